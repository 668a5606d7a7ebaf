"""Causal PCVR models: the history and then the target as one token sequence, read out at the target.

The target token (candidate item + projected context + its position) is placed right after each
row's last history event, at index seq_lengths[b]; causal mixing lets it read the whole history and
nothing after it, so the padding behind it never matters. TokenFormerPCVR mixes with causal
attention, GDRMixerPCVR with the gated delta rule (linear in the sequence length). TokenFormerPCVR also reads jagged
batches: each packed history gets its target appended, and causal varlen attention runs without padding.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.nn import GatedDeltaBlock, RMSNorm, TransformerBlock, expand_streams, merge_streams, run_blocks

from .features import FeatureEncoder, PredictionHead, append_targets
from .inputs import FeatureSpec, PCVRBatch


class CausalSequencePCVR(nn.Module):
    layouts: tuple[str, ...] = ("padded",)  # the batch layouts forward() reads; the first is the model's default

    def __init__(
        self,
        spec: FeatureSpec,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        ffn_mult: int = 4,
        dropout: float = 0.1,
        head_hidden: int = 256,
        mhc_streams: int = 0,
        sparse_collection: bool = False,
        sparse_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.mhc_streams = mhc_streams  # n > 0: blocks carry n residual streams joined by mHC
        self.features = FeatureEncoder(
            spec, d_model, max_positions=spec.seq_len + 1, sparse_collection=sparse_collection, sparse_dim=sparse_dim
        )
        context_width = self.features.n_context * d_model
        self.context_proj = nn.Linear(context_width, d_model)
        self.blocks = nn.ModuleList(
            self.make_block(d_model, n_heads, ffn_mult * d_model, dropout, mhc_streams) for _ in range(n_layers)
        )
        self.norm = RMSNorm(d_model)
        self.head = PredictionHead(d_model + context_width, head_hidden)

    def make_block(self, d_model: int, n_heads: int, ffn_hidden: int, dropout: float, hyper_streams: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, batch: PCVRBatch) -> torch.Tensor:
        """Conversion logits [B]."""
        if batch.jagged and "jagged" not in self.layouts:
            raise ValueError(f"batch: {type(self).__name__} reads padded histories only; set data.jagged=false")
        lengths = batch.seq_lengths
        context = self.features.context(batch).flatten(1)
        target = self.features.target(batch) + self.context_proj(context) + self.features.positions(lengths)
        if batch.jagged:
            return self._forward_jagged(batch, target, context)
        history = self.features.history(batch)
        tokens = torch.cat([history, history.new_zeros(history.shape[0], 1, history.shape[2])], dim=1)
        at_target = torch.arange(tokens.shape[1], device=lengths.device) == lengths[:, None]
        x = torch.where(at_target[..., None], target[:, None].to(tokens.dtype), tokens)
        if self.mhc_streams:
            x = expand_streams(x, self.mhc_streams)
        x = run_blocks(self.blocks, x, lengths + 1)
        if self.mhc_streams:
            x = merge_streams(x)
        rows = torch.arange(x.shape[0], device=x.device)
        readout = self.norm(x[rows, lengths])
        return self.head(torch.cat([readout.to(context.dtype), context], dim=-1))

    def _forward_jagged(self, batch: PCVRBatch, target: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x, cu_seqlens = append_targets(self.features.history_packed(batch), target, batch.seq_offsets)
        if self.mhc_streams:
            x = expand_streams(x, self.mhc_streams)
        for block in self.blocks:
            x = block(x, None, cu_seqlens, batch.max_seqlen + 1)
        if self.mhc_streams:
            x = merge_streams(x)
        readout = self.norm(x[cu_seqlens[1:].long() - 1])
        return self.head(torch.cat([readout.to(context.dtype), context], dim=-1))


class TokenFormerPCVR(CausalSequencePCVR):
    """Causal transformer over [history..., target]."""

    layouts = ("padded", "jagged")

    def make_block(self, d_model, n_heads, ffn_hidden, dropout, hyper_streams):
        return TransformerBlock(d_model, n_heads, ffn_hidden, causal=True, dropout=dropout, hyper_streams=hyper_streams)


class GDRMixerPCVR(CausalSequencePCVR):
    """Gated-delta-rule mixer blocks over [history..., target]: cost linear in the history length."""

    def make_block(self, d_model, n_heads, ffn_hidden, dropout, hyper_streams):
        return GatedDeltaBlock(d_model, n_heads, ffn_hidden, dropout=dropout, hyper_streams=hyper_streams)
