"""The Triton flash-attention fused backward (short sequences: one program per key block computes delta, dk, dv
and dq), its launcher and the rule that picks it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..buffers import empty
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import dropout
from .triton_blocks import LOG2E, _block_and_pair, _key_block, _pair_key, _rows_src, _store, _tile, _tile_once
from .triton_configs import FUSED_HEAD_DIMS, FUSED_MIN_PROGRAMS, BwdConfig, block_d, config, launch_options
from .triton_dkdv import _dv_and_ds_t, _query_blocks, _store_dkdv
from .triton_launch_args import _flags, _seed_arg, grid_of


@triton.jit
def _fused_block(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    o_src,
    lse_ptr,
    DQ,
    dq_base,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    kv_len,
    LQ,
    sqm,
    sdom,
    som,
    sdqm,
    qk_scale,
    sm_scale,
    dropout_p,
    drop_seed,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
):
    """One query block against this program's key block: dk, dv accumulate (transposed form, [keys, queries]) and
    the block's dq part is stored (the key block holds every key) or added to the fp32 dq (DQ_ATOMIC)."""
    rows = start_m + offs_m
    q = _tile(q_src, start_m, sqm, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    do = _tile(do_src, start_m, sdom, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    o = _tile(o_src, start_m, som, LQ, offs_m, offs_d, HEAD_DIM, PAD_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # delta = rowsum(o * do), here
    dv, _, ds_t = _dv_and_ds_t(
        dv,
        dv,
        k,
        k,
        v,
        v,
        q,
        q,
        do,
        do,
        lse_ptr,
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
        False,
        0,
    )
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    # the transpose of a tile computed in registers as a dot operand: Triton 3.4-3.7 can miscompile that on Hopper
    # (see gated_delta_rule/triton_backward.py); tests/gpu checks this dq at padded head dims 16, 32, 64 and 128
    dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
    dq_ptrs = dq_base + rows[:, None] * sdqm + offs_d[None, :]
    if DQ_ATOMIC:
        tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < LQ) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    else:
        _store(dq_ptrs, dq.to(DQ.dtype.element_ty), rows, LQ, offs_d, HEAD_DIM, PAD_D)
    return dk, dv


@direct_launch
@triton.jit(do_not_specialize=["H", "HKV", "GROUP", "LQ", "LK", "N_BLOCKS"])
def _bwd_fused_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DK,
    DV,
    DQ,
    KL,
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
    sob,
    soh,
    som,
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
    sdqb,
    sdqh,
    sdqm,
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
    DQ_ATOMIC: tl.constexpr,
):
    """dq, dk and dv in one kernel, no launch for delta: the dk/dv kernel's loop, which also computes each query block's
    delta and its dq part (5 products and one exp per score, against the two kernels' 7 and two)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    block, bhk = _block_and_pair(N_BLOCKS, 0, False)
    start_n = block * BLOCK_N
    b = bhk // HKV
    hk = bhk % HKV
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_j
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k = _tile_once(K, b, hk, skb, skh, skn, skd, start_n, LK, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, False)
    v = _tile_once(V, b, hk, svb, svh, svn, svd, start_n, LK, offs_j, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, PAD_D, False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    kv_len = LK
    if HAS_KL:
        kv_len = tl.load(KL + b)
    m_lo, m_full = _query_blocks(start_n, kv_len, LQ, BLOCK_M, BLOCK_N, CAUSAL)
    # a key block wholly past kv_len adds nothing; the one key block of a stored dq (start_n = 0, so m_lo = 0: it
    # visits every query block) runs anyway, its dq rows are written only here (zeros where no key is visible)
    if DQ_ATOMIC:
        active = start_n < kv_len
    else:
        active = start_n <= kv_len
    if active:
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            drop_seed = _pair_key(tl.load(SEED), bh) ^ _key_block(start_n) if DROPOUT else 0
            q_src = _rows_src(Q, b, h, sqb, sqh, sqm, sqd, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            do_src = _rows_src(DO, b, h, sdob, sdoh, sdom, sdod, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            o_src = _rows_src(O, b, h, sob, soh, som, 1, LQ, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, False)
            lse_ptr = LSE + bh.to(tl.int64) * LQ
            dq_base = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
            for start_m in range(m_lo, tl.minimum(m_full, LQ), BLOCK_M):
                dk, dv = _fused_block(
                    dk,
                    dv,
                    k,
                    v,
                    q_src,
                    do_src,
                    o_src,
                    lse_ptr,
                    DQ,
                    dq_base,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    kv_len,
                    LQ,
                    sqm,
                    sdom,
                    som,
                    sdqm,
                    qk_scale,
                    sm_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    True,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    DQ_ATOMIC,
                )
            for start_m in range(tl.maximum(m_full, m_lo), LQ, BLOCK_M):
                dk, dv = _fused_block(
                    dk,
                    dv,
                    k,
                    v,
                    q_src,
                    do_src,
                    o_src,
                    lse_ptr,
                    DQ,
                    dq_base,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    kv_len,
                    LQ,
                    sqm,
                    sdom,
                    som,
                    sdqm,
                    qk_scale,
                    sm_scale,
                    dropout_p,
                    drop_seed,
                    HEAD_DIM,
                    PAD_D,
                    False,
                    CAUSAL,
                    DROPOUT,
                    DOT_PRECISION,
                    DQ_ATOMIC,
                )
    _store_dkdv(
        DK, DV, dk * sm_scale, dv, b, hk, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, offs_n, offs_d, LK, HEAD_DIM, PAD_D
    )


# --------------------------------------------------------------------------- launch


def use_fused(q, k, min_programs: int = FUSED_MIN_PROGRAMS, cfg=None) -> bool:
    """The fused kernel for 16-bit inputs at the head dims where it won, where every key fits its block (it then
    stores dq: no atomics) and there are enough (batch, kv head) pairs to fill the GPU (min_programs), one program
    each; else the dq and dk/dv kernels. cfg: the fused kernel's BwdConfig, as backward_fused takes it (None: the
    table's "fused" entry)."""
    b, hkv, lk = k.shape[0], k.shape[1], k.shape[2]
    d = block_d(q.shape[-1])
    return (
        q.dtype != torch.float32
        and d in FUSED_HEAD_DIMS
        and b * hkv >= min_programs
        and lk <= (config("fused", d, q.dtype) if cfg is None else BwdConfig(*cfg)).block_n
    )


def backward_fused(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse, *, cfg=None):
    """(dq, dk, dv) of _bwd_fused_kernel. dq is stored where Lk fits the config's key block, else summed over the
    key blocks with fp32 atomics (not deterministic in its last bits) and cast. cfg: a BwdConfig instead of the
    table's "fused" entry (tma is ignored: pointer loads only)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    cfg = config("fused", d, q.dtype) if cfg is None else BwdConfig(*cfg)
    atomic = lk > cfg.block_n
    dq = (
        torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if atomic
        else empty(q.shape, dtype=q.dtype, device=q.device)
    )
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    n_blocks = cdiv(lk, cfg.block_n)
    _bwd_fused_kernel[grid_of(n_blocks, b * hkv)](
        q,
        k,
        v,
        o,
        do,
        lse,
        dk,
        dv,
        dq,
        key_lengths if key_lengths is not None else q,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o.stride()[:3],
        *do.stride(),
        *dk.stride()[:3],
        *dv.stride()[:3],
        *dq.stride()[:3],
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
        DQ_ATOMIC=atomic,
        **_flags(q, key_lengths, causal, dropout_p),
    )
    return (dq.to(q.dtype) if atomic else dq), dk, dv
