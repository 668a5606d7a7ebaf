"""Gated delta rule: the chunked torch backend against the recurrent reference (float64), the Triton
kernels under the interpreter at tiny shapes, dispatch reasons and every input error."""

import functools

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import gated_delta_rule as gdr_ops
from runtime.accelerators import use_accelerators
from runtime.accelerators.backends import BackendFallbackWarning, BackendUnavailableError
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, varlen
from runtime.accelerators.gated_delta_rule import split as gdr_split
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule import triton_backward_wy as gdr_wy
from runtime.accelerators.gated_delta_rule import triton_shared as gdr_shared
from runtime.accelerators.gated_delta_rule.reference import (
    recurrent_gated_delta_rule_reference,
)
from runtime.accelerators.gated_delta_rule.varlen import chunk_table, piece_bounds
from runtime.accelerators.testing import assert_close, differentiable, relative_rms_error

FUNCTIONS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}


def make_inputs(B, T, H, HV, K, V, dtype=torch.float32, state=False, sequences=None, seed=0, decay_shift=2.0):
    """Fresh random inputs: normalised-scale k, log decays in (-inf, 0) (logsigmoid(randn + decay_shift): a larger
    shift decays less), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = {
        "q": randn(B, T, H, K),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV) + decay_shift),
        "beta": torch.rand(B, T, HV, generator=gen),
    }
    inputs = {name: x.to(dtype) for name, x in inputs.items()}
    if state:
        n = B if sequences is None else sequences
        inputs["initial_state"] = randn(n, HV, K, V).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return inputs


def call(function, inputs, backend, **options):
    x = inputs
    return function(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"), backend=backend, **options
    )


def triton_chunk(
    inputs,
    tuning,
    backward_tuning=None,
    scale=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    """The Triton chunked kernels forward and backward with these variants (gdr_triton.Tuning; the backward's
    backward_tuning where given), without the op's dispatch: (o, final state or None)."""
    run = differentiable(
        functools.partial(gdr_triton.chunk_forward, tuning=tuning),
        functools.partial(gdr_backward.chunk_backward, tuning=backward_tuning or tuning),
        2,
    )
    x = inputs
    scale = float(x["q"].shape[-1] ** -0.5 if scale is None else scale)
    cu = None if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64)
    o, final = run(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x.get("initial_state"), output_final_state,
                   use_qk_l2norm_in_kernel, cu)  # fmt: skip
    return o, (final if output_final_state else None)


def doubled(inputs):
    return {name: x.detach().double().requires_grad_() for name, x in inputs.items()}


CU = torch.tensor([0, 20, 63, 63, 130])  # includes an empty sequence and one longer than a chunk
CASES = {
    "T63-K16-V32": dict(shape=(2, 63, 2, 2, 16, 32), options={}),
    "T130-GVA-state": dict(shape=(1, 130, 2, 4, 16, 16), state=True, options=dict(output_final_state=True)),
    "T64-l2norm-scale": dict(shape=(3, 64, 1, 3, 8, 24), options=dict(use_qk_l2norm_in_kernel=True, scale=0.37)),
    "varlen-GVA-l2norm-state": dict(
        shape=(1, 130, 2, 4, 16, 16),
        state=True,
        sequences=4,
        options=dict(cu_seqlens=CU, use_qk_l2norm_in_kernel=True, output_final_state=True),
    ),
    "T1": dict(shape=(2, 1, 1, 1, 16, 16), state=True, options=dict(output_final_state=True)),
}


def _inputs(case, dtype):
    shape, state, sequences = case["shape"], case.get("state", False), case.get("sequences")
    return make_inputs(*shape, dtype=dtype, state=state, sequences=sequences, decay_shift=case.get("decay_shift", 2.0))


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_matches_recurrent_in_float64(name):
    """Forward and every gradient (including d initial_state): the same math, up to float64 rounding."""
    case = CASES[name]
    inputs = doubled(_inputs(case, torch.float64))
    twin = doubled(inputs)
    o, state = call(chunk_gated_delta_rule, inputs, "torch", **case["options"])
    o_ref, state_ref = recurrent_gated_delta_rule_reference(
        *(twin[n] for n in ("q", "k", "v", "g", "beta")), case["options"].get("scale"), twin.get("initial_state"),
        case["options"].get("output_final_state", False), case["options"].get("use_qk_l2norm_in_kernel", False),
        case["options"].get("cu_seqlens"),
    )  # fmt: skip
    assert o.dtype == torch.float64
    assert_close("o", o, o_ref, 1e-12)
    outputs, refs = [o], [o_ref]
    if state_ref is not None:
        assert state.dtype == torch.float64
        assert_close("final_state", state, state_ref, 1e-12)
        outputs.append(state)
        refs.append(state_ref)
    else:
        assert state is None
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad(outputs, list(inputs.values()), grads_out)
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert_close(f"d{n}", grad, ref, 1e-11)


def test_recurrent_reference_matches_a_hand_written_step():
    """Two steps written out: S = e^g S; u = beta (v - S^T k); S += k u^T; o = scale S^T q."""
    x = make_inputs(1, 2, 1, 1, 3, 2, dtype=torch.float64, state=True)
    q, k, v, g, beta, S = (
        x["q"][0, :, 0],
        x["k"][0, :, 0],
        x["v"][0, :, 0],
        x["g"][0, :, 0],
        x["beta"][0, :, 0],
        x["initial_state"][0, 0],
    )
    expected = []
    for t in range(2):
        S = torch.exp(g[t]) * S
        u = beta[t] * (v[t] - S.T @ k[t])
        S = S + torch.outer(k[t], u)
        expected.append(0.5 * S.T @ q[t])
    o, final = recurrent_gated_delta_rule_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], 0.5, x["initial_state"], True
    )
    torch.testing.assert_close(o[0, :, 0], torch.stack(expected), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(final[0, 0], S, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("function", ["chunk", "recurrent"])
def test_torch_backend_in_low_precision_is_close_to_float64(function, dtype):
    inputs = make_inputs(2, 63, 2, 4, 16, 16, dtype=dtype, state=True)
    o, state = call(FUNCTIONS[function], inputs, "torch", output_final_state=True)
    ref, ref_state = call(FUNCTIONS["recurrent"], doubled(inputs), "torch", output_final_state=True)
    assert o.dtype == dtype and state.dtype == torch.float32
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    assert_close("o", o, ref, rtol)
    assert_close("final_state", state, ref_state, rtol)


@pytest.mark.parametrize("function", ["chunk", "recurrent"])
def test_torch_backend_under_autocast_computes_in_the_inputs_dtype(function):
    """autocast does not lower the op's float32 math, as it does not the kernels' (the reference's matmuls ran in
    bfloat16: o and the state 3e-3 from float64, past the fp32 bound)."""
    inputs = {name: x.requires_grad_() for name, x in make_inputs(2, 63, 2, 4, 16, 16, state=True).items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, state = call(FUNCTIONS[function], inputs, "torch", output_final_state=True)
    reference = doubled(inputs)
    ref, ref_state = call(FUNCTIONS["recurrent"], reference, "torch", output_final_state=True)
    assert o.dtype == torch.float32 and state.dtype == torch.float32
    assert_close("o", o, ref, 1e-4)
    assert_close("final_state", state, ref_state, 1e-4)
    grads = torch.autograd.grad([o, state], list(inputs.values()), [torch.ones_like(o), torch.ones_like(state)])
    ref_grads = torch.autograd.grad(
        [ref, ref_state], list(reference.values()), [torch.ones_like(ref), torch.ones_like(ref_state)]
    )
    for name, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert_close(f"d{name}", grad, ref_grad, 2e-4)


@pytest.mark.parametrize("K, V", [(32, 16), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_traced_placeholder_has_the_triton_forwards_shapes_and_dtypes(dtype, K, V):
    """What torch.compile traces with (the op's fake forward) is what the triton forward returns, saved factors
    included (w and u in bf16 for half inputs)."""
    x = make_inputs(1, 70, 1, 2, K, V, dtype=dtype, state=True, sequences=2)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True, True, torch.tensor([0, 30, 70]))
    real = gdr_ops.CHUNK.kernels("triton").forward(*args)
    fake = gdr_ops._fake_chunk_forward(*args, backend="triton")
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


def test_empty_sequence_axis():
    inputs = make_inputs(2, 0, 2, 2, 16, 16, state=True)
    for function in FUNCTIONS.values():
        for backend in ("torch", "triton"):
            o, state = call(function, inputs, backend, output_final_state=True)
            assert o.shape == (2, 0, 2, 16)
            torch.testing.assert_close(state, inputs["initial_state"])
            # a backward through zero steps runs: every input gets its (empty) gradient, the state's passes through
            leaves = [inputs[name].detach().requires_grad_() for name in ("q", "k", "v", "g", "beta", "initial_state")]
            o, state = function(*leaves[:5], initial_state=leaves[5], output_final_state=True, backend=backend)
            grads = torch.autograd.grad(o.sum() + (2 * state).sum(), leaves)
            assert [g.shape for g in grads] == [x.shape for x in leaves]
            torch.testing.assert_close(grads[5], torch.full_like(leaves[5], 2.0))


# --------------------------------------------------------------------------- Triton under the interpreter

TRITON_CASES = {  # shape: (B, T, H, HV, K, V)
    "T63-GVA": dict(shape=(2, 63, 2, 4, 16, 16), options={}),
    "T63-GVA-l2norm-state": dict(shape=(2, 63, 2, 4, 16, 16), state=True,
                                 options=dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "varlen-state": dict(shape=(1, 130, 2, 4, 16, 16), state=True, sequences=4, options=dict(cu_seqlens=CU, output_final_state=True)),
    "K128-V64-l2norm-state": dict(shape=(1, 63, 1, 2, 128, 64), state=True,  # several V blocks per head
                                  options=dict(use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "K32-V128": dict(shape=(1, 70, 1, 1, 32, 128), options={}),  # two V blocks in the walk and the output kernel
}  # fmt: skip


@pytest.mark.parametrize("function", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", list(TRITON_CASES))
@pytest.mark.slow
def test_triton_forward_under_the_interpreter(function, name):
    case = TRITON_CASES[name]
    inputs = make_inputs(*case["shape"], state=case.get("state", False), sequences=case.get("sequences"))
    with use_accelerators(fallback="error"), poison_outputs():
        o, state = call(FUNCTIONS[function], inputs, "triton", **case["options"])
    ref, ref_state = call(FUNCTIONS["recurrent"], doubled(inputs), "torch", **case["options"])
    assert o.dtype == torch.float32
    assert_close("o", o, ref, 1e-4)
    if ref_state is None:
        assert state is None
    else:
        assert state.dtype == torch.float32
        assert_close("final_state", state, ref_state, 1e-4)


def test_triton_blockwise_inverse_with_identical_keys_matches_float64():
    # identical unit keys, beta = 1, no decay: A is all ones below the diagonal, the case whose inverse
    # mixes the largest terms; a partial chunk (50 of 64 rows) as well
    T, K = 114, 16
    k = torch.ones(1, T, 1, K) / K**0.5
    v = torch.randn(1, T, 1, K)
    g, beta = torch.zeros(1, T, 1), torch.ones(1, T, 1)
    chunks = gdr_triton.Chunks.of(v, None)
    inverse = gdr_triton.prepare(k, v, g, beta, False, chunks, "ieee")[3]
    for start in range(0, T, gdr_triton.BT):
        n = min(gdr_triton.BT, T - start)
        a = torch.tril(torch.ones(n, n, dtype=torch.float64), -1)
        expected = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + a)
        assert_close("inverse", inverse[start : start + n, 0, :n], expected, 1e-6)


@pytest.mark.parametrize("l2norm", [False, True])
def test_triton_prepare_factors_match_float64(l2norm):
    # gamma, (I + A)^-1 (whole rows: zeros above the diagonal) and the WY factors of every chunk, varlen with
    # partial chunks and GVA (value head 1 reads k head 0)
    inputs = make_inputs(1, 130, 1, 2, 32, 16, sequences=4)
    k, v, g, beta = (inputs[name] for name in ("k", "v", "g", "beta"))
    k = 3 * k if l2norm else k  # rows of norm 3: the kernel must normalise them
    chunks = gdr_triton.Chunks.of(v, CU)
    with poison_outputs():
        gamma, w, u, inverse, k_factor = gdr_triton.prepare(k, v, g, beta, l2norm, chunks, "ieee")
    kd = F.normalize(k.double(), dim=-1, eps=0) if l2norm else k.double()
    for n in range(CU.numel() - 1):
        for start in range(int(CU[n]), int(CU[n + 1]), gdr_triton.BT):
            rows = slice(start, min(start + gdr_triton.BT, int(CU[n + 1])))
            for hv in range(2):
                kc, vc = kd[0, rows, 0], v[0, rows, hv].double()
                gc, bc = g[0, rows, hv].double().cumsum(0), beta[0, rows, hv].double()
                a = torch.tril(bc[:, None] * torch.exp(gc[:, None] - gc[None, :]) * (kc @ kc.T), -1)
                t = torch.linalg.inv(torch.eye(len(gc), dtype=torch.float64) + a)
                full = torch.zeros(len(gc), gdr_triton.BT, dtype=torch.float64)
                full[:, : len(gc)] = t
                assert_close("gamma", gamma[rows, hv], gc, 1e-5)
                assert_close("inverse", inverse[rows, hv], full, 1e-5)
                assert_close("w", w[rows, hv], t @ (kc * (bc * gc.exp())[:, None]), 1e-5)
                assert_close("u", u[rows, hv], t @ (vc * bc[:, None]), 1e-5)
                rstd = 1 / k[0, rows, 0].double().norm(dim=-1) if l2norm else 1.0
                assert_close("k_factor", k_factor[rows, hv], torch.exp(gc[-1] - gc) * rstd, 1e-5)


def test_triton_forward_bf16_under_the_interpreter():
    inputs = make_inputs(1, 63, 1, 2, 32, 16, dtype=torch.bfloat16, state=True)
    ref, ref_state = call(FUNCTIONS["recurrent"], doubled(inputs), "torch", output_final_state=True)
    for function in FUNCTIONS.values():
        with use_accelerators(fallback="error"), poison_outputs():
            o, state = call(function, inputs, "triton", output_final_state=True)
        assert o.dtype == torch.bfloat16
        assert_close("o", o, ref, 5e-3)
        assert_close("final_state", state, ref_state, 5e-3)


def test_triton_wy_factors_take_bf16_products_only_where_the_v_blocks_are_not_narrower():
    """Triton 3.6 on the H100 built the WY kernel's bf16 u product wrongly where it is narrower than the w product
    before it (K = 64, V = 32: a wrong u; K = 128, V = 32: an illegal address), so those launches stay in tf32.
    Where the products are bf16 (K = 16, V = 32 here), the forward stays within the GPU tier's bounds."""
    bf16, fp32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    assert gdr_triton._half_wy(bf16, 64, 64) == gdr_triton._half_wy(bf16, 16, 32) == "bf16"
    assert gdr_triton._half_wy(bf16, 64, 32) == gdr_triton._half_wy(fp32, 64, 64) == ""
    inputs = make_inputs(1, 63, 1, 2, 16, 32, dtype=torch.bfloat16, state=True)
    ref, ref_state = call(FUNCTIONS["recurrent"], doubled(inputs), "torch", output_final_state=True)
    with use_accelerators(fallback="error"), poison_outputs():
        o, state = call(chunk_gated_delta_rule, inputs, "triton", output_final_state=True)
    assert_close("o", o, ref, 5e-3)
    assert_close("final_state", state, ref_state, 5e-3)


def test_triton_inverse_is_stored_in_bf16_as_its_products_round_it():
    """prepare stores (I + A)^-1 in bf16 where the WY kernel and step 5 take it rounded to bf16 anyway (half inputs,
    the fused step 5 from K = 32, whose HALF follows it by default), rounded to nearest from the fp32 it stores
    otherwise; and step 5 takes it in either dtype (here bf16 from the forward, then the single kernel's tf32
    products)."""
    inputs = {n: x.requires_grad_() for n, x in make_inputs(1, 90, 1, 2, 32, 32, dtype=torch.bfloat16).items()}
    k, v, g, beta = (inputs[n].detach() for n in ("k", "v", "g", "beta"))
    chunks = gdr_triton.Chunks.of(v, None)
    inverse = {}
    for variant in ("single", "fused"):
        inverse[variant] = gdr_triton.prepare(k, v, g, beta, True, chunks, "tf32", gdr_triton.Tuning(grad_wy=variant))[
            3
        ]
    assert inverse["single"].dtype == torch.float32 and inverse["fused"].dtype == torch.bfloat16
    assert torch.equal(inverse["fused"], inverse["single"].bfloat16())
    fused, single = gdr_triton.Tuning(grad_wy="fused"), gdr_triton.Tuning(grad_wy="single")
    with poison_outputs():
        o, _ = triton_chunk(inputs, fused, single, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o, list(inputs.values()), torch.ones_like(o))
    assert all(torch.isfinite(grad).all() for grad in grads)


class _HalfRecorder:
    """Stands in for a step-5 kernel: records the HALF of each launch, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.half = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.half.append(kwargs["HALF"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_triton_fused_step5_takes_16_bit_products_only_above_k16(monkeypatch, dtype):
    """The fused step-5 kernel on bf16 operands at K = 16 (its loops over k's columns one block long) was wrong on
    the H200 with Triton 3.6 (fp16, K16-V32: dk, dbeta and dg 2.5 to 9 times the errors of the same kernel under the
    interpreter; bf16: an illegal memory access): there it takes fp32 products and T = (I + A)^-1 in fp32, asked for
    (half_backward=True) or by default, while the other kernels keep 16-bit products (of the input's type: fp16
    inputs keep fp16 intermediates); from K = 32 it takes 16-bit products and T in 16 bits (Tuning.half_step5).
    Every gradient within the GPU tier's bounds of the float64 recurrence either way."""
    half = "fp16" if dtype == torch.float16 else "bf16"
    recorder = _HalfRecorder(gdr_wy._chunk_grad_wy_fused_kernel)
    monkeypatch.setattr(gdr_wy, "_chunk_grad_wy_fused_kernel", recorder)
    for K, half_step5 in ((16, False), (32, True)):
        for half_backward in (None, True):
            tuning = gdr_triton.Tuning(grad_wy="fused", half_backward=half_backward)
            inputs = {n: x.requires_grad_() for n, x in make_inputs(1, 70, 1, 1, K, 32, dtype, state=True).items()}
            q, k, v, g, beta = (inputs[n].detach() for n in ("q", "k", "v", "g", "beta"))
            chunks = gdr_triton.Chunks.of(v, None)
            inverse = gdr_triton.prepare(k, v, g, beta, False, chunks, "tf32", tuning)[3]
            assert inverse.dtype == (dtype if half_step5 else torch.float32)
            twin = doubled(inputs)
            with poison_outputs():
                o, state = triton_chunk(inputs, tuning, output_final_state=True)
            refs = call(FUNCTIONS["recurrent"], twin, "torch", output_final_state=True)
            gen = torch.Generator().manual_seed(K)
            grads_out = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
            grads = torch.autograd.grad(
                [o, state], list(inputs.values()), [grads_out[0].to(dtype), grads_out[1].float()]
            )
            assert recorder.half == [half if half_step5 else ""]
            recorder.half.clear()
            assert tuning.half(q) == half and bool(tuning.half_step5(q)) == half_step5  # the other kernels keep HALF
            ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
            bounds = {"g": 2e-2, "beta": 2e-2}  # the op's half bounds: 8e-3, dg/dbeta 2e-2
            for n, grad, ref_grad in zip(inputs, grads, ref_grads):
                assert_close(f"d{n} (K {K}, half_backward {half_backward})", grad, ref_grad, bounds.get(n, 8e-3))


@pytest.mark.parametrize("K, V", [(16, 32), (64, 32), (128, 128)])
@pytest.mark.slow
def test_triton_fp16_storage_keeps_fp16_inputs_intermediates_in_fp16(K, V):
    """Tuning.fp16_storage: for fp16 inputs w, u, (I + A)^-1 where its products round it, the states, the
    corrections and every 16-bit product operand in fp16 (as fla keeps them) instead of bf16. fp16's three more
    mantissa bits show in every result: against the float64 recurrence the output and each gradient are several
    times closer than with bf16 intermediates (about 10x at K = 64 under the interpreter), within 2e-3."""
    inputs = make_inputs(1, 130, 1, 2, K, V, dtype=torch.float16, state=True, decay_shift=6.0)  # weak decay
    twin = doubled(inputs)
    refs = call(FUNCTIONS["recurrent"], twin, "torch", output_final_state=True, use_qk_l2norm_in_kernel=True)
    gen = torch.Generator().manual_seed(K)
    grads_out = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    fp16 = gdr_triton.Tuning(fp16_storage=True)
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    _, w, u, inverse, _ = gdr_triton.prepare(k, v, g, beta, True, gdr_triton.Chunks.of(v, None), "tf32", fp16)
    assert w.dtype == u.dtype == torch.float16 and fp16.half(q) in ("fp16", "")
    # in fp16 where the WY kernel and step 5 both round it (K = 128, V = 128: the fused step 5), else fp32
    assert inverse.dtype == (torch.float16 if K == V == 128 else torch.float32)
    errors = {}
    for name, tuning in (("bf16", gdr_triton.Tuning(fp16_storage=False)), ("fp16", fp16)):
        leaves = {n: x.detach().requires_grad_() for n, x in inputs.items()}
        with poison_outputs():
            o, state = triton_chunk(leaves, tuning, output_final_state=True, use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad([o, state], list(leaves.values()), [grads_out[0].half(), grads_out[1].float()])
        errors[name] = [relative_rms_error(o, refs[0])] + [
            relative_rms_error(grad, ref) for grad, ref in zip(grads, ref_grads)
        ]
    print(K, errors)
    assert max(errors["fp16"]) < 2e-3, errors
    assert errors["fp16"][0] < errors["bf16"][0] / 3, errors


@pytest.mark.parametrize("groups, K, dtype", [(2, 16, torch.bfloat16), (3, 48, torch.float16), (4, 128, torch.float32)])
def test_triton_sum_over_value_heads_matches_float64(groups, K, dtype):
    """GVA's dq/dk per value head (fp32) summed over each q/k head's value heads and cast in one kernel: row counts
    that do not fill the last block, K not a power of two; with two value heads the sum is torch's, bit for bit."""
    B, T, H = 2, 37, 3
    per_value_head = torch.randn(B * T, H * groups, K, generator=torch.Generator().manual_seed(groups))
    summed = gdr_backward._sum_value_heads(per_value_head, B, T, H, dtype)
    expected = per_value_head.double().view(B, T, H, groups, K).sum(3)
    assert summed.shape == (B, T, H, K) and summed.dtype == dtype
    assert_close("sum", summed, expected, 1e-6 if dtype == torch.float32 else 5e-3)
    if groups == 2:
        assert torch.equal(summed, per_value_head.view(B, T, H, groups, K).sum(3).to(dtype))


TRITON_BACKWARD_CASES = {  # shape: (B, T, H, HV, K, V)
    "T63-GVA-state-final": dict(shape=(1, 63, 2, 4, 16, 16), state=True, options=dict(output_final_state=True)),
    "T130-GVA-l2norm-scale": dict(shape=(2, 130, 2, 4, 16, 16), options=dict(use_qk_l2norm_in_kernel=True, scale=0.3)),
    "varlen-GVA-l2norm-state-final": dict(shape=(1, 130, 2, 4, 16, 16), state=True, sequences=4,
                                          options=dict(cu_seqlens=CU, use_qk_l2norm_in_kernel=True, output_final_state=True)),
    "K64-V64-state": dict(shape=(1, 63, 1, 2, 64, 64), state=True, options={}),  # two V blocks in the gradient kernel
    "K128-V32-l2norm-state": dict(shape=(1, 70, 1, 1, 128, 32), state=True,  # two K blocks in the state-gradient kernel
                                  options=dict(use_qk_l2norm_in_kernel=True)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRITON_BACKWARD_CASES))
@pytest.mark.slow
def test_triton_chunked_backward_under_the_interpreter(name):
    """Every gradient (and the final state's gradient flowing back) against the float64 recurrence."""
    case = TRITON_BACKWARD_CASES[name]
    inputs = {n: x.requires_grad_() for n, x in _inputs(case, torch.float32).items()}
    twin = doubled(inputs)
    with use_accelerators(fallback="error"), poison_outputs():
        o, state = call(chunk_gated_delta_rule, inputs, "triton", **case["options"])
    ref, ref_state = call(FUNCTIONS["recurrent"], twin, "torch", **case["options"])
    outputs, refs = [o, state], [ref, ref_state]
    if ref_state is None:
        outputs, refs = [o], [ref]
    gen = torch.Generator().manual_seed(1)
    grads_out = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    with poison_outputs():
        grads = torch.autograd.grad(outputs, list(inputs.values()), [g.float() for g in grads_out])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    for output, reference, label in zip(outputs, refs, ("o", "final_state")):
        assert_close(label, output, reference, 1e-4)
    for n, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        assert_close(f"d{n}", grad, ref_grad, 1e-4)


HALF_BACKWARD = {"tf32-products": False, "bf16-products": True}  # Tuning.half_backward


@pytest.mark.parametrize("K, V", [(32, 16), (16, 32)], ids=["K32-V16", "K16-V32-bf16-wy"])
@pytest.mark.parametrize("half_backward", list(HALF_BACKWARD.values()), ids=list(HALF_BACKWARD))
def test_triton_chunked_backward_bf16_under_the_interpreter(half_backward, K, V):
    """bf16, GVA, l2norm and an initial state, the backward's products on fp32 (tf32) or bf16 operands (and at
    K16-V32 the forward's WY factors on bf16 operands): every gradient within the GPU tier's bounds of the float64
    recurrence (the interpreter takes bf16 products as the GPU rounds)."""
    inputs = {
        n: x.requires_grad_() for n, x in make_inputs(1, 63, 1, 2, K, V, dtype=torch.bfloat16, state=True).items()
    }
    twin = doubled(inputs)
    with poison_outputs():
        o, state = triton_chunk(inputs, gdr_triton.Tuning(half_backward=half_backward), output_final_state=True,
                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    refs = call(FUNCTIONS["recurrent"], twin, "torch", output_final_state=True, use_qk_l2norm_in_kernel=True)
    grads_out = [torch.randn_like(r) for r in refs]
    grads = torch.autograd.grad([o, state], list(inputs.values()), [grads_out[0].bfloat16(), grads_out[1].float()])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), grads_out)
    bounds = {"g": 2e-2, "beta": 2e-2}  # the op's bf16 bounds: 8e-3, dg/dbeta 2e-2
    for n, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        assert_close(f"d{n}", grad, ref_grad, bounds.get(n, 8e-3))


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
def test_triton_chunked_backward_with_strong_decay_in_a_partial_chunk(grad_wy):
    # rows past a sequence's end read gamma = 0: exp(-gamma_j) of a strongly decayed chunk overflows there,
    # and the backward's decay masks must keep the inf * 0 (NaN) out of the gradients (each variant of step 5)
    inputs = make_inputs(1, 100, 1, 1, 16, 16)
    inputs["g"] = torch.full_like(inputs["g"], -5.0)
    inputs = {n: x.requires_grad_() for n, x in inputs.items()}
    twin = doubled(inputs)
    o, _ = triton_chunk(inputs, gdr_triton.Tuning(grad_wy=grad_wy))
    ref, _ = call(FUNCTIONS["recurrent"], twin, "torch")
    assert_close("o", o, ref, 1e-4)
    grad_out = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(o, list(inputs.values()), grad_out.float())
    ref_grads = torch.autograd.grad(ref, list(twin.values()), grad_out)
    for n, grad, ref_grad in zip(inputs, grads, ref_grads):
        assert_close(f"d{n}", grad, ref_grad, 1e-4)


def test_triton_chunked_with_only_q_requiring_grad_gives_a_final_state_without_grad():
    """The final state does not depend on q: with only q requiring grad it requires none (as on the torch backend),
    and dq is right with both outputs passed to autograd."""
    inputs = make_inputs(1, 11, 2, 2, 16, 16, state=True)
    inputs["q"].requires_grad_()
    o, state = call(FUNCTIONS["chunk"], inputs, "triton", output_final_state=True)
    ref, ref_state = call(FUNCTIONS["chunk"], inputs, "torch", output_final_state=True)
    assert not state.requires_grad and not ref_state.requires_grad and o.requires_grad
    assert_close("final state", state, ref_state, 1e-4)
    grad_out = torch.randn_like(o)
    (dq,) = torch.autograd.grad([o for o in (o, state) if o.requires_grad], [inputs["q"]], [grad_out])
    (ref_dq,) = torch.autograd.grad(ref, [inputs["q"]], [grad_out])
    assert_close("dq", dq, ref_dq, 2e-4)


# --------------------------------------------------------------------------- step 5's variants (Tuning.grad_wy)

# shape: (B, T, H, HV, K, V); GVA: HV = 2H. The GPU tier runs both variants at every case of gdr_checks.CASES.
WY_CASES = {
    "T100-B2-GVA-l2norm-K64-V32": dict(shape=(2, 100, 1, 2, 64, 32), options=dict(use_qk_l2norm_in_kernel=True)),
    "varlen-GVA-state-K64-V128": dict(shape=(1, 130, 1, 2, 64, 128), state=True, sequences=4,  # two V blocks
                                      options=dict(cu_seqlens=CU, output_final_state=True)),
    "T70-K128-V32-l2norm-state": dict(shape=(1, 70, 1, 1, 128, 32), state=True,  # HV = H: dk written in place
                                      options=dict(use_qk_l2norm_in_kernel=True)),
}  # fmt: skip


def _outputs_and_grads(inputs, options, tuning):
    """o, the final state (when asked) and every gradient with the kernels' variants `tuning`."""
    with poison_outputs():
        o, state = triton_chunk(inputs, tuning, **options)
        outputs = [o] if state is None else [o, state]
        gen = torch.Generator().manual_seed(1)
        grads_out = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in outputs]
        return list(torch.autograd.grad(outputs, list(inputs.values()), grads_out)), grads_out


@pytest.mark.parametrize("grad_wy", ["fused"])
@pytest.mark.parametrize("name", list(WY_CASES))
@pytest.mark.slow
def test_triton_grad_wy_variants_match_the_single_kernel_and_the_recurrence(name, grad_wy):
    """Every gradient of the variant against the single kernel's (fp32 rounding apart) and the float64 recurrence."""
    case = WY_CASES[name]
    inputs = {n: x.requires_grad_() for n, x in _inputs(case, torch.float32).items()}
    single, _ = _outputs_and_grads(inputs, case["options"], gdr_triton.Tuning(grad_wy="single"))
    grads, grads_out = _outputs_and_grads(inputs, case["options"], gdr_triton.Tuning(grad_wy=grad_wy))
    twin = doubled(inputs)
    refs = [r for r in call(FUNCTIONS["recurrent"], twin, "torch", **case["options"]) if r is not None]
    ref_grads = torch.autograd.grad(refs, list(twin.values()), [g.double() for g in grads_out])
    for n, grad, grad_single, ref in zip(inputs, grads, single, ref_grads):
        assert grad.dtype == inputs[n].dtype
        assert_close(f"d{n} ({grad_wy} vs single)", grad, grad_single, 1e-5)
        assert_close(f"d{n} ({grad_wy} vs float64 recurrence)", grad, ref, 1e-4)


@pytest.mark.parametrize("half_backward", list(HALF_BACKWARD.values()), ids=list(HALF_BACKWARD))
@pytest.mark.parametrize("grad_wy", ["fused"])
@pytest.mark.slow
def test_triton_grad_wy_variants_bf16_under_the_interpreter(grad_wy, half_backward):
    """bf16: dA from the stored (bf16) corrections U, within the GPU tier's bounds of the float64 recurrence (the
    backward's products on fp32 or bf16 operands, Tuning.half_backward)."""
    case = dict(shape=(1, 130, 2, 4, 32, 16), state=True, sequences=4,
                options=dict(cu_seqlens=CU, use_qk_l2norm_in_kernel=True, output_final_state=True))  # fmt: skip
    inputs = {n: x.requires_grad_() for n, x in _inputs(case, torch.bfloat16).items()}
    tuning = gdr_triton.Tuning(grad_wy=grad_wy, half_backward=half_backward)
    grads, grads_out = _outputs_and_grads(inputs, case["options"], tuning)
    twin = doubled(inputs)
    refs = call(FUNCTIONS["recurrent"], twin, "torch", **case["options"])
    ref_grads = torch.autograd.grad(refs, list(twin.values()), [g.double() for g in grads_out])
    bounds = {"g": 2e-2, "beta": 2e-2}  # the op's bf16 bounds: 8e-3, dg/dbeta 2e-2
    for n, grad, ref in zip(inputs, grads, ref_grads):
        assert grad.dtype == inputs[n].dtype
        assert_close(f"d{n}", grad, ref, bounds.get(n, 8e-3))


# --------------------------------------------------------------------------- varlen chunk table (device kernel)

TABLE_BOUNDARIES = {
    "empty-and-odd": [0, 20, 63, 63, 200],
    "all-empty": [0, 0, 0],
    "exact-chunks-and-one-token": [0, 64, 128, 129],
    "leading-empty": [0, 0, 65, 65, 300, 301],
    "over-a-block": [0, 3, 64 * 300 + 8],  # 301 chunks: the kernel's loop over blocks of 256
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("size", [64, 128])
@pytest.mark.parametrize("name", list(TABLE_BOUNDARIES))
def test_chunk_table_matches_the_python_construction(name, size, dtype):
    cu = TABLE_BOUNDARIES[name]
    host = torch.tensor(cu)
    with poison_outputs():
        table, first = chunk_table(host.to(dtype), host, size)
    counts = [-(-(end - start) // size) for start, end in zip(cu, cu[1:])]
    assert table.dtype == torch.int32 and table.shape == (sum(counts), 2)
    assert table.tolist() == [[n, c] for n, count in enumerate(counts) for c in range(count)]
    assert first.dtype == torch.int32 and first.tolist() == [sum(counts[:n]) for n in range(len(counts))]


def test_device_copies_of_boundaries_serve_a_later_cuda_graph_capture():
    """varlen.on_device copies host boundaries once per value; a call inside a CUDA-graph capture (where the copy is
    refused) takes an earlier call's copy and keeps it for good, and fails clearly without one. "meta" stands in
    for the GPU here."""
    capturing = False
    copies = varlen.DeviceCopies(max_copies=2, capturing=lambda device: capturing)
    meta = torch.device("meta")
    first = copies.on_device(torch.tensor([0, 3, 7]), meta, torch.int32)
    assert first.device == meta and first.dtype == torch.int32
    assert copies.on_device(torch.tensor([0, 3, 7]), meta, torch.int32) is first  # the same values: the same copy
    capturing = True
    with pytest.raises(RuntimeError, match="cu_seqlens: .*before capturing"):
        copies.on_device(torch.tensor([0, 4, 7]), meta, torch.int32)
    assert copies.on_device(torch.tensor([0, 3, 7]), meta, torch.int32) is first  # kept from now on
    capturing = False
    for end in (8, 9, 10):  # more copies than max_copies: the oldest not kept go
        copies.on_device(torch.tensor([0, 3, end]), meta, torch.int32)
    assert copies.on_device(torch.tensor([0, 3, 7]), meta, torch.int32) is first
    assert len(copies.copies) == 2
    host = torch.tensor([0, 5])
    assert varlen.on_device(host, host.device) is host  # already there: no copy, no cache


@pytest.mark.parametrize("name", list(TABLE_BOUNDARIES))
def test_piece_bounds_match_the_python_construction(name):
    """Pieces of 128 tokens as sequences of their own: boundaries and the global index of their first 64-chunk."""
    cu = TABLE_BOUNDARIES[name]
    host = torch.tensor(cu)
    with poison_outputs():
        bounds, first_chunks, first = piece_bounds(host, host, 128, 64)
    starts, chunks, first_pieces, chunk = [], [], [], 0
    for start, end in zip(cu, cu[1:]):
        first_pieces.append(len(starts))
        for piece in range(start, end, 128):
            starts.append(piece)
            chunks.append(chunk + (piece - start) // 64)
        chunk += -(-(end - start) // 64)
    assert bounds.dtype == torch.int64 and bounds.tolist() == starts + [cu[-1]]
    assert first_chunks.dtype == torch.int32 and first_chunks.tolist() == chunks
    assert first.tolist() == first_pieces


# --------------------------------------------------------------------------- context-parallel split (Triton)

SPLIT_CU = torch.tensor([0, 10, 10, 200, 330])  # a short, an empty, a 3-chunk and a 3-chunk sequence
# weak decay (about e^-0.2 over a 128-step segment): with the default decay a segment forgets the state it was entered
# with below fp32 rounding, and a wrong chain of the segment maps would go unseen
SPLIT_DECAY_SHIFT = 7.0
# split and whole walks round differently: up to 1.0e-6 apart (dg, whose sums cancel, at K = 128; each walk 5e-7 to
# 1e-6 from float64 there), while a chain of segment maps that is 0.1% off moves o and every gradient by ~1e-3
SPLIT_VS_WHOLE = 1e-5
SPLIT_CASES = {  # shape: (B, T, H, HV, K, V); segments of `segment` chunks
    # 5 chunks a sequence in segments of 2: 2, 2 and a partial one
    "T260-B2-GVA-l2norm-seg2": dict(shape=(2, 260, 1, 2, 16, 16), segment=2, options=dict(use_qk_l2norm_in_kernel=True)),
    "varlen-state-final-seg2": dict(shape=(1, 330, 1, 2, 16, 16), segment=2, state=True, sequences=4,
                                    options=dict(cu_seqlens=SPLIT_CU, output_final_state=True)),
    "K128-V64-state-final-seg1": dict(shape=(1, 200, 1, 1, 128, 64), segment=1, state=True,  # several V and M blocks
                                      options=dict(output_final_state=True, use_qk_l2norm_in_kernel=True)),
}  # fmt: skip


def _triton_outputs_and_grads(inputs, options, segment_chunks):
    """o, the final state (when asked) and every gradient, through the Triton kernels cut into segments."""
    with poison_outputs():
        o, state = triton_chunk(inputs, gdr_triton.Tuning(segment_chunks=segment_chunks), **options)
        outputs = [o] if state is None else [o, state]
        gen = torch.Generator().manual_seed(1)
        grads = torch.autograd.grad(
            outputs, list(inputs.values()), [torch.randn(x.shape, generator=gen) for x in outputs]
        )
    return outputs, grads


@pytest.mark.parametrize("name", list(SPLIT_CASES))
@pytest.mark.slow
def test_triton_split_matches_the_whole_walk_and_the_recurrence(name):
    """Forward, final state and every gradient: the split equals the whole-sequence walk up to fp32 rounding."""
    case = SPLIT_CASES[name] | {"decay_shift": SPLIT_DECAY_SHIFT}
    inputs = {n: x.requires_grad_() for n, x in _inputs(case, torch.float32).items()}
    outputs, grads = _triton_outputs_and_grads(inputs, case["options"], case["segment"])
    whole_outputs, whole_grads = _triton_outputs_and_grads(inputs, case["options"], 0)
    labels = ["o", "final_state"] + [f"d{n}" for n in inputs]
    for label, split, whole in zip(labels, outputs + list(grads), whole_outputs + list(whole_grads)):
        assert_close(f"{label} (split vs whole)", split, whole, SPLIT_VS_WHOLE)
    twin = doubled(inputs)
    refs = [r for r in call(FUNCTIONS["recurrent"], twin, "torch", **case["options"]) if r is not None]
    gen = torch.Generator().manual_seed(1)
    ref_grads = torch.autograd.grad(
        refs, list(twin.values()), [torch.randn(r.shape, generator=gen).double() for r in refs]
    )
    for label, split, ref in zip(labels, outputs + list(grads), refs + list(ref_grads)):
        assert_close(f"{label} (split vs float64 recurrence)", split, ref, 1e-4)


def test_fixed_length_segments_are_numbered_as_sequences_of_their_own():
    """B=2, T=450 (8 chunks each) in segments of 3 chunks: boundaries every 192 tokens within each sequence."""
    x = make_inputs(2, 450, 1, 1, 16, 16)
    chunks = gdr_triton.Chunks.of(x["v"], None)
    with poison_outputs():
        segments = gdr_triton.split(chunks, x["q"], x["v"], None, forced=3)
        parts = gdr_shared.segment_chunks(segments, chunks.total)
    assert parts.cu.tolist() == [0, 192, 384, 450, 642, 834, 900]
    assert parts.offsets.tolist() == [0, 3, 6, 8, 11, 14]
    assert segments.first.tolist() == [0, 3]
    assert (parts.n, parts.total, segments.tokens) == (6, 16, 192)


def test_the_occupancy_rule_splits_only_few_long_walks():
    def rule(n, per_sequence, programs):
        return gdr_split.split_length(n, per_sequence, n * per_sequence, programs=programs, sms=132)  # an H100

    assert rule(1, 1024, programs=2) == 16  # ~sqrt(1024) / 2 balances the chain
    assert rule(1, 64, programs=2) == 4
    assert rule(2, 4096, programs=4) == 63  # enough segments to fill the SMs
    assert rule(33, 64, programs=66) == 16  # 4 segments per sequence
    assert rule(34, 64, programs=67) == 0  # fewer than 4: not worth it
    assert rule(1, 4, programs=1) == 0  # one segment would hold it all


# --------------------------------------------------------------------------- dispatch reasons


def test_gradients_through_the_triton_recurrent_kernel_fall_back_to_torch_with_a_warning():
    inputs = {n: x.requires_grad_() for n, x in make_inputs(1, 5, 1, 1, 16, 16).items()}
    phrase = "recurrent kernels are forward-only"
    with pytest.warns(BackendFallbackWarning, match=phrase):
        o, _ = call(fused_recurrent_gated_delta_rule, inputs, "triton")
    o.sum().backward()  # the torch reference ran: gradients flow
    assert all(x.grad is not None for x in inputs.values())
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match=phrase):
        call(fused_recurrent_gated_delta_rule, inputs, "triton")


def test_kernel_reasons_name_the_problem():
    cases = [
        ("tilelang", make_inputs(1, 4, 1, 1, 24, 16), "K \\(the q/k head dim\\) is 24; the tilelang kernels take"),
        ("triton", make_inputs(1, 4, 1, 1, 24, 16), "K \\(the q/k head dim\\) is 24"),
        ("triton", make_inputs(1, 4, 1, 1, 16, 256), "V \\(the v head dim\\) is 256"),
        ("triton", make_inputs(1, 4, 1, 1, 16, 16, dtype=torch.float64), "q has dtype float64"),
    ]
    for backend, inputs, message in cases:
        for function in FUNCTIONS.values():
            with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError, match=message):
                call(function, inputs, backend)


def test_auto_picks_triton_under_the_interpreter_and_torch_when_it_cannot():
    from runtime.accelerators.backends import select_backend
    from runtime.accelerators.gated_delta_rule import SPEC

    x = make_inputs(1, 4, 1, 1, 16, 16)
    common = dict(g=x["g"], beta=x["beta"], initial_state=None, mode="chunk")
    assert select_backend(SPEC, "auto", x["q"].device, 1, q=x["q"], v=x["v"], needs_grad=False, **common) == "triton"
    assert select_backend(SPEC, "auto", x["q"].device, 2, q=x["q"], v=x["v"], needs_grad=True, **common) == "triton"
    common["mode"] = "recurrent"  # forward-only kernels
    assert select_backend(SPEC, "auto", x["q"].device, 3, q=x["q"], v=x["v"], needs_grad=True, **common) == "torch"


# --------------------------------------------------------------------------- input errors


def _base():
    return make_inputs(1, 8, 2, 4, 16, 16)


ERRORS = {
    "q-not-4d": (lambda x: x.update(q=x["q"][0]), ValueError, "q: expected \\[B, T, H, K\\]"),
    "k-shape": (lambda x: x.update(k=x["k"][:, :, :1]), ValueError, "k: expected the shape of q"),
    "v-shape": (lambda x: x.update(v=x["v"][:, :7]), ValueError, "v: expected \\[B, T, HV, V\\]"),
    "HV-not-multiple": (lambda x: x.update(v=x["v"][:, :, :3], g=x["g"][..., :3], beta=x["beta"][..., :3]), ValueError,
                        "HV=3 must be a multiple of the q/k heads H=2"),
    "g-shape": (lambda x: x.update(g=x["g"][..., :2]), ValueError, "g: expected shape \\[B, T, HV\\]"),
    "beta-shape": (lambda x: x.update(beta=x["beta"][:, :4]), ValueError, "beta: expected shape \\[B, T, HV\\]"),
    "v-dtype": (lambda x: x.update(v=x["v"].half()), TypeError, "v: expected the dtype of q"),
    "g-integer": (lambda x: x.update(g=x["g"].long()), TypeError, "g: expected a floating-point tensor"),
    "state-shape": (lambda x: x.update(initial_state=torch.zeros(1, 4, 16, 8)), ValueError,
                    "initial_state: expected shape \\[N, HV, K, V\\] = \\(1, 4, 16, 16\\)"),
    "scale-type": (lambda x: x.update(scale="big"), TypeError, "scale: expected a float > 0 or None, got str"),
    "scale-zero": (lambda x: x.update(scale=0.0), ValueError, "scale: expected a finite float > 0 or None, got 0.0"),
    "scale-negative": (lambda x: x.update(scale=-1), ValueError, "scale: expected a finite float > 0 or None, got -1"),
    "scale-nan": (lambda x: x.update(scale=float("nan")), ValueError, "scale: expected a finite float > 0 .*got nan"),
    "scale-inf": (lambda x: x.update(scale=float("inf")), ValueError, "scale: expected a finite float > 0 .*got inf"),
    "final-state-not-bool": (lambda x: x.update(output_final_state="yes"), TypeError,
                             "output_final_state: expected a bool \\(True or False\\), got str"),
    "l2norm-not-bool": (lambda x: x.update(use_qk_l2norm_in_kernel=1), TypeError,
                        "use_qk_l2norm_in_kernel: expected a bool \\(True or False\\), got int"),
    "cu-not-increasing": (lambda x: x.update(cu_seqlens=torch.tensor([0, 6, 3, 8])), ValueError, "non-decreasing"),
    "cu-not-from-0": (lambda x: x.update(cu_seqlens=torch.tensor([1, 8])), ValueError, "cu_seqlens: expected to start at 0"),
    "cu-not-to-T": (lambda x: x.update(cu_seqlens=torch.tensor([0, 7])), ValueError, "cu_seqlens: expected to end at T=8"),
    "cu-float": (lambda x: x.update(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens: expected a 1-D integer"),
    "cu-too-short": (lambda x: x.update(cu_seqlens=torch.tensor([0])), ValueError, "N \\+ 1 >= 2 boundaries"),
    "cu-state-count": (lambda x: x.update(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 4, 16, 16)),
                       ValueError, "\\(2, 4, 16, 16\\) \\(N = the number of sequences in cu_seqlens\\)"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ERRORS))
@pytest.mark.parametrize("function", ["chunk", "recurrent"])
def test_bad_input_errors_name_the_argument(function, name):
    edit, error, message = ERRORS[name]
    x = _base()
    edit(x)
    args = [x.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(error, match=message):
        FUNCTIONS[function](*args, **x)


# --------------------------------------------------------------------------- torch.compile with cu_seqlens


def _packed(function, backend, q, k, v, g, beta, state, cu_seqlens):
    return function(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, backend=backend,
    )  # fmt: skip


@pytest.mark.parametrize("function", ["chunk", "recurrent"])
@pytest.mark.slow
def test_compiled_full_graph_with_cu_seqlens_on_triton(function):
    """The boundaries' values are checked where they exist: eagerly before the launch, in a compiled call by the
    custom op at run time (nothing branches on them while tracing)."""
    x = make_inputs(1, 70, 2, 2, 16, 16, state=True, sequences=3)
    leaves = [x[n].requires_grad_(function == "chunk") for n in ("q", "k", "v", "g", "beta", "initial_state")]
    cu_seqlens = torch.tensor([0, 13, 13, 70])
    run = lambda *args: _packed(FUNCTIONS[function], "triton", *args)  # noqa: E731
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    with use_accelerators(fallback="error"):
        outputs, expected = compiled(*leaves, cu_seqlens), run(*leaves, cu_seqlens)
        for name, out, ref in zip(("o", "final_state"), outputs, expected):
            torch.testing.assert_close(out, ref, msg=lambda m, name=name: f"{name}: {m}")
        if function == "chunk":
            grads = torch.autograd.grad(sum(o.sum() for o in outputs), leaves)
            for i, (grad, ref) in enumerate(zip(grads, torch.autograd.grad(sum(o.sum() for o in expected), leaves))):
                torch.testing.assert_close(grad, ref, msg=lambda m, i=i: f"gradient {i}: {m}")
        # new boundaries reuse the graph; bad ones are rejected at run time as eagerly
        outputs = compiled(*leaves, torch.tensor([0, 40, 50, 70]))
        torch.testing.assert_close(outputs[0], run(*leaves, torch.tensor([0, 40, 50, 70]))[0])
        for bad, message in (([0, 50, 40, 70], "non-decreasing"), ([1, 13, 40, 70], "expected to start at 0"),
                             ([0, 13, 40, 69], "expected to end at T=70")):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                compiled(*leaves, torch.tensor(bad))


def test_compiled_full_graph_with_cu_seqlens_on_torch_says_what_to_do():
    x = make_inputs(1, 20, 1, 1, 16, 16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [None, torch.tensor([0, 7, 20])]
    run = lambda *args: _packed(chunk_gated_delta_rule, "torch", *args)  # noqa: E731
    with pytest.raises(Exception, match="backend='triton' or 'tilelang'"):
        torch.compile(run, backend="aot_eager", fullgraph=True)(*args)
    # without fullgraph the call runs eagerly
    torch.testing.assert_close(torch.compile(run, backend="aot_eager")(*args)[0], run(*args)[0])


def test_batch_above_one_with_cu_seqlens_is_an_error():
    x = make_inputs(2, 8, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="batch size must be 1, got B=2"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=torch.tensor([0, 8]))


def test_launch_grids_fit_cuda_limits_at_a_large_batch(monkeypatch):
    # CUDA caps grid y and z at 65535 blocks: sequences x heads (here 20000 x 4) must go on x
    from triton.runtime.interpreter import InterpretedFunction

    grids = []
    monkeypatch.setattr(
        InterpretedFunction, "run", lambda kernel, *args, grid, **kwargs: grids.append((kernel.fn.__name__, grid))
    )
    inputs = make_inputs(20000, 1, 4, 4, 16, 16)
    for name in ("q", "k", "v", "g", "beta"):
        inputs[name].requires_grad_()
    with use_accelerators(fallback="error"):
        with torch.no_grad():  # the recurrent kernel is forward-only
            fused_recurrent_gated_delta_rule(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), backend="triton")
        o, _ = chunk_gated_delta_rule(*(inputs[n] for n in ("q", "k", "v", "g", "beta")), backend="triton")
        o.sum().backward()  # the kernels do not run here: only their grids are recorded
    assert len({name for name, _ in grids}) >= 6, grids
    for name, grid in grids:
        assert all(size <= 65535 for size in tuple(grid)[1:]), f"{name}: grid {grid}"


@pytest.mark.parametrize("case", ["unit-keys", "l2norm-keys", "raw-keys", "full-decay"])
def test_column_inverse_of_the_tilelang_prepare_matches_float64(case):
    """reference.unit_lower_inverse_by_columns, the TileLang prepare kernel's algorithm: exact in float64, and in
    fp32 (the kernel's arithmetic) within a bound far below the bf16 rounding of the products that take it."""
    from runtime.accelerators.gated_delta_rule.reference import FULL_DECAY, unit_lower_inverse_by_columns

    n, K = 64, 32
    gen = torch.Generator().manual_seed(1)
    if case == "unit-keys":  # identical unit keys, beta = 1, no decay: all ones below the diagonal
        k, beta, gamma = torch.ones(n, K) / K**0.5, torch.ones(n), torch.zeros(n)
    else:
        k = torch.randn(n, K, generator=gen)
        k = F.normalize(k, dim=-1) if case in ("l2norm-keys", "full-decay") else k * 0.3
        beta = torch.rand(n, generator=gen)
        gamma = torch.cumsum(F.logsigmoid(torch.randn(n, generator=gen) + 2.0), 0)
        if case == "full-decay":  # A is zero across it: two independent blocks
            gamma[37:] -= FULL_DECAY
    a = torch.tril(beta[:, None] * torch.exp(gamma[:, None] - gamma[None, :]) * (k @ k.T), -1).double()
    expected = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + a)
    assert_close("inverse float64", unit_lower_inverse_by_columns(a), expected, 1e-12)
    assert_close("inverse fp32", unit_lower_inverse_by_columns(a.float()), expected, 1e-6)


@pytest.mark.parametrize("case", ["plain", "l2norm-state-full-decay"])
def test_tilelang_backward_stages_match_autograd_in_float64(case):
    """reference.chunked_backward_stages, the TileLang backward's decompositions (folded l2norm factors, dA through
    dU U^T, dgamma by row and column sums and the last row): every gradient equals autograd of the recurrence."""
    from runtime.accelerators.gated_delta_rule.reference import chunked_backward_stages

    l2norm = case != "plain"
    B, T, H, K, V = 2, 128, 2, 16, 8
    x = {n: t.double() for n, t in make_inputs(B, T, H, H, K, V, state=l2norm, seed=3).items()}
    if l2norm:
        x["q"], x["k"] = x["q"] * 3.0, x["k"] * 0.5  # raw rows far from unit norm
        x["g"][0, 70, 1] = -200.0  # a full decay inside the second chunk
        x["g"][1, 127, 0] = -1e4  # and on a chunk's last row
    initial = x.pop("initial_state", None)
    scale = K**-0.5
    gen = torch.Generator().manual_seed(4)
    grad_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    if initial is not None:
        leaves["initial_state"] = initial.clone().requires_grad_()
    o, final = recurrent_gated_delta_rule_reference(
        *(leaves[n] for n in ("q", "k", "v", "g", "beta")), scale, leaves.get("initial_state"), True, l2norm
    )
    ((o * grad_o).sum() + (final * grad_final).sum()).backward()
    got = chunked_backward_stages(
        *(x[n] for n in ("q", "k", "v", "g", "beta")), scale, initial, grad_o, grad_final, l2norm
    )
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for name, value in zip(names, got):
        if name in leaves:
            assert_close(f"d{name}", value, leaves[name].grad, 1e-10)


def test_tilelang_backward_stages_with_bf16_operands_stay_inside_the_gpu_bounds():
    """reference.chunked_backward_stages in fp32 with every 16-bit operand and stored tensor of the TileLang kernels
    rounded to bf16 (products at every K on bf16 operands, as the Triton backward's at K = 128): each gradient within
    half the GPU tier's bound against float64 on the same bf16 inputs (about 3e-3 at every K of the GPU cases)."""
    from runtime.accelerators.gated_delta_rule.reference import chunked_backward_stages

    def bf16(x):
        return x.to(torch.bfloat16).to(x.dtype)

    B, T, H, K, V = 2, 128, 2, 32, 32
    x = {n: bf16(t) for n, t in make_inputs(B, T, H, H, K, V, state=True, seed=5).items()}
    x["initial_state"] = x["initial_state"].float()
    gen = torch.Generator().manual_seed(6)
    grad_o, grad_final = bf16(torch.randn(B, T, H, V, generator=gen)), torch.randn(B, H, K, V, generator=gen)
    leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
    o, final = recurrent_gated_delta_rule_reference(*args, K**-0.5, leaves["initial_state"], True, True)
    ((o * grad_o.double()).sum() + (final * grad_final.double()).sum()).backward()
    got = chunked_backward_stages(
        *(x[n] for n in ("q", "k", "v", "g", "beta")), K**-0.5, x["initial_state"], grad_o, grad_final, True, bf16
    )
    bounds = dict(q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2, initial_state=8e-3)
    for (name, bound), value in zip(bounds.items(), got):
        value = value if name == "initial_state" else bf16(value)  # dq..dbeta are returned in the inputs' dtype
        assert_close(f"d{name}", value.double(), leaves[name].grad, bound / 2)
