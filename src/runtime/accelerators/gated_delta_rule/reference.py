"""Gated delta rule in plain torch: the step-by-step recurrence (ground truth) and the chunked form.

Semantics of flash-linear-attention. For every sequence and value head, with the state S [K, V]
(fp32, float64 for float64 inputs) and each step t:

    S   <- exp(g_t) * S                         (g is the log decay)
    u_t  = beta_t * (v_t - S^T k_t)             (the delta rule's correction, on the decayed state)
    S   <- S + k_t u_t^T
    o_t  = scale * S^T q_t

q/k are [B, T, H, K] and v is [B, T, HV, V]: value head hv reads q/k head hv // (HV // H) (GVA).
With cu_seqlens (B == 1) the T axis packs N sequences, each starting from its own initial state.

The chunked form (the torch backend) is the same math over chunks of C steps. Within a chunk, with
gamma the local cumulative sum of g and S0 the state entering the chunk:

    A[t, j]  = beta_t exp(gamma_t - gamma_j) k_t.k_j      for j < t (strictly lower)
    (I + A) U = diag(beta) V - diag(beta exp(gamma)) K S0   (U: the chunk's corrections u_t)
    WY form:  U = u - w S0,  u = (I + A)^-1 diag(beta) V,  w = (I + A)^-1 diag(beta exp(gamma)) K
    O        = scale * (diag(exp(gamma)) Q S0 + (Q K^T * exp(gamma_t - gamma_j))_{j <= t} U)
    S_next   = exp(gamma_last) S0 + (K * exp(gamma_last - gamma))^T U

Full decays: a step with g <= -FULL_DECAY (g = -inf included) erases the state, as exp(g) = 0 does in the
recurrence. gamma does not sum such a g (-inf would make gamma_t - gamma_j = -inf - -inf = NaN, and a huge finite
g drowns the other g's of the chunk in fp32): it steps down by exactly FULL_DECAY instead (local_gamma). Every
factor above is exp of a difference gamma_i - gamma_j (i >= j) or of gamma_t itself (gamma before the chunk = 0),
so a full decay between j and i puts at least -FULL_DECAY in the exponent, where exp is 0 in fp32 (and 1e-56 in
float64): the same for the output's exp(gamma_t), the state decay exp(gamma_last) and the corrections' factors.
g > 0 (growth) is outside the contract (chunk_gated_delta_rule rejects it on CPU tensors).

Both are differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import compute_dtype
from ..l2norm.reference import l2norm_reference

CHUNK_SIZE = 64
# A log decay at or below -FULL_DECAY is a full decay (exp(g) < 1e-55, far below fp32's resolution of the state).
# 128 = 2^7: exp(-128) = 2.6e-56 is below fp32's smallest denormal (1.4e-45), so a difference of gammas across a
# full decay gives exactly 0 in fp32; a gamma after z full decays is the sum of the other g's minus 128 z, rounded
# once (error at most ulp(128 z + |sum|): 1.5e-5 after one full decay, against the 1e-4 bound).
FULL_DECAY = 128.0


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Inputs in the compute dtype, q/k expanded to the value heads, q scaled."""
    dtype = compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_reference(q, 1e-6), l2norm_reference(k, 1e-6)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta


def _initial(initial_state, n: int, heads: int, K: int, V: int, like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(n, heads, K, V)
    return initial_state.to(like.dtype)


def _segments(cu_seqlens, batch: int, length: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _no_steps(q, k, v, g, beta):
    """The output of zero time steps ([N, 0, HV, V]): empty, but in the graph of q, k, v, g and beta, so that a
    backward through it runs and gives them their (empty) gradients."""
    return v + (q.sum(-1) + k.sum(-1) + g + beta)[..., None]


def _finish(o, state, q, output_final_state):
    return o.to(q.dtype), (state if output_final_state else None)


# --------------------------------------------------------------------------- recurrent


def _recurrent(q, k, v, g, beta, state):
    """q/k [N, T, HV, K], v [N, T, HV, V], g/beta [N, T, HV] (compute dtype, q scaled), state [N, HV, K, V]."""
    if q.shape[1] == 0:  # an empty sequence of a varlen batch
        return _no_steps(q, k, v, g, beta), state
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        correction = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], state))
    o = torch.stack(outputs, 1)
    return o, state


def recurrent_gated_delta_rule_reference(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
):
    """The step-by-step recurrence: returns (o [B, T, HV, V] in q's dtype, final state [N, HV, K, V] or None)."""
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, HV, K = ks.shape
    V = vs.shape[-1]
    if T == 0:
        state = _initial(initial_state, len(_segments(cu_seqlens, B, T)), HV, K, V, vs)
        return _finish(_no_steps(qs, ks, vs, gs, bs), state, q, output_final_state)
    if cu_seqlens is None:
        o, state = _recurrent(qs, ks, vs, gs, bs, _initial(initial_state, B, HV, K, V, vs))
        return _finish(o, state, q, output_final_state)
    segments = _segments(cu_seqlens, B, T)
    states = _initial(initial_state, len(segments), HV, K, V, vs)
    outputs, finals = [], []
    for n, (_, start, end) in enumerate(segments):
        pieces = (x[:, start:end] for x in (qs, ks, vs, gs, bs))
        o, state = _recurrent(*pieces, states[n : n + 1])
        outputs.append(o)
        finals.append(state)
    o = torch.cat(outputs, 1)
    state = torch.cat(finals, 0)
    return _finish(o, state, q, output_final_state)


# --------------------------------------------------------------------------- chunked


def _chunked(q, k, v, g, beta, state, chunk: int):
    """Like _recurrent, over chunks of `chunk` steps; T must be a multiple of `chunk`."""
    N, T, HV, K = k.shape
    V = v.shape[-1]
    n_chunks = T // chunk

    def blocks(x):  # [N, T, HV, ...] -> [N, HV, n_chunks, chunk, ...]
        x = x.reshape(N, n_chunks, chunk, HV, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    gamma = local_gamma(g)
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    causal = ones.tril()
    # exp(gamma_t - gamma_j) for j <= t, zero above the diagonal (masked before exp: no overflow)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~ones.tril(-1), 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # noqa: E731
    w = solve((beta * gamma.exp())[..., None] * k)
    u = solve(beta[..., None] * v)
    attention = (q @ k.transpose(-1, -2)) * decay
    last = gamma[..., -1]
    k_to_end = k * (last[..., None] - gamma).exp()[..., None]
    outputs = []
    for c in range(n_chunks):
        corrections = u[:, :, c] - w[:, :, c] @ state
        outputs.append((q[:, :, c] * gamma[:, :, c, :, None].exp()) @ state + attention[:, :, c] @ corrections)
        state = last[:, :, c, None, None].exp() * state + k_to_end[:, :, c].transpose(-1, -2) @ corrections
    o = torch.stack(outputs, 2)
    return o.permute(0, 2, 3, 1, 4).reshape(N, T, HV, V), state


def local_gamma(g: torch.Tensor) -> torch.Tensor:
    """The chunk's cumulative log decay along the last axis, a full decay (g <= -FULL_DECAY) counted as exactly
    -FULL_DECAY (its g gets no gradient: d exp(g) / dg = exp(g) = 0 there in the recurrence)."""
    full = g <= -FULL_DECAY
    return torch.where(full, 0.0, g).cumsum(-1) - FULL_DECAY * full.to(g.dtype).cumsum(-1)


def _pad_time(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 to `length` (zero g, beta and k leave the state unchanged)."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def chunk_gated_delta_rule_reference(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    chunk_size: int = CHUNK_SIZE,
):
    """The chunked form (the torch backend); same arguments and results as the recurrent reference."""
    qs, ks, vs, gs, bs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, HV, K = ks.shape
    V = vs.shape[-1]
    segments = _segments(cu_seqlens, B, T)
    state = _initial(initial_state, len(segments), HV, K, V, vs)
    if T == 0:
        return _finish(_no_steps(qs, ks, vs, gs, bs), state, q, output_final_state)
    if cu_seqlens is None:
        padded = -(-T // chunk_size) * chunk_size
        o, state = _chunked(*(_pad_time(x, padded) for x in (qs, ks, vs, gs, bs)), state, chunk_size)
        return _finish(o[:, :T], state, q, output_final_state)
    # varlen: gather the sequences into a zero-padded batch [N, padded, ...], run it, gather back
    longest = max((end - start for _, start, end in segments), default=0)
    padded = -(-longest // chunk_size) * chunk_size
    index = torch.zeros(len(segments), padded, dtype=torch.long)
    valid = torch.zeros(len(segments), padded, dtype=torch.bool)
    for n, (_, start, end) in enumerate(segments):
        index[n, : end - start] = torch.arange(start, end)
        valid[n, : end - start] = True
    index, valid = index.to(q.device), valid.to(q.device)

    def gather(x):  # a select, not a product with the mask: padding picks row 0, whose g may be -inf
        picked = x[0][index]
        return torch.where(valid.view(*valid.shape, *([1] * (picked.dim() - 2))), picked, 0.0)

    o, state = _chunked(*(gather(x) for x in (qs, ks, vs, gs, bs)), state, chunk_size)
    o = o.reshape(-1, HV, V)[valid.reshape(-1)].unsqueeze(0)
    return _finish(o, state, q, output_final_state)


def unit_lower_inverse_by_columns(a: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 of strictly lower A [..., n, n] as the TileLang prepare kernel forms it: forward substitution,
    X[i, j] = [i = j] - sum_{m < i} A[i, m] X[m, j], each column on its own (a thread per column), the sum over m
    in four partial sums by m mod 4, each accumulated in order of m in a's dtype, then added as (s0 + s1) + (s2 + s3)."""
    n = a.shape[-1]
    x = torch.zeros_like(a)
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    for i in range(n):
        partial = [torch.zeros_like(a[..., i, :]) for _ in range(4)]
        for m in range(i):
            partial[m % 4] = partial[m % 4] - a[..., i, m, None] * x[..., m, :]
        x[..., i, :] = eye[i] + ((partial[0] + partial[1]) + (partial[2] + partial[3]))
    return x


def _l2norm_backward(dx_n: torch.Tensor, raw: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d raw of x_n = raw rstd: (dx_n - x_n (dx_n . x_n)) rstd, with x_n . dx_n = rstd (raw . dx_n)."""
    projection = (dx_n * raw).sum(-1, keepdim=True) * rstd * rstd
    return (dx_n - raw * projection) * rstd


def chunked_backward_stages(q, k, v, g, beta, scale, initial_state, grad_o, grad_final, l2norm: bool, operand=None):
    """The TileLang chunked backward's stages (tilelang_backward.py) in torch, on one sequence per batch row, HV = H
    and T a multiple of CHUNK_SIZE: the same decompositions (raw q/k rows with the l2norm's rsqrt factors folded
    into the other operand, dA = -T^T (dU U^T), dgamma by row and column sums, dS_last on the chunk's last row) in the
    inputs' dtype, for a float64 check against autograd. `operand` (None: exact) rounds what the kernels take as 16-bit
    product operands or store in 16 bits, the forward's w, u and states included. Returns (dq, dk, dv, dg, dbeta,
    d(initial_state))."""
    B, T, H, K = q.shape
    V, C = v.shape[-1], CHUNK_SIZE
    n_chunks = T // C
    op = operand or (lambda x: x)

    def blocks(x):  # [B, T, H, ...] -> [B, H, n_chunks, C, ...]
        x = x.reshape(B, n_chunks, C, H, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta, grad_o = (blocks(x) for x in (q, k, v, g, beta, grad_o))
    ones = lambda x: torch.ones_like(x[..., 0])  # noqa: E731
    rq = torch.rsqrt((q * q).sum(-1) + 1e-6) if l2norm else ones(q)
    rk = torch.rsqrt((k * k).sum(-1) + 1e-6) if l2norm else ones(k)
    gamma = local_gamma(g)
    last = gamma[..., -1:]
    e_gamma, to_end = gamma.exp(), (last - gamma).exp()
    rows = torch.arange(C, device=q.device)
    causal, strict = rows[:, None] >= rows[None, :], rows[:, None] > rows[None, :]
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * rk[..., :, None] * rk[..., None, :]
    a = (beta[..., None] * kk * decay).masked_fill(~strict, 0.0)
    inverse = torch.linalg.inv(torch.eye(C, dtype=q.dtype, device=q.device) + a)
    w = op(inverse) @ op((beta * e_gamma * rk)[..., None] * k)
    u = op(inverse) @ op(beta[..., None] * v)
    # 0: the states entering each chunk and the corrections U
    state = initial_state.to(q.dtype) if initial_state is not None else q.new_zeros(B, H, K, V)
    states, corrections = [], []
    for c in range(n_chunks):
        states.append(op(state))
        corrections.append(u[:, :, c] - op(w[:, :, c]) @ states[-1])
        scaled = op(corrections[-1] * (to_end[:, :, c] * rk[:, :, c])[..., None])
        state = last[:, :, c, :, None].exp() * state + k[:, :, c].transpose(-1, -2) @ scaled
    states, corrections = torch.stack(states, 2), op(torch.stack(corrections, 2))
    # 1: dU_local = scale P^T dO and the walk's row factors
    q_factor, k_factor = scale * e_gamma * rq, to_end * rk
    attention_t = (k @ q.transpose(-1, -2)) * (decay * rq[..., :, None] * rk[..., None, :]).transpose(-1, -2) * scale
    du_local = op(op(attention_t) @ grad_o)
    # 2: the reverse walk
    dstate = grad_final.to(q.dtype) if grad_final is not None else q.new_zeros(B, H, K, V)
    dstates, du = [None] * n_chunks, [None] * n_chunks
    for c in reversed(range(n_chunks)):
        dstates[c] = op(dstate)
        du_fp32 = du_local[:, :, c] + k_factor[:, :, c, :, None] * (k[:, :, c] @ dstates[c])
        du[c] = op(du_fp32)
        dstate = (
            last[:, :, c, :, None].exp() * dstate
            + q[:, :, c].transpose(-1, -2) @ op(q_factor[:, :, c, :, None] * grad_o[:, :, c])
            - op(w[:, :, c]).transpose(-1, -2) @ du[c]
        )
    dstates, du = torch.stack(dstates, 2), torch.stack(du, 2)
    # 3: the products with the states; dq, and the output's and S''s parts of dk and dgamma
    dq_state = grad_o @ states.transpose(-1, -2)
    dk_state = corrections @ dstates.transpose(-1, -2)
    dw = op(-(du @ states.transpose(-1, -2)))
    dp = (grad_o @ corrections.transpose(-1, -2)) * decay * scale
    m = dp * (q @ k.transpose(-1, -2)) * rq[..., :, None] * rk[..., None, :]
    k_term = to_end * rk * (dk_state * k).sum(-1)
    d_gamma = q_factor * (dq_state * q).sum(-1) + m.sum(-1) - m.sum(-2) - k_term
    d_gamma[..., -1] += last[..., 0].exp() * (states * dstates).sum((-1, -2)) + k_term.sum(-1)
    dq = dq_state * (scale * e_gamma)[..., None] + op(dp * rk[..., None, :]) @ k  # of the normalised rows
    dk = dk_state * to_end[..., None] + op(dp * rq[..., :, None]).transpose(-1, -2) @ q
    # 4: through u, w and T
    inverse_t = op(inverse).transpose(-1, -2)
    du_u = du @ corrections.transpose(-1, -2)
    dv_beta = inverse_t @ du
    da = -(inverse_t @ op(du_u)) * decay.masked_fill(~strict, 0.0)
    dk_w = inverse_t @ dw
    k_dkw = e_gamma * rk * (dk_w * k).sum(-1)
    m = da * kk
    a_rows, a_cols = m.sum(-1), (m * beta[..., None]).sum(-2)
    dkk = (da * beta[..., :, None] + da.transpose(-1, -2) * beta[..., None, :]) * rk[..., None, :]
    dk = dk + dk_w * (beta * e_gamma)[..., None] + op(dkk) @ k
    dbeta = (dv_beta * v).sum(-1) + k_dkw + a_rows
    d_gamma = d_gamma + beta * (k_dkw + a_rows) - a_cols
    dg = d_gamma.flip(-1).cumsum(-1).flip(-1).masked_fill(g <= -FULL_DECAY, 0.0)
    if l2norm:
        dq, dk = _l2norm_backward(dq, q, rq[..., None]), _l2norm_backward(dk, k, rk[..., None])

    def unblock(x):  # [B, H, n_chunks, C, ...] -> [B, T, H, ...]
        return x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(B, T, H, *x.shape[4:])

    dv = dv_beta * beta[..., None]
    return (*(unblock(x) for x in (dq, dk, dv, dg, dbeta)), dstate)
