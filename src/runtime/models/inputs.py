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


TOKEN_FIELDS = ("seq_items", "seq_categories", "seq_actions", "seq_timestamps")  # one value per history event


@dataclass
class PCVRBatch:
    """B examples. sparse [B, F, hotness] raw per-field ids (0 = empty slot); dense [B, n_dense];
    seq_items / seq_categories / seq_actions [B, L] with the first seq_lengths[b] positions valid
    (oldest first) and zeros after; target_item / target_category [B]; label [B] float (1 = converted); user_id [B]
    int64 or None (the data has no user ids): read by the validation metrics (GAUC), not by the models.

    Jagged (packed) histories: with seq_offsets (int32 [B + 1], cu_seqlens: 0, then each history's end) the token
    fields seq_items / seq_categories / seq_actions / seq_timestamps are [total] (history b is rows
    seq_offsets[b]:seq_offsets[b + 1], no padding anywhere) and max_seqlen is the longest history (a host int, so no
    step reads the offsets back). seq_timestamps: int64 seconds, increasing within a history; None where the data
    has none ([B, L] in a padded batch made by `padded()`)."""

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
    seq_timestamps: torch.Tensor | None = None
    seq_offsets: torch.Tensor | None = None
    max_seqlen: int | None = None

    @property
    def jagged(self) -> bool:
        return self.seq_offsets is not None

    def _map(self, fn) -> "PCVRBatch":
        return PCVRBatch(
            **{
                f.name: t if not isinstance(t := getattr(self, f.name), torch.Tensor) else fn(t)
                for f in dataclasses.fields(self)
            }
        )

    def __len__(self) -> int:
        return self.label.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PCVRBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PCVRBatch":
        return self._map(lambda t: t.pin_memory())

    def slice(self, start: int, stop: int) -> "PCVRBatch":
        if not self.jagged:
            return self._map(lambda t: t[start:stop])
        return self.rows(torch.arange(start, min(max(start, stop), len(self))))

    def rows(self, index: torch.Tensor) -> "PCVRBatch":
        if not self.jagged:
            return self._map(lambda t: t[index])
        index = index.to(self.seq_offsets.device)
        starts, lengths = self.seq_offsets[:-1].long()[index], self.seq_lengths[index].long()
        offsets = offsets_of(lengths).long()
        total = int(offsets[-1])
        # token t of the result is token (t - offsets[row]) of source row `row`, at starts[row] + that
        row = torch.repeat_interleave(torch.arange(len(index), device=index.device), lengths, output_size=total)
        tokens = starts[row] + torch.arange(total, device=index.device) - offsets[:-1][row]
        values = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if f.name in TOKEN_FIELDS:
                values[f.name] = None if t is None else t[tokens]
            elif isinstance(t, torch.Tensor) and f.name != "seq_offsets":
                values[f.name] = t[index]
        longest = int(lengths.max()) if len(index) else 0
        return PCVRBatch(**values, seq_offsets=offsets.to(torch.int32), max_seqlen=longest)

    def padded(self, seq_len: int | None = None) -> "PCVRBatch":
        """This jagged batch with its histories padded to [B, seq_len] (default: max_seqlen) with zeros after each
        history's end: the same examples in the padded layout."""
        if not self.jagged:
            raise ValueError("padded(): the batch is padded already (seq_offsets is None)")
        width = self.max_seqlen if seq_len is None else seq_len
        if width < self.max_seqlen:
            raise ValueError(f"seq_len: expected at least the longest history ({self.max_seqlen}), got {seq_len}")
        lengths = self.seq_lengths.long()
        valid = torch.arange(width, device=lengths.device)[None] < lengths[:, None]

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(len(self), width)
            out[valid] = t
            return out

        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("seq_offsets", "max_seqlen")
        }
        values.update({name: None if (t := getattr(self, name)) is None else pad(t) for name in TOKEN_FIELDS})
        return PCVRBatch(**values)

    @staticmethod
    def concat(batches: list["PCVRBatch"]) -> "PCVRBatch":
        def cat(name: str):
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else torch.cat(parts)

        names = [f.name for f in dataclasses.fields(PCVRBatch) if f.name not in ("seq_offsets", "max_seqlen")]
        joined = PCVRBatch(**{name: cat(name) for name in names})
        if batches and batches[0].jagged:
            joined.seq_offsets = offsets_of(joined.seq_lengths.long())
            joined.max_seqlen = max(b.max_seqlen for b in batches)
        return joined


def pack_histories(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, L] padded histories (the first lengths[b] of row b valid) as their [total] packed values, row after row."""
    return values[torch.arange(values.shape[1], device=values.device)[None] < lengths[:, None]]


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: int32 [B + 1], 0 and then the running sum of lengths."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
