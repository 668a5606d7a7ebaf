"""Output allocation for kernel modules.

Kernels allocate their outputs through `empty`/`empty_like` so that tests can poison every
fresh output with NaN (`poison_outputs()`): an element a kernel forgets to write then fails
the numerics check instead of passing on leftover memory.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_poison = False


def _fill(tensor: torch.Tensor) -> torch.Tensor:
    tensor.fill_(float("nan") if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min)
    return tensor


# Both run on every kernel call: the fill is looked up only when poisoning, and the shape goes by keyword (torch's
# argument parser takes `size=` about 0.5 us faster than a positional tuple).
def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """shape: a tuple, list or torch.Size."""
    tensor = torch.empty(size=shape, dtype=dtype, device=device)
    return _fill(tensor) if _poison else tensor


def empty_like(tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.empty_like(tensor, dtype=dtype, memory_format=torch.contiguous_format)
    return _fill(out) if _poison else out


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Within the block, every kernel output starts as NaN (integers: their minimum)."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous
