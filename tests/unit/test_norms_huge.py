"""Row norms of fp32 inputs near 1e30 (their squares overflow fp32): the normalised rows, not zeros or NaN, forward and
every gradient, on the torch backend and the Triton kernels (under TRITON_INTERPRET=1, set by conftest)."""

import pytest
import torch

from huge_rows import ADD_NORMS, ROW_SCALES, check_add_norm_huge, huge_rows, reference64
from runtime.accelerators import l2norm, layer_norm, rms_norm, use_accelerators
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm, "l2norm": l2norm}


def check_huge(op, backend, width, offset=0.0, params=()):
    x = huge_rows(width, offset).float().requires_grad_()
    kwargs = {}
    if "weight" in params:
        kwargs["weight"] = (1 + 0.5 * torch.randn(width)).requires_grad_()
    if "bias" in params:
        kwargs["bias"] = torch.randn(width).requires_grad_()
    dy = torch.randn(x.shape)
    with use_accelerators(fallback="error"), poison_outputs():
        y = OPS[op](x, **kwargs, backend=backend)
        grads = torch.autograd.grad(y, [x, *kwargs.values()], dy)
    x64 = x.detach().double().requires_grad_()
    kwargs64 = {k: v.detach().double().requires_grad_() for k, v in kwargs.items()}
    y64 = reference64(op, x64, **kwargs64)
    grads64 = torch.autograd.grad(y64, [x64, *kwargs64.values()], dy.double())
    for row, scale in enumerate(ROW_SCALES):  # each row on its own: dx of a row scales as 1 / its size
        tag = f"{op} {backend} row x{scale:g}"
        assert_close(f"{tag} y", y[row], y64[row], RTOL[torch.float32])
        assert_close(f"{tag} dx", grads[0][row], grads64[0][row], gradient_tolerance(torch.float32))
    for name, grad, grad64 in zip(kwargs, grads[1:], grads64[1:]):
        assert_close(f"{op} {backend} d{name}", grad, grad64, gradient_tolerance(torch.float32))


@pytest.mark.parametrize("width", [37, 300])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", list(OPS))
def test_huge_rows_are_normalised(op, backend, width):
    check_huge(
        op, backend, width, params=() if op == "l2norm" else ("weight", "bias") if op == "layer_norm" else ("weight",)
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_norm_of_huge_rows_with_a_large_mean(backend):
    """Centred values near 1e30 overflow too, not only the raw ones."""
    check_huge("layer_norm", backend, 64, offset=3.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("op", list(OPS))
def test_ordinary_rows_are_unchanged_by_the_scaling(op, backend):
    """Rows below the scaling bound take the plain formula: the same bits as without it."""
    x = torch.randn(9, 53) * 1e4
    with use_accelerators(fallback="error"):
        y = OPS[op](x, backend=backend)
    xf = x if op != "layer_norm" else x - x.mean(-1, keepdim=True)
    squares = xf.square().sum(-1, keepdim=True) if op == "l2norm" else xf.square().mean(-1, keepdim=True)
    eps = 1e-5 if op == "layer_norm" else 1e-6
    plain = xf * torch.rsqrt(squares + eps)
    if backend == "torch":
        assert torch.equal(y, plain)
    else:
        assert_close(f"{op} y", y, plain, RTOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(ADD_NORMS))
def test_add_norm_of_huge_rows_is_normalised(name, backend):
    rows = huge_rows(300, offset=3.0 if name == "add_layer_norm" else 0.0).float()
    x = (rows / 2).requires_grad_()
    residual = (rows / 2).requires_grad_()
    params = {key: (1 + 0.5 * torch.randn(300)).requires_grad_() for key in ADD_NORMS[name][2]}
    check_add_norm_huge(name, backend, x, residual, params, RTOL[torch.float32], gradient_tolerance(torch.float32))
