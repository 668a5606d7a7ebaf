"""top_k(scores, k) and sample(logits, temperature, top_k, top_p): selection and sampling over the last dim.

top_k returns torch.topk's values; its indices are torch's where the values are distinct, and among equal values
(-0.0 equals +0.0; NaN ranks above +inf, as in torch.topk) the lower index comes first. Both backends return the k
entries sorted (best first) whatever `sorted` says: sorted=False only allows another order, as in torch.topk.

sample draws one id per row. Every backend draws exactly one uniform per row from the generator
(torch.rand(B, generator=generator) on the logits' device) and inverts the restricted CDF in the same order
(descending probability, then ascending id), so the same generator state gives the same ids on every backend up to
floating-point ties at the CDF boundaries.

The triton and tilelang backends select with a radix select (no sort of the row: select_plan holds what their hosts
share) and need k (top_k) <= 2048, float32, bfloat16 or float16 inputs, and no gradient. `"auto"` tries tilelang
first: on an H200 it was 1.15-2.1x faster than triton at every benchmark case (docs/benchmark/sampling.md).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..backends import Backend, OpSpec, select_backend
from ..checks import KERNEL_DTYPES, check_bool, check_readable, check_strided, check_tensor, dtype_reasons
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from .reference import restricted_draw, sample_reference, top_k_reference
from .select_plan import MAX_K

MAX_WIDTH = 2**31 - 1  # the kernels index a row with 32-bit offsets


def _reasons(backend: str, scores: torch.Tensor, k: int | None, needs_grad: bool = False) -> list[str]:
    """k: the top-k size (the largest top_k of sample), None where sample has no top_k."""
    reasons = dtype_reasons("the scores (logits)", scores, KERNEL_DTYPES)
    if k is None:
        reasons.append(f"sample without top_k draws from the whole sorted vocabulary; the {backend} kernels need top_k")
    elif k > MAX_K:
        reasons.append(f"k = {k}; the {backend} kernels select at most {MAX_K} entries per row")
    if scores.shape[-1] > MAX_WIDTH:
        reasons.append(f"the last dim has {scores.shape[-1]} entries; the {backend} kernels take at most {MAX_WIDTH}")
    if needs_grad:
        reasons.append(
            f"scores require grad; the {backend} kernels are forward-only (run under torch.no_grad(), or "
            "backend='torch')"
        )
    return reasons


SPEC = OpSpec(name="sampling", priority=("tilelang", "triton"), reasons=_reasons, widths=("scores",))


def _fake_top_k(scores, k, largest):
    shape = (*scores.shape[:-1], k)
    return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.int64)


def _fake_sample(logits, keep_k, max_k, temperature, top_p, uniforms):
    return logits.new_empty(logits.shape[:1], dtype=torch.int64)


def _triton_top_k_kernels() -> KernelBackend:
    from .triton import TOP_K_KERNELS

    return TOP_K_KERNELS


def _tilelang_top_k_kernels() -> KernelBackend:
    from .tilelang import TOP_K_KERNELS

    return TOP_K_KERNELS


def _triton_sample_kernels() -> KernelBackend:
    from .triton import SAMPLE_KERNELS

    return SAMPLE_KERNELS


def _tilelang_sample_kernels() -> KernelBackend:
    from .tilelang import SAMPLE_KERNELS

    return SAMPLE_KERNELS


# kernel modules: top_k_forward(scores [..., V], k, largest) -> (values, indices) [..., k]
#                 sample_forward(logits [B, V], keep_k [B] int32, max_k, temperature, top_p, uniforms [B] fp32) -> ids [B]
TOP_K_KERNEL = KernelOp(
    "sampling_top_k",
    "Tensor scores, int k, bool largest",
    n_outputs=2,
    n_saved=0,
    fake_forward=_fake_top_k,
    backends={
        "triton": _triton_top_k_kernels,
        "tilelang": _tilelang_top_k_kernels,
    },
)
SAMPLE_KERNEL = KernelOp(
    "sampling_sample",
    "Tensor logits, Tensor keep_k, int max_k, Tensor temperature, Tensor top_p, Tensor uniforms",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_sample,
    backends={
        "triton": _triton_sample_kernels,
        "tilelang": _tilelang_sample_kernels,
    },
)


def _check_count(name: str, value, width: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int from 1 to {width} (the last dim), got {type(value).__name__}")
    if not 1 <= value <= width:
        raise ValueError(f"{name}: expected an int from 1 to {width} (the size of the last dim), got {value}")


def top_k(
    scores: torch.Tensor, k: int, *, largest: bool = True, sorted: bool = True, backend: Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest (or smallest) entries of the last dim of scores [..., V]: (values, int64 indices) [..., k].

    Values as torch.topk; among equal values the lower index first. Gradients flow to scores on the torch backend
    (as torch.topk's values); the triton and tilelang backends are forward-only.
    """
    check_tensor("scores", scores, min_dim=1)
    width = scores.shape[-1]
    _check_count("k", k, width)
    k = int(k)  # any Integral (numpy's too) as a Python int: the launchers and the kernel schema take one
    check_bool("largest", largest)
    check_bool("sorted", sorted)
    needs_grad = scores.requires_grad and torch.is_grad_enabled()
    key = (scores.dtype, k <= MAX_K, width <= MAX_WIDTH, needs_grad)
    chosen = select_backend(SPEC, backend, scores.device, key, scores=scores, k=k, needs_grad=needs_grad)
    if chosen == "torch" or scores.numel() == 0:
        return top_k_reference(scores, k, largest)
    return TOP_K_KERNEL(chosen, scores, k, largest)


def _per_row(
    name: str, value, rows: int, device: torch.device, dtype: torch.dtype, expected: str, valid
) -> torch.Tensor:
    """A number or a [rows] tensor, checked with valid(value) (comparisons only: a bool for a number, a bool tensor
    for a tensor, whose values are read on the host), as a [rows] tensor of dtype on device."""
    if isinstance(value, torch.Tensor):
        check_strided(name, value)
        integral = dtype == torch.int32
        if (value.is_floating_point() or value.dtype == torch.bool) if integral else not value.is_floating_point():
            raise TypeError(
                f"{name}: expected {'an integer' if integral else 'a floating-point'} tensor, got {value.dtype}"
            )
        if value.shape != (rows,):
            raise ValueError(
                f"{name}: expected a number or a tensor of shape ({rows},) (one per row), got {tuple(value.shape)}"
            )
        if value.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} like logits, got one on {value.device}")
        check_readable(name, value, "to check them")
        if rows and not bool(valid(value).all()):
            raise ValueError(f"{name}: expected {expected} in every row, got {value.tolist()}")
        if value.dtype == torch.float64 and dtype == torch.float32:  # as a number past float32's range is taken
            value = value.clamp(max=torch.finfo(dtype).max)
        return value.to(dtype)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {expected} (a number or a per-row tensor), got {type(value).__name__}")
    if not valid(value):  # plain Python: nothing for torch.compile to trace
        raise ValueError(f"{name}: expected {expected}, got {value}")
    if dtype.is_floating_point:  # a finite number past float32's range (a temperature of 1e39): its widest value
        value = min(value, torch.finfo(dtype).max)
    return torch.full((rows,), value, dtype=dtype, device=device)


def sample(
    logits: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    generator: torch.Generator | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """One id per row of logits [B, V] (int64 [B]), drawn from softmax(logits / temperature) restricted to the
    top_k largest logits (when given), then to the smallest set of the most probable of those whose cumulative
    probability, renormalised over the top-k set, reaches top_p (when given; the id that crosses top_p is kept; ties
    broken by the lower id), renormalised again.

    temperature > 0 (finite), 0 < top_p <= 1, 1 <= top_k <= V: each a number or a tensor of one value per row (its
    values are read on the host to check them, and top_k's to size the selection).

    Reproducibility: every backend draws exactly one uniform per row from `generator` (torch's default when None):
    torch.rand(B, generator=generator, device=logits.device), and inverts the restricted CDF in the same order
    (descending probability, then ascending id), so the same generator state gives the same ids on every backend up
    to floating-point ties at the CDF boundaries.

    NaN logits, or a row whose logits are all -inf: on the CPU a ValueError naming logits (checked on every eager
    call; compiled calls treat them as CUDA calls do). On CUDA the check costs no host sync:
    a row with a NaN among its top-k survivors (NaN ranks above every number, so any NaN in the row when top_k is
    None or the row holds fewer than top_k numbers above it), or whose logits are all -inf, gets the id -1; test
    `ids < 0` where it matters.
    """
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [B, V] (rows of vocabulary logits), got {tuple(logits.shape)}")
    rows, width = logits.shape
    if width == 0:
        raise ValueError("logits: the vocabulary dim (the last) is empty")
    device = logits.device
    temperature = _per_row(
        "temperature",
        temperature,
        rows,
        device,
        torch.float32,
        "a finite number > 0",
        lambda t: (t > 0) & (t < math.inf),  # NaN fails both
    )
    top_p = _per_row(
        "top_p",
        1.0 if top_p is None else top_p,
        rows,
        device,
        torch.float32,
        "a number in (0, 1]",
        lambda t: (t > 0) & (t <= 1),
    )
    if top_k is None:
        keep_k, max_k = torch.full((rows,), width, dtype=torch.int32, device=device), None
    else:
        if isinstance(top_k, bool) or not isinstance(top_k, (numbers.Integral, torch.Tensor)):
            raise TypeError(f"top_k: expected an int or an integer per-row tensor, got {type(top_k).__name__}")
        keep_k = _per_row(
            "top_k",
            top_k,
            rows,
            device,
            torch.int32,
            f"an int from 1 to {width} (the vocabulary size)",
            lambda t: (t >= 1) & (t <= width),
        )
        max_k = int(top_k) if not isinstance(top_k, torch.Tensor) else int(keep_k.max()) if rows else 1
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != device.type:
            raise ValueError(
                f"generator: expected a generator on {device.type} like logits, got one on {generator.device.type}"
            )
    if device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(torch.isnan(logits).any()):
            raise ValueError("logits: contains NaN (the distribution is undefined)")
        all_neg_inf = (logits == -math.inf).all(-1)
        if bool(all_neg_inf.any()):
            row = int(all_neg_inf.nonzero()[0, 0])
            raise ValueError(f"logits: every logit of row {row} is -inf (the distribution is undefined)")
    uniforms = torch.rand(rows, generator=generator, device=device)
    logits = logits.detach()
    key = (logits.dtype, max_k is None, max_k is not None and max_k <= MAX_K, width <= MAX_WIDTH)
    chosen = select_backend(SPEC, backend, device, key, scores=logits, k=max_k)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if chosen == "torch":
        return sample_reference(logits, keep_k, max_k or width, temperature, top_p, uniforms)
    return SAMPLE_KERNEL(chosen, logits, keep_k, max_k, temperature, top_p, uniforms)


__all__ = ["MAX_K", "SPEC", "restricted_draw", "sample", "top_k"]
