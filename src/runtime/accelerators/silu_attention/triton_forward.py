"""silu_attention's Triton forward (kernel and launcher) and the pieces every kernel and launcher shares (launch
configurations: triton_configs.py; the kernels' math: triton.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backends import triton_interpret
from ..buffers import empty
from ..flash_attention import dropout
from ..flash_attention.triton_blocks import _keep, _key_block, _mix32, _pair_key, _query_block
from ..launch_math import cdiv, next_power_of_2
from ..triton_launch import direct_launch
from . import reference
from .triton_configs import config

MAX_TIME_BUCKETS = 63  # floor(log2(1 + |dt|)) <= 62 for |dt| <= MAX_TIME_DIFFERENCE = 2^63 - 2
MAX_TIME_DIFFERENCE = tl.constexpr(reference.MAX_TIME_DIFFERENCE)


def block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _time_bucket(tq, tk, T, PTX: tl.constexpr):
    """min(floor(log2(1 + |tq - tk|)), T - 1) of int64 timestamps, exact, |tq - tk| saturated at MAX_TIME_DIFFERENCE
    as the reference's time_differences: the difference is exact in unsigned arithmetic, also past int64 (as the
    TileLang prelude computes it)."""
    uq, uk = tq.to(tl.uint64, bitcast=True), tk.to(tl.uint64, bitcast=True)
    d = tl.where(tq > tk, uq - uk, uk - uq)
    x = (tl.minimum(d, MAX_TIME_DIFFERENCE) + 1).to(tl.int64, bitcast=True)
    if PTX:  # 63 - the count of leading zeros is floor(log2) of a positive integer
        b = 63 - tl.inline_asm_elementwise("clz.b64 $0, $1;", "=r,l", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:  # no PTX under the interpreter: the float log2 is at most one off, and x >> b is 1 exactly when b is right
        b = tl.floor(tl.log2(x.to(tl.float32))).to(tl.int32)
        b = tl.minimum(tl.maximum(b, 0), 62)
        r = x >> b.to(tl.int64)
        b = b - (r == 0).to(tl.int32) + (r >= 2).to(tl.int32)
    return tl.minimum(b, T - 1)


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    if APPROX:  # one MUFU op, max relative error about 2^-11 (below 16-bit rounding)
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _silu(x, APPROX: tl.constexpr):
    """x * sigmoid(x) as h + h tanh(h), h = x / 2: one formula whichever tanh runs (tanh.approx on the GPU for 16-bit
    inputs; 2 sigmoid(2h) - 1 under the interpreter, which runs no PTX, and for fp32, whose bound is below 2^-11)."""
    h = 0.5 * x
    return h + h * _tanh(h, APPROX)


@triton.jit
def _sigmoid(x, APPROX: tl.constexpr):
    """(1 + tanh(x / 2)) / 2, by _silu's tanh."""
    return 0.5 + 0.5 * _tanh(0.5 * x, APPROX)


@triton.jit
def _scores(
    qk,
    h,
    qi,
    kj,
    tq,
    tk,
    PB,
    TB,
    sph,
    spp,
    sth,
    stt,
    P,
    T,
    alpha,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    PTX: tl.constexpr,
):
    """alpha * qk plus the biases of queries qi and keys kj (local indices; tq, tk their timestamps), broadcast."""
    s = qk * alpha
    if HAS_POS:
        s += tl.load(PB + h * sph + tl.minimum(tl.abs(qi - kj), P - 1) * spp).to(tl.float32)
    if HAS_TIME:
        s += tl.load(TB + h * sth + _time_bucket(tq, tk, T, PTX) * stt).to(tl.float32)
    return s


@triton.jit
def _visible(qi, kj, n, first_target, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """Query qi sees key kj (broadcast): both in the sequence, kj <= qi when causal, a candidate key (kj >=
    first_target) only by itself."""
    visible = (qi < n) & (kj < n)
    if CAUSAL:
        visible = visible & (kj <= qi)
    if HAS_TARGETS:
        visible = visible & ((kj < first_target) | (qi == kj))
    return visible


@triton.jit
def _sequence(CU, NT, s, HAS_TARGETS: tl.constexpr):
    """(first row, length, first candidate index) of sequence s."""
    start = tl.load(CU + s)
    n = tl.load(CU + s + 1) - start
    first_target = n
    if HAS_TARGETS:
        first_target = n - tl.load(NT + s)
    return start, n, first_target


@triton.jit
def _rows(X, start, h, s_row, s_head, rows, n, offs_d, HEAD_DIM: tl.constexpr, IN_SEQUENCE: tl.constexpr = False):
    """The [rows, BLOCK_D] tile of head h at local rows `rows` of the sequence from row `start`, zero outside
    (IN_SEQUENCE: every row is inside)."""
    ptrs = X + (start + rows).to(tl.int64)[:, None] * s_row + h * s_head + offs_d[None, :]
    if IN_SEQUENCE:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs, mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _store_rows(X, value, start, h, s_row, s_head, rows, n, offs_d, HEAD_DIM: tl.constexpr):
    ptrs = X + (start + rows).to(tl.int64)[:, None] * s_row + h * s_head + offs_d[None, :]
    tl.store(ptrs, value.to(X.dtype.element_ty), mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _times(TS, start, rows, n, HAS_TIME: tl.constexpr, IN_SEQUENCE: tl.constexpr = False):
    if HAS_TIME:
        if IN_SEQUENCE:
            return tl.load(TS + start + rows)
        return tl.load(TS + start + rows, mask=rows < n, other=0)
    return rows.to(tl.int64)  # not read


@triton.jit
def _dsilu(s, sig):
    return sig * (1.0 + s * (1.0 - sig))


# --------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tile(
    acc,
    q,
    tq,
    offs_m,
    start_n,
    offs_j,
    start,
    h,
    n,
    first_target,
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
    scale,
    dropout_p,
    offs_d,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    DROPOUT: tl.constexpr,
    MASK: tl.constexpr,
    PTX: tl.constexpr,
    TANH_APPROX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc plus silu(scores) * scale times v of the key block at start_n; MASK: zero the scores not visible or dropped
    (without it, every score must be visible, every key inside the sequence)."""
    offs_n = start_n + offs_j
    k = _rows(K, start, h, skt, skh, offs_n, n, offs_d, HEAD_DIM, not MASK)
    v = _rows(V, start, h, svt, svh, offs_n, n, offs_d, HEAD_DIM, not MASK)
    tk = _times(TS, start, offs_n, n, HAS_TIME, not MASK)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    sc = _scores(qk, h, offs_m[:, None], offs_n[None, :], tq[:, None], tk[None, :], PB, TB, sph, spp, sth, stt, P, T,
                 alpha, HAS_POS, HAS_TIME, PTX)  # fmt: skip
    a = _silu(sc, TANH_APPROX) * scale
    if MASK:
        visible = _visible(offs_m[:, None], offs_n[None, :], n, first_target, CAUSAL, HAS_TARGETS)
        if DROPOUT:
            visible = visible & _keep(_mix32(drop_seed ^ _key_block(start_n)), offs_m[:, None], offs_n[None, :],
                                      dropout_p)  # fmt: skip
        a = tl.where(visible, a, 0.0)
    return tl.dot(a.to(v.dtype), v, acc, input_precision=DOT_PRECISION)


@direct_launch
@triton.jit(do_not_specialize=["H", "NBLOCKS", "P", "T"])
def _fwd_kernel(
    Q,
    K,
    V,
    O,
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
    sot,
    soh,
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
    """Two loops over key blocks (as FlashAttention's two stages): first the blocks every score of which is visible
    (inside the sequence, before the causal diagonal and the first candidate, no dropout), without a mask (rows past
    the sequence are computed there, never stored), then the edge blocks, masked."""
    pid = tl.program_id(0)
    block = NBLOCKS - 1 - pid % NBLOCKS  # the heaviest (last) query blocks of causal attention first
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
        tq = _times(TS, start, offs_m, n, HAS_TIME)
        drop_seed = _pair_key(tl.load(SEED), pair) ^ _query_block(start_m) if DROPOUT else 0
        scale = inv_max * inv_keep if DROPOUT else inv_max
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n_end = tl.minimum(n, start_m + BLOCK_M) if CAUSAL else n
        # keys below `seen` are visible to every query of the block (key kj <= start_m sees all of them when causal)
        seen = tl.minimum(first_target, start_m + 1) if CAUSAL else first_target
        n_full = 0 if DROPOUT else (seen // BLOCK_N) * BLOCK_N
        for start_n in range(0, n_full, BLOCK_N):
            acc = _fwd_tile(acc, q, tq, offs_m, start_n, offs_j, start, h, n, first_target, drop_seed, K, V, TS, PB, TB,
                            skt, skh, svt, svh, sph, spp, sth, stt, P, T, alpha, scale, dropout_p, offs_d, HEAD_DIM,
                            CAUSAL, HAS_TARGETS, HAS_POS, HAS_TIME, DROPOUT, False, PTX, TANH_APPROX,
                            DOT_PRECISION)  # fmt: skip
        for start_n in range(n_full, n_end, BLOCK_N):
            acc = _fwd_tile(acc, q, tq, offs_m, start_n, offs_j, start, h, n, first_target, drop_seed, K, V, TS, PB, TB,
                            skt, skh, svt, svh, sph, spp, sth, stt, P, T, alpha, scale, dropout_p, offs_d, HEAD_DIM,
                            CAUSAL, HAS_TARGETS, HAS_POS, HAS_TIME, DROPOUT, True, PTX, TANH_APPROX,
                            DOT_PRECISION)  # fmt: skip
        _store_rows(O, acc, start, h, sot, soh, offs_m, n, offs_d, HEAD_DIM)


# --------------------------------------------------------------------------- launchers


def _bias_args(bias: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """(tensor, head stride, element stride, size) of an [H, size] bias view, or stand-ins where absent."""
    if bias is None:
        return q, 0, 0, 1
    return bias, bias.stride(0), bias.stride(1), bias.shape[1]


def _common(
    q, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
):
    """(tensor arguments, scalar strides of the biases, scalars, constexprs) that every kernel takes."""
    pb, sph, spp, p = _bias_args(position_bias, q)
    tb, sth, stt, t = _bias_args(time_bias, q)
    rate = dropout.drop_rate(dropout_p)
    tensors = (cu_seqlens, num_targets if num_targets is not None else cu_seqlens, pb, tb,
               timestamps if timestamps is not None else cu_seqlens, seed if seed is not None else cu_seqlens)  # fmt: skip
    scalars = (p, min(t, MAX_TIME_BUCKETS), alpha, 1.0 / max_seqlen, rate, 1.0 / (1.0 - rate))
    flags = dict(
        HEAD_DIM=q.shape[-1], BLOCK_D=block_d(q.shape[-1]), CAUSAL=bool(causal), HAS_TARGETS=num_targets is not None,
        HAS_POS=position_bias is not None, HAS_TIME=time_bias is not None, DROPOUT=dropout_p > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # the latter is ignored for 16-bit inputs
        PTX=not triton_interpret(), TANH_APPROX=not triton_interpret() and q.dtype != torch.float32,
    )  # fmt: skip
    return tensors, (sph, spp, sth, stt), scalars, flags


def _strides(*xs) -> tuple:
    return tuple(s for x in xs for s in x.stride()[:2])


def _head_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(
    q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
):
    """o [total, H, D] in q's dtype."""
    q, k, v = (_head_dim_contiguous(x) for x in (q, k, v))
    total, h, _ = q.shape
    o = empty((total, h, q.shape[-1]), dtype=q.dtype, device=q.device)
    n = cu_seqlens.shape[0] - 1
    tensors, bias_strides, scalars, flags = _common(
        q, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
    )
    block_m, block_n, warps, stages = config("fwd", q.dtype)
    n_blocks = cdiv(max_seqlen, block_m)
    if n * h * n_blocks:
        _fwd_kernel[(n * h * n_blocks,)](
            q, k, v, o, *tensors, *_strides(q, k, v, o), *bias_strides, h, n_blocks, *scalars,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **flags,
        )  # fmt: skip
    return o
