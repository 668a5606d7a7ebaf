"""The Triton flash-attention dk/dv kernel (one program per key block, looping over the query heads of its kv
head) and its launcher; the fused backward (triton_fused.py) reuses its block pieces."""

from __future__ import annotations

import torch
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
from .triton_configs import BwdConfig, launch_options
from .triton_forward import _ensure_scratch_allocator, backward_variant
from .triton_launch_args import _flags, _packing_args, _seed_arg, _sizes, _strides, grid_of


@triton.jit
def _query_blocks(start_n, kv_len, LQ, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(m_lo, m_full) for the key block at start_n: its query blocks start at m_lo; those below m_full straddle the
    causal diagonal and need the mask, and all of them do when the key block straddles kv_len."""
    if CAUSAL:
        m_lo = (start_n // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_full = LQ * 0
    if start_n + BLOCK_N > kv_len:
        m_full = LQ
    return m_lo, m_full


@triton.jit
def _store_dkdv(
    DK,
    DV,
    dk,
    dv,
    b,
    hk,
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    offs_n,
    offs_d,
    LK,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
):
    dk_ptrs = DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + offs_n[:, None] * sdkn + offs_d[None, :]
    dv_ptrs = DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + offs_n[:, None] * sdvn + offs_d[None, :]
    _store(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, LK, offs_d, HEAD_DIM, PAD_D)
    _store(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, LK, offs_d, HEAD_DIM, PAD_D)


@triton.jit
def _dkdv_block(
    dk,
    dk_hi,
    dv,
    dv_hi,
    k,
    k_hi,
    v,
    v_hi,
    q_src,
    q_hi_src,
    do_src,
    do_hi_src,
    lse_src,
    delta_src,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    offs_hi,
    kv_len,
    LQ,
    sqm,
    sdom,
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
    LSE_DELTA_TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """Accumulate one query block into dk, dv of this key block, in transposed form ([keys, queries]);
    q_src/do_src: _rows_src sources of LQ rows; lse_src/delta_src: 1-D descriptors of LQ values where
    LSE_DELTA_TMA, else the (b, h) base pointers. D_HI > 0: the head dim's second column part too (the *_hi tiles,
    sources and accumulators, offs_hi: see _bwd_dkdv_kernel); else those are not read."""
    rows = start_m + offs_m
    q = _tile(q_src, start_m, sqm, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, TMA)
    do = _tile(do_src, start_m, sdom, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, TMA)
    if D_HI > 0:
        q_hi = _tile(q_hi_src, start_m, sqm, LQ, offs_m, offs_hi, HEAD_DIM, PAD_D, True, False)
        do_hi = _tile(do_hi_src, start_m, sdom, LQ, offs_m, offs_hi, HEAD_DIM, PAD_D, True, False)
    else:  # stand-ins, never read
        q_hi, do_hi = q, do
    if LSE_DELTA_TMA:
        delta = delta_src.load([start_m])
    else:
        delta = tl.load(delta_src + rows, mask=rows < LQ, other=0.0)
    dv, dv_hi, ds_t = _dv_and_ds_t(
        dv,
        dv_hi,
        k,
        k_hi,
        v,
        v_hi,
        q,
        q_hi,
        do,
        do_hi,
        lse_src,
        delta,
        rows,
        offs_n,
        kv_len,
        LQ,
        start_m,
        qk_scale,
        dropout_p,
        drop_seed,
        MASK,
        CAUSAL,
        DROPOUT,
        DOT_PRECISION,
        LSE_DELTA_TMA,
        D_HI,
    )
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dk_hi = tl.dot(ds_t, q_hi, dk_hi, input_precision=DOT_PRECISION)
    return dk, dk_hi, dv, dv_hi


@triton.jit
def _dv_and_ds_t(
    dv,
    dv_hi,
    k,
    k_hi,
    v,
    v_hi,
    q,
    q_hi,
    do,
    do_hi,
    lse_src,
    delta,
    rows,
    offs_n,
    kv_len,
    LQ,
    start_m,
    qk_scale,
    dropout_p,
    drop_seed,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LSE_DELTA_TMA: tl.constexpr,
    D_HI: tl.constexpr,
):
    """For a key block and the query rows `rows` (from start_m), in transposed form ([keys, queries]): dv plus P^T dO
    (P after dropout), and dS^T = P^T * (dP^T - delta) in fp32. lse_src: the (b, h) row of lse, a descriptor where
    LSE_DELTA_TMA (q and do then come through descriptors too), else a pointer. D_HI > 0: the products over the head
    dim take the second column parts (k_hi, v_hi, q_hi, do_hi) too and dv_hi gets P^T dO_hi; else dv_hi is returned
    as given."""
    if LSE_DELTA_TMA:
        # zeros past LQ (not lse = +inf): such a row's q and do are zeros too (descriptor loads), so its column of
        # P^T (exp2(0) = 1) meets zeros in every product and adds nothing
        lse = lse_src.load([start_m]) * 1.4426950408889634
    else:
        # rows past LQ load lse = +inf, so their probabilities are 0
        lse = tl.load(lse_src + rows, mask=rows < LQ, other=float("inf")) * 1.4426950408889634
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    if D_HI > 0:
        qk_t = tl.dot(k_hi, tl.trans(q_hi), qk_t, input_precision=DOT_PRECISION)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    if MASK:
        visible = offs_n[:, None] < kv_len
        if CAUSAL:
            visible = visible & (rows[None, :] >= offs_n[:, None])
        p_t = tl.where(visible, p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if D_HI > 0:
        dp_t = tl.dot(v_hi, tl.trans(do_hi), dp_t, input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _query_block(start_m)), rows[None, :], offs_n[:, None], dropout_p)
        inv_keep = 1.0 / (1.0 - dropout_p)
        p_kept_t = tl.where(keep, p_t * inv_keep, 0.0).to(do.dtype)
        dv = tl.dot(p_kept_t, do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
    else:
        p_kept_t = p_t.to(do.dtype)
        dv = tl.dot(p_kept_t, do, dv, input_precision=DOT_PRECISION)
    if D_HI > 0:
        dv_hi = tl.dot(p_kept_t, do_hi, dv_hi, input_precision=DOT_PRECISION)
    return dv, dv_hi, p_t * (dp_t - delta[None, :])


@direct_launch
@triton.jit(do_not_specialize=["H", "HKV", "GROUP", "LQ", "LK", "N_BLOCKS"])
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    KL,
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
    sdkb,
    sdkh,
    sdkn,
    sdvb,
    sdvh,
    sdvn,
    H,
    HKV,
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
    LSE_DELTA_TMA: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dk, dv of one key block. LSE_DELTA_TMA (only with TMA): lse and delta through 1-D descriptors too. D_HI > 0
    (split_d): every [rows, HEAD_DIM] tile in two column parts, as in _fwd_kernel, read through pointers. VARLEN: see
    _sequence; a key block past its sequence's keys writes nothing."""
    tl.static_assert(D_HI == 0 or not TMA, "the split head dim loads through pointers")
    tl.static_assert(not (VARLEN and TMA), "packed sequences load through pointers")
    PAD_D: tl.constexpr = BLOCK_D + D_HI != HEAD_DIM
    block, bhk = _block_and_pair(N_BLOCKS, HEAVY_FIRST, False)
    start_n = block * BLOCK_N
    b = bhk // HKV
    hk = bhk % HKV
    lq, kv_len, q_start, k_start = _sequence(CU_Q, CU_K, KL, b, LQ, LK, HAS_KL, VARLEN)
    n_keys = LK  # the rows of K/V/dK/dV this program may read and write
    if VARLEN:
        Q += q_start * sqm
        DO += q_start * sdom
        K += k_start * skn
        V += k_start * svn
        DK += k_start * sdkn
        DV += k_start * sdvn
        n_keys = kv_len
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_j
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    if TMA:  # both descriptors, then both loads: fewer spills on sm_90 (280 bytes at head dim 128, against 312)
        k_src = _rows_src(K, b, hk, skb, skh, skn, skd, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        v_src = _rows_src(V, b, hk, svb, svh, svn, svd, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
        k = _tile(k_src, start_n, skn, n_keys, offs_j, offs_d, HEAD_DIM, PAD_D, True, TMA)
        v = _tile(v_src, start_n, svn, n_keys, offs_j, offs_d, HEAD_DIM, PAD_D, True, TMA)
    else:
        k = _tile_once(
            K, b, hk, skb, skh, skn, skd, start_n, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, TMA
        )
        v = _tile_once(
            V, b, hk, svb, svh, svn, svd, start_n, n_keys, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, TMA
        )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        k_hi = _tile_once(
            K, b, hk, skb, skh, skn, skd, start_n, n_keys, offs_j, offs_hi, HEAD_DIM, BLOCK_N, D_HI, PAD_D, False
        )
        v_hi = _tile_once(
            V, b, hk, svb, svh, svn, svd, start_n, n_keys, offs_j, offs_hi, HEAD_DIM, BLOCK_N, D_HI, PAD_D, False
        )
        dk_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
        dv_hi = tl.zeros([BLOCK_N, D_HI], dtype=tl.float32)
    else:  # one part: stand-ins, never read (the loops carry dk_hi and dv_hi unchanged, which the compiler drops)
        offs_hi, k_hi, v_hi, dk_hi, dv_hi = offs_d, k, v, dk, dv

    m_lo, m_full = _query_blocks(start_n, kv_len, lq, BLOCK_M, BLOCK_N, CAUSAL)
    if start_n < kv_len:  # a block wholly past kv_len gets dk = dv = 0
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            drop_seed = _pair_key(tl.load(SEED), bh) ^ _key_block(start_n) if DROPOUT else 0
            q_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, lq, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
            do_src = _rows_src(DO, b, h, sdob, sdoh, sdom, sdod, lq, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
            if D_HI > 0:
                q_hi_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, lq, offs_m, offs_hi, HEAD_DIM, BLOCK_M, D_HI, False)
                do_hi_src = _rows_src(
                    DO, b, h, sdob, sdoh, sdom, sdod, lq, offs_m, offs_hi, HEAD_DIM, BLOCK_M, D_HI, False
                )
            else:  # stand-ins, never read
                q_hi_src, do_hi_src = q_src, do_src
            lse_row = _lse_row(b, h, H, LQ, q_start, VARLEN)
            lse_src = LSE + lse_row
            delta_src = DELTA + lse_row
            if LSE_DELTA_TMA:
                lse_src = tl.make_tensor_descriptor(lse_src, [lq], [1], [BLOCK_M])
                delta_src = tl.make_tensor_descriptor(delta_src, [lq], [1], [BLOCK_M])
            for start_m in range(m_lo, tl.minimum(m_full, lq), BLOCK_M):
                dk, dk_hi, dv, dv_hi = _dkdv_block(
                    dk,
                    dk_hi,
                    dv,
                    dv_hi,
                    k,
                    k_hi,
                    v,
                    v_hi,
                    q_src,
                    q_hi_src,
                    do_src,
                    do_hi_src,
                    lse_src,
                    delta_src,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_hi,
                    kv_len,
                    lq,
                    sqm,
                    sdom,
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
                    LSE_DELTA_TMA,
                    D_HI,
                )
            for start_m in range(tl.maximum(m_full, m_lo), lq, BLOCK_M):
                dk, dk_hi, dv, dv_hi = _dkdv_block(
                    dk,
                    dk_hi,
                    dv,
                    dv_hi,
                    k,
                    k_hi,
                    v,
                    v_hi,
                    q_src,
                    q_hi_src,
                    do_src,
                    do_hi_src,
                    lse_src,
                    delta_src,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_hi,
                    kv_len,
                    lq,
                    sqm,
                    sdom,
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
                    LSE_DELTA_TMA,
                    D_HI,
                )
    _store_dkdv(
        DK, DV, dk * sm_scale, dv, b, hk, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, offs_n, offs_d, n_keys, HEAD_DIM, PAD_D
    )
    if D_HI > 0:
        _store_dkdv(
            DK,
            DV,
            dk_hi * sm_scale,
            dv_hi,
            b,
            hk,
            sdkb,
            sdkh,
            sdkn,
            sdvb,
            sdvh,
            sdvn,
            offs_n,
            offs_hi,
            n_keys,
            HEAD_DIM,
            PAD_D,
        )


# --------------------------------------------------------------------------- launch


def backward_dkdv(
    do, q, k, v, key_lengths, causal, scale, dropout_p, seed, lse, delta, *, cfg=None, tma=None, packing=None
):
    """(dk, dv) in k's and v's dtypes. cfg, tma: see backward_variant (and lse_delta_variant). packing: see forward."""
    b, h, hkv, lq, lk, _, rows_k = _sizes(q, k, packing)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    cfg, variant = backward_variant("dkdv", q, k, v, do, cfg, False if packing is not None else tma, causal=causal)
    variant["LSE_DELTA_TMA"] = lse_delta_variant(cfg, lse, delta, variant["TMA"])
    if variant["TMA"]:
        _ensure_scratch_allocator()
    n_blocks = cdiv(rows_k, cfg.block_n)
    _bwd_dkdv_kernel[grid_of(n_blocks, b * hkv)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        key_lengths if key_lengths is not None else q,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(do, packing),
        *_strides(dk, packing)[:3],
        *_strides(dv, packing)[:3],
        h,
        hkv,
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
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return dk, dv


def lse_delta_variant(cfg: BwdConfig, lse: torch.Tensor, delta: torch.Tensor, tma: bool) -> bool:
    """Whether the dk/dv kernel on its descriptor path (tma: backward_variant's TMA) reads lse and delta (contiguous
    [B, H, Lq] fp32, as both paths take them) through 1-D descriptors too: the config asks for it (lse_delta_tma) and
    every (b, h) row is 16-byte aligned (Lq % 4 == 0); else pointer loads. Query blocks of fewer than 32 rows take
    pointers too: with 16 (64-byte boxes) the kernel faulted on a misaligned address on an H100 (Triton 3.6,
    head dim 32)."""
    if not (cfg.lse_delta_tma and tma) or cfg.block_m < 32:
        return False
    return lse.shape[-1] % 4 == 0 and all(x.data_ptr() % 16 == 0 for x in (lse, delta))
