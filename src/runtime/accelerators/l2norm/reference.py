"""L2Norm in plain torch (fp32 math; float64 stays float64): always available, CPU-safe, differentiable by autograd."""

import torch

from ..checks import compute_dtype
from ..norms import rsqrt_mean_square


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.to(compute_dtype(x))
    return (xf * rsqrt_mean_square(xf, eps, mean=False)).to(x.dtype)
