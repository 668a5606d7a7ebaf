"""silu_attention: HSTU pointwise attention over packed variable-length sequences.

q, k, v [total, H, D] hold N sequences back to back (rows cu_seqlens[s]:cu_seqlens[s + 1]). For sequence s,
local query i and key j:

    score_ij = alpha * <q_i, k_j> + position_bias[min(|i - j|, P - 1)]
               + time_bias[min(floor(log2(1 + |t_i - t_j|)), T - 1)]
    out_i    = sum_j dropout(silu(score_ij) / max_seqlen * visible_ij) v_j

Visible: j <= i when causal, else every key of the sequence; with num_targets the last num_targets[s] tokens are
candidates, which are seen by no query but themselves.

Value checks (cu_seqlens rising from 0 to total, max_seqlen covering the longest sequence, num_targets within each
sequence) need the offsets on the host: they cost one synchronisation, made once for offsets passed again unchanged
(every attention layer of a model passes the same cu_seqlens) and skipped while compiling or capturing a CUDA graph.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..autocast import autocast_enabled, autocast_inputs, without_autocast
from ..backends import Backend, OpSpec, select_backend
from ..checks import (
    as_finite_float,
    as_int,
    as_probability,
    check_bool,
    check_readable,
    check_same_device,
    check_strided,
    check_tensor,
)
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..seeds import draw_seed_tensor
from .reference import silu_attention_reference

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


@dataclass(frozen=True)
class KernelSupport:
    dtypes: tuple[torch.dtype, ...]
    backward: bool = True
    dtype_note: str = ""


SUPPORT: dict[str, KernelSupport] = {
    # fp32 runs exact fp32 products (tf32 would miss the fp32 accuracy bound)
    "triton": KernelSupport(dtypes=(torch.bfloat16, torch.float16, torch.float32)),
    "tilelang": KernelSupport(
        dtypes=(torch.bfloat16, torch.float16),
        dtype_note="the tilelang kernels compute with bf16/fp16 tensor cores; cast q/k/v to bfloat16 or float16 "
        "(or run under autocast), or use backend='triton'",
    ),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def needs_grad(*tensors) -> bool:
    """This call will be differentiated: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def input_reasons(
    backend: str, q=None, k=None, v=None, position_bias=None, time_bias=None, dropout_p: float = 0.0
) -> list[str]:
    """Why a kernel backend cannot run these inputs (empty: it can). Every input is optional (explain())."""
    support = SUPPORT[backend]
    reasons = []
    if not support.backward and needs_grad(q, k, v, position_bias, time_bias):
        reasons.append(
            f"an input requires grad; the {backend} silu_attention kernels are forward-only (use backend='triton' "
            "for training)"
        )
    if q is not None:
        if q.dtype not in support.dtypes:
            allowed = ", ".join(_dtype_name(d) for d in support.dtypes)
            note = f" ({support.dtype_note})" if support.dtype_note else ""
            reasons.append(f"q has dtype {_dtype_name(q.dtype)}; the {backend} kernels take {allowed}{note}")
        d = q.shape[-1]
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            reasons.append(f"head dim {d} is outside the kernels' range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
        if backend == "triton" and q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # the interpreter's tl.dot multiplies bfloat16 operands' raw bits (seen with Triton 3.9)
            reasons.append(
                "bfloat16 on the CPU: the Triton interpreter computes bfloat16 dot products wrongly; use float16 or float32 there"
            )
    return reasons


SPEC = OpSpec(name="silu_attention", priority=("tilelang", "triton"), reasons=input_reasons, widths=("q",))


def _fake_forward(
    q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed, max_seqlen, alpha, causal, dropout_p
):
    return q.new_empty(q.shape)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(q, k, v, cu_seqlens, num_targets, position_bias, time_bias, timestamps, seed,
#                         max_seqlen, alpha, causal, dropout_p) -> o [total, H, D] in q's dtype
#                 backward(do, <the same arguments>, None) -> a gradient (or None) per argument
# cu_seqlens, num_targets: int32 contiguous; position_bias / time_bias: [H, P] / [H, T] views (a [P] bias expanded,
# head stride 0) whose gradients are summed back by the launcher; timestamps int64 contiguous; seed: a one-element
# int64 tensor on q's device (None without dropout).
# max_seqlen is a SymInt: it changes from batch to batch, and an int would specialise a compiled graph on it
KERNEL = KernelOp(
    "silu_attention",
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor? num_targets, Tensor? position_bias, Tensor? time_bias, "
    "Tensor? timestamps, Tensor? seed, SymInt max_seqlen, float alpha, bool causal, float dropout_p",
    n_outputs=1,
    n_saved=0,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


# --------------------------------------------------------------------------- checks


def _check_bias(name: str, bias, h: int, q: torch.Tensor) -> None:
    if bias is None:
        return
    check_tensor(name, bias)
    check_same_device(name, bias, "q", q)
    if bias.dim() not in (1, 2) or bias.shape[-1] == 0 or (bias.dim() == 2 and bias.shape[0] != h):
        size = "P" if name == "position_bias" else "T"
        raise ValueError(
            f"{name}: expected shape [{size}] or [H, {size}] = [{h}, {size}] with {size} >= 1, got {tuple(bias.shape)}"
        )


def _check_index(name: str, x, expected: str, n: int, q: torch.Tensor, dtypes=(torch.int32, torch.int64)) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an integer torch.Tensor {expected}, got {type(x).__name__}")
    check_strided(name, x)
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(_dtype_name, dtypes))}, got {_dtype_name(x.dtype)}")
    if x.dim() != 1 or x.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},) {expected}, got {tuple(x.shape)}")
    check_same_device(name, x, "q", q)


def _check_inputs(
    q, k, v, cu_seqlens, max_seqlen, alpha, causal, num_targets, position_bias, time_bias, timestamps, dropout_p
) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor [total, H, D], got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        check_same_device(name, x, "q", q)
        if x.shape != q.shape:
            raise ValueError(f"{name}: expected the shape of q {tuple(q.shape)} ([total, H, D]), got {tuple(x.shape)}")
        if x.dtype != q.dtype and not autocast_enabled(q.device.type):
            raise TypeError(f"{name}: expected dtype {_dtype_name(q.dtype)} like q, got {_dtype_name(x.dtype)}")
    total, h, d = q.shape
    if d == 0 or h == 0:
        raise ValueError(f"q: the head count and head dim must be positive; shape {tuple(q.shape)}")
    if isinstance(cu_seqlens, torch.Tensor):
        check_strided("cu_seqlens", cu_seqlens)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [N + 1] of offsets from 0 to total, got {got}")
    n = cu_seqlens.shape[0] - 1
    _check_index("cu_seqlens", cu_seqlens, "(N + 1 offsets)", n + 1, q)
    max_seqlen = as_int(
        "max_seqlen", max_seqlen, least=0, expected="a non-negative int (the longest sequence's length)"
    )
    if alpha is not None:
        alpha = as_finite_float("alpha", alpha)
    check_bool("causal", causal)  # a string or None would be read by its truth value
    if num_targets is not None:
        _check_index("num_targets", num_targets, "(one count per sequence)", n, q)
    _check_bias("position_bias", position_bias, h, q)
    _check_bias("time_bias", time_bias, h, q)
    if time_bias is not None and timestamps is None:
        raise ValueError("time_bias: given without timestamps; pass timestamps (int64 [total], seconds) too")
    if timestamps is not None and time_bias is None:  # they only index the time bias: alone they would do nothing
        raise ValueError("timestamps: given without time_bias; pass time_bias ([T] or [H, T]) too, or no timestamps")
    if timestamps is not None:
        _check_index("timestamps", timestamps, "(one per token: [total])", total, q)
    dropout_p = as_probability("dropout_p", dropout_p)
    _check_values(cu_seqlens, num_targets, max_seqlen, total)
    return max_seqlen, alpha, dropout_p


_checked: tuple = ()  # (weakrefs and versions of the last cu_seqlens / num_targets checked, max_seqlen, total)


def _identity(x) -> tuple:
    return (None, -1) if x is None else (weakref.ref(x), x._version)


def _same(checked: tuple, x) -> bool:
    ref, version = checked
    if x is None:  # a dead weakref also returns None: only "no tensor last time" matches no tensor now
        return ref is None
    return ref is not None and ref() is x and version == x._version


def _check_values(cu_seqlens: torch.Tensor, num_targets, max_seqlen: int, total: int) -> None:
    """One synchronisation: the offsets rise from 0 to total, max_seqlen >= the longest sequence, targets fit."""
    global _checked
    if torch.compiler.is_compiling() or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    check_readable("cu_seqlens", cu_seqlens, "the bounds of the sequences")
    if num_targets is not None:
        check_readable("num_targets", num_targets, "to check them against the sequences' lengths")
    # inference tensors (made under torch.inference_mode) have no version counter: they are checked on every call
    remember = not (cu_seqlens.is_inference() or (num_targets is not None and num_targets.is_inference()))
    if (
        remember
        and _checked
        and _same(_checked[0], cu_seqlens)
        and _same(_checked[1], num_targets)
        and _checked[2:] == (max_seqlen, total)
    ):
        return
    offsets = cu_seqlens.long()
    lengths = offsets[1:] - offsets[:-1]
    stats = [offsets[0], offsets[-1]]
    if lengths.numel():
        stats += [lengths.min(), lengths.max()]
        if num_targets is not None:
            stats += [num_targets.min(), (lengths - num_targets.long()).min()]
    values = torch.stack(stats).tolist()
    first, last = values[0], values[1]
    if first != 0:
        raise ValueError(f"cu_seqlens: expected offsets rising from 0 to total ({total}); the first is {first}")
    if last != total:
        raise ValueError(
            f"cu_seqlens: expected offsets rising from 0 to total = q.shape[0] = {total}; the last is {last}"
        )
    if lengths.numel():
        shortest, longest = values[2], values[3]
        if shortest < 0:
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets from 0 to total ({total}); one step is {shortest}"
            )
        if longest > max_seqlen:
            raise ValueError(
                f"max_seqlen: expected at least the longest sequence's length ({longest}), got {max_seqlen}"
            )
        if num_targets is not None:
            if values[4] < 0:
                raise ValueError(f"num_targets: expected counts >= 0, got {values[4]}")
            if values[5] < 0:
                raise ValueError(
                    f"num_targets: expected at most each sequence's length; one sequence has {-values[5]} more targets than tokens"
                )
    if remember:
        _checked = (_identity(cu_seqlens), _identity(num_targets), max_seqlen, total)


def _autocast(q, k, v):
    """Under autocast, attention runs in the autocast dtype (as SDPA does)."""
    return autocast_inputs(q.device.type, q, k, v)


def _as_heads(bias, h: int):
    """A [P] bias as the [H, P] view the kernels read (head stride 0); [H, P] as it is."""
    return None if bias is None else (bias.expand(h, -1) if bias.dim() == 1 else bias)


def silu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int,
    alpha: float | None = None,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """HSTU attention: sum_j dropout(silu(score_ij) / max_seqlen) v_j over the visible keys (see the module doc).

    q, k, v [total, H, D]; cu_seqlens int [N + 1] (0, ..., total); max_seqlen >= every sequence's length;
    alpha defaults to 1 / sqrt(D); num_targets int [N]; position_bias [P] or [H, P]; time_bias [T] or [H, T] with
    timestamps int [total] (seconds). dropout_p is applied whenever > 0 (pass 0 in eval); its seed comes from
    torch's generator of q's device. Returns [total, H, D] in q's dtype.
    """
    max_seqlen, alpha, dropout_p = _check_inputs(
        q, k, v, cu_seqlens, max_seqlen, alpha, causal, num_targets, position_bias, time_bias, timestamps, dropout_p
    )
    q, k, v = _autocast(q, k, v)
    alpha = q.shape[-1] ** -0.5 if alpha is None else float(alpha)
    grads = needs_grad(q, k, v, position_bias, time_bias)
    key = (q.dtype, q.shape[-1], dropout_p > 0, grads)
    chosen = select_backend(
        SPEC,
        backend,
        q.device,
        key,
        silu_attention,
        q=q,
        k=k,
        v=v,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        alpha=alpha,
        causal=causal,
        num_targets=num_targets,
        position_bias=position_bias,
        time_bias=time_bias,
        timestamps=timestamps,
        dropout_p=dropout_p,
    )
    if chosen == "torch" or q.shape[0] == 0:
        with without_autocast(q.device.type):  # q, k, v are cast already; the rest in the kernels' dtypes
            return silu_attention_reference(
                q,
                k,
                v,
                cu_seqlens,
                max_seqlen,
                alpha,
                causal,
                num_targets,
                position_bias,
                time_bias,
                timestamps,
                float(dropout_p),
            )
    h = q.shape[1]
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    num_targets = num_targets.to(torch.int32).contiguous() if num_targets is not None else None
    timestamps = timestamps.to(torch.int64).contiguous() if time_bias is not None else None
    seed = draw_seed_tensor(q.device) if dropout_p > 0 else None
    return KERNEL(
        chosen,
        q,
        k,
        v,
        cu_seqlens,
        num_targets,
        _as_heads(position_bias, h),
        _as_heads(time_bias, h),
        timestamps,
        seed,
        max_seqlen,
        alpha,
        bool(causal),
        float(dropout_p),
    )
