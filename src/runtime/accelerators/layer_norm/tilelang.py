"""LayerNorm in TileLang: y = (x - mean) * rstd * w + b over the last dimension, fp32 math.

One compiled kernel per (dtype, weight dtype, bias dtype, width) serves every row count.
The variance is taken from the centred row held in registers (two reductions, no
cancellation). Backward is one persistent kernel writing dx and one row of partial sums
of dweight and dbias per block; a column-sum kernel reduces them (no atomics).
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
    column_sum_entry,
    info_for,
    kernel_rows,
    launcher,
    load_rows,
    param_or_placeholder,
    persistent_row_grid,
    placeholder,
    plan_for,
    reduce_dtype,
    reduce_partials,
    row_layout,
    scaled_squares,
    store_rows,
)


def forward_kernel(dtype: str, w_dtype: str | None, b_dtype: str | None, plan: RowPlan):
    N, NP, BM = plan.width, plan.padded, plan.block_rows
    has_w, has_b = w_dtype is not None, b_dtype is not None
    M = T.dynamic("M")

    @T.prim_func
    def layer_norm_fwd(
        X: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        B: T.Tensor((N if has_b else 1,), b_dtype or ACCUM),
        Y: T.Tensor((M, N), dtype),
        Mean: T.Tensor((M,), ACCUM),
        Rstd: T.Tensor((M,), ACCUM),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=plan.threads) as bx:
            io = T.alloc_fragment((BM, NP), dtype)
            xc = T.alloc_fragment((BM, NP), ACCUM)  # x, then x - mean (zero in padded columns)
            sq = T.alloc_fragment((BM, NP), ACCUM)
            mean = T.alloc_fragment((BM,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            inv = T.alloc_fragment((BM,), ACCUM)  # 1 / the row's scale (see norms.SCALE_ABOVE)
            layout = row_layout(plan)
            T.annotate_layout({io: layout, xc: layout, sq: layout})
            row0 = bx * BM
            load_rows(X, io, row0, M, N)
            for i, j in T.Parallel(BM, NP):
                xc[i, j] = T.cast(io[i, j], ACCUM)
            T.reduce_sum(xc, mean, dim=1)
            for i in T.Parallel(BM):
                mean[i] = mean[i] / N
            for i, j in T.Parallel(BM, NP):
                xc[i, j] = T.if_then_else(j < N, xc[i, j] - mean[i], 0.0)
            scaled_squares(xc, sq, inv)
            T.reduce_sum(sq, rstd, dim=1)
            for i in T.Parallel(BM):
                rstd[i] = T.rsqrt(rstd[i] / N + eps * inv[i] * inv[i]) * inv[i]
                if row0 + i < M:
                    Mean[row0 + i] = mean[i]
                    Rstd[row0 + i] = rstd[i]
            for i, j in T.Parallel(BM, NP):
                y = xc[i, j] * rstd[i]
                if has_w:
                    y = y * T.cast(W[j], ACCUM)
                if has_b:
                    y = y + T.cast(B[j], ACCUM)
                io[i, j] = T.cast(y, dtype)
            store_rows(io, Y, row0, M, N)

    return layer_norm_fwd


def backward_kernel(
    dtype: str,
    w_dtype: str | None,
    b_dtype: str | None,
    plan: RowPlan,
    n_blocks: int,
    min_blocks_per_sm: int | None = None,
):
    N, NP, BM, G = plan.width, plan.padded, plan.block_rows, n_blocks
    has_w, has_b = w_dtype is not None, b_dtype is not None
    n_params = int(has_w) + int(has_b)
    M = T.dynamic("M")

    @T.prim_func
    def layer_norm_bwd(
        DY: T.Tensor((M, N), dtype),
        X: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        Mean: T.Tensor((M,), ACCUM),
        Rstd: T.Tensor((M,), ACCUM),
        DX: T.Tensor((M, N), dtype),
        Partial: T.Tensor((G, n_params, N) if n_params else (1,), ACCUM),  # [block, (dweight, dbias), column]
    ):
        with T.Kernel(G, threads=plan.threads) as bx:
            if min_blocks_per_sm is not None:
                T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            x_io = T.alloc_fragment((BM, NP), dtype)
            dy_io = T.alloc_fragment((BM, NP), dtype)
            xhat = T.alloc_fragment((BM, NP), ACCUM)
            g = T.alloc_fragment((BM, NP), ACCUM)  # dy * w
            gx = T.alloc_fragment((BM, NP), ACCUM)
            dw = T.alloc_fragment((BM, NP), ACCUM)
            db = T.alloc_fragment((BM, NP), ACCUM)
            col_sum = T.alloc_fragment((NP,), ACCUM)
            mean = T.alloc_fragment((BM,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            c1 = T.alloc_fragment((BM,), ACCUM)
            c2 = T.alloc_fragment((BM,), ACCUM)
            layout = row_layout(plan)
            T.annotate_layout(
                {x_io: layout, dy_io: layout, xhat: layout, g: layout, gx: layout, dw: layout, db: layout}
            )
            T.clear(dw)
            T.clear(db)
            # persistent: block bx takes row groups bx, bx + G, bx + 2G, ...
            for step in T.serial(T.ceildiv(T.ceildiv(M, BM) - bx, G)):
                row0 = (step * G + bx) * BM
                load_rows(X, x_io, row0, M, N)
                load_rows(DY, dy_io, row0, M, N)
                for i in T.Parallel(BM):
                    mean[i] = T.if_then_else(row0 + i < M, Mean[row0 + i], 0.0)
                    rstd[i] = T.if_then_else(row0 + i < M, Rstd[row0 + i], 0.0)
                for i, j in T.Parallel(BM, NP):
                    xhat[i, j] = T.if_then_else(j < N, (T.cast(x_io[i, j], ACCUM) - mean[i]) * rstd[i], 0.0)
                    g[i, j] = T.cast(dy_io[i, j], ACCUM)
                    if has_w:
                        dw[i, j] += g[i, j] * xhat[i, j]
                    if has_b:
                        db[i, j] += g[i, j]
                    if has_w:
                        g[i, j] = g[i, j] * T.cast(W[j], ACCUM)
                    gx[i, j] = g[i, j] * xhat[i, j]
                T.reduce_sum(gx, c1, dim=1)
                T.reduce_sum(g, c2, dim=1)
                for i, j in T.Parallel(BM, NP):
                    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
                    x_io[i, j] = T.cast(rstd[i] * (g[i, j] - c2[i] / N - xhat[i, j] * (c1[i] / N)), dtype)
                store_rows(x_io, DX, row0, M, N)
            if has_w:
                T.reduce_sum(dw, col_sum, dim=0)
                for j in T.Parallel(NP):
                    if j < N:
                        Partial[bx, 0, j] = col_sum[j]
            if has_b:
                T.reduce_sum(db, col_sum, dim=0)
                for j in T.Parallel(NP):
                    if j < N:
                        Partial[bx, n_params - 1, j] = col_sum[j]

    return layer_norm_bwd


REGISTERS_PER_ELEMENT = 8  # backward register budget per fp32 row element a thread holds (see blocks_per_sm)


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT)


def kernel_entries(
    dtype: torch.dtype,
    width: int,
    w_dtype: torch.dtype | None,
    b_dtype: torch.dtype | None,
    device: torch.device | None = None,
) -> list[Entry]:
    """The kernels (forward, backward, and the parameter-gradient reduction) for these dtypes and
    width on `device` (None: the compile-only H100 default)."""
    entries = [_forward_entry(dtype, width, w_dtype, b_dtype), _backward_entry(dtype, width, w_dtype, b_dtype)]
    params = [d for d in (w_dtype, b_dtype) if d is not None]
    if params:
        n_blocks = persistent_grid(dtype, width, info_for(device).sm_count)[2]
        entries.append(column_sum_entry(reduce_dtype(params), n_blocks))
    return entries


def _forward_entry(dtype, width, w_dtype, b_dtype) -> Entry:
    def build(_):
        return forward_kernel(TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype), plan_for(dtype, width))

    return ("layer_norm_fwd", dtype, width, w_dtype, b_dtype), build


def _backward_entry(dtype, width, w_dtype, b_dtype) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count)
        return backward_kernel(TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype), plan, n_blocks, per_sm)

    return ("layer_norm_bwd", dtype, width, w_dtype, b_dtype), build


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float):
    rows = kernel_rows(x)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, mean, rstd
    kernel = launcher(_forward_entry(x.dtype, width, _dtype(weight), _dtype(bias)), x.device)
    kernel(rows, param_or_placeholder(weight, x), param_or_placeholder(bias, x), y.view(n_rows, width), mean, rstd, eps)
    return y, mean, rstd


def backward(dy, x, weight, bias, eps, y, mean, rstd):
    rows, dy_rows = kernel_rows(x), kernel_rows(dy)
    n_rows, width = rows.shape
    dx = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, _zeros_like(weight), _zeros_like(bias), None
    kernel = launcher(_backward_entry(x.dtype, width, _dtype(weight), _dtype(bias)), x.device)
    params = [p for p in (weight, bias) if p is not None]
    if not params:
        kernel(dy_rows, rows, placeholder(x.device), mean, rstd, dx.view(n_rows, width), placeholder(x.device))
        return dx, None, None, None
    n_blocks = persistent_grid(x.dtype, width, info_for(x.device).sm_count)[2]
    partial = buffers.empty((n_blocks, len(params), width), dtype=torch.float32, device=x.device)
    kernel(dy_rows, rows, param_or_placeholder(weight, x), mean, rstd, dx.view(n_rows, width), partial)
    grads = reduce_partials(partial.view(n_blocks, -1), params)
    dweight = grads.pop(0) if weight is not None else None
    dbias = grads.pop(0) if bias is not None else None
    return dx, dweight, dbias, None


def _dtype(t: torch.Tensor | None):
    return None if t is None else t.dtype


def _zeros_like(t: torch.Tensor | None):
    return None if t is None else torch.zeros_like(t)


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="saved")
