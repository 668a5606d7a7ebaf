"""GELU and SiLU modules, on the backend the active accelerator config picks."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.activation import APPROXIMATIONS, gelu, silu
from runtime.accelerators.backends import Backend


class GELU(nn.Module):
    """As nn.GELU. `backend` pins one backend; None follows the active config."""

    def __init__(self, approximate: str = "none", *, backend: Backend | None = None) -> None:
        super().__init__()
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x, self.approximate, backend=self.backend)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, backend={self.backend}"


class SiLU(nn.Module):
    """As nn.SiLU. `backend` pins one backend; None follows the active config."""

    def __init__(self, *, backend: Backend | None = None) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu(x, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"
