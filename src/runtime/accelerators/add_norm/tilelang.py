"""add_rms_norm / add_layer_norm in TileLang: total = x + residual (rounded to the inputs' dtype), y = norm(total),
fp32 math. The math and the outputs are the Triton module's (see add_norm/triton.py).

One compiled kernel per (dtype, weight dtype, bias dtype, width, centred or not) serves every row count (rows are a
dynamic dimension), laid out as the row norms' TileLang kernels are (tilelang_common.RowPlan). Backward is one
persistent kernel: each block loops over row groups, writes dtotal (both dx and dresidual) and keeps its share of
dweight / dbias in registers, then one partial row each per block; a column-sum kernel adds them (no atomics).
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
    store_rows,
)


def forward_kernel(dtype: str, w_dtype: str | None, b_dtype: str | None, centre: bool, plan: RowPlan):
    N, NP, BM = plan.width, plan.padded, plan.block_rows
    has_w, has_b = w_dtype is not None, b_dtype is not None
    M = T.dynamic("M")

    @T.prim_func
    def add_norm_fwd(
        X: T.Tensor((M, N), dtype),
        R: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        B: T.Tensor((N if has_b else 1,), b_dtype or ACCUM),
        Y: T.Tensor((M, N), dtype),
        S: T.Tensor((M, N), dtype),
        Rstd: T.Tensor((M,), ACCUM),
        Mean: T.Tensor((M,) if centre else (1,), ACCUM),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=plan.threads) as bx:
            io = T.alloc_fragment((BM, NP), dtype)  # x, then the sum, then y: 16-byte accesses
            r_io = T.alloc_fragment((BM, NP), dtype)
            s = T.alloc_fragment((BM, NP), ACCUM)  # the sum, centred for layer norm (zero in padded columns)
            sq = T.alloc_fragment((BM, NP), ACCUM)
            mean = T.alloc_fragment((BM,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            layout = row_layout(plan)
            T.annotate_layout({io: layout, r_io: layout, s: layout, sq: layout})
            row0 = bx * BM
            load_rows(X, io, row0, M, N)
            load_rows(R, r_io, row0, M, N)
            for i, j in T.Parallel(BM, NP):
                io[i, j] = T.cast(T.cast(io[i, j], ACCUM) + T.cast(r_io[i, j], ACCUM), dtype)
            store_rows(io, S, row0, M, N)
            for i, j in T.Parallel(BM, NP):
                s[i, j] = T.cast(io[i, j], ACCUM)
            if centre:
                T.reduce_sum(s, mean, dim=1)
                for i in T.Parallel(BM):
                    mean[i] = mean[i] / N
                for i, j in T.Parallel(BM, NP):
                    s[i, j] = T.if_then_else(j < N, s[i, j] - mean[i], 0.0)
            for i, j in T.Parallel(BM, NP):
                sq[i, j] = s[i, j] * s[i, j]
            T.reduce_sum(sq, rstd, dim=1)
            for i in T.Parallel(BM):
                rstd[i] = T.rsqrt(rstd[i] / N + eps)
                if row0 + i < M:
                    Rstd[row0 + i] = rstd[i]
                    if centre:
                        Mean[row0 + i] = mean[i]
            for i, j in T.Parallel(BM, NP):
                y = s[i, j] * rstd[i]
                if has_w:
                    y = y * T.cast(W[j], ACCUM)
                if has_b:
                    y = y + T.cast(B[j], ACCUM)
                io[i, j] = T.cast(y, dtype)
            store_rows(io, Y, row0, M, N)

    return add_norm_fwd


def backward_kernel(
    dtype: str,
    w_dtype: str | None,
    b_dtype: str | None,
    centre: bool,
    plan: RowPlan,
    n_blocks: int,
    min_blocks_per_sm: int | None = None,
):
    N, NP, BM, G = plan.width, plan.padded, plan.block_rows, n_blocks
    has_w, has_b = w_dtype is not None, b_dtype is not None
    n_params = int(has_w) + int(has_b)
    M = T.dynamic("M")

    @T.prim_func
    def add_norm_bwd(
        DY: T.Tensor((M, N), dtype),
        DN: T.Tensor((M, N), dtype),
        S: T.Tensor((M, N), dtype),
        Rstd: T.Tensor((M,), ACCUM),
        Mean: T.Tensor((M,) if centre else (1,), ACCUM),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        DS: T.Tensor((M, N), dtype),
        Partial: T.Tensor((G, n_params, N) if n_params else (1,), ACCUM),  # [block, (dweight, dbias), column]
    ):
        with T.Kernel(G, threads=plan.threads) as bx:
            if min_blocks_per_sm is not None:
                T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            s_io = T.alloc_fragment((BM, NP), dtype)
            dy_io = T.alloc_fragment((BM, NP), dtype)
            dn_io = T.alloc_fragment((BM, NP), dtype)
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
                {
                    s_io: layout,
                    dy_io: layout,
                    dn_io: layout,
                    xhat: layout,
                    g: layout,
                    gx: layout,
                    dw: layout,
                    db: layout,
                }
            )
            T.clear(dw)
            T.clear(db)
            # persistent: block bx takes row groups bx, bx + G, bx + 2G, ...
            for step in T.serial(T.ceildiv(T.ceildiv(M, BM) - bx, G)):
                row0 = (step * G + bx) * BM
                load_rows(S, s_io, row0, M, N)
                load_rows(DY, dy_io, row0, M, N)
                load_rows(DN, dn_io, row0, M, N)
                for i in T.Parallel(BM):
                    rstd[i] = T.if_then_else(row0 + i < M, Rstd[row0 + i], 0.0)
                    if centre:
                        mean[i] = T.if_then_else(row0 + i < M, Mean[row0 + i], 0.0)
                for i, j in T.Parallel(BM, NP):
                    if centre:
                        xhat[i, j] = T.if_then_else(j < N, (T.cast(s_io[i, j], ACCUM) - mean[i]) * rstd[i], 0.0)
                    else:
                        xhat[i, j] = T.cast(s_io[i, j], ACCUM) * rstd[i]  # zero in padded columns
                    g[i, j] = T.cast(dy_io[i, j], ACCUM)
                    if has_w:
                        dw[i, j] += g[i, j] * xhat[i, j]
                    if has_b:
                        db[i, j] += g[i, j]
                    if has_w:
                        g[i, j] = g[i, j] * T.cast(W[j], ACCUM)
                    gx[i, j] = g[i, j] * xhat[i, j]
                T.reduce_sum(gx, c1, dim=1)
                if centre:
                    T.reduce_sum(g, c2, dim=1)
                else:
                    T.clear(c2)
                for i, j in T.Parallel(BM, NP):
                    # dtotal = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dnew (RMSNorm: mean(g) left out)
                    s_io[i, j] = T.cast(
                        rstd[i] * (g[i, j] - c2[i] / N - xhat[i, j] * (c1[i] / N)) + T.cast(dn_io[i, j], ACCUM), dtype
                    )
                store_rows(s_io, DS, row0, M, N)
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

    return add_norm_bwd


# backward register budget per fp32 row element a thread holds (tilelang_common.blocks_per_sm): the row norms' (4 and
# 8) and one more row tile (dnew)
REGISTERS_PER_ELEMENT = {False: 6, True: 10}


def persistent_grid(dtype: torch.dtype, width: int, sm_count: int, centre: bool) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of the persistent backward kernel."""
    return persistent_row_grid(dtype, width, sm_count, REGISTERS_PER_ELEMENT[centre])


def kernel_entries(
    dtype: torch.dtype,
    width: int,
    w_dtype: torch.dtype | None,
    b_dtype: torch.dtype | None,
    centre: bool,
    device: torch.device | None = None,
) -> list[Entry]:
    """The kernels (forward, backward, and the parameter-gradient reduction) for these dtypes, width and norm (centre:
    layer norm) on `device` (None: the compile-only H100 default)."""
    entries = [
        _forward_entry(dtype, width, w_dtype, b_dtype, centre),
        _backward_entry(dtype, width, w_dtype, b_dtype, centre),
    ]
    params = [d for d in (w_dtype, b_dtype) if d is not None]
    if params:
        n_blocks = persistent_grid(dtype, width, info_for(device).sm_count, centre)[2]
        entries.append(column_sum_entry(reduce_dtype(params), n_blocks))
    return entries


def _forward_entry(dtype, width, w_dtype, b_dtype, centre) -> Entry:
    def build(_):
        plan = plan_for(dtype, width)
        return forward_kernel(TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype), centre, plan)

    return ("add_norm_fwd", dtype, width, w_dtype, b_dtype, centre), build


def _backward_entry(dtype, width, w_dtype, b_dtype, centre) -> Entry:
    def build(info):
        plan, per_sm, n_blocks = persistent_grid(dtype, width, info.sm_count, centre)
        return backward_kernel(
            TL_DTYPE[dtype], TL_DTYPE.get(w_dtype), TL_DTYPE.get(b_dtype), centre, plan, n_blocks, per_sm
        )

    return ("add_norm_bwd", dtype, width, w_dtype, b_dtype, centre), build


def _dtype(t: torch.Tensor | None):
    return None if t is None else t.dtype


def _forward(x, residual, weight, bias, eps: float, centre: bool):
    rows, r_rows = kernel_rows(x), kernel_rows(residual)
    n_rows, width = rows.shape
    y = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    total = buffers.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = buffers.empty((n_rows,), dtype=torch.float32, device=x.device)
    mean = buffers.empty((n_rows,), dtype=torch.float32, device=x.device) if centre else None
    if n_rows:
        kernel = launcher(_forward_entry(x.dtype, width, _dtype(weight), _dtype(bias), centre), x.device)
        kernel(
            rows, r_rows, param_or_placeholder(weight, x), param_or_placeholder(bias, x), y.view(n_rows, width),
            total.view(n_rows, width), rstd, placeholder(x.device) if mean is None else mean, eps,
        )  # fmt: skip
    return (y, total, rstd, mean) if centre else (y, total, rstd)


def _backward(dy, dnew, weight, bias, total, rstd, mean):
    """(dtotal, dweight, dbias); dtotal is both dx and dresidual."""
    dy_rows, dn_rows = kernel_rows(dy), kernel_rows(dnew)
    n_rows, width = dy_rows.shape
    dtotal = buffers.empty(total.shape, dtype=total.dtype, device=total.device)
    params = [p for p in (weight, bias) if p is not None]
    if n_rows == 0:
        return dtotal, *(None if p is None else torch.zeros_like(p) for p in (weight, bias))
    device, centre = total.device, mean is not None
    kernel = launcher(_backward_entry(total.dtype, width, _dtype(weight), _dtype(bias), centre), device)
    n_blocks = persistent_grid(total.dtype, width, info_for(device).sm_count, centre)[2]
    partial = buffers.empty((n_blocks, len(params), width), dtype=torch.float32, device=device) if params else None
    kernel(
        dy_rows, dn_rows, total.view(n_rows, width), rstd, placeholder(device) if mean is None else mean,
        param_or_placeholder(weight, total), dtotal.view(n_rows, width), placeholder(device) if partial is None else partial,
    )  # fmt: skip
    if not params:
        return dtotal, None, None
    grads = reduce_partials(partial.view(n_blocks, -1), params)
    return dtotal, grads.pop(0) if weight is not None else None, grads.pop(0) if bias is not None else None


def rms_forward(x, residual, weight, eps: float):
    return _forward(x, residual, weight, None, eps, centre=False)


def rms_backward(dy, dnew, x, residual, weight, eps, y, total, rstd):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, _ = _backward(dy, dnew, weight, None, total, rstd, None)
    return dtotal, dtotal, dweight, None


def layer_forward(x, residual, weight, bias, eps: float):
    return _forward(x, residual, weight, bias, eps, centre=True)


def layer_backward(dy, dnew, x, residual, weight, bias, eps, y, total, rstd, mean):
    """x, residual and y are not read (x and residual are None in eager calls)."""
    dtotal, dweight, dbias = _backward(dy, dnew, weight, bias, total, rstd, mean)
    return dtotal, dtotal, dweight, dbias, None


RMS_KERNELS = KernelBackend(forward=rms_forward, backward=rms_backward)
LAYER_KERNELS = KernelBackend(forward=layer_forward, backward=layer_backward)
