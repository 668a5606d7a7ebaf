"""Gated delta rule in Triton: the chunked backward (fp32 accumulation throughout).

Per chunk (see reference.py), with S the state entering it, S' the state leaving it, P the causal
attention (Q K^T * exp(gamma_t - gamma_j))_{j <= t}, T = (I + A)^-1 and the corrections U = u - w S:

    O  = scale (diag(e^gamma) Q S + P U)        S' = e^gamma_last S + (K * e^(gamma_last - gamma))^T U

Backward, given dO and dS' (the gradient of the final state for the last chunk):
  0. the forward's states S per chunk are recomputed (triton.states_and_output, no output written);
  1. _state_grad_kernel, one program per (sequence, value head, V block), walks the chunks backwards:
        dU = scale P^T dO + (K * e^(gamma_last - gamma)) dS'
        dS = e^gamma_last dS' + scale (Q e^gamma)^T dO - w^T dU
     storing dS' per chunk and dU, and dS of the first chunk as d(initial_state);
  2. _chunk_grad_kernel, one program per (chunk, value head): dq, dk, dv, dbeta and dgamma from
     O, S' and U = u - w S (dw = -dU S^T, du = dU), then the WY factors w = T diag(beta e^gamma) K,
     u = T diag(beta) V through T (dA = -T^T dT T^T on the strictly lower part), the reverse
     cumulative sum dgamma -> dg within the chunk, and the l2norm backward of q and k.
dq/dk are written per value head and summed over the value heads of each q/k head (GVA) in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from .triton import BT_, L2NORM_EPS, Chunks, _bounds, _chunk_bounds, _contiguous, _first_chunk, _precision, _state_block
from .triton import states_and_output


@triton.jit
def _load_qk(x, rows, row_mask, i_h, H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """Rows of q or k in fp32 (l2-normalised when asked) and the rsqrt factor of each row."""
    cols = tl.arange(0, K)
    raw = tl.load(x + (rows[:, None] * H + i_h) * K + cols[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if L2NORM:
        rstd = tl.rsqrt(tl.sum(raw * raw, 1) + L2NORM_EPS)
    else:
        rstd = tl.full([BT_], 1.0, tl.float32)
    return raw * rstd[:, None], rstd


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _state_grad_kernel(
    q, k, gamma_in, w_in, do, du_out, dstates, dht, dh0, cu_seqlens, chunk_offsets, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_GRAD: tl.constexpr, L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
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
    causal = r[:, None] >= r[None, :]
    n_chunks = (eos - bos + BT_ - 1) // BT_
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        # dS' of chunk c: the gradient of the state leaving it
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
        decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
        attention = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * decay
        k_to_end = b_k * tl.where(row_mask, tl.exp(last - gamma), 0.0)[:, None]
        b_du = tl.dot(tl.trans(attention), b_do, input_precision=PRECISION) * scale
        b_du += tl.dot(k_to_end, dstate, input_precision=PRECISION)
        tl.store(du_out + (rows[:, None] * HV + i_hv) * V + cols_v[None, :], b_du, mask=row_mask[:, None])
        q_decayed = b_q * (tl.exp(gamma) * scale)[:, None]
        dstate = dstate * tl.exp(last) + tl.dot(tl.trans(q_decayed), b_do, input_precision=PRECISION)
        dstate -= tl.dot(tl.trans(b_w), b_du, input_precision=PRECISION)
    if USE_INITIAL_STATE:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + block, dstate)


@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_kernel(
    q, k, v, beta, gamma_in, w_in, u_in, inverse_in, states, dstates, do, du,
    dq_out, dk_out, dv_out, dbeta_out, dg_out, cu_seqlens, chunk_indices, scale, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, start, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, T, N_CHUNKS, IS_VARLEN)
    r = tl.arange(0, BT_)
    rows = start + r
    row_mask = rows < eos
    cols_k = tl.arange(0, K)
    causal = r[:, None] >= r[None, :]
    strictly_lower = r[:, None] > r[None, :]

    gamma = tl.load(gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0)
    last_row = tl.minimum(start + BT_, eos) - 1
    last = tl.load(gamma_in + last_row * HV + i_hv)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    b_q, q_rstd = _load_qk(q, rows, row_mask, i_h, H, K, L2NORM)
    b_k, k_rstd = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    b_w = tl.load(w_in + (rows[:, None] * HV + i_hv) * K + cols_k[None, :], mask=row_mask[:, None], other=0.0)
    inverse = tl.load(inverse_in + (rows[:, None] * HV + i_hv) * BT_ + r[None, :], mask=row_mask[:, None], other=0.0)
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf")))
    e_gamma = tl.exp(gamma)
    to_end = tl.where(row_mask, tl.exp(last - gamma), 0.0)
    state_base = (i_t.to(tl.int64) * HV + i_hv) * K * V

    # over V blocks: the terms that need S, dS', dO, dU, u, v
    dq_state = tl.zeros([BT_, K], dtype=tl.float32)  # dO S^T
    dk_state = tl.zeros([BT_, K], dtype=tl.float32)  # U dS'^T
    dw = tl.zeros([BT_, K], dtype=tl.float32)  # -dU S^T
    do_u = tl.zeros([BT_, BT_], dtype=tl.float32)  # dO U^T
    d_inverse = tl.zeros([BT_, BT_], dtype=tl.float32)  # dT (u's part: dU (beta V)^T)
    dbeta = tl.zeros([BT_], dtype=tl.float32)
    d_last = tl.zeros([K], dtype=tl.float32)  # summed at the end: d gamma_last
    for i_v in range(0, V, BV):
        cols_v = i_v + tl.arange(0, BV)
        block = cols_k[:, None] * V + cols_v[None, :]
        tokens = (rows[:, None] * HV + i_hv) * V + cols_v[None, :]
        b_s = tl.load(states + state_base + block)
        b_ds = tl.load(dstates + state_base + block)
        b_do = tl.load(do + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_du = tl.load(du + tokens, mask=row_mask[:, None], other=0.0)
        b_u = tl.load(u_in + tokens, mask=row_mask[:, None], other=0.0)
        b_v = tl.load(v + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        corrections = b_u - tl.dot(b_w, b_s, input_precision=PRECISION)
        dq_state += tl.dot(b_do, tl.trans(b_s), input_precision=PRECISION)
        dk_state += tl.dot(corrections, tl.trans(b_ds), input_precision=PRECISION)
        dw -= tl.dot(b_du, tl.trans(b_s), input_precision=PRECISION)
        do_u += tl.dot(b_do, tl.trans(corrections), input_precision=PRECISION)
        # u = T diag(beta) V
        dv_beta = tl.dot(tl.trans(inverse), b_du, input_precision=PRECISION)
        tl.store(dv_out + tokens, (dv_beta * b_beta[:, None]).to(dv_out.dtype.element_ty), mask=row_mask[:, None])
        dbeta += tl.sum(dv_beta * b_v, 1)
        d_inverse += tl.dot(b_du, tl.trans(b_v * b_beta[:, None]), input_precision=PRECISION)
        d_last += tl.sum(b_s * b_ds, 1)  # per K row; e^gamma_last <S, dS'> summed below
    d_gamma_last = tl.sum(d_last, 0) * tl.exp(last)

    # O and S' directly
    dp = tl.where(causal, do_u * decay, 0.0) * scale  # d(Q K^T) of the causal attention, decay included
    qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
    dq = dq_state * (e_gamma * scale)[:, None] + tl.dot(dp, b_k, input_precision=PRECISION)
    dk = tl.dot(tl.trans(dp), b_q, input_precision=PRECISION) + dk_state * to_end[:, None]
    m = dp * qk
    k_to_end_term = to_end * tl.sum(b_k * dk_state, 1)
    d_gamma = scale * e_gamma * tl.sum(b_q * dq_state, 1) + tl.sum(m, 1) - tl.sum(m, 0) - k_to_end_term
    d_gamma_last += tl.sum(k_to_end_term, 0)

    # w = T diag(beta e^gamma) K
    k_weight = b_beta * e_gamma
    dk_weighted = tl.dot(tl.trans(inverse), dw, input_precision=PRECISION)
    d_inverse += tl.dot(dw, tl.trans(b_k * k_weight[:, None]), input_precision=PRECISION)
    dk += dk_weighted * k_weight[:, None]
    kdk = e_gamma * tl.sum(dk_weighted * b_k, 1)
    dbeta += kdk
    d_gamma += b_beta * kdk

    # T = (I + A)^-1, A = beta_t e^(gamma_t - gamma_j) k_t.k_j strictly lower
    da = tl.dot(tl.dot(tl.trans(inverse), d_inverse, input_precision=PRECISION), tl.trans(inverse), input_precision=PRECISION)
    da = tl.where(strictly_lower, -da, 0.0)
    kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
    da_decay = da * decay  # zero on and above the diagonal
    dbeta += tl.sum(da_decay * kk, 1)
    da_a = da_decay * kk * b_beta[:, None]
    d_gamma += tl.sum(da_a, 1) - tl.sum(da_a, 0)
    dkk = da_decay * b_beta[:, None]
    dk += tl.dot(dkk, b_k, input_precision=PRECISION) + tl.dot(tl.trans(dkk), b_k, input_precision=PRECISION)

    # gamma = cumsum(g) within the chunk: dg_s = sum_{t >= s} dgamma_t
    d_gamma += tl.where(rows == last_row, d_gamma_last, 0.0)
    d_gamma = tl.where(row_mask, d_gamma, 0.0)
    dg = tl.sum(d_gamma, 0) - tl.cumsum(d_gamma, 0) + d_gamma
    if L2NORM:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
        dq = (dq - b_q * tl.sum(dq * b_q, 1)[:, None]) * q_rstd[:, None]
        dk = (dk - b_k * tl.sum(dk * b_k, 1)[:, None]) * k_rstd[:, None]
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]
    tl.store(dq_out + heads, dq, mask=row_mask[:, None])
    tl.store(dk_out + heads, dk, mask=row_mask[:, None])
    tl.store(dbeta_out + rows * HV + i_hv, dbeta, mask=row_mask)
    tl.store(dg_out + rows * HV + i_hv, dg, mask=row_mask)


def _grad_block(K: int, V: int) -> int:
    return min(V, 32 if K == 128 else 64)


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
    _, _, states = states_and_output(
        q, k, v, gamma, w, u, scale, initial_state, False, use_qk_l2norm_in_kernel, chunks,
        write_output=False, store_states=True,
    )  # fmt: skip

    dstates = buffers.empty((chunks.total, HV, K, V), dtype=torch.float32, device=device)
    du = buffers.empty((B * T, HV, V), dtype=torch.float32, device=device)
    dh0 = buffers.empty((chunks.n, HV, K, V), dtype=torch.float32, device=device) if initial_state is not None else None
    BV = _state_block(K, V)
    _state_grad_kernel[(triton.cdiv(V, BV), chunks.n * HV)](
        q, k, gamma, w, grad_o, du, dstates, grad_final, dh0, chunks.cu, chunks.offsets, scale, T, chunks.per_sequence,
        H=H, HV=HV, K=K, V=V, BV=BV, USE_INITIAL_STATE=initial_state is not None, USE_FINAL_GRAD=bool(output_final_state),
        L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=is_varlen, PRECISION=precision, num_warps=4,
    )  # fmt: skip

    dq = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    dk = buffers.empty((B * T, HV, K), dtype=torch.float32, device=device)
    dv = buffers.empty(v.shape, dtype=v.dtype, device=device)
    dbeta = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    dg = buffers.empty((B * T, HV), dtype=torch.float32, device=device)
    if chunks.total > 0:
        _chunk_grad_kernel[(chunks.total, HV)](
            q, k, v, beta, gamma, w, u, inverse, states, dstates, grad_o, du, dq, dk, dv, dbeta, dg,
            chunks.cu, chunks.indices, scale, T, chunks.per_sequence,
            H=H, HV=HV, K=K, V=V, BV=_grad_block(K, V), L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=is_varlen,
            PRECISION=precision, num_warps=4 if K <= 32 else 8,
        )  # fmt: skip
    groups = HV // H  # GVA: a q/k head's gradient sums over its value heads
    dq = dq.view(B, T, H, groups, K).sum(3).to(q.dtype)
    dk = dk.view(B, T, H, groups, K).sum(3).to(k.dtype)
    dg = dg.view(B, T, HV).to(g.dtype)
    dbeta = dbeta.view(B, T, HV).to(beta.dtype)
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, None, dh0, None, None, None
