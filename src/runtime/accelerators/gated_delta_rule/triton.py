"""Gated delta rule in Triton: the fused recurrent kernel (forward) and the chunked kernels (forward and backward).

All state math is fp32. Tokens are addressed as rows of the packed [B*T] axis: a sequence is
[bos, eos) (fixed length: bos = n*T; varlen: cu_seqlens[n], cu_seqlens[n+1]). Value head hv reads
q/k head hv // (HV // H).

Recurrent: one program per (sequence, value head, V block) holds its [K, BV] slice of the state
in registers and walks the steps (l2norm of q/k fused).

Chunked (chunks of BT = 64 steps, see reference.py for the math), three kernels:
  1. _chunk_prepare_kernel, one program per (chunk, value head): the local cumulative decay gamma,
     A = beta exp(gamma_t - gamma_j) k_t.k_j (strictly lower), (I + A)^-1 (blockwise, _unit_lower_inverse),
     and the WY factors w = (I + A)^-1 diag(beta exp(gamma)) K, u = (I + A)^-1 diag(beta) V (fp32;
     gamma, w, u and (I + A)^-1 are kept for the backward).
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

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl

from .. import buffers
from . import varlen
from ..launch_math import cdiv

BT = 64  # the chunk size (reference.CHUNK_SIZE)
BT_ = tl.constexpr(BT)
INVERSE_BLOCK = tl.constexpr(16)  # diagonal blocks of (I + A)^-1 solved by substitution (see _unit_lower_inverse)
L2NORM_EPS = tl.constexpr(1e-6)  # the l2norm op's default eps


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs need IEEE dots for the 1e-4 bound; tf32 keeps more mantissa than the half inputs have
    return "ieee" if q.dtype == torch.float32 else "tf32"


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
    cu = None if cu_seqlens is None else cu_seqlens.to(q.device, non_blocking=True)
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
def _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN: tl.constexpr):
    """(the BT packed rows of global chunk i_t, which of them lie inside its sequence, its last row)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_t)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
    else:
        i_n = i_t // N_CHUNKS
        i_c = i_t % N_CHUNKS
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    start = bos + i_c.to(tl.int64) * BT_
    rows = start + tl.arange(0, BT_)
    return rows, rows < eos, tl.minimum(start + BT_, eos) - 1


@triton.jit
def _unit_lower_inverse(a):
    """(I + A)^-1 of a strictly lower triangular [BT, BT] A, in fp32 (dots in tf32x3: fp32-accurate on tensor cores).

    The 16 x 16 diagonal blocks first, by forward substitution on the i-th row of every block at once
    (row r = e_r - sum_{j < r} A[r, j] row j: 15 dots), giving D = (I + A_diag)^-1. Then I + A =
    (I + A_diag)(I + N) with N = D A_below (A below the diagonal blocks): N is strictly block-lower with
    four blocks, so N^4 = 0 and (I + A)^-1 = (I - N)(I + N^2) D.
    """
    r = tl.arange(0, BT_)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    same_block = (r[:, None] // INVERSE_BLOCK) == (r[None, :] // INVERSE_BLOCK)
    a_diagonal = tl.where(same_block, a, 0.0)
    d = eye
    for i in range(1, INVERSE_BLOCK):
        rows = (r % INVERSE_BLOCK) == i
        substituted = eye - tl.dot(tl.where(rows[:, None], a_diagonal, 0.0), d, input_precision="tf32x3")
        d = tl.where(rows[:, None], substituted, d)
    n = tl.dot(d, tl.where(same_block, 0.0, a), input_precision="tf32x3")
    n2 = tl.dot(n, n, input_precision="tf32x3")
    return tl.dot(eye - n + n2 - tl.dot(n, n2, input_precision="tf32x3"), d, input_precision="tf32x3")


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_prepare_kernel(
    k, v, g, beta, gamma_out, w_out, u_out, inverse_out, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    rows, row_mask, _ = _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    cols_k, cols_v = tl.arange(0, K), tl.arange(0, V)
    b_g = tl.load(g + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    gamma = tl.cumsum(b_g, 0)
    tl.store(gamma_out + rows * HV + i_hv, gamma, mask=row_mask)
    b_k, _ = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    b_v = tl.load(v + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)

    r = tl.arange(0, BT_)
    strictly_lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(strictly_lower, gamma[:, None] - gamma[None, :], 0.0))
    kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
    a = tl.where(strictly_lower, b_beta[:, None] * decay * kk, 0.0)
    inverse = _unit_lower_inverse(a)
    w = tl.dot(inverse, b_k * (b_beta * tl.exp(gamma))[:, None], input_precision=PRECISION)
    u = tl.dot(inverse, b_v * b_beta[:, None], input_precision=PRECISION)
    tl.store(w_out + (rows[:, None] * HV + i_hv) * K + cols_k[None, :], w, mask=row_mask[:, None])
    tl.store(u_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], u, mask=row_mask[:, None])
    tl.store(inverse_out + (rows[:, None] * HV + i_hv) * BT_ + r[None, :], inverse, mask=row_mask[:, None])


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_state_kernel(
    k, gamma_in, w_in, u_in, h0, ht, states, corrections_out, cu_seqlens, chunk_offsets, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, STORE_STATES: tl.constexpr, TRANSITION: tl.constexpr,
):  # fmt: skip
    # TRANSITION: walk the linear part of the chunk maps instead (V = K, no u): from the identity, the product M
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
    for start in range(bos, eos, BT_):
        if STORE_STATES:
            chunk = first_chunk + (start - bos) // BT_
            tl.store(states + (chunk * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :], state)
        rows = start + r
        row_mask = rows < eos
        gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
        last = tl.load(gamma_in + (tl.minimum(start + BT_, eos) - 1) * HV + i_hv)
        b_k, _ = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
        b_w = tl.load(w_in + (rows[:, None] * HV + i_hv) * K + cols_k[None, :], mask=row_mask[:, None], other=0.0)
        if TRANSITION:
            corrections = -tl.dot(b_w, state, input_precision=PRECISION)
        else:
            b_u = tl.load(u_in + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], mask=row_mask[:, None], other=0.0)
            corrections = b_u - tl.dot(b_w, state, input_precision=PRECISION)
            if STORE_STATES:
                tl.store(corrections_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], corrections, mask=row_mask[:, None])
        k_to_end = b_k * tl.where(row_mask, tl.exp(last - gamma), 0.0)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(k_to_end), corrections, input_precision=PRECISION)
    if STORE_FINAL_STATE:
        tl.store(ht + state_offsets, state)


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_output_kernel(
    q, k, gamma_in, states, corrections, o, cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
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
    state = tl.load(states + (i_t.to(tl.int64) * HV + i_hv) * K * V + cols_k[:, None] * V + cols_v[None, :])
    tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
    b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0)
    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    decay = tl.exp(tl.where((r[:, None] >= r[None, :]) & row_mask[:, None], gamma[:, None] - gamma[None, :], float("-inf")))
    attention = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay
    b_o = tl.dot(b_q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
    b_o += tl.dot(attention, b_corrections, input_precision=PRECISION)
    tl.store(o + tokens, (b_o * scale).to(o.dtype.element_ty), mask=row_mask[:, None])


def _state_stages(q: torch.Tensor, K: int) -> int:
    # the chunk loop's loads are pipelined; fp32 at K=128 with 2 stages would need ~165 KB of shared memory
    return 1 if q.dtype == torch.float32 and K == 128 else 2


@triton.jit
def _load_qk(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """Rows of q or k in fp32, l2-normalised when asked with the l2norm op's math (x rsqrt(sum(x^2) + eps)),
    and the rsqrt factor of each row (1 without L2NORM)."""
    cols = tl.arange(0, K)
    raw = tl.load(x + (rows[:, None] * H + i_h) * K + cols[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
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
        cu = cu_seqlens.to(v.device, non_blocking=True)
        indices, offsets = varlen.chunk_table(cu, cu_seqlens, BT)
        longest = int(varlen.piece_counts(cu_seqlens, BT).max())
        return cls(cu_seqlens.numel() - 1, 0, indices.shape[0], longest, cu, indices, offsets)


def _state_block(K: int, V: int) -> int:
    return min(V, 32 if K == 128 else 64)  # the [K, BV] state stays in registers


def prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks: Chunks, precision: str):
    """Per chunk: gamma [B*T, HV], w [B*T, HV, K], u [B*T, HV, V], (I + A)^-1 [B*T, HV, BT] (fp32)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    device = k.device
    gamma = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    w = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    u = buffers.empty((B * T, HV, V), dtype=torch.float32, device=device)
    inverse = buffers.empty((B * T, HV, BT), dtype=torch.float32, device=device)
    if chunks.total > 0:
        _chunk_prepare_kernel[(chunks.total, HV)](
            k, v, g, beta, gamma, w, u, inverse, chunks.cu, chunks.indices, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=chunks.cu is not None, PRECISION=precision,
            num_warps=4,
        )  # fmt: skip
    return gamma, w, u, inverse


def _walk(k, gamma, w, u, l2norm, chunks: Chunks, *, h0=None, ht=None, states=None, corrections=None, transition=False):
    """One _chunk_state_kernel launch over the sequences of `chunks`: what it stores is what is given
    (states and corrections together)."""
    B, T, H, K = k.shape
    HV = gamma.shape[1]
    V = K if transition else u.shape[-1]
    BV = _state_block(K, V)
    _chunk_state_kernel[(chunks.n * HV, cdiv(V, BV))](
        k, gamma, w, u, h0, ht, states, corrections, chunks.cu, chunks.offsets, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
        L2NORM=l2norm, IS_VARLEN=chunks.cu is not None, PRECISION=_precision(k), STORE_STATES=states is not None,
        TRANSITION=transition, num_warps=4, num_stages=_state_stages(k, K),
    )  # fmt: skip


def _output(q, k, gamma, states, corrections, scale, l2norm, chunks: Chunks, v_shape) -> torch.Tensor:
    """The outputs of every chunk in parallel (one program per chunk, value head and V block)."""
    B, T, H, K = q.shape
    HV, V = v_shape[2], v_shape[3]
    o = buffers.empty(v_shape, dtype=q.dtype, device=q.device)
    BV = min(V, 64)
    if chunks.total > 0:
        _chunk_output_kernel[(chunks.total, HV, cdiv(V, BV))](
            q, k, gamma, states, corrections, o, chunks.cu, chunks.indices, scale, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, BV=BV, L2NORM=l2norm, IS_VARLEN=chunks.cu is not None, PRECISION=_precision(q),
            num_warps=4,
        )  # fmt: skip
    return o


def _state_buffer(n: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    return buffers.empty((n, HV, K, V), dtype=torch.float32, device=device)


def walk_states(k, v, gamma, w, u, initial_state, output_final_state, l2norm, chunks: Chunks, segments: "Segments | None"):
    """The inter-chunk recurrence: (final state, the state entering each chunk [total, HV, K, V], the corrections
    U = u - w S [B*T, HV, V] (fp32), and with segments their maps M [segments, HV, K, K] for the backward, else None)."""
    K, (HV, V), device = k.shape[-1], v.shape[2:], k.device
    final = _final_state(output_final_state, chunks.n, HV, K, V, device)
    states = _state_buffer(chunks.total, HV, K, V, device)
    corrections = buffers.empty(u.shape, dtype=torch.float32, device=device)
    walk = functools.partial(_walk, k, gamma, w, u, l2norm)
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


def chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    """(o, final state, and for backward: gamma, w, u, (I + A)^-1, all fp32)."""
    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)
    chunks = Chunks.of(v, cu_seqlens)
    gamma, w, u, inverse = prepare(k, v, g, beta, use_qk_l2norm_in_kernel, chunks, _precision(q))
    segments = Segments.of(chunks, q, v, cu_seqlens)
    final, states, corrections, _ = walk_states(
        k, v, gamma, w, u, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunks, segments
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
_forced_segment_chunks: int | None = None


@contextlib.contextmanager
def split_sequences(segment_chunks: int) -> Iterator[None]:
    """Within the block the chunked launchers cut every sequence into segments of `segment_chunks` chunks
    (0: never split) whatever the occupancy; for tests and benchmarks, where the rule would not split."""
    global _forced_segment_chunks
    previous, _forced_segment_chunks = _forced_segment_chunks, segment_chunks
    try:
        yield
    finally:
        _forced_segment_chunks = previous


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _segment_chunks(chunks: Chunks, HV: int, K: int, V: int, device: torch.device) -> int:
    """Chunks per segment of the split, or 0 to walk every sequence whole."""
    if _forced_segment_chunks is not None:
        return _forced_segment_chunks
    if device.type != "cuda" or chunks.total == 0:
        return 0
    programs = chunks.n * HV * cdiv(V, _state_block(K, V))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return split_length(chunks, programs, _sm_count(index))


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
    def of(cls, chunks: Chunks, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> "Segments | None":
        """The split the occupancy asks for (None: none); cu_seqlens on the host, as the launchers get it."""
        length = _segment_chunks(chunks, v.shape[2], q.shape[-1], v.shape[-1], v.device)
        if length == 0 or chunks.total == 0:
            return None
        B, T = v.shape[:2]
        cu_host = torch.arange(0, B * T + 1, T) if cu_seqlens is None else cu_seqlens
        cu = torch.arange(0, B * T + 1, T, device=v.device) if chunks.cu is None else chunks.cu
        tokens = length * BT
        bounds, first_chunks, first = varlen.piece_bounds(cu, cu_host, tokens, BT)
        parts = Chunks(bounds.numel() - 1, 0, chunks.total, length, bounds, None, first_chunks)
        return cls(parts, tokens, cu, first)


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


# --------------------------------------------------------------------------- chunked backward
# The chunked backward (fp32 accumulation throughout).
#
# Per chunk (see reference.py), with S the state entering it, S' the state leaving it, P the causal
# attention (Q K^T * exp(gamma_t - gamma_j))_{j <= t}, T = (I + A)^-1 and the corrections U = u - w S:
#
#     O  = scale (diag(e^gamma) Q S + P U)        S' = e^gamma_last S + (K * e^(gamma_last - gamma))^T U
#
# Backward, given dO and dS' (the gradient of the final state for the last chunk):
#   0. the forward's states S and corrections U per chunk are recomputed (walk_states);
#   1. _state_grad_kernel, one program per (sequence, value head, V block), walks the chunks backwards:
#         dU = scale P^T dO + (K * e^(gamma_last - gamma)) dS'
#         dS = e^gamma_last dS' + scale (Q e^gamma)^T dO - w^T dU
#      storing dS' per chunk and dU, and dS of the first chunk as d(initial_state);
#   2. _chunk_grad_state_kernel, one program per (chunk, value head, K block): the products with the states,
#      dO S^T, U dS'^T, dw = -dU S^T (written where dq, dk and dw go) and <S, dS'> (for d gamma_last);
#   3. _chunk_grad_kernel, one program per (chunk, value head): dq, dk, dv, dbeta and dgamma from
#      O, S' and U (du = dU), then the WY factors w = T diag(beta e^gamma) K,
#      u = T diag(beta) V through T (dA = -T^T dT T^T on the strictly lower part), the reverse
#      cumulative sum dgamma -> dg within the chunk, and the l2norm backward of q and k.
# dq/dk are written per value head and summed over the value heads of each q/k head (GVA) in torch.
# Steps 2 and 3 were one kernel: carrying every accumulator through one V loop spilled 5 KB per thread at K = 128.
#
# No tl.dot here takes tl.trans(X) of an X computed in registers from another tl.dot: Triton 3.4 to 3.7.0
# miscompiles that on Hopper (the wgmma operand of a transposed MMA-layout tensor gives wrong numbers:
# flash-linear-attention issues #640/#984), and the GPU machine has Triton 3.6. The transposed matrices
# are computed directly from their factors instead, transposes only of tiles loaded from memory:
#   P^T = (K Q^T) * decay^T;  dP^T from U dO^T, accumulated next to dO U^T = dO u^T - (dO S^T) w^T;
#   dA^T = -(T dT^T T) with T dT^T = u dU^T + w dw^T = U dU^T (u = T diag(beta) V, w = T diag(beta e^gamma) K).


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _state_grad_kernel(
    q, k, gamma_in, w_in, do, du_out, dstates, dht, dh0, cu_seqlens, chunk_offsets, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_GRAD: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, STORE_GRADS: tl.constexpr,
):  # fmt: skip
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    first_chunk = _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN)
    cols_k = tl.arange(0, K)
    cols_v = i_v * BV + tl.arange(0, BV)
    block = cols_k[:, None] * V + cols_v[None, :]
    if USE_FINAL_GRAD:
        dstate = tl.load(dht + i_nh.to(tl.int64) * K * V + block).to(tl.float32)
    else:
        dstate = tl.zeros([K, BV], dtype=tl.float32)
    r = tl.arange(0, BT_)
    causal_t = r[:, None] <= r[None, :]  # P^T: key j (row) <= query t (column)
    n_chunks = (eos - bos + BT_ - 1) // BT_
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        if STORE_GRADS:  # dS' of chunk c: the gradient of the state leaving it
            tl.store(dstates + ((first_chunk + c) * HV + i_hv) * K * V + block, dstate)
        start = bos + c * BT_
        rows = start + r
        row_mask = rows < eos
        gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
        last = tl.load(gamma_in + (tl.minimum(start + BT_, eos) - 1) * HV + i_hv)
        b_q, _ = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
        b_k, _ = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
        b_w = tl.load(w_in + (rows[:, None] * HV + i_hv) * K + cols_k[None, :], mask=row_mask[:, None], other=0.0)
        b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
        # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
        decay_t = tl.exp(tl.where(causal_t & row_mask[None, :], gamma[None, :] - gamma[:, None], float("-inf")))
        attention_t = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION) * decay_t  # P^T (see above)
        k_to_end = b_k * tl.where(row_mask, tl.exp(last - gamma), 0.0)[:, None]
        b_du = tl.dot(attention_t, b_do, input_precision=PRECISION) * scale
        b_du += tl.dot(k_to_end, dstate, input_precision=PRECISION)
        if STORE_GRADS:
            tl.store(du_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], b_du, mask=row_mask[:, None])
        q_decayed = b_q * (tl.exp(gamma) * scale)[:, None]
        dstate = dstate * tl.exp(last) + tl.dot(tl.trans(q_decayed), b_do, input_precision=PRECISION)
        dstate -= tl.dot(tl.trans(b_w), b_du, input_precision=PRECISION)
    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + block, dstate)


def _state_grad(q, k, gamma, w, grad_o, scale, l2norm, chunks: Chunks, *, dht=None, du=None, dstates=None, dh0=None):
    """One _state_grad_kernel launch over the sequences of `chunks` (du and dstates are stored together or not)."""
    B, T, H, K = q.shape
    HV, V = grad_o.shape[2:]
    BV = _state_block(K, V)
    _state_grad_kernel[(chunks.n * HV, cdiv(V, BV))](
        q, k, gamma, w, grad_o, du, dstates, dht, dh0, chunks.cu, chunks.offsets, scale, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_INITIAL_STATE=dh0 is not None, USE_FINAL_GRAD=dht is not None,
        L2NORM=l2norm, IS_VARLEN=chunks.cu is not None, PRECISION=_precision(q), STORE_GRADS=du is not None,
        num_warps=4, num_stages=2 if K == 128 else 3,  # K=128 with 3 stages needs ~258 KB of shared memory (sm_90 has 227)
    )  # fmt: skip


@triton.jit
def _dot_qk(a, b, input_dtype: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr):
    """a b^T of two [BT, K] q/k tiles. For half inputs with 16-bit operands, which hold tf32's 10-bit mantissa:
    the loaded values exactly in their own dtype, l2-normalised ones (|x| <= 1) in fp16. Kept in fp32, these
    operands made Triton 3.6 ask for more shared memory than sm_90 has at K = 128 (264 KB at BV = 16)."""
    if PRECISION == "ieee":
        return tl.dot(a, tl.trans(b), input_precision=PRECISION)
    dtype: tl.constexpr = tl.float16 if L2NORM else input_dtype
    return tl.dot(a.to(dtype), tl.trans(b.to(dtype)))


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_state_kernel(
    states, dstates, do, du, corrections, dq_state_out, dk_state_out, dw_out, d_last_out,
    cu_seqlens, chunk_indices, T, N_CHUNKS,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_t, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, row_mask, _ = _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    cols_k = i_k * BK + tl.arange(0, BK)
    state_base = (i_t.to(tl.int64) * HV + i_hv) * K * V
    dq_state = tl.zeros([BT_, BK], dtype=tl.float32)  # dO S^T
    dk_state = tl.zeros([BT_, BK], dtype=tl.float32)  # U dS'^T
    dw = tl.zeros([BT_, BK], dtype=tl.float32)  # -dU S^T
    d_last = tl.zeros([BK], dtype=tl.float32)  # <S, dS'> per K row
    for i_v in range(0, V, BV):
        cols_v = i_v + tl.arange(0, BV)
        block = cols_k[:, None] * V + cols_v[None, :]
        tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_s = tl.load(states + state_base + block)
        b_ds = tl.load(dstates + state_base + block)
        b_do = tl.load(do + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_du = tl.load(du + tokens, mask=row_mask[:, None], other=0.0)
        b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0)
        dq_state += tl.dot(b_do, tl.trans(b_s), input_precision=PRECISION)
        dk_state += tl.dot(b_corrections, tl.trans(b_ds), input_precision=PRECISION)
        dw -= tl.dot(b_du, tl.trans(b_s), input_precision=PRECISION)
        d_last += tl.sum(b_s * b_ds, 1)
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]
    tl.store(dq_state_out + heads, dq_state, mask=row_mask[:, None])
    tl.store(dk_state_out + heads, dk_state, mask=row_mask[:, None])
    tl.store(dw_out + heads, dw, mask=row_mask[:, None])
    tl.store(d_last_out + (i_t * HV + i_hv) * (K // BK) + i_k, tl.sum(d_last, 0))  # read as K_BLOCKS per (chunk, head)


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_kernel(
    q, k, v, beta, gamma_in, w_in, u_in, inverse_in, corrections, d_last_in, dw_in, do, du,
    dq, dk, dv_out, dbeta_out, dg_out, cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, K_BLOCKS: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # dq and dk hold dO S^T and U dS'^T (from _chunk_grad_state_kernel) on entry, the gradients on exit
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    rows, row_mask, last_row = _chunk_rows(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    r = tl.arange(0, BT_)
    cols_k = tl.arange(0, K)
    causal = r[:, None] >= r[None, :]
    strictly_lower = r[:, None] > r[None, :]
    causal_t, strictly_upper = r[:, None] <= r[None, :], r[:, None] < r[None, :]

    gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
    last = tl.load(gamma_in + last_row * HV + i_hv)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    inverse = tl.load(inverse_in + (rows[:, None] * HV + i_hv) * BT_ + r[None, :], mask=row_mask[:, None], other=0.0)

    # over V blocks: the [BT, BT] products with dO, dU, u, U and v
    do_u = tl.zeros([BT_, BT_], dtype=tl.float32)  # dO u^T here; dO U^T = dO u^T - (dO S^T) w^T after the loop
    u_do = tl.zeros([BT_, BT_], dtype=tl.float32)  # U dO^T
    u_du = tl.zeros([BT_, BT_], dtype=tl.float32)  # U dU^T = T dT^T
    d_inverse = tl.zeros([BT_, BT_], dtype=tl.float32)  # dT (u's part: dU (beta V)^T)
    dbeta = tl.zeros([BT_], dtype=tl.float32)
    for i_v in range(0, V, BV):
        cols_v = i_v + tl.arange(0, BV)
        tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_do = tl.load(do + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_du = tl.load(du + tokens, mask=row_mask[:, None], other=0.0)
        b_u = tl.load(u_in + tokens, mask=row_mask[:, None], other=0.0)
        b_v = tl.load(v + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0)
        do_u += tl.dot(b_do, tl.trans(b_u), input_precision=PRECISION)
        u_do += tl.dot(b_corrections, tl.trans(b_do), input_precision=PRECISION)
        u_du += tl.dot(b_corrections, tl.trans(b_du), input_precision=PRECISION)
        # u = T diag(beta) V
        dv_beta = tl.dot(tl.trans(inverse), b_du, input_precision=PRECISION)
        tl.store(dv_out + tokens, (dv_beta * b_beta[:, None]).to(dv_out.dtype.element_ty), mask=row_mask[:, None])
        dbeta += tl.sum(dv_beta * b_v, 1)
        d_inverse += tl.dot(b_du, tl.trans(b_v * b_beta[:, None]), input_precision=PRECISION)
    d_last = tl.load(d_last_in + (i_t * HV + i_hv) * K_BLOCKS + tl.arange(0, K_BLOCKS))
    d_gamma_last = tl.sum(d_last, 0) * tl.exp(last)

    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    decay = tl.exp(tl.where(causal & row_mask[:, None], gamma[:, None] - gamma[None, :], float("-inf")))
    decay_t = tl.exp(tl.where(causal_t & row_mask[None, :], gamma[None, :] - gamma[:, None], float("-inf")))
    e_gamma = tl.exp(gamma)
    to_end = tl.where(row_mask, tl.exp(last - gamma), 0.0)
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]
    # the [BT, K] tiles are loaded where first needed and finished as early as possible (register pressure)

    # O: dq, and dP / dP^T (with dO U^T = dO u^T - (dO S^T) w^T)
    dq_state = tl.load(dq + heads, mask=row_mask[:, None], other=0.0)
    do_u -= tl.dot(dq_state, tl.trans(tl.load(w_in + heads, mask=row_mask[:, None], other=0.0)), input_precision=PRECISION)
    dp = tl.where(causal, do_u * decay, 0.0) * scale  # d(Q K^T) of the causal attention, decay included
    dp_t = tl.where(causal_t, u_do * decay_t, 0.0) * scale  # its transpose, directly (see above)
    b_q, q_rstd = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
    b_k, k_rstd = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    m = dp * _dot_qk(b_q, b_k, q.dtype.element_ty, L2NORM, PRECISION)
    d_gamma = scale * e_gamma * tl.sum(b_q * dq_state, 1) + tl.sum(m, 1) - tl.sum(m, 0)
    dq_new = dq_state * (e_gamma * scale)[:, None] + tl.dot(dp, b_k, input_precision=PRECISION)
    if L2NORM:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
        dq_new = (dq_new - b_q * tl.sum(dq_new * b_q, 1)[:, None]) * q_rstd[:, None]
    tl.store(dq + heads, dq_new, mask=row_mask[:, None])
    dk_new = tl.dot(dp_t, b_q, input_precision=PRECISION)

    # S'
    dk_state = tl.load(dk + heads, mask=row_mask[:, None], other=0.0)
    dk_new += dk_state * to_end[:, None]
    k_to_end_term = to_end * tl.sum(b_k * dk_state, 1)
    d_gamma -= k_to_end_term
    d_gamma_last += tl.sum(k_to_end_term, 0)

    # w = T diag(beta e^gamma) K
    dw = tl.load(dw_in + heads, mask=row_mask[:, None], other=0.0)
    k_weight = b_beta * e_gamma
    dk_weighted = tl.dot(tl.trans(inverse), dw, input_precision=PRECISION)
    d_inverse += tl.dot(dw, tl.trans(b_k * k_weight[:, None]), input_precision=PRECISION)
    dk_new += dk_weighted * k_weight[:, None]
    kdk = e_gamma * tl.sum(dk_weighted * b_k, 1)
    dbeta += kdk
    d_gamma += b_beta * kdk

    # T = (I + A)^-1, A = beta_t e^(gamma_t - gamma_j) k_t.k_j strictly lower
    da = tl.dot(tl.dot(tl.trans(inverse), d_inverse, input_precision=PRECISION), tl.trans(inverse), input_precision=PRECISION)
    da = tl.where(strictly_lower, -da, 0.0)
    da_t = tl.where(strictly_upper, -tl.dot(u_du, inverse, input_precision=PRECISION), 0.0)  # dA^T = -T dT^T T
    kk = _dot_qk(b_k, b_k, q.dtype.element_ty, L2NORM, PRECISION)
    da_decay = da * decay  # zero on and above the diagonal
    dbeta += tl.sum(da_decay * kk, 1)
    da_a = da_decay * kk * b_beta[:, None]
    d_gamma += tl.sum(da_a, 1) - tl.sum(da_a, 0)
    dkk = da_decay * b_beta[:, None]
    dkk_t = da_t * decay_t * b_beta[None, :]
    dk_new += tl.dot(dkk, b_k, input_precision=PRECISION) + tl.dot(dkk_t, b_k, input_precision=PRECISION)
    if L2NORM:
        dk_new = (dk_new - b_k * tl.sum(dk_new * b_k, 1)[:, None]) * k_rstd[:, None]
    tl.store(dk + heads, dk_new, mask=row_mask[:, None])

    # gamma = cumsum(g) within the chunk: dg_s = sum_{t >= s} dgamma_t
    d_gamma += tl.where(rows == last_row, d_gamma_last, 0.0)
    d_gamma = tl.where(row_mask, d_gamma, 0.0)
    dg = tl.sum(d_gamma, 0) - tl.cumsum(d_gamma, 0) + d_gamma
    tl.store(dbeta_out + rows * HV + i_hv, dbeta, mask=row_mask)
    tl.store(dg_out + rows * HV + i_hv, dg, mask=row_mask)


STATE_GRAD_BLOCK_K = 64  # K columns per _chunk_grad_state_kernel program: three [BT, 64] fp32 accumulators


def _grad_block(K: int, V: int) -> int:
    # V columns per step of _chunk_grad_kernel's loop; sm_90 shared memory with Triton 3.6 (8 warps, 1 stage, bf16):
    # K=128 192 KB, K=64 128 KB (scripts/triton_resources.py), below the 227 KB
    return min(V, 32 if K >= 64 else 64)


def chunk_backward(
    grad_o, grad_final, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
    o, final, gamma, w, u, inverse,
):  # fmt: skip
    q, k, v, g, beta, initial_state, grad_o, grad_final = _contiguous(q, k, v, g, beta, initial_state, grad_o, grad_final)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, precision = q.device, _precision(q)
    chunks = Chunks.of(v, cu_seqlens)
    is_varlen = cu_seqlens is not None
    segments = Segments.of(chunks, q, v, cu_seqlens)
    _, states, corrections, maps = walk_states(k, v, gamma, w, u, initial_state, False, use_qk_l2norm_in_kernel, chunks, segments)

    dstates = _state_buffer(chunks.total, HV, K, V, device)
    du = buffers.empty((B * T, HV, V), dtype=torch.float32, device=device)
    dh0 = _state_buffer(chunks.n, HV, K, V, device) if initial_state is not None else None
    dht = grad_final if output_final_state else None
    walk = functools.partial(_state_grad, q, k, gamma, w, grad_o, scale, use_qk_l2norm_in_kernel)
    if segments is None:
        walk(chunks, dht=dht, du=du, dstates=dstates, dh0=dh0)
    else:  # dS = M^T dS' + c per segment: c from a zero dS', the chain backwards, then the segments again
        parts = segments.chunks
        offsets, leaving = _state_buffer(parts.n, HV, K, V, device), _state_buffer(parts.n, HV, K, V, device)
        walk(parts, dh0=offsets)
        _combine(segments, maps, offsets, dht, leaving, dh0, precision, reverse=True)
        walk(parts, dht=leaving, du=du, dstates=dstates)

    dq = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    dk = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    dw = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    dv = buffers.empty(v.shape, dtype=v.dtype, device=device)
    dbeta = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    dg = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    block_k = min(K, STATE_GRAD_BLOCK_K)
    d_last = buffers.empty((chunks.total, HV, K // block_k), dtype=torch.float32, device=device)
    if chunks.total > 0:
        _chunk_grad_state_kernel[(chunks.total, HV, K // block_k)](
            states, dstates, grad_o, du, corrections, dq, dk, dw, d_last, chunks.cu, chunks.indices, T, chunks.per_sequence,
            HV=HV, K=K, V=V, BK=block_k, BV=min(V, 64), IS_VARLEN=is_varlen, PRECISION=precision, num_warps=4, num_stages=2,
        )  # fmt: skip
        _chunk_grad_kernel[(chunks.total, HV)](
            q, k, v, beta, gamma, w, u, inverse, corrections, d_last, dw, grad_o, du, dq, dk, dv, dbeta, dg,
            chunks.cu, chunks.indices, scale, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, BV=_grad_block(K, V), K_BLOCKS=K // block_k, L2NORM=use_qk_l2norm_in_kernel,
            IS_VARLEN=is_varlen, PRECISION=precision, num_warps=8, num_stages=1,
        )  # fmt: skip
    groups = HV // H  # GVA: a q/k head's gradient sums over its value heads
    dq = dq.view(B, T, H, groups, K).sum(3).to(q.dtype)
    dk = dk.view(B, T, H, groups, K).sum(3).to(k.dtype)
    dg = dg.view(B, T, HV).to(g.dtype)
    dbeta = dbeta.view(B, T, HV).to(beta.dtype)
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, None, dh0, None, None, None
