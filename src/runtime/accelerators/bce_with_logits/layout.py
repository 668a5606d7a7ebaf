"""The bce kernels' argument layout, shared by triton.py and tilelang.py (and the package, which prepares it).

Logits and targets are read as flat contiguous arrays of N elements. `weight` and `pos_weight` are passed in their
own (small) shape when their broadcast to the logits can be expressed as one index map,

    operand value at flat logits index i  =  operand.flatten()[(i // inner) % count]

which covers full tensors (inner 1, count N), per-class vectors [C] (inner 1, count C), per-row
weights [B, 1] (inner C, count B), scalars and any broadcast over leading and trailing dims.
Other broadcasts (e.g. [B, 1, C] against [B, H, C]) are materialised to the logits' shape first.

A forward may also write the logits' fp32 gradient for an incoming gradient of one (the unit gradient), which
backward scales: the op's second KernelOp (the package's UNIT_GRADIENT_KERNEL), whose backward, the same for both
backends, eager and compiled, is unit_gradient_backward.
"""

from __future__ import annotations

import math

import torch

from .. import buffers

# how a kernel reads weight / pos_weight
ABSENT, FULL, BROADCAST = 0, 1, 2


def broadcast_layout(operand: torch.Tensor, shape: torch.Size) -> tuple[int, int] | None:
    """(inner, count) such that operand broadcast to `shape`, flattened, is operand.flatten()[(i // inner) % count].

    None when the broadcast is not of that form (a broadcast dimension between two kept ones).
    """
    sizes = [1] * (len(shape) - operand.dim()) + list(operand.shape)
    kept = [d for d, size in enumerate(sizes) if size > 1]
    if not kept:
        return 1, 1
    first, last = kept[0], kept[-1] + 1
    if any(sizes[d] != shape[d] for d in range(first, last)):
        return None
    return math.prod(shape[last:]), math.prod(shape[first:last])


def operand_mode(operand: torch.Tensor | None, shape: torch.Size) -> tuple[int, int, int]:
    """(mode, inner, count) of a kernel operand prepared by `kernel_operand`."""
    if operand is None:
        return ABSENT, 1, 1
    inner, count = broadcast_layout(operand, shape)
    if inner == 1 and count == math.prod(shape):
        return FULL, 1, count
    return BROADCAST, inner, count


def kernel_operand(operand: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """weight / pos_weight as the kernels read it: contiguous, materialised only when no index map fits."""
    if operand is None:
        return None
    if broadcast_layout(operand, shape) is None:
        return operand.expand(shape).contiguous()
    return operand.contiguous()


def is_scalar_gradient(grad: torch.Tensor) -> bool:
    """A loss gradient that is one value everywhere (mean / sum, or `none` after loss.sum().backward()):
    the backward kernels then read that one value instead of N."""
    return grad.dim() == 0 or all(s == 0 for s in grad.stride())


def unit_gradient_buffer(logits: torch.Tensor) -> torch.Tensor:
    """Where a forward kernel writes the logits' fp32 gradient for an incoming gradient of one (logits-shaped)."""
    return buffers.empty_like(logits, dtype=torch.float32)  # empty_like: about 1 us less host time than torch.empty


def scale_unit_gradient(unit: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dlogits = grad * unit (fp32 math) in the logits' dtype: the backward of a forward that wrote the unit gradient."""
    if dtype == grad.dtype == torch.float32:  # the product has the logits' dtype: one ATen op, not two
        return torch.mul(unit, grad)
    return torch.mul(unit, grad, out=buffers.empty_like(unit, dtype=dtype))


def unit_gradient_backward(grad, logits, targets, weight, pos_weight, reduction, loss, unit) -> tuple:
    """The backward of both backends' unit-gradient forwards (KernelBackend convention: the incoming gradient, the
    forward's arguments, its results): the logits' gradient scaled from the unit gradient, no launch of a kernel of
    its own. It reads the logits' dtype alone; targets, weight and pos_weight arrive as None in eager calls (the op's
    unread_args), the loss always (backward_reads="saved")."""
    return scale_unit_gradient(unit, grad, logits.dtype), None, None, None, None
