"""add_rms_norm / add_layer_norm in plain torch: the sum in the inputs' dtype (as eager torch adds), then the norm's
reference on it (fp32 math; float64 stays float64). Always available, CPU-safe, differentiable by autograd."""

import torch

from ..layer_norm.reference import layer_norm_reference
from ..rms_norm.reference import rms_norm_reference


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return layer_norm_reference(total, weight, bias, eps), total
