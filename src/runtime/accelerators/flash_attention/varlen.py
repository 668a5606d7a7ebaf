"""Packed (varlen) sequences for flash_attention: argument checks, the longest sequences' lengths, the kernel op.

q [total_q, H, D] and k/v [total_k, Hkv, D] hold N sequences back to back: sequence s is rows
cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k and v, and attends as the op
alone would (causal top-left within the sequence; a query with no visible key gives zeros).

The kernels' grid comes from N and max_seqlen_q/_k, their loops from the cu_seqlens tensors they load, so one
compiled kernel serves every packing. Reading the lengths on the host costs a device synchronisation: it is done at
most once per cu_seqlens pair (checks and max_seqlen together), and not at all where the caller passes both
max_seqlen_* for CUDA tensors; while compiling or capturing a CUDA graph the values are never read, and a missing
max_seqlen is bounded by the packed length.
"""

from __future__ import annotations

import weakref

import torch

from ..autocast import autocast_enabled
from ..checks import as_int, check_readable, check_same_device, check_strided, check_tensor
from ..kernel_backend import KernelBackend
from ..kernel_op import KernelOp


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fake_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p, seed):
    total_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(h, total_q, dtype=torch.float32)


def _triton_varlen_kernels() -> KernelBackend:
    from .triton import VARLEN_KERNELS

    return VARLEN_KERNELS


def _tilelang_varlen_kernels() -> KernelBackend:
    from .tilelang import VARLEN_KERNELS

    return VARLEN_KERNELS


# kernel modules: varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
#                                dropout_p, seed) -> (o [total_q, H, D] in q's dtype, lse [H, total_q] fp32)
#                 varlen_backward(do, *those arguments, o, lse) -> (dq, dk, dv, None x 8)
# cu_seqlens: int32 [N + 1], contiguous, on q's device; max_seqlen_*: at least every sequence's length. Dropout keeps
# element (s, h, i, j) (sequence s, positions i and j within it) as the padded batch [N, H, max_q, max_k] does.
# max_seqlen is a SymInt: it changes from batch to batch, and an int would specialise a compiled graph on it
KERNEL = KernelOp(
    "flash_attention_varlen",
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, bool causal, float scale, float dropout_p, Tensor? seed",
    n_outputs=1,
    n_saved=1,
    fake_forward=_fake_forward,
    backends={
        "triton": _triton_varlen_kernels,
        "tilelang": _tilelang_varlen_kernels,
    },
)


def check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_lengths, attn_mask) -> tuple:
    """Shapes, dtypes and devices of a packed call (no value is read); returns (max_seqlen_q, max_seqlen_k) as ints
    (or None where not given)."""
    for name, given, other in (
        ("cu_seqlens_q", cu_seqlens_q, "cu_seqlens_k"),
        ("cu_seqlens_k", cu_seqlens_k, "cu_seqlens_q"),
    ):
        if given is None:
            raise ValueError(f"{name}: expected a tensor together with {other} (packed sequences need both), got None")
    if key_lengths is not None:
        raise ValueError(
            "key_lengths: not taken with cu_seqlens_q/cu_seqlens_k (each packed sequence has its own keys already)"
        )
    if attn_mask is not None:
        raise ValueError("attn_mask: not taken with cu_seqlens_q/cu_seqlens_k (packed sequences take causal only)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 3:
            layout = "[total_q, H, D]" if name == "q" else "[total_k, Hkv, D]"
            raise ValueError(
                f"{name}: expected a 3-D tensor {layout} with cu_seqlens (packed sequences), got shape {tuple(x.shape)}"
            )
    for name, x in (("k", k), ("v", v)):
        check_same_device(name, x, "q", q)
        if x.dtype != q.dtype and not autocast_enabled(q.device.type):
            raise TypeError(f"{name}: expected dtype {_dtype_name(q.dtype)} like q, got {_dtype_name(x.dtype)}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)} ([total_k, Hkv, D]), got {tuple(v.shape)}")
    h, d = q.shape[1], q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"k: expected head dim {d} like q, got {k.shape[2]} (shape {tuple(k.shape)})")
    if d == 0:
        raise ValueError(f"q: the head dim is empty; shape {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"k: the number of kv heads ({hkv}) must divide the number of query heads ({h}) of q")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name}: expected an int32 torch.Tensor [N + 1], got {type(cu).__name__}")
        check_strided(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name}: expected dtype int32, got {_dtype_name(cu.dtype)}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"{name}: expected a 1-D tensor [N + 1] (offsets from 0), got shape {tuple(cu.shape)}")
        check_same_device(name, cu, "q", q)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k: expected {cu_seqlens_q.numel()} offsets like cu_seqlens_q (one sequence of keys per sequence of "
            f"queries), got {cu_seqlens_k.numel()}"
        )
    return tuple(
        None
        if value is None
        else as_int(name, value, least=0, expected="None or an int >= 0 (the longest sequence's length)")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
    )


_checked: tuple = ()  # (weakrefs and versions of the last cu_seqlens pair read, their totals, the longest lengths)


def _longest(cu: torch.Tensor) -> torch.Tensor:
    lengths = cu[1:] - cu[:-1]
    return lengths.max() if lengths.numel() else cu.new_zeros(())


def _read_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> tuple[int, int]:
    """Check both offset tensors and return their longest sequences' lengths: one synchronisation, none for the pair
    checked last when passed again unchanged (every attention layer of a model takes the same offsets). Inference
    tensors (made under torch.inference_mode) have no version counter to tell whether they changed in place: they are
    read on every call."""
    global _checked
    check_readable("cu_seqlens_q", cu_q, "the bounds of the sequences")
    check_readable("cu_seqlens_k", cu_k, "the bounds of the sequences")
    remember = not (cu_q.is_inference() or cu_k.is_inference())
    key = (total_q, total_k, cu_q._version, cu_k._version) if remember else None
    if remember and _checked and _checked[0]() is cu_q and _checked[1]() is cu_k and _checked[2] == key:
        return _checked[3]
    stats = []
    for cu in (cu_q, cu_k):
        lengths = cu[1:] - cu[:-1]
        lowest = lengths.min() if lengths.numel() else cu.new_zeros(())
        stats += [cu[0], cu[-1], lowest, _longest(cu)]
    first_q, last_q, low_q, long_q, first_k, last_k, low_k, long_k = torch.stack(stats).tolist()
    for name, first, last, low, total, rows in (
        ("cu_seqlens_q", first_q, last_q, low_q, total_q, "q.shape[0]"),
        ("cu_seqlens_k", first_k, last_k, low_k, total_k, "k.shape[0]"),
    ):
        if first != 0:
            raise ValueError(f"{name}: expected offsets starting at 0, got {first}")
        if low < 0:
            raise ValueError(f"{name}: expected non-decreasing offsets (sequence lengths >= 0), found a step of {low}")
        if last != total:
            raise ValueError(
                f"{name}: expected the last offset to equal the packed length {rows} = {total}, got {last}"
            )
    if remember:
        _checked = (weakref.ref(cu_q), weakref.ref(cu_k), key, (long_q, long_k))
    return long_q, long_k


def _values_readable(cu: torch.Tensor) -> bool:
    """Whether reading the offsets on the host is possible here (not while compiling or capturing a CUDA graph)."""
    if torch.compiler.is_compiling():
        return False
    return not (cu.is_cuda and torch.cuda.is_current_stream_capturing())


def max_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """(max_seqlen_q, max_seqlen_k) for the kernels' grid, checking the offsets' values where that is cheap: on the
    CPU, or where a missing max_seqlen makes the host read them anyway (one synchronisation for both)."""
    total_q, total_k = q.shape[0], k.shape[0]
    if not _values_readable(cu_seqlens_q):
        return (
            total_q if max_seqlen_q is None else max_seqlen_q,
            total_k if max_seqlen_k is None else max_seqlen_k,
        )
    given = max_seqlen_q is not None and max_seqlen_k is not None
    if given and cu_seqlens_q.is_cuda:
        return max_seqlen_q, max_seqlen_k  # the caller gave both to avoid a synchronisation
    long_q, long_k = _read_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    for name, value, longest in (("max_seqlen_q", max_seqlen_q, long_q), ("max_seqlen_k", max_seqlen_k, long_k)):
        if value is not None and value < longest:
            raise ValueError(f"{name}: {value} is smaller than the longest sequence ({longest})")
    return (
        long_q if max_seqlen_q is None else max_seqlen_q,
        long_k if max_seqlen_k is None else max_seqlen_k,
    )
