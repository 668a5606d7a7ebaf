"""l2norm(x, eps=1e-6): x * rsqrt(sum(x^2, -1) + eps)."""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..norms import check_norm_inputs, norm_key, norm_reasons
from .reference import l2norm_reference

SPEC = OpSpec(name="l2norm", priority=("triton", "tilelang"), reasons=norm_reasons, widths=("x",))


def _fake_forward(x, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(x, eps) -> (y, rstd[rows] fp32); y contiguous
#                 infer(x, eps) -> (y,) where the module has it (Triton: no rstd)
#                 backward(dy, x, eps, y, rstd) -> (dx, None), from y and rstd
KERNEL = KernelOp(
    "l2norm",
    "Tensor x, float eps",
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def l2norm(x: torch.Tensor, eps: float = 1e-6, *, backend: Backend | None = None) -> torch.Tensor:
    check_norm_inputs(x, eps)
    chosen = select_backend(SPEC, backend, x.device, norm_key(x), l2norm, x=x, eps=eps)
    if chosen == "torch" or x.numel() == 0:
        return l2norm_reference(x, eps)
    return KERNEL(chosen, x, float(eps))
