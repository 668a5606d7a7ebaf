"""Host-side steps shared by the kernel backends: bag layout, and the sort behind the weight gradient.

The weight gradient is reduced without atomics. The flat indices are sorted (stably, so the
order of every sum is fixed and the result deterministic); a run of equal indices is a
*segment*, one per distinct row. The kernels then walk the sorted entries in fixed chunks of
CHUNK entries: a segment inside one chunk is summed and written there; a segment that crosses
chunks (a hot row with thousands of entries) leaves one partial sum per chunk, and a second
pass adds those partials up. No row waits on another, however skewed the indices.

`sort_segments` sorts with torch.sort (`sort_keys`) and finds each entry's segment start with searchsorted (the
TileLang kernels read those starts); the Triton kernels find segment edges from the sorted keys alone, after
`sort_keys` or radix_sort.py's sort (the Triton backend's, where it fits).

Nothing here synchronises with the host except `sparse_ranks`, which must learn the number of
distinct rows to size the sparse gradient (torch's own sparse backward syncs there too).

The sort and the dense gradient's [num_embeddings, dim] zero fill run one after the other on the current
stream: running them concurrently on two streams gained nothing on an H100 (within 1%).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

INT32_MAX = 2**31 - 1


class Bags(NamedTuple):  # built on every call: a NamedTuple costs half a frozen dataclass
    """The bags in kernel form. Fixed hotness: bag b is flat[b*L:(b+1)*L] (offsets None).
    Ragged: bag b is flat[offsets[b]:offsets[b+1]], the last one ending at len(flat) unless
    include_last_offset gave its end."""

    flat: torch.Tensor  # 1-D contiguous indices
    offsets: torch.Tensor | None  # 1-D contiguous, or None for fixed hotness
    num_bags: int
    bag_len: int  # L for fixed hotness, 0 for ragged


def bag_layout(indices: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool) -> Bags:
    if indices.dim() == 2:
        return Bags(indices.reshape(-1).contiguous(), None, indices.shape[0], indices.shape[1])
    num_bags = offsets.numel() - 1 if include_last_offset else offsets.numel()
    return Bags(indices.contiguous(), offsets.contiguous(), num_bags, 0)


@dataclass(frozen=True)
class Segments:
    keys: torch.Tensor  # sorted flat indices (int32 when every row number fits)
    perm: torch.Tensor  # int64 (torch.sort) or int32 (radix_sort.py): each sorted entry's position in the flat indices
    # int32: each sorted entry's segment start (a position in sorted order); None where the kernels find segment
    # edges from the sorted keys (the Triton kernels)
    first: torch.Tensor | None


def sort_keys(flat: torch.Tensor, num_embeddings: int) -> Segments:
    """The flat indices sorted by torch.sort (stable), without segment starts."""
    if flat.numel() > INT32_MAX:
        raise ValueError(f"indices: {flat.numel()} entries; the kernels take at most {INT32_MAX}")
    keys = flat
    if keys.dtype == torch.int64 and num_embeddings <= INT32_MAX:
        keys = keys.to(torch.int32)  # half the radix-sort passes of int64 keys
    keys, perm = torch.sort(keys, stable=True)
    return Segments(keys, perm, None)


def sort_segments(flat: torch.Tensor, num_embeddings: int) -> Segments:
    """sort_keys, with each sorted entry's segment start."""
    segments = sort_keys(flat, num_embeddings)
    return dataclasses.replace(segments, first=torch.searchsorted(segments.keys, segments.keys, out_int32=True))


def sparse_ranks(segments: Segments, num_embeddings: int, padding_idx: int) -> tuple[torch.Tensor, int]:
    """Each sorted entry's output row in the sparse gradient, and the number of such rows.

    Rows are the distinct in-range, non-padding indices in ascending order (a coalesced gradient).
    """
    keys = segments.keys
    starts = torch.ones(keys.shape, dtype=torch.bool, device=keys.device)  # where the sorted key changes
    torch.ne(keys[1:], keys[:-1], out=starts[1:])
    starts &= (keys >= 0) & (keys < num_embeddings) & (keys != padding_idx)
    ranks = torch.cumsum(starts, 0, dtype=torch.int32) - 1
    count = int(ranks[-1]) + 1 if keys.numel() else 0  # the sparse path's one host sync: the gradient's nnz
    return ranks, count


def empty_input_gradient(weight: torch.Tensor, sparse: bool):
    """The weight's gradient where no index was looked up: zeros, or (rows, values) of nothing when sparse."""
    if sparse:
        return torch.empty(0, dtype=torch.int64, device=weight.device), weight.new_empty(0, weight.shape[1])
    return torch.zeros_like(weight, memory_format=torch.contiguous_format)


def sparse_gradient(rows: torch.Tensor, values: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    shape = (num_embeddings, values.shape[1])
    with warnings.catch_warnings():
        # torch 2.11 warns that invariant checks are "implicitly disabled" even when asked not to check: the rows
        # are sorted and unique by construction, and checking them would cost a host sync
        warnings.filterwarnings(
            "ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning
        )
        return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False)


def num_chunks(num_indices: int, chunk: int) -> int:
    return (num_indices + chunk - 1) // chunk
