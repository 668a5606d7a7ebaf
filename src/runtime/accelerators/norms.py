"""What the three row-norm ops (rms_norm, layer_norm, l2norm) share: checks and kernel reasons."""

from __future__ import annotations

import math

import torch

from .checks import check_eps, check_feature_param, check_rows, check_tensor, dtype_reasons

# widest row a kernel keeps in registers in one pass; wider rows go to torch
MAX_KERNEL_WIDTH = 16384


def check_norm_inputs(
    x: torch.Tensor, eps, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> None:
    # Every call: inputs that pass everything below pass this first test too, in one frame and few tensor attribute
    # reads (each a few hundred instructions); any other input goes through the checks that name what is wrong.
    if (
        type(x) is torch.Tensor
        and x.layout is torch.strided
        and x.is_floating_point()
        and x.dim()
        and type(eps) is float
        and 0.0 <= eps < math.inf
    ):
        width, device = x.shape[-1], x.device
        if width and _is_feature_param(weight, width, device) and _is_feature_param(bias, width, device):
            return
    check_tensor("x", x, min_dim=1)
    check_rows("x", x)
    check_feature_param("weight", weight, x)
    check_feature_param("bias", bias, x)
    check_eps(eps)


# A row whose largest |value| exceeds this is divided by it before its squares are summed, in every backend (fp32
# inputs near 1e30 have squares past fp32's 3.4e38; the TileLang kernels divide by a power of two within 4x of it,
# tilelang_common.scaled_squares). Below it the squares of the widest kernel row (2^14 values, each
# at most 2^100) add up to at most 2^114, and the row takes the plain formula exactly (a scale of 1).
SCALE_ABOVE = 2.0**50
# A row whose sum of squares is at most this has no |value| above SCALE_ABOVE (its scale is 1): the Triton kernels
# look for the largest |value| only in tiles with a row above it, so the common row pays one reduction, not two.
SQUARES_ABOVE = SCALE_ABOVE**2


def rsqrt_mean_square(x: torch.Tensor, eps: float, mean: bool = True) -> torch.Tensor:
    """rsqrt(mean (or sum) of x^2 over the last dim + eps), keepdim, as the kernels compute it: an fp32 row whose
    largest |x| is m > 2^50 (its squares could overflow) takes rsqrt(mean((x / m)^2) + eps / m^2) / m. The result
    does not depend on m, so m carries no gradient. Other rows, and float64, take the plain formula."""
    if x.dtype != torch.float32:
        squares = x.square()
        return torch.rsqrt((squares.mean(-1, keepdim=True) if mean else squares.sum(-1, keepdim=True)) + eps)
    m = x.detach().abs().amax(-1, keepdim=True)
    inv = 1.0 / torch.where(m > SCALE_ABOVE, m, torch.ones_like(m))
    squares = (x * inv).square()
    return (
        torch.rsqrt((squares.mean(-1, keepdim=True) if mean else squares.sum(-1, keepdim=True)) + eps * inv * inv) * inv
    )


def _is_feature_param(param, width: int, device: torch.device) -> bool:
    """Whether check_feature_param passes (None included)."""
    if param is None:
        return True
    return (
        isinstance(param, torch.Tensor)
        and param.layout is torch.strided
        and param.is_floating_point()
        and param.shape == (width,)
        and param.device == device
    )


def norm_reasons(backend: str, x: torch.Tensor, weight=None, bias=None) -> list[str]:
    reasons = dtype_reasons("x", x)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            reasons += dtype_reasons(name, param)
    if x.shape[-1] > MAX_KERNEL_WIDTH:
        reasons.append(
            f"the row width {x.shape[-1]} exceeds {MAX_KERNEL_WIDTH}, the widest the norm kernels hold in one pass"
        )
    return reasons


def norm_key(x: torch.Tensor, weight=None, bias=None) -> tuple:
    """Everything norm_reasons reads: the decision cache key."""
    return (
        x.dtype,
        x.shape[-1] > MAX_KERNEL_WIDTH,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
    )


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D row-contiguous [rows, width] tensor (a copy only when x's last dim is strided)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
