"""LayerNorm in plain torch (fp32 math; float64 stays float64): always available, CPU-safe, differentiable by autograd."""

import torch

from ..checks import compute_dtype
from ..norms import rsqrt_mean_square


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    xf = x.to(compute_dtype(x))
    mean = xf.mean(-1, keepdim=True)
    centred = xf - mean
    y = centred * rsqrt_mean_square(centred, eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)
