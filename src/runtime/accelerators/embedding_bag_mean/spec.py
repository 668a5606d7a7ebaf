"""embedding_bag_mean's capabilities (its OpSpec), shared by the single-table op and the collection."""

from __future__ import annotations

import torch

from ..backends import OpSpec
from ..checks import dtype_reasons

TILELANG_MAX_DIM = 1024


def _reasons(
    backend: str,
    weight: torch.Tensor,
    unit_columns: bool | None = None,
    contiguous: bool | None = None,
    collection=None,
) -> list[str]:
    """unit_columns and contiguous: weight.stride(1) == 1 and weight.is_contiguous(), passed by the op (the stand-ins
    of torch.compile's decision have strides of their own); explain() reads them from weight."""
    if collection is not None:
        return _collection_reasons(backend, weight, collection)
    reasons = dtype_reasons("weight", weight)
    if unit_columns is None:
        unit_columns, contiguous = weight.dim() != 2 or weight.stride(1) == 1, weight.is_contiguous()
    if not unit_columns:
        reasons.append("weight has a column stride other than 1; the kernels read rows with a unit column stride")
    elif backend == "tilelang" and not contiguous:
        reasons.append("weight is not contiguous; the tilelang kernels take a contiguous table")
    if backend == "tilelang" and weight.dim() == 2 and weight.shape[1] > TILELANG_MAX_DIM:
        # the gradient kernel holds a chunk of rows of the whole width in shared memory (32 x 4 bytes per column)
        reasons.append(
            f"the embedding dim {weight.shape[1]} exceeds {TILELANG_MAX_DIM}, the widest the tilelang gradient kernel holds"
        )
    return reasons


def _collection_reasons(backend: str, weight: torch.Tensor, collection: tuple) -> list[str]:
    """embedding_bag_collection's reasons; collection: (tables, every table has a unit column stride, widest dim)."""
    _, unit_columns, _ = collection
    if backend == "tilelang":
        return [
            "the tilelang backend has no embedding_bag_collection kernel; the triton backend runs every table in one launch"
        ]
    reasons = dtype_reasons("weights", weight)
    if not unit_columns:
        reasons.append(
            "a table of weights has a column stride other than 1; the kernels read rows with a unit column stride"
        )
    return reasons


SPEC = OpSpec(name="embedding_bag_mean", priority=("triton", "tilelang"), reasons=_reasons, widths=("weight",))
