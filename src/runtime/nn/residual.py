"""Dropout on a branch plus the residual stream, as one op, and that sum followed by an RMSNorm as one op."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.add_norm import add_rms_norm
from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_probability
from runtime.accelerators.dropout_add import dropout_add

from .norms import RMSNorm


class DropoutAdd(nn.Module):
    """residual + dropout(x, p); dropout is active in training mode only.

    Under autocast the branch x comes out of a matmul in bf16 while the residual stream stays in the
    dtype it started in (fp32 embeddings): x is cast to the residual's dtype, as `residual + x` would.
    """

    def __init__(self, p: float = 0.0, *, backend: Backend | None = None) -> None:
        super().__init__()
        self.p = as_probability("p", p)
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return dropout_add(x.to(residual.dtype), residual, self.p, self.training, backend=self.backend)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = residual + dropout(x, p): one add_rms_norm (on the norm's backend) where dropout
        draws nothing (eval, or p == 0) and `norm` is this package's RMSNorm as built. Otherwise this module's
        dropout_add and then a call of `norm`: the random stream is the one the unfused `norm(self(x, residual))`
        draws, and a norm the user replaced (another class) or hooked (forward hooks) runs as such."""
        if (self.training and self.p > 0.0) or not _fusable(norm):
            total = self(x, residual)
            return norm(total), total
        return add_rms_norm(x.to(residual.dtype), residual, norm.weight, norm.eps, backend=norm.backend)

    def extra_repr(self) -> str:
        return f"p={self.p}, backend={self.backend}"


def _fusable(norm: nn.Module) -> bool:
    """The fused add_rms_norm reads norm's weight and eps in place of calling it: only for an RMSNorm itself (not a
    subclass, which may compute something else) without forward hooks, which a call would run."""
    return type(norm) is RMSNorm and not (norm._forward_hooks or norm._forward_pre_hooks)
