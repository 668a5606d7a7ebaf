"""RMSNorm in Triton: y = x * rstd * weight, rstd = rsqrt(mean(x^2) + eps), fp32 math.

Backward (xhat = x * rstd, g = dy * weight):
    dx = rstd * (g - xhat * mean(g * xhat))     dweight = sum over rows of dy * xhat

The backward kernel works rstd out again from x, as the forward does (rms_rstd): it reads x anyway, so that costs one
row sum and no memory traffic, and a forward that will be differentiated keeps nothing for it (eager calls run
`infer`: one allocation and one saved tensor fewer per call; its KERNELS' backward_reads). `forward`, the custom op's,
still returns rstd, as the op's schema has it.

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
    rms_rstd,
    row_tiles,
    rows_of,
    sum_partials,
)
from ..triton_launch import direct_launch


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _forward_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, N, stride_x, eps,
    HAS_W: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n_rows, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_W:  # loaded before the reduction, so that its latency overlaps x's
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    rstd = rms_rstd(x, N, eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * w
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _backward_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, part_ptr, dw_ptr, counter_ptr, n_rows, N, stride_dy, stride_x, eps,
    HAS_W: tl.constexpr, FINISH: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = rms_rstd(x, N, eps)[:, None]
        xhat = x * rstd
        g = dy * w if HAS_W else dy
        dx = (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]) * rstd
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
    if HAS_W:
        tl.store(part_ptr + pid * N + cols, tl.sum(dw, axis=0), mask=col_mask)
        if FINISH:
            add_partials_if_last(part_ptr, dw_ptr, dw_ptr, counter_ptr, N, True, False, BLOCK_N, ROWS)


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    return _forward(x, weight, eps, store_rstd=True)


def infer(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """y alone (no rstd for a backward): one allocation fewer."""
    return _forward(x, weight, eps, store_rstd=False)


def native_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    """infer's y, its backward attached as a C++ node (_NATIVE) that runs backward_launch; None, having run nothing,
    where it cannot be (see NativeBackward.plan), or where the backward takes two launches (wide rows)."""
    rows = rows_of(x)
    dweight = None if weight is None else GRAD_OF[1]
    launch = backward_launch(x, weight, eps, GRAD, x.shape[-1], GRAD_OF[0], dweight, None, rows)
    if launch is None:
        return None
    inputs = (x, weight)
    plan = _NATIVE.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    (y,) = _forward(x, weight, eps, store_rstd=False, rows=rows)  # infer's, on the rows the backward reads
    return y if _NATIVE.attach(plan, y, inputs, launch) else None


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, store_rstd: bool, rows=None):
    """rows: rows_of(x) where the caller has it (a copy for x whose rows are not a view)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device) if store_rstd else None
    _forward_kernel[(n_tiles(n_rows, tiles),)](
        x2, x2 if weight is None else weight.contiguous(), y, x2 if rstd is None else rstd, n_rows, width, stride_x, eps,
        HAS_W=weight is not None, STORE_RSTD=store_rstd, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y, rstd) if store_rstd else (y,)


def backward(dy, x, weight, eps, y, rstd, launch: ParameterBackwardLaunch = PARAMETER_BACKWARD):
    """y and rstd are not read (None in eager calls)."""
    dy2, _, stride_dy = rows_of(dy)
    dx = buffers.empty_like(x)
    dweight = None if weight is None else buffers.empty_like(weight)
    backward_launch(x, weight, eps, dy2, stride_dy, dx, dweight, launch).run()
    return dx, dweight, None


def backward_launch(
    x, weight, eps, dy, stride_dy: int, dx, dweight, launch: ParameterBackwardLaunch | None, rows=None
) -> LaunchPlan | None:
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. dy (rows of stride
    stride_dy), dx, dweight (None without a weight): the gradients, or the node's stand-ins for them (GRAD, GRAD_OF).
    launch None: the default launch where it is one launch, else None, allocating nothing. rows: rows_of(x)."""
    x2, n_rows, stride_x = rows or rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    n_params = int(weight is not None)
    split = backward_split(n_rows, width, tiles, x.device, n_params, x2, launch)
    if split is None:
        return None
    programs, finish, counter, partial = split
    return LaunchPlan(
        _backward_kernel, (programs,),
        (dy, x2, x2 if weight is None else weight.contiguous(), dx, partial, x2 if dweight is None else dweight, counter,
         n_rows, width, stride_dy, stride_x, eps),
        dict(HAS_W=weight is not None, FINISH=finish, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
        (counter, partial) if finish else (),
        (sum_partials, partial, dweight) if n_params and not finish else (),
    )  # fmt: skip


_NATIVE = NativeBackward("RmsNormTritonBackward", _backward_kernel)


KERNELS = KernelBackend(
    forward=forward, backward=backward, infer=infer, native_forward=native_forward, backward_reads="arguments"
)
