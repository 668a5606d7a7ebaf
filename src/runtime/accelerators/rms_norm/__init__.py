"""rms_norm(x, weight=None, eps=1e-6): x * rsqrt(mean(x^2, -1) + eps) * weight."""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..norms import check_norm_inputs, norm_key, norm_reasons
from .reference import rms_norm_reference

SPEC = OpSpec(name="rms_norm", priority=("triton", "tilelang"), reasons=norm_reasons, widths=("x",))


def _fake_forward(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(x, weight, eps) -> (y, rstd[rows] fp32)
#                 backward(dy, x, weight, eps, y, rstd) -> (dx, dweight, None); y is None in eager calls (unread)
KERNEL = KernelOp(
    "rms_norm",
    "Tensor x, Tensor? weight, float eps",
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, backend: Backend | None = None
) -> torch.Tensor:
    check_norm_inputs(x, eps, weight)
    chosen = select_backend(SPEC, backend, x.device, norm_key(x, weight), rms_norm, x=x, weight=weight, eps=eps)
    if chosen == "torch" or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    return KERNEL(chosen, x, weight, float(eps))
