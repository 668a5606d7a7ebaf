"""RMSNorm in plain torch (fp32 math; float64 stays float64): always available, CPU-safe, differentiable by autograd."""

import torch

from ..checks import compute_dtype
from ..norms import rsqrt_mean_square


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    xf = x.to(compute_dtype(x))
    y = xf * rsqrt_mean_square(xf, eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)
