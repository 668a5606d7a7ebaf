"""Gated delta rule on the GPU, the TileLang backend: both forwards at every case, the chunked forward and backward
at the half-precision cases (its chunked kernels multiply on bf16 operands, so fp32 inputs are a not-supported reason
there), against the float64 recurrence with test_gated_delta_rule.py's bounds; and, on both kernel backends, strong
decay in a partial chunk and packed sequences under CUDA graphs and across streams."""

import pytest
import torch

from gdr_checks import (
    BOUND,
    CASES,
    GRAD_BOUND,
    call,
    case_options,
    check_chunked_forward_and_every_gradient,
    check_forward_matches_the_float64_recurrence,
    make_inputs,
    reference,
    triton_chunk,
)
from runtime.accelerators import use_accelerators
from runtime.accelerators.backends import BackendFallbackWarning
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from runtime.accelerators.gated_delta_rule import varlen as gdr_varlen
from runtime.accelerators.gated_delta_rule.reference import recurrent_gated_delta_rule_reference
from runtime.accelerators.gated_delta_rule.triton import Tuning
from runtime.accelerators.testing import assert_close

# --------------------------------------------------------------------------- tilelang

# the chunked TileLang kernels multiply on bf16 operands: fp32 inputs are a not-supported reason there
TILELANG_CHUNK_CASES = [name for name, case in CASES.items() if case[6] != torch.float32]
TILELANG_CASES = [("recurrent", name) for name in CASES] + [("chunk", name) for name in TILELANG_CHUNK_CASES]


@pytest.fixture(scope="module")
def tilelang_compiled():
    """Every TileLang kernel of the cases (forward, and the chunked backward for the half cases), compiled in
    parallel once: compiled one by one on first use they would take most of the GPU suite's time."""
    from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
    from runtime.accelerators.tilelang_common import precompile

    entries = []
    for name in CASES:
        (B, T, H, HV, K, V, dtype, state, sequences), options = case_options(name)
        flags = (state, options.get("output_final_state", False), options.get("use_qk_l2norm_in_kernel", False),
                 "cu_seqlens" in options)  # fmt: skip
        if name in TILELANG_CHUNK_CASES:
            entries += gdr_tilelang.entries(K, V, dtype, dtype, dtype, *flags, backward=True)
        else:
            entries.append(gdr_tilelang.recurrent_entry(K, V, dtype, dtype, dtype, *flags))
    precompile(entries, torch.device("cuda"))


@pytest.mark.parametrize("function, name", TILELANG_CASES)
def test_tilelang_forward_matches_the_float64_recurrence(function, name, tilelang_compiled):
    check_forward_matches_the_float64_recurrence(function, name, "tilelang")


@pytest.mark.parametrize("name", TILELANG_CHUNK_CASES)
def test_tilelang_chunked_forward_and_every_gradient(name, tilelang_compiled):
    """As the Triton test, with the same bounds (bf16/fp16: dq/dk/dv/d(initial_state) 8e-3, dg/dbeta 2e-2)."""
    check_chunked_forward_and_every_gradient(name, "tilelang")


@pytest.mark.parametrize(
    "backend, grad_wy, half_backward",
    [("triton", "single", False), ("triton", "fused", False), ("triton", "single", True), ("triton", "fused", True),
     ("tilelang", None, False)],
)  # fmt: skip
def test_strong_decay_in_a_partial_chunk_keeps_gradients_finite(backend, grad_wy, half_backward):
    """g = -5 everywhere, T = 100: rows past the end of the last chunk must not turn exp overflow into NaN (the Triton
    backward with each variant of its step 5, Tuning.grad_wy, its products on fp32 or bf16 operands)."""
    inputs = make_inputs(1, 100, 1, 1, 16, 16, torch.bfloat16)
    inputs["g"] = torch.full_like(inputs["g"], -5.0)
    inputs = {n: t.requires_grad_() for n, t in inputs.items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    if backend == "triton":
        o, _ = triton_chunk(inputs, Tuning(grad_wy=grad_wy, half_backward=half_backward))
    else:
        with use_accelerators(fallback="error"):
            o, _ = call(chunk_gated_delta_rule, inputs, backend)
    ref, _ = recurrent_gated_delta_rule_reference(
        *(twin[n] for n in ("q", "k", "v", "g", "beta")), None, None, False, False, None
    )
    assert_close("o", o, ref, BOUND[torch.bfloat16])
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(o, list(inputs.values()), grad_out.to(o.dtype))
    for n, grad, ref_grad in zip(inputs, grads, torch.autograd.grad(ref, list(twin.values()), grad_out)):
        assert_close(f"d{n}", grad, ref_grad, GRAD_BOUND[f"d{n}"])


def test_tilelang_chunked_kernels_refuse_fp32_and_recurrent_gradients_fall_back():
    from runtime.accelerators.backends import BackendUnavailableError

    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match="tf32"):
        call(chunk_gated_delta_rule, make_inputs(1, 8, 1, 1, 16, 16, torch.float32), "tilelang")
    inputs = {n: t.requires_grad_() for n, t in make_inputs(1, 8, 1, 1, 16, 16, torch.bfloat16).items()}
    with pytest.warns(BackendFallbackWarning, match="forward-only"):
        o, _ = call(fused_recurrent_gated_delta_rule, inputs, "tilelang")
    o.float().sum().backward()
    assert inputs["q"].grad is not None


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_varlen_forward_and_backward_replay_in_a_cuda_graph(backend, request):
    """Packed sequences with host boundaries under CUDA-graph capture: the boundaries' device copy made by the warm-up
    call serves the capture (a copy from the host is refused there), and a replay with new inputs copied in gives the
    eager results for them bit for bit (same kernels), into outputs spoilt beforehand."""
    if backend == "tilelang":
        request.getfixturevalue("tilelang_compiled")
    (B, T, H, HV, K, V, dtype, state, sequences), options = case_options("varlen-K128-bf16-GVA-state")
    inputs = {n: x.requires_grad_() for n, x in make_inputs(B, T, H, HV, K, V, dtype, state, sequences).items()}
    grad_o = torch.randn(B, T, HV, V, device="cuda", dtype=dtype)

    def step():
        o, final = call(chunk_gated_delta_rule, inputs, backend, **options)
        return (o, final, *torch.autograd.grad(o, list(inputs.values()), grad_o))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), use_accelerators(fallback="error"):
        step()  # the warm-up (compiles, and makes the boundaries' device copy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), use_accelerators(fallback="error"):
        captured = step()
    # new inputs, and the outputs spoilt, so that only kernels the replay runs can give the eager results
    with torch.no_grad():
        for name, x in make_inputs(B, T, H, HV, K, V, dtype, state, sequences, seed=1).items():
            inputs[name].copy_(x)
    with use_accelerators(fallback="error"):
        expected = [t.clone() for t in step()]
    for t in captured:
        t.detach().fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(["o", "final_state", *(f"d{n}" for n in inputs)], captured, expected):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_varlen_boundaries_copied_on_a_busy_stream_serve_a_call_on_another(backend, request, monkeypatch):
    """The device copy of host boundaries is made once, asynchronously on the stream of the call that made it; a call
    with the same boundaries on another stream must wait for it. The first stream is kept busy, so that the copy lands
    late: the second call still gives the results of a call with no copy pending."""
    if backend == "tilelang":
        request.getfixturevalue("tilelang_compiled")
    (B, T, H, HV, K, V, dtype, state, sequences), options = case_options("varlen-K128-bf16-GVA-state")
    inputs = make_inputs(B, T, H, HV, K, V, dtype, state, sequences)
    with use_accelerators(fallback="error"), torch.no_grad():
        expected = call(chunk_gated_delta_rule, inputs, backend, **options)
        monkeypatch.setattr(gdr_varlen.DEVICE_COPIES, "copies", type(gdr_varlen.DEVICE_COPIES.copies)())  # no copy yet
        busy, other = torch.cuda.Stream(), torch.cuda.Stream()
        busy.wait_stream(torch.cuda.current_stream())
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(busy):
            torch.cuda._sleep(1_000_000_000)  # about half a second: the copy waits behind it
            call(chunk_gated_delta_rule, inputs, backend, **options)
        with torch.cuda.stream(other):
            got = call(chunk_gated_delta_rule, inputs, backend, **options)
    torch.cuda.synchronize()
    for name, g, want in zip(["o", "final_state"], got, expected):
        assert torch.equal(g, want), name


# --------------------------------------------------------------------------- context-parallel split (tilelang)

# Weak decay (about e^-0.2 to e^-0.4 over a segment): with the default one a segment forgets the state it was entered
# with below bf16 rounding, and a wrong chain of the segment maps would go unseen.
SPLIT_DECAY_SHIFT = 7.0
SPLIT_CASES = {  # name: (B, T, H, HV, K, V, initial state, segment_chunks, options)
    "B2-T1000-K128-GVA-l2norm-state-final-seg3": (2, 1000, 1, 2, 128, 128, True, 3,
                                                  dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    # uneven lengths: shorter than a segment, empty, and segments whose last one is partial
    "varlen-K64-GVA-state-final-seg2": (1, 1900, 2, 4, 64, 64, True, 2,
                                        dict(cu_seqlens=torch.tensor([0, 37, 37, 700, 1000, 1900]),
                                             output_final_state=True)),
    "B3-T300-K16-final-seg1": (3, 300, 2, 2, 16, 16, False, 1, dict(output_final_state=True)),  # a segment a chunk
    # V != K: [K, K] maps beside [K, V] offsets and states
    "varlen-K128-V64-l2norm-seg4": (1, 2000, 1, 1, 128, 64, False, 4,
                                    dict(cu_seqlens=torch.tensor([0, 1300, 2000]), use_qk_l2norm_in_kernel=True)),
}  # fmt: skip


@pytest.fixture(scope="module")
def split_compiled():
    """The chunked forward's kernels of the split cases, whole and split, compiled in parallel once."""
    from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
    from runtime.accelerators.gated_delta_rule import tilelang_split
    from runtime.accelerators.tilelang_common import precompile

    entries, bf16 = [], torch.bfloat16
    for *_, K, V, state, _, options in SPLIT_CASES.values():
        final = options.get("output_final_state", False)
        l2norm, varlen = options.get("use_qk_l2norm_in_kernel", False), "cu_seqlens" in options
        entries += [
            gdr_tilelang.prepare_entry(K, V, bf16, bf16, bf16, l2norm, varlen),
            gdr_tilelang.storing_walk_entry(K, V, bf16, state, final, l2norm, varlen),
            gdr_tilelang.output_entry(K, V, bf16, l2norm, varlen),
            *tilelang_split.split_entries(K, V, state, final, l2norm),
        ]
    precompile(entries, torch.device("cuda"))


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_tilelang_split_matches_the_recurrence_and_the_whole_walk(name, split_compiled):
    """The storing walk cut into segments (forced) against the float64 recurrence with the op's bound, and against
    the whole-sequence walk (segment_chunks=0) within the same bound; outputs poisoned, so that a state or correction
    the split leaves unwritten fails."""
    from runtime.accelerators.buffers import poison_outputs
    from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
    from runtime.accelerators.gated_delta_rule import tilelang_split

    B, T, H, HV, K, V, state, segment_chunks, options = SPLIT_CASES[name]
    cu = options.get("cu_seqlens")
    sequences = None if cu is None else len(cu) - 1
    inputs = make_inputs(B, T, H, HV, K, V, torch.bfloat16, state, sequences, decay_shift=SPLIT_DECAY_SHIFT)
    n = B if cu is None else sequences
    chunks = gdr_tilelang.Chunks.of(B, T, cu, inputs["q"].device)
    segments = tilelang_split.split_segments(chunks, B, T, n, HV, K, V, cu, inputs["q"].device, segment_chunks)
    assert segments is not None and segments.count > n, "several segments per sequence"
    args = [inputs[x] for x in ("q", "k", "v", "g", "beta")]
    rest = (K**-0.5, inputs.get("initial_state"), options.get("output_final_state", False),
            options.get("use_qk_l2norm_in_kernel", False), cu)  # fmt: skip
    with poison_outputs(), torch.no_grad():
        split = gdr_tilelang.chunk_forward(*args, *rest, segment_chunks=segment_chunks)
        whole = gdr_tilelang.chunk_forward(*args, *rest, segment_chunks=0)
    o_ref, final_ref = reference(inputs, **options)
    bound = BOUND[torch.bfloat16]
    assert_close("o (split)", split[0], o_ref, bound)
    assert_close("o (split vs whole walk)", split[0], whole[0].double(), bound)
    if final_ref is not None:
        assert_close("final_state (split)", split[1], final_ref, bound)
        assert_close("final_state (split vs whole walk)", split[1], whole[1].double(), bound)
    for label, x, y in zip(("gamma", "w", "u", "(I + A)^-1"), split[2:], whole[2:]):
        assert torch.equal(x, y), f"{label}: prepare runs the same either way"


def test_the_occupancy_rule_splits_the_packed_benchmark_shape():
    """One packed 32768-token sequence, 32 value heads, K = V = 128: 64 storing-walk programs, too few for the SMs."""
    from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
    from runtime.accelerators.gated_delta_rule import tilelang_split

    device, cu = torch.device("cuda"), torch.tensor([0, 32768])
    chunks = gdr_tilelang.Chunks.of(1, 32768, cu, device)
    segments = tilelang_split.split_segments(chunks, 1, 32768, 1, 32, 128, 128, cu, device, None)
    assert segments is not None and segments.count >= 4
    assert tilelang_split.split_segments(chunks, 1, 32768, 1, 32, 128, 128, cu, device, 0) is None
