"""Embedding-bag mean in plain torch: always available, CPU-safe, differentiable by autograd."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_readable

INDEX_ERROR = (
    "embedding_bag_mean: an index is outside [0, num_embeddings) or the offsets do not rise "
    "from 0 to len(indices) (check_indices=True)"
)


def bad_indices(
    weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
) -> torch.Tensor:
    """A 0-d bool tensor: True when an index is out of range or the offsets are malformed."""
    bad = ((indices < 0) | (indices >= weight.shape[0])).any()
    if offsets is not None and offsets.numel() > 0:
        ends = offsets if include_last_offset else torch.cat([offsets, offsets.new_tensor([indices.numel()])])
        bad = bad | (offsets[0] != 0) | (ends[1:] < ends[:-1]).any() | (ends[-1] != indices.numel())
    return bad


def check_indices_(weight, indices, offsets, include_last_offset) -> None:
    """Raise on bad indices or offsets: IndexError on CPU, a device-side assert (no host sync) on CUDA. Under
    torch.compile the assert on every device (RuntimeError on CPU): it is an op of the graph, where reading the flag
    on the host would break the graph."""
    check_readable("indices", indices, "check_indices=True; pass check_indices=False")
    bad = bad_indices(weight, indices, offsets, include_last_offset)
    if indices.device.type == "cuda" or torch.compiler.is_compiling():
        torch._assert_async(~bad, INDEX_ERROR)
    elif bad.item():
        raise index_error(weight, indices, offsets, include_last_offset)


def index_error(weight, indices, offsets, include_last_offset) -> IndexError:
    """The error for inputs bad_indices rejected, naming the argument at fault (a device assert cannot: CPU only)."""
    n = weight.shape[0]
    outside = (indices < 0) | (indices >= n)
    if outside.any():
        at = int(outside.reshape(-1).nonzero()[0])
        value = int(indices.reshape(-1)[at])
        return IndexError(
            f"embedding_bag_mean: indices: {value} (flat position {at}) is outside [0, num_embeddings={n}) (check_indices=True)"
        )
    end = f"len(indices)={indices.numel()}" + (
        " at the last offset (include_last_offset=True)" if include_last_offset else ""
    )
    got = offsets.tolist() if offsets.numel() <= 16 else "a longer sequence that does not"
    return IndexError(
        f"embedding_bag_mean: offsets: expected to start at 0 and rise to {end}, got {got} (check_indices=True)"
    )


def embedding_bag_mean_reference(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor | None = None,
    padding_idx: int | None = None,
    include_last_offset: bool = False,
    sparse: bool = False,
    check_indices: bool = True,
) -> torch.Tensor:
    """F.embedding_bag(indices, weight, offsets, mode="mean", ...): the mean of each bag's rows, padding excluded."""
    if check_indices:
        check_indices_(weight, indices, offsets, include_last_offset)
    if weight.shape[1] == 0:
        return _empty_bags(weight, indices, offsets, include_last_offset, sparse)
    if indices.dim() == 2 and indices.shape[1] == 0:  # torch cannot build offsets for empty fixed bags
        indices, offsets, include_last_offset = indices.reshape(-1), indices.new_zeros(indices.shape[0]), False
    if offsets is not None and offsets.dtype != indices.dtype:
        offsets = offsets.to(indices.dtype)
    return F.embedding_bag(
        indices,
        weight,
        offsets,
        mode="mean",
        padding_idx=padding_idx,
        include_last_offset=include_last_offset,
        sparse=sparse,
    )


def _empty_bags(weight, indices, offsets, include_last_offset, sparse) -> torch.Tensor:
    """[bags, 0] for an embedding dim of 0 (F.embedding_bag cannot index such a table), still in the graph of weight
    so that backward gives its (empty) gradient, sparse when asked."""
    bags = indices.shape[0] if indices.dim() == 2 else offsets.numel() - int(include_last_offset)
    rows = F.embedding(indices.reshape(-1)[:0], weight, sparse=sparse)  # [0, 0]
    return rows.sum(0, keepdim=True).repeat(bags, 1)
