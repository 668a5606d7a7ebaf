"""Linear: nn.Linear with a fused activation, on the backend the active accelerator config picks."""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int
from runtime.accelerators.linear import linear
from runtime.accelerators.linear.reference import ACTIVATIONS


class Linear(nn.Module):
    """act(x @ weight^T + bias), with nn.Linear's parameters, initialisation and state_dict keys.

    activation: None, "relu", "gelu", "gelu_tanh", "silu" or "swiglu". For "swiglu" out_features is F and the weight
    is [2F, in_features] (gate rows first, then up rows; bias [2F]). `backend` pins one backend; None follows the
    active config.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
        *,
        backend: Backend | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
        self.in_features = as_int("in_features", in_features, least=0, expected="an int >= 0")
        self.out_features = out_features = as_int("out_features", out_features, least=0, expected="an int >= 0")
        self.activation = activation
        self.backend = backend
        rows = 2 * out_features if activation == "swiglu" else out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(rows, self.in_features, **factory))
        self.bias = nn.Parameter(torch.empty(rows, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Linear: kaiming-uniform weight, bias uniform in +-1/sqrt(in_features)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.activation, backend=self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"activation={self.activation!r}, backend={self.backend}"
        )
