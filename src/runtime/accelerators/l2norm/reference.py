"""L2Norm in plain torch (fp32 math): always available, CPU-safe, differentiable by autograd."""

import torch


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
