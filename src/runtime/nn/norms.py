"""RMSNorm and LayerNorm modules over the last dimension, on the backend the active accelerator config picks."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.layer_norm import layer_norm
from runtime.accelerators.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2, -1) + eps) * weight. `backend` pins one backend; None follows the active config."""

    def __init__(self, dim: int, eps: float = 1e-6, *, elementwise_affine: bool = True, backend: Backend | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        dim = None if self.weight is None else self.weight.shape[0]
        return f"{dim}, eps={self.eps}, backend={self.backend}"


class LayerNorm(nn.Module):
    """As nn.LayerNorm over the last dimension. `backend` pins one backend; None follows the active config."""

    def __init__(self, dim: int, eps: float = 1e-5, *, elementwise_affine: bool = True, bias: bool = True, backend: Backend | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        dim = None if self.weight is None else self.weight.shape[0]
        return f"{dim}, eps={self.eps}, backend={self.backend}"
