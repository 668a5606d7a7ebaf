"""Helpers for peers: torch.compile of a function, compiled once per process."""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


@functools.cache
def compiled_max_autotune(fn: Callable) -> Callable:
    """torch.compile(fn, mode="max-autotune"): Inductor benchmarks its GEMM templates against cuBLAS (compile time
    counts minutes for a GEMM-heavy function; it is reported as the first call)."""
    return torch.compile(fn, mode="max-autotune")
