"""Helpers for peers: torch.compile of a function, compiled once per process."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


@functools.cache
def compiled_max_autotune(fn: Callable) -> Callable:
    """torch.compile(fn, mode="max-autotune", dynamic=False): Inductor benchmarks its GEMM templates against cuBLAS for
    each shape (static shapes: each benchmark shape gets its own tuned graph; the compile time, minutes for a
    GEMM-heavy function, is reported as the first call)."""
    return torch.compile(fn, mode="max-autotune", dynamic=False)
