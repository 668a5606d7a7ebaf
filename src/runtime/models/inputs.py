"""What a PCVR model reads: the feature spec (vocabulary sizes and shapes) and a batch of examples."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FeatureSpec:
    """Sizes of one data set's features. Ids are 1-based; 0 is padding everywhere.

    sparse_fields: name -> vocabulary size of each categorical user/context field (multi-hot bags
    of at most `sparse_hotness` ids); n_dense: float features; seq_len: the longest behaviour history
    (most recent last); n_items / n_categories / n_actions: vocabularies of the history and target.
    """

    n_items: int
    n_categories: int
    n_actions: int
    sparse_fields: dict[str, int]
    sparse_hotness: int
    n_dense: int
    seq_len: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "FeatureSpec":
        return cls(**{**values, "sparse_fields": dict(values["sparse_fields"])})


@dataclass
class PCVRBatch:
    """B examples. sparse [B, F, hotness] raw per-field ids (0 = empty slot); dense [B, n_dense];
    seq_items / seq_categories / seq_actions [B, L] with the first seq_lengths[b] positions valid
    (oldest first) and zeros after; target_item / target_category [B]; label [B] float (1 = converted); user_id [B]
    int64 or None (the data has no user ids): read by the validation metrics (GAUC), not by the models."""

    sparse: torch.Tensor
    dense: torch.Tensor
    seq_items: torch.Tensor
    seq_categories: torch.Tensor
    seq_actions: torch.Tensor
    seq_lengths: torch.Tensor
    target_item: torch.Tensor
    target_category: torch.Tensor
    label: torch.Tensor
    user_id: torch.Tensor | None = None

    def _map(self, fn) -> "PCVRBatch":
        return PCVRBatch(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in dataclasses.fields(self)})

    def __len__(self) -> int:
        return self.label.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PCVRBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PCVRBatch":
        return self._map(lambda t: t.pin_memory())

    def slice(self, start: int, stop: int) -> "PCVRBatch":
        return self._map(lambda t: t[start:stop])

    def rows(self, index: torch.Tensor) -> "PCVRBatch":
        return self._map(lambda t: t[index])

    @staticmethod
    def concat(batches: list["PCVRBatch"]) -> "PCVRBatch":
        def cat(name: str):
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else torch.cat(parts)

        return PCVRBatch(**{f.name: cat(f.name) for f in dataclasses.fields(PCVRBatch)})
