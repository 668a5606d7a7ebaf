"""Host-side steps shared by the kernel backends: bag layout, and the sort behind the weight gradient.

The weight gradient is reduced without atomics. The flat indices are sorted (stably, so the
order of every sum is fixed and the result deterministic); a run of equal indices is a
*segment*, one per distinct row. The kernels then walk the sorted entries in fixed chunks of
CHUNK entries: a segment inside one chunk is summed and written there; a segment that crosses
chunks (a hot row with thousands of entries) leaves one partial sum per chunk, and a second
pass adds those partials up. No row waits on another, however skewed the indices.

Nothing here synchronises with the host except `sparse_ranks`, which must learn the number of
distinct rows to size the sparse gradient (torch's own sparse backward syncs there too).

The dense gradient starts as a [num_embeddings, dim] zero fill: 128-256 MB at the issue's shapes,
bandwidth bound (50-100 us on an H100), while the sort is a latency-bound chain of small kernels.
On CUDA `dense_gradient_and_segments` runs the two concurrently, on two streams (see OVERLAP).
"""

from __future__ import annotations

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
    perm: torch.Tensor  # int64: each sorted entry's position in the flat indices
    first: torch.Tensor  # int32: each sorted entry's segment start (a position in sorted order)


def sort_segments(flat: torch.Tensor, num_embeddings: int) -> Segments:
    segments = _segment_buffers(flat, num_embeddings)
    _sort_into(flat, segments)
    return segments


def _segment_buffers(flat: torch.Tensor, num_embeddings: int) -> Segments:
    """Uninitialised Segments for `flat`, allocated on the current stream."""
    if flat.numel() > INT32_MAX:
        raise ValueError(f"indices: {flat.numel()} entries; the kernels take at most {INT32_MAX}")
    # int32 keys when every row number fits: half the radix-sort passes of int64 keys
    key_dtype = torch.int32 if flat.dtype == torch.int32 or num_embeddings <= INT32_MAX else flat.dtype
    n, device = flat.numel(), flat.device
    keys = torch.empty(n, dtype=key_dtype, device=device)
    perm = torch.empty(n, dtype=torch.int64, device=device)
    first = torch.empty(n, dtype=torch.int32, device=device)
    return Segments(keys, perm, first)


def _sort_into(flat: torch.Tensor, segments: Segments) -> None:
    """Fill `segments` (from _segment_buffers) for `flat`: writes only into its tensors (and sort's own scratch)."""
    keys = flat if flat.dtype == segments.keys.dtype else flat.to(segments.keys.dtype)
    torch.sort(keys, stable=True, out=(segments.keys, segments.perm))
    torch.searchsorted(segments.keys, segments.keys, out_int32=True, out=segments.first)


# How the dense gradient's zero fill meets the sort on CUDA (a module global: scripts/embedding_bag_sweep.py
# compares them). Concurrent kernels of equal stream priority barely overlap: the block scheduler hands out
# the blocks of the kernel queued first (the fill's tens of thousands) before those of a kernel queued after
# it, so each kernel of the sort chain would wait for the fill to drain. The sort therefore goes on a side
# stream of higher priority, whose blocks are scheduled ahead of the fill's as soon as SMs free up (CUDA graphs
# keep the priority: torch instantiates them with cudaGraphInstantiateFlagUseNodePriority). A side stream below
# the current stream's priority is not available for the fill: the default priority is already the lowest.
#   "sort_beside": the sort on the high-priority side stream, the fill on the current stream;
#   "fill_beside": the fill on the side stream, the sort on the current stream;
#   "serial": both on the current stream, one after the other.
OVERLAP = "sort_beside"
SIDE_PRIORITY = -1  # torch: lower is higher priority; 0 is the default (and lowest)

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The cached high-priority side stream of a CUDA device (made on first use)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=SIDE_PRIORITY)
    return stream


def dense_gradient_and_segments(flat: torch.Tensor, num_embeddings: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, Segments]:
    """torch.zeros(num_embeddings, dim) and sort_segments(flat, num_embeddings); on CUDA the fill and the sort
    run concurrently on two streams (OVERLAP), joined before this returns. CUDA-graph capturable: the fork and
    the join are captured as graph edges, and side-stream allocations go to the graph's pool."""
    grad = torch.empty((num_embeddings, dim), dtype=dtype, device=flat.device)
    segments = _segment_buffers(flat, num_embeddings)
    fill, sort = grad.zero_, lambda: _sort_into(flat, segments)
    if flat.device.type != "cuda" or OVERLAP == "serial":
        fill()
        sort()
        return grad, segments
    beside, here = (sort, fill) if OVERLAP == "sort_beside" else (fill, sort)
    # Safe for the caching allocator without record_stream: every tensor either stream writes (grad and the
    # segment buffers) or reads (flat) was allocated on, or is owned by, the current stream, and is referenced
    # here until the join. (1) The side stream first waits for the current stream, so its writes land after
    # every kernel queued earlier, including those of the tensors whose freed blocks were reused for these.
    # (2) Nothing here can be freed before the join (`finally`: even if a launch raises), and the join orders
    # every later use, and the free that lets the allocator reuse the block on the current stream, after the
    # side stream's work. Sort's own scratch is allocated and freed on the side stream: ordered there.
    current = torch.cuda.current_stream(flat.device)
    side = side_stream(flat.device)
    side.wait_stream(current)  # fork
    try:
        with torch.cuda.stream(side):
            beside()
        here()
    finally:
        current.wait_stream(side)  # join: before any kernel writes gradient rows
    return grad, segments


def sparse_ranks(segments: Segments, num_embeddings: int, padding_idx: int) -> tuple[torch.Tensor, int]:
    """Each sorted entry's output row in the sparse gradient, and the number of such rows.

    Rows are the distinct in-range, non-padding indices in ascending order (a coalesced gradient).
    """
    keys = segments.keys
    starts = segments.first == torch.arange(keys.numel(), device=keys.device, dtype=torch.int32)
    starts &= (keys >= 0) & (keys < num_embeddings) & (keys != padding_idx)
    ranks = torch.cumsum(starts, 0, dtype=torch.int32) - 1
    count = int(ranks[-1]) + 1 if keys.numel() else 0  # the sparse path's one host sync: the gradient's nnz
    return ranks, count


def sparse_gradient(rows: torch.Tensor, values: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    shape = (num_embeddings, values.shape[1])
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False)


def num_chunks(num_indices: int, chunk: int) -> int:
    return (num_indices + chunk - 1) // chunk
