"""BCE with logits in plain torch (fp32 math, float64 for float64 inputs): always available, differentiable.

    loss = weight * ((1 - y) * x + (1 + (pos_weight - 1) * y) * softplus(-x))

which is -weight * (pos_weight * y * log(sigmoid(x)) + (1 - y) * log(1 - sigmoid(x))) written so
that it stays finite for any |x| (softplus(-x) = -logsigmoid(x)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("none", "mean", "sum")


def loss_dtype(logits: torch.Tensor, targets: torch.Tensor, weight=None, pos_weight=None) -> torch.dtype:
    """The loss dtype: the promotion of every tensor argument's dtype. Torch (2.13) gives the targets' dtype where
    they are narrower than the logits (fp32 logits, bf16 targets: a bf16 loss); the promotion keeps the wider one."""
    dtype = logits.dtype
    for operand in (targets, weight, pos_weight):
        if operand is not None and operand.dtype != dtype:  # equal dtypes promote to themselves
            dtype = torch.promote_types(dtype, operand.dtype)
    return dtype


def bce_with_logits_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    out_dtype = loss_dtype(logits, targets, weight, pos_weight)
    compute = torch.promote_types(out_dtype, torch.float32)
    x, y = logits.to(compute), targets.to(compute)
    softplus_neg = -F.logsigmoid(x)
    if pos_weight is None:
        loss = (1 - y) * x + softplus_neg
    else:
        loss = (1 - y) * x + (1 + (pos_weight.to(compute) - 1) * y) * softplus_neg
    if weight is not None:
        loss = loss * weight.to(compute)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    return loss.to(out_dtype)
