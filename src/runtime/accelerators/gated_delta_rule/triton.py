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
in parallel ("context-parallel split"). The backward's kernels are described where they start ("chunked
backward"). Varlen chunk tables are written on the device (varlen.py).
With use_qk_l2norm_in_kernel, q and k are normalised in fp32 as they are loaded (the l2norm op's math;
normalising them first through the l2norm op would round them to the input dtype).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count, triton_interpret
from . import varlen
from ..launch_math import cdiv
from ..triton_launch import direct_launch

BT = 64  # the chunk size (reference.CHUNK_SIZE)
BT_ = tl.constexpr(BT)
SUB = tl.constexpr(16)  # (I + A) is inverted by blocks of 16 rows (see _chunk_inverse_kernel)
INVERSE_PRECISION = tl.constexpr("tf32x3")  # the dots between blocks of (I + A)^-1: fp32-accurate on tensor cores
L2NORM_EPS = tl.constexpr(1e-6)  # the l2norm op's default eps


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs need IEEE dots for the 1e-4 bound; tf32 keeps more mantissa than the half inputs have
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _half_dots(q: torch.Tensor) -> bool:
    """Whether the state walk and the output take their products on bf16 operands with fp32 accumulation, as fla
    does (_storage_dot's HALF): for half inputs, whose w, u, states and corrections are stored in bf16 anyway (see
    storage_dtype)."""
    return q.dtype != torch.float32


# The interpreter's bf16 dots are wrong (it multiplies the bits as integers): under it, _half_dot takes the same
# rounded operands in an exact fp32 dot. Its fp32 -> bf16 conversion truncates where the GPU rounds to nearest:
# _to_half rounds on the bits there (stores into bf16 tensors still truncate under the interpreter).
# Read at import, so that the sm_90 compile tier (a process without TRITON_INTERPRET) builds the GPU's path.
_EMULATE_HALF_DOTS = tl.constexpr(triton_interpret())


@triton.jit
def _to_half(x, DTYPE: tl.constexpr):
    """x in the 16-bit DTYPE, rounded to nearest (even) as the GPU converts."""
    if _EMULATE_HALF_DOTS and DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero
    else:
        return x.to(DTYPE)


@triton.jit
def _half_dot(a, b, DTYPE: tl.constexpr, acc=None):
    """a @ b (+ acc) in fp32 on operands rounded to the 16-bit DTYPE (under the interpreter: in an exact fp32 dot)."""
    if _EMULATE_HALF_DOTS:
        return tl.dot(_to_half(a, DTYPE).to(tl.float32), _to_half(b, DTYPE).to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DTYPE), b.to(DTYPE), acc)


@triton.jit
def _storage_dot(a, b, PRECISION: tl.constexpr, HALF: tl.constexpr, acc=None):
    """a @ b (+ acc) in fp32: with HALF on bf16 operands (tensor cores at twice the tf32 rate, half the registers),
    else on fp32 operands at PRECISION."""
    if HALF:
        return _half_dot(a, b, tl.bfloat16, acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


def storage_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of the per-token factors w and u and of the stored states and corrections: bf16 for half inputs
    (they are the kernels' largest traffic; the math stays fp32 but for the products of the state walk and the
    output, on bf16 operands (_half_dots), and the recurrence itself keeps fp32 in registers), fp32 for fp32 inputs
    (1e-4 bound)."""
    return torch.float32 if q.dtype == torch.float32 else torch.bfloat16


def _warps(elements: int) -> int:
    return 1 if elements <= 512 else 2 if elements <= 2048 else 4


def _sequences(v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return v.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def _final_state(output_final_state: bool, n: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    shape = (n, HV, K, V) if output_final_state else (0,)
    return buffers.empty(shape, dtype=torch.float32, device=device)


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


@triton.jit
def _bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """[bos, eos) of sequence i_n on the packed token axis (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


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


# --------------------------------------------------------------------------- chunked


@triton.jit
def _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """Global index (int64) of sequence i_n's first chunk: chunks are numbered sequence by sequence."""
    if IS_VARLEN:
        return tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        return i_n.to(tl.int64) * N_CHUNKS


@triton.jit
def _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """(the first packed row of global chunk i_t, the end of its sequence), int64."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
    else:
        i_n = i_t // N_CHUNKS
        i_c = i_t % N_CHUNKS
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    return bos + i_c.to(tl.int64) * BT_, eos


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """(the BT packed rows of global chunk i_t, which of them lie inside its sequence, its last row)."""
    start, eos = _chunk_start(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    rows = start + tl.arange(0, BT_)
    return rows, rows < eos, tl.minimum(start + BT_, eos) - 1


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
def _block_gamma(g, gamma_out, b: tl.constexpr, before, n_rows, HV: tl.constexpr):
    """gamma on block b's rows, given the sum of g over the rows before it (stored); and that sum past block b."""
    rows = b * SUB + tl.arange(0, SUB)
    b_g = _block_rows(g, b, n_rows, HV)
    gamma = before + tl.cumsum(b_g, 0)
    tl.store(gamma_out + rows * HV, gamma, mask=rows < n_rows)
    return gamma, before + tl.sum(b_g, 0)


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

    gamma0, before = _block_gamma(g, gamma_out, 0, 0.0, n_rows, HV)
    gamma1, before = _block_gamma(g, gamma_out, 1, before, n_rows, HV)
    gamma2, before = _block_gamma(g, gamma_out, 2, before, n_rows, HV)
    gamma3, _ = _block_gamma(g, gamma_out, 3, before, n_rows, HV)
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
    _chunk_inverse_kernel wrote them (l2norm: k's rows times their rsqrt factor); HALF: on bf16 operands. Also the
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


@triton.jit
def _chunk_last(gamma_in, start, bos, eos, i_hv, HV: tl.constexpr):
    """gamma on the last row of the chunk at `start` (0 for a chunk outside [bos, eos), which loads nothing): the walks
    load it a chunk ahead by hand, as Triton 3.6 does not pipeline this scalar load with the tiles."""
    inside = (start >= bos) & (start < eos)
    return tl.load(gamma_in + (tl.minimum(start + BT_, eos) - 1) * HV + i_hv, mask=inside, other=0.0)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_state_kernel(
    k, k_factor, gamma_in, w_in, u_in, h0, ht, states, corrections_out, cu_seqlens, chunk_offsets, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, STORE_STATES: tl.constexpr, TRANSITION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    # TRANSITION: walk the linear part of the chunk maps instead (V = K, no u): from the identity, the product M.
    # k's rows enter only the products, with their factors e^(gamma_last - gamma) rstd precomputed (k_factor): no
    # [BT, K] math on the sequential path, and the tiles can go from memory to the products as loaded
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    state_offsets = i_nh.to(tl.int64) * K * V + cols_k[:, None] * V + cols_v[None, :]
    if USE_INITIAL_STATE:
        state = tl.load(h0 + state_offsets).to(tl.float32)
    elif TRANSITION:
        state = tl.where(cols_k[:, None] == cols_v[None, :], 1.0, 0.0)
    else:
        state = tl.zeros([K, BV], dtype=tl.float32)
    # the state entering each chunk, at the chunk's global index (chunk_offsets[n] + c), and the corrections
    first_chunk = _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN)
    r = tl.arange(0, BT_)
    # Triton pipelines the tile loads (cp.async, num_stages - 1 chunks ahead) but not this scalar: it is loaded one
    # chunk ahead by hand, raw (e^ where it is used, after the products). Loading u and k's factors ahead by hand
    # as well kept Triton from pipelining them (sm_90 SASS)
    last = _chunk_last(gamma_in, bos, bos, eos, i_hv, HV)
    for start in range(bos, eos, BT_):
        next_last = _chunk_last(gamma_in, start + BT_, bos, eos, i_hv, HV)
        if STORE_STATES:
            chunk = first_chunk + (start - bos) // BT_
            tl.store(states + (chunk * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :], state.to(states.dtype.element_ty))
        rows = start + r
        row_mask = rows < eos
        k_rows = _walk_operand(k, rows, row_mask, i_h, H, K, HALF)
        b_w = _walk_operand(w_in, rows, row_mask, i_hv, HV, K, HALF)
        # K~^T U with K~ = diag(e^(gamma_last - gamma) rstd) K_raw: the row factors scale U's [BT, BV] rows
        to_end = tl.load(k_factor + rows * HV + i_hv, mask=row_mask, other=0.0)
        if TRANSITION:
            corrections = -tl.dot(b_w, state, input_precision=PRECISION)
            scaled = corrections * to_end[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(k_rows), scaled, input_precision=PRECISION)
        else:
            b_u = tl.load(u_in + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], mask=row_mask[:, None], other=0.0)
            corrections = b_u.to(tl.float32) - _storage_dot(b_w, state, PRECISION, HALF)
            if STORE_STATES:
                stored = corrections.to(corrections_out.dtype.element_ty)
                tl.store(corrections_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], stored, mask=row_mask[:, None])
            state = state * tl.exp(last) + _storage_dot(tl.trans(k_rows), corrections * to_end[:, None], PRECISION, HALF)
        last = next_last
    if STORE_FINAL_STATE:
        tl.store(ht + state_offsets, state)


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
    state = tl.load(states + (i_t.to(tl.int64) * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :]).to(tl.float32)
    tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
    b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    decay = tl.exp(tl.where((r[:, None] >= r[None, :]) & row_mask[:, None], gamma[:, None] - gamma[None, :], float("-inf")))
    attention = _storage_dot(b_q, tl.trans(b_k), PRECISION, HALF) * decay
    b_o = _storage_dot(b_q * tl.exp(gamma)[:, None], state, PRECISION, HALF)
    b_o += _storage_dot(attention, b_corrections, PRECISION, HALF)
    tl.store(o + tokens, (b_o * scale).to(o.dtype.element_ty), mask=row_mask[:, None])


def _state_stages(q: torch.Tensor, K: int, programs: int | None) -> int:
    """Pipeline stages of a walk's chunk loop; `programs`: the grid's size where more stages may pay (None: never)."""
    if q.dtype == torch.float32:  # fp32 at K=128 with 2 stages would need ~165 KB of shared memory
        return 1 if K == 128 else 2
    # A grid of at most one program per SM loses no occupancy to the deeper pipeline's shared memory. H100, forward
    # + backward: packed 32768 (128 programs) 11.63 -> 10.95 ms with 4 stages; B4-T4096-H16-D128 (256
    # programs, two a SM at 2 stages) 2.316 -> 2.373 with 4.
    return 4 if programs is not None and programs <= sm_count(q.device) else 2


@triton.jit
def _as_operand(x, HALF: tl.constexpr):
    """A loaded tile as a product operand of _storage_dot: as loaded with HALF (bf16 tiles go to the product
    unconverted), else in fp32."""
    if HALF:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _walk_operand(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, HALF: tl.constexpr):
    """A chunk's rows of q, k (heads H) or w (heads HV) as stored (0 past the end): a product operand of the state
    walks (_as_operand), or with HALF False in fp32 for math on them."""
    return _walk_operand_columns(x, rows, row_mask, i_h, H, K, 0, K, HALF)


@triton.jit
def _walk_operand_columns(
    x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, first: tl.constexpr, BK: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """_walk_operand's columns [first, first + BK)."""
    columns = first + tl.arange(0, BK)
    raw = tl.load(x + (rows[:, None] * H + i_h) * K + columns[None, :], mask=row_mask[:, None], other=0.0)
    return _as_operand(raw, HALF)


@triton.jit
def _load_qk(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """Rows of q or k in fp32, l2-normalised when asked with the l2norm op's math (x rsqrt(sum(x^2) + eps)),
    and the rsqrt factor of each row (1 without L2NORM)."""
    raw = _walk_operand(x, rows, row_mask, i_h, H, K, False)
    if L2NORM:
        rstd = tl.rsqrt(tl.sum(raw * raw, 1) + L2NORM_EPS)
    else:
        rstd = tl.full([BT_], 1.0, tl.float32)
    return raw * rstd[:, None], rstd


@dataclass
class Chunks:
    """How the packed token axis splits into chunks of BT (shared by the forward and backward launchers)."""

    n: int  # sequences
    per_sequence: int  # chunks per sequence (fixed length; 0 with cu_seqlens)
    total: int  # chunks over all sequences
    longest: int  # chunks of the longest sequence
    cu: torch.Tensor | None  # device cu_seqlens (int64)
    indices: torch.Tensor | None  # device [total, 2] int32: (sequence, chunk within it)
    offsets: torch.Tensor | None  # device [N] int32: global index of each sequence's first chunk

    @classmethod
    def of(cls, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> "Chunks":
        B, T = v.shape[:2]
        if cu_seqlens is None:
            per_sequence = cdiv(T, BT)
            return cls(B, per_sequence, B * per_sequence, per_sequence, None, None, None)
        cu = varlen.on_device(cu_seqlens, v.device)
        indices, offsets = varlen.chunk_table(cu, cu_seqlens, BT)
        longest = int(varlen.piece_counts(cu_seqlens, BT).max())
        return cls(cu_seqlens.numel() - 1, 0, indices.shape[0], longest, cu, indices, offsets)


@dataclass(frozen=True)
class Tuning:
    """Variants of the chunked kernels, for tests and sweeps; the defaults are what the op runs. The forward and its
    backward must take the same (the forward stores (I + A)^-1 in the dtype the backward's step 5 reads).

    grad_wy: how the backward runs its step 5 (triton_backward): "single" (_chunk_grad_wy_kernel, tf32 products) or
        "fused" (_chunk_grad_wy_fused_kernel); None: "fused" at K = 128 and "single" below, as the H100 timings chose.
    half_backward: the backward's products on bf16 operands (fp32 accumulation) for half inputs, in every kernel but
        the single step-5 kernel (on bf16 operands it faulted on the H100 at K = 16 and 32); None: where step 5 runs
        fused, where it pays (docs/tuning/gated_delta_rule.md has the timings and the errors against float64).
    segment_chunks: chunks per segment of the context-parallel split (0: never split); None: the occupancy rule
        (split_length) decides.
    """

    grad_wy: str | None = None
    half_backward: bool | None = None
    segment_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.grad_wy not in (None, "single", "fused"):
            raise ValueError(f"Tuning.grad_wy: expected None, 'single' or 'fused', got {self.grad_wy!r}")
        if self.segment_chunks is not None and (not isinstance(self.segment_chunks, int) or self.segment_chunks < 0):
            raise ValueError(f"Tuning.segment_chunks: expected None or an int >= 0, got {self.segment_chunks!r}")

    def step5(self, K: int) -> str:
        """The backward's step-5 kernel at this K: "single" or "fused"."""
        return self.grad_wy or ("fused" if K == 128 else "single")

    def half(self, q: torch.Tensor) -> bool:
        """The HALF constexpr of the backward's kernels for these inputs (half inputs only, _half_dots)."""
        on = self.step5(q.shape[-1]) == "fused" if self.half_backward is None else self.half_backward
        return on and _half_dots(q)

    def half_inverse(self, k: torch.Tensor) -> bool:
        """Whether step 5 takes T = (I + A)^-1 only in products that round it to bf16 (the fused kernel with HALF), so
        that prepare may store it in bf16 (_inverse_dtype). Both step-5 kernels take T in either dtype."""
        return self.step5(k.shape[-1]) == "fused" and self.half(k)


DEFAULT_TUNING = Tuning()


def _state_block(K: int, V: int) -> int:
    return min(V, 32 if K == 128 else 64)  # the [K, BV] state stays in registers


# The WY factors of half inputs are taken on bf16 operands (T and the scaled rows of K and V rounded to bf16, fp32
# accumulation), as fla does: faster than tf32 on an H100 at no cost in the bounds (docs/tuning/gated_delta_rule.md).


def _half_wy(k: torch.Tensor, BK: int, BV: int) -> bool:
    """HALF of the WY kernel. Only where the V blocks are at least as wide as the K blocks: Triton 3.6 on the H100
    built the bf16 products wrongly when the u product (BV columns) was narrower than the w product before it (BK
    columns, the same T operand): K = 64, V = 32 gave a wrong u, K = 128, V = 32 an illegal memory access."""
    return _half_dots(k) and BV >= BK


def _inverse_dtype(k: torch.Tensor, half_wy: bool, tuning: Tuning) -> torch.dtype:
    """The dtype prepare stores (I + A)^-1 in: bf16 where every product that takes it rounds it to bf16 first (the WY
    kernel with HALF, `half_wy`, and step 5 of the backward: Tuning.half_inverse), so that the numbers are the same
    and the traffic half; else fp32 (its tf32 and IEEE products keep more mantissa)."""
    return torch.bfloat16 if half_wy and tuning.half_inverse(k) else torch.float32


def _wy_launch(k: torch.Tensor, V: int) -> tuple[dict, int, bool]:
    """The WY kernel's launch options, its K block and HALF."""
    K = k.shape[-1]
    wide = 32 if k.dtype == torch.float32 else 64  # IEEE dots (fp32) spill at 64 columns
    # one warpgroup (wgmma dots); at K = 16 one warp (mma) was 0.6% faster (forward + backward, PCVR, H100)
    options = dict(BV=min(V, wide), num_warps=1 if K == 16 else 4)
    BK = min(K, wide)
    return options, BK, _half_wy(k, BK, options["BV"])


def saved_dtypes(k: torch.Tensor, V: int) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes prepare stores w and u, and (I + A)^-1, in (for the op's traced placeholder)."""
    return storage_dtype(k), _inverse_dtype(k, _wy_launch(k, V)[2], DEFAULT_TUNING)


def prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks: Chunks, precision: str, tuning: Tuning = DEFAULT_TUNING):
    """Per chunk: gamma [B*T, HV], w [B*T, HV, K], u [B*T, HV, V] (storage_dtype), (I + A)^-1 [B*T, HV, BT]
    (_inverse_dtype), and the walks' row factors of k, e^(gamma_last - gamma) rstd [B*T, HV] (fp32)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    device = k.device
    gamma = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    w = buffers.empty((B * T, HV, K), dtype=storage_dtype(k), device=device)
    u = buffers.empty((B * T, HV, V), dtype=storage_dtype(k), device=device)
    k_factor = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    options, BK, half_wy = _wy_launch(k, V)
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


def _walk(
    k, k_factor, gamma, w, u, chunks: Chunks, *, h0=None, ht=None, states=None, corrections=None, transition=False
):  # fmt: skip
    """One _chunk_state_kernel launch over the sequences of `chunks`: what it stores is what is given
    (states and corrections together)."""
    B, T, H, K = k.shape
    HV = gamma.shape[1]
    V = K if transition else u.shape[-1]
    options = dict(BV=_state_block(K, V), num_warps=4)
    grid = (chunks.n * HV, cdiv(V, options["BV"]))
    options.setdefault("num_stages", _state_stages(k, K, None if transition else grid[0] * grid[1]))
    _chunk_state_kernel[grid](
        k, k_factor, gamma, w, u, h0, ht, states, corrections, chunks.cu, chunks.offsets, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
        IS_VARLEN=chunks.cu is not None, PRECISION=_precision(k), STORE_STATES=states is not None,
        TRANSITION=transition, HALF=_half_dots(k) and not transition, **options,
    )  # fmt: skip


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
            HALF=_half_dots(q), **options,
        )  # fmt: skip
    return o


def _state_buffer(n: int, HV: int, K: int, V: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return buffers.empty((n, HV, K, V), dtype=dtype, device=device)


def walk_states(
    k, v, k_factor, gamma, w, u, initial_state, output_final_state, chunks: Chunks, segments: "Segments | None"
):  # fmt: skip
    """The inter-chunk recurrence, k_factor the walks' row factors of k (prepare): (final state, the state entering
    each chunk [total, HV, K, V], the corrections U = u - w S [B*T, HV, V] (both in u's dtype, storage_dtype), and
    with segments their maps M [segments, HV, K, K] for the backward, else None)."""
    K, (HV, V), device = k.shape[-1], v.shape[2:], k.device
    final = _final_state(output_final_state, chunks.n, HV, K, V, device)
    states = _state_buffer(chunks.total, HV, K, V, device, u.dtype)
    corrections = buffers.empty(u.shape, dtype=u.dtype, device=device)
    walk = functools.partial(_walk, k, k_factor, gamma, w, u)
    if segments is None:
        walk(chunks, h0=initial_state, ht=final if output_final_state else None, states=states, corrections=corrections)
        return final, states, corrections, None
    # each segment maps the state entering it to S -> M S + b: M and b (from a zero state) in parallel,
    # then the states entering the segments in order (cheap), then the segments again from those
    parts = segments.chunks
    maps, offsets = _state_buffer(parts.n, HV, K, K, device), _state_buffer(parts.n, HV, K, V, device)
    walk(parts, ht=maps, transition=True)
    walk(parts, ht=offsets)
    entering = _state_buffer(parts.n, HV, K, V, device)
    _combine(segments, maps, offsets, initial_state, entering, final if output_final_state else None, _precision(k))
    walk(parts, h0=entering, states=states, corrections=corrections)
    return final, states, corrections, maps


def chunk_forward(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, *,
    tuning: Tuning = DEFAULT_TUNING,
):  # fmt: skip
    """(o, final state, and for backward: gamma, w, u, (I + A)^-1, as prepare stores them); tuning: the kernels'
    variants (pass the backward the same)."""
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    chunks = Chunks.of(v, cu_seqlens)
    gamma, w, u, inverse, k_factor = prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks, _precision(q), tuning)
    segments = Segments.of(chunks, q, v, cu_seqlens, tuning.segment_chunks)
    final, states, corrections, _ = walk_states(
        k, v, k_factor, gamma, w, u, initial_state, output_final_state, chunks, segments
    )
    o = _output(q, k, gamma, states, corrections, scale, use_qk_l2norm_in_kernel, chunks, v.shape)
    return o, final, gamma, w, u, inverse


# --------------------------------------------------------------------------- context-parallel split
# The walks above run one program per (sequence, value head, V block) through all of a sequence's chunks.
# When those programs are too few to fill the GPU (few long sequences, few heads), every sequence is cut
# into segments of the same number of chunks (the last may be shorter; a shorter sequence is one segment).
# Per chunk the state map is affine, S' = M S + b with M = e^gamma_last I - K~^T w and b = K~^T u
# (K~ = K e^(gamma_last - gamma)), and so is a segment's: its M (the walk of the linear part from the
# identity) and b (the walk from a zero state) are computed for all segments in parallel, one short
# walk per sequence (_segment_combine_kernel) chains them into the state entering each segment, and the
# segments are walked again in parallel from those states. Segments are handed to the walking kernels as
# sequences of their own (their boundaries as cu_seqlens, their first global chunk as chunk offsets).
# The backward's reverse walk is affine in dS' with M^T: the same three steps, the chain run backwards.

SPLIT_PROGRAMS_PER_SM = 2  # split to reach about this many walking programs per SM
MIN_SEGMENTS = 4  # the split walks each segment about three times: it pays from about four segments per sequence
MIN_SEGMENT_CHUNKS = 4


def _segment_chunks(chunks: Chunks, HV: int, K: int, V: int, device: torch.device, forced: int | None) -> int:
    """Chunks per segment of the split, or 0 to walk every sequence whole; `forced` (Tuning.segment_chunks) where
    given."""
    if forced is not None:
        return forced
    if device.type != "cuda" or chunks.total == 0:
        return 0
    programs = chunks.n * HV * cdiv(V, _state_block(K, V))
    return split_length(chunks, programs, sm_count(device))


def split_length(chunks: Chunks, programs: int, sms: int) -> int:
    """The occupancy rule: chunks per segment when `programs` walking programs leave most of `sms` SMs idle, else 0.

    Split when the segments per sequence that would give SPLIT_PROGRAMS_PER_SM programs per SM are at least
    MIN_SEGMENTS (on an H100's 132 SMs: at most 66 programs), into segments of at least MIN_SEGMENT_CHUNKS,
    and only when the longest sequence is longer than one segment. Every sequence is cut with the same length.
    """
    segments = SPLIT_PROGRAMS_PER_SM * sms // max(programs, 1)
    if segments < MIN_SEGMENTS:
        return 0
    # the chain walks a sequence's segments one by one, each step about a quarter of a chunk's:
    # segments of ~sqrt(chunks) / 2 balance it against the segment walks
    length = max(MIN_SEGMENT_CHUNKS, math.isqrt(chunks.longest) // 2, cdiv(chunks.total, chunks.n * segments))
    return length if length < chunks.longest else 0


@dataclass
class Segments:
    """The split: `chunks` describes the segments as sequences of their own (for the walking kernels)."""

    chunks: Chunks
    tokens: int  # per segment (a multiple of BT)
    cu: torch.Tensor  # device [N + 1] int64: the sequences' boundaries (fixed length: every T tokens)
    first: torch.Tensor  # device [N] int32: each sequence's first segment

    @classmethod
    def of(
        cls, chunks: Chunks, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, forced: int | None = None
    ) -> "Segments | None":
        """The split the occupancy asks for, or `forced` chunks per segment (None: none); cu_seqlens on the host, as
        the launchers get it."""
        length = _segment_chunks(chunks, v.shape[2], q.shape[-1], v.shape[-1], v.device, forced)
        if length == 0 or chunks.total == 0:
            return None
        B, T = v.shape[:2]
        cu_host = torch.arange(0, B * T + 1, T) if cu_seqlens is None else cu_seqlens
        cu = torch.arange(0, B * T + 1, T, device=v.device) if chunks.cu is None else chunks.cu
        tokens = length * BT
        bounds, first_chunks, first = varlen.piece_bounds(cu, cu_host, tokens, BT)
        parts = Chunks(bounds.numel() - 1, 0, chunks.total, length, bounds, None, first_chunks)
        return cls(parts, tokens, cu, first)


@direct_launch
@triton.jit(do_not_specialize=["SEGMENT"])
def _segment_combine_kernel(
    maps, offsets, start, through, end, cu_seqlens, first_segment, SEGMENT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_START: tl.constexpr, STORE_END: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Chains the segments of a sequence: x -> M x + b through them in order (REVERSE: x -> M^T x + b from the
    last one), storing the x each segment is entered with, then the x at the end."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    n_segments = (eos - bos + SEGMENT - 1) // SEGMENT
    first = tl.load(first_segment + i_n).to(tl.int64)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    block = cols_k[:, None] * V + cols_v[None, :]
    if REVERSE:
        map_block = cols_k[None, :] * K + cols_k[:, None]  # M^T
    else:
        map_block = cols_k[:, None] * K + cols_k[None, :]
    if USE_START:
        x = tl.load(start + i_nh.to(tl.int64) * K * V + block).to(tl.float32)
    else:
        x = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(0, n_segments):
        if REVERSE:
            segment = first + n_segments - 1 - i
        else:
            segment = first + i
        base = segment * HV + i_hv
        tl.store(through + base * K * V + block, x)
        m = tl.load(maps + base * K * K + map_block)
        x = tl.dot(m, x, input_precision=PRECISION) + tl.load(offsets + base * K * V + block)
    if STORE_END:
        tl.store(end + i_nh.to(tl.int64) * K * V + block, x)


def _combine(segments: Segments, maps, offsets, start, through, end, precision: str, reverse: bool = False):
    """Launches _segment_combine_kernel: `start`/`end` per sequence [N, HV, K, V] or None, the rest per segment."""
    HV, K, V = offsets.shape[1:]
    BV = _state_block(K, V)
    _segment_combine_kernel[(segments.first.numel() * HV, cdiv(V, BV))](
        maps, offsets, start, through, end, segments.cu, segments.first, segments.tokens,
        HV=HV, K=K, V=V, BV=BV, USE_START=start is not None, STORE_END=end is not None, REVERSE=reverse,
        PRECISION=precision, num_warps=4, num_stages=2,  # K=128 with 3 stages needs ~224 KB of shared memory
    )  # fmt: skip


def chunk_backward(*args, tuning: Tuning = DEFAULT_TUNING):
    """The chunked backward: triton_backward.chunk_backward (a module of its own, built on the helpers here)."""
    from .triton_backward import chunk_backward as backward

    return backward(*args, tuning=tuning)
