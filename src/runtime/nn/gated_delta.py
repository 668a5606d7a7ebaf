"""The gated delta rule (Gated DeltaNet) in plain torch, and a sequence-mixer module built on it.

Per head, with a state S [K, V] carried along the sequence (flash-linear-attention semantics):

    S_t = exp(g_t) * S_{t-1}                              g_t <= 0 is a log-decay
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        a delta-rule write with strength beta_t
    o_t = scale * S_t^T q_t

The accelerators package has no gated-delta-rule op yet, so the mixer runs the chunked torch
formulation below (autograd gives the backward). Its signature follows the planned
`chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state)`, so the mixer
can switch to that op, and its backends, once it lands.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.l2norm import l2norm
from runtime.accelerators.swiglu import swiglu

from .norms import RMSNorm


def _check_rule_inputs(q, k, v, g, beta) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected two tensors of one shape [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v: expected shape [B, T, H, V] with B, T, H of q {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name}: expected shape [B, T, H] = {tuple(q.shape[:3])}, got {tuple(x.shape)}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gated_delta_rule_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """The rule one step at a time: the readable definition (a test oracle; slow for long sequences).

    q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; state [B, H, K, V]. Returns (o [B, T, H, V]
    in v's dtype, final state in fp32 or None).
    """
    _check_rule_inputs(q, k, v, g, beta)
    b, t, h, dk = q.shape
    dtype, out_dtype = _compute_dtype(v), v.dtype
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        update = beta[:, i, :, None] * (v[:, i] - predicted)
        state = state + k[:, i, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.to(out_dtype), (state.float() if output_final_state else None)


def gated_delta_rule_chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """The same rule in chunks of `chunk_size`: matmuls inside a chunk, a recurrence only across chunks.

    Inside a chunk with cumulative log-decay G_t (from the chunk start), unrolling the recurrence gives
    the writes U = (I + A)^-1 (beta V - beta exp(G) K S0) with A[t, s] = beta_t exp(G_t - G_s) k_t.k_s
    (s < t): one unit-lower-triangular solve per chunk. Outputs and the next state follow from U:
        O = scale (exp(G) Q S0 + (Q K^T * D) U),  S_C = exp(G_C) S0 + (K exp(G_C - G))^T U
    with D[t, s] = exp(G_t - G_s) for s <= t. Arguments and results as gated_delta_rule_recurrent.
    """
    _check_rule_inputs(q, k, v, g, beta)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    dtype, out_dtype = _compute_dtype(v), v.dtype
    scale = dk**-0.5 if scale is None else scale
    c = max(1, min(chunk_size, t))  # a short sequence is one chunk of its own length
    n = max(1, math.ceil(t / c))
    pad = n * c - t

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, H, N, C, ...]; zero padding makes the padded steps leave the state as it is
        x = x.to(dtype).transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(b, h, n, c, *x.shape[3:])

    q, k, v, g, beta = chunks(q * scale), chunks(k), chunks(v), chunks(g), chunks(beta)
    gamma = g.cumsum(-1)  # [B, H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, gamma[..., :, None] - gamma[..., None, :], -math.inf).exp()  # D, zero above the diagonal
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    lower = a + torch.eye(c, dtype=dtype, device=q.device)
    u_from_v = torch.linalg.solve_triangular(lower, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, (beta * gamma.exp())[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for i in range(n):
        u = u_from_v[:, :, i] - w[:, :, i] @ state
        outputs.append((q[:, :, i] * gamma[:, :, i, :, None].exp()) @ state + scores[:, :, i] @ u)
        last = gamma[:, :, i, -1]
        k_to_end = k[:, :, i] * (last[..., None] - gamma[:, :, i]).exp()[..., None]
        state = state * last.exp()[..., None, None] + k_to_end.transpose(-1, -2) @ u
    o = torch.stack(outputs, dim=2).reshape(b, h, n * c, dv)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), (state.float() if output_final_state else None)


class GatedDeltaRuleMixer(nn.Module):
    """A Gated DeltaNet token mixer: x [B, T, d_model] -> [B, T, d_model], causal by construction.

    q, k, v projections (SiLU, q and k L2-normalised per head), a per-head data-dependent decay
    g = -exp(A_log) * softplus(x W_a + dt_bias) and write strength beta = sigmoid(x W_b), the gated
    delta rule, then a per-head RMSNorm gated by SiLU(x W_gate) and an output projection.
    Norms, L2 norms and the gate run on the accelerator ops; the rule itself is the torch chunked form.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, *, chunk_size: int = 64, backend: Backend | None = None) -> None:
        super().__init__()
        if n_heads <= 0 or (head_dim is None and d_model % n_heads != 0):
            raise ValueError(f"n_heads: expected a positive divisor of d_model={d_model} (or give head_dim), got {n_heads}")
        self.n_heads = n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.chunk_size = chunk_size
        self.backend = backend
        width = n_heads * self.head_dim
        self.qkv = nn.Linear(d_model, 3 * width, bias=False)
        self.gate = nn.Linear(d_model, width, bias=False)
        self.decay_beta = nn.Linear(d_model, 2 * n_heads, bias=False)
        # decay rates spread over heads (as in Mamba-2 / Gated DeltaNet): A in [1, 16], dt in [1e-3, 1e-1]
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))
        dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.norm = RMSNorm(self.head_dim, backend=backend)
        self.out = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        q, k, v = (F.silu(z).view(b, t, h, d) for z in self.qkv(x).chunk(3, dim=-1))
        q, k = l2norm(q, backend=self.backend), l2norm(k, backend=self.backend)
        gates = self.decay_beta(x)
        dtype = torch.promote_types(gates.dtype, torch.float32)  # decays in fp32 at least (bf16 under autocast)
        a, beta_logits = gates.to(dtype).chunk(2, dim=-1)
        g = -self.A_log.to(dtype).exp() * F.softplus(a + self.dt_bias.to(dtype))
        o, _ = gated_delta_rule_chunked(q, k, v, g, beta_logits.sigmoid(), chunk_size=self.chunk_size)
        gate = self.gate(x).view(b, t, h, d)
        o = swiglu(gate, self.norm(o).to(gate.dtype), backend=self.backend)  # silu(gate) * norm(o)
        return self.out(o.reshape(b, t, h * d))
