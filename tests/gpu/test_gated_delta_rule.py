"""Gated delta rule on the GPU: the Triton kernels (chunked and recurrent forward, chunked backward) against
the float64 recurrent reference with the issue's bounds (o and final state 5e-3 for half inputs, 1e-4 for
fp32; gradients dq/dk/dv/d(initial_state) 8e-3, dg/dbeta 2e-2 for half inputs, 2e-4 for fp32), and the
torch backend's forward and every gradient on CUDA. Triton 3.4-3.7 has miscompiled this kind of backward
elsewhere: every gradient is compared here, on the GPU machine's Triton. The TileLang kernels face the same
checks: both forwards, and the chunked forward and backward on the half-precision cases (its chunked kernels
multiply in tf32, so fp32 inputs are a not-supported reason there)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import use_accelerators
from runtime.accelerators.backends import BackendFallbackWarning
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule import varlen as gdr_varlen
from runtime.accelerators.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)
from runtime.accelerators.testing import assert_close, compiled_kernels

FUNCTIONS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}
BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-3, torch.float16: 5e-3}
GRAD_BOUND = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dinitial_state": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


def make_inputs(B, T, H, HV, K, V, dtype, state=False, sequences=None, seed=0, decay_shift=2.0):
    """log decays logsigmoid(randn + decay_shift): a larger shift decays less."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV) + decay_shift),
        "beta": torch.rand(B, T, HV, generator=gen, device="cuda"),
    }
    inputs = {name: x.to(dtype) for name, x in inputs.items()}
    if state:
        inputs["initial_state"] = randn(B if sequences is None else sequences, HV, K, V)
    return inputs


def call(function, inputs, backend, **options):
    x = inputs
    return function(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"), backend=backend, **options)


def reference(inputs, **options):
    x = {name: t.detach().double() for name, t in inputs.items()}
    return recurrent_gated_delta_rule_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], options.get("scale"), x.get("initial_state"),
        options.get("output_final_state", False), options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip


VARLEN = [0, 1, 64, 200, 263, 1000]  # a one-token sequence, one exactly a chunk, odd lengths
CASES = {  # name: (B, T, H, HV, K, V, dtype, state, options)
    "T63-K16-fp32": (2, 63, 2, 4, 16, 16, torch.float32, True, dict(output_final_state=True)),
    "T200-K128-bf16-l2norm-state": (2, 200, 2, 2, 128, 128, torch.bfloat16, True,
                                    dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "T1000-K64-V32-fp16-GVA": (1, 1000, 1, 4, 64, 32, torch.float16, False, dict(use_qk_l2norm_in_kernel=True)),
    "T37-K32-V128-bf16-GVA-scale": (3, 37, 2, 6, 32, 128, torch.bfloat16, True, dict(scale=0.3, output_final_state=True)),
    # the Triton reverse walk at K = 128 with V < 32: a 32-wide V block with its columns past V masked (with V = 32
    # this case made an illegal memory access in session 21 while the walk held its state as one [128, 32] tile)
    "T300-K128-V16-bf16-l2norm-state": (1, 300, 2, 2, 128, 16, torch.bfloat16, True,
                                        dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    # fp32 at K = 128: the walks' IEEE launches (BV 32, 8 warps, 1 stage), covered by no other case
    "T130-K128-V64-fp32-state": (1, 130, 1, 2, 128, 64, torch.float32, True, dict(output_final_state=True)),
    "T256-K16-bf16-pcvr": (8, 256, 4, 4, 16, 16, torch.bfloat16, False, dict(use_qk_l2norm_in_kernel=True)),
    "varlen-K128-bf16-GVA-state": (1, 1000, 2, 4, 128, 64, torch.bfloat16, True,
                                   dict(cu_seqlens=torch.tensor(VARLEN), use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "varlen-K64-fp32-cuda-boundaries": (1, 1000, 1, 1, 64, 64, torch.float32, True,
                                        dict(cu_seqlens="cuda", output_final_state=True)),  # boundaries given on the GPU
}  # fmt: skip


@pytest.mark.parametrize("function", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_forward_matches_the_float64_recurrence(function, name):
    check_forward_matches_the_float64_recurrence(function, name, "triton")


def _options(name):
    B, T, H, HV, K, V, dtype, state, options = CASES[name]
    if options.get("cu_seqlens") == "cuda":
        options = dict(options, cu_seqlens=torch.tensor(VARLEN, device="cuda"))
    sequences = len(options["cu_seqlens"]) - 1 if "cu_seqlens" in options else None
    return (B, T, H, HV, K, V, dtype, state, sequences), options


def check_forward_matches_the_float64_recurrence(function, name, backend):
    (B, T, H, HV, K, V, dtype, state, sequences), options = _options(name)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, state, sequences)
    with use_accelerators(fallback="error"), torch.no_grad():
        o, final = call(FUNCTIONS[function], inputs, backend, **options)
    o_ref, final_ref = reference(inputs, **options)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, BOUND[dtype])
    if final_ref is None:
        assert final is None
    else:
        assert final.dtype == torch.float32
        assert_close("final_state", final, final_ref, BOUND[dtype])


def check_chunked_forward_and_every_gradient(name, backend):
    """o, the final state and every gradient (the final state's gradient flowing back too) vs the float64 recurrence."""
    (B, T, H, HV, K, V, dtype, state, sequences), options = _options(name)
    inputs = {n: t.requires_grad_() for n, t in make_inputs(B, T, H, HV, K, V, dtype, state, sequences).items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    with use_accelerators(fallback="error"):
        o, final = call(chunk_gated_delta_rule, inputs, backend, **options)
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        twin["q"], twin["k"], twin["v"], twin["g"], twin["beta"], options.get("scale"), twin.get("initial_state"),
        options.get("output_final_state", False), options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip
    assert o.dtype == dtype
    assert_close("o", o, o_ref, BOUND[dtype])
    outputs, refs = [o], [o_ref]
    if final_ref is not None:
        assert_close("final_state", final, final_ref, BOUND[dtype])
        outputs.append(final)
        refs.append(final_ref)
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad(outputs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outputs)])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        bound = 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[f"d{n}"]
        assert_close(f"d{n}", grad, ref, bound)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_chunked_forward_and_every_gradient(name):
    check_chunked_forward_and_every_gradient(name, "triton")


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_grad_wy_variants_forward_and_every_gradient(name, grad_wy, monkeypatch):
    """The backward's step 5 as each variant at every K (triton_backward.GRAD_WY; the test above runs the default
    choice by K)."""
    monkeypatch.setattr(gdr_backward, "GRAD_WY", grad_wy)
    check_chunked_forward_and_every_gradient(name, "triton")


HALF_CASES = [name for name, case in CASES.items() if case[6] != torch.float32]


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_triton_half_backward_forward_and_every_gradient(name, grad_wy, monkeypatch):
    """triton_backward.HALF_BACKWARD forced on (the backward's products on bf16 operands, fp32 accumulation; by default
    on where step 5 runs fused), each variant of step 5 (the single one keeps tf32), every half-precision case: the
    same bounds."""
    monkeypatch.setattr(gdr_backward, "HALF_BACKWARD", True)
    monkeypatch.setattr(gdr_backward, "GRAD_WY", grad_wy)
    check_chunked_forward_and_every_gradient(name, "triton")


@pytest.mark.parametrize("name", ["T63-K16-fp32", "T37-K32-V128-bf16-GVA-scale", "varlen-K128-bf16-GVA-state"])
def test_torch_backend_forward_and_every_gradient(name):
    B, T, H, HV, K, V, dtype, state, options = CASES[name]
    sequences = len(options["cu_seqlens"]) - 1 if "cu_seqlens" in options else None
    inputs = {n: t.requires_grad_() for n, t in make_inputs(B, T, H, HV, K, V, dtype, state, sequences).items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    o, final = call(chunk_gated_delta_rule, inputs, "torch", **options)
    o_ref, final_ref = recurrent_gated_delta_rule_reference(
        twin["q"], twin["k"], twin["v"], twin["g"], twin["beta"], options.get("scale"), twin.get("initial_state"),
        True, options.get("use_qk_l2norm_in_kernel", False), options.get("cu_seqlens"),
    )  # fmt: skip
    assert_close("o", o, o_ref, BOUND[dtype])
    outputs, refs = [o], [o_ref]
    if final is not None:
        assert_close("final_state", final, final_ref, BOUND[dtype])
        outputs.append(final)
        refs.append(final_ref)
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad(outputs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outputs)])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        bound = 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[f"d{n}"]
        assert_close(f"d{n}", grad, ref, bound)


def test_chunked_torch_backend_matches_the_recurrence_on_cuda_in_float64():
    x = make_inputs(2, 130, 2, 4, 32, 16, torch.float64, state=True)
    o, final = chunk_gated_delta_rule_reference(*(x[n] for n in ("q", "k", "v", "g", "beta")), None, x["initial_state"], True)
    o_ref, final_ref = reference(x, output_final_state=True)
    assert_close("o", o, o_ref, 1e-12)
    assert_close("final_state", final, final_ref, 1e-12)


def test_sum_over_value_heads_is_torchs_and_compiles_once_for_every_row_count():
    """GVA's per-value-head dq/dk summed and cast in one kernel: torch's sum then cast, bit for bit with two value
    heads, at row counts Triton would otherwise specialise on (1, multiples of 16, others), one compiled kernel."""
    def summed(rows):
        per_value_head = torch.randn(rows, 2 * 2, 48, device="cuda")
        out = gdr_backward._sum_value_heads(per_value_head, 1, rows, 2, torch.bfloat16)
        assert torch.equal(out, per_value_head.view(1, rows, 2, 2, 48).sum(3).bfloat16())

    summed(37)
    before = compiled_kernels(gdr_backward._sum_value_heads_kernel)
    if before is None:
        pytest.skip("this Triton has no JITFunction.device_caches to count compiled kernels")
    for rows in (1, 16, 64, 1000):
        summed(rows)
    assert compiled_kernels(gdr_backward._sum_value_heads_kernel) == before


def test_gradients_through_the_triton_recurrent_kernel_fall_back():
    inputs = {n: t.requires_grad_() for n, t in make_inputs(1, 8, 1, 1, 16, 16, torch.bfloat16).items()}
    with pytest.warns(BackendFallbackWarning, match="forward-only"):
        o, _ = call(fused_recurrent_gated_delta_rule, inputs, "triton")
    o.float().sum().backward()
    assert inputs["q"].grad is not None


# --------------------------------------------------------------------------- context-parallel split (triton)

# few (sequence, value head, V block) walking programs for the SMs: the occupancy rule cuts these into segments.
# Weak decay (about e^-0.4 over a 256-step segment): with the default one a segment forgets the state it was entered
# with below fp32 rounding, and a wrong chain of the segment maps would go unseen.
SPLIT_DECAY_SHIFT = 7.0
SPLIT_CASES = {  # name: (B, T, H, HV, K, V, dtype, options)
    "T4096-K64-fp32-l2norm-state": (1, 4096, 1, 2, 64, 64, torch.float32,
                                    dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "varlen-K128-bf16-GVA-state": (1, 3000, 1, 2, 128, 128, torch.bfloat16,
                                   dict(cu_seqlens=torch.tensor([0, 37, 2100, 2100, 3000]), output_final_state=True)),
}  # fmt: skip


def _triton_outputs_and_grads(inputs, options, grads_out, segment_chunks=None):
    """o, final state and every gradient; segment_chunks=0 forces the whole-sequence walk, None lets the rule decide."""
    split = contextlib.nullcontext() if segment_chunks is None else gdr_triton.split_sequences(segment_chunks)
    with split, use_accelerators(fallback="error"):
        outputs = call(chunk_gated_delta_rule, inputs, "triton", **options)
        grads = torch.autograd.grad(outputs, list(inputs.values()), [g.to(o.dtype) for g, o in zip(grads_out, outputs)])
    return [*outputs, *grads]


# the split's walks of the backward (segment offsets, then the segments again) with HALF_BACKWARD on as well
SPLIT_RUNS = [(name, False) for name in SPLIT_CASES] + [
    (name, True) for name, case in SPLIT_CASES.items() if case[6] != torch.float32
]


@pytest.mark.parametrize("name, half_backward", SPLIT_RUNS, ids=[f"{n}-half_backward-{h}" for n, h in SPLIT_RUNS])
def test_triton_split_of_long_sequences_matches_the_recurrence_and_the_whole_walk(name, half_backward, monkeypatch):
    monkeypatch.setattr(gdr_backward, "HALF_BACKWARD", half_backward)
    B, T, H, HV, K, V, dtype, options = SPLIT_CASES[name]
    cu = options.get("cu_seqlens")
    sequences = None if cu is None else len(cu) - 1
    made = make_inputs(B, T, H, HV, K, V, dtype, True, sequences, decay_shift=SPLIT_DECAY_SHIFT)
    inputs = {n: t.requires_grad_() for n, t in made.items()}
    chunks = gdr_triton.Chunks.of(inputs["v"], cu)
    assert gdr_triton.Segments.of(chunks, inputs["q"], inputs["v"], cu) is not None, "the occupancy rule should split"
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    refs = recurrent_gated_delta_rule_reference(
        twin["q"], twin["k"], twin["v"], twin["g"], twin["beta"], None, twin["initial_state"], True,
        options.get("use_qk_l2norm_in_kernel", False), cu,
    )  # fmt: skip
    grads_out = [torch.randn_like(r) for r in refs]
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    split = _triton_outputs_and_grads(inputs, options, grads_out)
    whole = _triton_outputs_and_grads(inputs, options, grads_out, segment_chunks=0)
    labels = ["o", "final_state"] + [f"d{n}" for n in inputs]
    for i, (label, out, out_whole, ref) in enumerate(zip(labels, split, whole, [*refs, *ref_grads])):
        bound = BOUND[dtype] if i < 2 else 2 * BOUND[dtype] if dtype == torch.float32 else GRAD_BOUND[label]
        assert_close(label, out, ref, bound)
        if dtype == torch.float32:  # IEEE dots: the split only reorders fp32 sums
            assert_close(f"{label} (split vs whole)", out, out_whole, 1e-5)


# --------------------------------------------------------------------------- tilelang

# the chunked TileLang kernels multiply in tf32: fp32 inputs are a not-supported reason there
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
        (B, T, H, HV, K, V, dtype, state, sequences), options = _options(name)
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
def test_strong_decay_in_a_partial_chunk_keeps_gradients_finite(backend, grad_wy, half_backward, monkeypatch):
    """g = -5 everywhere, T = 100: rows past the end of the last chunk must not turn exp overflow into NaN (the Triton
    backward with each variant of its step 5, triton_backward.GRAD_WY, its products on fp32 or bf16 operands)."""
    monkeypatch.setattr(gdr_backward, "HALF_BACKWARD", half_backward)
    if grad_wy is not None:
        monkeypatch.setattr(gdr_backward, "GRAD_WY", grad_wy)
    inputs = make_inputs(1, 100, 1, 1, 16, 16, torch.bfloat16)
    inputs["g"] = torch.full_like(inputs["g"], -5.0)
    inputs = {n: t.requires_grad_() for n, t in inputs.items()}
    twin = {n: t.detach().double().requires_grad_() for n, t in inputs.items()}
    with use_accelerators(fallback="error"):
        o, _ = call(chunk_gated_delta_rule, inputs, backend)
    ref, _ = recurrent_gated_delta_rule_reference(*(twin[n] for n in ("q", "k", "v", "g", "beta")), None, None, False, False, None)
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
    (B, T, H, HV, K, V, dtype, state, sequences), options = _options("varlen-K128-bf16-GVA-state")
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
    (B, T, H, HV, K, V, dtype, state, sequences), options = _options("varlen-K128-bf16-GVA-state")
    inputs = make_inputs(B, T, H, HV, K, V, dtype, state, sequences)
    with use_accelerators(fallback="error"), torch.no_grad():
        expected = call(chunk_gated_delta_rule, inputs, backend, **options)
        monkeypatch.setattr(gdr_varlen, "_copies", type(gdr_varlen._copies)())  # no copy of these boundaries yet
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
