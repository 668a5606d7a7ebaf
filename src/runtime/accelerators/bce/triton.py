"""BCE with logits in Triton: a one-pass forward and a one-pass backward over the flat logits.

The mean / sum reductions are deterministic: each program writes the fp32 sum of its block to a
partials buffer, then one program adds the partials in a fixed order (no atomics), so the same
inputs give the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import is_scalar_gradient, operand_mode
from .reference import loss_dtype

BLOCK = 4096  # elements per program (forward and backward)
NUM_WARPS = 8
SUM_BLOCK = 1024  # partials added per step by the final reduction


@triton.jit
def _operand(ptr, offs, mask, inner, count, MODE: tl.constexpr):
    """weight / pos_weight at flat logits indices `offs` (see the package docstring for the index map)."""
    if MODE == 1:  # FULL (see ABSENT, FULL, BROADCAST in the package)
        index = offs
    else:  # BROADCAST (Triton specialises inner == 1, so a per-class vector costs one modulo)
        index = (offs // inner) % count
    return tl.load(ptr + index, mask=mask, other=1.0).to(tl.float32)


@triton.jit
def _log1p_exp_neg_abs(x):
    """log(1 + exp(-|x|)), accurate also where exp(-|x|) is tiny (the interpreter has no libdevice log1p)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    d = u - 1.0
    # log(u) * e / (u - 1) cancels the rounding of 1 + e (d == 0 means e is below half an ulp of 1)
    return tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _loss(x, y, pw, HAS_PW: tl.constexpr):
    """(1 - y) x + lw softplus(-x), lw = 1 + (pw - 1) y, with softplus(-x) = max(-x, 0) + log1p(exp(-|x|))
    and the max folded into the first term, so that small losses do not cancel: for x < 0 it is -pw y x."""
    if HAS_PW:
        return tl.where(x >= 0, (1.0 - y) * x, -pw * y * x) + (1.0 + (pw - 1.0) * y) * _log1p_exp_neg_abs(x)
    return tl.where(x >= 0, (1.0 - y) * x, -y * x) + _log1p_exp_neg_abs(x)


@direct_launch
@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, n,
    w_inner, w_count, pw_inner, pw_count, divisor,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, REDUCE: tl.constexpr, ONE_PROGRAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PW_MODE != 0:
        loss = _loss(x, y, _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE), True)
    else:
        loss = _loss(x, y, 1.0, False)
    if W_MODE != 0:
        loss = loss * _operand(w_ptr, offs, mask, w_inner, w_count, W_MODE)
    if REDUCE:
        total = tl.sum(tl.where(mask, loss, 0.0), axis=0)
        if ONE_PROGRAM:  # the whole reduction in this program: no partials, no second launch
            tl.store(out_ptr, (total / divisor).to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + pid, total)
    else:
        tl.store(out_ptr + offs, loss.to(out_ptr.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, n_parts, divisor, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
    total = tl.sum(acc, axis=0) / divisor
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@direct_launch
@triton.jit
def _backward_kernel(
    g_ptr, x_ptr, y_ptr, w_ptr, pw_ptr, dx_ptr, dy_ptr, n, g_divisor,
    w_inner, w_count, pw_inner, pw_count,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, G_SCALAR: tl.constexpr, TARGETS_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if G_SCALAR:  # mean / sum: one incoming gradient (divided by N for the mean)
        g = tl.load(g_ptr).to(tl.float32) / g_divisor
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if W_MODE != 0:
        g = g * _operand(w_ptr, offs, mask, w_inner, w_count, W_MODE)
    # d/dx [(1 - y) x + lw softplus(-x)] = lw sigmoid(x) - pw y, with lw = 1 + (pw - 1) y. Written with
    # q = sigmoid(-|x|) <= 1/2 (no overflow) so that no 1 - q cancels: for x >= 0 it is (1 - y) - lw q
    e = tl.exp(-tl.abs(x))
    q = e / (1.0 + e)
    if PW_MODE != 0:
        pw = _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE)
        lw = 1.0 + (pw - 1.0) * y
        dx = tl.where(x >= 0, (1.0 - y) - lw * q, lw * q - pw * y)
    else:
        dx = tl.where(x >= 0, (1.0 - y) - q, q - y)
    tl.store(dx_ptr + offs, (dx * g).to(dx_ptr.dtype.element_ty), mask=mask)
    if TARGETS_GRAD:
        if PW_MODE != 0:  # d/dy = (pw - 1) softplus(-x) - x, the max folded in as in _loss
            dy = tl.where(x >= 0, -x, -pw * x) + (pw - 1.0) * _log1p_exp_neg_abs(x)
        else:
            dy = -x
        tl.store(dy_ptr + offs, (dy * g).to(dy_ptr.dtype.element_ty), mask=mask)


# The kernels index flat element offsets from each tensor's data pointer, so a contiguous tensor of any shape is
# passed as it is: no flattening view (each view is one more ATen op on every eager call).


def _operands(logits, weight, pos_weight):
    """Pointers (a stand-in where absent), modes and index maps of weight and pos_weight (contiguous already:
    see kernel_operand)."""
    w_mode, w_inner, w_count = operand_mode(weight, logits.shape)
    pw_mode, pw_inner, pw_count = operand_mode(pos_weight, logits.shape)
    w = weight if weight is not None else logits
    pw = pos_weight if pos_weight is not None else logits
    return (w, pw), (w_inner, w_count, pw_inner, pw_count), (w_mode, pw_mode)


def forward(logits, targets, weight, pos_weight, reduction, targets_grad):
    n = logits.numel()
    x, y = logits.contiguous(), targets.contiguous()
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    dtype = loss_dtype(logits, targets, weight, pos_weight)
    grid = (cdiv(n, BLOCK),)

    def launch(out, divisor=1.0, reduce=True, one_program=False):
        _forward_kernel[grid](
            x, y, w, pw, out, n, *maps, divisor,
            W_MODE=w_mode, PW_MODE=pw_mode, REDUCE=reduce, ONE_PROGRAM=one_program, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip

    if reduction == "none":
        loss = buffers.empty(logits.shape, dtype=dtype, device=logits.device)
        launch(loss, reduce=False)
        return loss
    loss = buffers.empty((), dtype=dtype, device=logits.device)
    divisor = float(n) if reduction == "mean" else 1.0
    if grid[0] == 1:  # PCVR batches: the whole reduction in one launch
        launch(loss, divisor, one_program=True)
        return loss
    partials = buffers.empty((grid[0],), dtype=torch.float32, device=logits.device)
    launch(partials)
    _sum_partials_kernel[(1,)](partials, loss, grid[0], divisor, BLOCK=SUM_BLOCK, num_warps=4)
    return loss


def backward(grad, logits, targets, weight, pos_weight, reduction, targets_grad, loss):
    n = logits.numel()
    x, y = logits.contiguous(), targets.contiguous()
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    g_scalar = reduction != "none" or is_scalar_gradient(grad)
    g = grad if g_scalar else grad.contiguous()  # a scalar gradient: its data pointer is the one value read
    g_divisor = float(n) if reduction == "mean" else 1.0
    dlogits = buffers.empty_like(logits)
    dtargets = buffers.empty_like(targets) if targets_grad else None
    _backward_kernel[(cdiv(n, BLOCK),)](
        g, x, y, w, pw, dlogits, dtargets if targets_grad else dlogits, n, g_divisor, *maps,
        W_MODE=w_mode, PW_MODE=pw_mode, G_SCALAR=g_scalar, TARGETS_GRAD=targets_grad,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dlogits, dtargets, None, None, None, None

