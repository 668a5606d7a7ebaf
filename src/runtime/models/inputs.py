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
    (oldest first) and zeros after; target_item / target_category [B]; label [B] float (1 = converted)."""

    sparse: torch.Tensor
    dense: torch.Tensor
    seq_items: torch.Tensor
    seq_categories: torch.Tensor
    seq_actions: torch.Tensor
    seq_lengths: torch.Tensor
    target_item: torch.Tensor
    target_category: torch.Tensor
    label: torch.Tensor

    def __len__(self) -> int:
        return self.label.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PCVRBatch":
        return PCVRBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in dataclasses.fields(self)})

    def pin_memory(self) -> "PCVRBatch":
        return PCVRBatch(**{f.name: getattr(self, f.name).pin_memory() for f in dataclasses.fields(self)})

    def slice(self, start: int, stop: int) -> "PCVRBatch":
        return PCVRBatch(**{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)})

    @staticmethod
    def concat(batches: list["PCVRBatch"]) -> "PCVRBatch":
        return PCVRBatch(**{f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(PCVRBatch)})
