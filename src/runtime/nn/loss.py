"""Binary cross-entropy on logits, the PCVR training loss."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.bce_with_logits import binary_cross_entropy_with_logits
from runtime.accelerators.bce_with_logits.reference import REDUCTIONS


class BCEWithLogitsLoss(nn.Module):
    """As nn.BCEWithLogitsLoss. Logits are taken in float32 at least (a bf16 loss is too coarse to train on); float64
    stays float64. The loss follows the logits, whatever the pos_weight buffer's dtype (`.double()` or `.half()` of
    the module change it, not the loss), as in torch."""

    def __init__(
        self,
        pos_weight: float | None = None,
        reduction: str = "mean",
        *,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
        if pos_weight is not None and (isinstance(pos_weight, bool) or not isinstance(pos_weight, numbers.Real)):
            raise TypeError(f"pos_weight: expected a number or None, got {type(pos_weight).__name__}")
        self.reduction = reduction
        self.backend = backend
        weight = None if pos_weight is None else torch.tensor([float(pos_weight)], device=device, dtype=dtype)
        self.register_buffer("pos_weight", weight, persistent=False)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        pos_weight = self.pos_weight
        if pos_weight is not None and pos_weight.dtype != dtype:
            pos_weight = pos_weight.to(dtype)
        return binary_cross_entropy_with_logits(
            logits.to(dtype),
            targets.to(dtype),
            pos_weight=pos_weight,
            reduction=self.reduction,
            backend=self.backend,
        )
