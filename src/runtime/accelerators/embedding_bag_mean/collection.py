"""embedding_bag_collection(weights, values, offsets): every table's embedding-bag mean, side by side, in one launch.

The input follows TorchRec's KeyedJaggedTensor (key-major): T tables, B examples; `values` holds every table's
indices, table after table; bag b of table t is values[offsets[t*B + b]:offsets[t*B + b + 1]] (offsets has T*B + 1
entries, from 0 to len(values)). The result [B, sum D_t] holds table t's bag means in its D_t columns, in table order:
what embedding_bag_mean gives per table (an empty bag gives zeros, padding entries are left out of the mean).
A KeyedJaggedTensor (anything with .values(), .offsets() and .keys()) may stand in for `values` (offsets then None).
The config key is `embedding_bag_mean`, the single-table op's.

The Triton backend's entry points are declared as a KernelBackend (collection_triton.KERNELS), reached through the
loader _triton_kernels as every op's are (the TileLang backend has none: the spec's reasons send its calls
elsewhere). No KernelOp runs them; _Collection, an autograd.Function of its own, applies that declaration's forward
and backward, and under torch.compile a call runs outside the graph (a graph break), for these reasons:
- the tables are a list of any length: KernelOp's eager path saves and passes a fixed number of tensor arguments
  (its schema's), and autograd sees a table only as an argument of its own, so the Function takes them spread
  (*weights); a custom op could take them as `Tensor[]`, but KernelOp's schema, saving and gradient plumbing do not
  carry a tensor list;
- the kernels read the tables through their kernel form (Tables: each table's address in a device array, built once
  per layout and cached, so that a captured CUDA graph replays no host-to-device copy); a compiled graph could not
  hold it as a plain value, and building it in a custom op's body would copy to the device on every call;
- the backward returns each table's gradient as a view of one flat buffer; a custom op's outputs may not alias one
  another, so the backward op would copy every table's gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backends import Backend, select_backend
from ..checks import as_padding_idx, check_bool, check_readable, check_same_device, check_strided, check_tensor
from ..kernel_backend import KernelBackend
from .spec import SPEC

INDEX_DTYPES = (torch.int32, torch.int64)
_TABLES_CACHE_SIZE = 64


def is_keyed_jagged(value) -> bool:
    """TorchRec's KeyedJaggedTensor, or anything shaped like it (values(), offsets() and keys() methods)."""
    return all(callable(getattr(value, name, None)) for name in ("values", "offsets", "keys"))


def _check_weights(weights) -> list[torch.Tensor]:
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence) or len(weights) == 0:
        raise TypeError(f"weights: expected a non-empty list of 2-D tables [n_t, D_t], got {type(weights).__name__}")
    first = weights[0]
    for t, weight in enumerate(weights):
        check_tensor(f"weights[{t}]", weight)
        if weight.dim() != 2:
            raise ValueError(
                f"weights[{t}]: expected a 2-D [num_embeddings, embedding_dim] table, got shape {tuple(weight.shape)}"
            )
        if weight.dtype != first.dtype:
            raise TypeError(
                f"weights[{t}]: expected {first.dtype} like weights[0] (the output has one dtype), got {weight.dtype}"
            )
        check_same_device(f"weights[{t}]", weight, "weights[0]", first)
    return list(weights)


def _check_index_tensor(name: str, value, weight: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of int32 or int64, got {type(value).__name__}")
    check_strided(name, value)
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    check_same_device(name, value, "weights[0]", weight)


def _paddings(padding_idx, weights: list[torch.Tensor]) -> tuple[int | None, ...]:
    """padding_idx (None, one int for every table, or one int-or-None per table), normalised per table."""
    per_table = (  # a str is a Sequence too: one bad entry for every table, not one entry per character
        list(padding_idx)
        if isinstance(padding_idx, Sequence) and not isinstance(padding_idx, str)
        else [padding_idx] * len(weights)
    )
    if len(per_table) != len(weights):
        raise ValueError(f"padding_idx: expected one entry per table ({len(weights)}), got {len(per_table)}")
    return tuple(
        as_padding_idx(pad, weight.shape[0], f"table {t}") for t, (pad, weight) in enumerate(zip(per_table, weights))
    )


def _check_inputs(weights, values, offsets, padding_idx, check_indices):
    """Validate the arguments; returns (weights, values, offsets, per-table padding rows)."""
    weights = _check_weights(weights)
    if is_keyed_jagged(values):
        if offsets is not None:
            raise ValueError("offsets: must be None when values is a KeyedJaggedTensor (its offsets() are used)")
        keys = list(values.keys())
        if len(keys) != len(weights):
            raise ValueError(
                f"values: the KeyedJaggedTensor has {len(keys)} keys {keys}, expected one per table ({len(weights)})"
            )
        values, offsets = values.values(), values.offsets()
    _check_index_tensor("values", values, weights[0])
    if offsets is None:
        raise ValueError(
            "offsets: required (T*B + 1 entries: bag b of table t is values[offsets[t*B + b]:offsets[t*B + b + 1]])"
        )
    _check_index_tensor("offsets", offsets, weights[0])
    num_tables = len(weights)
    if offsets.numel() < 1 or (offsets.numel() - 1) % num_tables:
        raise ValueError(
            f"offsets: expected T*B + 1 entries for T={num_tables} tables (B bags each), got {offsets.numel()}"
        )
    check_bool("check_indices", check_indices)
    check_readable("offsets", offsets, "the bounds of the bags")
    return weights, values, offsets, _paddings(padding_idx, weights)


def embedding_bag_collection_reference(weights, values, offsets, paddings, check_indices: bool = True) -> torch.Tensor:
    """A loop over the tables with F.embedding_bag (differentiable by autograd; reads the offsets on the host)."""
    num_tables = len(weights)
    batch = (offsets.numel() - 1) // num_tables
    bounds = offsets.tolist()
    if check_indices:
        _check_offsets(bounds, values.numel())
    outs = []
    for t, (weight, pad) in enumerate(zip(weights, paddings)):
        lo, hi = bounds[t * batch], bounds[(t + 1) * batch]
        ids = values[lo:hi]
        if check_indices and ids.numel() and bool(((ids < 0) | (ids >= weight.shape[0])).any()):
            bad = int(ids[(ids < 0) | (ids >= weight.shape[0])][0])
            raise IndexError(
                f"embedding_bag_collection: values: {bad} (table {t}) is outside [0, num_embeddings={weight.shape[0]}) "
                "(check_indices=True)"
            )
        if weight.shape[1] == 0 or batch == 0:
            outs.append(weight.new_zeros(batch, weight.shape[1]) + weight.sum() * 0)
            continue
        bag_starts = (offsets[t * batch : (t + 1) * batch] - lo).to(ids.dtype)
        outs.append(F.embedding_bag(ids, weight, bag_starts, mode="mean", padding_idx=pad))
    return torch.cat(outs, dim=1)


def _check_offsets(bounds: list[int], num_values: int) -> None:
    rising = all(a <= b for a, b in zip(bounds, bounds[1:]))
    if bounds[0] != 0 or bounds[-1] != num_values or not rising:
        shown = bounds if len(bounds) <= 16 else "a longer sequence that does not"
        raise IndexError(
            f"embedding_bag_collection: offsets: expected to rise from 0 to len(values)={num_values}, got {shown} "
            "(check_indices=True)"
        )


def _check_no_bags(values: torch.Tensor, offsets: torch.Tensor) -> None:
    """offsets [x] (B = 0): the kernels launch nothing and check nothing; x must be 0 and values empty (as the torch
    backend checks), read on the host on the CPU only (a device-side assert elsewhere and under torch.compile)."""
    if values.numel() != 0:
        raise IndexError(
            f"embedding_bag_collection: offsets: expected to rise from 0 to len(values)={values.numel()}, got "
            "a single offset (no bag) (check_indices=True)"
        )
    if offsets.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(offsets[0] == 0, "embedding_bag_collection: offsets: expected [0] with no bag")
    elif int(offsets[0]) != 0:
        _check_offsets(offsets.tolist(), 0)


def _triton_kernels() -> KernelBackend:
    from .collection_triton import KERNELS

    return KERNELS


BACKENDS = {"triton": _triton_kernels}  # backend -> the loader of its KernelBackend


@functools.cache
def _kernels(backend: str) -> KernelBackend:
    """The backend's KernelBackend (its loader called on first use: the package imports without triton)."""
    return BACKENDS[backend]()


_tables_cache: dict = {}


def _tables(weights, pads: tuple[int, ...]):
    """The tables' kernel form, cached by layout (each table's address, shape and strides, which fix everything it
    holds): its device array is built once for a model's parameters, not copied to the device on every step (a
    captured CUDA graph could not replay that copy)."""
    key = (tuple((w.data_ptr(), tuple(w.shape), tuple(w.stride())) for w in weights), pads, weights[0].device)
    meta = _tables_cache.get(key)
    if meta is None:
        from .collection_triton import tables

        if len(_tables_cache) >= _TABLES_CACHE_SIZE:
            _tables_cache.pop(next(iter(_tables_cache)))
        meta = _tables_cache[key] = tables(weights, pads)
    return meta


class _Collection(torch.autograd.Function):
    """The Triton KernelBackend's forward and backward (see the module docstring for why no KernelOp runs them)."""

    @staticmethod
    def forward(ctx, pads, check_indices, values, offsets, *weights):
        kernels = _kernels("triton")
        meta = _tables(weights, pads)
        out, scale, bag_of, keys = kernels.forward(weights, values, offsets, meta, check_indices)
        ctx.save_for_backward(scale, bag_of, keys, *weights)
        ctx.meta, ctx.check_indices = meta, check_indices
        ctx.mark_non_differentiable(scale, bag_of, keys)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        scale, bag_of, keys, *weights = ctx.saved_tensors
        # values, offsets and out are not read (backward_reads="saved"; values and offsets are not saved)
        grads, *_ = _kernels("triton").backward(
            grad_out, weights, None, None, ctx.meta, ctx.check_indices, None, scale, bag_of, keys
        )
        return (None, None, None, None, *grads)


def _kernel_call(weights, values, offsets, pads, check_indices):
    if values.numel() and not values.is_contiguous():
        values = values.contiguous()
    return _Collection.apply(pads, check_indices, values, offsets.contiguous(), *weights)


@functools.cache
def _kernel_call_outside_graphs():
    """_kernel_call run eagerly under torch.compile (the kernel form holds the tables' addresses: a graph break)."""
    return torch.compiler.disable(_kernel_call)


def embedding_bag_collection(
    weights: Sequence[torch.Tensor],
    values,
    offsets: torch.Tensor | None = None,
    *,
    padding_idx: int | Sequence[int | None] | None = None,
    check_indices: bool = True,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Each table's embedding-bag mean over its bags, concatenated: [B, sum D_t] (see the module docstring).

    padding_idx: a row left out of every mean (an int for every table, or one int-or-None per table).
    check_indices: raise on an entry outside its table or offsets that do not rise from 0 to len(values) (a
    device-side assert on CUDA, no host sync); with it off such entries give unspecified values, never
    out-of-bounds accesses.
    """
    weights, values, offsets, paddings = _check_inputs(weights, values, offsets, padding_idx, check_indices)
    first = weights[0]
    unit_columns = all(w.stride(1) == 1 for w in weights)
    summary = (len(weights), unit_columns, max(w.shape[1] for w in weights))
    key = ("collection", first.dtype, *summary)
    chosen = select_backend(SPEC, backend, first.device, key, weight=first, collection=summary)
    if chosen == "torch" or summary[2] == 0:
        return embedding_bag_collection_reference(weights, values, offsets, paddings, check_indices)
    if check_indices and offsets.numel() == 1:
        _check_no_bags(values, offsets)
    pads = tuple(-1 if p is None else p for p in paddings)
    call = _kernel_call_outside_graphs() if torch.compiler.is_compiling() else _kernel_call
    return call(weights, values, offsets, pads, check_indices)
