"""The Triton flash-attention dq kernel (one program per query block; it also writes delta = rowsum(o * do) for
the dk/dv kernel) and its launcher."""

from __future__ import annotations

import triton
import triton.language as tl

from ..buffers import empty
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import dropout
from .triton_blocks import (
    LOG2E,
    _block_and_pair,
    _keep,
    _key_block,
    _load,
    _lse_row,
    _mix32,
    _pair_key,
    _query_block,
    _rows_src,
    _sequence,
    _store,
    _tile,
    _tile_once,
)
from .triton_configs import launch_options
from .triton_forward import _ensure_scratch_allocator, backward_variant
from .triton_launch_args import _flags, _packing_args, _seed_arg, _sizes, _strides, grid_of


@triton.jit
def _store_delta(
    O,
    DELTA,
    do,
    do_hi,
    b,
    h,
    delta_row,
    sob,
    soh,
    som,
    offs_m,
    LQ,
    offs_d,
    offs_hi,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    D_HI: tl.constexpr,
):
    """Stores and returns delta = rowsum(o * do) (fp32) of the query rows offs_m, for the do tile of those rows (and,
    where D_HI > 0, its second column part do_hi at columns offs_hi)."""
    o_rows = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som
    o = _load(o_rows + offs_d[None, :], offs_m, LQ, offs_d, HEAD_DIM, PAD_D, True).to(tl.float32)
    delta = tl.sum(o * do.to(tl.float32), 1)
    if D_HI > 0:
        o_hi = _load(o_rows + offs_hi[None, :], offs_m, LQ, offs_hi, HEAD_DIM, PAD_D, True).to(tl.float32)
        delta += tl.sum(o_hi * do_hi.to(tl.float32), 1)
    tl.store(DELTA + delta_row + offs_m, delta, mask=offs_m < LQ)
    return delta


@triton.jit
def _dq_block(
    dq,
    dq_hi,
    q,
    q_hi,
    do,
    do_hi,
    lse,
    delta,
    k_src,
    k_hi_src,
    v_src,
    v_hi_src,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    offs_hi,
    kv_len,
    skn,
    svn,
    qk_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """One key block into dq; k_src/v_src: _rows_src sources of kv_len rows. D_HI > 0: the head dim's second column
    part too (the *_hi tiles, sources and accumulator, offs_hi: see _bwd_dq_kernel); else those are not read."""
    cols = start_n + offs_n
    k = _tile(k_src, start_n, skn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    v = _tile(v_src, start_n, svn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_HI > 0:
        k_hi = _tile(k_hi_src, start_n, skn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PRECISION)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK:
        visible = cols[None, :] < kv_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if D_HI > 0:
        v_hi = _tile(v_hi_src, start_n, svn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        dp = tl.dot(do_hi, tl.trans(v_hi), dp, input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], cols[None, :], dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dq_hi = tl.dot(ds, k_hi, dq_hi, input_precision=DOT_PRECISION)
    return dq, dq_hi


@direct_launch
@triton.jit(do_not_specialize=["H", "GROUP", "LQ", "LK", "N_BLOCKS"])
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    KL,
    O,
    CU_Q,
    CU_K,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sdob,
    sdoh,
    sdom,
    sdod,
    sdqb,
    sdqh,
    sdqm,
    sob,
    soh,
    som,
    H,
    GROUP,
    LQ,
    LK,
    N_BLOCKS,
    qk_scale,
    sm_scale,
    dropout_p,
    SEED,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WRITE_DELTA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dq of one query block. WRITE_DELTA: the block's delta = rowsum(o * do) is computed here (o read once, do
    already loaded) and stored for the dk/dv kernel, which then runs after this one: no launch of its own. D_HI > 0
    (split_d): every [rows, HEAD_DIM] tile in two column parts, as in _fwd_kernel, read through pointers. VARLEN: see
    _sequence."""
    tl.static_assert(D_HI == 0 or not TMA, "the split head dim loads through pointers")
    tl.static_assert(not (VARLEN and TMA), "packed sequences load through pointers")
    PAD_D: tl.constexpr = BLOCK_D + D_HI != HEAD_DIM
    block, bh = _block_and_pair(N_BLOCKS, HEAVY_FIRST, True)
    start_m = block * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // GROUP
    lq, kv_len, q_start, k_start = _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL, VARLEN)
    lse_row = _lse_row(b, h, H, LQ, q_start, VARLEN)
    if VARLEN:
        Q += q_start * sqm
        DO += q_start * sdom
        O += q_start * som
        DQ += q_start * sdqm
        K += k_start * skn
        V += k_start * svn
        kv_len = tl.where(start_m < lq, kv_len, 0)  # a block past its sequence's queries visits no key
    drop_seed = _pair_key(tl.load(SEED), bh) ^ _query_block(start_m) if DROPOUT else 0
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = _tile_once(Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA)
    do = _tile_once(
        DO, b, h, sdob, sdoh, sdom, sdod, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA
    )
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        q_hi = _tile_once(
            Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
        do_hi = _tile_once(
            DO, b, h, sdob, sdoh, sdom, sdod, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
    else:  # one part: stand-ins, never read
        offs_hi, q_hi, do_hi = offs_d, q, do
    lse = tl.load(LSE + lse_row + offs_m, mask=offs_m < lq, other=float("inf")) * 1.4426950408889634
    if WRITE_DELTA:
        delta = _store_delta(
            O, DELTA, do, do_hi, b, h, lse_row, sob, soh, som, offs_m, lq, offs_d, offs_hi, HEAD_DIM, PAD_D, D_HI
        )
    else:
        delta = tl.load(DELTA + lse_row + offs_m, mask=offs_m < lq, other=0.0)

    # K/V of kv_len rows (descriptors: at least one, a program with kv_len = 0 loads nothing through them)
    kv_rows = tl.maximum(kv_len, 1)
    k_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    if CAUSAL:
        n_end = tl.minimum(kv_len, start_m + BLOCK_M)
        n_full = (tl.minimum(kv_len, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        n_end = kv_len
        n_full = (kv_len // BLOCK_N) * BLOCK_N

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:
        k_hi_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        v_hi_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        dq_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    else:  # stand-ins, never read (the loops carry dq_hi unchanged, which the compiler drops)
        k_hi_src, v_hi_src, dq_hi = k_src, v_src, dq
    for start_n in range(0, n_full, BLOCK_N):
        dq, dq_hi = _dq_block(
            dq,
            dq_hi,
            q,
            q_hi,
            do,
            do_hi,
            lse,
            delta,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            False,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )
    for start_n in range(n_full, n_end, BLOCK_N):
        dq, dq_hi = _dq_block(
            dq,
            dq_hi,
            q,
            q_hi,
            do,
            do_hi,
            lse,
            delta,
            k_src,
            k_hi_src,
            v_src,
            v_hi_src,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            offs_hi,
            kv_len,
            skn,
            svn,
            qk_scale,
            dropout_p,
            drop_seed,
            HEAD_DIM,
            PAD_D,
            True,
            CAUSAL,
            DROPOUT,
            DOT_PRECISION,
            TMA,
            D_HI,
        )
    dq = dq * sm_scale
    dq_rows = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + offs_m[:, None] * sdqm
    _store(dq_rows + offs_d[None, :], dq.to(DQ.dtype.element_ty), offs_m, lq, offs_d, HEAD_DIM, PAD_D)
    if D_HI > 0:
        dq_hi = dq_hi * sm_scale
        _store(dq_rows + offs_hi[None, :], dq_hi.to(DQ.dtype.element_ty), offs_m, lq, offs_hi, HEAD_DIM, PAD_D)


# --------------------------------------------------------------------------- launch


def backward_dq(
    do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, *, o=None, cfg=None, tma=None, packing=None
):
    """dq in q's dtype; with o, it also writes delta = rowsum(o * do) into `delta` (for the dk/dv kernel run after
    it: no separate launch for delta). cfg, tma: see backward_variant. packing: see forward."""
    b, h, hkv, lq, lk, rows_q, _ = _sizes(q, k, packing)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    cfg, variant = backward_variant("dq", q, k, v, do, cfg, False if packing is not None else tma, causal=causal)
    if variant["TMA"]:
        _ensure_scratch_allocator()
    o_arg = q if o is None else o  # a stand-in, not read, without o
    n_blocks = cdiv(rows_q, cfg.block_m)
    _bwd_dq_kernel[grid_of(n_blocks, b * h)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        key_lengths if key_lengths is not None else q,
        o_arg,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(do, packing),
        *_strides(dq, packing)[:3],
        *_strides(o_arg, packing)[:3],
        h,
        h // hkv,
        lq,
        lk,
        n_blocks,
        scale * LOG2E,
        scale,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        VARLEN=packing is not None,
        WRITE_DELTA=o is not None,
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return dq
