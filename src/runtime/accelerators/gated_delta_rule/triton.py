"""Gated delta rule in Triton: the fused recurrent kernel (forward) and the chunked kernels (forward and backward).

All state math is fp32. Tokens are addressed as rows of the packed [B*T] axis: a sequence is
[bos, eos) (fixed length: bos = n*T; varlen: cu_seqlens[n], cu_seqlens[n+1]). Value head hv reads
q/k head hv // (HV // H).

Recurrent: one program per (sequence, value head, V block) holds its [K, BV] slice of the state
in registers and walks the steps (l2norm of q/k fused).

Chunked (chunks of BT = 64 steps, see reference.py for the math), three steps:
  1. prepare, two kernels of one program per (chunk, value head): _chunk_inverse_kernel, the local cumulative decay
     gamma, A = beta exp(gamma_t - gamma_j) k_t.k_j (strictly lower) and (I + A)^-1 (by blocks of 16 rows);
     _chunk_wy_kernel, the WY factors w = (I + A)^-1 diag(beta exp(gamma)) K, u = (I + A)^-1 diag(beta) V
     (gamma, w, u and (I + A)^-1 are kept for the backward).
  2. _chunk_state_kernel, one program per (sequence, value head, V block): the only sequential part; walks
     the chunks with the state in registers, storing the state S entering each chunk and the corrections
     U = u - w S (the backward runs it again instead of keeping them).
  3. _chunk_output_kernel, one program per (chunk, value head, V block), all in parallel: the chunk's output
     scale (diag(exp(gamma)) Q S + (Q K^T * decay)_{j<=t} U).
With few (sequence, value head, V block) programs for the SMs, long sequences are cut into segments walked
in parallel ("context-parallel split"). The state walk, the split and the helpers the backward uses too are in
triton_shared.py; the backward's kernels in triton_backward.py. Varlen chunk tables are written on the device (varlen.py).
With use_qk_l2norm_in_kernel, q and k are normalised in fp32 as they are loaded (the l2norm op's math;
normalising them first through the l2norm op would round them to the input dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from . import varlen
from .triton_backward import chunk_backward  # noqa: F401  (the backward entry point of this backend)
from .triton_shared import (
    BT,
    BT_,
    DEFAULT_TUNING,
    FULL_DECAY_,
    L2NORM_EPS,
    Chunks,
    Tuning,
    _bounds,
    _chunk_rows,
    _chunk_start,
    _contiguous,
    _final_state,
    _full_decays,
    _half_dots,
    _load_qk,
    _precision,
    _storage_dot,
    _to_half,
    half_storage,
    half_type,
    split,
    walk_states,
)

SUB = tl.constexpr(16)  # (I + A) is inverted by blocks of 16 rows (see _chunk_inverse_kernel)
INVERSE_PRECISION = tl.constexpr("tf32x3")  # the dots between blocks of (I + A)^-1: fp32-accurate on tensor cores


def _warps(elements: int) -> int:
    return 1 if elements <= 512 else 2 if elements <= 2048 else 4


def _sequences(v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return v.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


# --------------------------------------------------------------------------- recurrent


@direct_launch
@triton.jit(do_not_specialize=["T"])
def _recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    mask_v = cols_v < V
    state_offsets = i_nh.to(tl.int64) * K * V + cols_k[:, None] * V + cols_v[None, :]
    state_mask = (cols_k[:, None] < K) & mask_v[None, :]
    if USE_INITIAL_STATE:
        state = tl.load(h0 + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([K, BV], dtype=tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + cols_k).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + cols_k).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + cols_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
        state = state * tl.exp(b_g)
        correction = b_beta * (b_v - tl.sum(state * b_k[:, None], 0))
        state += b_k[:, None] * correction[None, :]
        b_o = tl.sum(state * b_q[:, None], 0) * scale
        tl.store(o + (t * HV + i_hv) * V + cols_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offsets, state, mask=state_mask)


def recurrent_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    n = _sequences(v, cu_seqlens)
    o = buffers.empty(v.shape, dtype=q.dtype, device=q.device)
    final = _final_state(output_final_state, n, HV, K, V, q.device)
    BV = min(V, 32)
    cu = None if cu_seqlens is None else varlen.on_device(cu_seqlens, q.device)
    _recurrent_kernel[(n * HV, cdiv(V, BV))](
        q, k, v, g, beta, o, initial_state, final, cu, scale, T,
        H=H, HV=HV, K=K, V=V, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
        L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=cu_seqlens is not None, num_warps=_warps(K * BV),
    )  # fmt: skip
    return o, final


def recurrent_backward(*_):
    # unreachable: requiring gradients is a not-supported reason of the recurrent kernels
    raise RuntimeError("gated_delta_rule: the recurrent Triton kernels are forward-only")


# --------------------------------------------------------------------------- the chunk's WY factors
# Two kernels per (chunk, value head), the chunk's rows in four blocks of SUB = 16 (block b: rows 16 b .. 16 b + 15):
#   _chunk_inverse_kernel, one warp: gamma = cumsum(g) and T = (I + A)^-1, A = beta_t exp(gamma_t - gamma_s) k_t.k_s
#     (s < t), all in registers. The ten blocks A_bm (m <= b) are [16, K] x [K, 16] dots of k's row blocks as stored
#     (half inputs are exact in tf32), the l2norm's rsqrt factors scaling the result; the diagonal blocks are
#     inverted by forward substitution on rows, whose reductions stay in the program's one warp (no barrier, no
#     memory round trip), and the blocks below them follow by block forward substitution in [16, 16] dots:
#         T_bm = -T_bb sum_{m <= j < b} A_bj T_jm.
#     T is written whole (zeros above the diagonal blocks; the backward reads it), in bf16 where _inverse_dtype says.
#   _chunk_wy_kernel, one warpgroup: w = T diag(beta e^gamma) K and u = T diag(beta) V ([64, 64] x [64, 64 columns]
#     dots, wgmma), from the T and gamma the first kernel wrote.


@triton.jit
def _mm(a, b, acc):
    """acc + a b between blocks of the inverse (INVERSE_PRECISION)."""
    return tl.dot(a, b, acc, input_precision=INVERSE_PRECISION)


@triton.jit
def _k_block(k, b: tl.constexpr, c, n_rows, ROW: tl.constexpr, BK: tl.constexpr):
    """Columns c .. c + BK of k's rows in block b, as stored, in fp32 (0 past the sequence); `k` at the chunk's first
    row."""
    rows = b * SUB + tl.arange(0, SUB)
    x = tl.load(k + rows[:, None] * ROW + c + tl.arange(0, BK)[None, :], mask=(rows < n_rows)[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _squares(x):
    return tl.sum(x * x, 1)


@triton.jit
def _kk(x, y, acc, PRECISION: tl.constexpr):
    return tl.dot(x, tl.trans(y), acc, input_precision=PRECISION)


@triton.jit
def _block_rows(x, b: tl.constexpr, n_rows, HV: tl.constexpr):
    """A per-row value (g, beta) on block b's rows, fp32 (0 past the sequence)."""
    rows = b * SUB + tl.arange(0, SUB)
    return tl.load(x + rows * HV, mask=rows < n_rows, other=0.0).to(tl.float32)


@triton.jit
def _block_gamma(g, gamma_out, b: tl.constexpr, before, fulls_before, n_rows, HV: tl.constexpr):
    """gamma on block b's rows (stored), given the sum of the chunk's g over the rows before it but the full decays
    and the count of those: sum - FULL_DECAY count, rounded once (reference.local_gamma); and both past block b."""
    rows = b * SUB + tl.arange(0, SUB)
    full, kept = _full_decays(_block_rows(g, b, n_rows, HV))
    gamma = (before + tl.cumsum(kept, 0)) - FULL_DECAY_ * (fulls_before + tl.cumsum(full, 0))
    tl.store(gamma_out + rows * HV, gamma, mask=rows < n_rows)
    return gamma, before + tl.sum(kept, 0), fulls_before + tl.sum(full, 0)


@triton.jit
def _rstd(squares, L2NORM: tl.constexpr):
    if L2NORM:
        return tl.rsqrt(squares + L2NORM_EPS)
    else:
        return tl.full([SUB], 1.0, tl.float32)


@triton.jit
def _a_block(kk, beta_b, gamma_b, rstd_b, gamma_m, rstd_m):
    """A_bm from k_b k_m^T (its strictly lower part when m = b)."""
    return kk * (beta_b * rstd_b)[:, None] * rstd_m[None, :] * tl.exp(gamma_b[:, None] - gamma_m[None, :])


@triton.jit
def _diagonal_inverse(kk, beta, gamma, rstd):
    """T_bb = (I + A_bb)^-1 from k_b k_b^T, by rows, T[i] = e_i - sum_{s < i} A[i, s] T[s], computed transposed
    (E = T_bb^T, one column a step): a step's reduction runs along axis 1, the shorter one across lanes in the dot
    layout, and row i of A, reduced along axis 0 (longer), does not depend on E, so those reductions are off the
    dependent chain. Neither needs a layout conversion."""
    p = tl.arange(0, SUB)
    row, col = p[:, None], p[None, :]
    a = tl.where(row > col, _a_block(kk, beta, gamma, rstd, gamma, rstd), 0.0)  # above: exp may overflow, unused
    e = tl.where(row == col, 1.0, 0.0)
    for i in tl.static_range(1, SUB):
        a_i = tl.sum(tl.where(row == i, a, 0.0), 0)  # A[i, s] along s
        e = tl.where(col == i, e - tl.sum(e * a_i[None, :], 1)[:, None], e)
    return tl.trans(e)


@triton.jit
def _store_block(inverse, b: tl.constexpr, m: tl.constexpr, x, n_rows, ROW: tl.constexpr):
    p = tl.arange(0, SUB)
    rows = b * SUB + p
    if inverse.dtype.element_ty == tl.bfloat16:
        x = _to_half(x, tl.bfloat16)  # as the products that take it would round it (the interpreter's store truncates)
    tl.store(inverse + rows[:, None] * ROW + m * SUB + p[None, :], x, mask=(rows < n_rows)[:, None])


@triton.jit
def _store_row_block(inverse, b: tl.constexpr, x0, x1, x2, x3, n_rows, ROW: tl.constexpr):
    """Row block b of T, from its four blocks (rows past the sequence are not written)."""
    _store_block(inverse, b, 0, x0, n_rows, ROW)
    _store_block(inverse, b, 1, x1, n_rows, ROW)
    _store_block(inverse, b, 2, x2, n_rows, ROW)
    _store_block(inverse, b, 3, x3, n_rows, ROW)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_inverse_kernel(
    k, g, beta, gamma_out, inverse_out, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (chunk, value head): gamma and T = (I + A)^-1 (fp32), in one warp (see above)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, eos = _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    # every pointer at the chunk's first row: offsets within the chunk are small (int32)
    k += (start * H + i_h) * K
    g += start * HV + i_hv
    beta += start * HV + i_hv
    gamma_out += start * HV + i_hv
    inverse_out += (start * HV + i_hv) * BT_
    ROW: tl.constexpr = HV * BT_  # between the rows of inverse_out
    n_rows = tl.minimum(eos - start, BT_).to(tl.int32)  # the chunk's rows inside its sequence

    gamma0, before, fulls = _block_gamma(g, gamma_out, 0, 0.0, 0.0, n_rows, HV)
    gamma1, before, fulls = _block_gamma(g, gamma_out, 1, before, fulls, n_rows, HV)
    gamma2, before, fulls = _block_gamma(g, gamma_out, 2, before, fulls, n_rows, HV)
    gamma3, _, _ = _block_gamma(g, gamma_out, 3, before, fulls, n_rows, HV)
    beta0 = _block_rows(beta, 0, n_rows, HV)
    beta1 = _block_rows(beta, 1, n_rows, HV)
    beta2 = _block_rows(beta, 2, n_rows, HV)
    beta3 = _block_rows(beta, 3, n_rows, HV)

    # k_b k_m^T (m <= b) and the squared norms of k's rows, over column blocks of k
    zero = tl.zeros([SUB, SUB], dtype=tl.float32)
    kk00, kk10, kk11, kk20, kk21 = zero, zero, zero, zero, zero
    kk22, kk30, kk31, kk32, kk33 = zero, zero, zero, zero, zero
    none = tl.zeros([SUB], dtype=tl.float32)
    sq0, sq1, sq2, sq3 = none, none, none, none
    for c in range(0, K, BK):  # not unrolled: the loads of all column blocks at once would spill
        k0 = _k_block(k, 0, c, n_rows, H * K, BK)
        k1 = _k_block(k, 1, c, n_rows, H * K, BK)
        k2 = _k_block(k, 2, c, n_rows, H * K, BK)
        k3 = _k_block(k, 3, c, n_rows, H * K, BK)
        if L2NORM:
            sq0, sq1, sq2, sq3 = sq0 + _squares(k0), sq1 + _squares(k1), sq2 + _squares(k2), sq3 + _squares(k3)
        kk00 = _kk(k0, k0, kk00, PRECISION)
        kk10 = _kk(k1, k0, kk10, PRECISION)
        kk11 = _kk(k1, k1, kk11, PRECISION)
        kk20 = _kk(k2, k0, kk20, PRECISION)
        kk21 = _kk(k2, k1, kk21, PRECISION)
        kk22 = _kk(k2, k2, kk22, PRECISION)
        kk30 = _kk(k3, k0, kk30, PRECISION)
        kk31 = _kk(k3, k1, kk31, PRECISION)
        kk32 = _kk(k3, k2, kk32, PRECISION)
        kk33 = _kk(k3, k3, kk33, PRECISION)
    rstd0, rstd1, rstd2, rstd3 = _rstd(sq0, L2NORM), _rstd(sq1, L2NORM), _rstd(sq2, L2NORM), _rstd(sq3, L2NORM)

    # by row blocks, each stored once done (zeros right of its diagonal block): fewer blocks held at once
    t00 = _diagonal_inverse(kk00, beta0, gamma0, rstd0)
    _store_row_block(inverse_out, 0, t00, zero, zero, zero, n_rows, ROW)
    t11 = _diagonal_inverse(kk11, beta1, gamma1, rstd1)
    a10 = _a_block(kk10, beta1, gamma1, rstd1, gamma0, rstd0)
    t10 = -_mm(t11, _mm(a10, t00, zero), zero)
    _store_row_block(inverse_out, 1, t10, t11, zero, zero, n_rows, ROW)
    t22 = _diagonal_inverse(kk22, beta2, gamma2, rstd2)
    a20 = _a_block(kk20, beta2, gamma2, rstd2, gamma0, rstd0)
    a21 = _a_block(kk21, beta2, gamma2, rstd2, gamma1, rstd1)
    t21 = -_mm(t22, _mm(a21, t11, zero), zero)
    t20 = -_mm(t22, _mm(a21, t10, _mm(a20, t00, zero)), zero)
    _store_row_block(inverse_out, 2, t20, t21, t22, zero, n_rows, ROW)
    t33 = _diagonal_inverse(kk33, beta3, gamma3, rstd3)
    a30 = _a_block(kk30, beta3, gamma3, rstd3, gamma0, rstd0)
    a31 = _a_block(kk31, beta3, gamma3, rstd3, gamma1, rstd1)
    a32 = _a_block(kk32, beta3, gamma3, rstd3, gamma2, rstd2)
    t32 = -_mm(t33, _mm(a32, t22, zero), zero)
    t31 = -_mm(t33, _mm(a32, t21, _mm(a31, t11, zero)), zero)
    t30 = -_mm(t33, _mm(a32, t20, _mm(a31, t10, _mm(a30, t00, zero))), zero)
    _store_row_block(inverse_out, 3, t30, t31, t32, t33, n_rows, ROW)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_wy_kernel(
    k, v, beta, gamma_in, inverse_in, w_out, u_out, k_factor_out, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """One (chunk, value head): w = T diag(beta e^gamma) K and u = T diag(beta) V by column blocks, T and gamma as
    _chunk_inverse_kernel wrote them (l2norm: k's rows times their rsqrt factor); HALF: on 16-bit operands. Also the
    state walk's row factors of k, e^(gamma_last - gamma) rstd (rows past the end are not written)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    start, eos = _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    k += (start * H + i_h) * K
    v += (start * HV + i_hv) * V
    beta += start * HV + i_hv
    gamma_in += start * HV + i_hv
    inverse_in += (start * HV + i_hv) * BT_
    w_out += (start * HV + i_hv) * K
    u_out += (start * HV + i_hv) * V
    k_factor_out += start * HV + i_hv
    n_rows = tl.minimum(eos - start, BT_).to(tl.int32)
    r = tl.arange(0, BT_)
    row_mask = r < n_rows
    b_beta = tl.load(beta + r * HV, mask=row_mask, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_in + r * HV, mask=row_mask, other=0.0)
    t = tl.load(inverse_in + r[:, None] * (HV * BT_) + r[None, :], mask=row_mask[:, None], other=0.0)
    _, rstd = _load_qk(k, r, row_mask, 0, H, K, L2NORM)
    last = tl.load(gamma_in + (n_rows - 1) * HV)
    tl.store(k_factor_out + r * HV, tl.exp(last - gamma) * rstd, mask=row_mask)
    k_scale = rstd * b_beta * tl.exp(gamma)
    for c in tl.static_range(0, K, BK):
        cols = c + tl.arange(0, BK)
        raw = tl.load(k + r[:, None] * (H * K) + cols[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
        w = _storage_dot(t, raw * k_scale[:, None], PRECISION, HALF)
        tl.store(w_out + r[:, None] * (HV * K) + cols[None, :], w.to(w_out.dtype.element_ty), mask=row_mask[:, None])
    for c in tl.static_range(0, V, BV):
        cols = c + tl.arange(0, BV)
        b_v = tl.load(v + r[:, None] * (HV * V) + cols[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
        u = _storage_dot(t, b_v * b_beta[:, None], PRECISION, HALF)
        tl.store(u_out + r[:, None] * (HV * V) + cols[None, :], u.to(u_out.dtype.element_ty), mask=row_mask[:, None])


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_output_kernel(
    q, k, gamma_in, states, corrections, o, cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """O = scale (diag(e^gamma) Q S + (Q K^T * decay)_{j <= t} U) of one chunk, from its stored S and U."""
    i_t, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    rows, row_mask, _ = _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    r = tl.arange(0, BT_)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
    b_q, _ = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
    b_k, _ = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    state = tl.load(states + (i_t.to(tl.int64) * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :]).to(
        tl.float32
    )
    tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
    b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    decay = tl.exp(
        tl.where((r[:, None] >= r[None, :]) & row_mask[:, None], gamma[:, None] - gamma[None, :], float("-inf"))
    )
    attention = _storage_dot(b_q, tl.trans(b_k), PRECISION, HALF) * decay
    b_o = _storage_dot(b_q * tl.exp(gamma)[:, None], state, PRECISION, HALF)
    b_o += _storage_dot(attention, b_corrections, PRECISION, HALF)
    tl.store(o + tokens, (b_o * scale).to(o.dtype.element_ty), mask=row_mask[:, None])


# The WY factors of half inputs are taken on bf16 operands (T and the scaled rows of K and V rounded to bf16, fp32
# accumulation), as fla does: faster than tf32 on an H100 at no cost in the bounds (docs/tuning/gated_delta_rule.md).


def _half_wy(k: torch.Tensor, BK: int, BV: int, tuning: Tuning = DEFAULT_TUNING) -> str:
    """HALF of the WY kernel: the storage type of half inputs. Only where the V blocks are at least as wide as the K
    blocks: Triton 3.6 on the H100 built the bf16 products wrongly when the u product (BV columns) was narrower than
    the w product before it (BK columns, the same T operand): K = 64, V = 32 gave a wrong u, K = 128, V = 32 an
    illegal memory access."""
    return half_type(tuning.storage_dtype(k)) if _half_dots(k) and BV >= BK else ""


def _inverse_dtype(k: torch.Tensor, half_wy: str, tuning: Tuning) -> torch.dtype:
    """The dtype prepare stores (I + A)^-1 in: 16 bits where every product that takes it rounds it to that type first
    (the WY kernel with HALF, `half_wy`, and step 5 of the backward: Tuning.half_inverse), so that the numbers are the
    same and the traffic half; else fp32 (its tf32 and IEEE products keep more mantissa)."""
    return half_storage(half_wy) if tuning.half_inverse(k) else torch.float32


def _wy_launch(k: torch.Tensor, V: int, tuning: Tuning) -> tuple[dict, int, str]:
    """The WY kernel's launch options, its K block and HALF."""
    K = k.shape[-1]
    wide = 32 if k.dtype == torch.float32 else 64  # IEEE dots (fp32) spill at 64 columns
    # one warpgroup (wgmma dots); at K = 16 one warp (mma) was 0.6% faster (forward + backward, PCVR, H100)
    options = dict(BV=min(V, wide), num_warps=1 if K == 16 else 4)
    BK = min(K, wide)
    return options, BK, _half_wy(k, BK, options["BV"], tuning)


def saved_dtypes(k: torch.Tensor, V: int) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes prepare stores w and u, and (I + A)^-1, in (for the op's traced placeholder)."""
    half_wy = _wy_launch(k, V, DEFAULT_TUNING)[2]
    return DEFAULT_TUNING.storage_dtype(k), _inverse_dtype(k, half_wy, DEFAULT_TUNING)


def prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks: Chunks, precision: str, tuning: Tuning = DEFAULT_TUNING):
    """Per chunk: gamma [B*T, HV], w [B*T, HV, K], u [B*T, HV, V] (Tuning.storage_dtype), (I + A)^-1 [B*T, HV, BT]
    (_inverse_dtype), and the walks' row factors of k, e^(gamma_last - gamma) rstd [B*T, HV] (fp32)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    device = k.device
    gamma = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    w = buffers.empty((B * T, HV, K), dtype=tuning.storage_dtype(k), device=device)
    u = buffers.empty((B * T, HV, V), dtype=tuning.storage_dtype(k), device=device)
    k_factor = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    options, BK, half_wy = _wy_launch(k, V, tuning)
    inverse = buffers.empty((B * T, HV, BT), dtype=_inverse_dtype(k, half_wy, tuning), device=device)
    if chunks.total > 0:
        common = dict(L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=chunks.cu is not None, PRECISION=precision)
        _chunk_inverse_kernel[(chunks.total, HV)](
            k, g, beta, gamma, inverse, chunks.cu, chunks.indices, T, chunks.per_sequence,
            H=H, HV=HV, K=K, BK=16, **common,  # wider column steps spill at K = 32 (sm_90)
            num_warps=1,  # the substitution's reductions stay within the warp
        )  # fmt: skip
        _chunk_wy_kernel[(chunks.total, HV)](
            k, v, beta, gamma, inverse, w, u, k_factor, chunks.cu, chunks.indices, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, BK=BK, HALF=half_wy, **common, **options,
        )  # fmt: skip
    return gamma, w, u, inverse, k_factor


def _output(q, k, gamma, states, corrections, scale, l2norm, chunks: Chunks, v_shape) -> torch.Tensor:
    """The outputs of every chunk in parallel (one program per chunk, value head and V block)."""
    B, T, H, K = q.shape
    HV, V = v_shape[2], v_shape[3]
    o = buffers.empty(v_shape, dtype=q.dtype, device=q.device)
    # with bf16 products the whole value width fits one program (Q K^T once per chunk): 3.642 -> 3.560 ms forward +
    # backward at B4-T4096-H16-D128 (H100)
    options = dict(BV=min(V, 128 if _half_dots(q) else 64), num_warps=4)
    if chunks.total > 0:
        _chunk_output_kernel[(chunks.total, HV, cdiv(V, options["BV"]))](
            q, k, gamma, states, corrections, o, chunks.cu, chunks.indices, scale, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, L2NORM=l2norm, IS_VARLEN=chunks.cu is not None, PRECISION=_precision(q),
            HALF=half_type(states.dtype), **options,
        )  # fmt: skip
    return o


def chunk_forward(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, *,
    tuning: Tuning = DEFAULT_TUNING,
):  # fmt: skip
    """(o, final state, and for backward: gamma, w, u, (I + A)^-1, as prepare stores them); tuning: the kernels'
    variants (pass the backward the same)."""
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    chunks = Chunks.of(v, cu_seqlens)
    gamma, w, u, inverse, k_factor = prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks, _precision(q), tuning)
    segments = split(chunks, q, v, cu_seqlens, tuning.segment_chunks)
    final, states, corrections, _ = walk_states(
        k, v, k_factor, gamma, w, u, initial_state, output_final_state, chunks, segments
    )
    o = _output(q, k, gamma, states, corrections, scale, use_qk_l2norm_in_kernel, chunks, v.shape)
    return o, final, gamma, w, u, inverse


CHUNK_KERNELS = KernelBackend(forward=chunk_forward, backward=chunk_backward)
RECURRENT_KERNELS = KernelBackend(forward=recurrent_forward, backward=recurrent_backward)
