"""LayerNorm in plain torch (fp32 math): always available, CPU-safe, differentiable by autograd."""

import torch


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    centred = xf - mean
    y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
