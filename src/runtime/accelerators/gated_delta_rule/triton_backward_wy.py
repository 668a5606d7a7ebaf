"""Step 5 of the chunked gated delta rule's Triton backward (triton_backward.py): the gradient through the WY factors
w and u and through T, as one kernel or in two parts through dA (Tuning.grad_wy)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers
from ..triton_launch import direct_launch
from .triton_backward_launch import _grad_launch, _grad_wy_launch
from .triton_shared import (
    BT_,
    L2NORM_EPS,
    Chunks,
    _as_operand,
    _chunk_program,
    _dot_qk,
    _load_qk,
    _operand,
    _storage_dot,
    _store_dg,
)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_wy_kernel(
    k, v, beta, gamma_in, inverse_in, corrections, dw_in, du, dk, d_gamma_in, g,
    dk_out, dv_out, dbeta_out, dg_out, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Step 5: the WY factors' part. dv and dbeta through u = T diag(beta) V, dk and dbeta through
    w = T diag(beta e^gamma) K, both through T = (I + A)^-1 (dA = -T^T dT T^T, strictly lower); then dk (dk holds
    step 4's part) and dgamma (d_gamma_in: step 4's part) are finished: the l2norm backward of k, and dg from dgamma
    by the reverse cumulative sum within the chunk. dk_out, dv, dbeta and dg in their tensors' dtypes."""
    i_t, i_hv, i_h, rows, row_mask, last_row, gamma = _chunk_program(
        gamma_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H, HV, IS_VARLEN
    )
    r = tl.arange(0, BT_)
    cols_k = tl.arange(0, K)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    inverse_rows = (rows[:, None] * HV + i_hv) * BT_ + r[None, :]
    inverse = tl.load(inverse_in + inverse_rows, mask=row_mask[:, None], other=0.0).to(tl.float32)

    # over V blocks: u = T diag(beta) V, and U dU^T = T dT^T (see above)
    u_du = tl.zeros([BT_, BT_], dtype=tl.float32)
    d_inverse = tl.zeros([BT_, BT_], dtype=tl.float32)  # dT (u's part: dU (beta V)^T)
    dbeta = tl.zeros([BT_], dtype=tl.float32)
    for i_v in range(0, V, BV):
        tokens = (rows[:, None] * HV + i_hv) * V + i_v + tl.arange(0, BV)[None, :]
        b_du = tl.load(du + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_v = tl.load(v + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        b_corrections = tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        u_du += tl.dot(b_corrections, tl.trans(b_du), input_precision=PRECISION)
        dv_beta = tl.dot(tl.trans(inverse), b_du, input_precision=PRECISION)
        tl.store(dv_out + tokens, (dv_beta * b_beta[:, None]).to(dv_out.dtype.element_ty), mask=row_mask[:, None])
        dbeta += tl.sum(dv_beta * b_v, 1)
        d_inverse += tl.dot(b_du, tl.trans(b_v * b_beta[:, None]), input_precision=PRECISION)

    # w = T diag(beta e^gamma) K
    e_gamma = tl.exp(gamma)
    heads = (rows[:, None] * HV + i_hv) * K + cols_k[None, :]
    b_k, k_rstd = _load_qk(k, rows, row_mask, i_h, H, K, L2NORM)
    dw = tl.load(dw_in + heads, mask=row_mask[:, None], other=0.0).to(tl.float32)
    k_weight = b_beta * e_gamma
    dk_weighted = tl.dot(tl.trans(inverse), dw, input_precision=PRECISION)
    d_inverse += tl.dot(dw, tl.trans(b_k * k_weight[:, None]), input_precision=PRECISION)
    dk_new = tl.load(dk + heads, mask=row_mask[:, None], other=0.0) + dk_weighted * k_weight[:, None]
    kdk = e_gamma * tl.sum(dk_weighted * b_k, 1)
    dbeta += kdk
    d_gamma = tl.load(d_gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0) + b_beta * kdk

    # T = (I + A)^-1, A = beta_t e^(gamma_t - gamma_j) k_t.k_j strictly lower: dA = -T^T dT T^T, dA^T = -T dT^T T
    # (this order spills least at K = 128: 304 B against 784 B with dA^T first, sm_90, Triton 3.6)
    strictly_lower = (r[:, None] > r[None, :]) & row_mask[:, None]
    strictly_upper = (r[:, None] < r[None, :]) & row_mask[None, :]
    decay = tl.exp(tl.where(strictly_lower, gamma[:, None] - gamma[None, :], float("-inf")))
    decay_t = tl.exp(tl.where(strictly_upper, gamma[None, :] - gamma[:, None], float("-inf")))
    da = tl.dot(
        tl.dot(tl.trans(inverse), d_inverse, input_precision=PRECISION), tl.trans(inverse), input_precision=PRECISION
    )
    da_decay = tl.where(strictly_lower, -da, 0.0) * decay
    da_t = tl.where(strictly_upper, -tl.dot(u_du, inverse, input_precision=PRECISION), 0.0)
    kk = _dot_qk(b_k, b_k, k.dtype.element_ty, L2NORM, PRECISION)
    dbeta += tl.sum(da_decay * kk, 1)
    da_a = da_decay * kk * b_beta[:, None]
    d_gamma += tl.sum(da_a, 1) - tl.sum(da_a, 0)
    dkk = da_decay * b_beta[:, None]
    dkk_t = da_t * decay_t * b_beta[None, :]
    dk_new += tl.dot(dkk, b_k, input_precision=PRECISION) + tl.dot(dkk_t, b_k, input_precision=PRECISION)
    if L2NORM:
        dk_new = (dk_new - b_k * tl.sum(dk_new * b_k, 1)[:, None]) * k_rstd[:, None]
    tl.store(dk_out + heads, dk_new.to(dk_out.dtype.element_ty), mask=row_mask[:, None])

    tl.store(dbeta_out + rows * HV + i_hv, dbeta.to(dbeta_out.dtype.element_ty), mask=row_mask)
    _store_dg(dg_out, g, d_gamma, rows, row_mask, i_hv, HV)


# --------------------------------------------------------------------------- step 5 through dA = -T^T dU U^T
# T needs no dT of its own: with dw = -dU S^T, dT T^T = dU u^T + dw w^T = dU U^T, so dA = -T^T (dU U^T): one [BT, BT]
# accumulator over V blocks and one [BT, BT] dot (the single kernel above takes three). The rest splits into two parts
# that share only dA~ = dA * decay (strictly lower) and dbeta's part from v:
#   the values' part (_grad_wy_values), over V blocks: dv = diag(beta) T^T dU, dbeta's part, and dA~, stored (fp32);
#   the keys' part (_grad_wy_keys), over K blocks, from dA~ loaded once (a loaded tile may be transposed: see
#     triton_backward.py): dk += diag(beta e^gamma) T^T dw + (diag(beta) dA~ + dA~^T diag(beta)) K, dbeta, dgamma,
#     then the l2norm backward of k and dg.
# Tuning.grad_wy: "single" (_chunk_grad_wy_kernel) or "fused" (both parts in one program, dA~ through memory and a
# barrier). Which wins where, and their registers: docs/tuning/gated_delta_rule.md.


@triton.jit
def _grad_wy_values(
    v, corrections, du, inverse, b_beta, gamma, rows, row_mask, i_hv, dv_out, da_out,
    HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """The values' part: stores dv and dA * decay (rows past the end are not written), returns dbeta's part."""
    r = tl.arange(0, BT_)
    du_u = tl.zeros([BT_, BT_], dtype=tl.float32)  # dU U^T = dT T^T
    dbeta = tl.zeros([BT_], dtype=tl.float32)
    for i_v in range(0, V, BV):
        tokens = (rows[:, None] * HV + i_hv) * V + i_v + tl.arange(0, BV)[None, :]
        b_du = _operand(tl.load(du + tokens, mask=row_mask[:, None], other=0.0), HALF)
        b_corrections = _as_operand(tl.load(corrections + tokens, mask=row_mask[:, None], other=0.0), HALF)
        du_u += _storage_dot(b_du, tl.trans(b_corrections), PRECISION, HALF)
        dv_beta = _storage_dot(tl.trans(inverse), b_du, PRECISION, HALF)
        tl.store(dv_out + tokens, (dv_beta * b_beta[:, None]).to(dv_out.dtype.element_ty), mask=row_mask[:, None])
        b_v = tl.load(v + tokens, mask=row_mask[:, None], other=0.0).to(tl.float32)
        dbeta += tl.sum(dv_beta * b_v, 1)
    strictly_lower = (r[:, None] > r[None, :]) & row_mask[:, None]
    decay = tl.exp(tl.where(strictly_lower, gamma[:, None] - gamma[None, :], float("-inf")))
    da = _storage_dot(tl.trans(inverse), du_u, PRECISION, HALF)
    da_decay = tl.where(strictly_lower, -da, 0.0) * decay
    tl.store(da_out + (rows[:, None] * HV + i_hv) * BT_ + r[None, :], da_decay, mask=row_mask[:, None])
    return dbeta


@triton.jit
def _k_columns(k, rows, row_mask, i_h, c, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, HALF: tl.constexpr):
    """Columns c .. c + BK of a chunk's k rows as stored (0 past the end): as a product operand (_operand: with HALF
    the loaded bf16 tile itself, no fp32 copy to transpose and narrow) and in fp32."""
    columns = (rows[:, None] * H + i_h) * K + c + tl.arange(0, BK)[None, :]
    stored = tl.load(k + columns, mask=row_mask[:, None], other=0.0)
    return _operand(stored, HALF), stored.to(tl.float32)


@triton.jit
def _grad_wy_keys(
    k, dw_in, dk, d_gamma_in, g, da_in, inverse, b_beta, gamma, dbeta, rows, row_mask, i_h, i_hv, dk_out, dbeta_out,
    dg_out, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """The keys' part, given dbeta's part from the values and dA * decay in da_in: stores dk, dbeta and dg. Over
    blocks of BK columns of k twice (only [BT, BK] and [BT, BT] tiles live): first K K^T and per row (T^T dw).k,
    |k|^2 and dk.k; then dk = dk + (diag(beta) dA~ + dA~^T diag(beta)) K + diag(beta e^gamma) T^T dw and the l2norm
    backward, whose projection dk.k_n follows from the first pass's sums (T^T dw is computed in both passes)."""
    r = tl.arange(0, BT_)
    cols = tl.arange(0, BK)
    kk = tl.zeros([BT_, BT_], dtype=tl.float32)  # of k as stored (raw)
    kdk = tl.zeros([BT_], dtype=tl.float32)
    squares = tl.zeros([BT_], dtype=tl.float32)
    dk_k = tl.zeros([BT_], dtype=tl.float32)
    for c in range(0, K, BK):
        heads = (rows[:, None] * HV + i_hv) * K + c + cols[None, :]
        k_operand, raw = _k_columns(k, rows, row_mask, i_h, c, H, K, BK, HALF)
        kk += _storage_dot(k_operand, tl.trans(k_operand), PRECISION, HALF)  # half inputs: exact in tf32 (bf16: HALF)
        dw = _operand(tl.load(dw_in + heads, mask=row_mask[:, None], other=0.0), HALF)  # 16-bit where step 4 used HALF
        kdk += tl.sum(_storage_dot(tl.trans(inverse), dw, PRECISION, HALF) * raw, 1)
        if L2NORM:
            squares += tl.sum(raw * raw, 1)
            dk_k += tl.sum(tl.load(dk + heads, mask=row_mask[:, None], other=0.0) * raw, 1)
    if L2NORM:
        rstd = tl.rsqrt(squares + L2NORM_EPS)
        kk = kk * rstd[:, None] * rstd[None, :]
    else:
        rstd = tl.full([BT_], 1.0, tl.float32)

    # w = T diag(beta e^gamma) K
    e_gamma = tl.exp(gamma)
    kdk = e_gamma * rstd * kdk
    dbeta += kdk
    d_gamma = tl.load(d_gamma_in + rows * HV + i_hv, mask=row_mask, other=0.0) + b_beta * kdk

    # A = beta_t e^(gamma_t - gamma_j) k_t.k_j strictly lower, through dA~ = dA * decay as stored, and its transpose
    da_decay = tl.load(da_in + (rows[:, None] * HV + i_hv) * BT_ + r[None, :], mask=row_mask[:, None], other=0.0)
    da_kk = da_decay * kk
    dbeta += tl.sum(da_kk, 1)
    da_a_rows = b_beta * tl.sum(da_kk, 1)  # row and column sums of dA~ * A~ (A~ = diag(beta) kk): gamma_t's part
    da_a_cols = tl.sum(da_kk * b_beta[:, None], 0)  # and -gamma_j's
    d_gamma += da_a_rows - da_a_cols
    dkk = da_decay * b_beta[:, None] + tl.trans(da_decay) * b_beta[None, :]  # a loaded tile's transpose (see above)

    # dk; with k_n = diag(rstd) K the l2norm's dk.k_n per row is the sum of its three terms' (dk as loaded, through w
    # and through A): rstd dk.k, beta kdk and sum_j dkk_tj kk_tj = (row + column sums of dA~ * A~)_t
    projection = rstd * dk_k + b_beta * kdk + da_a_rows + da_a_cols
    dkk = dkk * rstd[None, :]  # dkk K_n = (dkk diag(rstd)) K
    k_weight = b_beta * e_gamma
    for c in range(0, K, BK):
        heads = (rows[:, None] * HV + i_hv) * K + c + cols[None, :]
        k_operand, raw = _k_columns(k, rows, row_mask, i_h, c, H, K, BK, HALF)
        dw = _operand(tl.load(dw_in + heads, mask=row_mask[:, None], other=0.0), HALF)
        dk_new = _storage_dot(dkk, k_operand, PRECISION, HALF, tl.load(dk + heads, mask=row_mask[:, None], other=0.0))
        dk_new += _storage_dot(tl.trans(inverse), dw, PRECISION, HALF) * k_weight[:, None]
        if L2NORM:  # x_n = x rstd: dx = (dx_n - x_n (dx_n . x_n)) rstd
            dk_new = (dk_new - raw * (rstd * projection)[:, None]) * rstd[:, None]
        tl.store(dk_out + heads, dk_new.to(dk_out.dtype.element_ty), mask=row_mask[:, None])

    tl.store(dbeta_out + rows * HV + i_hv, dbeta.to(dbeta_out.dtype.element_ty), mask=row_mask)
    _store_dg(dg_out, g, d_gamma, rows, row_mask, i_hv, HV)


@triton.jit
def _wy_program(
    beta, gamma_in, inverse_in, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """A (chunk, value head) program of step 5: _chunk_program's values, beta and T on the chunk's rows (T only
    enters products: _operand)."""
    i_t, i_hv, i_h, rows, row_mask, last_row, gamma = _chunk_program(
        gamma_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H, HV, IS_VARLEN
    )
    b_beta = tl.load(beta + rows * HV + i_hv, mask=row_mask, other=0.0).to(tl.float32)
    inverse_rows = (rows[:, None] * HV + i_hv) * BT_ + tl.arange(0, BT_)[None, :]
    inverse = tl.load(inverse_in + inverse_rows, mask=row_mask[:, None], other=0.0)
    return i_hv, i_h, rows, row_mask, gamma, b_beta, _operand(inverse, HALF)


@direct_launch
@triton.jit(do_not_specialize=["T", "N_CHUNKS"])
def _chunk_grad_wy_fused_kernel(
    k, v, beta, gamma_in, inverse_in, corrections, dw_in, du, dk, d_gamma_in, g, da_scratch,
    dk_out, dv_out, dbeta_out, dg_out, cu_seqlens, chunk_indices, T, N_CHUNKS,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Step 5 "fused" (Tuning.grad_wy): both parts in one program, dA * decay through da_scratch (read back by other threads)."""
    i_hv, i_h, rows, row_mask, gamma, b_beta, inverse = _wy_program(
        beta, gamma_in, inverse_in, cu_seqlens, chunk_indices, T, N_CHUNKS, H, HV, IS_VARLEN, HALF
    )
    dbeta = _grad_wy_values(
        v, corrections, du, inverse, b_beta, gamma, rows, row_mask, i_hv, dv_out, da_scratch, HV, V, BV, PRECISION, HALF
    )
    tl.debug_barrier()  # the program's stores of dA * decay before its loads
    _grad_wy_keys(
        k, dw_in, dk, d_gamma_in, g, da_scratch, inverse, b_beta, gamma, dbeta, rows, row_mask, i_h, i_hv, dk_out,
        dbeta_out, dg_out, H, HV, K, BK, L2NORM, PRECISION, HALF,
    )  # fmt: skip


def _grad_wy(inputs: tuple, outputs: tuple, chunks: Chunks, T: int, shared: dict, variant: str) -> None:
    """Step 5 as `variant` ("single" or "fused", Tuning.step5): inputs (k, v, beta, gamma, inverse, corrections, dw,
    du, dk, d_gamma, g), outputs (dk_out, dv, dbeta, dg); `shared`, the constexprs of the qk kernel with step 5's HALF
    (Tuning.half_step5)."""
    k, v, beta, gamma, inverse, corrections, dw, du, dk, d_gamma, g = inputs
    dk_out, dv, dbeta, dg = outputs
    K, V, precision = shared["K"], shared["V"], shared["PRECISION"]
    tail = (chunks.cu, chunks.indices, T, chunks.per_sequence)
    grid = (chunks.total, shared["HV"])
    if variant == "single":
        tf32 = {name: value for name, value in shared.items() if name != "HALF"}  # see Tuning.half_backward
        _chunk_grad_wy_kernel[grid](*inputs, *outputs, *tail, **_grad_launch(K, V), **tf32)
        return
    da = buffers.empty(inverse.shape, dtype=torch.float32, device=inverse.device)  # dA * decay per chunk
    _chunk_grad_wy_fused_kernel[grid](*inputs, da, *outputs, *tail, **_grad_wy_launch(K, V, precision), **shared)
