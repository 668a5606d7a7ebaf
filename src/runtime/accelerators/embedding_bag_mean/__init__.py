"""embedding_bag_mean(weight, indices, offsets=None, padding_idx=None): F.embedding_bag(..., mode="mean").

Fixed-hotness 2-D indices [B, L] or ragged 1-D indices with offsets; padding entries are left out
of each mean; an empty bag gives zeros. The kernel backends sum in fp32 and reduce the weight
gradient without atomics (segments.py says how); `sparse=True` gives a coalesced sparse COO
weight gradient, as nn.EmbeddingBag(sparse=True) does (torch's is uncoalesced: same tensor).

Each backend declares two KernelBackends (its module's KERNELS and SPARSE_KERNELS: the same forward, a dense or a
sparse weight gradient), behind two KernelOps. SPARSE_KERNEL is declared with in_graphs=False: a sparse gradient
cannot be a custom op's result here (torch.compile does not trace sparse tensors, and the backward custom op
declares each gradient dense and shaped like its argument, while a sparse gradient's nnz is known only once its
backward has run), so under torch.compile a sparse call runs eagerly outside the graph (a graph break), through the
same KernelOp eager path.
"""

from __future__ import annotations

import torch

from ..backends import Backend, select_backend
from ..checks import as_padding_idx, check_bool, check_same_device, check_strided, check_tensor
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .collection import embedding_bag_collection
from .reference import check_indices_, embedding_bag_mean_reference
from .spec import SPEC, TILELANG_MAX_DIM

__all__ = ["SPEC", "TILELANG_MAX_DIM", "embedding_bag_collection", "embedding_bag_mean"]

INDEX_DTYPES = (torch.int32, torch.int64)


def _fake_forward(weight, indices, offsets, padding_idx, include_last_offset, check_indices):
    if indices.dim() == 2:
        num_bags, entries = indices.shape[0], 0
    else:
        num_bags, entries = offsets.shape[0] - int(include_last_offset), indices.shape[0]
    return (
        weight.new_empty(num_bags, weight.shape[1]),
        weight.new_empty(num_bags, dtype=torch.float32),
        indices.new_empty(entries, dtype=torch.int32),
    )


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


def _triton_sparse_kernels() -> KernelBackend:
    from .triton import SPARSE_KERNELS

    return SPARSE_KERNELS


def _tilelang_sparse_kernels() -> KernelBackend:
    from .tilelang import SPARSE_KERNELS

    return SPARSE_KERNELS


_ARGS = "Tensor weight, Tensor indices, Tensor? offsets, int padding_idx, bool include_last_offset, bool check_indices"

# kernel modules: forward(weight, indices, offsets, padding_idx, include_last_offset, check_indices)
#                     -> (out [B, D], scale [B] fp32, bag_of [N] int32 for ragged bags, else empty)
#                 backward(grad_out, *args, out, scale, bag_of) -> (dense grad_weight, None x 5)
#                 backward_sparse(grad_out, *args, None, scale, bag_of) -> (sparse COO grad_weight, None x 5)
# padding_idx is -1 for "no padding"; a negative one is normalised first.
KERNEL = KernelOp(
    "embedding_bag_mean",
    _ARGS,
    n_outputs=1,
    n_saved=2,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)
SPARSE_KERNEL = KernelOp(
    "embedding_bag_mean_sparse",
    _ARGS,
    n_outputs=1,
    n_saved=2,
    fake_forward=None,
    backends={
        "triton": _triton_sparse_kernels,
        "tilelang": _tilelang_sparse_kernels,
    },
    in_graphs=False,  # see the module docstring
)


def _check_index_tensor(name: str, value, weight: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of int32 or int64, got {type(value).__name__}")
    check_strided(name, value)
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {value.dtype}")
    check_same_device(name, value, "weight", weight)


def _check_inputs(weight, indices, offsets, padding_idx, include_last_offset, sparse, check_indices) -> int | None:
    """Validate the arguments; returns padding_idx normalised to [0, num_embeddings) (or None)."""
    check_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(
            f"weight: expected a 2-D [num_embeddings, embedding_dim] table, got shape {tuple(weight.shape)}"
        )
    _check_index_tensor("indices", indices, weight)
    if indices.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets: must be None when indices is 2-D (each row of indices is one bag)")
    elif indices.dim() == 1:
        if offsets is None:
            raise ValueError("offsets: required when indices is 1-D (offsets[b] is where bag b starts)")
        _check_index_tensor("offsets", offsets, weight)
        if offsets.dim() != 1:
            raise ValueError(f"offsets: expected a 1-D tensor, got shape {tuple(offsets.shape)}")
        if include_last_offset and offsets.numel() == 0:
            raise ValueError("offsets: include_last_offset=True needs at least one offset (the end of the last bag)")
    else:
        raise ValueError(
            f"indices: expected a 2-D [bags, bag_size] or 1-D (with offsets) tensor, got shape {tuple(indices.shape)}"
        )
    for name, flag in (
        ("include_last_offset", include_last_offset),
        ("sparse", sparse),
        ("check_indices", check_indices),
    ):
        check_bool(name, flag)
    return as_padding_idx(padding_idx, weight.shape[0])


def embedding_bag_mean(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor | None = None,
    padding_idx: int | None = None,
    *,
    include_last_offset: bool = False,
    sparse: bool = False,
    check_indices: bool = True,
    backend: Backend | None = None,
) -> torch.Tensor:
    """The mean of each bag's rows of `weight`, as F.embedding_bag(indices, weight, offsets, mode="mean").

    check_indices: raise on an index outside [0, num_embeddings) or malformed offsets, checked on the
    device (a device-side assert on CUDA, no host sync). With it off, such entries give unspecified
    values (never out-of-bounds memory accesses).
    """
    padding = _check_inputs(weight, indices, offsets, padding_idx, include_last_offset, sparse, check_indices)
    unit_columns, contiguous = weight.stride(1) == 1, weight.is_contiguous()
    key = (weight.dtype, unit_columns, contiguous, weight.shape[1] > TILELANG_MAX_DIM)
    chosen = select_backend(
        SPEC,
        backend,
        weight.device,
        key,
        embedding_bag_mean,
        weight=weight,
        unit_columns=unit_columns,
        contiguous=contiguous,
        indices=indices,
        offsets=offsets,
        padding_idx=padding_idx,
        include_last_offset=include_last_offset,
        sparse=sparse,
        check_indices=check_indices,
    )
    if chosen == "torch" or weight.numel() == 0:
        return embedding_bag_mean_reference(
            weight, indices, offsets, padding, include_last_offset, sparse, check_indices
        )
    if indices.dim() == 2:
        include_last_offset = False  # as torch: fixed bags ignore it
    elif check_indices and offsets.numel() == int(include_last_offset):
        # no bag: the kernels launch nothing, so they would check nothing (include_last_offset=True with offsets
        # [x] must still end at len(indices), and every index must be in range, as the torch backend checks)
        check_indices_(weight, indices, offsets, include_last_offset)
    pad = -1 if padding is None else padding
    if sparse and weight.requires_grad and torch.is_grad_enabled():
        return SPARSE_KERNEL(chosen, weight, indices, offsets, pad, include_last_offset, check_indices)
    return KERNEL(chosen, weight, indices, offsets, pad, include_last_offset, check_indices)
