"""KernelOp's eager path: what it saves for backward, and the arguments the kernel module's backward gets."""

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators.dropout_add import KERNEL as DROPOUT_ADD
from runtime.accelerators.gated_delta_rule import CHUNK
from runtime.accelerators.layer_norm import KERNEL as LAYER_NORM
from runtime.accelerators.rms_norm import triton as rms_norm_triton


def test_arguments_come_back_in_schema_order():
    """Tensor arguments are saved, plain values kept on ctx; backward gets them back in the schema's order, also
    where values sit between tensors."""
    x, weight, bias, residual, seed = (torch.randn(2) for _ in range(5))
    assert LAYER_NORM.arguments((x, weight, bias), (1e-5,)) == (x, weight, bias, 1e-5)
    assert DROPOUT_ADD.arguments((x, residual, seed), (0.1,)) == (x, residual, 0.1, seed)
    q, k, v, g, beta, state, cu = (torch.randn(2) for _ in range(7))
    args = (q, k, v, g, beta, 0.5, state, True, False, cu)
    assert CHUNK.arguments(CHUNK.tensors_of(args), CHUNK.values_of(args)) == args


def test_backward_that_reads_no_output_gets_none_and_the_output_is_not_saved(monkeypatch):
    x = torch.randn(5, 48, requires_grad=True)
    weight = torch.randn(48, requires_grad=True)
    received = []
    backward = rms_norm_triton.backward
    monkeypatch.setattr(rms_norm_triton, "backward", lambda *args: received.append(args) or backward(*args))
    y = acc.rms_norm(x, weight, backend="triton")
    assert len(y.grad_fn.saved_tensors) == 3  # x, weight, rstd: not y
    grads = torch.autograd.grad(y, [x, weight], torch.randn_like(y))
    dy, x_, weight_, eps, y_, rstd = received[0]
    assert x_ is x and weight_ is weight and eps == 1e-6 and y_ is None and rstd.shape == (5,)
    expected = torch.autograd.grad(acc.rms_norm(x, weight, backend="torch"), [x, weight], dy)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bce_gradient_from_the_forward_twice(reduction):
    """The forward writes the unit gradient and backward scales it (fp32: one multiply): a second backward over the
    same graph (retain_graph) gives the same gradient, so backward does not scale the saved unit gradient in place."""
    logits, targets = torch.randn(7, requires_grad=True), torch.rand(7)
    loss = acc.binary_cross_entropy_with_logits(logits, targets, reduction=reduction, backend="triton")
    grad = torch.randn_like(loss)
    first = torch.autograd.grad(loss, logits, grad, retain_graph=True)[0]
    second = torch.autograd.grad(loss, logits, grad)[0]
    assert first.dtype == torch.float32 and torch.equal(first, second)
    reference = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction=reduction)
    expected = torch.autograd.grad(reference, logits, grad)[0]
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-7)
