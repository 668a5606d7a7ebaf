"""Feature embeddings shared by the PCVR models, and their prediction head."""

from __future__ import annotations

import torch
from torch import nn

from runtime.accelerators.embedding_bag_mean import embedding_bag_mean
from runtime.nn import EmbeddingBagCollection, EmbeddingBagMean, LayerNorm, SwiGLUFeedForward
from runtime.nn.embedding import init_table_

from .inputs import FeatureSpec, PCVRBatch

INIT_STD = 0.02


class FeatureEncoder(nn.Module):
    """Embeds a PCVRBatch: history tokens, the target item, and context (sparse fields + dense) tokens.

    The sparse fields share one table: field f's id i (1-based) is row offset_f + i, and row 0 is the
    padding that empty bag slots point to (left out of each bag's mean). With sparse_collection, each field
    has its own table of sparse_dim columns (row 0 padding), all pooled in one embedding_bag_collection call
    and projected to d_model.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        d_model: int,
        max_positions: int,
        sparse_collection: bool = False,
        sparse_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.items = nn.Embedding(spec.n_items + 1, d_model, padding_idx=0)
        self.categories = nn.Embedding(spec.n_categories + 1, d_model, padding_idx=0)
        self.actions = nn.Embedding(spec.n_actions + 1, d_model, padding_idx=0)
        self.positions = nn.Embedding(max_positions, d_model)
        self._init_tables()
        vocab = list(spec.sparse_fields.values())
        self.sparse_collection = sparse_collection
        self.sparse_projection = None
        # ids come from the data layer, which validates them once: no per-call range check (a device sync)
        if sparse_collection:
            if not spec.sparse_fields:
                raise ValueError(
                    "model.sparse_collection: true needs sparse features (a table per field), and the data has none; "
                    "set it to false"
                )
            width = sparse_dim or d_model
            tables = {name: (size + 1, width) for name, size in spec.sparse_fields.items()}
            self.sparse = EmbeddingBagCollection(tables, padding_idx=0, init_std=INIT_STD, check_indices=False)
            if width != d_model:
                self.sparse_projection = nn.Linear(width, d_model)
        else:
            self.register_buffer("field_offsets", torch.empty(1, len(vocab), 1, dtype=torch.long), persistent=False)
            self._fill_field_offsets()
            self.sparse = EmbeddingBagMean(
                sum(vocab) + 1, d_model, padding_idx=0, init_std=INIT_STD, check_indices=False
            )
        self.dense = nn.Linear(spec.n_dense, d_model)

    def _fill_field_offsets(self) -> None:
        """field_offsets: where each sparse field's ids start in the shared table. A buffer out of the state_dict,
        so it is refilled wherever to_empty may have left it uninitialised: reset_parameters and load_state_dict."""
        if not self.sparse_collection:
            vocab = list(self.spec.sparse_fields.values())
            offsets = torch.tensor([0] + vocab[:-1]).cumsum(0)
            with torch.no_grad():
                self.field_offsets.copy_(offsets.view(1, -1, 1))

    def reset_parameters(self) -> None:
        """The tables this module holds directly: normal with std INIT_STD, padding rows zero; field_offsets
        refilled. (The sparse bags and dense projection reset their own.)"""
        self._init_tables()
        self._fill_field_offsets()

    def _init_tables(self) -> None:
        for table in (self.items, self.categories, self.actions, self.positions):
            init_table_(table.weight, INIT_STD, table.padding_idx)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._fill_field_offsets()

    @property
    def n_context(self) -> int:
        """Context tokens per example: one per sparse field, one for the dense features."""
        return len(self.spec.sparse_fields) + 1

    def history(self, batch: PCVRBatch) -> torch.Tensor:
        """[B, L, d]: item + category + action + position of each history event."""
        positions = torch.arange(batch.seq_items.shape[1], device=batch.seq_items.device)
        return (
            self.items(batch.seq_items)
            + self.categories(batch.seq_categories)
            + self.actions(batch.seq_actions)
            + self.positions(positions)
        )

    def history_packed(self, batch: PCVRBatch) -> torch.Tensor:
        """[total, d]: history() of a jagged batch, the histories back to back (no padding)."""
        items = batch.seq_items
        return (
            self.items(items)
            + self.categories(batch.seq_categories)
            + self.actions(batch.seq_actions)
            + self.positions(positions_in_sequence(batch.seq_offsets, items.shape[0]))
        )

    def history_mean(self, batch: PCVRBatch) -> torch.Tensor:
        """[B, d]: the mean item embedding of each history (padding left out)."""
        if batch.jagged:
            offsets = batch.seq_offsets[:-1].long()
            return embedding_bag_mean(self.items.weight, batch.seq_items, offsets, padding_idx=0, check_indices=False)
        return embedding_bag_mean(self.items.weight, batch.seq_items, padding_idx=0, check_indices=False)

    def target(self, batch: PCVRBatch) -> torch.Tensor:
        """[B, d]: the candidate item."""
        return self.items(batch.target_item) + self.categories(batch.target_category)

    def context(self, batch: PCVRBatch) -> torch.Tensor:
        """[B, F + 1, d]: each sparse field's mean-pooled bag, then the projected dense features."""
        b, n_fields, hotness = batch.sparse.shape
        if self.sparse_collection:
            # key-major jagged input: field after field, each example's bag of `hotness` slots (0: empty, padding)
            values = batch.sparse.transpose(0, 1).reshape(-1)
            offsets = torch.arange(0, values.numel() + 1, hotness, device=values.device)
            fields = self.sparse(values, offsets).unflatten(-1, (n_fields, -1))
            if self.sparse_projection is not None:
                fields = self.sparse_projection(fields)
        else:
            ids = torch.where(batch.sparse > 0, batch.sparse + self.field_offsets, 0)
            fields = self.sparse(ids.view(b * n_fields, hotness)).unflatten(0, (b, n_fields))
        dense = self.dense(batch.dense.to(self.dense.weight.dtype)).to(fields.dtype)  # float32 data, any model dtype
        return torch.cat([fields, dense[:, None]], dim=1)


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: each packed token's index within its own sequence (no host read of the offsets)."""
    offsets = cu_seqlens.long()
    owner = torch.repeat_interleave(
        torch.arange(offsets.shape[0] - 1, device=offsets.device), offsets.diff(), output_size=total
    )
    return torch.arange(total, device=offsets.device) - offsets[owner]


def append_targets(
    tokens: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences [total, d] with sequence s's target token targets[s] placed after its last token: returns
    ([total + B, d], the new cu_seqlens int32 [B + 1]); sequence s's target is row new_cu_seqlens[s + 1] - 1."""
    offsets = cu_seqlens.long()
    n, total = targets.shape[0], tokens.shape[0]
    grown = offsets + torch.arange(n + 1, device=offsets.device)
    # row r of the result reads row r - s of tokens (s: its sequence), or targets[s] at the sequence's last row
    source = torch.arange(total, device=offsets.device)
    source = source + torch.repeat_interleave(torch.arange(n, device=offsets.device), offsets.diff(), output_size=total)
    rows = torch.empty(total + n, dtype=torch.long, device=offsets.device)
    rows[source] = torch.arange(total, device=offsets.device)
    rows[grown[1:] - 1] = total + torch.arange(n, device=offsets.device)
    return torch.cat([tokens, targets.to(tokens.dtype)])[rows], grown.to(torch.int32)


class PredictionHead(nn.Module):
    """LayerNorm, then a SwiGLU MLP to one logit per example."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.norm = LayerNorm(in_features)
        # the projection to one logit on torch: the kernel backends need a multiple of 8 outputs
        self.mlp = SwiGLUFeedForward(in_features, hidden, d_out=1, bias=True, down_backend="torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x)).squeeze(-1)
