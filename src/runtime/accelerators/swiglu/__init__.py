"""swiglu(gate, up): silu(gate) * up, elementwise over tensors of one shape and dtype (under autocast too, which casts
neither: a mix is refused naming up, not promoted as eager silu(gate) * up would)."""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..checks import check_like, check_tensor, dtype_reasons, size_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import swiglu_reference

# the tilelang kernels index elements with 32-bit integers (blocks of up to 2^16 elements)
TILELANG_MAX_NUMEL = 2**31 - 2**16


def _reasons(backend: str, gate: torch.Tensor, up: torch.Tensor, too_large: bool | None = None) -> list[str]:
    reasons = dtype_reasons("gate", gate)
    if backend == "tilelang":
        reasons += size_reasons("gate", gate, TILELANG_MAX_NUMEL, too_large, "the tilelang kernels take")
    return reasons


# triton first: the same GPU time as tilelang on H100 (8192 x 4096 bf16), a shorter first call
SPEC = OpSpec(name="swiglu", priority=("triton", "tilelang"), reasons=_reasons)


def _fake_forward(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(gate, up) -> y
#                 backward(dy, gate, up, y) -> (dgate, dup)
KERNEL = KernelOp(
    "swiglu",
    "Tensor gate, Tensor up",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def check_swiglu_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensor("gate", gate)
    check_tensor("up", up)
    check_like("up", up, "gate", gate, "silu(gate) * up")


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend | None = None) -> torch.Tensor:
    check_swiglu_inputs(gate, up)
    too_large = gate.numel() > TILELANG_MAX_NUMEL
    chosen = select_backend(
        SPEC, backend, gate.device, (gate.dtype, too_large), swiglu, gate=gate, up=up, too_large=too_large
    )
    if chosen == "torch" or gate.numel() == 0:
        return swiglu_reference(gate, up)
    return KERNEL(chosen, gate, up)
