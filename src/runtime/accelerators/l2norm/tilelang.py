"""L2Norm in TileLang: y = x * rstd, rstd = rsqrt(sum(x^2) + eps), fp32 math.

One compiled kernel per (dtype, width) and direction serves every row count. No
parameters, so backward needs no partial sums: dx = rstd * (dy - y * sum(dy * y)), from the output y
(see triton.py). The forward kernel is built by the row norms' family (norms_tilelang, flag l2).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..norms_tilelang import forward_kernel
from ..tilelang_common import (
    ACCUM,
    TL_DTYPE,
    Entry,
    RowPlan,
    kernel_rows,
    launcher,
    load_rows,
    plan_for,
    row_layout,
    store_rows,
)


def backward_kernel(dtype: str, plan: RowPlan):
    N, NP, BM = plan.width, plan.padded, plan.block_rows
    M = T.dynamic("M")

    @T.prim_func
    def l2norm_bwd(
        DY: T.Tensor((M, N), dtype),
        Y: T.Tensor((M, N), dtype),
        Rstd: T.Tensor((M,), ACCUM),
        DX: T.Tensor((M, N), dtype),
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=plan.threads) as bx:
            row0 = (T.ceildiv(M, BM) - 1 - bx) * BM  # last tile first (see triton.py)
            y_io = T.alloc_fragment((BM, NP), dtype)
            dy_io = T.alloc_fragment((BM, NP), dtype)
            y = T.alloc_fragment((BM, NP), ACCUM)
            dy = T.alloc_fragment((BM, NP), ACCUM)
            dyy = T.alloc_fragment((BM, NP), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            dot = T.alloc_fragment((BM,), ACCUM)
            layout = row_layout(plan)
            T.annotate_layout({y_io: layout, dy_io: layout, y: layout, dy: layout, dyy: layout})
            load_rows(Y, y_io, row0, M, N)
            load_rows(DY, dy_io, row0, M, N)
            for i in T.Parallel(BM):
                rstd[i] = T.if_then_else(row0 + i < M, Rstd[row0 + i], 0.0)
            for i, j in T.Parallel(BM, NP):
                y[i, j] = T.cast(y_io[i, j], ACCUM)
                dy[i, j] = T.cast(dy_io[i, j], ACCUM)
                dyy[i, j] = dy[i, j] * y[i, j]
            T.reduce_sum(dyy, dot, dim=1)
            for i, j in T.Parallel(BM, NP):
                y_io[i, j] = T.cast(rstd[i] * (dy[i, j] - y[i, j] * dot[i]), dtype)
            store_rows(y_io, DX, row0, M, N)

    return l2norm_bwd


def kernel_entries(dtype: torch.dtype, width: int) -> list[Entry]:
    """The kernels (forward, backward) for this dtype and width."""
    return [_entry("fwd", _forward_kernel, dtype, width), _entry("bwd", backward_kernel, dtype, width)]


def _forward_kernel(dtype: str, plan: RowPlan):
    return forward_kernel("l2norm_fwd", dtype, None, None, plan, l2=True)


def _entry(direction: str, builder, dtype: torch.dtype, width: int) -> Entry:
    return ("l2norm_" + direction, dtype, width), lambda _: builder(TL_DTYPE[dtype], plan_for(dtype, width))


def forward(x: torch.Tensor, eps: float):
    rows = kernel_rows(x)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    launcher(_entry("fwd", _forward_kernel, x.dtype, width), x.device)(rows, y.view(n_rows, width), rstd, eps)
    return y, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, eps: float, y: torch.Tensor, rstd: torch.Tensor):
    """dx from y and rstd, as triton.py (see its docstring); y is forward's contiguous output."""
    dy_rows = kernel_rows(dy)
    n_rows, width = dy_rows.shape
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, None
    launcher(_entry("bwd", backward_kernel, x.dtype, width), x.device)(
        dy_rows, kernel_rows(y), rstd, dx.view(n_rows, width)
    )
    return dx, None


KERNELS = KernelBackend(forward=forward, backward=backward)
