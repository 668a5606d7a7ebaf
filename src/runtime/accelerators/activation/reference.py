"""gelu and silu in plain torch, as torch computes them: CPU-safe, differentiable by autograd."""

import torch
import torch.nn.functional as F

# what the kernels compute (the formulas are in activation/triton.py)
SILU, GELU, GELU_TANH = 0, 1, 2
SQRT_HALF = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
SQRT_2_OVER_PI = 0.7978845608028654
TANH_CUBIC = 0.044715


def gelu_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)
