"""Gated delta rule on the GPU, the Triton backward's variants: each variant of its step 5 (Tuning.grad_wy) at every
case, and its products on half-precision operands (Tuning.half_backward) at the half cases, against the float64
recurrence with test_gated_delta_rule.py's bounds."""

import pytest

from gdr_checks import CASES, HALF_CASES, check_chunked_forward_and_every_gradient
from runtime.accelerators.gated_delta_rule.triton import Tuning


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_grad_wy_variants_forward_and_every_gradient(name, grad_wy):
    """The backward's step 5 as each variant at every K (the test above runs the default choice by K)."""
    check_chunked_forward_and_every_gradient(name, "triton", Tuning(grad_wy=grad_wy))


@pytest.mark.parametrize("grad_wy", ["single", "fused"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_triton_half_backward_forward_and_every_gradient(name, grad_wy):
    """Tuning.half_backward forced on (the backward's products on bf16 operands, fp32 accumulation; by default on
    where step 5 runs fused), each variant of step 5 (the single one keeps tf32), every half-precision case: the same
    bounds."""
    check_chunked_forward_and_every_gradient(name, "triton", Tuning(grad_wy=grad_wy, half_backward=True))
