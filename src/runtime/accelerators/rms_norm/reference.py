"""RMSNorm in plain torch (fp32 math): always available, CPU-safe, differentiable by autograd."""

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
