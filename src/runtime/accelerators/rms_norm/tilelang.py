"""RMSNorm in TileLang: y = x * rstd * w, rstd = rsqrt(mean(x^2) + eps), fp32 math.

One compiled kernel per (dtype, weight dtype, width) serves every row count (rows are a
dynamic dimension). Backward is one persistent kernel: each block loops over row groups,
writes dx and keeps its share of dweight in registers, then one partial row per block;
a column-sum kernel reduces the partials (no atomics).
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..tilelang_common import (
    ACCUM,
    TL_DTYPE,
    Entry,
    RowPlan,
    column_sum,
    column_sum_entry,
    info_for,
    kernel_rows,
    launcher,
    load_rows,
    param_or_placeholder,
    persistent_row_grid,
    placeholder,
    plan_for,
    row_layout,
    scaled_squares,
    store_rows,
)


def forward_kernel(dtype: str, w_dtype: str | None, plan: RowPlan):
    N, NP, BM = plan.width, plan.padded, plan.block_rows
    has_w = w_dtype is not None
    M = T.dynamic("M")

    @T.prim_func
    def rms_norm_fwd(
        X: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        Y: T.Tensor((M, N), dtype),
        Rstd: T.Tensor((M,), ACCUM),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=plan.threads) as bx:
            io = T.alloc_fragment((BM, NP), dtype)  # rows as loaded and stored: 16-byte accesses
            x = T.alloc_fragment((BM, NP), ACCUM)
            sq = T.alloc_fragment((BM, NP), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            inv = T.alloc_fragment((BM,), ACCUM)  # 1 / the row's scale (see norms.SCALE_ABOVE)
            T.annotate_layout({io: row_layout(plan), x: row_layout(plan), sq: row_layout(plan)})
            row0 = bx * BM
            load_rows(X, io, row0, M, N)
            for i, j in T.Parallel(BM, NP):
                x[i, j] = T.cast(io[i, j], ACCUM)
            scaled_squares(x, sq, inv)
            T.reduce_sum(sq, rstd, dim=1)
            for i in T.Parallel(BM):
                rstd[i] = T.rsqrt(rstd[i] / N + eps * inv[i] * inv[i]) * inv[i]
                if row0 + i < M:
                    Rstd[row0 + i] = rstd[i]
            for i, j in T.Parallel(BM, NP):
                if has_w:
                    io[i, j] = T.cast(x[i, j] * rstd[i] * T.cast(W[j], ACCUM), dtype)
                else:
                    io[i, j] = T.cast(x[i, j] * rstd[i], dtype)
            store_rows(io, Y, row0, M, N)

    return rms_norm_fwd


def backward_kernel(
    dtype: str, w_dtype: str | None, plan: RowPlan, n_blocks: int, min_blocks_per_sm: int | None = None
):
    N, NP, BM, G = plan.width, plan.padded, plan.block_rows, n_blocks
    has_w = w_dtype is not None
    M = T.dynamic("M")

    @T.prim_func
    def rms_norm_bwd(
        DY: T.Tensor((M, N), dtype),
        X: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        Rstd: T.Tensor((M,), ACCUM),
        DX: T.Tensor((M, N), dtype),
        Partial: T.Tensor((G, N) if has_w else (1,), ACCUM),
    ):
        with T.Kernel(G, threads=plan.threads) as bx:
            if min_blocks_per_sm is not None:
                T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            x_io = T.alloc_fragment((BM, NP), dtype)
            dy_io = T.alloc_fragment((BM, NP), dtype)
            x = T.alloc_fragment((BM, NP), ACCUM)
            g = T.alloc_fragment((BM, NP), ACCUM)  # dy * w
            gx = T.alloc_fragment((BM, NP), ACCUM)
            dw = T.alloc_fragment((BM, NP), ACCUM)
            dw_sum = T.alloc_fragment((NP,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            dot = T.alloc_fragment((BM,), ACCUM)
            layout = row_layout(plan)
            T.annotate_layout({x_io: layout, dy_io: layout, x: layout, g: layout, gx: layout, dw: layout})
            T.clear(dw)
            # persistent: block bx takes row groups bx, bx + G, bx + 2G, ...
            for step in T.serial(T.ceildiv(T.ceildiv(M, BM) - bx, G)):
                row0 = (step * G + bx) * BM
                load_rows(X, x_io, row0, M, N)
                load_rows(DY, dy_io, row0, M, N)
                for i in T.Parallel(BM):
                    rstd[i] = T.if_then_else(row0 + i < M, Rstd[row0 + i], 0.0)
                for i, j in T.Parallel(BM, NP):
                    x[i, j] = T.cast(x_io[i, j], ACCUM)
                    g[i, j] = T.cast(dy_io[i, j], ACCUM)
                    if has_w:
                        dw[i, j] += g[i, j] * x[i, j] * rstd[i]
                        g[i, j] = g[i, j] * T.cast(W[j], ACCUM)
                    gx[i, j] = g[i, j] * x[i, j]
                T.reduce_sum(gx, dot, dim=1)
                for i in T.Parallel(BM):
                    dot[i] = dot[i] * rstd[i] * rstd[i] / N  # mean(g * xhat) * rstd
                for i, j in T.Parallel(BM, NP):
                    # dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd
                    x_io[i, j] = T.cast(rstd[i] * (g[i, j] - x[i, j] * dot[i]), dtype)
                store_rows(x_io, DX, row0, M, N)
            if has_w:
                T.reduce_sum(dw, dw_sum, dim=0)
                for j in T.Parallel(NP):
                    if j < N:
                        Partial[bx, j] = dw_sum[j]

    return rms_norm_bwd


REGISTERS_PER_ELEMENT = 4  # backward register budget per fp32 row element a thread holds (see blocks_per_sm)


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT)


def kernel_entries(
    dtype: torch.dtype, width: int, w_dtype: torch.dtype | None, device: torch.device | None = None
) -> list[Entry]:
    """The kernels (forward, backward, and the dweight reduction) for these dtypes and width on
    `device` (None: the compile-only H100 default)."""
    entries = [_forward_entry(dtype, width, w_dtype), _backward_entry(dtype, width, w_dtype)]
    if w_dtype is not None:
        entries.append(column_sum_entry(w_dtype, persistent_grid(dtype, width, info_for(device).sm_count)[2]))
    return entries


def _forward_entry(dtype, width, w_dtype) -> Entry:
    def build(_):
        return forward_kernel(TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), plan_for(dtype, width))

    return ("rms_norm_fwd", dtype, width, w_dtype), build


def _backward_entry(dtype, width, w_dtype) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count)
        return backward_kernel(TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), plan, n_blocks, per_sm)

    return ("rms_norm_bwd", dtype, width, w_dtype), build


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float):
    rows = kernel_rows(x)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    kernel = launcher(_forward_entry(x.dtype, width, None if weight is None else weight.dtype), x.device)
    kernel(rows, param_or_placeholder(weight, x), y.view(n_rows, width), rstd, eps)
    return y, rstd


def backward(dy, x, weight, eps, y, rstd):
    rows, dy_rows = kernel_rows(x), kernel_rows(dy)
    n_rows, width = rows.shape
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, None if weight is None else torch.zeros_like(weight), None
    kernel = launcher(_backward_entry(x.dtype, width, None if weight is None else weight.dtype), x.device)
    if weight is None:
        kernel(dy_rows, rows, placeholder(x.device), rstd, dx.view(n_rows, width), placeholder(x.device))
        return dx, None, None
    n_blocks = persistent_grid(x.dtype, width, info_for(x.device).sm_count)[2]
    partial = buffers.empty((n_blocks, width), dtype=torch.float32, device=x.device)
    kernel(dy_rows, rows, weight.contiguous(), rstd, dx.view(n_rows, width), partial)
    dweight = column_sum(partial, buffers.empty((width,), dtype=weight.dtype, device=weight.device))
    return dx, dweight, None


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="saved")
