"""The TileLang kernels of the row norms (rms_norm, layer_norm, l2norm, add_rms_norm / add_layer_norm): one forward and
one persistent backward builder, the op chosen by flags. Plans, row tiles and the column sum: tilelang_common.

    centre    subtract the row mean first (layer_norm, add_layer_norm)
    l2        rstd of the sum of squares, not of their mean, and no parameters (l2norm; its backward, one tile per
              block from the output y, is its own: l2norm.tilelang)
    residual  norm the sum x + residual, which is stored too (add_norm); its backward adds dnew and works from xhat
              also when not centred
    w_dtype, b_dtype  a weight, a bias; None: absent (the kernel then takes a 1-element fp32 placeholder)

An argument annotated None is not one of the kernel's (the ops that never take it), and tiles a kernel leaves unused
are not in its source. rms_norm's backward works from x and scales the dot product by rstd^2 / N (the others from
xhat). Each kernel keeps
the name, argument names and tile names of the op's own kernel: they name the generated CUDA source's function and
variables, so that source stays the op's (see docs/tuning/refactor.md).

Imported only by the tilelang kernel modules, so the package imports without tilelang.
"""

import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from .tilelang_common import ACCUM, RowPlan, load_rows, row_layout, scaled_squares, store_rows


def keep_name(buffer, name: str) -> None:
    """Name an argument or tile as the op's own kernel did (a Python assignment names it after the variable)."""
    IRBuilder.name(name, buffer)


def shared_layout(plan: RowPlan, tiles: list) -> dict:
    """The row layout for each of `tiles` (None: a tile the op does not have)."""
    layout = row_layout(plan)
    return {tile: layout for tile in tiles if tile is not None}


def forward_kernel(
    name: str,
    dtype: str,
    w_dtype: str | None,
    b_dtype: str | None,
    plan: RowPlan,
    *,
    centre: bool = False,
    l2: bool = False,
    residual: bool = False,
):
    """y = x' * rstd * w + b, x' = x - mean (centre) or x, and the row statistics; `name`: the kernel's."""
    N, NP, BM = plan.width, plan.padded, plan.block_rows
    has_w, has_b = w_dtype is not None, b_dtype is not None
    takes_b_and_mean = centre or residual  # layer_norm and add_norm take both (placeholders when absent)
    mean_first = centre and not residual  # layer_norm stores the mean before rstd, add_layer_norm after
    M = T.dynamic("M")

    @T.prim_func
    def row_norm_fwd(
        X: T.Tensor((M, N), dtype),
        R: T.Tensor((M, N), dtype) if residual else None,
        W: None if l2 else T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        B: T.Tensor((N if has_b else 1,), b_dtype or ACCUM) if takes_b_and_mean else None,
        Y: T.Tensor((M, N), dtype),
        S: T.Tensor((M, N), dtype) if residual else None,
        Mean: T.Tensor((M,) if centre else (1,), ACCUM) if takes_b_and_mean else None,
        Rstd: T.Tensor((M,), ACCUM),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(M, BM), threads=plan.threads) as bx:
            io = T.alloc_fragment((BM, NP), dtype)  # x (then the sum), then y: 16-byte accesses
            r_io = T.alloc_fragment((BM, NP), dtype)
            x = T.alloc_fragment((BM, NP), ACCUM)  # x (the sum), centred when centre (zero in padded columns)
            sq = T.alloc_fragment((BM, NP), ACCUM)
            mean = T.alloc_fragment((BM,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            inv = T.alloc_fragment((BM,), ACCUM)  # 1 / the row's scale (see norms.SCALE_ABOVE)
            if residual:
                keep_name(x, "s")
            elif centre:
                keep_name(x, "xc")
            T.annotate_layout(shared_layout(plan, [io, r_io if residual else None, x, sq]))
            row0 = bx * BM
            load_rows(X, io, row0, M, N)
            if residual:
                load_rows(R, r_io, row0, M, N)
                for i, j in T.Parallel(BM, NP):
                    io[i, j] = T.cast(T.cast(io[i, j], ACCUM) + T.cast(r_io[i, j], ACCUM), dtype)
                store_rows(io, S, row0, M, N)
            for i, j in T.Parallel(BM, NP):
                x[i, j] = T.cast(io[i, j], ACCUM)
            if centre:
                T.reduce_sum(x, mean, dim=1)
                for i in T.Parallel(BM):
                    mean[i] = mean[i] / N
                for i, j in T.Parallel(BM, NP):
                    x[i, j] = T.if_then_else(j < N, x[i, j] - mean[i], 0.0)
            scaled_squares(x, sq, inv)
            T.reduce_sum(sq, rstd, dim=1)
            for i in T.Parallel(BM):
                if l2:
                    rstd[i] = T.rsqrt(rstd[i] + eps * inv[i] * inv[i]) * inv[i]
                else:
                    rstd[i] = T.rsqrt(rstd[i] / N + eps * inv[i] * inv[i]) * inv[i]
                if row0 + i < M:
                    if mean_first:
                        Mean[row0 + i] = mean[i]
                    Rstd[row0 + i] = rstd[i]
                    if centre and not mean_first:
                        Mean[row0 + i] = mean[i]
            for i, j in T.Parallel(BM, NP):
                # rms_norm and l2norm write y in one expression, layer_norm and add_norm bind it first (a named value
                # in the source when there are no parameters)
                if takes_b_and_mean:
                    y = x[i, j] * rstd[i]
                    if has_w:
                        y = y * T.cast(W[j], ACCUM)
                    if has_b:
                        y = y + T.cast(B[j], ACCUM)
                    io[i, j] = T.cast(y, dtype)
                elif has_w:
                    io[i, j] = T.cast(x[i, j] * rstd[i] * T.cast(W[j], ACCUM), dtype)
                else:
                    io[i, j] = T.cast(x[i, j] * rstd[i], dtype)
            store_rows(io, Y, row0, M, N)

    return row_norm_fwd.with_attr("global_symbol", name)


def backward_kernel(
    name: str,
    dtype: str,
    w_dtype: str | None,
    b_dtype: str | None,
    plan: RowPlan,
    n_blocks: int,
    min_blocks_per_sm: int | None = None,
    *,
    centre: bool = False,
    residual: bool = False,
):
    """dx (dtotal when residual) and one row of partial sums of dweight (and dbias) per block, in a persistent grid of
    `n_blocks` blocks: block bx takes row groups bx, bx + G, bx + 2G, ... `name`: the kernel's."""
    N, NP, BM, G = plan.width, plan.padded, plan.block_rows, n_blocks
    has_w, has_b = w_dtype is not None, b_dtype is not None
    n_params = int(has_w) + int(has_b)
    from_x = not (centre or residual)  # rms_norm's own math (see the module docstring)
    takes_mean = centre or residual
    mean_first = centre and not residual  # layer_norm reads the mean before rstd, add_layer_norm after
    stage_dn = residual and plan.row_threads > 32
    M = T.dynamic("M")

    @T.prim_func
    def row_norm_bwd(
        DY: T.Tensor((M, N), dtype),
        DN: T.Tensor((M, N), dtype) if residual else None,
        X: T.Tensor((M, N), dtype),
        W: T.Tensor((N if has_w else 1,), w_dtype or ACCUM),
        Mean: T.Tensor((M,) if centre else (1,), ACCUM) if takes_mean else None,
        Rstd: T.Tensor((M,), ACCUM),
        DX: T.Tensor((M, N), dtype),
        Partial: T.Tensor(((G, N) if from_x else (G, n_params, N)) if n_params else (1,), ACCUM),
    ):
        with T.Kernel(G, threads=plan.threads) as bx:
            if min_blocks_per_sm is not None:
                T.annotate_min_blocks_per_sm(min_blocks_per_sm)
            x_io = T.alloc_fragment((BM, NP), dtype)
            dy_io = T.alloc_fragment((BM, NP), dtype)
            # dnew is read only after the row sums; where they cross warps (barriers), ptxas sinks a register tile's
            # load past them, a second round trip to memory per row: a shared tile is written before the barriers
            dn_io = (T.alloc_shared if stage_dn else T.alloc_fragment)((BM, NP), dtype)
            xhat = T.alloc_fragment((BM, NP), ACCUM)  # x itself when from_x
            g = T.alloc_fragment((BM, NP), ACCUM)  # dy * w
            gx = T.alloc_fragment((BM, NP), ACCUM)
            dw = T.alloc_fragment((BM, NP), ACCUM)
            db = T.alloc_fragment((BM, NP), ACCUM)
            col_sum = T.alloc_fragment((NP,), ACCUM)
            mean = T.alloc_fragment((BM,), ACCUM)
            rstd = T.alloc_fragment((BM,), ACCUM)
            c1 = T.alloc_fragment((BM,), ACCUM)  # sum(g * xhat); from_x: mean(g * xhat) * rstd
            c2 = T.alloc_fragment((BM,), ACCUM)  # sum(g)
            if residual:
                keep_name(X, "S")
                keep_name(DX, "DS")
                keep_name(x_io, "s_io")
            if from_x:
                keep_name(xhat, "x")
                keep_name(c1, "dot")
                keep_name(col_sum, "dw_sum")
            fragments = [x_io, dy_io, dn_io if residual and not stage_dn else None, xhat, g, gx, dw]
            T.annotate_layout(shared_layout(plan, [*fragments, None if from_x else db]))
            T.clear(dw)
            if not from_x:
                T.clear(db)
            for step in T.serial(T.ceildiv(T.ceildiv(M, BM) - bx, G)):
                row0 = (step * G + bx) * BM
                load_rows(X, x_io, row0, M, N)
                load_rows(DY, dy_io, row0, M, N)
                if residual:
                    load_rows(DN, dn_io, row0, M, N)
                for i in T.Parallel(BM):
                    if mean_first:
                        mean[i] = T.if_then_else(row0 + i < M, Mean[row0 + i], 0.0)
                    rstd[i] = T.if_then_else(row0 + i < M, Rstd[row0 + i], 0.0)
                    if centre and not mean_first:
                        mean[i] = T.if_then_else(row0 + i < M, Mean[row0 + i], 0.0)
                for i, j in T.Parallel(BM, NP):
                    if centre:
                        xhat[i, j] = T.if_then_else(j < N, (T.cast(x_io[i, j], ACCUM) - mean[i]) * rstd[i], 0.0)
                    elif residual:
                        xhat[i, j] = T.cast(x_io[i, j], ACCUM) * rstd[i]  # zero in padded columns
                    else:
                        xhat[i, j] = T.cast(x_io[i, j], ACCUM)
                    g[i, j] = T.cast(dy_io[i, j], ACCUM)
                    if has_w:
                        if from_x:
                            dw[i, j] += g[i, j] * xhat[i, j] * rstd[i]
                        else:
                            dw[i, j] += g[i, j] * xhat[i, j]
                    if has_b:
                        db[i, j] += g[i, j]
                    if has_w:
                        g[i, j] = g[i, j] * T.cast(W[j], ACCUM)
                    gx[i, j] = g[i, j] * xhat[i, j]
                T.reduce_sum(gx, c1, dim=1)
                if from_x:
                    for i in T.Parallel(BM):
                        c1[i] = c1[i] * rstd[i] * rstd[i] / N  # mean(g * xhat) * rstd
                elif centre:
                    T.reduce_sum(g, c2, dim=1)
                else:
                    T.clear(c2)
                for i, j in T.Parallel(BM, NP):
                    if from_x:
                        # dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd
                        x_io[i, j] = T.cast(rstd[i] * (g[i, j] - xhat[i, j] * c1[i]), dtype)
                    elif residual:
                        # dtotal = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dnew (RMSNorm: mean(g) left out)
                        x_io[i, j] = T.cast(
                            rstd[i] * (g[i, j] - c2[i] / N - xhat[i, j] * (c1[i] / N)) + T.cast(dn_io[i, j], ACCUM),
                            dtype,
                        )
                    else:
                        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
                        x_io[i, j] = T.cast(rstd[i] * (g[i, j] - c2[i] / N - xhat[i, j] * (c1[i] / N)), dtype)
                store_rows(x_io, DX, row0, M, N)
            # one partial row per block: [block, column] from x, else [block, (dweight, dbias), column]
            if has_w:
                T.reduce_sum(dw, col_sum, dim=0)
                for j in T.Parallel(NP):
                    if j < N:
                        if from_x:
                            Partial[bx, j] = col_sum[j]
                        else:
                            Partial[bx, 0, j] = col_sum[j]
            if has_b:
                T.reduce_sum(db, col_sum, dim=0)
                for j in T.Parallel(NP):
                    if j < N:
                        Partial[bx, n_params - 1, j] = col_sum[j]

    return row_norm_bwd.with_attr("global_symbol", name)
