"""The chunked gated delta rule's backward in Triton (the forward: triton.py; what both use: triton_shared.py; step 5,
through the WY factors: triton_backward_wy.py)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import buffers
from ..backends import sm_count
from ..launch_math import cdiv, next_power_of_2
from ..triton_launch import direct_launch
from .triton_backward_launch import _grad_qk_state_launch, _local_grad_launch, _walk_launch
from .triton_backward_wy import _grad_wy
from .triton_shared import (
    BT_,
    DEFAULT_TUNING,
    Chunks,
    Tuning,
    _as_operand,
    _bounds,
    _chunk_last,
    _chunk_program,
    _combine,
    _contiguous,
    _dot_qk,
    _first_chunk,
    _load_qk,
    _operand,
    _precision,
    _state_buffer,
    _storage_dot,
    _walk_operand_columns,
    half_storage,
    segment_chunks,
    split,
    walk_states,
)

# --------------------------------------------------------------------------- chunked backward
# The chunked backward (fp32 accumulation throughout). Per chunk (see reference.py), with S the state entering it, S'
# the state leaving it, P the causal attention (Q K^T * exp(gamma_t - gamma_j))_{j <= t}, T = (I + A)^-1 and the
# corrections U = u - w S:  O = scale (diag(e^gamma) Q S + P U),  S' = e^gamma_last S + K~^T U,  K~ = diag(e^(gamma_last
# - gamma)) K. Given dO and dS', after the forward's S and U are recomputed (walk_states):
#   1. _chunk_local_grad_kernel, per (chunk, value head): dU_local = scale P^T dO, and the row factors that make Q~ and
#      K~ from the raw q/k rows (scale e^gamma rstd_q, e^(gamma_last - gamma) rstd_k; rstd: the l2norm's, else 1);
#   2. _state_grad_kernel, per (sequence, value head, V block), walks the chunks backwards: dU = dU_local + K~ dS',
#      dS = e^gamma_last dS' + Q~^T dO - w^T dU; it stores dS' per chunk, dU, and d(initial_state);
#   3. and 4. _chunk_grad_qk_state_kernel, per (chunk, value head): the products with the states in registers, then
#      dq (final) and the parts of dk and dgamma from O and S';
#   5. triton_backward_wy.py: through the WY factors and T: dv, dbeta, the rest of dk and dgamma, the l2norm backward
#      of k and dg. GVA (HV > H) sums dq/dk over each q/k head's value heads in _sum_value_heads (from fp32).
# Why the steps split as they do, and their launches (triton_backward_launch.py): docs/tuning/gated_delta_rule.md.
#
# No tl.dot here takes tl.trans(X) of an X computed by another tl.dot: Triton 3.4 to 3.7.0 miscompiles that on Hopper
# (wrong numbers from the wgmma operand of a transposed MMA-layout tensor). Transposes are computed from their
# factors instead, or taken of tiles loaded from memory: P^T = (K Q^T) * decay^T; dP^T from U dO^T; dA^T = -(T dT^T
# T) with T dT^T = U dU^T; the walk's Q_raw^T and w^T are loaded tiles, and dU enters w^T dU untransposed.


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_local_grad_kernel(
    q, k, gamma_in, do, du_out, q_factor_out, k_factor_out, cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """dU_local = scale P^T dO of one chunk, P^T = (K Q^T) * decay^T (key j <= query t), over V blocks; and the
    row factors of the walk, scale e^gamma rstd_q and e^(gamma_last - gamma) rstd_k (rows past the end are not
    written: the walk loads them masked, as 0)."""
    i_t, i_hv, i_h, rows, row_mask, last_row, gamma = _chunk_program(
        gamma_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H, HV, IS_VARLEN
    )
    r = tl.arange(0, BT_)
    last = tl.load(gamma_in + last_row * HV + i_hv)
    b_q, q_rstd = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
    b_k, k_rstd = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    causal_t = (r[:, None] <= r[None, :]) & row_mask[None, :]
    decay_t = tl.exp(tl.where(causal_t, gamma[None, :] - gamma[:, None], float("-inf")))
    attention_t = _dot_qk(b_k, b_q, q.dtype.element_ty, L2NORM, PRECISION) * decay_t * scale
    for i_v in range(0, V, BV):
        tokens = (rows[:, None] * HV + i_hv) * V + i_v + tl.arange(0, BV)[None, :]
        b_do = tl.load(do + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        tl.store(du_out + tokens, _storage_dot(attention_t, b_do, PRECISION, HALF), mask=row_mask[:, None])
    tl.store(q_factor_out + rows * HV + i_hv, scale * tl.exp(gamma) * q_rstd, mask=row_mask)
    tl.store(k_factor_out + rows * HV + i_hv, tl.exp(last - gamma) * k_rstd, mask=row_mask)


@triton.jit
def _state_tiles(ptr, block, block_mask, dstate, dstate_hi, K: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    """Stores dS as its row tiles: rows [0, BK) from dstate, with K = 2 BK rows [BK, K) from dstate_hi."""
    tl.store(ptr + block, dstate.to(ptr.dtype.element_ty), mask=block_mask)
    if K > BK:
        tl.store(ptr + BK * V + block, dstate_hi.to(ptr.dtype.element_ty), mask=block_mask)


@triton.jit
def _reverse_walk_tile(
    dstate, decay, q, w_in, rows, row_mask, i_h, i_hv, do_operand, du_operand, H: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, first: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Rows [first, first + BK) of dS = e^gamma_last dS' + Q~^T dO - w^T dU (the operands as _storage_dot takes them,
    dU negated)."""
    q_rows = _walk_operand_columns(q, rows, row_mask, i_h, H, K, first, BK, HALF)
    w_rows = _walk_operand_columns(w_in, rows, row_mask, i_hv, HV, K, first, BK, HALF)
    dstate = _storage_dot(tl.trans(q_rows), do_operand, PRECISION, HALF, dstate * decay)
    return _storage_dot(tl.trans(w_rows), du_operand, PRECISION, HALF, dstate)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _state_grad_kernel(
    q, k, q_factor, k_factor, gamma_in, w_in, do, du, dstates, dht, dh0, cu_seqlens, chunk_offsets, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, STORE_GRADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """The reverse walk over a sequence's chunks: dU = dU_local + K~ dS', dS = e^gamma_last dS' + Q~^T dO - w^T dU
    (du holds dU_local on entry; with STORE_GRADS it gets dU, and dstates each chunk's dS'). dS stays fp32 in
    registers (HALF: the products on 16-bit operands, as the forward walk's), as one [K, BV] tile or, with K = 2 BK,
    two [BK, BV] tiles: products of 64 state rows, as fla's reverse walk takes them (a [128, 32] tile made illegal
    memory accesses with Triton 3.6 on the H100)."""
    tl.static_assert(K <= 2 * BK)  # at most two row tiles
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # sequences x heads on x: grid y caps at 65535
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    first_chunk = _first_chunk(chunk_offsets, i_n, N_CHUNKS, IS_VARLEN)
    state_rows = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    column_mask = cols_v < V  # a V block wider than V (K = 128, V = 16: see _walk_launch); all true otherwise
    block = state_rows[:, None] * V + cols_v[None, :]
    block_mask = (state_rows[:, None] >= 0) & column_mask[None, :]  # [BK, BV]
    dstate = tl.zeros([BK, BV], dtype=tl.float32)
    dstate_hi = tl.zeros([BK, BV], dtype=tl.float32)  # rows [BK, K) where K = 2 BK, else unused
    if USE_FINAL_GRAD:
        final = dht + i_nh.to(tl.int64) * K * V
        dstate = tl.load(final + block, mask=block_mask, other=0.0).to(tl.float32)
        if K > BK:
            dstate_hi = tl.load(final + BK * V + block, mask=block_mask, other=0.0).to(tl.float32)
    n_chunks = (eos - bos + BT_ - 1) // BT_
    # Triton pipelines the tile loads; gamma_last is loaded a chunk ahead by hand (_chunk_last)
    last = _chunk_last(gamma_in, bos + (n_chunks - 1) * BT_, bos, eos, i_hv, HV)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        next_last = _chunk_last(gamma_in, bos + (c - 1) * BT_, bos, eos, i_hv, HV)
        if STORE_GRADS:  # dS' of chunk c: the gradient of the state leaving it
            _state_tiles(
                dstates + ((first_chunk + c) * HV + i_hv) * K * V, block, block_mask, dstate, dstate_hi, K, BK, V
            )
        start = bos + c * BT_
        rows = start + tl.arange(0, BT_)
        row_mask = rows < eos
        tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
        # the row factors scale the [BT, BV] sides of the products, not the [BT, K] rows (K~ = diag(k_factor) K_raw)
        k_rows = _walk_operand_columns(k, rows, row_mask, i_h, H, K, 0, BK, HALF)
        k_product = _storage_dot(k_rows, dstate, PRECISION, HALF)
        if K > BK:
            k_rows_hi = _walk_operand_columns(k, rows, row_mask, i_h, H, K, BK, BK, HALF)
            k_product = _storage_dot(k_rows_hi, dstate_hi, PRECISION, HALF, k_product)
        k_rows_factor = tl.load(k_factor + rows * HV + i_hv, mask=row_mask, other=0.0)
        tile_mask = row_mask[:, None] & column_mask[None, :]
        b_du = tl.load(du + tokens, mask=tile_mask, other=0.0).to(tl.float32)
        b_du += k_product * k_rows_factor[:, None]
        if STORE_GRADS:
            tl.store(du + tokens, b_du.to(du.dtype.element_ty), mask=tile_mask)
        q_rows_factor = tl.load(q_factor + rows * HV + i_hv, mask=row_mask, other=0.0)
        b_do = tl.load(do + tokens, mask=tile_mask, other=0.0).to(tl.float32) * q_rows_factor[:, None]
        do_operand, du_operand, decay = _operand(b_do, HALF), _operand(-b_du, HALF), tl.exp(last)
        dstate = _reverse_walk_tile(
            dstate, decay, q, w_in, rows, row_mask, i_h, i_hv, do_operand, du_operand, H, HV, K, 0, BK, PRECISION, HALF
        )
        if K > BK:
            dstate_hi = _reverse_walk_tile(dstate_hi, decay, q, w_in, rows, row_mask, i_h, i_hv, do_operand,
                                           du_operand, H, HV, K, BK, BK, PRECISION, HALF)  # fmt: skip
        last = next_last
    if USE_INITIAL_STATE:
        _state_tiles(dh0 + i_nh.to(tl.int64) * K * V, block, block_mask, dstate, dstate_hi, K, BK, V)


def _local_grad(q, k, gamma, grad_o, scale, l2norm, chunks: Chunks, du, half: str):
    """_chunk_local_grad_kernel over every chunk: dU_local into du; returns the walk's row factors of q and k."""
    B, T, H, K = q.shape
    HV, V = grad_o.shape[2:]
    q_factor = buffers.empty((B * T, HV), dtype=torch.float32, device=q.device)
    k_factor = buffers.empty((B * T, HV), dtype=torch.float32, device=q.device)
    if chunks.total > 0:
        _chunk_local_grad_kernel[(chunks.total, HV)](
            q, k, gamma, grad_o, du, q_factor, k_factor, chunks.cu, chunks.indices, scale, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, L2NORM=l2norm, IS_VARLEN=chunks.cu is not None, PRECISION=_precision(q),
            HALF=half, **_local_grad_launch(K, V),
        )  # fmt: skip
    return q_factor, k_factor


def _state_grad(q, k, factors, gamma, w, grad_o, du, half: str, chunks: Chunks, *, dht=None, dstates=None, dh0=None):
    """One _state_grad_kernel launch over the sequences of `chunks` (dU and dS' are stored when dstates is given)."""
    B, T, H, K = q.shape
    HV, V = grad_o.shape[2:]
    BV, warps, stages = _walk_launch(K, V, _precision(q), chunks.n * HV, sm_count(q.device))
    options = dict(BV=BV, num_warps=warps, num_stages=stages)
    _state_grad_kernel[(chunks.n * HV, cdiv(V, options["BV"]))](
        q, k, *factors, gamma, w, grad_o, du, dstates, dht, dh0, chunks.cu, chunks.offsets, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, BK=min(K, 64), USE_INITIAL_STATE=dh0 is not None, USE_FINAL_GRAD=dht is not None,
        IS_VARLEN=chunks.cu is not None, PRECISION=_precision(q), STORE_GRADS=dstates is not None,
        HALF=half, **options,
    )  # fmt: skip


@triton.jit
def _grad_qk_outputs(
    q, k, dq_out, dk_part_out, d_gamma_out, rows, row_mask, last_row, gamma, last, i_h, i_hv, do_u, u_do, dq_state,
    dk_state, s_ds, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr,
    PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Step 4's outputs from dO U^T, U dO^T, dO S^T, U dS'^T and <S, dS'> (fp32): dq_out (final), dk_part_out (fp32;
    may be where U dS'^T was read from) and d_gamma_out."""
    r = tl.arange(0, BT_)
    cols_k = tl.arange(0, K)
    d_gamma_last = s_ds * tl.exp(last)
    # rows past the end (gamma 0) masked: e^-gamma_j can overflow to inf, and inf * 0 is NaN
    causal = (r[:, None] >= r[None, :]) & row_mask[:, None]
    causal_t = (r[:, None] <= r[None, :]) & row_mask[None, :]
    dp = tl.where(causal, do_u * tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf"))), 0.0) * scale
    dp_t = (
        tl.where(causal_t, u_do * tl.exp(tl.where(causal_t, gamma[None, :] - gamma[:, None], float("-inf"))), 0.0)
        * scale
    )
    e_gamma = tl.exp(gamma)
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]

    # O: dq, and dgamma through diag(e^gamma) and the decay
    b_q, q_rstd = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
    b_k, k_rstd = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    m = dp * _dot_qk(b_q, b_k, q.dtype.element_ty, L2NORM, PRECISION)
    d_gamma = scale * e_gamma * tl.sum(b_q * dq_state, 1) + tl.sum(m, 1) - tl.sum(m, 0)
    dq_new = dq_state * (e_gamma * scale)[:, None] + _storage_dot(dp, b_k, PRECISION, HALF)
    if L2NORM:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
        dq_new = (dq_new - b_q * tl.sum(dq_new * b_q, 1)[:, None]) * q_rstd[:, None]
    tl.store(dq_out + heads, dq_new.to(dq_out.dtype.element_ty), mask=row_mask[:, None])

    # S' = e^gamma_last S + K~^T U
    to_end = tl.where(row_mask, tl.exp(last - gamma), 0.0)
    dk_part = _storage_dot(dp_t, b_q, PRECISION, HALF) + dk_state * to_end[:, None]
    tl.store(dk_part_out + heads, dk_part, mask=row_mask[:, None])
    k_to_end_term = to_end * tl.sum(b_k * dk_state, 1)
    d_gamma_last += tl.sum(k_to_end_term, 0)
    d_gamma = d_gamma - k_to_end_term + tl.where(rows == last_row, d_gamma_last, 0.0)
    tl.store(d_gamma_out + rows * HV + i_hv, d_gamma, mask=row_mask)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_qk_state_kernel(
    q, k, gamma_in, states, dstates, do, du, corrections, dq_out, dk_part_out, dw_out, d_gamma_out,
    cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Steps 3 and 4 in one program per (chunk, value head): one loop over V blocks takes the
    products with the states (dO S^T, U dS'^T, dw = -dU S^T over the whole K, <S, dS'>) and dO U^T, U dO^T, so that
    none of them goes through memory but dw; then step 4's outputs."""
    i_t, i_hv, i_h, rows, row_mask, last_row, gamma = _chunk_program(
        gamma_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H, HV, IS_VARLEN
    )
    cols_k = tl.arange(0, K)
    last = tl.load(gamma_in + last_row * HV + i_hv)
    state_base = (i_t.to(tl.int64) * HV + i_hv) * K * V
    dq_state = tl.zeros([BT_, K], dtype=tl.float32)  # dO S^T
    dk_state = tl.zeros([BT_, K], dtype=tl.float32)  # U dS'^T
    du_s = tl.zeros([BT_, K], dtype=tl.float32)  # dU S^T = -dw
    do_u = tl.zeros([BT_, BT_], dtype=tl.float32)
    u_do = tl.zeros([BT_, BT_], dtype=tl.float32)
    s_ds = tl.zeros([K], dtype=tl.float32)  # <S, dS'> by K row
    for i_v in range(0, V, BV):
        cols_v = i_v + tl.arange(0, BV)
        block = cols_k[:, None] * V + cols_v[None, :]
        tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_s = tl.load(states + state_base + block)
        b_ds = tl.load(dstates + state_base + block)
        s_ds += tl.sum(b_s.to(tl.float32) * b_ds.to(tl.float32), 1)
        b_s, b_ds = _as_operand(b_s, HALF), _as_operand(b_ds, HALF)
        b_do = _as_operand(tl.load(do + tokens, mask=row_mask[:, None], other=0.0), HALF)
        b_du = _as_operand(tl.load(du + tokens, mask=row_mask[:, None], other=0.0), HALF)
        b_u = _as_operand(tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0), HALF)
        dq_state = _storage_dot(b_do, tl.trans(b_s), PRECISION, HALF, dq_state)
        dk_state = _storage_dot(b_u, tl.trans(b_ds), PRECISION, HALF, dk_state)
        du_s = _storage_dot(b_du, tl.trans(b_s), PRECISION, HALF, du_s)  # (the interpreter negates bf16 bits wrongly)
        do_u = _storage_dot(b_do, tl.trans(b_u), PRECISION, HALF, do_u)
        u_do = _storage_dot(b_u, tl.trans(b_do), PRECISION, HALF, u_do)
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]
    tl.store(dw_out + heads, (-du_s).to(dw_out.dtype.element_ty), mask=row_mask[:, None])
    _grad_qk_outputs(
        q, k, dq_out, dk_part_out, d_gamma_out, rows, row_mask, last_row, gamma, last, i_h, i_hv, do_u, u_do,
        dq_state, dk_state, tl.sum(s_ds, 0), scale, H, HV, K, L2NORM, PRECISION, HALF,
    )  # fmt: skip


@direct_launch
@triton.jit(do_not_specialize=["ROWS"])  # one compiled kernel for every row count (else 1, multiples of 16, others)
def _sum_value_heads_kernel(
    per_value_head, out, ROWS, GROUPS: tl.constexpr, K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr
):
    """out[r] = sum over g of per_value_head[r, g] (fp32, in order of g), stored in out's dtype: GVA's sum of a q/k
    head's gradient over its value heads and the cast in one pass over the fp32 buffer."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < ROWS) & (cols[None, :] < K)
    first = rows.to(tl.int64)[:, None] * GROUPS * K + cols[None, :]
    total = tl.zeros([BLOCK_ROWS, BLOCK_K], dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        total += tl.load(per_value_head + first + g * K, mask=mask, other=0.0)
    tl.store(out + rows.to(tl.int64)[:, None] * K + cols[None, :], total.to(out.dtype.element_ty), mask=mask)


def _sum_value_heads(per_value_head: torch.Tensor, B: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """[B * T, H * groups, K] fp32 -> [B, T, H, K] in dtype, summed over each q/k head's value heads."""
    K = per_value_head.shape[-1]
    groups = per_value_head.shape[1] // H
    out = buffers.empty((B, T, H, K), dtype=dtype, device=per_value_head.device)
    rows = B * T * H
    block_k = next_power_of_2(K)
    block_rows = max(1, 4096 // block_k)
    if rows > 0:
        grid = (cdiv(rows, block_rows),)
        _sum_value_heads_kernel[grid](
            per_value_head, out, rows, GROUPS=groups, K=K, BLOCK_ROWS=block_rows, BLOCK_K=block_k, num_warps=4
        )
    return out


def _final_buffer(fp32_buffer: torch.Tensor | None, x: torch.Tensor, groups: int, shape: tuple) -> torch.Tensor:
    """Where the gradient kernels write the gradient of q or k, per value head: in fp32 for GVA (summed over value
    heads afterwards) and fp32 inputs, in `fp32_buffer` where given (read before it is written by the same program),
    else in the input's dtype."""
    if groups > 1 or x.dtype == torch.float32:
        return buffers.empty(shape, dtype=torch.float32, device=x.device) if fp32_buffer is None else fp32_buffer
    return buffers.empty(shape, dtype=x.dtype, device=x.device)


def chunk_backward(
    grad_o, grad_final, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
    o, final, gamma, w, u, inverse, *, tuning: Tuning = DEFAULT_TUNING,
):  # fmt: skip
    """Every input's gradient (None for the non-tensor ones); tuning: the kernels' variants (the forward's)."""
    q, k, v, g, beta, initial_state, grad_o, grad_final = _contiguous(
        q, k, v, g, beta, initial_state, grad_o, grad_final
    )
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, precision = q.device, _precision(q)
    chunks = Chunks.of(v, cu_seqlens)
    is_varlen = cu_seqlens is not None
    half = tuning.half(q)  # every kernel's HALF but step 5's
    half_step5 = tuning.half_step5(q)
    step5 = tuning.step5(K)
    # dS', dU and dw only ever enter products after they are stored: with HALF in its type, as those products round them
    # (the walk adds dU_local to K~ dS' in fp32 after one rounding; <S, dS'> for d gamma_last takes dS' rounded). dU
    # stays fp32 for a step-5 kernel without HALF, whose products are tf32 (bf16 dU: dv's error 9.5e-3 -> 1.3e-2 at
    # K 32 with the single kernel); step 5 takes dw in either dtype
    product_dtype = half_storage(half)
    du_dtype = half_storage(half_step5)
    dstates = _state_buffer(chunks.total, HV, K, V, device, product_dtype)
    du = buffers.empty((B * T, HV, V), dtype=du_dtype, device=device)  # dU_local, then dU
    factors = _local_grad(q, k, gamma, grad_o, scale, use_qk_l2norm_in_kernel, chunks, du, half)
    # the states again, from the k factors just computed (the forward's up to rounding: the same math, another kernel)
    segments = split(chunks, q, v, cu_seqlens, tuning.segment_chunks)
    _, states, corrections, maps = walk_states(k, v, factors[1], gamma, w, u, initial_state, False, chunks, segments)
    dh0 = _state_buffer(chunks.n, HV, K, V, device) if initial_state is not None else None
    dht = grad_final if output_final_state else None
    walk = functools.partial(_state_grad, q, k, factors, gamma, w, grad_o, du, half)
    if segments is None:
        walk(chunks, dht=dht, dstates=dstates, dh0=dh0)
    else:  # dS = M^T dS' + c per segment: c from a zero dS', the chain backwards, then the segments again
        parts = segment_chunks(segments, chunks.total)
        offsets, leaving = _state_buffer(parts.n, HV, K, V, device), _state_buffer(parts.n, HV, K, V, device)
        walk(parts, dh0=offsets)
        _combine(segments, maps, offsets, dht, leaving, dh0, precision, reverse=True)
        walk(parts, dht=leaving, dstates=dstates)

    groups = HV // H  # GVA: a q/k head's gradient sums over its value heads (_sum_value_heads, from fp32)
    per_value_head = (B * T, HV, K)
    dk = buffers.empty(per_value_head, dtype=torch.float32, device=device)  # step 4's part
    dq_out, dk_out = _final_buffer(None, q, groups, per_value_head), _final_buffer(dk, k, groups, per_value_head)
    dw = buffers.empty(per_value_head, dtype=product_dtype, device=device)
    dv = buffers.empty(v.shape, dtype=v.dtype, device=device)
    dbeta = buffers.empty((B, T, HV), dtype=beta.dtype, device=device)
    dg = buffers.empty((B, T, HV), dtype=g.dtype, device=device)
    if chunks.total > 0:
        shared = dict(
            H=H, HV=HV, K=K, V=V, L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=is_varlen, PRECISION=precision, HALF=half
        )
        d_gamma = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
        tail = (chunks.cu, chunks.indices, scale, T, chunks.per_sequence)
        _chunk_grad_qk_state_kernel[(chunks.total, HV)](
            q, k, gamma, states, dstates, grad_o, du, corrections, dq_out, dk, dw, d_gamma, *tail,
            **_grad_qk_state_launch(K, V), **shared,
        )  # fmt: skip
        wy_inputs = (k, v, beta, gamma, inverse, corrections, dw, du, dk, d_gamma, g)
        _grad_wy(wy_inputs, (dk_out, dv, dbeta, dg), chunks, T, dict(shared, HALF=half_step5), step5)
    if groups > 1:
        dq_out, dk_out = _sum_value_heads(dq_out, B, T, H, q.dtype), _sum_value_heads(dk_out, B, T, H, k.dtype)
    dq_out, dk_out = dq_out.view(B, T, H, K), dk_out.view(B, T, H, K)
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    return dq_out, dk_out, dv, dg, dbeta, None, dh0, None, None, None
