"""add_rms_norm / add_layer_norm in Triton: total = x + residual (rounded to the inputs' dtype), y = norm(total).

Forward: one read of x and residual, one write of y and total, and the per-row statistics (rstd; layer norm also the
mean) when a backward will come. Backward (xhat = (total - mean) * rstd, mean = 0 for RMSNorm, g = dy * weight):
    dtotal = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dnew      (RMSNorm: without the mean(g) term)
    dx = dresidual = dtotal     dweight = sum over rows of dy * xhat     dbias = sum over rows of dy
It reads dy, dnew and total, with the saved statistics, and writes dtotal once: dx and dresidual are the same tensor.
The row tiles, the persistent backward and its deterministic parameter partials are the row norms' (norms_triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_plan import LaunchPlan
from ..norms_triton import (
    PARAMETER_BACKWARD,
    ParameterBackwardLaunch,
    add_partials_if_last,
    n_tiles,
    parameter_backward,
    rms_rstd,
    row_statistics,
    row_tiles,
    rows_of,
    sum_partials,
)
from ..triton_launch import direct_launch


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _forward_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, rstd_ptr, mean_ptr, n_rows, N, stride_x, stride_r, eps,
    CENTRE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n_rows, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # the sum in fp32, rounded once to the stream's dtype: the new residual, and what is normalised
    s = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + rows[:, None] * N + cols[None, :], s, mask=mask)
    s = s.to(tl.float32)
    if CENTRE:
        mean, centred, rstd = row_statistics(s, mask, N, eps)
        y = centred * rstd[:, None]
    else:
        rstd = rms_rstd(s, N, eps)
        y = s * rstd[:, None]
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if CENTRE:
            tl.store(mean_ptr + rows, mean, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _backward_kernel(
    dy_ptr, dn_ptr, s_ptr, rstd_ptr, mean_ptr, w_ptr, ds_ptr, part_ptr, dw_ptr, db_ptr, counter_ptr,
    n_rows, N, stride_dy, stride_dn,
    CENTRE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, FINISH: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        s = tl.load(s_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dn = tl.load(dn_ptr + rows[:, None] * stride_dn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if CENTRE:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            xhat = tl.where(mask, (s - mean) * rstd, 0.0)
        else:
            xhat = s * rstd
        g = dy * w if HAS_W else dy
        dot = (tl.sum(g * xhat, axis=1) / N)[:, None]
        if CENTRE:
            ds = (g - (tl.sum(g, axis=1) / N)[:, None] - xhat * dot) * rstd + dn
        else:
            ds = (g - xhat * dot) * rstd + dn
        tl.store(ds_ptr + rows[:, None] * N + cols[None, :], ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_B:
            db += dy
    # one partial row per program: the weight's rows, then the bias's (norms_triton.partials)
    if HAS_W:
        tl.store(part_ptr + pid * N + cols, tl.sum(dw, axis=0), mask=col_mask)
        b_row = tl.num_programs(0) + pid
    else:
        b_row = pid
    if HAS_B:
        tl.store(part_ptr + b_row * N + cols, tl.sum(db, axis=0), mask=col_mask)
    if FINISH:
        add_partials_if_last(part_ptr, dw_ptr, db_ptr, counter_ptr, N, HAS_W, HAS_B, BLOCK_N, ROWS)


def _forward(x, residual, weight, bias, eps: float, centre: bool, store_stats: bool):
    (x2, n_rows, stride_x), (r2, _, stride_r) = rows_of(x), rows_of(residual)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y, total = buffers.empty_like(x), buffers.empty_like(x)
    if store_stats:
        rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
        mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device) if centre else None
    else:
        rstd = mean = None
    _forward_kernel[(n_tiles(n_rows, tiles),)](
        x2, r2, x2 if weight is None else weight.contiguous(), x2 if bias is None else bias.contiguous(), y, total,
        x2 if rstd is None else rstd, x2 if mean is None else mean, n_rows, width, stride_x, stride_r, eps,
        CENTRE=centre, HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=store_stats,
        BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    if not store_stats:
        return y, total
    return (y, total, rstd, mean) if centre else (y, total, rstd)


def _backward(dy, dnew, weight, bias, total, rstd, mean, launch: ParameterBackwardLaunch):
    """(dtotal, dweight, dbias); dtotal is both dx and dresidual."""
    (dy2, _, stride_dy), (dn2, _, stride_dn) = rows_of(dy), rows_of(dnew)
    dtotal = buffers.empty_like(total)
    dweight = None if weight is None else buffers.empty_like(weight)
    dbias = None if bias is None else buffers.empty_like(bias)
    backward_launch(
        dy2, stride_dy, dn2, stride_dn, weight, bias, total, rstd, mean, dtotal, dweight, dbias, launch
    ).run()
    return dtotal, dweight, dbias


def backward_launch(
    dy, stride_dy: int, dnew, stride_dnew: int, weight, bias, total, rstd, mean, dtotal, dweight, dbias,
    launch: ParameterBackwardLaunch,
) -> LaunchPlan:  # fmt: skip
    """The backward's launch (run by `_backward`). dy and dnew: the gradients of y and of total, rows of stride
    stride_dy and stride_dnew; dtotal, dweight, dbias (None without the parameter): where the gradients go; mean
    None for RMSNorm."""
    width = total.shape[-1]
    n_rows = total.numel() // width
    tiles = row_tiles(width)
    n_params = (weight is not None) + (bias is not None)
    programs, finish, counter, partial = parameter_backward(n_rows, width, tiles, total.device, n_params, total, launch)
    return LaunchPlan(
        _backward_kernel, (programs,),
        (dy, dnew, total, rstd, rstd if mean is None else mean, total if weight is None else weight.contiguous(), dtotal,
         partial, total if dweight is None else dweight, total if dbias is None else dbias, counter,
         n_rows, width, stride_dy, stride_dnew),
        dict(CENTRE=mean is not None, HAS_W=weight is not None, HAS_B=bias is not None, FINISH=finish,
             BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
        (counter, partial) if finish else (),
        (sum_partials, partial, dweight, dbias, launch.sum_partials_kernel) if n_params and not finish else (),
    )  # fmt: skip


def rms_forward(x, residual, weight, eps: float):
    return _forward(x, residual, weight, None, eps, centre=False, store_stats=True)


def rms_infer(x, residual, weight, eps: float):
    """(y, total) alone (no rstd for a backward)."""
    return _forward(x, residual, weight, None, eps, centre=False, store_stats=False)


def rms_backward(
    dy, dnew, x, residual, weight, eps, y, total, rstd, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD
):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, _ = _backward(dy, dnew, weight, None, total, rstd, None, launch)
    return dtotal, dtotal, dweight, None


def layer_forward(x, residual, weight, bias, eps: float):
    return _forward(x, residual, weight, bias, eps, centre=True, store_stats=True)


def layer_infer(x, residual, weight, bias, eps: float):
    """(y, total) alone (no statistics for a backward)."""
    return _forward(x, residual, weight, bias, eps, centre=True, store_stats=False)


def layer_backward(
    dy, dnew, x, residual, weight, bias, eps, y, total, rstd, mean, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD
):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, dbias = _backward(dy, dnew, weight, bias, total, rstd, mean, launch)
    return dtotal, dtotal, dweight, dbias, None


RMS_KERNELS = KernelBackend(forward=rms_forward, backward=rms_backward, infer=rms_infer)
LAYER_KERNELS = KernelBackend(forward=layer_forward, backward=layer_backward, infer=layer_infer)
