"""BCE with logits in Triton: a one-pass forward and a one-pass backward over the flat logits.

Each program walks blocks of BLOCK elements: full blocks without a mask (vector loads for any N), then the
one partial block, masked, in the program it would fall to. By default there is one program per block; a
launch with fewer programs (Launch.programs_per_sm) makes each loop over several.

The mean / sum reductions are deterministic: each program writes the fp32 sum of its blocks to a partials
buffer, then one program adds the partials in a fixed order (no atomics), so the same inputs give the same
bits on every run of a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .layout import ABSENT, is_scalar_gradient, operand_mode, unit_gradient_backward, unit_gradient_buffer
from .reference import loss_dtype


@dataclass(frozen=True)
class Launch:
    block: int = 4096  # elements per program and step
    num_warps: int = 8
    programs_per_sm: int = 0  # 0: one program per block; k > 0: at most k programs per SM, each looping over blocks
    reverse: bool = False  # walk the blocks last to first (a backward then first reads what its forward left in L2)
    stages: int = 1  # > 1: loads of the next blocks are issued (cp.async) while a program works on one (loops only)


# Inputs of at most SMALL.block elements (PCVR batches) take one program, which also ends the reduction.
SMALL = Launch()


@dataclass(frozen=True)
class LargeLaunches:
    """The launches of inputs above SMALL.block elements, by kernel. The defaults come from a sweep of launches on an
    H100 at 2^24 (bf16 and fp32; docs/benchmark/bce_with_logits.md)."""

    forward: Launch = Launch(programs_per_sm=3, stages=2)  # mean / sum
    forward_none: Launch = Launch(block=1024, num_warps=4)
    backward: Launch = Launch(block=2048, num_warps=4, reverse=True)


LARGE_LAUNCHES = LargeLaunches()
SUM_BLOCK = 1024  # partials added per step by the final reduction


def _plan(n: int, large: Launch, tensor: torch.Tensor) -> tuple[Launch, int]:
    """The launch and its number of programs for n elements."""
    if n <= SMALL.block:
        return SMALL, 1
    blocks = cdiv(n, large.block)
    if large.programs_per_sm:
        return large, min(blocks, large.programs_per_sm * max(1, sm_count(tensor.device)))
    return large, blocks


@triton.jit
def _load(ptr, mask):
    """fp32 values at ptr; mask None in full blocks (no predicate, vector loads)."""
    if mask is None:
        value = tl.load(ptr)
    else:
        value = tl.load(ptr, mask=mask, other=0.0)
    return value.to(tl.float32)


@triton.jit
def _operand(ptr, offs, mask, inner, count, MODE: tl.constexpr):
    """weight / pos_weight at flat logits indices `offs` (see the package docstring for the index map)."""
    if MODE == 1:  # FULL (see ABSENT, FULL, BROADCAST in the package)
        index = offs
    else:  # BROADCAST (Triton specialises inner == 1, so a per-class vector costs one modulo)
        index = (offs // inner) % count
    return _load(ptr + index, mask)


@triton.jit
def _log1p_exp_neg_abs(x):
    """log(1 + e) for e = exp(-|x|) in (0, 1], as e p(e) with p(e) ~ log1p(e) / e on [0, 1] a degree-9 least-squares
    fit in the Chebyshev basis, in powers of e (Horner, ten FMAs): within 2.4e-7 relative
    in fp32 for |x| < 87, tiny losses stay relatively accurate (no 1 + e is rounded), and it costs no log (about
    30 instructions in libdevice) and no division."""
    e = tl.exp(-tl.abs(x))
    p = -0.003214032156392932
    p = p * e + 0.019649142399430275
    p = p * e - 0.05643497034907341
    p = p * e + 0.10533220320940018
    p = p * e - 0.15251445770263672
    p = p * e + 0.19651488959789276
    p = p * e - 0.24947808682918549
    p = p * e + 0.3332909941673279
    p = p * e - 0.4999985098838806
    p = p * e + 1.0
    return e * p


FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # a jitted function reads only constexpr globals


@triton.jit
def _loss(x, y, pw, HAS_PW: tl.constexpr):
    """(1 - y) x + lw softplus(-x), lw = 1 + (pw - 1) y, with softplus(-x) = max(-x, 0) + log1p(exp(-|x|)) and
    the max folded into the first term, so that small losses do not cancel: for x < 0 it is -pw y x. Without
    pos_weight that is max(x, 0) - x y (one FMA: x (1 - y) rounded once for x >= 0, exactly -x y below).
    Infinite logits take torch's (1 - y) x - lw logsigmoid(x), logsigmoid(x) = min(x, 0) there: inf or NaN as torch
    gives them (the folded forms would give NaN for x = +inf, y < 1 and inf for x = -inf, y > 0)."""
    if HAS_PW:
        lw = 1.0 + (pw - 1.0) * y
        loss = tl.where(x >= 0, (1.0 - y) * x, -pw * y * x) + lw * _log1p_exp_neg_abs(x)
    else:
        lw = 1.0
        loss = (tl.maximum(x, 0.0) - x * y) + _log1p_exp_neg_abs(x)
    return tl.where(tl.abs(x) > FLOAT32_MAX, (1.0 - y) * x - lw * tl.minimum(x, 0.0), loss)


@triton.jit
def _block_index(step, n_full, REVERSE: tl.constexpr):
    if REVERSE:
        return n_full - 1 - step
    return step


@triton.jit
def _dloss_dx(x, y, pw, HAS_PW: tl.constexpr):
    """d/dx [(1 - y) x + lw softplus(-x)] = lw sigmoid(x) - pw y, with lw = 1 + (pw - 1) y. Written with
    q = sigmoid(-|x|) <= 1/2 (no overflow) so that no 1 - q cancels: for x >= 0 it is (1 - y) - lw q."""
    e = tl.exp(-tl.abs(x))
    q = e / (1.0 + e)
    if HAS_PW:
        lw = 1.0 + (pw - 1.0) * y
        return tl.where(x >= 0, (1.0 - y) - lw * q, lw * q - pw * y)
    return tl.where(x >= 0, (1.0 - y) - q, q - y)


@triton.jit
def _forward_block(
    x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, unit_ptr, offs, mask, acc,
    w_inner, w_count, pw_inner, pw_count, divisor,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, REDUCE: tl.constexpr, UNIT_GRAD: tl.constexpr,
):  # fmt: skip
    """acc plus the block's losses (REDUCE), or acc after storing them. UNIT_GRAD: also stores the fp32 gradient of
    the (reduced) loss for an incoming gradient of one."""
    x = _load(x_ptr + offs, mask)
    y = _load(y_ptr + offs, mask)
    pw = 1.0
    if PW_MODE != 0:
        pw = _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE)
    loss = _loss(x, y, pw, PW_MODE != 0)
    if UNIT_GRAD:
        dx = _dloss_dx(x, y, pw, PW_MODE != 0) / divisor
    if W_MODE != 0:
        w = _operand(w_ptr, offs, mask, w_inner, w_count, W_MODE)
        loss = loss * w
        if UNIT_GRAD:
            dx = dx * w
    if UNIT_GRAD:
        tl.store(unit_ptr + offs, dx, mask=mask)
    if not REDUCE:
        tl.store(out_ptr + offs, loss.to(out_ptr.dtype.element_ty), mask=mask)
    elif mask is None:
        acc += loss
    else:
        acc += tl.where(mask, loss, 0.0)
    return acc


@direct_launch
@triton.jit
def _forward_kernel(
    x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, unit_ptr, n,
    w_inner, w_count, pw_inner, pw_count, divisor,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, REDUCE: tl.constexpr, UNIT_GRAD: tl.constexpr, ONE_PROGRAM: tl.constexpr,
    REVERSE: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_full = n // BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for step in tl.range(pid, n_full, programs, num_stages=NUM_STAGES):
        offs = _block_index(step, n_full, REVERSE) * BLOCK + tl.arange(0, BLOCK)
        acc = _forward_block(
            x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, unit_ptr, offs, None, acc, w_inner, w_count, pw_inner, pw_count,
            divisor, W_MODE, PW_MODE, REDUCE, UNIT_GRAD,
        )  # fmt: skip
    if pid == n_full % programs and n_full * BLOCK < n:
        offs = n_full * BLOCK + tl.arange(0, BLOCK)
        acc = _forward_block(
            x_ptr, y_ptr, w_ptr, pw_ptr, out_ptr, unit_ptr, offs, offs < n, acc, w_inner, w_count, pw_inner, pw_count,
            divisor, W_MODE, PW_MODE, REDUCE, UNIT_GRAD,
        )  # fmt: skip
    if REDUCE:
        total = tl.sum(acc, axis=0)
        if ONE_PROGRAM:  # the whole reduction in this program: no partials, no second launch
            tl.store(out_ptr, (total / divisor).to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + pid, total)


@direct_launch
@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, n_parts, divisor, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
    total = tl.sum(acc, axis=0) / divisor
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _backward_block(
    g_ptr, x_ptr, y_ptr, w_ptr, pw_ptr, dx_ptr, dy_ptr, offs, mask, g_scalar,
    w_inner, w_count, pw_inner, pw_count,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, G_SCALAR: tl.constexpr, TARGETS_GRAD: tl.constexpr,
):  # fmt: skip
    x = _load(x_ptr + offs, mask)
    y = _load(y_ptr + offs, mask)
    if G_SCALAR:
        g = g_scalar
    else:
        g = _load(g_ptr + offs, mask)
    if W_MODE != 0:
        g = g * _operand(w_ptr, offs, mask, w_inner, w_count, W_MODE)
    pw = 1.0
    if PW_MODE != 0:
        pw = _operand(pw_ptr, offs, mask, pw_inner, pw_count, PW_MODE)
    dx = _dloss_dx(x, y, pw, PW_MODE != 0)
    tl.store(dx_ptr + offs, (dx * g).to(dx_ptr.dtype.element_ty), mask=mask)
    if TARGETS_GRAD:
        if PW_MODE != 0:  # d/dy = (pw - 1) softplus(-x) - x, the max folded in as in _loss
            dy = tl.where(x >= 0, -x, -pw * x) + (pw - 1.0) * _log1p_exp_neg_abs(x)
        else:
            dy = -x
        tl.store(dy_ptr + offs, (dy * g).to(dy_ptr.dtype.element_ty), mask=mask)


@direct_launch
@triton.jit
def _backward_kernel(
    g_ptr, x_ptr, y_ptr, w_ptr, pw_ptr, dx_ptr, dy_ptr, n, g_divisor,
    w_inner, w_count, pw_inner, pw_count,
    W_MODE: tl.constexpr, PW_MODE: tl.constexpr, G_SCALAR: tl.constexpr, TARGETS_GRAD: tl.constexpr,
    REVERSE: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_full = n // BLOCK
    g_scalar = 0.0
    if G_SCALAR:  # mean / sum: one incoming gradient (divided by N for the mean)
        g_scalar = tl.load(g_ptr).to(tl.float32) / g_divisor
    for step in tl.range(pid, n_full, programs, num_stages=NUM_STAGES):
        offs = _block_index(step, n_full, REVERSE) * BLOCK + tl.arange(0, BLOCK)
        _backward_block(
            g_ptr, x_ptr, y_ptr, w_ptr, pw_ptr, dx_ptr, dy_ptr, offs, None, g_scalar, w_inner, w_count, pw_inner,
            pw_count, W_MODE, PW_MODE, G_SCALAR, TARGETS_GRAD,
        )  # fmt: skip
    if pid == n_full % programs and n_full * BLOCK < n:
        offs = n_full * BLOCK + tl.arange(0, BLOCK)
        _backward_block(
            g_ptr, x_ptr, y_ptr, w_ptr, pw_ptr, dx_ptr, dy_ptr, offs, offs < n, g_scalar, w_inner, w_count, pw_inner,
            pw_count, W_MODE, PW_MODE, G_SCALAR, TARGETS_GRAD,
        )  # fmt: skip


# The kernels index flat element offsets from each tensor's data pointer, so a contiguous tensor of any shape is
# passed as it is: no flattening view (each view is one more ATen op on every eager call).


# An absent operand's pointer and index map are passed as None, which Triton takes as a constexpr: a launch then
# keys and passes nothing for them (and the kernels never read them).
_ABSENT_OPERANDS = (None, None), (None, None, None, None), (ABSENT, ABSENT)


def _operands(logits, weight, pos_weight):
    """Pointers, index maps and modes of weight and pos_weight (contiguous already: see kernel_operand)."""
    if weight is None and pos_weight is None:
        return _ABSENT_OPERANDS
    w_mode, w_inner, w_count = operand_mode(weight, logits.shape)
    pw_mode, pw_inner, pw_count = operand_mode(pos_weight, logits.shape)
    if weight is None:
        w_inner = w_count = None
    if pos_weight is None:
        pw_inner = pw_count = None
    return (weight, pos_weight), (w_inner, w_count, pw_inner, pw_count), (w_mode, pw_mode)


def forward(logits, targets, weight, pos_weight, reduction, targets_grad, launches=LARGE_LAUNCHES):
    return _forward(logits, targets, weight, pos_weight, reduction, None, launches)


def unit_gradient_forward(logits, targets, weight, pos_weight, reduction, launches=LARGE_LAUNCHES):
    """(the loss, the logits' fp32 gradient for an incoming gradient of one), from one forward launch."""
    unit = unit_gradient_buffer(logits)
    return _forward(logits, targets, weight, pos_weight, reduction, unit, launches), unit


def _forward(logits, targets, weight, pos_weight, reduction, unit, launches: LargeLaunches):
    """The loss; with `unit`, also the logits' gradient for an incoming gradient of one, in it."""
    n = logits.numel()
    x, y = logits.contiguous(), targets.contiguous()
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    dtype = loss_dtype(logits, targets, weight, pos_weight)
    reduce = reduction != "none"
    launch, programs = _plan(n, launches.forward if reduce else launches.forward_none, logits)
    if reduce:
        loss = buffers.empty((), dtype=dtype, device=logits.device)
        out = loss if programs == 1 else buffers.empty((programs,), dtype=torch.float32, device=logits.device)
    else:
        loss = out = buffers.empty(logits.shape, dtype=dtype, device=logits.device)
    divisor = float(n) if reduction == "mean" else 1.0
    _forward_kernel[(programs,)](
        x, y, w, pw, out, unit, n, *maps, divisor,
        W_MODE=w_mode, PW_MODE=pw_mode, REDUCE=reduce, UNIT_GRAD=unit is not None, ONE_PROGRAM=programs == 1,
        REVERSE=launch.reverse, NUM_STAGES=launch.stages, BLOCK=launch.block, num_warps=launch.num_warps,
    )  # fmt: skip
    if reduce and programs > 1:
        _sum_partials_kernel[(1,)](out, loss, programs, divisor, BLOCK=SUM_BLOCK, num_warps=4)
    return loss


def backward(grad, logits, targets, weight, pos_weight, reduction, targets_grad, loss=None, launches=LARGE_LAUNCHES):
    """(dlogits, dtargets or None, None...) from the arguments alone (loss: None, backward_reads="arguments")."""
    n = logits.numel()
    x, y = logits.contiguous(), targets.contiguous()
    (w, pw), maps, (w_mode, pw_mode) = _operands(logits, weight, pos_weight)
    g_scalar = reduction != "none" or is_scalar_gradient(grad)
    g = grad if g_scalar else grad.contiguous()  # a scalar gradient: its data pointer is the one value read
    g_divisor = float(n) if reduction == "mean" else 1.0
    dlogits = buffers.empty_like(logits)
    dtargets = buffers.empty_like(targets) if targets_grad else None
    launch, programs = _plan(n, launches.backward, logits)
    _backward_kernel[(programs,)](
        g, x, y, w, pw, dlogits, dtargets, n, g_divisor, *maps,
        W_MODE=w_mode, PW_MODE=pw_mode, G_SCALAR=g_scalar, TARGETS_GRAD=targets_grad,
        REVERSE=launch.reverse, NUM_STAGES=launch.stages, BLOCK=launch.block, num_warps=launch.num_warps,
    )  # fmt: skip
    return dlogits, dtargets, None, None, None, None


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
UNIT_GRADIENT_KERNELS = KernelBackend(
    forward=unit_gradient_forward, backward=unit_gradient_backward, backward_reads="saved"
)
