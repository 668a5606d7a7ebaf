"""BCE with logits in TileLang: a one-pass forward and a one-pass backward over the flat logits.

Each block takes BLOCK consecutive elements as a [ROWS, VEC] tile (VEC contiguous elements per
thread and row, so full blocks load and store with vector instructions; the last, partial block
clamps its reads and guards its writes). The mean / sum reductions are deterministic: each block
writes the fp32 sum of its tile to a partials buffer, then one block adds the partials in a fixed
order (no atomics). The length is dynamic (T.dynamic): one compiled kernel per dtypes and flags.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which name locals
import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..tilelang_common import TL_DTYPE, launcher
from .layout import ABSENT, FULL, is_scalar_gradient, operand_mode, unit_gradient_backward, unit_gradient_buffer
from .reference import loss_dtype

THREADS = 256
VEC = 8  # contiguous elements per thread and row: 16-byte accesses for 16-bit dtypes, two for fp32
ROWS = 512
BLOCK = ROWS * VEC  # elements per block
SUM_CHUNK = 1024  # partials added per step by the final reduction

F32 = "float32"


# --------------------------------------------------------------------------- kernels


def _log1p_exp_neg_abs(x):
    return T.log1p(T.exp(-T.abs(x)))


def _loss(x, y, pw):
    """(1 - y) x + lw softplus(-x), lw = 1 + (pw - 1) y, pw None for 1: as the Triton kernel, with the
    max(-x, 0) of softplus(-x) = max(-x, 0) + log1p(exp(-|x|)) folded into the first term (no cancellation).
    Infinite logits take torch's (1 - y) x - lw logsigmoid(x), logsigmoid(x) = min(x, 0) there, as in the Triton
    kernel (the folded form gives inf for x = -inf, y > 0, where torch gives NaN)."""
    if pw is None:
        lw = 1.0
        loss = T.if_then_else(x >= 0.0, (1.0 - y) * x, -y * x) + _log1p_exp_neg_abs(x)
    else:
        lw = 1.0 + (pw - 1.0) * y
        loss = T.if_then_else(x >= 0.0, (1.0 - y) * x, -pw * y * x) + lw * _log1p_exp_neg_abs(x)
    return T.if_then_else(T.isinf(x), (1.0 - y) * x - lw * T.min(x, 0.0), loss)


def _dloss_dx(x, y, pw):
    """lw sigmoid(x) - pw y, lw = 1 + (pw - 1) y, pw None for 1: with q = sigmoid(-|x|) <= 1/2, as in the Triton
    kernel (no 1 - q cancels)."""
    e = T.exp(-T.abs(x))
    q = e / (1.0 + e)
    if pw is None:
        return T.if_then_else(x >= 0.0, (1.0 - y) - q, q - y)
    lw = 1.0 + (pw - 1.0) * y
    return T.if_then_else(x >= 0.0, (1.0 - y) - lw * q, lw * q - pw * y)


@T.macro
def _load_block(base, N, X, x, Y, y, W, w, w_mode, PW, pw, pw_mode, G=None, g=None):
    """The block's tiles of the logits, the targets, the FULL weight operands and, when G is given (one gradient
    per element), the incoming gradient: vector loads in a full block, clamped reads in the last, partial one.
    base and N come under their own names: TileLang renames a scalar passed to a macro after the parameter."""
    if base + BLOCK <= N:
        for r, v in T.Parallel(ROWS, VEC):
            x[r, v] = X[base + r * VEC + v]
        for r, v in T.Parallel(ROWS, VEC):
            y[r, v] = Y[base + r * VEC + v]
        if G is not None:
            for r, v in T.Parallel(ROWS, VEC):
                g[r, v] = G[base + r * VEC + v]
        if w_mode == FULL:
            for r, v in T.Parallel(ROWS, VEC):
                w[r, v] = W[base + r * VEC + v]
        if pw_mode == FULL:
            for r, v in T.Parallel(ROWS, VEC):
                pw[r, v] = PW[base + r * VEC + v]
    else:
        for r, v in T.Parallel(ROWS, VEC):
            x[r, v] = X[T.min(base + r * VEC + v, N - 1)]
            y[r, v] = Y[T.min(base + r * VEC + v, N - 1)]
            if G is not None:
                g[r, v] = G[T.min(base + r * VEC + v, N - 1)]
            if w_mode == FULL:
                w[r, v] = W[T.min(base + r * VEC + v, N - 1)]
            if pw_mode == FULL:
                pw[r, v] = PW[T.min(base + r * VEC + v, N - 1)]


@T.macro
def _store_block(Out, tile, base, N, out_dtype):
    """tile's elements to Out[base:], the last block guarded."""
    if base + BLOCK <= N:
        for r, v in T.Parallel(ROWS, VEC):
            Out[base + r * VEC + v] = T.cast(tile[r, v], out_dtype)
    else:
        for r, v in T.Parallel(ROWS, VEC):
            if base + r * VEC + v < N:
                Out[base + r * VEC + v] = T.cast(tile[r, v], out_dtype)


def _operand_value(mode, tile, buffer, i, inner, count):
    """weight / pos_weight at flat index i: a loaded tile when FULL, else the index map of the package docstring."""
    if mode == FULL:
        return T.cast(tile, F32)
    return T.cast(buffer[T.truncmod(T.truncdiv(i, inner), count)], F32)


def _operand_shape(mode, n, symbol):
    return (n,) if mode == FULL else (symbol,)


def forward_func(x_dtype, y_dtype, w_dtype, pw_dtype, out_dtype, w_mode, pw_mode, reduce, unit_grad):
    """The forward prim_func: per-element losses (reduce=False) or per-block fp32 partial sums; with unit_grad also
    the fp32 gradient of the loss for an incoming gradient of one (divided by g_divisor) in Unit."""
    N, WN, PN, UN = T.dynamic("N, WN, PN, UN")
    out_shape, out_elem = ((T.ceildiv(N, BLOCK),), F32) if reduce else ((N,), out_dtype)

    @T.prim_func
    def bce_forward(
        X: T.Tensor((N,), x_dtype),
        Y: T.Tensor((N,), y_dtype),
        W: T.Tensor(_operand_shape(w_mode, N, WN), w_dtype),
        PW: T.Tensor(_operand_shape(pw_mode, N, PN), pw_dtype),
        w_inner: T.int32,
        pw_inner: T.int32,
        g_divisor: T.float32,
        Out: T.Tensor(out_shape, out_elem),
        Unit: T.Tensor((N,) if unit_grad else (UN,), F32),
    ):
        with T.Kernel(T.ceildiv(N, BLOCK), threads=THREADS) as bx:
            x = T.alloc_fragment((ROWS, VEC), x_dtype)
            y = T.alloc_fragment((ROWS, VEC), y_dtype)
            w = T.alloc_fragment((ROWS, VEC), w_dtype)
            pw = T.alloc_fragment((ROWS, VEC), pw_dtype)
            loss = T.alloc_fragment((ROWS, VEC), F32)
            unit = T.alloc_fragment((ROWS, VEC), F32)
            base = bx * BLOCK
            _load_block(base, N, X, x, Y, y, W, w, w_mode, PW, pw, pw_mode)
            for r, v in T.Parallel(ROWS, VEC):
                i = base + r * VEC + v
                xf = T.cast(x[r, v], F32)
                yf = T.cast(y[r, v], F32)
                pwf = None if pw_mode == ABSENT else _operand_value(pw_mode, pw[r, v], PW, i, pw_inner, PN)
                value = _loss(xf, yf, pwf)
                scale = 1.0 / g_divisor
                if w_mode != ABSENT:
                    wf = _operand_value(w_mode, w[r, v], W, i, w_inner, WN)
                    value = value * wf
                    scale = scale * wf
                if unit_grad:
                    unit[r, v] = _dloss_dx(xf, yf, pwf) * scale
                if reduce:
                    value = T.if_then_else(i < N, value, 0.0)
                loss[r, v] = value
            if reduce:
                row = T.alloc_fragment((ROWS,), F32)
                total = T.alloc_fragment((1,), F32)
                T.reduce_sum(loss, row, dim=1)
                T.reduce_sum(row, total, dim=0)
                Out[bx] = total[0]
            else:
                _store_block(Out, loss, base, N, out_dtype)
            if unit_grad:
                _store_block(Unit, unit, base, N, F32)

    return bce_forward


def sum_func(out_dtype):
    """Adds the fp32 partials in a fixed order and divides by `divisor` (N for the mean, 1 for the sum)."""
    P = T.dynamic("P")

    @T.prim_func
    def bce_sum_partials(Part: T.Tensor((P,), F32), divisor: T.float32, Out: T.Tensor((1,), out_dtype)):
        with T.Kernel(1, threads=THREADS):
            acc = T.alloc_fragment((SUM_CHUNK,), F32)
            total = T.alloc_fragment((1,), F32)
            T.clear(acc)
            for k in T.serial(T.ceildiv(P, SUM_CHUNK)):
                for i in T.Parallel(SUM_CHUNK):
                    j = k * SUM_CHUNK + i
                    acc[i] += T.if_then_else(j < P, Part[T.min(j, P - 1)], 0.0)
            T.reduce_sum(acc, total, dim=0)
            Out[0] = T.cast(total[0] / divisor, out_dtype)

    return bce_sum_partials


def backward_func(x_dtype, y_dtype, w_dtype, pw_dtype, g_dtype, w_mode, pw_mode, g_scalar, targets_grad):
    """dlogits (and dtargets when targets_grad) from the incoming gradient: one value (g_scalar) or one per element."""
    N, WN, PN, GN, DN = T.dynamic("N, WN, PN, GN, DN")
    g_shape = (GN,) if g_scalar else (N,)
    dy_shape = (N,) if targets_grad else (DN,)

    @T.prim_func
    def bce_backward(
        G: T.Tensor(g_shape, g_dtype),
        X: T.Tensor((N,), x_dtype),
        Y: T.Tensor((N,), y_dtype),
        W: T.Tensor(_operand_shape(w_mode, N, WN), w_dtype),
        PW: T.Tensor(_operand_shape(pw_mode, N, PN), pw_dtype),
        w_inner: T.int32,
        pw_inner: T.int32,
        g_divisor: T.float32,
        DX: T.Tensor((N,), x_dtype),
        DY: T.Tensor(dy_shape, y_dtype),
    ):
        with T.Kernel(T.ceildiv(N, BLOCK), threads=THREADS) as bx:
            x = T.alloc_fragment((ROWS, VEC), x_dtype)
            y = T.alloc_fragment((ROWS, VEC), y_dtype)
            w = T.alloc_fragment((ROWS, VEC), w_dtype)
            pw = T.alloc_fragment((ROWS, VEC), pw_dtype)
            g = T.alloc_fragment((ROWS, VEC), g_dtype)
            dx = T.alloc_fragment((ROWS, VEC), x_dtype)
            dy = T.alloc_fragment((ROWS, VEC), y_dtype)
            base = bx * BLOCK
            _load_block(base, N, X, x, Y, y, W, w, w_mode, PW, pw, pw_mode, G=None if g_scalar else G, g=g)
            for r, v in T.Parallel(ROWS, VEC):
                i = base + r * VEC + v
                xf = T.cast(x[r, v], F32)
                yf = T.cast(y[r, v], F32)
                scale = T.cast(g[r, v], F32)
                if g_scalar:
                    scale = T.cast(G[0], F32) / g_divisor
                if w_mode != ABSENT:
                    scale = scale * _operand_value(w_mode, w[r, v], W, i, w_inner, WN)
                pwf = None if pw_mode == ABSENT else _operand_value(pw_mode, pw[r, v], PW, i, pw_inner, PN)
                dx[r, v] = T.cast(_dloss_dx(xf, yf, pwf) * scale, x_dtype)
                if targets_grad:
                    if pw_mode != ABSENT:
                        # (pw - 1) softplus(-x) - x, the max folded in as in _loss
                        dyf = T.if_then_else(xf >= 0.0, -xf, -pwf * xf) + (pwf - 1.0) * _log1p_exp_neg_abs(xf)
                        dy[r, v] = T.cast(dyf * scale, y_dtype)
                    else:
                        dy[r, v] = T.cast(-xf * scale, y_dtype)
            _store_block(DX, dx, base, N, x_dtype)
            if targets_grad:
                _store_block(DY, dy, base, N, y_dtype)

    return bce_backward


# --------------------------------------------------------------------------- compile cache entries
# (key, build) pairs for tilelang_common.compiled / precompile: keyed by dtype names and flags only


def forward_entry(x_dtype, y_dtype, w_dtype, pw_dtype, out_dtype, w_mode, pw_mode, reduce, unit_grad):
    names = (x_dtype, y_dtype, w_dtype, pw_dtype, out_dtype, w_mode, pw_mode, reduce, unit_grad)
    return ("bce_forward", *names), lambda _: forward_func(*names)


def sum_entry(out_dtype):
    return ("bce_sum", out_dtype), lambda _: sum_func(out_dtype)


def backward_entry(x_dtype, y_dtype, w_dtype, pw_dtype, g_dtype, w_mode, pw_mode, g_scalar, targets_grad):
    names = (x_dtype, y_dtype, w_dtype, pw_dtype, g_dtype, w_mode, pw_mode, g_scalar, targets_grad)
    return ("bce_backward", *names), lambda _: backward_func(*names)


# --------------------------------------------------------------------------- launchers


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 1-D, 16-byte aligned (full blocks use vector loads)."""
    t = t.contiguous().view(-1)
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _operand(operand, x, shape):
    """(tensor, dtype name, mode, inner) of weight / pos_weight; when absent, x stands in (it is never read)."""
    mode, inner, _ = operand_mode(operand, shape)
    if operand is None:
        return x, TL_DTYPE[x.dtype], mode, inner
    flat = _flat(operand)
    return flat, TL_DTYPE[flat.dtype], mode, inner


def forward(logits, targets, weight, pos_weight, reduction, targets_grad):
    return _forward(logits, targets, weight, pos_weight, reduction, None)


def unit_gradient_forward(logits, targets, weight, pos_weight, reduction):
    """(the loss, the logits' fp32 gradient for an incoming gradient of one), from one forward launch."""
    unit = unit_gradient_buffer(logits)
    return _forward(logits, targets, weight, pos_weight, reduction, unit), unit


def _forward(logits, targets, weight, pos_weight, reduction, unit):
    """The loss; with `unit`, also the logits' gradient for an incoming gradient of one, in it."""
    n, device = logits.numel(), logits.device
    x, y = _flat(logits), _flat(targets)
    w, w_dtype, w_mode, w_inner = _operand(weight, x, logits.shape)
    pw, pw_dtype, pw_mode, pw_inner = _operand(pos_weight, x, logits.shape)
    dtype = loss_dtype(logits, targets, weight, pos_weight)
    reduce = reduction != "none"
    divisor = float(n) if reduction == "mean" else 1.0
    unit_grad = unit is not None
    if not unit_grad:  # never written: the kernel's unit-gradient argument still has to be a tensor
        unit = buffers.empty((0,), dtype=torch.float32, device=device)
    entry = forward_entry(
        TL_DTYPE[x.dtype],
        TL_DTYPE[y.dtype],
        w_dtype,
        pw_dtype,
        TL_DTYPE[dtype],
        w_mode,
        pw_mode,
        reduce,
        unit_grad,
    )
    kernel = launcher(entry, device)
    if not reduce:
        loss = buffers.empty(logits.shape, dtype=dtype, device=device)
        kernel(x, y, w, pw, w_inner, pw_inner, divisor, loss.view(-1), unit.view(-1))
        return loss
    partials = buffers.empty((-(-n // BLOCK),), dtype=torch.float32, device=device)
    kernel(x, y, w, pw, w_inner, pw_inner, divisor, partials, unit.view(-1))
    loss = buffers.empty((), dtype=dtype, device=device)
    launcher(sum_entry(TL_DTYPE[dtype]), device)(partials, divisor, loss.view(1))
    return loss


def backward(grad, logits, targets, weight, pos_weight, reduction, targets_grad, loss=None):
    """(dlogits, dtargets or None, None...) from the arguments alone (loss: None, backward_reads="arguments")."""
    n, device = logits.numel(), logits.device
    x, y = _flat(logits), _flat(targets)
    w, w_dtype, w_mode, w_inner = _operand(weight, x, logits.shape)
    pw, pw_dtype, pw_mode, pw_inner = _operand(pos_weight, x, logits.shape)
    g_scalar = reduction != "none" or is_scalar_gradient(grad)
    g = _flat(grad.as_strided((1,), (1,)) if g_scalar else grad)
    g_divisor = float(n) if reduction == "mean" else 1.0
    dlogits = buffers.empty_like(logits)
    dtargets = buffers.empty_like(targets) if targets_grad else None
    entry = backward_entry(
        TL_DTYPE[x.dtype],
        TL_DTYPE[y.dtype],
        w_dtype,
        pw_dtype,
        TL_DTYPE[g.dtype],
        w_mode,
        pw_mode,
        g_scalar,
        targets_grad,
    )
    kernel = launcher(entry, device)
    # without targets_grad the kernel never writes DY: targets stand in for it
    kernel(g, x, y, w, pw, w_inner, pw_inner, g_divisor, dlogits.view(-1), dtargets.view(-1) if targets_grad else y)
    return dlogits, dtargets, None, None, None, None


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="arguments")
UNIT_GRADIENT_KERNELS = KernelBackend(
    forward=unit_gradient_forward, backward=unit_gradient_backward, backward_reads="saved"
)
