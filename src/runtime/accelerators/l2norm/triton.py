"""L2Norm in Triton: y = x * rstd, rstd = rsqrt(sum(x^2) + eps), fp32 math.

Backward: dx = rstd * (dy - y * sum(dy * y)), from the output y (= x * rstd) that forward wrote, not from x, as
fla's backward kernel does. The bytes are the same; y was written last, so where backward follows forward closely
(the benchmark's forward+backward) more of it is still in L2, and backward visits the row tiles in reverse to start
on the rows still there. For 16-bit inputs dx then carries y's rounding (relative 2^-9 at bf16), far inside the
gradient bounds. No parameters, so backward runs one tile per program like forward.

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
from ..native import GRAD, GRAD_OF, OUTPUT, NativeBackward
from ..norms_triton import n_tiles, row_tiles, rows_of, rsqrt_mean_square
from ..triton_launch import direct_launch


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _forward_kernel(
    x_ptr, y_ptr, rstd_ptr, n_rows, N, stride_x, eps,
    STORE_RSTD: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n_rows, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = rsqrt_mean_square(x, 1, eps)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def _backward_kernel(
    dy_ptr, y_ptr, rstd_ptr, dx_ptr, n_rows, N, stride_dy, stride_y,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # last tile first: those are the rows of y that forward wrote last (see the docstring)
    rows = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < n_rows, cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
    rows = rows.to(tl.int64)
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = (dy - y * tl.sum(dy * y, axis=1)[:, None]) * rstd
    tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def forward(x: torch.Tensor, eps: float):
    return _forward(x, eps, _rstd_buffer(x))


def infer(x: torch.Tensor, eps: float):
    """Forward without autograd: rstd is neither allocated nor written."""
    return _forward(x, eps, None)


def _rstd_buffer(x: torch.Tensor) -> torch.Tensor:
    return buffers.empty((x.numel() // x.shape[-1],), dtype=torch.float32, device=x.device)


def native_forward(x: torch.Tensor, eps: float):
    """forward's y, its backward attached as a C++ node (_NATIVE) that runs backward_launch, reading y and rstd;
    None, having run nothing, where it cannot be (see NativeBackward.plan)."""
    width = x.shape[-1]
    rstd = _rstd_buffer(x)
    launch = backward_launch(x, rstd, GRAD, width, OUTPUT, width, GRAD_OF[0])
    inputs = (x,)
    plan = _NATIVE.plan(x.dtype, inputs, launch)
    if plan is None:
        return None
    y, _ = _forward(x, eps, rstd)
    return y if _NATIVE.attach(plan, y, inputs, launch) else None


def _forward(x: torch.Tensor, eps: float, rstd: torch.Tensor | None):
    """(y, rstd) with rstd written into the given buffer, or (y,) where it is None."""
    x2, n_rows, stride_x = rows_of(x)
    width = x.shape[-1]
    tiles = row_tiles(width)
    y = buffers.empty_like(x)
    _forward_kernel[(n_tiles(n_rows, tiles),)](
        x2, y, x2 if rstd is None else rstd, n_rows, width, stride_x, eps,
        STORE_RSTD=rstd is not None, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps,
    )  # fmt: skip
    return (y,) if rstd is None else (y, rstd)


def backward(dy, x, eps, y, rstd):
    (dy2, _, stride_dy), (y2, _, stride_y) = rows_of(dy), rows_of(y)
    dx = buffers.empty_like(x)
    backward_launch(x, rstd, dy2, stride_dy, y2, stride_y, dx).run()
    return dx, None


def backward_launch(x, rstd, dy, stride_dy: int, y, stride_y: int, dx) -> LaunchPlan:
    """The backward's launch, for `backward` to run and `native_forward` to hand to the C++ node. dy and y (rows of
    stride stride_dy and stride_y), dx: the output's gradient, the output and the input's gradient, or the node's
    stand-ins for them (GRAD, OUTPUT, GRAD_OF)."""
    width = x.shape[-1]
    n_rows, tiles = x.numel() // width, row_tiles(width)
    return LaunchPlan(
        _backward_kernel,
        (n_tiles(n_rows, tiles),),
        (dy, y, rstd, dx, n_rows, width, stride_dy, stride_y),
        dict(BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps),
    )


_NATIVE = NativeBackward("L2NormTritonBackward", _backward_kernel)


KERNELS = KernelBackend(forward=forward, backward=backward, infer=infer, native_forward=native_forward)
