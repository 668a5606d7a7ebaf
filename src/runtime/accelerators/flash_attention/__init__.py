"""flash_attention(q, k, v, *, causal, key_lengths, attn_mask, dropout_p, scale): SDPA semantics.

q [B, H, Lq, D], k/v [B, Hkv, Lk, D] with H a multiple of Hkv (GQA/MQA); strided views such as
x.view(B, L, H, D).transpose(1, 2) are passed to the kernels as they are (strides, no copy).
A query row that sees no key gives zeros where SDPA gives NaN.
Packed (varlen) sequences: q [total_q, H, D], k/v [total_k, Hkv, D] with cu_seqlens_q/_k (see varlen.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..autocast import autocast_enabled, autocast_inputs
from ..backends import Backend, OpSpec, select_backend
from ..checks import (
    as_probability,
    check_bool,
    check_readable,
    check_same_device,
    check_scale,
    check_strided,
    check_tensor,
)
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp
from ..seeds import draw_seed_tensor
from . import varlen
from .reference import flash_attention_reference, flash_attention_varlen_reference

# What each kernel backend supports; the reasons below are derived from this table.
# (The tilelang entry belongs to the TileLang backend's author.)


@dataclass(frozen=True)
class KernelSupport:
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    dropout: bool = True
    dtype_note: str = ""
    deterministic_backward: bool = True  # the same gradients, bit for bit, run after run


SUPPORT: dict[str, KernelSupport] = {
    # fp32 runs with exact fp32 products (tf32 would miss the fp32 accuracy bound); slower than bf16
    "triton": KernelSupport(dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dims=(16, 32, 48, 64, 128)),
    "tilelang": KernelSupport(
        dtypes=(torch.bfloat16, torch.float16),
        head_dims=(16, 32, 48, 64, 128),
        dtype_note="the tilelang kernels compute with bf16/fp16 tensor cores; cast q/k/v to bfloat16 or float16 "
        "(or run under autocast), or use backend='triton'",
        # each key block's program adds its share of dq to an fp32 accumulator by bulk reductions, in no fixed order
        deterministic_backward=False,
    ),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def needs_deterministic_backward(q=None, k=None, v=None) -> bool:
    """torch.use_deterministic_algorithms is on and this call will be differentiated (the backward runs on the
    forward's backend, so the forward decides)."""
    return (
        torch.are_deterministic_algorithms_enabled()
        and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (q, k, v))
    )


def input_reasons(backend: str, q=None, k=None, v=None, attn_mask=None, dropout_p: float = 0.0) -> list[str]:
    """Why a kernel backend cannot run these inputs (empty: it can). Every input is optional (explain())."""
    support = SUPPORT[backend]
    reasons = []
    if not support.deterministic_backward and needs_deterministic_backward(q, k, v):
        reasons.append(
            f"deterministic algorithms are on (torch.use_deterministic_algorithms) and gradients are needed: the "
            f"{backend} backward adds dq across key blocks in no fixed order (the triton backward is deterministic)"
        )
    if attn_mask is not None:
        reasons.append(
            "a general attn_mask is given; the kernels take only causal and key_lengths masks (use key_lengths for key padding)"
        )
    if q is not None:
        if q.dtype not in support.dtypes:
            allowed = ", ".join(_dtype_name(d) for d in support.dtypes)
            note = f" ({support.dtype_note})" if support.dtype_note else ""
            reasons.append(f"q has dtype {_dtype_name(q.dtype)}; the {backend} kernels take {allowed}{note}")
        if q.shape[-1] not in support.head_dims:
            dims = ", ".join(map(str, support.head_dims))
            reasons.append(f"head dim {q.shape[-1]} is not one of the {backend} kernels' head dims ({dims})")
        if backend == "triton" and q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # seen with Triton 3.9: the interpreter's tl.dot multiplies bfloat16 operands' raw bits
            reasons.append(
                "bfloat16 on the CPU: the Triton interpreter computes bfloat16 dot products wrongly; use float16 or float32 there"
            )
    if dropout_p > 0 and not support.dropout:
        reasons.append(f"dropout_p={dropout_p} > 0; the {backend} kernels have no dropout")
    if backend == "tilelang" and q is not None and q.is_cuda and torch.cuda.get_device_capability(q.device) < (9, 0):
        # the kernels are built on TMA loads, wgmma and warp specialisation
        major, minor = torch.cuda.get_device_capability(q.device)
        reasons.append(
            f"GPU compute capability {major}.{minor}: the tilelang flash-attention kernels need Hopper (9.0) or newer"
        )
    return reasons


def input_priority(q=None, dropout_p=0.0) -> tuple[str, ...] | None:
    """tilelang > triton at head dim 128, and with dropout at head dims 48 and 64"""
    # forward + backward (docs/benchmark/flash_attention.md): TileLang ran 1.2-1.3x faster at head
    # dim 128, lengths 512-8192, causal or not; Triton as fast or faster at head dims up to 64. With dropout 0.1
    # (two maps) TileLang ran 1.01-1.18x faster at head dims 48 and 64 and Triton 1.02-1.39x faster at 16
    # and 32.
    if q is None:
        return None
    d = q.shape[-1]
    return ("tilelang", "triton") if d == 128 or (dropout_p > 0 and d >= 48) else None


SPEC = OpSpec(
    name="flash_attention",
    priority=("triton", "tilelang"),
    reasons=input_reasons,
    input_priority=input_priority,
    widths=("q",),
)


def _fake_forward(q, k, v, key_lengths, causal, scale, dropout_p, seed):
    b, h, lq, d = q.shape
    return q.new_empty(b, h, lq, d), q.new_empty(b, h, lq, dtype=torch.float32)


def _triton_kernels() -> KernelBackend:
    from .triton import KERNELS

    return KERNELS


def _tilelang_kernels() -> KernelBackend:
    from .tilelang import KERNELS

    return KERNELS


# kernel modules: forward(q, k, v, key_lengths, causal, scale, dropout_p, seed) -> (o [B,H,Lq,D] in q's dtype, lse [B,H,Lq] fp32)
#                 backward(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse)
#                     -> (dq, dk, dv, None, None, None, None, None)
# key_lengths: None or int32 [B] contiguous on q's device, values in [0, Lk]; dk/dv of a kv head sum
# over its query heads; dropout keeps (b, h, i, j) by a counter-based hash of `seed` (None without dropout, else
# a one-element int64 tensor on q's device that the kernels load; backward regenerates the mask).
KERNEL = KernelOp(
    "flash_attention",
    "Tensor q, Tensor k, Tensor v, Tensor? key_lengths, bool causal, float scale, float dropout_p, Tensor? seed",
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_kernels,
        "tilelang": _tilelang_kernels,
    },
)


def _check_dropout_and_scale(dropout_p, scale) -> float:
    """Returns dropout_p as a float."""
    check_scale(scale)
    return as_probability("dropout_p", dropout_p)


def _check_inputs(q, k, v, key_lengths, attn_mask, dropout_p, scale) -> float:
    """Validate the arguments; returns dropout_p as a float."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 4:
            layout = "[B, H, Lq, D]" if name == "q" else "[B, Hkv, Lk, D]"
            raise ValueError(f"{name}: expected a 4-D tensor {layout}, got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        check_same_device(name, x, "q", q)
        if x.dtype != q.dtype and not autocast_enabled(q.device.type):  # autocast casts all three (as SDPA)
            raise TypeError(f"{name}: expected dtype {_dtype_name(q.dtype)} like q, got {_dtype_name(x.dtype)}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)} ([B, Hkv, Lk, D]), got {tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"k: expected batch size {b} like q, got {k.shape[0]} (shape {tuple(k.shape)})")
    if k.shape[3] != d:
        raise ValueError(f"k: expected head dim {d} like q, got {k.shape[3]} (shape {tuple(k.shape)})")
    if d == 0:
        raise ValueError(f"q: the head dim is empty; shape {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"k: the number of kv heads ({hkv}) must divide the number of query heads ({h}) of q")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor):
            raise TypeError(
                f"key_lengths: expected an integer torch.Tensor of shape ({b},), got {type(key_lengths).__name__}"
            )
        check_strided("key_lengths", key_lengths)
        if key_lengths.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"key_lengths: expected dtype int32 or int64, got {_dtype_name(key_lengths.dtype)}")
        if tuple(key_lengths.shape) != (b,):
            raise ValueError(
                f"key_lengths: expected shape ({b},) (one length per batch row), got {tuple(key_lengths.shape)}"
            )
        check_same_device("key_lengths", key_lengths, "q", q)
        _check_lengths_range(key_lengths, k.shape[2])
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
            got = attn_mask.dtype if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
            raise TypeError(f"attn_mask: expected a bool tensor (True = visible), got {got}")
        check_strided("attn_mask", attn_mask)
        check_same_device("attn_mask", attn_mask, "q", q)
        target = (b, h, q.shape[2], k.shape[2])
        try:
            torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            raise ValueError(
                f"attn_mask: expected a shape broadcastable to {target} ([B, H, Lq, Lk]), got {tuple(attn_mask.shape)}"
            ) from None
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask: expected at most 4 dimensions, got shape {tuple(attn_mask.shape)}")
    return _check_dropout_and_scale(dropout_p, scale)


_last_lengths: tuple = (None, -1, {})  # (weakref to the last key_lengths seen, its version, what was done for it)


def _in_graph(key_lengths: torch.Tensor) -> bool:
    """Compiling or capturing a CUDA graph: work on the lengths must be recorded, never reused or read on the host."""
    return torch.compiler.is_compiling() or (key_lengths.is_cuda and torch.cuda.is_current_stream_capturing())


def _remembered(key_lengths: torch.Tensor) -> dict | None:
    """What was done for this key_lengths tensor while it is the last one seen and unchanged in place (every attention
    layer of a model gets the same lengths: one range check and one cast a step, not one a layer); a fresh record for
    a new tensor. None for an inference tensor (made under torch.inference_mode: no version counter to tell whether
    it changed in place). Not for use inside a graph (_in_graph)."""
    global _last_lengths
    if key_lengths.is_inference():
        return None
    ref, version, record = _last_lengths
    if ref is None or ref() is not key_lengths or version != key_lengths._version:
        record = {}
        _last_lengths = (weakref.ref(key_lengths), key_lengths._version, record)
    return record


def _check_lengths_range(key_lengths: torch.Tensor, lk: int) -> None:
    """Values in [0, Lk]. Reading them synchronises with the device, so the check is skipped while capturing a CUDA
    graph or compiling, and done once for a tensor passed again unchanged (_remembered)."""
    if key_lengths.numel() == 0 or _in_graph(key_lengths):
        return
    check_readable("key_lengths", key_lengths, "to check that they lie in [0, Lk]")
    record = _remembered(key_lengths)
    if record is not None and record.get("checked_lk") == lk:
        return
    low, high = torch.stack(torch.aminmax(key_lengths)).tolist()  # one synchronisation
    if low < 0 or high > lk:
        raise ValueError(f"key_lengths: expected values in [0, {lk}] (Lk of k), got values in [{low}, {high}]")
    if record is not None:
        record["checked_lk"] = lk


def _kernel_lengths(key_lengths: torch.Tensor) -> torch.Tensor:
    """key_lengths as the kernels read them, contiguous int32: cast once for a tensor passed again unchanged
    (_remembered), on every call inside a graph, where the cast must be recorded, and under torch.inference_mode
    until a cast made outside it is kept."""
    if key_lengths.dtype == torch.int32 and key_lengths.is_contiguous():
        return key_lengths
    record = None if _in_graph(key_lengths) else _remembered(key_lengths)
    if record is None:
        return key_lengths.to(torch.int32).contiguous()
    if "int32" not in record:
        cast = key_lengths.to(torch.int32).contiguous()
        if torch.is_inference_mode_enabled():  # an inference tensor, which a later training call could not save
            return cast
        record["int32"] = cast
    return record["int32"]


def _autocast(q, k, v):
    """Under autocast, attention runs in the autocast dtype (as SDPA does)."""
    return autocast_inputs(q.device.type, q, k, v)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per head, as torch.nn.functional.scaled_dot_product_attention.

    q [B, H, Lq, D]; k, v [B, Hkv, Lk, D] with H a multiple of Hkv. causal: query i sees keys j <= i
    (top-left aligned, as SDPA). key_lengths [B] int: keys j >= key_lengths[b] are hidden. attn_mask:
    a bool mask broadcastable to [B, H, Lq, Lk], True = visible (torch backend only). dropout_p is
    applied whenever > 0 (pass 0 in eval, as with SDPA); its seed comes from torch's generator of q's
    device, so torch.manual_seed repeats a run and a captured CUDA graph draws a new mask on every replay.
    scale defaults to 1 / sqrt(D). Rows that see no key give zeros. Under torch.use_deterministic_algorithms, a call
    that will be differentiated does not take the tilelang backend (its dq reductions have no fixed order): "auto"
    takes triton, an explicit "tilelang" follows the fallback rule.

    Packed sequences: with cu_seqlens_q and cu_seqlens_k (both, int32 [N + 1], from 0, non-decreasing, ending at
    the packed lengths), q is [total_q, H, D] and k, v are [total_k, Hkv, D]; sequence s is rows
    cu_seqlens_*[s]:cu_seqlens_*[s + 1] and attends as the op on it alone would (causal top-left per sequence).
    The result is [total_q, H, D]. max_seqlen_q/_k (the longest lengths) spare the host a read of the offsets;
    key_lengths and attn_mask are not taken.
    """
    check_bool("causal", causal)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _flash_attention_packed(
            q,
            k,
            v,
            causal,
            key_lengths,
            attn_mask,
            dropout_p,
            scale,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            backend,
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            raise ValueError(f"{name}: only taken with cu_seqlens_q and cu_seqlens_k (packed sequences), got {value}")
    dropout_p = _check_inputs(q, k, v, key_lengths, attn_mask, dropout_p, scale)
    q, k, v = _autocast(q, k, v)
    key = (q.dtype, q.shape[-1], attn_mask is not None, dropout_p > 0, needs_deterministic_backward(q, k, v))
    chosen = select_backend(
        SPEC,
        backend,
        q.device,
        key,
        flash_attention,
        q=q,
        k=k,
        v=v,
        causal=causal,
        key_lengths=key_lengths,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        scale=scale,
    )
    if chosen == "torch" or q.numel() == 0 or k.shape[2] == 0:
        return flash_attention_reference(q, k, v, causal, key_lengths, attn_mask, float(dropout_p), scale)
    if key_lengths is not None:
        key_lengths = _kernel_lengths(key_lengths)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    seed = draw_seed_tensor(q.device) if dropout_p > 0 else None
    return KERNEL(chosen, q, k, v, key_lengths, bool(causal), scale, float(dropout_p), seed)


def _flash_attention_packed(
    q,
    k,
    v,
    causal,
    key_lengths,
    attn_mask,
    dropout_p,
    scale,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    backend,
) -> torch.Tensor:
    """flash_attention on packed sequences (cu_seqlens; see varlen.py)."""
    max_seqlen_q, max_seqlen_k = varlen.check_layout(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_lengths, attn_mask
    )
    dropout_p = _check_dropout_and_scale(dropout_p, scale)
    max_seqlen_q, max_seqlen_k = varlen.max_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = _autocast(q, k, v)
    deterministic = needs_deterministic_backward(q, k, v)
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    key = (q.dtype, q.shape[-1], "packed", grads, dropout_p > 0, deterministic)
    chosen = select_backend(
        SPEC,
        backend,
        q.device,
        key,
        flash_attention,
        q=q,
        k=k,
        v=v,
        causal=causal,
        dropout_p=dropout_p,
        scale=scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    if chosen == "torch":
        return flash_attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, float(dropout_p), scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    seed = draw_seed_tensor(q.device) if dropout_p > 0 else None
    return varlen.KERNEL(
        chosen,
        q,
        k,
        v,
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        max_seqlen_q,
        max_seqlen_k,
        bool(causal),
        scale,
        float(dropout_p),
        seed,
    )
