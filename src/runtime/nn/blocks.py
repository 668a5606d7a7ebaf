"""Pre-norm residual blocks: attention or gated-delta-rule mixing, then a SwiGLU feed-forward."""

from __future__ import annotations

import torch
from torch import nn

from .attention import MultiHeadAttention
from .feedforward import SwiGLUFeedForward
from .gated_delta import GatedDeltaRuleMixer
from .norms import RMSNorm
from .residual import DropoutAdd


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)); residual dropout on both branches."""

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, *, causal: bool = False, dropout: float = 0.0, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, causal=causal, dropout=attn_dropout)
        self.ffn_norm = RMSNorm(d_model)
        self.ffn = SwiGLUFeedForward(d_model, ffn_hidden)
        self.residual = DropoutAdd(dropout)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = self.residual(self.attn(self.attn_norm(x), key_lengths), x)
        return self.residual(self.ffn(self.ffn_norm(x)), x)


class GatedDeltaBlock(nn.Module):
    """x + gdr(norm(x)), then x + ffn(norm(x)). Causal; padding after a row's length does not reach earlier tokens."""

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(d_model)
        self.mixer = GatedDeltaRuleMixer(d_model, n_heads)
        self.ffn_norm = RMSNorm(d_model)
        self.ffn = SwiGLUFeedForward(d_model, ffn_hidden)
        self.residual = DropoutAdd(dropout)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = self.residual(self.mixer(self.mixer_norm(x)), x)
        return self.residual(self.ffn(self.ffn_norm(x)), x)
