"""linear(x, weight, bias, activation) in plain torch, as eager torch computes it (F.linear in the input dtype, then
the activation): always available, CPU-safe, differentiable by autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "swiglu")
# the activations whose kernel backward reads the saved pre-activation (relu reads the output, None nothing)
SAVES_PREACT = ("gelu", "gelu_tanh", "silu", "swiglu")


def activate(preact: torch.Tensor, activation: str | None) -> torch.Tensor:
    """activation(preact); for "swiglu", preact holds the gate columns first, then the up columns."""
    if activation is None:
        return preact
    if activation == "relu":
        return F.relu(preact)
    if activation == "gelu":
        return F.gelu(preact)
    if activation == "gelu_tanh":
        return F.gelu(preact, approximate="tanh")
    if activation == "silu":
        return F.silu(preact)
    if activation == "swiglu":
        gate, up = preact.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    return activate(F.linear(x, weight, bias), activation)
