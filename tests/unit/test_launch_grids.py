"""Launch grids at sizes past CUDA's gridDim.y / gridDim.z limit (65535 blocks), worked out without a GPU.

TileLang kernels: the extents of blockIdx.y and blockIdx.z in the built prim_func (T.Kernel's second and third
extents), with its dynamic sizes set to large but plausible values. Triton flash attention: the launchers' grid_of.
(The kernels' folded indices are exercised at small sizes by the interpreter tests of each op; tests/gpu/
test_grid_limits.py runs the large shapes.)
"""

import pytest
import torch

MAX_GRID_YZ = 65535


def block_extents(func, sizes: dict[str, int]) -> dict[str, int]:
    """{"blockIdx.x": extent, ...} of a TileLang prim_func, its dynamic variables set by name from sizes."""
    from tilelang import tvm
    from tvm import tirx

    extents = {}

    def visit(node):
        if isinstance(node, tirx.For) and node.thread_binding is not None:
            tag = node.thread_binding.thread_tag
            if tag.startswith("blockIdx"):
                extents[tag] = node.extent

    tirx.stmt_functor.post_order_visit(func.body, visit)
    analyzer = tvm.arith.Analyzer()

    def value(expr):
        found = []
        tirx.stmt_functor.post_order_visit(
            expr, lambda node: found.append(node) if isinstance(node, tirx.Var) else None
        )
        bound = tirx.stmt_functor.substitute(expr, {var: tirx.IntImm(var.dtype, sizes[var.name]) for var in found})
        return int(analyzer.simplify(bound))

    return {tag: value(expr) for tag, expr in extents.items()}


def built(entry):
    from runtime.accelerators.tilelang_common import device_info

    func = entry[1](device_info(None))
    return getattr(func, "func", func)  # Unchecked wraps the prim_func


def test_linear_tilelang_forward_puts_the_row_blocks_on_x():
    pytest.importorskip("runtime.accelerators.linear.tilelang", reason="tilelang 0.1.15 is not installed")
    from runtime.accelerators.linear import tilelang as kernels

    rows = 2**24  # 16M rows (batch 8192 x 2048 tokens): 131072 row blocks of 128
    for activation in (None, "gelu", "swiglu"):
        func = built(kernels.forward_entry(torch.bfloat16, 256, 64, activation, True, True))
        extents = block_extents(func, {"M": rows})
        assert extents["blockIdx.x"] == rows // 128, activation
        assert all(extents.get(axis, 1) <= MAX_GRID_YZ for axis in ("blockIdx.y", "blockIdx.z")), extents


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_silu_attention_tilelang_puts_sequences_and_heads_on_x(kernel):
    pytest.importorskip(
        "runtime.accelerators.silu_attention.tilelang_forward", reason="tilelang 0.1.15 is not installed"
    )
    from runtime.accelerators.silu_attention import tilelang_backward, tilelang_forward

    flags = (True, False, True, False, False)  # causal, no targets, position bias, no time bias, no dropout
    if kernel == "forward":
        entry = tilelang_forward.forward_entry(32, torch.bfloat16, *flags)
    else:
        entry = tilelang_backward.backward_entry(kernel, 32, torch.bfloat16, *flags)
    sequences, heads, blocks = 2**17, 8, 4  # 131072 sequences of up to 256 tokens
    sizes = {"n_offsets": sequences + 1, "heads": heads, "n_blocks": blocks}
    extents = block_extents(built(entry), sizes)
    assert extents["blockIdx.x"] == sequences * heads * blocks
    assert all(extents.get(axis, 1) <= MAX_GRID_YZ for axis in ("blockIdx.y", "blockIdx.z")), extents


@pytest.mark.parametrize("fold", [False, True], ids=["grid", "folded"])
@pytest.mark.parametrize("kernel", ["forward", "preprocess", "backward"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "packed"])
def test_flash_attention_tilelang_folds_blocks_heads_and_sequences_onto_x(kernel, varlen, fold):
    """Folded, every program is on x; otherwise (the launchers' choice up to 65535 heads and sequences) the grid is
    (blocks, heads, sequences), as fast as before the fold existed."""
    pytest.importorskip("runtime.accelerators.flash_attention.tilelang", reason="tilelang 0.1.15 is not installed")
    from runtime.accelerators.flash_attention import tilelang as kernels
    from runtime.accelerators.flash_attention.tilelang_configs import BWD_CONFIGS, FWD_CONFIGS, PREP_ROWS

    sequences, heads, kv_heads, length = 2**17 if fold else 2**10, 8, 2, 256  # a batch (or pack) of 256 tokens each
    packed = sequences * length
    sizes = dict(batch=sequences, heads=heads, kv_heads=kv_heads, q_len=length, k_len=length, kv_len=length)
    if varlen:  # q_len, k_len: the packed lengths; the block counts come from max_seqlen
        sizes.update(n_offsets=sequences + 1, q_len=packed, k_len=packed)
    if kernel == "forward":
        entry = kernels.forward_entry(64, torch.bfloat16, True, False, False, varlen=varlen, fold=fold)
        blocks, h = length // FWD_CONFIGS[64].block_m, heads
        sizes["q_blocks"] = blocks
    elif kernel == "preprocess":
        entry = kernels.preprocess_entry(64, torch.bfloat16, varlen=varlen, fold=fold)
        blocks, h = (packed if varlen else length) // PREP_ROWS, heads
        sequences = 1 if varlen else sequences  # varlen: one program per block of packed rows of one head
    else:
        entry = kernels.backward_entry(64, torch.bfloat16, True, False, False, varlen=varlen, fold=fold)
        blocks, h = length // BWD_CONFIGS[64].block_n, kv_heads
        sizes["k_blocks"] = blocks
    extents = block_extents(built(entry), sizes)
    if fold:
        assert extents == {"blockIdx.x": blocks * h * sequences}
    else:
        assert extents == {"blockIdx.x": blocks, "blockIdx.y": h, "blockIdx.z": sequences}


def test_tilelang_launch_past_grid_x_names_the_argument():
    pytest.importorskip("runtime.accelerators.flash_attention.tilelang", reason="tilelang 0.1.15 is not installed")
    from runtime.accelerators.flash_attention import tilelang as kernels

    with pytest.raises(ValueError, match="cu_seqlens_q: .* programs"):
        kernels._check_programs("cu_seqlens_q", 2**24, (2**16, 64, 16))  # 16M sequences x 1024 blocks x 16 heads
    kernels._check_programs("q", 2**17, (256, 64, 8))  # 4M programs: fine


def test_flash_attention_triton_grid_is_one_dimensional():
    from runtime.accelerators.flash_attention.triton_launch_args import grid_of

    grid = grid_of(16, 16384 * 8)  # batch 16384 x 8 heads, 16 query blocks each
    assert grid == (16 * 16384 * 8,) and grid[0] < 2**31
