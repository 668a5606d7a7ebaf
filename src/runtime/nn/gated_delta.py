"""A Gated DeltaNet sequence mixer on the chunk_gated_delta_rule op.

Per head, with a state S [K, V] carried along the sequence (flash-linear-attention semantics):

    S_t = exp(g_t) * S_{t-1}                              g_t <= 0 is a log-decay
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        a delta-rule write with strength beta_t
    o_t = scale * S_t^T q_t
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int
from runtime.accelerators.gated_delta_rule import chunk_gated_delta_rule
from runtime.accelerators.l2norm import l2norm
from runtime.accelerators.swiglu import swiglu

from .linear import Linear
from .norms import RMSNorm


class GatedDeltaRuleMixer(nn.Module):
    """A Gated DeltaNet token mixer: x [B, T, d_model] -> [B, T, d_model], causal by construction.

    q, k, v projections (SiLU, q and k L2-normalised per head), a per-head data-dependent decay
    g = -exp(A_log) * softplus(x W_a + dt_bias) and write strength beta = sigmoid(x W_b), the gated
    delta rule, then a per-head RMSNorm gated by SiLU(x W_gate) and an output projection.
    The projections (the q/k/v SiLU fused into theirs), the rule, the norms, the L2 norms and the gate all run on the
    accelerator ops.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        *,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        d_model = as_int("d_model", d_model, least=1, expected="an int >= 1")
        n_heads = as_int("n_heads", n_heads, least=1, expected=f"a positive divisor of d_model={d_model}")
        if head_dim is None and d_model % n_heads != 0:
            raise ValueError(
                f"n_heads: expected a positive divisor of d_model={d_model} (or give head_dim), got {n_heads}"
            )
        if head_dim is not None:  # 0 was read as "not given" and a negative one failed deep in Linear
            head_dim = as_int("head_dim", head_dim, least=1, expected="None or an int >= 1")
        self.n_heads = n_heads
        self.head_dim = head_dim if head_dim is not None else d_model // n_heads
        self.backend = backend
        width = n_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.qkv = Linear(d_model, 3 * width, bias=False, activation="silu", backend=backend, **factory)  # silu fused
        self.gate = Linear(d_model, width, bias=False, backend=backend, **factory)
        self.decay_beta = Linear(d_model, 2 * n_heads, bias=False, backend=backend, **factory)
        self.A_log = nn.Parameter(torch.empty(n_heads, **factory))
        self.dt_bias = nn.Parameter(torch.empty(n_heads, **factory))
        self.reset_parameters()
        self.norm = RMSNorm(self.head_dim, backend=backend, **factory)
        self.out = Linear(width, d_model, bias=False, backend=backend, **factory)

    def reset_parameters(self) -> None:
        """A_log and dt_bias (the projections and the norm reset their own): decay rates spread over heads (as in
        Mamba-2 / Gated DeltaNet), A in [1, 16], dt in [1e-3, 1e-1]."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"x: expected a padded batch [B, T, d_model], got shape {tuple(x.shape)}")
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        q, k, v = (z.view(b, t, h, d) for z in self.qkv(x).chunk(3, dim=-1))
        q, k = l2norm(q, backend=self.backend), l2norm(k, backend=self.backend)
        gates = self.decay_beta(x)
        dtype = torch.promote_types(gates.dtype, torch.float32)  # decays in fp32 at least (bf16 under autocast)
        a, beta_logits = gates.to(dtype).chunk(2, dim=-1)
        g = -self.A_log.to(dtype).exp() * F.softplus(a + self.dt_bias.to(dtype))
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta_logits.sigmoid(), backend=self.backend)
        gate = self.gate(x).view(b, t, h, d)
        o = swiglu(gate, self.norm(o).to(gate.dtype), backend=self.backend)  # silu(gate) * norm(o)
        return self.out(o.reshape(b, t, h * d))
