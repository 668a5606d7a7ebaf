"""Rows near 1e30 (their squares overflow fp32) for the row norms' tests on both tiers: the rows, a float64 reference
of each norm, and the check of add_rms_norm / add_layer_norm on them."""

import torch

from norm_reference import reference64
from runtime.accelerators import add_layer_norm, add_rms_norm, use_accelerators
from runtime.accelerators.testing import assert_close

# rows of ordinary size between huge ones, so that a tile holds both kinds
ROW_SCALES = [1e30, 1.0, 3e28, 1e32, 0.01, 2e31, 1e16]
# add-norm op -> (function, the norm it applies, its parameters)
ADD_NORMS = {
    "add_rms_norm": (add_rms_norm, "rms_norm", ("weight",)),
    "add_layer_norm": (add_layer_norm, "layer_norm", ("weight", "bias")),
}


def huge_rows(width: int, offset: float = 0.0, device: str = "cpu") -> torch.Tensor:
    """float64 rows of randn times each scale of ROW_SCALES; `offset` (relative) moves each row's mean from zero."""
    scales = torch.tensor(ROW_SCALES, dtype=torch.float64, device=device)[:, None]
    return (torch.randn(len(ROW_SCALES), width, dtype=torch.float64, device=device) + offset) * scales


def check_add_norm_huge(name, backend, x, residual, params, rtol, gradient_rtol):
    """norm(x + residual) of rows near 1e30 and the sum: y against float64 of the rounded sum, the sum exact, and the
    gradient reaching x and residual (through y and through the sum) against float64."""
    function, norm, _ = ADD_NORMS[name]
    dy, dnew = torch.randn_like(x), torch.randn_like(x)
    with use_accelerators(fallback="error"):
        y, total = function(x, residual, **params, backend=backend)
        grads = torch.autograd.grad((y, total), [x, residual, *params.values()], (dy, dnew))
    assert torch.equal(total, x.detach() + residual.detach())
    total64 = total.detach().double().requires_grad_()
    params64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    y64 = reference64(norm, total64, **params64)
    grads64 = torch.autograd.grad(y64, [total64, *params64.values()], dy.double())
    dtotal64 = grads64[0] + dnew.double()
    for row, scale in enumerate(ROW_SCALES):
        tag = f"{name} {backend} {x.dtype} {x.shape[-1]} row x{scale:g}"
        assert_close(f"{tag} y", y[row], y64[row], rtol)
        assert_close(f"{tag} dx", grads[0][row], dtotal64[row], gradient_rtol)
        assert_close(f"{tag} dresidual", grads[1][row], dtotal64[row], gradient_rtol)
    for key, grad, grad64 in zip(params, grads[2:], grads64[1:]):
        assert_close(f"{name} {backend} d{key}", grad, grad64, gradient_rtol)
