"""Benchmark cases of binary_cross_entropy_with_logits (op key bce_with_logits).

Large: 2^24 logits with the mean (the bandwidth target) and with reduction none.
PCVR: one logit per sample, batches of 4096 and 256 (launch-bound).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...accelerators.bce_with_logits import binary_cross_entropy_with_logits
from ...accelerators.bce_with_logits.reference import bce_with_logits_reference
from ..case import Case, tensor_bytes
from ..peers import compiled

SHAPES = {"16M": (2**24, "mean"), "16M-none": (2**24, "none"), "4096": (4096, "mean"), "256": (256, "mean")}


def _inputs(n: int):
    def make(device, dtype):
        return {
            "logits": (3 * torch.randn(n, device=device, dtype=dtype)).requires_grad_(),
            "targets": torch.rand(n, device=device, dtype=dtype),
        }

    return make


def _bytes(reduction: str):
    def count(inputs, mode: str) -> int:
        """fwd: read logits and targets, write the loss. bwd: read logits, targets and the loss gradient, write dlogits."""
        x, y = inputs["logits"], inputs["targets"]
        loss = x if reduction == "none" else x.new_empty(())
        if mode == "fwd":
            return tensor_bytes(x, y, loss)
        return tensor_bytes(x, y, loss, x)

    return count


def _torch_bce(logits, targets, reduction):
    return F.binary_cross_entropy_with_logits(logits, targets, reduction=reduction)


def _case(name: str, n: int, reduction: str) -> Case:
    return Case(
        op="bce_with_logits",
        shape=name,
        make_inputs=_inputs(n),
        run=lambda backend, i: binary_cross_entropy_with_logits(
            i["logits"], i["targets"], reduction=reduction, backend=backend
        ),
        reference=lambda i: bce_with_logits_reference(i["logits"], i["targets"], reduction=reduction),
        bytes=_bytes(reduction),
        peers={
            "torch eager": lambda i: _torch_bce(i["logits"], i["targets"], reduction),
            "torch.compile": lambda i: compiled(_torch_bce)(i["logits"], i["targets"], reduction),
        },
    )


CASES = [_case(name, n, reduction) for name, (n, reduction) in SHAPES.items()]
