"""Pre-norm blocks: attention or gated-delta-rule mixing, then a SwiGLU feed-forward, each branch joined
to the stream by a residual with dropout or, with `hyper_streams` > 0, by an mHC hyper-connection
(the block then takes and returns [..., n, C] streams)."""

from __future__ import annotations

import torch
from torch import nn

from .attention import MultiHeadAttention
from .feedforward import SwiGLUFeedForward
from .gated_delta import GatedDeltaRuleMixer
from .hyper_connections import HyperConnection
from .norms import RMSNorm
from .residual import DropoutAdd


class PreNorm(nn.Module):
    """layer(norm(x), *args)."""

    def __init__(self, width: int, layer: nn.Module, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = RMSNorm(width, device=device, dtype=dtype)
        self.layer = layer

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self.layer(self.norm(x), *args)


class Residual(nn.Module):
    """x + dropout(branch(x, *args))."""

    def __init__(self, branch: nn.Module, dropout: float) -> None:
        super().__init__()
        self.branch = branch
        self.add = DropoutAdd(dropout)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self.add(self.branch(x, *args), x)


def connect(branch: nn.Module, width: int, dropout: float, hyper_streams: int, factory: dict) -> nn.Module:
    return HyperConnection(branch, hyper_streams, width, **factory) if hyper_streams else Residual(branch, dropout)


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)). x [B, L, d] with key_lengths, or packed [total, d] with cu_seqlens and
    max_seqlen (see MultiHeadAttention)."""

    def __init__(
        self, d_model: int, n_heads: int, ffn_hidden: int, *, causal: bool = False, dropout: float = 0.0, attn_dropout: float = 0.0,
        hyper_streams: int = 0, device=None, dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        attention = MultiHeadAttention(d_model, n_heads, causal=causal, dropout=attn_dropout, **factory)
        self.mix = connect(PreNorm(d_model, attention, **factory), d_model, dropout, hyper_streams, factory)
        ffn = SwiGLUFeedForward(d_model, ffn_hidden, **factory)
        self.ffn = connect(PreNorm(d_model, ffn, **factory), d_model, dropout, hyper_streams, factory)

    def forward(
        self, x: torch.Tensor, key_lengths: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if cu_seqlens is None:
            return self.ffn(self.mix(x, key_lengths))
        return self.ffn(self.mix(x, key_lengths, cu_seqlens, max_seqlen))


class GatedDeltaBlock(nn.Module):
    """x + gdr(norm(x)), then x + ffn(norm(x)). Causal; padding after a row's length does not reach earlier tokens."""

    def __init__(
        self, d_model: int, n_heads: int, ffn_hidden: int, *, dropout: float = 0.0, hyper_streams: int = 0, device=None, dtype=None,
    ) -> None:  # fmt: skip
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        mixer = GatedDeltaRuleMixer(d_model, n_heads, **factory)
        self.mix = connect(PreNorm(d_model, mixer, **factory), d_model, dropout, hyper_streams, factory)
        ffn = SwiGLUFeedForward(d_model, ffn_hidden, **factory)
        self.ffn = connect(PreNorm(d_model, ffn, **factory), d_model, dropout, hyper_streams, factory)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.ffn(self.mix(x))
