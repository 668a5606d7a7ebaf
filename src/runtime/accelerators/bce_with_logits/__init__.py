"""binary_cross_entropy_with_logits(logits, targets, weight=None, pos_weight=None, reduction="mean"): as torch.

How the kernels read their arguments (weight and pos_weight by one index map, the unit gradient) is in layout.py,
which both kernel modules import.

Two KernelOps, each backend declaring one KernelBackend for each (its module's KERNELS and UNIT_GRADIENT_KERNELS):
KERNEL, a forward and a backward kernel (the backward recomputes from the arguments), and UNIT_GRADIENT_KERNEL, for
small inputs whose logits alone need a gradient (GRAD_IN_FORWARD_MAX_NUMEL): its forward also writes the logits'
gradient for an incoming gradient of one, saved as its second result, and its backward (layout.unit_gradient_backward)
only scales it. It saves the logits (for their dtype, and as the edge a double backward's error node takes) and
that gradient, nothing else (unread_args), eager and compiled alike.
"""

from __future__ import annotations

import torch

from ..autocast import autocast_to_float32
from ..backends import Backend, OpSpec, select_backend
from ..checks import check_bool, check_readable, check_same_device, check_tensor, dtype_reasons, size_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .layout import kernel_operand
from .reference import REDUCTIONS, bce_with_logits_reference, loss_dtype

# flat indices are 32-bit in the kernels (with room for one block past the end)
MAX_KERNEL_NUMEL = 2**31 - 2**16

# Up to this many logits (launch-bound PCVR batches), when the logits alone need a gradient, the forward also writes
# it for an incoming gradient of one and backward only scales it: one launch path, not two (docs/tuning/bce_with_logits.md).
GRAD_IN_FORWARD_MAX_NUMEL = 2**16


def check_bce_inputs(logits, targets, weight, pos_weight, reduction) -> None:
    # Every call: the common case (plain tensors, no weights), when valid, in one frame; any other input goes through
    # the checks that name what is wrong.
    if (
        weight is None
        and pos_weight is None
        and type(logits) is torch.Tensor
        and type(targets) is torch.Tensor
        and logits.layout is torch.strided
        and targets.layout is torch.strided
        and logits.is_floating_point()
        and targets.is_floating_point()
        and targets.shape == logits.shape
        and targets.device == logits.device
        and reduction in REDUCTIONS
    ):
        return
    check_tensor("logits", logits)
    check_tensor("targets", targets)
    if targets.shape != logits.shape:
        raise ValueError(f"targets: expected the shape of logits {tuple(logits.shape)}, got {tuple(targets.shape)}")
    check_same_device("targets", targets, "logits", logits)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if weight is None and pos_weight is None:
        return
    for name, operand in (("weight", weight), ("pos_weight", pos_weight)):
        if operand is None:
            continue
        check_tensor(name, operand)
        check_same_device(name, operand, "logits", logits)
        try:
            broadcast = torch.broadcast_shapes(operand.shape, logits.shape)
        except RuntimeError:
            broadcast = None
        if broadcast != logits.shape:
            raise ValueError(
                f"{name}: expected a shape broadcastable to the logits' shape {tuple(logits.shape)}, "
                f"got {tuple(operand.shape)}"
            )


def check_target_range(targets: torch.Tensor) -> None:
    """Targets must be probabilities (this reads the tensor: it synchronises with the device)."""
    check_readable("targets", targets, "check_targets=True; pass check_targets=False")
    outside = ~((targets >= 0) & (targets <= 1))
    if bool(outside.any()):
        bad = targets[outside].flatten()[0].item()
        raise ValueError(
            f"targets: expected values in [0, 1] (check_targets=True), found {int(outside.sum())} outside, e.g. {bad}"
        )


def _needs_grad(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.requires_grad and torch.is_grad_enabled()


def bce_reasons(
    backend: str, logits, targets, weight=None, pos_weight=None, too_large: bool | None = None
) -> list[str]:
    reasons = dtype_reasons("logits", logits) + dtype_reasons("targets", targets)
    for name, operand in (("weight", weight), ("pos_weight", pos_weight)):
        if operand is None:
            continue
        reasons += dtype_reasons(name, operand)
        if _needs_grad(operand):
            reasons.append(f"{name} requires grad; the {backend} kernels compute gradients for logits and targets only")
    return reasons + size_reasons("logits", logits, MAX_KERNEL_NUMEL, too_large, "the kernels index")


def bce_key(logits, targets, weight=None, pos_weight=None) -> tuple:
    """Everything bce_reasons reads: the decision cache key."""
    return (
        logits.dtype,
        targets.dtype,
        None if weight is None else (weight.dtype, _needs_grad(weight)),
        None if pos_weight is None else (pos_weight.dtype, _needs_grad(pos_weight)),
        logits.numel() > MAX_KERNEL_NUMEL,
    )


# tilelang first: similar GPU time at 2^24 fp32 (fwd 60.0 vs 62.1 us, fwd+bwd 135 vs 126 us on an H100) and
# 20-30% less host time per call at PCVR batch sizes, where the op is launch-bound
SPEC = OpSpec(name="bce_with_logits", priority=("triton", "tilelang"), reasons=bce_reasons)


def _fake_forward(logits, targets, weight, pos_weight, reduction, targets_grad=False):
    shape = logits.shape if reduction == "none" else ()
    return logits.new_empty(shape, dtype=loss_dtype(logits, targets, weight, pos_weight))


def _fake_unit_gradient_forward(logits, targets, weight, pos_weight, reduction):
    loss = _fake_forward(logits, targets, weight, pos_weight, reduction)
    return loss, logits.new_empty(logits.shape, dtype=torch.float32)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


def _triton_unit_gradient_kernels() -> KernelBackend:
    from .triton import UNIT_GRADIENT_KERNELS

    return UNIT_GRADIENT_KERNELS


def _tilelang_unit_gradient_kernels() -> KernelBackend:
    from .tilelang import UNIT_GRADIENT_KERNELS

    return UNIT_GRADIENT_KERNELS


_ARGS = "Tensor logits, Tensor targets, Tensor? weight, Tensor? pos_weight, str reduction"

# kernel modules: forward(logits, targets, weight, pos_weight, reduction, targets_grad) -> loss
#                 backward(dloss, logits, targets, weight, pos_weight, reduction, targets_grad, loss)
#                     -> (dlogits, dtargets or None, None, None, None, None)    (loss: None, backward_reads="arguments")
# weight / pos_weight arrive prepared by kernel_operand; targets_grad says whether to write dtargets.
KERNEL = KernelOp(
    "bce_with_logits",
    f"{_ARGS}, bool targets_grad",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)

# kernel modules: unit_gradient_forward(logits, targets, weight, pos_weight, reduction) -> (loss, unit gradient fp32)
#                 layout.unit_gradient_backward(dloss, *args, loss, unit) -> (dlogits, None, None, None, None)
UNIT_GRADIENT_KERNEL = KernelOp(
    "bce_with_logits_unit_gradient",
    _ARGS,
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_unit_gradient_forward,
    backends={
        "triton": _triton_unit_gradient_kernels,
        "tilelang": _tilelang_unit_gradient_kernels,
    },
    unread_args=("targets", "weight", "pos_weight"),
)


def binary_cross_entropy_with_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    check_targets: bool = False,
    backend: Backend | None = None,
) -> torch.Tensor:
    """As torch.nn.functional.binary_cross_entropy_with_logits, with fp32 math for every input dtype. Under autocast
    the float16 / bfloat16 arguments are cast to float32 first, as autocast does for torch's op (a float32 loss).

    check_targets=True verifies that targets lie in [0, 1] (one device synchronisation).
    The mean and sum reductions are deterministic (fixed-order, no atomics) on every backend.
    """
    check_bce_inputs(logits, targets, weight, pos_weight, reduction)
    check_bool("check_targets", check_targets)
    if check_targets:
        check_target_range(targets)
    # as torch under autocast: every argument in float32, so the loss is float32 (an fp16 loss times a GradScaler
    # scale would overflow); the gradients reach the inputs in their own dtypes through the casts
    logits, targets, weight, pos_weight = autocast_to_float32(logits.device.type, logits, targets, weight, pos_weight)
    key = bce_key(logits, targets, weight, pos_weight)
    chosen = select_backend(
        SPEC,
        backend,
        logits.device,
        key,
        binary_cross_entropy_with_logits,
        logits=logits,
        targets=targets,
        weight=weight,
        pos_weight=pos_weight,
        reduction=reduction,
        check_targets=check_targets,
        too_large=key[-1],  # logits.numel() > MAX_KERNEL_NUMEL
    )
    if chosen == "torch" or logits.numel() == 0:
        return bce_with_logits_reference(logits, targets, weight, pos_weight, reduction)
    return kernel_loss(logits, targets, weight, pos_weight, reduction, chosen)


def kernel_loss(
    logits, targets, weight, pos_weight, reduction, backend: str, grad_in_forward_max_numel=GRAD_IN_FORWARD_MAX_NUMEL
):
    """The loss by a kernel backend's module, for checked inputs: binary_cross_entropy_with_logits past dispatch.
    Up to grad_in_forward_max_numel logits, the forward also writes the logits' gradient (see the constant)."""
    if weight is not None or pos_weight is not None:
        weight, pos_weight = kernel_operand(weight, logits.shape), kernel_operand(pos_weight, logits.shape)
    grad_enabled = torch.is_grad_enabled()
    targets_grad = grad_enabled and targets.requires_grad
    if grad_enabled and logits.requires_grad and not targets_grad and logits.numel() <= grad_in_forward_max_numel:
        return UNIT_GRADIENT_KERNEL(backend, logits, targets, weight, pos_weight, reduction)
    return KERNEL(backend, logits, targets, weight, pos_weight, reduction, targets_grad)
