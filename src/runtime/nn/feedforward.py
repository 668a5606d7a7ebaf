"""SwiGLU feed-forward: w_out(silu(x W_gate) * (x W_up)), the gate and up projections and the SwiGLU in one op."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int

from .linear import Linear


class SwiGLUFeedForward(nn.Module):
    """d_model -> hidden (gated) -> d_out (d_model when not given).

    gate_up is one Linear with the swiglu epilogue: weight [2 * hidden, d_model], the gate rows first, then the up
    rows (the layout of the unfused nn.Linear this module had, so its checkpoints load unchanged). `backend` pins both
    projections; `down_backend` pins the output projection alone (a head's projection to one logit, which no kernel
    backend runs: they need a multiple of 8 outputs).
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        d_out: int | None = None,
        *,
        bias: bool = False,
        backend: Backend | None = None,
        down_backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        # checked here so that an error names this module's arguments, not the Linear's in_/out_features
        d_model = as_int("d_model", d_model, least=1, expected="a positive int")
        hidden = as_int("hidden", hidden, least=1, expected="a positive int")
        d_out = d_model if d_out is None else as_int("d_out", d_out, least=1, expected="None or a positive int")
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.gate_up = Linear(d_model, hidden, bias=bias, activation="swiglu", backend=backend, **factory)
        self.down = Linear(hidden, d_out, bias=bias, backend=down_backend or backend, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up(x))
