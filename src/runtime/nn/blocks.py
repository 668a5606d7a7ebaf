"""Pre-norm blocks: attention or gated-delta-rule mixing, then a SwiGLU feed-forward, each branch joined
to the stream by a residual with dropout or, with `hyper_streams` > 0, by an mHC hyper-connection
(the block then takes and returns [..., n, C] streams).

Without hyper-connections a residual add is followed by the next sub-layer's RMSNorm: `step` runs a block with its
last add left pending, so that add and the next norm (the next block's, or the model's final norm, `run_blocks`) run
as one add_rms_norm; inside a block the attention's add and the feed-forward's norm do. Where dropout draws a mask
(training with dropout > 0) the add stays a dropout_add followed by the norm, so the random stream is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from .attention import MultiHeadAttention
from .feedforward import SwiGLUFeedForward
from .gated_delta import GatedDeltaRuleMixer
from .hyper_connections import HyperConnection
from .norms import RMSNorm
from .residual import DropoutAdd


class Pending(NamedTuple):
    """A residual add not yet done: the stream is `add(branch, x)` for the x it travels with."""

    branch: torch.Tensor
    add: DropoutAdd


def join(x: torch.Tensor, pending: Pending | None) -> torch.Tensor:
    """The stream x with its pending add done."""
    return x if pending is None else pending.add(pending.branch, x)


def join_norm(x: torch.Tensor, pending: Pending | None, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(stream), stream) of x with its pending add done: one add_rms_norm where dropout draws nothing."""
    if pending is None:
        return norm(x), x
    return pending.add.add_norm(pending.branch, x, norm)


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

    def __init__(self, branch: PreNorm, dropout: float) -> None:
        super().__init__()
        self.branch = branch
        self.add = DropoutAdd(dropout)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self.add(self.branch(x, *args), x)

    def step(self, x: torch.Tensor, pending: Pending | None, *args) -> tuple[torch.Tensor, Pending]:
        """forward on the stream (x, pending), its own add left pending: the pending add is joined with the norm."""
        normed, x = join_norm(x, pending, self.branch.norm)
        return x, Pending(self.branch.layer(normed, *args), self.add)


def connect(branch: nn.Module, width: int, dropout: float, hyper_streams: int, factory: dict) -> nn.Module:
    return HyperConnection(branch, hyper_streams, width, **factory) if hyper_streams else Residual(branch, dropout)


class _MixThenFeedForward(nn.Module):
    """x + mix(norm(x), ...), then x + ffn(norm(x)); `mix` and `ffn` are set by the subclasses."""

    mix_reads_lengths = True

    def forward(
        self,
        x: torch.Tensor,
        key_lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        return join(*self.step(x, None, key_lengths, cu_seqlens, max_seqlen))

    def step(
        self,
        x: torch.Tensor,
        pending: Pending | None,
        key_lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, Pending | None]:
        """The block on the stream (x, pending), its last residual add left pending (None with hyper-connections,
        which have no add to leave). x [B, L, d] with key_lengths, or packed [total, d] with cu_seqlens and
        max_seqlen (see MultiHeadAttention)."""
        args = (key_lengths,) if self.mix_reads_lengths else ()
        if cu_seqlens is not None:
            if not self.mix_reads_lengths:
                raise ValueError(
                    f"cu_seqlens: {type(self).__name__} takes padded batches [B, L, d] only, not packed sequences"
                )
            args = (key_lengths, cu_seqlens, max_seqlen)
        if isinstance(self.mix, HyperConnection):
            return self.ffn(self.mix(join(x, pending), *args)), None
        x, pending = self.mix.step(x, pending, *args)
        return self.ffn.step(x, pending)


class TransformerBlock(_MixThenFeedForward):
    """x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        ffn_hidden: int,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        hyper_streams: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        attention = MultiHeadAttention(d_model, n_heads, causal=causal, dropout=attn_dropout, **factory)
        self.mix = connect(PreNorm(d_model, attention, **factory), d_model, dropout, hyper_streams, factory)
        ffn = SwiGLUFeedForward(d_model, ffn_hidden, **factory)
        self.ffn = connect(PreNorm(d_model, ffn, **factory), d_model, dropout, hyper_streams, factory)


class GatedDeltaBlock(_MixThenFeedForward):
    """x + gdr(norm(x)), then x + ffn(norm(x)). Causal; padding after a row's length does not reach earlier tokens."""

    mix_reads_lengths = False

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        ffn_hidden: int,
        *,
        dropout: float = 0.0,
        hyper_streams: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        mixer = GatedDeltaRuleMixer(d_model, n_heads, **factory)
        self.mix = connect(PreNorm(d_model, mixer, **factory), d_model, dropout, hyper_streams, factory)
        ffn = SwiGLUFeedForward(d_model, ffn_hidden, **factory)
        self.ffn = connect(PreNorm(d_model, ffn, **factory), d_model, dropout, hyper_streams, factory)


def run_blocks(
    blocks: Iterable[nn.Module],
    x: torch.Tensor,
    key_lengths: torch.Tensor | None = None,
    *,
    norm: nn.Module | None = None,
):
    """The blocks (TransformerBlock / GatedDeltaBlock) in turn, each one's last residual add joined with the next
    one's first norm. Returns the stream, or with `norm`, (norm(stream), stream): the last add joined with it."""
    pending = None
    for block in blocks:
        x, pending = block.step(x, pending, key_lengths)
    return join(x, pending) if norm is None else join_norm(x, pending, norm)
