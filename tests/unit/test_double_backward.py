"""Second derivatives through the kernel backends: a kernel backward is not recorded by autograd, so differentiating
its gradients again (after create_graph=True) raises an error naming the op, on every op (eager calls, the custom
ops that torch.compile runs, and compiled graphs), rather than giving wrong second derivatives."""

import functools

import pytest
import torch

import runtime.accelerators as acc
from op_cases import DIFFERENTIABLE, run_case, second_backward
from runtime.accelerators.bce_with_logits import KERNEL as BCE

DOUBLE_BACKWARD = r"double backward is not supported on the triton backend"


@pytest.mark.parametrize("case", sorted(DIFFERENTIABLE))
@pytest.mark.slow
def test_eager_double_backward_names_the_op(case):
    make_inputs, fn = DIFFERENTIABLE[case]
    with acc.use_accelerators(fallback="error"), pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        second_backward(functools.partial(fn, "triton"), make_inputs())


@pytest.mark.parametrize("case", ["binary_cross_entropy_with_logits-none", "swiglu"])
def test_double_backward_on_the_torch_backend_is_torchs(case):
    """The reference is differentiable twice: what the error message points to."""
    make_inputs, fn = DIFFERENTIABLE[case]
    inputs = make_inputs()
    got = second_backward(functools.partial(fn, "torch"), inputs)
    doubled = [x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    expected = second_backward(functools.partial(fn, "torch"), doubled)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5)


def test_plain_backward_after_a_double_backward_error_still_works():
    x, y = torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)
    loss = acc.binary_cross_entropy_with_logits(x, y, reduction="none", backend="triton")
    (grad,) = torch.autograd.grad(loss.sum(), x)
    torch.testing.assert_close(grad, torch.sigmoid(x.detach()) - y)


def test_the_custom_ops_double_backward_names_the_op():
    """The custom ops' autograd (what compiled graphs are traced through), called outside a compiled graph."""
    x, y = torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)
    loss = BCE._forward_op("triton", x, y, None, None, "none", False)
    (grad,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"bce_with_logits: " + DOUBLE_BACKWARD):
        torch.autograd.grad(grad.square().sum(), x)


@pytest.mark.parametrize("case", ["binary_cross_entropy_with_logits-none", "swiglu"])
def test_compiled_double_backward_is_an_error(case):
    """A compiled graph's backward is torch's (AOT autograd), which refuses a double backward itself: at the first
    backward (create_graph=True is refused where the graph donates buffers) or the second. (A second backward that
    asks only for the gradients of chosen inputs may not reach it: torch then reports them unused.)"""
    make_inputs, fn = DIFFERENTIABLE[case]
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(fn, "triton"), backend="aot_eager", fullgraph=True)
    inputs = make_inputs()
    run_case(compiled, inputs)  # compiles, and runs a plain backward
    leaves = [x for x in inputs if x.requires_grad]
    with pytest.raises(RuntimeError, match="double backward|create_graph=False"):
        out = compiled(*inputs)
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
