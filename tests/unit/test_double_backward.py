"""Second derivatives through the kernel backends: a kernel backward is not recorded by autograd, so differentiating
its gradients again (after create_graph=True) raises an error naming the op, on every op (eager calls, the custom
ops that torch.compile runs, and compiled graphs), rather than giving wrong second derivatives."""

import functools

import pytest
import torch
from torch.utils._pytree import tree_leaves

import runtime.accelerators as acc
from runtime.accelerators.bce import KERNEL as BCE
from test_compile_ops import CASES, _run

DOUBLE_BACKWARD = r"double backward is not supported on the triton backend"

EXTRA_CASES = {
    # the eager path of a loss whose logits' gradient is written by the forward (targets need no gradient)
    "binary_cross_entropy_with_logits-unit-gradient": (
        lambda: (torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x, y, backend=backend),
    ),
    "binary_cross_entropy_with_logits-none": (
        lambda: (torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x, y, reduction="none", backend=backend),
    ),
    "embedding_bag_mean-sparse": (
        lambda: (torch.randn(40, 5, requires_grad=True), torch.randint(0, 40, (6, 3))),
        lambda backend, w, i: acc.embedding_bag_mean(w, i, sparse=True, backend=backend),
    ),
}
FORWARD_ONLY = ("fused_recurrent", "top_k")  # kernels that take no gradient: nothing to differentiate twice
DIFFERENTIABLE = {
    name: case for name, case in {**CASES, **EXTRA_CASES}.items() if not any(op in name for op in FORWARD_ONLY)
}


def _second_backward(fn, inputs):
    """A Hessian-vector product: the gradients of fn's weighted outputs with create_graph=True, then the gradient
    of their weighted sum."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    outputs = [o for o in tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    generator = torch.Generator().manual_seed(1)

    def randn_like(t):
        return torch.randn(t.shape, generator=generator).to(t.device, t.dtype)

    grads = torch.autograd.grad(outputs, leaves, [randn_like(o) for o in outputs], create_graph=True)
    dense = [g.to_dense() if g.is_sparse else g for g in grads]
    return torch.autograd.grad(sum((g * randn_like(g)).sum() for g in dense), leaves, allow_unused=True)


@pytest.mark.parametrize("case", sorted(DIFFERENTIABLE))
def test_eager_double_backward_names_the_op(case):
    make_inputs, fn = DIFFERENTIABLE[case]
    with acc.use_accelerators(fallback="error"), pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        _second_backward(functools.partial(fn, "triton"), make_inputs())


@pytest.mark.parametrize("case", ["binary_cross_entropy_with_logits-none", "swiglu"])
def test_double_backward_on_the_torch_backend_is_torchs(case):
    """The reference is differentiable twice: what the error message points to."""
    make_inputs, fn = DIFFERENTIABLE[case]
    inputs = make_inputs()
    got = _second_backward(functools.partial(fn, "torch"), inputs)
    doubled = [x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    expected = _second_backward(functools.partial(fn, "torch"), doubled)
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
    loss, _ = BCE._forward_op("triton", x, y, None, None, "none", False, False)
    (grad,) = torch.autograd.grad(loss.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"bce: " + DOUBLE_BACKWARD):
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
    _run(compiled, inputs)  # compiles, and runs a plain backward
    leaves = [x for x in inputs if x.requires_grad]
    with pytest.raises(RuntimeError, match="double backward|create_graph=False"):
        out = compiled(*inputs)
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
