"""gelu and silu in plain torch, as torch computes them: CPU-safe, differentiable by autograd."""

import torch
import torch.nn.functional as F


def gelu_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)
