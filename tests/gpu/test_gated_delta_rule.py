"""Gated delta rule on the GPU: the Triton kernels (chunked and recurrent forward, chunked backward) against
the float64 recurrent reference with the op's bounds (o and final state 5e-3 for half inputs, 1e-4 for
fp32; gradients dq/dk/dv/d(initial_state) 8e-3, dg/dbeta 2e-2 for half inputs, 2e-4 for fp32), and the
torch backend's forward and every gradient on CUDA. Triton 3.4-3.7 has miscompiled this kind of backward
elsewhere: every gradient is compared here, on the GPU machine's Triton. The Triton backward's variants are in
test_gated_delta_rule_variants.py and _split.py, the TileLang backend in _tilelang.py (four files, so that
the GPU tier runs them side by side: their kernels compile for minutes)."""

import pytest
import torch

from gdr_checks import (
    BOUND,
    CASES,
    FUNCTIONS,
    call,
    check_chunked_forward_and_every_gradient,
    check_forward_matches_the_float64_recurrence,
    make_inputs,
    reference,
)
from runtime.accelerators import use_accelerators
from runtime.accelerators.backends import BackendFallbackWarning
from runtime.accelerators.gated_delta_rule import fused_recurrent_gated_delta_rule
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule.reference import chunk_gated_delta_rule_reference
from runtime.accelerators.testing import assert_close, compiled_kernels


@pytest.mark.parametrize("function", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_forward_matches_the_float64_recurrence(function, name):
    check_forward_matches_the_float64_recurrence(function, name, "triton")


@pytest.mark.parametrize("name", list(CASES))
def test_triton_chunked_forward_and_every_gradient(name):
    check_chunked_forward_and_every_gradient(name, "triton")


@pytest.mark.parametrize("name", ["T63-K16-fp32", "T37-K32-V128-bf16-GVA-scale", "varlen-K128-bf16-GVA-state"])
def test_torch_backend_forward_and_every_gradient(name):
    check_chunked_forward_and_every_gradient(name, "torch")


def test_chunked_torch_backend_matches_the_recurrence_on_cuda_in_float64():
    x = make_inputs(2, 130, 2, 4, 32, 16, torch.float64, state=True)
    o, final = chunk_gated_delta_rule_reference(
        *(x[n] for n in ("q", "k", "v", "g", "beta")), None, x["initial_state"], True
    )
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


@pytest.mark.parametrize(
    "backend, dtype", [("triton", torch.float32), ("triton", torch.bfloat16), ("tilelang", torch.bfloat16)]
)
@pytest.mark.parametrize("function", ["chunk", "recurrent"])
def test_inductor_full_graph_with_cu_seqlens(function, backend, dtype):
    """cu_seqlens on the device: its values are checked by the custom op at run time, nothing branches on them while
    tracing; outputs and gradients equal eager ones."""
    x = make_inputs(1, 200, 2, 4, 64, 64, dtype, state=True, sequences=3)
    leaves = [x[n].requires_grad_(function == "chunk") for n in ("q", "k", "v", "g", "beta", "initial_state")]
    cu_seqlens = torch.tensor([0, 70, 70, 200], device="cuda")

    def run(q, k, v, g, beta, state, cu_seqlens):
        return FUNCTIONS[function](
            q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens, backend=backend,
        )  # fmt: skip

    torch._dynamo.reset()
    with use_accelerators(fallback="error"), torch._inductor.config.patch(force_disable_caches=True):
        expected = run(*leaves, cu_seqlens)
        outputs = torch.compile(run, backend="inductor", fullgraph=True)(*leaves, cu_seqlens)
        results, references = list(outputs), list(expected)
        if function == "chunk":
            results += torch.autograd.grad(sum(o.float().sum() for o in outputs), leaves)
            references += torch.autograd.grad(sum(o.float().sum() for o in expected), leaves)
    for i, (out, ref) in enumerate(zip(results, references)):
        assert_close(f"{function} {backend} result {i}", out, ref, BOUND[dtype])
