"""Output allocation for kernel modules.

Kernels allocate their outputs through `empty`/`empty_like` so that tests can poison every
fresh output with NaN (`poison_outputs()`): an element a kernel forgets to write then fails
the numerics check instead of passing on leftover memory.

Both run on every kernel call. `empty_like` is torch.empty_like itself (with a contiguous layout)
outside poison_outputs(), which rebinds it: call it as `buffers.empty_like`, never import the name
(tests/unit/test_buffers.py checks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

_poison = False
_poison_listeners: list = []  # called with the new setting (outputs allocated outside Python: native)


def _fill(tensor: torch.Tensor) -> torch.Tensor:
    tensor.fill_(float("nan") if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min)
    return tensor


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """shape: a tuple, list or torch.Size (by keyword: torch's argument parser takes `size=` about 0.5 us faster than a
    positional tuple)."""
    tensor = torch.empty(size=shape, dtype=dtype, device=device)
    return _fill(tensor) if _poison else tensor


def _poisoned_empty_like(tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _fill(torch.empty_like(tensor, dtype=dtype, memory_format=torch.contiguous_format))


# empty_like(tensor, *, dtype=None): no Python frame of its own
empty_like = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Within the block, every kernel output starts as NaN (integers: their minimum)."""
    global _poison, empty_like
    previous = _poison, empty_like
    _poison, empty_like = True, _poisoned_empty_like
    _tell_listeners()
    try:
        yield
    finally:
        _poison, empty_like = previous
        _tell_listeners()


def poisoning() -> bool:
    """Whether kernel outputs start as NaN now (within poison_outputs())."""
    return _poison


def on_poison_change(listener) -> None:
    """listener(poisoning()) after every change."""
    _poison_listeners.append(listener)


def _tell_listeners() -> None:
    for listener in _poison_listeners:
        listener(_poison)
