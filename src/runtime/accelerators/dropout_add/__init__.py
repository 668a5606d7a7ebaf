"""dropout_add(x, residual, p=0.0, training=True): residual + dropout(x, p).

The kernel backends draw the keep mask from a counter-based generator of (seed, element index)
and store no mask: backward draws it again. The seed is a one-element int64 tensor on x's device,
drawn by torch's generator of that device (`seeds.draw_seed_tensor`) and loaded by the kernels;
backward reuses the forward's seed tensor (an argument of the op, saved for backward). So
torch.manual_seed repeats a run, no host sync is needed, and the op runs on its kernel backends
inside CUDA graphs: every replay draws a new seed, hence a new mask. Not training, or p == 0, is
x + residual (still differentiable) and draws nothing.

x and residual have one shape and dtype, under autocast too (which casts neither): a mix is refused naming residual,
not promoted as eager residual + x would.
"""

from __future__ import annotations

import torch

from ..backends import Backend, OpSpec, select_backend
from ..checks import as_probability, check_bool, check_like, check_tensor, dtype_reasons, size_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..seeds import draw_seed_tensor
from .reference import dropout_add_reference

# the tilelang kernels index elements with 32-bit integers (blocks of up to 2^16 elements);
# the triton kernels' Philox counters are distinct up to 2^64 / 4 elements, so no limit there
TILELANG_MAX_NUMEL = 2**31 - 2**16


def _reasons(backend: str, x: torch.Tensor, residual: torch.Tensor, too_large: bool | None = None) -> list[str]:
    reasons = dtype_reasons("x", x)
    if backend == "tilelang":
        reasons += size_reasons("x", x, TILELANG_MAX_NUMEL, too_large, "the tilelang kernels take")
    return reasons


# tilelang first: faster on H100 (8192 x 4096 bf16: 2.85 vs 2.51 TB/s forward+backward, GPU time)
SPEC = OpSpec(name="dropout_add", priority=("tilelang", "triton"), reasons=_reasons)


def _fake_forward(x, residual, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(x, residual, p, seed) -> out
#                 backward(dout, x, residual, p, seed, out) -> (dx, dresidual, None, None)
# seed: the int64 tensor of shape (1,) from draw_seed_tensor, on x's device
KERNEL = KernelOp(
    "dropout_add",
    "Tensor x, Tensor residual, float p, Tensor seed",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def check_dropout_add_inputs(x: torch.Tensor, residual: torch.Tensor, p) -> float:
    """Validate the arguments; returns p as a float."""
    check_tensor("x", x)
    check_tensor("residual", residual)
    check_like("residual", residual, "x", x, "residual + x")
    return as_probability("p", p)


def dropout_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    p: float = 0.0,
    training: bool = True,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    p = check_dropout_add_inputs(x, residual, p)
    check_bool("training", training)
    too_large = x.numel() > TILELANG_MAX_NUMEL
    chosen = select_backend(
        SPEC,
        backend,
        x.device,
        (x.dtype, too_large),
        dropout_add if training and p else None,
        x=x,
        residual=residual,
        p=p,
        training=training,
        too_large=too_large,
    )
    if not training or p == 0.0 or x.numel() == 0:
        return x + residual
    if chosen == "torch":
        return dropout_add_reference(x, residual, p, training)
    return KERNEL(chosen, x, residual, p, draw_seed_tensor(x.device))
