"""The Triton flash-attention forward (kernel and launcher), and the TMA and variant choices every launcher takes
(see triton_configs.py)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4: the scratch allocator of in-kernel tensor descriptors
    from triton.runtime import _allocation
except ImportError:
    _allocation = None

from ..backends import device_capability
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
from .triton_configs import BwdConfig, FwdConfig, backward_kind, config, launch_options, split_head_dim
from .triton_launch_args import _flags, _packing_args, _row_shape, _seed_arg, _sizes, _strides, grid_of


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """TMA hardware (Hopper on) and a Triton with device-side tensor descriptors (3.4 on)."""
    descriptors = _allocation is not None and hasattr(tl, "make_tensor_descriptor")
    return descriptors and device_capability(device) >= (9, 0)


def _tma_layout(x: torch.Tensor) -> bool:
    """Whether a [B, H, L, D] view can be read through per-(batch, head) [L, D] descriptors: a 16-byte aligned
    base for every (b, h) and row stride, rows apart (not expanded: an upstream gradient can be), and a contiguous
    head dim."""
    step = 16 // x.element_size()
    b, h, _, _ = x.shape
    sb, sh, sl, sd = x.stride()
    return (
        x.data_ptr() % 16 == 0 and sd == 1 and sl % step == 0 and sl > 0
        and (b == 1 or sb % step == 0) and (h == 1 or sh % step == 0)
    )  # fmt: skip


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # on the current device and stream, as the launch; torch's blocks are 512-byte aligned
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Compiled kernels that make tensor descriptors need Triton's global scratch allocator (a context variable: per
    thread); set a torch one where none is set, never replacing one the user set (nothing under the interpreter)."""
    if _fwd_kernel.direct and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


@triton.jit
def _fwd_block(
    acc,
    acc_hi,
    l_i,
    m_i,
    q,
    q_hi,
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
    """One key block into the online softmax; k_src/v_src: _rows_src sources of kv_len rows. D_HI > 0: the head
    dim's second column part too (the *_hi tiles, sources and offs_hi: see _fwd_kernel); else those are not read."""
    cols = start_n + offs_n
    k = _tile(k_src, start_n, skn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    v = _tile(v_src, start_n, svn, kv_len, offs_n, offs_d, HEAD_DIM, PAD_D, MASK, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if D_HI > 0:
        k_hi = _tile(k_hi_src, start_n, skn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PRECISION)
    if MASK:
        visible = cols[None, :] < kv_len
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    # m_i starts finite (-1e30), so a row masked so far gets p = exp2(-inf) = 0, never NaN
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if D_HI > 0:
        acc_hi = acc_hi * alpha[:, None]
    if DROPOUT:
        keep = _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], cols[None, :], dropout_p)
        p = tl.where(keep, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    if D_HI > 0:
        v_hi = _tile(v_hi_src, start_n, svn, kv_len, offs_n, offs_hi, HEAD_DIM, PAD_D, MASK, False)
        acc_hi = tl.dot(p.to(v.dtype), v_hi, acc_hi, input_precision=DOT_PRECISION)
    return acc, acc_hi, l_i, m_new


@direct_launch
@triton.jit(do_not_specialize=["H", "GROUP", "LQ", "LK", "N_BLOCKS"])
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
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
    sob,
    soh,
    som,
    H,
    GROUP,
    LQ,
    LK,
    N_BLOCKS,
    qk_scale,
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
    HEAVY_FIRST: tl.constexpr,
    D_HI: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """One query block. D_HI > 0 (split_d): every [rows, HEAD_DIM] tile is held as two column parts, [0, BLOCK_D)
    and [BLOCK_D, HEAD_DIM) of D_HI columns (powers of two both, HEAD_DIM = BLOCK_D + D_HI), read through pointers;
    D_HI = 0: one part of BLOCK_D columns, zero past HEAD_DIM. VARLEN: see _sequence."""
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
        O += q_start * som
        K += k_start * skn
        V += k_start * svn
        kv_len = tl.where(start_m < lq, kv_len, 0)  # a block past its sequence's queries visits no key
    drop_seed = _pair_key(tl.load(SEED), bh) ^ _query_block(start_m) if DROPOUT else 0
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_i
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = _tile_once(Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, PAD_D, TMA)
    # K/V of kv_len rows (descriptors: at least one, a program with kv_len = 0 loads nothing through them)
    kv_rows = tl.maximum(kv_len, 1)
    k_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    # blocks below n_full are visible to every row of this program; blocks up to n_end need the mask
    if CAUSAL:
        n_end = tl.minimum(kv_len, start_m + BLOCK_M)
        n_full = (tl.minimum(kv_len, start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        n_end = kv_len
        n_full = (kv_len // BLOCK_N) * BLOCK_N

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if D_HI > 0:  # the second part: columns BLOCK_D + offs_hi
        offs_hi = BLOCK_D + tl.arange(0, D_HI)
        q_hi = _tile_once(
            Q, b, h, sqb, sqh, sqm, sqd, start_m, lq, offs_i, offs_hi, HEAD_DIM, BLOCK_M, D_HI, PAD_D, False
        )
        k_hi_src = _rows_src(K, b, hk, skb, skh, skn, skd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        v_hi_src = _rows_src(V, b, hk, svb, svh, svn, svd, kv_rows, offs_n, offs_hi, HEAD_DIM, BLOCK_N, D_HI, False)
        acc_hi = tl.zeros([BLOCK_M, D_HI], dtype=tl.float32)
    else:  # one part: stand-ins, never read (the loops carry acc_hi unchanged, which the compiler drops)
        offs_hi, q_hi, k_hi_src, v_hi_src, acc_hi = offs_d, q, k_src, v_src, acc
    for start_n in range(0, n_full, BLOCK_N):
        acc, acc_hi, l_i, m_i = _fwd_block(
            acc,
            acc_hi,
            l_i,
            m_i,
            q,
            q_hi,
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
        acc, acc_hi, l_i, m_i = _fwd_block(
            acc,
            acc_hi,
            l_i,
            m_i,
            q,
            q_hi,
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

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    inv_l = 1.0 / l_safe
    if DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty_row, float("inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_rows = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh + offs_m[:, None] * som
    _store(o_rows + offs_d[None, :], out.to(O.dtype.element_ty), offs_m, lq, offs_d, HEAD_DIM, PAD_D)
    if D_HI > 0:
        out_hi = acc_hi * inv_l[:, None]
        _store(o_rows + offs_hi[None, :], out_hi.to(O.dtype.element_ty), offs_m, lq, offs_hi, HEAD_DIM, PAD_D)
    tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < lq)


# --------------------------------------------------------------------------- launch


def _use_tma(cfg, tensors, tma) -> bool:
    """Whether a launch reads `tensors` through descriptors. tma: None lets the config decide, on a compiled CUDA
    device of capability >= 9.0 only; True/False force the descriptor path on or off (tests: the interpreter runs it
    too). Either way the strides of every tensor must suit descriptors, else the pointer path runs."""
    x = tensors[0]
    if tma is None:
        tma = cfg.tma and _fwd_kernel.direct and x.is_cuda and _has_tma(x.device)
    return bool(tma) and all(_tma_layout(t) for t in tensors)


def _split_or_tma(cfg, tensors, tma) -> dict:
    """D_HI (the second column part's width where the config asks for split_d and the head dim splits, see
    split_head_dim; else 0) and TMA (_use_tma; never for a split launch, whose parts load through pointers)."""
    d_hi = split_head_dim(tensors[0].shape[-1])[1] if cfg.split_d else 0
    return dict(TMA=d_hi == 0 and _use_tma(cfg, tensors, tma), D_HI=d_hi)


def forward_variant(q, k, v, causal: bool, cfg=None, tma=None) -> tuple[FwdConfig, dict]:
    """The forward's config and variant constexprs for these inputs.

    cfg: a FwdConfig (or its leading 4-tuple) instead of the table's. tma: see _use_tma. TMA and D_HI: see
    _split_or_tma (a split forward loads through pointers)."""
    cfg = config("fwd_causal" if causal else "fwd", q.shape[-1], q.dtype) if cfg is None else cfg
    if not isinstance(cfg, FwdConfig):
        cfg = FwdConfig(*cfg)
    return cfg, dict(HEAVY_FIRST=int(cfg.heavy_first) if causal else 0) | _split_or_tma(cfg, (q, k, v), tma)


def backward_variant(kind: str, q, k, v, do, cfg=None, tma=None, *, causal=False) -> tuple[BwdConfig, dict]:
    """The config and variant constexprs of the "dkdv" or "dq" kernel for these inputs (both read q, k, v, do); the
    dk/dv kernel's LSE_DELTA_TMA depends on lse and delta too: see lse_delta_variant.

    cfg: a BwdConfig (or a plain 4-tuple) instead of the table's. tma: see _use_tma. TMA and D_HI: see _split_or_tma
    (a split launch loads through pointers)."""
    cfg = config(backward_kind(kind, causal), q.shape[-1], q.dtype) if cfg is None else cfg
    if not isinstance(cfg, BwdConfig):
        cfg = BwdConfig(*cfg)
    return cfg, dict(HEAVY_FIRST=int(cfg.heavy_first) if causal else 0) | _split_or_tma(cfg, (q, k, v, do), tma)


def forward(q, k, v, key_lengths, causal, scale, dropout_p, seed, *, cfg=None, tma=None, packing=None):
    """(o [B, H, Lq, D] in q's dtype, lse [B, H, Lq] fp32; +inf for rows that see no key). cfg, tma: see
    forward_variant. packing: packed sequences (Packing; key_lengths is then None): o [total_q, H, D], lse [H, total_q],
    pointer loads only."""
    b, h, hkv, lq, lk, rows_q, _ = _sizes(q, k, packing)
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty(_row_shape(q, packing), dtype=torch.float32, device=q.device)
    cfg, variant = forward_variant(q, k, v, causal, cfg, False if packing is not None else tma)
    if variant["TMA"]:
        _ensure_scratch_allocator()
    n_blocks = cdiv(rows_q, cfg.block_m)
    _fwd_kernel[grid_of(n_blocks, b * h)](
        q,
        k,
        v,
        o,
        lse,
        key_lengths if key_lengths is not None else q,
        *_packing_args(packing, q),
        *_strides(q, packing),
        *_strides(k, packing),
        *_strides(v, packing),
        *_strides(o, packing)[:3],
        h,
        h // hkv,
        lq,
        lk,
        n_blocks,
        scale * LOG2E,
        dropout.drop_rate(dropout_p),
        _seed_arg(seed, q),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        **launch_options(cfg),
        VARLEN=packing is not None,
        **variant,
        **_flags(q, key_lengths, causal, dropout_p, variant["D_HI"]),
    )
    return o, lse
