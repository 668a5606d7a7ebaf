"""layer_norm(x, weight=None, bias=None, eps=1e-5): F.layer_norm over the last dimension."""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..norms import check_norm_inputs, norm_key, norm_reasons
from .reference import layer_norm_reference

SPEC = OpSpec(name="layer_norm", priority=("triton", "tilelang"), reasons=norm_reasons, widths=("x",))


def _fake_forward(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(x, weight, bias, eps) -> (y, mean[rows] fp32, rstd[rows] fp32)
#                 backward(dy, x, weight, bias, eps, y, mean, rstd) -> (dx, dweight, dbias, None); y is None in eager
#                 calls (unread)
KERNEL = KernelOp(
    "layer_norm",
    "Tensor x, Tensor? weight, Tensor? bias, float eps",
    n_outputs=1,
    n_saved=2,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    check_norm_inputs(x, eps, weight, bias)
    chosen = select_backend(
        SPEC, backend, x.device, norm_key(x, weight, bias), layer_norm, x=x, weight=weight, bias=bias, eps=eps
    )
    if chosen == "torch" or x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps)
    return KERNEL(chosen, x, weight, bias, float(eps))
