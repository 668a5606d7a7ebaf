"""HSTU PCVR model: HSTU layers over each user's jagged behaviour history with the candidate appended as the target.

Each history (no padding: a jagged batch) gets its target token (candidate item + projected context + its position)
after its last event, with the last event's timestamp; silu_attention sees it as a target (num_targets = 1): it reads
the whole history and no history token reads it. The prediction reads the target token's output and the context
features, as the causal models do.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.nn import HSTUBlock, RMSNorm

from .features import FeatureEncoder, PredictionHead, append_targets
from .inputs import FeatureSpec, PCVRBatch


class HSTUPCVR(nn.Module):
    """n_layers HSTUBlocks (head_dim per head, default d_model // n_heads; learned relative position and time biases
    of position_buckets and time_buckets per head). ffn_mult is taken for the shared model schema and unused: an
    HSTU layer has no feed-forward (its gating by U takes that place); mhc_streams must be 0 (each layer carries its
    own residual)."""

    layouts = ("jagged",)  # the batch layouts forward() reads: jagged histories only

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
        head_dim: int | None = None,
        position_buckets: int = 256,
        time_buckets: int = 64,
    ) -> None:
        super().__init__()
        if mhc_streams:
            raise ValueError(
                f"mhc_streams: expected 0 for HSTU (each HSTU layer carries its own residual), got {mhc_streams}"
            )
        self.features = FeatureEncoder(
            spec, d_model, max_positions=spec.seq_len + 1, sparse_collection=sparse_collection, sparse_dim=sparse_dim
        )
        context_width = self.features.n_context * d_model
        self.context_proj = nn.Linear(context_width, d_model)
        self.blocks = nn.ModuleList(
            HSTUBlock(d_model, n_heads, head_dim, position_buckets, time_buckets, dropout) for _ in range(n_layers)
        )
        self.norm = RMSNorm(d_model)
        self.head = PredictionHead(d_model + context_width, head_hidden)
        # silu_attention divides by max_seqlen: the longest history any batch can hold (plus its target), not the
        # batch's own longest, so that an example's prediction does not depend on the examples batched with it
        self.max_seqlen = spec.seq_len + 1

    def forward(self, batch: PCVRBatch) -> torch.Tensor:
        """Conversion logits [B] of a jagged batch."""
        if not batch.jagged:
            raise ValueError(
                "batch: HSTUPCVR reads jagged histories (seq_offsets and max_seqlen set; data.jagged=true)"
            )
        lengths = batch.seq_lengths
        history = self.features.history_packed(batch)
        context = self.features.context(batch).flatten(1)
        target = self.features.target(batch) + self.context_proj(context) + self.features.positions(lengths)
        x, cu_seqlens = append_targets(history, target, batch.seq_offsets)
        timestamps = None
        if batch.seq_timestamps is not None:
            # each history's last timestamp (0 for an empty history: a leading zero keeps the gather in range
            # when the batch has no event at all)
            shifted = torch.cat([batch.seq_timestamps.new_zeros(1), batch.seq_timestamps])
            last = torch.where(lengths > 0, shifted[batch.seq_offsets[1:].long()], 0)
            timestamps = append_targets(batch.seq_timestamps, last, batch.seq_offsets)[0]
        num_targets = torch.ones_like(cu_seqlens[1:])
        for block in self.blocks:
            x = block(x, cu_seqlens, self.max_seqlen, timestamps, num_targets)
        readout = self.norm(x[cu_seqlens[1:].long() - 1])
        return self.head(torch.cat([readout.to(context.dtype), context], dim=-1))
