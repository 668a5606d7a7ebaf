"""SwiGLU feed-forward: w_out(silu(x W_gate) * (x W_up)), with the gate and up projections in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.swiglu import swiglu


class SwiGLUFeedForward(nn.Module):
    """d_model -> hidden (gated) -> d_out (d_model when not given)."""

    def __init__(
        self, d_model: int, hidden: int, d_out: int | None = None, *, bias: bool = False, backend: Backend | None = None,
        device=None, dtype=None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=bias, **factory)
        self.down = nn.Linear(hidden, d_model if d_out is None else d_out, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(swiglu(gate, up, backend=self.backend))
