"""add_rms_norm / add_layer_norm(x, residual, ...): (norm(x + residual), x + residual), one pass each way.

The sum is rounded to the inputs' dtype (it is returned as the new residual stream) and the norm is taken of that
rounded sum, as the unfused `s = x + residual; norm(s)` computes it. Both outputs are differentiable: the gradient
reaching the sum is the norm's backward of dy plus the gradient of the new residual, and x and residual both get it.

x and residual have one shape and dtype, under autocast too (a mix is refused naming residual, not promoted); weight
and bias may be in another (fp32 with bf16 x): the outputs take x's dtype, the gradients their input's.
"""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..checks import check_like, check_tensor
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..norms import check_norm_inputs, norm_key, norm_reasons
from .reference import add_layer_norm_reference, add_rms_norm_reference

SPEC = OpSpec(name="add_norm", priority=("triton", "tilelang"), reasons=norm_reasons, widths=("x",))


def _fake_rms_forward(x, residual, weight, eps):
    rows = x.numel() // x.shape[-1]
    like = dict(memory_format=torch.contiguous_format)
    return torch.empty_like(x, **like), torch.empty_like(x, **like), x.new_empty(rows, dtype=torch.float32)


def _fake_layer_forward(x, residual, weight, bias, eps):
    return *_fake_rms_forward(x, residual, weight, eps), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _triton_rms_kernels() -> KernelBackend:
    from .triton import RMS_KERNELS

    return RMS_KERNELS


def _tilelang_rms_kernels() -> KernelBackend:
    from .tilelang import RMS_KERNELS

    return RMS_KERNELS


def _triton_layer_kernels() -> KernelBackend:
    from .triton import LAYER_KERNELS

    return LAYER_KERNELS


def _tilelang_layer_kernels() -> KernelBackend:
    from .tilelang import LAYER_KERNELS

    return LAYER_KERNELS


# kernel modules: rms_forward(x, residual, weight, eps) -> (y, total, rstd[rows] fp32)
#                 rms_backward(dy, dtotal, x, residual, weight, eps, y, total, rstd) -> (dx, dresidual, dweight, None)
#                 layer_forward(x, residual, weight, bias, eps) -> (y, total, rstd, mean)
#                 layer_backward(dy, dtotal, x, residual, weight, bias, eps, y, total, rstd, mean)
#                     -> (dx, dresidual, dweight, dbias, None)
# total = x + residual; backward reads total and the statistics, not x, residual (unread_args: eager calls keep them
# not alive for it) or y; dx and dresidual are one tensor (the custom ops copy one: their outputs may not alias)
RMS_KERNEL = KernelOp(
    "add_norm_rms",
    "Tensor x, Tensor residual, Tensor? weight, float eps",
    n_outputs=2,
    n_saved=1,
    fake_forward=_fake_rms_forward,
    unread_args=("x", "residual"),
    backends={
        "triton": _triton_rms_kernels,
        "tilelang": _tilelang_rms_kernels,
    },
)
LAYER_KERNEL = KernelOp(
    "add_norm_layer",
    "Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps",
    n_outputs=2,
    n_saved=2,
    fake_forward=_fake_layer_forward,
    unread_args=("x", "residual"),
    backends={
        "triton": _triton_layer_kernels,
        "tilelang": _tilelang_layer_kernels,
    },
)


def check_add_norm_inputs(x, residual, eps, weight=None, bias=None) -> None:
    check_norm_inputs(x, eps, weight, bias)
    check_tensor("residual", residual)
    check_like("residual", residual, "x", x, "x + residual")


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight, eps), x + residual)."""
    check_add_norm_inputs(x, residual, eps, weight)
    chosen = select_backend(
        SPEC, backend, x.device, norm_key(x, weight), add_rms_norm, x=x, residual=residual, weight=weight, eps=eps
    )
    if chosen == "torch" or x.numel() == 0:
        return add_rms_norm_reference(x, residual, weight, eps)
    y, total = RMS_KERNEL(chosen, x, residual, weight, float(eps))
    return y, _sum_output(total, x, residual)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual, weight, bias, eps), x + residual)."""
    check_add_norm_inputs(x, residual, eps, weight, bias)
    chosen = select_backend(
        SPEC,
        backend,
        x.device,
        norm_key(x, weight, bias),
        add_layer_norm,
        x=x,
        residual=residual,
        weight=weight,
        bias=bias,
        eps=eps,
    )
    if chosen == "torch" or x.numel() == 0:
        return add_layer_norm_reference(x, residual, weight, bias, eps)
    y, total = LAYER_KERNEL(chosen, x, residual, weight, bias, float(eps))
    return y, _sum_output(total, x, residual)


def _sum_output(total: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x + residual as the kernels return it, detached where neither x nor residual requires grad (only the norm's
    weight or bias does): the sum does not depend on them, so it requires no grad, as in the torch backend (the kernel
    op marks every output of its autograd node differentiable)."""
    return total if x.requires_grad or residual.requires_grad else total.detach()
