"""What the three row-norm ops (rms_norm, layer_norm, l2norm) share: checks and kernel reasons."""

from __future__ import annotations

import math

import torch

from .checks import check_eps, check_feature_param, check_rows, check_tensor, dtype_reasons

# widest row a kernel keeps in registers in one pass; wider rows go to torch
MAX_KERNEL_WIDTH = 16384


def check_norm_inputs(x: torch.Tensor, eps, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
    # Every call: inputs that pass everything below pass this first test too, in one frame and few tensor attribute
    # reads (each a few hundred instructions); any other input goes through the checks that name what is wrong.
    if type(x) is torch.Tensor and x.is_floating_point() and x.dim() and type(eps) is float and 0.0 <= eps < math.inf:
        width, device = x.shape[-1], x.device
        if width and _is_feature_param(weight, width, device) and _is_feature_param(bias, width, device):
            return
    check_tensor("x", x, min_dim=1)
    check_rows("x", x)
    check_feature_param("weight", weight, x)
    check_feature_param("bias", bias, x)
    check_eps(eps)


def _is_feature_param(param, width: int, device: torch.device) -> bool:
    """Whether check_feature_param passes (None included)."""
    if param is None:
        return True
    return isinstance(param, torch.Tensor) and param.is_floating_point() and param.shape == (width,) and param.device == device


def norm_reasons(backend: str, x: torch.Tensor, weight=None, bias=None) -> list[str]:
    reasons = dtype_reasons("x", x)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            reasons += dtype_reasons(name, param)
    if x.shape[-1] > MAX_KERNEL_WIDTH:
        reasons.append(f"the row width {x.shape[-1]} exceeds {MAX_KERNEL_WIDTH}, the widest the norm kernels hold in one pass")
    return reasons


def norm_key(x: torch.Tensor, weight=None, bias=None) -> tuple:
    """Everything norm_reasons reads: the decision cache key."""
    return (x.dtype, x.shape[-1] > MAX_KERNEL_WIDTH, None if weight is None else weight.dtype, None if bias is None else bias.dtype)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D row-contiguous [rows, width] tensor (a copy only when x's last dim is strided)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
