"""gelu(x, approximate="none" | "tanh") and silu(x), elementwise as torch computes them, one pass each way.

The kernel backends' backward works the derivative out again from x (it keeps no output).
"""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..checks import check_tensor, dtype_reasons, size_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import gelu_reference, silu_reference

APPROXIMATIONS = ("none", "tanh")
# the tilelang kernels index elements with 32-bit integers (blocks of up to 2^16 elements)
TILELANG_MAX_NUMEL = 2**31 - 2**16


def _reasons(backend: str, x: torch.Tensor, too_large: bool | None = None) -> list[str]:
    reasons = dtype_reasons("x", x)
    if backend == "tilelang":
        reasons += size_reasons("x", x, TILELANG_MAX_NUMEL, too_large, "the tilelang kernels take")
    return reasons


SPEC = OpSpec(name="activation", priority=("triton", "tilelang"), reasons=_reasons)


def _fake_forward(x, *flags):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _triton_gelu_kernels() -> KernelBackend:
    from .triton import GELU_KERNELS

    return GELU_KERNELS


def _tilelang_gelu_kernels() -> KernelBackend:
    from .tilelang import GELU_KERNELS

    return GELU_KERNELS


def _triton_silu_kernels() -> KernelBackend:
    from .triton import SILU_KERNELS

    return SILU_KERNELS


def _tilelang_silu_kernels() -> KernelBackend:
    from .tilelang import SILU_KERNELS

    return SILU_KERNELS


# kernel modules: gelu_forward(x, tanh) -> y      gelu_backward(dy, x, tanh, y) -> (dx, None)
#                 silu_forward(x) -> y            silu_backward(dy, x, y) -> (dx,)
# backward reads x, never y (None in eager calls)
GELU_KERNEL = KernelOp(
    "activation_gelu",
    "Tensor x, bool tanh",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_gelu_kernels,
        "tilelang": _tilelang_gelu_kernels,
    },
)
SILU_KERNEL = KernelOp(
    "activation_silu",
    "Tensor x",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_silu_kernels,
        "tilelang": _tilelang_silu_kernels,
    },
)


def gelu(x: torch.Tensor, approximate: str = "none", *, backend: Backend | None = None) -> torch.Tensor:
    """As F.gelu: x * Phi(x), or its tanh approximation with approximate="tanh"."""
    check_tensor("x", x)
    if approximate not in APPROXIMATIONS:  # also anything that is not a string
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    too_large = x.numel() > TILELANG_MAX_NUMEL
    chosen = select_backend(
        SPEC, backend, x.device, (x.dtype, too_large), gelu, x=x, approximate=approximate, too_large=too_large
    )
    if chosen == "torch" or x.numel() == 0:
        return gelu_reference(x, approximate)
    return GELU_KERNEL(chosen, x, approximate == "tanh")


def silu(x: torch.Tensor, *, backend: Backend | None = None) -> torch.Tensor:
    """As F.silu: x * sigmoid(x)."""
    check_tensor("x", x)
    too_large = x.numel() > TILELANG_MAX_NUMEL
    chosen = select_backend(SPEC, backend, x.device, (x.dtype, too_large), silu, x=x, too_large=too_large)
    if chosen == "torch" or x.numel() == 0:
        return silu_reference(x)
    return SILU_KERNEL(chosen, x)
