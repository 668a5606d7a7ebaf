"""Gated delta rule on the GPU, the Triton backward's variants: each variant of its step 5 (triton_backward.GRAD_WY)
at every case, and its products on half-precision operands (HALF_BACKWARD) at the half cases, against the float64
recurrence with test_gated_delta_rule.py's bounds."""

import pytest

from gdr_checks import CASES, HALF_CASES, check_chunked_forward_and_every_gradient
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_grad_wy_variants_forward_and_every_gradient(name, grad_wy, monkeypatch):
    """The backward's step 5 as each variant at every K (triton_backward.GRAD_WY; the test above runs the default
    choice by K)."""
    monkeypatch.setattr(gdr_backward, "GRAD_WY", grad_wy)
    check_chunked_forward_and_every_gradient(name, "triton")


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_triton_half_backward_forward_and_every_gradient(name, grad_wy, monkeypatch):
    """triton_backward.HALF_BACKWARD forced on (the backward's products on bf16 operands, fp32 accumulation; by default
    on where step 5 runs fused), each variant of step 5 (the single one keeps tf32), every half-precision case: the
    same bounds."""
    monkeypatch.setattr(gdr_backward, "HALF_BACKWARD", True)
    monkeypatch.setattr(gdr_backward, "GRAD_WY", grad_wy)
    check_chunked_forward_and_every_gradient(name, "triton")
