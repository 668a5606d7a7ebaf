"""The casts an op makes under autocast, as the torch op it stands for would make them."""

from __future__ import annotations

import contextlib

import torch


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled(device_type), False for a device type autocast does not have (meta tensors), where
    torch raises instead."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # "unknown device type for autocast"
        return False


def autocast_inputs(device_type: str, *tensors: torch.Tensor | None) -> tuple:
    """Under autocast on `device_type`, the tensors in its dtype (None stays None); else the tensors as they are. A
    tensor already in that dtype comes back as it is, as `.to` would return it, without `.to`'s dispatcher round trip
    (a few us of host time per call on an eager step's hot path). float64 tensors stay float64, as autocast leaves
    them (it casts only the lower-precision-eligible float16/bfloat16/float32 inputs)."""
    if not autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple([t if t is None or t.dtype in (dtype, torch.float64) else t.to(dtype) for t in tensors])  # a list


def autocast_to_float32(device_type: str, *tensors: torch.Tensor | None) -> tuple:
    """Under autocast on `device_type`, the float16 / bfloat16 tensors as float32 (others, and None, as they are), as
    autocast casts the arguments of the ops it runs in float32 (binary_cross_entropy_with_logits among them); else the
    tensors as they are."""
    if not autocast_enabled(device_type):
        return tensors
    return tuple([t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors])


def without_autocast(device_type: str):
    """A context with autocast off on `device_type` (none where it is off): for the torch path of an op that computes
    in its inputs' dtypes, as its kernels do, whose reference's matmuls autocast would otherwise run in its dtype."""
    if not autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
