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
gs = pytest.importorskip("runtime.accelerators.gated_delta_rule.tilelang_split", exc_type=ImportError)

from runtime.accelerators.gated_delta_rule import SPEC  # noqa: E402
from runtime.accelerators.gated_delta_rule.split import split_length  # noqa: E402
from tilelang_launch_check import patch_launchers  # noqa: E402

# each kernel once, at widths and flags that exercise its special paths: K=V=16 (two-warp state
# gemms), varlen with l2norm, initial and final state, g in fp32 beside bf16 q/k/v
KERNELS = {
    "recurrent-K128-V64-bf16-varlen-l2norm-state": lambda: gt.recurrent_entry(
        128, 64, torch.bfloat16, torch.float32, torch.bfloat16, True, True, True, True
    ),
    "prepare-K16-V16-f16-varlen-l2norm": lambda: gt.prepare_entry(
        16, 16, torch.float16, torch.float16, torch.float16, True, True
    ),
    # the forward at the widths of the long-sequence benchmark: wgmma products, the walk warp-specialised
    "prepare-K128-V128-bf16-varlen-l2norm": lambda: gt.prepare_entry(
        128, 128, torch.bfloat16, torch.float32, torch.bfloat16, True, True
    ),
    # the forward's storing walk for bf16 inputs (every tile through the pipeline)
    "store-walk-K16-V16-bf16-varlen-l2norm-state": lambda: gs.state_store_entry(16, 16, True, True, True, True),
    "store-walk-K128-V128-bf16-varlen-l2norm-state": lambda: gs.state_store_entry(128, 128, True, True, True, True),
    "store-walk-K128-V128-bf16-l2norm": lambda: gs.state_store_entry(128, 128, False, False, True, False),
    # the context-parallel split: the segments' maps (transition walk) and offsets (end state only), the chain of
    # the segments, and the storing walk from the states entering them (initial state, no final one)
    "map-walk-K16-V16-bf16-varlen": lambda: gs.state_store_entry(
        16, 16, False, True, False, True, store_states=False, transition=True
    ),
    "map-walk-K16-V16-bf16-l2norm": lambda: gs.state_store_entry(
        16, 16, False, True, True, False, store_states=False, transition=True
    ),
    "map-walk-K128-V128-bf16-varlen-l2norm": lambda: gs.state_store_entry(
        128, 128, False, True, True, True, store_states=False, transition=True
    ),
    "end-walk-K16-V16-bf16-varlen-l2norm": lambda: gs.state_store_entry(
        16, 16, False, True, True, True, store_states=False
    ),
    "end-walk-K128-V128-bf16-varlen": lambda: gs.state_store_entry(
        128, 128, False, True, False, True, store_states=False
    ),
    "end-walk-K128-V128-bf16-l2norm": lambda: gs.state_store_entry(
        128, 128, False, True, True, False, store_states=False
    ),
    "store-walk-K16-V16-bf16-varlen-initial": lambda: gs.state_store_entry(16, 16, True, False, False, True),
    "store-walk-K128-V128-bf16-varlen-l2norm-initial": lambda: gs.state_store_entry(128, 128, True, False, True, True),
    "chain-K16-V16": lambda: gs.chain_entry(16, 16, False, False),
    "chain-K16-V16-state-final": lambda: gs.chain_entry(16, 16, True, True),
    "chain-K128-V128-final": lambda: gs.chain_entry(128, 128, False, True),
    "chain-K128-V128-state": lambda: gs.chain_entry(128, 128, True, False),
    "chain-K128-V128-state-final": lambda: gs.chain_entry(128, 128, True, True),
    # the output of every chunk from the stored states and U (the forward's default after the storing walk)
    "output-K16-V16-f16": lambda: gt.output_entry(16, 16, torch.float16, False, False),
    "output-K128-V128-bf16-varlen-l2norm": lambda: gt.output_entry(128, 128, torch.bfloat16, True, True),
    # the storing walk of fp16 inputs, forward and backward (fp16 k converted to bf16 on load, l2-normalised in the
    # walk)
    "state-store-K16-V16-f16-varlen-l2norm-state": lambda: gt.storing_walk_entry(
        16, 16, torch.float16, True, False, True, True
    ),
    "state-store-K64-V32-f16-l2norm": lambda: gt.storing_walk_entry(64, 32, torch.float16, False, True, True, False),
    "state-store-K128-V128-f16-varlen-l2norm-state": lambda: gt.storing_walk_entry(
        128, 128, torch.float16, True, False, True, True
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
    "state-store": ("States", "Corrections"),
    "store-walk": ("States", "Corrections"),
    "map-walk": ("HT",),
    "end-walk": ("HT",),
    "chain": ("Entering",),
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
    # rows (segments for the chain), heads and the sequence count are runtime arguments: one kernel serves every shape
    for dynamic in ("n_segments" if name.startswith("chain") else "rows", "v_heads"):
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if "varlen" in name or name.startswith("chain"):
        assert "Cu[" in source, f"{name}: the varlen boundaries should be read on the device"
    if not name.startswith("recurrent"):
        assert "mma_sync" in source or "wgmma" in source, f"{name}: the chunk matmuls should use tensor cores"
    if "K128" in name and not name.startswith(("recurrent", "chain")):  # the chain's product is on fp32 operands
        assert "wgmma" in source, f"{name}: the 16-bit products should be warpgroup MMAs on sm_90a"
    for kernel, stores in STORES.items():
        if name.startswith(kernel):
            for tensor in stores:
                assert accessed(tensor, source), f"{name}: {tensor} should be stored"
    if name.startswith("state-store"):
        assert not accessed("O", source), f"{name}: the backward's state walk writes no output"
    if name.startswith(("map-walk", "end-walk")):
        for tensor in ("States", "Corrections"):
            assert not accessed(tensor, source), f"{name}: the split's first walks store only the end state"
    if name.startswith("map-walk"):
        assert not accessed("U", source), f"{name}: the transition walk takes u as zero"
    if name.startswith("chain"):
        assert accessed("HT", source) == ("final" in name), f"{name}: the final state is stored when asked only"


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


@requires_nvcc
@pytest.mark.parametrize("kernel", ["gdr_chunk_local_grad", "gdr_chunk_grad_qk", "gdr_chunk_grad_wy"])
def test_per_chunk_backward_kernels_bind_their_scalars_once(kernel, tmp_path):
    """The (chunk, value head) programs' q/k head, first row and sequence end are bound once: as expressions of the
    block index TileLang recomputes them at every access, each division by a dynamic size a call of a 64-bit division
    routine (55 calls in local_grad's SASS at K = 128)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    import tilelang_resources as resources

    if resources.nvdisasm_tool() is None:
        pytest.skip("no nvdisasm (on PATH or bundled with Triton)")
    entries = gb.backward_entries(128, 128, torch.bfloat16, torch.float32, torch.bfloat16, False, False, True, False)
    (entry,) = [entry for entry in entries if entry[0][0] == kernel]
    report, sass = resources.compile_source(compile_entry(entry).get_kernel_source(), tmp_path)
    assert resources.profile(report, sass)["calls"] == 0


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
    "dtype, walk", [(torch.bfloat16, "gdr_chunk_state_store"), (torch.float16, "gdr_chunk_state_store_fp16")]
)
def test_forward_and_backward_store_states_with_one_walk_per_dtype(dtype, walk):
    """The pipelined storing walk takes bf16 only: fp16 inputs get fp16_state_store_kernel's walk, in the forward and
    in the backward, which walks again."""
    flags = (True, False, True, True)
    assert gt.storing_walk_entry(64, 32, dtype, *flags)[0][0] == walk
    other = {"gdr_chunk_state_store", "gdr_chunk_state_store_fp16"} - {walk}
    forward = [key[0] for key, _ in gt.entries(64, 32, dtype, torch.float32, dtype, *flags)]
    backward = [key[0] for key, _ in gb.backward_entries(64, 32, dtype, torch.float32, dtype, True, False, True, True)]
    for keys in (forward, backward):
        assert walk in keys and not other & set(keys)


@pytest.mark.parametrize(
    "dtype, segment_chunks",
    [(torch.bfloat16, 0), (torch.bfloat16, 2), (torch.float16, 0)],
    ids=["bf16-whole-walk", "bf16-split", "fp16-whole-walk"],
)
def test_every_launch_passes_the_dtypes_its_kernel_declares(monkeypatch, dtype, segment_chunks):
    """The forward (the whole walk, and the context-parallel split in segments of two chunks for bf16) and the
    backward, K = 64, V = 32, grouped value heads, an initial and a final state, l2norm: every tensor each launch
    passes has the dtype its kernel declares."""
    launched = patch_launchers(monkeypatch)
    B, T_, H, HV, K, V = 2, 300, 1, 2, 64, 32
    q, k = torch.randn(B, T_, H, K, dtype=dtype), torch.randn(B, T_, H, K, dtype=dtype)
    v, beta = torch.randn(B, T_, HV, V, dtype=dtype), torch.rand(B, T_, HV, dtype=dtype)
    g, h0 = -torch.rand(B, T_, HV, dtype=dtype), torch.randn(B, HV, K, V)
    forward = gt.chunk_forward(q, k, v, g, beta, K**-0.5, h0, True, True, None, segment_chunks=segment_chunks)
    if segment_chunks and dtype == torch.bfloat16:
        assert "gdr_chunk_transition" in launched or launched.count("gdr_chunk_state_store") >= 3
    o, final = forward[:2]
    gb.chunk_backward(torch.randn_like(o), torch.randn_like(final), q, k, v, g, beta, K**-0.5, h0, True, True, None,
                      *forward)  # fmt: skip


def test_chunk_table_numbers_chunks_sequence_by_sequence():
    """chunk_forward's table (the kernel in varlen.py, on the int32 boundaries the TileLang kernels read)."""
    from runtime.accelerators.gated_delta_rule.varlen import chunk_table

    cu = torch.tensor([0, 20, 63, 63, 200])  # an empty sequence, one over two chunks
    table, first = chunk_table(gt._device_cu(cu, cu.device), cu, gt.BT)
    assert table.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1], [3, 2]]
    assert first.tolist() == [0, 1, 2, 2]


# --------------------------------------------------------------------------- the context-parallel split

SPLIT_CU = torch.tensor([0, 10, 10, 200, 330, 1000])  # shorter than a segment, empty, 3 + 3 + 11 chunks


def _segments(B, T, cu, segment_chunks, HV=2, K=16, V=16):
    chunks = gt.Chunks.of(B, T, cu, torch.device("cpu"))
    n = B if cu is None else cu.numel() - 1
    return gs.split_segments(chunks, B, T, n, HV, K, V, cu, torch.device("cpu"), segment_chunks)


def test_varlen_segments_are_numbered_as_sequences_of_their_own():
    """Segments of 2 chunks (128 tokens): a sequence shorter than one is one segment, an empty one has none."""
    segments = _segments(1, 1000, SPLIT_CU, 2)
    assert segments.bounds.dtype == torch.int32  # as the TileLang kernels read boundaries
    assert segments.bounds.tolist() == [0, 10, 138, 200, 328, 330, 458, 586, 714, 842, 970, 1000]
    # the sequences' first chunks are 0, 1, 1, 4 and 7; a segment's first chunk is 2 past the one before it
    assert segments.first_chunks.tolist() == [0, 1, 3, 4, 6, 7, 9, 11, 13, 15, 17]
    assert segments.first.tolist() == [0, 1, 1, 3, 5]
    assert segments.cu.tolist() == SPLIT_CU.tolist()
    assert (segments.count, segments.length, segments.tokens) == (11, 2, 128)


def test_fixed_length_segments_restart_at_every_sequence():
    segments = _segments(2, 200, None, 2)  # 4 chunks per sequence: two segments each, the second one 72 tokens
    assert segments.bounds.tolist() == [0, 128, 200, 328, 400]
    assert segments.first_chunks.tolist() == [0, 2, 4, 6]
    assert segments.first.tolist() == [0, 2]
    assert segments.cu.tolist() == [0, 200, 400]


def test_the_split_is_forced_or_left_to_the_occupancy_rule():
    assert _segments(1, 1000, SPLIT_CU, 0) is None  # never split
    assert _segments(1, 1000, SPLIT_CU, None) is None  # the rule splits on CUDA devices only
    assert _segments(2, 200, None, 9).bounds.tolist() == [0, 200, 400]  # longer than a sequence: one segment each
    # the packed benchmark shape: 64 storing-walk programs (32 value heads x 2 V blocks of 64) on an H100's 132 SMs
    programs = gs.storing_walk_programs(1, 32, 128, 128)
    assert programs == 64
    assert split_length(1, 512, 512, programs, 132) == 128


def test_bad_segment_chunks_are_refused():
    x = _inputs(torch.bfloat16)
    args = (x["q"], x["q"], x["v"], x["g"], x["beta"], 1.0, None, False, False, None)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="segment_chunks: expected None or an int >= 0"):
            gt.chunk_forward(*args, segment_chunks=bad)
    with pytest.raises(ValueError, match="bf16 inputs only"):
        fp16 = _inputs(torch.float16)
        gt.chunk_forward(fp16["q"], fp16["q"], fp16["v"], fp16["g"], fp16["beta"], 1.0, None, False, False, None,
                         segment_chunks=2)  # fmt: skip
    with pytest.raises(ValueError, match="transition walk takes V = K"):
        gs.state_store_entry(16, 32, False, True, False, True, store_states=False, transition=True)


def _split_model(inputs, segments, scale, l2norm):
    """The split in float64 on the recurrence itself (the kernels' chunked form aside): per segment its map M (the
    steps' linear part walked from the identity) and offset b (the steps walked from zero), the chain per sequence
    (x <- M x + b from the initial state), then every segment walked from the state entering it. (o, final state)."""
    from runtime.accelerators.gated_delta_rule import reference

    x = {n: t.double() for n, t in inputs.items()}
    qs, ks, vs, gs_, bs = reference._prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, l2norm)
    B, T, HV, K = ks.shape
    qs, ks, vs, gs_, bs = (t.reshape(1, B * T, *t.shape[2:]) for t in (qs, ks, vs, gs_, bs))
    bounds = segments.bounds.tolist()
    eye = torch.eye(K, dtype=torch.float64).expand(1, HV, K, K)

    def walk(s, state, values):
        a, b = bounds[s], bounds[s + 1]
        return reference._recurrent(qs[:, a:b], ks[:, a:b], values[:, a:b], gs_[:, a:b], bs[:, a:b], state)

    maps = [walk(s, eye, torch.zeros_like(ks))[1] for s in range(segments.count)]
    offsets = [walk(s, torch.zeros(1, HV, K, vs.shape[-1], dtype=torch.float64), vs)[1] for s in range(segments.count)]
    first, cu = segments.first.tolist() + [segments.count], segments.cu.tolist()
    entering, finals = [], []
    for n in range(len(cu) - 1):
        state = x["initial_state"][n : n + 1]
        for s in range(first[n], first[n + 1]):
            entering.append(state)
            state = torch.einsum("nhij,nhjv->nhiv", maps[s], state) + offsets[s]
        finals.append(state)
    o = torch.cat([walk(s, entering[s], vs)[0] for s in range(segments.count)], 1)
    return o.reshape(B, T, HV, -1), torch.cat(finals, 0)


@pytest.mark.parametrize(
    "B, T, cu, segment_chunks, l2norm",
    [(1, 1000, SPLIT_CU, 2, True), (2, 200, None, 2, False), (1, 1000, SPLIT_CU, 5, False)],
    ids=["varlen-empty-and-short-seg2-l2norm", "B2-T200-seg2", "varlen-seg5"],
)
def test_the_split_in_float64_is_the_recurrence(B, T, cu, segment_chunks, l2norm):
    """The split's math (maps, offsets, the chain) on its own tables equals the float64 recurrence: weak decay, so
    that a wrong chain would show (the default decay forgets the state entering a segment)."""
    from runtime.accelerators.gated_delta_rule.reference import recurrent_gated_delta_rule_reference

    HV, K, V = 2, 4, 3  # one q/k head for two value heads
    n = B if cu is None else cu.numel() - 1
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "q": torch.randn(B, T, 1, K, generator=gen),
        "k": torch.nn.functional.normalize(torch.randn(B, T, 1, K, generator=gen), dim=-1),
        "v": torch.randn(B, T, HV, V, generator=gen),
        "g": torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen) + 7.0),
        "beta": torch.rand(B, T, HV, generator=gen),
        "initial_state": torch.randn(n, HV, K, V, generator=gen),
    }
    segments = _segments(B, T, cu, segment_chunks, HV, K, V)
    o, final = _split_model(inputs, segments, 0.5, l2norm)
    x = {name: t.double() for name, t in inputs.items()}
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"], True, l2norm, cu
    )
    assert torch.allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    assert torch.allclose(final, final_ref, rtol=1e-10, atol=1e-10)
