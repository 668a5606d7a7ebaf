"""gated_delta_rule's TileLang kernels, compile-only: lowered and compiled for sm_90a with the local nvcc.

One representative specialisation per kernel (recurrent, chunk prepare, the forward's storing walk and output, the
walk computing the output itself, and the chunked backward's state store, local dU, reverse walk and the two
chunk-gradient kernels; the chunk kernels at K=128, where their products are wgmma); the GPU tier checks the numbers. The chunk kernels at K=128 are also checked to fit
sm_90's shared memory (a launch-time failure that compiling does not catch). Also what needs no GPU: the tilelang backend's reasons and the varlen chunk table.
"""

import re

import pytest
import torch

from conftest import SM90A, requires_nvcc

gt = pytest.importorskip(
    "runtime.accelerators.gated_delta_rule.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)
gb = pytest.importorskip("runtime.accelerators.gated_delta_rule.tilelang_backward", exc_type=ImportError)

from runtime.accelerators.gated_delta_rule import SPEC  # noqa: E402

# each kernel once, at widths and flags that exercise its special paths: K=V=16 (two-warp state
# gemms), varlen with l2norm, initial and final state, g in fp32 beside bf16 q/k/v
KERNELS = {
    "recurrent-K128-V64-bf16-varlen-l2norm-state": lambda: gt.recurrent_entry(
        128, 64, torch.bfloat16, torch.float32, torch.bfloat16, True, True, True, True
    ),
    "prepare-K16-V16-f16-varlen-l2norm": lambda: gt.prepare_entry(
        16, 16, torch.float16, torch.float16, torch.float16, True, True
    ),
    "state-output-K16-V16-bf16-state": lambda: gt.state_output_entry(16, 16, torch.bfloat16, True, True, False, False),
    # fp16 q and k converted to bf16 on load, l2-normalised in the walk
    "state-output-K64-V32-f16-l2norm": lambda: gt.state_output_entry(64, 32, torch.float16, False, True, True, False),
    # the forward at the widths of the long-sequence benchmark: wgmma products, the walk warp-specialised
    "prepare-K128-V128-bf16-varlen-l2norm": lambda: gt.prepare_entry(
        128, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True
    ),
    "state-output-K128-V128-bf16-varlen-l2norm-state": lambda: gt.state_output_entry(
        128, 128, torch.bfloat16, True, True, True, True
    ),
    # the forward's storing walk for bf16 inputs (every tile through the pipeline)
    "store-walk-K16-V16-bf16-varlen-l2norm-state": lambda: gt.storing_walk_entry(
        16, 16, torch.bfloat16, True, True, True, True
    ),
    "store-walk-K128-V128-bf16-varlen-l2norm-state": lambda: gt.storing_walk_entry(
        128, 128, torch.bfloat16, True, True, True, True
    ),
    "store-walk-K128-V128-bf16-l2norm": lambda: gt.storing_walk_entry(
        128, 128, torch.bfloat16, False, False, True, False
    ),
    # the output of every chunk from the stored states and U (the forward's default after the storing walk)
    "output-K16-V16-f16": lambda: gt.output_entry(16, 16, torch.float16, False, False),
    "output-K128-V128-bf16-varlen-l2norm": lambda: gt.output_entry(128, 128, torch.bfloat16, True, True),
    # the storing walk of fp16 inputs, forward and backward (state_output_kernel storing states and U, no output)
    "state-store-K16-V16-f16-varlen-l2norm-state": lambda: gt.state_output_entry(
        16, 16, torch.float16, True, False, True, True, write_output=False, store_states=True
    ),
    "state-store-K128-V128-f16-varlen-l2norm-state": lambda: gt.state_output_entry(
        128, 128, torch.float16, True, False, True, True, write_output=False, store_states=True
    ),
    # the backward's own kernels at K=128 (wgmma, shared-memory fit) and at K=16 (two-warp and mma.sync products)
    "local-grad-K128-V128-bf16-varlen-l2norm": lambda: gb.local_grad_entry(128, 128, torch.bfloat16, True, True),
    "state-grad-K128-V128-bf16-varlen-state": lambda: gb.state_grad_entry(128, 128, torch.bfloat16, True, True, True),
    "state-grad-K16-V16-f16-state": lambda: gb.state_grad_entry(16, 16, torch.float16, True, True, False),
    "grad-qk-K128-V128-bf16-varlen-l2norm": lambda: gb.grad_qk_entry(128, 128, torch.bfloat16, True, True),
    "grad-qk-K16-V16-f16": lambda: gb.grad_qk_entry(16, 16, torch.float16, False, False),
    "grad-wy-K128-V128-bf16-varlen-l2norm": lambda: gb.grad_wy_entry(
        128, 128, torch.bfloat16, torch.bfloat16, torch.float32, True, True
    ),
}
# the tensors each kernel must store to (one missing from the source: that store was compiled away)
STORES = {
    "state-output": ("O", "HT"),
    "state-store": ("States", "Corrections"),
    "store-walk": ("States", "Corrections"),
    "output": ("O",),
    "local-grad": ("DU", "QFactor", "KFactor"),
    "state-grad": ("DStates", "DU", "DH0"),
    "grad-qk": ("DQ", "DKPart", "DW", "DGamma"),
    "grad-wy": ("DK", "DV", "DBeta", "DG"),
}
SM90_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may use on sm_90


def compile_entry(entry):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    key, build = entry
    return tilelang.compile(build(device_info(None)), target=SM90A)


def dynamic_shared_bytes(entry) -> int:
    """The dynamic shared memory the lowered kernel asks for (TileLang's own lowering, under the sm_90a target)."""
    from tilelang import tvm
    from tilelang.engine.lower import lower

    from runtime.accelerators.tilelang_common import device_info

    key, build = entry
    with tvm.target.Target(SM90A):
        artifact = lower(build(device_info(None)), target=SM90A)
    (func,) = artifact.device_mod.functions.values()
    return int(func.attrs.get("dyn_shared_memory_buf", 0))


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm90a(name):
    source = compile_entry(KERNELS[name]()).get_kernel_source()
    assert "__global__" in source
    # rows, heads and the sequence count are runtime arguments: one kernel serves every shape
    for dynamic in ("rows", "v_heads"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "varlen" in name:
        assert "Cu[" in source, f"{name}: the varlen boundaries should be read on the device"
    if not name.startswith("recurrent"):
        assert "mma_sync" in source or "wgmma" in source, f"{name}: the chunk matmuls should use tensor cores"
    if "K128" in name and not name.startswith("recurrent"):
        assert "wgmma" in source, f"{name}: the 16-bit products should be warpgroup MMAs on sm_90a"
    for kernel, stores in STORES.items():
        if name.startswith(kernel):
            for tensor in stores:
                assert accessed(tensor, source), f"{name}: {tensor} should be stored"
    if name.startswith("state-store"):
        assert not accessed("O", source), f"{name}: the backward's state walk writes no output"


def accessed(tensor: str, source: str) -> bool:
    """Whether the CUDA source indexes `tensor` (`T[...]`, or `(T + ...)` in a vector access)."""
    return re.search(rf"\b{tensor}(\[| \+ )", source) is not None


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in KERNELS if "K128" in name and not name.startswith("recurrent")])
def test_chunk_kernels_at_k128_fit_sm90_shared_memory(name):
    used = dynamic_shared_bytes(KERNELS[name]())
    assert 0 < used <= SM90_SHARED_BYTES, f"{name}: {used} bytes of shared memory, sm_90 has {SM90_SHARED_BYTES}"


def _inputs(dtype, K=16, V=16):
    q = torch.randn(1, 5, 1, K).to(dtype)
    v = torch.randn(1, 5, 1, V).to(dtype)
    return dict(q=q, v=v, g=torch.randn(1, 5, 1), beta=torch.rand(1, 5, 1), initial_state=None)


def test_tilelang_reasons():
    bf16, fp32 = _inputs(torch.bfloat16), _inputs(torch.float32)
    assert SPEC.reasons("tilelang", **bf16, mode="chunk", needs_grad=False) == []
    assert SPEC.reasons("tilelang", **bf16, mode="recurrent", needs_grad=False) == []
    assert SPEC.reasons("tilelang", **fp32, mode="recurrent", needs_grad=False) == []  # exact fp32 math
    (reason,) = SPEC.reasons("tilelang", **fp32, mode="chunk", needs_grad=False)
    assert "tf32" in reason and "float32" in reason
    assert SPEC.reasons("tilelang", **bf16, mode="chunk", needs_grad=True) == []  # the chunked backward
    (reason,) = SPEC.reasons("tilelang", **fp32, mode="chunk", needs_grad=True)
    assert "tf32" in reason
    (reason,) = SPEC.reasons("tilelang", **bf16, mode="recurrent", needs_grad=True)
    assert "recurrent kernels are forward-only" in reason
    (reason,) = SPEC.reasons("tilelang", **_inputs(torch.bfloat16, K=24), mode="recurrent", needs_grad=False)
    assert "K (the q/k head dim) is 24" in reason


@pytest.mark.parametrize(
    "dtype, walk", [(torch.bfloat16, "gdr_chunk_state_store"), (torch.float16, "gdr_chunk_state_output")]
)
def test_forward_and_backward_store_states_with_one_walk_per_dtype(dtype, walk):
    """The pipelined storing walk takes bf16 only: fp16 inputs get state_output_kernel's walk (store_states), in the
    forward and in the backward, which walks again."""
    flags = (True, False, True, True)
    assert gt.storing_walk_entry(64, 32, dtype, *flags)[0][0] == walk
    other = {"gdr_chunk_state_store", "gdr_chunk_state_output"} - {walk}
    forward = [key[0] for key, _ in gt.entries(64, 32, dtype, torch.float32, dtype, *flags)]
    backward = [key[0] for key, _ in gb.backward_entries(64, 32, dtype, torch.float32, dtype, True, False, True, True)]
    for keys in (forward, backward):
        assert walk in keys and not other & set(keys)


def test_chunk_table_numbers_chunks_sequence_by_sequence():
    """chunk_forward's table (the kernel in varlen.py, on the int32 boundaries the TileLang kernels read)."""
    from runtime.accelerators.gated_delta_rule.varlen import chunk_table

    cu = torch.tensor([0, 20, 63, 63, 200])  # an empty sequence, one over two chunks
    table, first = chunk_table(gt._device_cu(cu, cu.device), cu, gt.BT)
    assert table.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert first.tolist() == [0, 1, 2, 2]
