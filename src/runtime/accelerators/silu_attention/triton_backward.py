"""silu_attention's Triton backward: the dk/dv, dq and bias-gradient kernels and their launchers (see triton.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..buffers import empty
from ..flash_attention.triton_blocks import _keep, _key_block, _mix32, _pair_key, _query_block
from ..launch_math import cdiv, next_power_of_2
from ..triton_launch import direct_launch
from .bias_folds import fold_distances
from .triton_configs import config
from .triton_forward import (
    _common,
    _dsilu,
    _head_dim_contiguous,
    _rows,
    _scores,
    _sequence,
    _sigmoid,
    _store_rows,
    _strides,
    _time_bucket,
    _times,
    _visible,
)

# --------------------------------------------------------------------------- backward


@direct_launch
@triton.jit(do_not_specialize=["H", "NBLOCKS", "P", "T"])
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    CU,
    NT,
    PB,
    TB,
    TS,
    SEED,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    sdot,
    sdoh,
    sdkt,
    sdkh,
    sdvt,
    sdvh,
    sph,
    spp,
    sth,
    stt,
    H,
    NBLOCKS,
    P,
    T,
    alpha,
    inv_max,
    dropout_p,
    inv_keep,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    DROPOUT: tl.constexpr,
    PTX: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key block; tiles are [keys, queries] (transposed scores), so no register tile is transposed into a dot."""
    pid = tl.program_id(0)
    block = pid % NBLOCKS  # the heaviest (first) key blocks of causal attention first
    pair = pid // NBLOCKS
    s = pair // H
    h = pair % H
    start, n, first_target = _sequence(CU, NT, s, HAS_TARGETS)
    start_n = block * BLOCK_N
    if start_n < n:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_i = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        k = _rows(K, start, h, skt, skh, offs_n, n, offs_d, HEAD_DIM)
        v = _rows(V, start, h, svt, svh, offs_n, n, offs_d, HEAD_DIM)
        tk = _times(TS, start, offs_n, n, HAS_TIME)
        drop_seed = _pair_key(tl.load(SEED), pair) ^ _key_block(start_n) if DROPOUT else 0
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        m_start = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
        for start_m in range(m_start, n, BLOCK_M):
            offs_m = start_m + offs_i
            q = _rows(Q, start, h, sqt, sqh, offs_m, n, offs_d, HEAD_DIM)
            do = _rows(DO, start, h, sdot, sdoh, offs_m, n, offs_d, HEAD_DIM)
            tq = _times(TS, start, offs_m, n, HAS_TIME)
            kq = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
            sc = _scores(kq, h, offs_m[None, :], offs_n[:, None], tq[None, :], tk[:, None], PB, TB, sph, spp, sth, stt,
                         P, T, alpha, HAS_POS, HAS_TIME, PTX)  # fmt: skip
            sig = _sigmoid(sc, TANH_APPROX)
            visible = _visible(offs_m[None, :], offs_n[:, None], n, first_target, CAUSAL, HAS_TARGETS)
            scale = inv_max
            if DROPOUT:
                keep = _keep(_mix32(drop_seed ^ _query_block(start_m)), offs_m[None, :], offs_n[:, None], dropout_p)
                visible = visible & keep
                scale = inv_max * inv_keep
            a = tl.where(visible, sc * sig * scale, 0.0)
            dv = tl.dot(a.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            da = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds = tl.where(visible, da * _dsilu(sc, sig) * scale, 0.0)
            dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        _store_rows(DK, dk * alpha, start, h, sdkt, sdkh, offs_n, n, offs_d, HEAD_DIM)
        _store_rows(DV, dv, start, h, sdvt, sdvh, offs_n, n, offs_d, HEAD_DIM)


@triton.jit
def _ds_tile(
    q,
    do,
    start,
    h,
    start_m,
    offs_m,
    start_n,
    offs_n,
    n,
    first_target,
    tq,
    drop_seed,
    K,
    V,
    TS,
    PB,
    TB,
    skt,
    skh,
    svt,
    svh,
    sph,
    spp,
    sth,
    stt,
    P,
    T,
    alpha,
    inv_max,
    dropout_p,
    inv_keep,
    offs_d,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    DROPOUT: tl.constexpr,
    PTX: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(ds [queries, keys] fp32, k): the score gradient of one tile, zero where not visible, and the key tile."""
    k = _rows(K, start, h, skt, skh, offs_n, n, offs_d, HEAD_DIM)
    v = _rows(V, start, h, svt, svh, offs_n, n, offs_d, HEAD_DIM)
    tk = _times(TS, start, offs_n, n, HAS_TIME)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    sc = _scores(qk, h, offs_m[:, None], offs_n[None, :], tq[:, None], tk[None, :], PB, TB, sph, spp, sth, stt,
                 P, T, alpha, HAS_POS, HAS_TIME, PTX)  # fmt: skip
    visible = _visible(offs_m[:, None], offs_n[None, :], n, first_target, CAUSAL, HAS_TARGETS)
    scale = inv_max
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], offs_n[None, :], dropout_p)
        visible = visible & keep
        scale = inv_max * inv_keep
    da = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = tl.where(visible, da * _dsilu(sc, _sigmoid(sc, TANH_APPROX)) * scale, 0.0)
    return ds, k


@direct_launch
@triton.jit(do_not_specialize=["H", "NBLOCKS", "P", "T"])
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    CU,
    NT,
    PB,
    TB,
    TS,
    SEED,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    sdot,
    sdoh,
    sdqt,
    sdqh,
    sph,
    spp,
    sth,
    stt,
    H,
    NBLOCKS,
    P,
    T,
    alpha,
    inv_max,
    dropout_p,
    inv_keep,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    DROPOUT: tl.constexpr,
    PTX: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    block = NBLOCKS - 1 - pid % NBLOCKS
    pair = pid // NBLOCKS
    s = pair // H
    h = pair % H
    start, n, first_target = _sequence(CU, NT, s, HAS_TARGETS)
    start_m = block * BLOCK_M
    if start_m < n:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_j = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _rows(Q, start, h, sqt, sqh, offs_m, n, offs_d, HEAD_DIM)
        do = _rows(DO, start, h, sdot, sdoh, offs_m, n, offs_d, HEAD_DIM)
        tq = _times(TS, start, offs_m, n, HAS_TIME)
        drop_seed = _pair_key(tl.load(SEED), pair) ^ _query_block(start_m) if DROPOUT else 0
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n_end = tl.minimum(n, start_m + BLOCK_M) if CAUSAL else n
        for start_n in range(0, n_end, BLOCK_N):
            ds, k = _ds_tile(
                q,
                do,
                start,
                h,
                start_m,
                offs_m,
                start_n,
                start_n + offs_j,
                n,
                first_target,
                tq,
                drop_seed,
                K,
                V,
                TS,
                PB,
                TB,
                skt,
                skh,
                svt,
                svh,
                sph,
                spp,
                sth,
                stt,
                P,
                T,
                alpha,
                inv_max,
                dropout_p,
                inv_keep,
                offs_d,
                HEAD_DIM,
                CAUSAL,
                HAS_TARGETS,
                HAS_POS,
                HAS_TIME,
                DROPOUT,
                PTX,
                TANH_APPROX,
                DOT_PRECISION,
            )
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        _store_rows(DQ, dq * alpha, start, h, sdqt, sdqh, offs_m, n, offs_d, HEAD_DIM)


@direct_launch
@triton.jit(do_not_specialize=["H", "NBLOCKS", "NBANDS", "P", "T"])
def _bwd_bias_kernel(
    Q,
    K,
    V,
    DO,
    CU,
    NT,
    PB,
    TB,
    TS,
    SEED,
    POS_PART,
    TIME_PART,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    sdot,
    sdoh,
    sph,
    spp,
    sth,
    stt,
    H,
    NBLOCKS,
    NBANDS,
    P,
    T,
    alpha,
    inv_max,
    dropout_p,
    inv_keep,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    T_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    DROPOUT: tl.constexpr,
    PTX: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Band `band` of one (sequence, head): the tiles (query block mb, key block mb - t) with t = band (causal) or
    band - (NBLOCKS - 1). Writes POS_PART[pair, band, u], the sum of ds over the band's diagonals i - j = t * BLOCK_B
    + u - (BLOCK_B - 1), and TIME_PART[pair, band, b], the sum of ds per time bucket b."""
    pid = tl.program_id(0)
    band = pid % NBANDS
    pair = pid // NBANDS
    s = pair // H
    h = pair % H
    t = band if CAUSAL else band - (NBLOCKS - 1)
    start, n, first_target = _sequence(CU, NT, s, HAS_TARGETS)
    n_blocks = tl.cdiv(n, BLOCK_B)
    offs_b = tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    offs_u = tl.arange(0, 2 * BLOCK_B)
    offs_t = tl.arange(0, T_PAD)
    # the key column of diagonal u in row a: c = a - u + BLOCK_B - 1, inside the tile or not
    diag_col = offs_b[:, None] - offs_u[None, :] + (BLOCK_B - 1)
    on_diag = (diag_col >= 0) & (diag_col < BLOCK_B)
    diag_col = tl.where(on_diag, diag_col, 0)
    pos_acc = tl.zeros([2 * BLOCK_B], dtype=tl.float32)
    time_acc = tl.zeros([T_PAD], dtype=tl.float32)
    seed = tl.load(SEED) if DROPOUT else 0
    for mb in range(tl.maximum(t, 0), n_blocks + tl.minimum(t, 0)):
        start_m = mb * BLOCK_B
        start_n = (mb - t) * BLOCK_B
        offs_m = start_m + offs_b
        q = _rows(Q, start, h, sqt, sqh, offs_m, n, offs_d, HEAD_DIM)
        do = _rows(DO, start, h, sdot, sdoh, offs_m, n, offs_d, HEAD_DIM)
        tq = _times(TS, start, offs_m, n, HAS_TIME)
        drop_seed = _pair_key(seed, pair) ^ _query_block(start_m) if DROPOUT else 0
        ds, _ = _ds_tile(
            q,
            do,
            start,
            h,
            start_m,
            offs_m,
            start_n,
            start_n + offs_b,
            n,
            first_target,
            tq,
            drop_seed,
            K,
            V,
            TS,
            PB,
            TB,
            skt,
            skh,
            svt,
            svh,
            sph,
            spp,
            sth,
            stt,
            P,
            T,
            alpha,
            inv_max,
            dropout_p,
            inv_keep,
            offs_d,
            HEAD_DIM,
            CAUSAL,
            HAS_TARGETS,
            HAS_POS,
            HAS_TIME,
            DROPOUT,
            PTX,
            TANH_APPROX,
            DOT_PRECISION,
        )
        if HAS_POS:
            along = tl.gather(ds, diag_col, axis=1)
            pos_acc += tl.sum(tl.where(on_diag, along, 0.0), axis=0)
        if HAS_TIME:
            tk = _times(TS, start, start_n + offs_b, n, HAS_TIME)
            bucket = _time_bucket(tq[:, None], tk[None, :], T, PTX)
            # only the buckets this tile holds (few where timestamps rise along the sequence)
            low = tl.min(tl.min(bucket, axis=1), axis=0)
            high = tl.max(tl.max(bucket, axis=1), axis=0)
            for b in range(low, high + 1):
                total = tl.sum(tl.sum(tl.where(bucket == b, ds, 0.0), axis=1), axis=0)
                time_acc += tl.where(offs_t == b, total, 0.0)
    row = pair.to(tl.int64) * NBANDS + band
    if HAS_POS:
        tl.store(POS_PART + row * (2 * BLOCK_B) + offs_u, pos_acc)
    if HAS_TIME:
        tl.store(TIME_PART + row * T_PAD + offs_t, time_acc)


# --------------------------------------------------------------------------- launchers


def backward(do, q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha,
             causal, dropout_p, o=None):  # fmt: skip
    """(dq, dk, dv, None, None, dposition_bias [H, P], dtime_bias [H, T], None x 6), in the inputs' dtypes."""
    q, k, v, do = (_head_dim_contiguous(x) for x in (q, k, v, do))
    total, h, d = q.shape
    n = cu_seqlens.shape[0] - 1
    dq, dk, dv = (empty((total, h, d), dtype=x.dtype, device=x.device) for x in (q, k, v))
    tensors, bias_strides, scalars, flags = _common(
        q, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
    )
    block_m, block_n, warps, stages = config("dkdv", q.dtype)
    n_blocks = cdiv(max_seqlen, block_n)
    if n * h * n_blocks:
        _bwd_dkdv_kernel[(n * h * n_blocks,)](
            q, k, v, do, dk, dv, *tensors, *_strides(q, k, v, do, dk, dv), *bias_strides, h, n_blocks, *scalars,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
        )  # fmt: skip
    block_m, block_n, warps, stages = config("dq", q.dtype)
    n_blocks = cdiv(max_seqlen, block_m)
    if n * h * n_blocks:
        _bwd_dq_kernel[(n * h * n_blocks,)](
            q, k, v, do, dq, *tensors, *_strides(q, k, v, do, dq), *bias_strides, h, n_blocks, *scalars,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
        )  # fmt: skip
    dpos = dtime = None
    if position_bias is not None or time_bias is not None:
        dpos, dtime = bias_gradients(
            do, q, k, v, tensors, bias_strides, scalars, flags, position_bias, time_bias, max_seqlen, n, h
        )
    return dq, dk, dv, None, None, dpos, dtime, None, None, None, None, None, None


def bias_gradients(do, q, k, v, tensors, bias_strides, scalars, flags, position_bias, time_bias, max_seqlen, n, h):
    """(dposition_bias [H, P] or None, dtime_bias [H, T] or None): the bias kernel's partial sums, added over the
    sequences and folded into buckets in a fixed order."""
    block_b, _, warps, stages = config("bias", q.dtype)
    n_blocks = cdiv(max_seqlen, block_b)
    causal = flags["CAUSAL"]
    n_bands = n_blocks if causal else max(2 * n_blocks - 1, 0)
    t_pad = next_power_of_2(scalars[1])
    pos_part = empty((n, h, n_bands, 2 * block_b), dtype=torch.float32, device=q.device)
    time_part = empty((n, h, n_bands, t_pad), dtype=torch.float32, device=q.device)
    if n * h * n_bands:
        _bwd_bias_kernel[(n * h * n_bands,)](
            q, k, v, do, *tensors, pos_part, time_part, *_strides(q, k, v, do), *bias_strides,
            h, n_blocks, n_bands, *scalars, BLOCK_B=block_b, T_PAD=t_pad, num_warps=warps, num_stages=stages, **flags,
        )  # fmt: skip
    dpos = dtime = None
    if position_bias is not None:
        first_band = 0 if causal else -(n_blocks - 1)
        dpos = fold_distances(pos_part.sum(0), block_b, first_band, position_bias.shape[1]).to(position_bias.dtype)
    if time_bias is not None:
        per_bucket = time_part.sum((0, 2))[:, : scalars[1]]
        dtime = torch.zeros(time_bias.shape, dtype=torch.float32, device=q.device)
        dtime[:, : per_bucket.shape[1]] = per_bucket
        dtime = dtime.to(time_bias.dtype)
    return dpos, dtime
