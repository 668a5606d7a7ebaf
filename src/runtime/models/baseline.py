"""The baseline PCVR model: pooled sparse features + a transformer over the behaviour history + an MLP head."""

from __future__ import annotations

import torch
from torch import nn

from runtime.nn import CrossAttention, RMSNorm, TransformerBlock, expand_streams, merge_streams, run_blocks

from .features import FeatureEncoder, PredictionHead
from .inputs import FeatureSpec, PCVRBatch


class BaselinePCVR(nn.Module):
    """History events go through bidirectional transformer blocks (padding masked by length); the
    target item attends over the encoded history (DIN-style interest); the head reads the context
    tokens, the target, that interest, the mean history item and target * interest. With
    mhc_streams = n > 0 the blocks carry n residual streams joined by mHC hyper-connections. Jagged batches run the
    same math on packed histories (varlen attention, no padding)."""

    layouts = ("padded", "jagged")  # the batch layouts forward() reads; the first is the model's default

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
        self.mhc_streams = mhc_streams
        self.features = FeatureEncoder(
            spec, d_model, max_positions=spec.seq_len, sparse_collection=sparse_collection, sparse_dim=sparse_dim
        )
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, ffn_mult * d_model, dropout=dropout, hyper_streams=mhc_streams)
            for _ in range(n_layers)
        )
        self.norm = RMSNorm(d_model)
        self.target_attention = CrossAttention(d_model, n_heads)
        self.head = PredictionHead((self.features.n_context + 4) * d_model, head_hidden)

    def forward(self, batch: PCVRBatch) -> torch.Tensor:
        """Conversion logits [B]."""
        if batch.jagged:
            return self._forward_jagged(batch)
        lengths = batch.seq_lengths
        x = self.features.history(batch)
        if self.mhc_streams:
            x = self.norm(merge_streams(run_blocks(self.blocks, expand_streams(x, self.mhc_streams), lengths)))
        else:
            x, _ = run_blocks(self.blocks, x, lengths, norm=self.norm)  # the last residual add joined with the norm
        target = self.features.target(batch)
        interest = self.target_attention(target[:, None].to(x.dtype), x, lengths)[:, 0].to(target.dtype)
        pooled = self.features.history_mean(batch)
        context = self.features.context(batch).flatten(1)
        return self.head(torch.cat([context, target, interest, pooled, target * interest], dim=-1))

    def _forward_jagged(self, batch: PCVRBatch) -> torch.Tensor:
        cu_seqlens, max_seqlen = batch.seq_offsets, batch.max_seqlen
        x = self.features.history_packed(batch)
        if self.mhc_streams:
            x = expand_streams(x, self.mhc_streams)
        for block in self.blocks:
            x = block(x, None, cu_seqlens, max_seqlen)
        x = self.norm(merge_streams(x) if self.mhc_streams else x)
        target = self.features.target(batch)
        interest = self.target_attention(target.to(x.dtype), x, None, cu_seqlens, max_seqlen).to(target.dtype)
        pooled = self.features.history_mean(batch)
        context = self.features.context(batch).flatten(1)
        return self.head(torch.cat([context, target, interest, pooled, target * interest], dim=-1))
