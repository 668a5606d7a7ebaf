"""The Triton kernels of the row norms (rms_norm, layer_norm, l2norm): one forward and one backward, their op chosen by
compile-time flags. Tiles, launches and partial sums: norms_triton.

    CENTRE  subtract the row mean first (LayerNorm)
    L2      rstd of the sum of squares, not of their mean (l2norm); its backward reads the output y and the saved rstd
            (x_ptr, rstd_ptr) and runs one tile per program, last tile first (see l2norm.triton)
    HAS_W, HAS_B  a weight, a bias

The backward reads the rstd (and, with CENTRE, the mean) that the forward stored (STORE_STATS) rather than working
them out again from x: 4 or 8 bytes a row, against a second row reduction for rows whose squares pass 2^100 and a
tile-wide vote on it in every step of the persistent loop.

Each op passes None for the parameters its kernel does not take: Triton compiles a None argument as a constexpr, so an
op's compiled kernel takes the same parameters, in the same order, as a kernel of its own would (a native node passes
them in that order). The launches: the ops' forward launchers and their `backward_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .norms_triton import add_partials_if_last, rms_rstd, row_statistics, rsqrt_mean_square
from .triton_launch import direct_launch


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def row_norm_forward(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, N, stride_x, eps,
    CENTRE: tl.constexpr, L2: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """y = x' * rstd * w + b, x' = x - mean (CENTRE) or x. STORE_STATS: the mean (CENTRE) and rstd of each row too."""
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
    if CENTRE:
        mean, x, rstd = row_statistics(x, mask, N, eps)
    elif L2:
        rstd = rsqrt_mean_square(x, 1, eps)
    else:
        rstd = rms_rstd(x, N, eps)
    if L2:  # y's address worked out before y, as in l2norm's own kernel (the same instructions, in the same order)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        y = x * rstd[:, None]
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + b
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        if CENTRE:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])
def row_norm_backward(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, dw_ptr, db_ptr, counter_ptr,
    n_rows, N, stride_dy, stride_x,
    CENTRE: tl.constexpr, L2: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, FINISH: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """dx, and the partial sums of dweight / dbias (norms_triton), from the forward's stored rstd and (CENTRE) mean
    (mean_ptr None without CENTRE). Where L2, x_ptr is the output y."""
    if L2:  # last tile first: those are the rows of y that forward wrote last
        rows = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < n_rows, cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        rows = rows.to(tl.int64)
        y = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = (dy - y * tl.sum(dy * y, axis=1)[:, None]) * rstd  # y = xhat, g = dy, sums for means
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
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
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
            if CENTRE:
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
            rows = rows.to(tl.int64)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # x - mean is not zero in the padding columns, but dy (and so g) is: no sum sees them
            xhat = (x - mean) * rstd if CENTRE else x * rstd
            g = dy * w if HAS_W else dy
            if CENTRE:
                mean_g = tl.sum(g, axis=1) / N
                mean_gx = tl.sum(g * xhat, axis=1) / N
                dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd
            else:
                dx = (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]) * rstd
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
