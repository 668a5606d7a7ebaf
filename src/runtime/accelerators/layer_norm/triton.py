"""LayerNorm in Triton: y = (x - mean) * rstd * weight + bias, rstd = rsqrt(var + eps), fp32 math.

Backward (xhat = (x - mean) * rstd, g = dy * weight):
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat          dbias = sum over rows of dy

The backward kernel works mean and rstd out again from x, as the forward does (row_statistics): it reads x anyway, so
that costs two row sums and no memory traffic, and a forward that will be differentiated keeps nothing for it (eager
calls run `infer`: two allocations and two saved tensors fewer per call; its KERNELS' backward_reads). `forward`, the
custom op's, still returns mean and rstd, as the op's schema has them.

The backward's launch is described once, by `backward_launch` (a LaunchPlan): `backward` runs it, `native_forward`
hands it to the C++ node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_plan import LaunchPlan
from ..native import GRAD, GRAD_OF, NativeBackward
from ..norms_triton import (
    PARAMETER_BACKWARD,
    ParameterBackwardLaunch,
    add_partials_if_last,
    backward_split,
    n_tiles,
    row_statistics,
    row_tiles,
    rows_of,
    sum_partials,
)
from ..triton_launch import direct_launch


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, N, stride_x, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n_rows, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # the parameters are loaded before the reductions, so that their latency overlaps x's
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mean, centred, rstd = row_statistics(x, mask, N, eps)
    y = centred * rstd[:, None]
    if HAS_W:
        y = y * w
    if HAS_B:
        y = y + b
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, dw_ptr, db_ptr, counter_ptr, n_rows, N, stride_dy, stride_x, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, FINISH: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
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
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, centred, rstd = row_statistics(x, mask, N, eps)
        rstd = rstd[:, None]
        xhat = centred * rstd
        g = dy * w if HAS_W else dy
        mean_g = tl.sum(g, axis=1) / N
        mean_gx = tl.sum(g * xhat, axis=1) / N
        dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
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


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    return _forward(x, weight, bias, eps, store_stats=True)


def infer(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    """y alone (no mean and rstd for a backward): two allocations fewer."""
    return _forward(x, weight, bias, eps, store_stats=False)


def native_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    """infer's y, its backward attached as a C++ node (_NATIVE) that runs backward_launch; None, having run nothing,
    where it cannot be (see NativeBackward.plan), or where the backward takes two launches (wide rows)."""
    rows = rows_of(x)
    dweight, dbias = None if weight is None else GRAD_OF[1], None if bias is None else GRAD_OF[2]
    launch = backward_launch(x, weight, bias, eps, GRAD, x.shape[-1], GRAD_OF[0], dweight, dbias, None, rows)
    if launch is None:
        return None
    inputs = (x, weight, bias)
    plan = _NATIVE.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    (y,) = _forward(x, weight, bias, eps, store_stats=False, rows=rows)  # infer's, on the rows the backward reads
    return y if _NATIVE.attach(plan, y, inputs, launch) else None


def _forward(x, weight, bias, eps: float, store_stats: bool, rows=None):
    """rows: rows_of(x) where the caller has it (a copy for x whose rows are not a view)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    if store_stats:
        mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
        rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    else:
        mean = rstd = x2  # stand-ins, not written
    _forward_kernel[(n_tiles(n_rows, tiles),)](
        x2, x2 if weight is None else weight.contiguous(), x2 if bias is None else bias.contiguous(), y, mean, rstd,
        n_rows, width, stride_x, eps,
        HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=store_stats,
        BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y, mean, rstd) if store_stats else (y,)


def backward(dy, x, weight, bias, eps, y, mean, rstd, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD):
    """y, mean and rstd are not read (None in eager calls)."""
    dy2, _, stride_dy = rows_of(dy)
    dx = buffers.empty_like(x)
    dweight = None if weight is None else buffers.empty_like(weight)
    dbias = None if bias is None else buffers.empty_like(bias)
    backward_launch(x, weight, bias, eps, dy2, stride_dy, dx, dweight, dbias, launch).run()
    return dx, dweight, dbias, None


def backward_launch(
    x, weight, bias, eps, dy, stride_dy: int, dx, dweight, dbias, launch: ParameterBackwardLaunch | None, rows=None
) -> LaunchPlan | None:
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. dy (rows of stride
    stride_dy), dx, dweight, dbias (None without the parameter): the gradients, or the node's stand-ins for them
    (GRAD, GRAD_OF). launch None: the default launch where it is one launch, else None, allocating nothing.
    rows: rows_of(x)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    n_params = (weight is not None) + (bias is not None)
    split = backward_split(n_rows, width, tiles, x.device, n_params, x2, launch)
    if split is None:
        return None
    programs, finish, counter, partial = split
    return LaunchPlan(
        _backward_kernel, (programs,),
        (dy, x2, x2 if weight is None else weight.contiguous(), dx, partial, x2 if dweight is None else dweight,
         x2 if dbias is None else dbias, counter, n_rows, width, stride_dy, stride_x, eps),
        dict(HAS_W=weight is not None, HAS_B=bias is not None, FINISH=finish,
             BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
        (counter, partial) if finish else (),
        (sum_partials, partial, dweight, dbias) if n_params and not finish else (),
    )  # fmt: skip


_NATIVE = NativeBackward("LayerNormTritonBackward", _backward_kernel)


KERNELS = KernelBackend(
    forward=forward, backward=backward, infer=infer, native_forward=native_forward, backward_reads="arguments"
)
