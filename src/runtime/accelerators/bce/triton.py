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
def _softplus_neg(x):
    """log(1 + exp(-x)) for any x: max(-x, 0) + log1p(exp(-|x|)), log1p made accurate for tiny arguments."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    d = u - 1.0
    # log(u) * e / (u - 1) cancels the rounding of 1 + e (d == 0 means e is below half an ulp of 1)
    log1p_e = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.maximum(-x, 0.0) + log1p_e


@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, n,
    w_inner, w_count, pw_inner, pw_count,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, REDUCE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    softplus_neg = _softplus_neg(x)
    if PW_MODE != 0:
        pw = _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE)
        loss = (1.0 - y) * x + (1.0 + (pw - 1.0) * y) * softplus_neg
    else:
        loss = (1.0 - y) * x + softplus_neg
    if W_MODE != 0:
        loss = loss * _operand(w_ptr, offs, mask, w_inner, w_count, W_MODE)
    if REDUCE:
        tl.store(out_ptr + pid, tl.sum(tl.where(mask, loss, 0.0), axis=0))
    else:
        tl.store(out_ptr + offs, loss.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, n_parts, divisor, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
    total = tl.sum(acc, axis=0) / divisor
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


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
    # sigmoid(x) without overflow: e = exp(-|x|) <= 1
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    sig = tl.where(x >= 0, r, e * r)
    if PW_MODE != 0:
        pw = _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE)
        # d/dx [(1 - y) x + (1 + (pw - 1) y) softplus(-x)] = (1 + (pw - 1) y) sigmoid(x) - pw y
        dx = (1.0 + (pw - 1.0) * y) * sig - pw * y
    else:
        dx = sig - y
    tl.store(dx_ptr + offs, (dx * g).to(dx_ptr.dtype.element_ty), mask=mask)
    if TARGETS_GRAD:
        if PW_MODE != 0:
            dy = (pw - 1.0) * _softplus_neg(x) - x
        else:
            dy = -x
        tl.store(dy_ptr + offs, (dy * g).to(dy_ptr.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _operands(logits, weight, pos_weight):
    """Pointers (a stand-in where absent), modes and index maps of weight and pos_weight."""
    w_mode, w_inner, w_count = operand_mode(weight, logits.shape)
    pw_mode, pw_inner, pw_count = operand_mode(pos_weight, logits.shape)
    w = weight.view(-1) if weight is not None else logits
    pw = pos_weight.view(-1) if pos_weight is not None else logits
    return (w, pw), (w_inner, w_count, pw_inner, pw_count), (w_mode, pw_mode)


def forward(logits, targets, weight, pos_weight, reduction, targets_grad):
    n = logits.numel()
    x, y = _flat(logits), _flat(targets)
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    dtype = loss_dtype(logits, targets, weight, pos_weight)
    grid = (triton.cdiv(n, BLOCK),)
    if reduction == "none":
        loss = buffers.empty(logits.shape, dtype=dtype, device=logits.device)
        _forward_kernel[grid](
            x, y, w, pw, loss, n, *maps, W_MODE=w_mode, PW_MODE=pw_mode, REDUCE=False, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
        return loss
    partials = buffers.empty((grid[0],), dtype=torch.float32, device=logits.device)
    _forward_kernel[grid](
        x, y, w, pw, partials, n, *maps, W_MODE=w_mode, PW_MODE=pw_mode, REDUCE=True, BLOCK=BLOCK, num_warps=NUM_WARPS
    )
    loss = buffers.empty((), dtype=dtype, device=logits.device)
    divisor = float(n) if reduction == "mean" else 1.0
    _sum_partials_kernel[(1,)](partials, loss, grid[0], divisor, BLOCK=SUM_BLOCK, num_warps=4)
    return loss


def backward(grad, logits, targets, weight, pos_weight, reduction, targets_grad, loss):
    n = logits.numel()
    x, y = _flat(logits), _flat(targets)
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    g_scalar = reduction != "none" or is_scalar_gradient(grad)
    g = grad.as_strided((1,), (1,)) if g_scalar else _flat(grad)
    g_divisor = float(n) if reduction == "mean" else 1.0
    dlogits = buffers.empty_like(logits)
    dtargets = buffers.empty_like(targets) if targets_grad else None
    _backward_kernel[(triton.cdiv(n, BLOCK),)](
        g, x, y, w, pw, dlogits, dtargets if targets_grad else dlogits, n, g_divisor, *maps,
        W_MODE=w_mode, PW_MODE=pw_mode, G_SCALAR=g_scalar, TARGETS_GRAD=targets_grad,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dlogits, dtargets, None, None, None, None

