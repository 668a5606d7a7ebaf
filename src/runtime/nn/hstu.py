"""HSTUBlock: the HSTU layer (pointwise SiLU attention with relative position and time biases, gated by U) on
packed sequences."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.backends import Backend
from runtime.accelerators.checks import as_int, as_probability, check_bool
from runtime.accelerators.silu_attention import silu_attention

from .linear import Linear
from .norms import LayerNorm
from .residual import DropoutAdd

BIAS_INIT_STD = 0.02


class HSTUBlock(nn.Module):
    """One HSTU layer over packed sequences x [total, d_model] (sequence s is rows cu_seqlens[s]:cu_seqlens[s + 1]):

        u, v, q, k = split(silu(W_uvqk layer_norm(x) + b))          one projection, H * head_dim columns each
        a          = silu_attention(q, k, v, position and time biases, causal, num_targets)
        out        = x + dropout(W_o (layer_norm(a) * u) + b_o)

    The relative position bias [H, position_buckets] is indexed by min(|i - j|, position_buckets - 1), the time
    bias [H, time_buckets] by min(floor(log2(1 + |t_i - t_j|)), time_buckets - 1) of the timestamps (seconds);
    0 buckets leaves that bias out. With num_targets the last num_targets[s] tokens of sequence s are candidates,
    seen by no token but themselves. The layer norm of `a` runs over all heads together (H * head_dim).
    attn_dropout is dropout on the attention weights; both dropouts act in training only.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int | None = None,
        position_buckets: int = 256,
        time_buckets: int = 64,
        dropout: float = 0.0,
        *,
        attn_dropout: float = 0.0,
        causal: bool = True,
        backend: Backend | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        d_model = as_int("d_model", d_model, least=1, expected="an int >= 1")
        n_heads = as_int("n_heads", n_heads, least=1, expected="an int >= 1")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"head_dim: None takes d_model // n_heads, but n_heads={n_heads} does not divide d_model={d_model}; pass head_dim"
                )
            head_dim = d_model // n_heads
        head_dim = as_int("head_dim", head_dim, least=1, expected="None or an int >= 1")
        expected = "an integer >= 0 (0: no such bias)"
        position_buckets = as_int("position_buckets", position_buckets, least=0, expected=expected)
        time_buckets = as_int("time_buckets", time_buckets, least=0, expected=expected)
        attn_dropout = as_probability("attn_dropout", attn_dropout)
        check_bool("causal", causal)
        factory = {"device": device, "dtype": dtype}
        self.n_heads, self.head_dim = n_heads, head_dim
        self.causal = causal
        self.attn_dropout = attn_dropout
        self.backend = backend  # silu_attention's backend; None follows the active config
        width = n_heads * head_dim
        self.input_norm = LayerNorm(d_model, **factory)
        self.uvqk = Linear(d_model, 4 * width, activation="silu", **factory)
        self.position_bias = (
            nn.Parameter(torch.empty(n_heads, position_buckets, **factory)) if position_buckets else None
        )
        self.time_bias = nn.Parameter(torch.empty(n_heads, time_buckets, **factory)) if time_buckets else None
        self.output_norm = LayerNorm(width, **factory)
        self.out = Linear(width, d_model, **factory)
        self.residual = DropoutAdd(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for bias in (self.position_bias, self.time_bias):
            if bias is not None:
                nn.init.normal_(bias, std=BIAS_INIT_STD)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        timestamps: torch.Tensor | None = None,
        num_targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [total, d_model]; cu_seqlens int [N + 1]; max_seqlen >= every sequence's length; timestamps int64
        [total] (needed with a time bias); num_targets int [N] or None. Returns [total, d_model]."""
        if x.dim() != 2:
            raise ValueError(f"x: expected packed tokens [total, d_model], got shape {tuple(x.shape)}")
        if self.time_bias is not None and timestamps is None:
            raise ValueError("timestamps: required by the time bias (time_buckets > 0); pass int64 [total] seconds")
        total = x.shape[0]
        u, v, q, k = self.uvqk(self.input_norm(x)).split(self.n_heads * self.head_dim, dim=-1)
        heads = (total, self.n_heads, self.head_dim)
        a = silu_attention(
            q.reshape(heads),
            k.reshape(heads),
            v.reshape(heads),
            cu_seqlens,
            max_seqlen=max_seqlen,
            causal=self.causal,
            num_targets=num_targets,
            position_bias=self.position_bias,
            time_bias=self.time_bias,
            timestamps=timestamps if self.time_bias is not None else None,
            dropout_p=self.attn_dropout if self.training else 0.0,
            backend=self.backend,
        )
        gated = self.output_norm(a.reshape(total, self.n_heads * self.head_dim)) * u
        return self.residual(self.out(gated), x)

    def extra_repr(self) -> str:
        p = 0 if self.position_bias is None else self.position_bias.shape[1]
        t = 0 if self.time_bias is None else self.time_bias.shape[1]
        return f"heads={self.n_heads}, head_dim={self.head_dim}, position_buckets={p}, time_buckets={t}, causal={self.causal}, backend={self.backend}"
