"""Helpers for peers: torch.compile of a function, compiled once per process."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    return torch.compile(fn)
