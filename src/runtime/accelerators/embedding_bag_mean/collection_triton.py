"""embedding_bag_collection in Triton: every table's embedding-bag mean in one forward launch, and every table's
weight gradient from one sort and one (two-launch) segmented reduction.

forward(weights, values, offsets, meta, check_indices) -> (out [B, sum D], scale [T*B] fp32, bag_of [N] int32,
                                                           keys [N] global row of each entry, or -1)
backward(grad_out, weights, values, offsets, meta, check_indices, out, scale, bag_of, keys)
    -> (one dense gradient per table (views of one buffer), None, None, None, None); reads neither values, offsets
       nor out (the caller passes None for them)
declared at the end as KERNELS (a KernelBackend: the package's collection.py says why no KernelOp runs it)

`meta` (Tables) holds, per table, as device arrays: the table's base address (an int64 data_ptr: the kernel casts it
to a pointer, so no table is copied or concatenated), row stride, width, first output column, padding row, first row
in the global numbering (row_base) and first element in the flat gradient (elem_base).

The gradient follows triton.py's algorithm (segments.py explains it) on global row numbers: entry e of table t has
key row_base[t] + values[e] (-1 for padding and out-of-range entries, which every pass skips), so one sort groups the
entries of every row of every table; a sorted entry finds its table through its bag (bag_of: t * B + b). The chunk
kernel's tiles are as wide as the widest table, each row masked to its own table's width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv, pow2_at_least
from ..triton_launch import direct_launch
from .configs import BLOCK_J, CHUNK
from .reference import INDEX_ERROR
from .segments import INT32_MAX, num_chunks
from .triton import CHECK_ASSERT, CHECK_FLAG, CHECK_OFF, _segmented_add, sort_for_gradient

INDEX_MESSAGE = tl.constexpr(INDEX_ERROR.replace("embedding_bag_mean", "embedding_bag_collection"))
BLOCK_L = 8  # bag entries gathered per step of the forward (their rows are loaded together)


class Tables(NamedTuple):
    """The tables in kernel form (see the module docstring); the host ints are kept for launch sizes."""

    arrays: (
        torch.Tensor
    )  # int64 [8, T]: address, row stride, width, first column, padding row, row_base, elem_base, rows
    num_tables: int
    num_rows: int  # all tables' rows
    num_elements: int  # all tables' elements (the flat gradient)
    max_dim: int
    total_dim: int
    dims: tuple[int, ...]
    rows: tuple[int, ...]


def tables(weights, pads: tuple[int, ...]) -> Tables:
    """The tables' kernel form (pads: each table's padding row, -1 for none)."""
    dims = tuple(w.shape[1] for w in weights)
    rows = tuple(w.shape[0] for w in weights)
    columns, row_base, elem_base = [0], [0], [0]
    for n, d in zip(rows, dims):
        columns.append(columns[-1] + d)
        row_base.append(row_base[-1] + n)
        elem_base.append(elem_base[-1] + n * d)
    host = [
        [w.data_ptr() for w in weights],
        [w.stride(0) for w in weights],
        list(dims),
        columns[:-1],
        list(pads),
        row_base[:-1],
        elem_base[:-1],
        list(rows),
    ]
    arrays = torch.tensor(host, dtype=torch.int64).to(weights[0].device)
    return Tables(arrays, len(weights), row_base[-1], elem_base[-1], max(dims), columns[-1], dims, rows)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _table(arrays_ptr, t, num_tables, field: tl.constexpr):
    return tl.load(arrays_ptr + field * num_tables + t)


# debug=True compiles in the CUDA index check (tl.device_assert) and checks int32 arithmetic: the math is int64
@direct_launch
@triton.jit(debug=True, do_not_specialize=["batch", "num_tables", "num_indices"])
def _forward_kernel(
    arrays_ptr, values_ptr, offsets_ptr, out_ptr, scale_ptr, bag_of_ptr, keys_ptr, ok_ptr,
    batch, num_tables, num_indices, stride_out,
    CHECK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    pid_d = tl.program_id(2).to(tl.int64)
    bag = t * batch + b
    address = _table(arrays_ptr, t, num_tables, 0)
    stride_w = _table(arrays_ptr, t, num_tables, 1)
    dim = _table(arrays_ptr, t, num_tables, 2)
    column = _table(arrays_ptr, t, num_tables, 3)
    padding_idx = _table(arrays_ptr, t, num_tables, 4)
    row_base = _table(arrays_ptr, t, num_tables, 5)
    num_rows = _table(arrays_ptr, t, num_tables, 7)
    weight_ptr = address.to(tl.pointer_type(out_ptr.dtype.element_ty))
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim

    num_bags = batch * num_tables
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    bad = (
        (start < 0) | (end < start) | ((bag == 0) & (start != 0)) | ((bag + 1 == num_bags) & (end != num_indices))
    ).to(tl.int32)
    start = tl.minimum(tl.maximum(start, 0), num_indices)  # memory-safe even when unchecked
    end = tl.minimum(tl.maximum(end, start), num_indices)

    j = tl.arange(0, BLOCK_L)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_L], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_L):
        e = e0 + j
        in_bag = e < end
        idx = tl.load(values_ptr + e, mask=in_bag, other=0).to(tl.int64)
        in_range = (idx >= 0) & (idx < num_rows)
        bad |= tl.max((in_bag & ~in_range).to(tl.int32), 0)
        use = in_bag & in_range & (idx != padding_idx)
        count += use.to(tl.float32)
        rows = tl.load(
            weight_ptr + idx[:, None] * stride_w + cols[None, :], mask=use[:, None] & col_ok[None, :], other=0.0
        )
        acc += tl.sum(rows.to(tl.float32), 0)
        if pid_d == 0:  # what the gradient reads: each entry's bag, and its global row (-1: no gradient)
            tl.store(bag_of_ptr + e, tl.full([BLOCK_L], 0, tl.int32) + bag.to(tl.int32), mask=in_bag)
            tl.store(keys_ptr + e, tl.where(use, row_base + idx, -1).to(keys_ptr.dtype.element_ty), mask=in_bag)

    n = tl.sum(count, 0)
    scale = tl.where(n > 0, 1.0 / tl.maximum(n, 1.0), 0.0)
    tl.store(out_ptr + b * stride_out + column + cols, (acc * scale).to(out_ptr.dtype.element_ty), mask=col_ok)
    if pid_d == 0:
        tl.store(scale_ptr + bag, scale)
        # entries no bag covers (before the first offset, after the last) get no bag and no row
        k = tl.arange(0, BLOCK_T)
        if bag == 0:
            for k0 in range(0, start, BLOCK_T):
                tl.store(bag_of_ptr + k0 + k, tl.full([BLOCK_T], -1, tl.int32), mask=k0 + k < start)
                tl.store(keys_ptr + k0 + k, tl.full([BLOCK_T], -1, keys_ptr.dtype.element_ty), mask=k0 + k < start)
        if bag + 1 == num_bags:
            for k0 in range(end, num_indices, BLOCK_T):
                tl.store(bag_of_ptr + k0 + k, tl.full([BLOCK_T], -1, tl.int32), mask=k0 + k < num_indices)
                tl.store(
                    keys_ptr + k0 + k, tl.full([BLOCK_T], -1, keys_ptr.dtype.element_ty), mask=k0 + k < num_indices
                )
        if CHECK == 1:  # CHECK_FLAG
            tl.store(ok_ptr, 0, mask=bad > 0)
        if CHECK == 2:  # CHECK_ASSERT
            tl.device_assert(bad == 0, INDEX_MESSAGE)


@direct_launch
@triton.jit(do_not_specialize=["num_indices", "num_rows", "batch", "num_tables"])
def _chunk_kernel(
    keys_ptr, perm_ptr, bag_of_ptr, scale_ptr, grad_ptr, arrays_ptr,
    out_ptr, tail_ptr, head_ptr,
    num_indices, num_rows, batch, num_tables, max_dim, stride_g,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    pid_d = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    p = c * CHUNK + i
    valid = p < num_indices
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)

    key = tl.load(keys_ptr + p, mask=valid, other=-1)
    next_key = tl.load(keys_ptr + p + 1, mask=p + 1 < num_indices, other=-1)
    prev_key = tl.load(keys_ptr + p - 1, mask=valid & (i > 0), other=0)
    before_chunk = tl.load(keys_ptr + c * CHUNK - 1, mask=c > 0, other=0)
    starts = (key != prev_key) | (i == 0)
    began_here = (key != before_chunk) | (p < CHUNK)
    row_ok = (key >= 0) & (key < num_rows)  # the forward gave padding and out-of-range entries -1
    pos = tl.load(perm_ptr + p, mask=valid & row_ok, other=0).to(tl.int64)
    bag = tl.load(bag_of_ptr + pos, mask=valid & row_ok, other=0).to(tl.int64)
    use = valid & row_ok & (bag >= 0) & (bag < batch * num_tables)
    bag = tl.where(use, bag, 0)
    t = bag // batch
    b = bag - t * batch
    dim = _table(arrays_ptr, t, num_tables, 2)
    column = _table(arrays_ptr, t, num_tables, 3)
    row_base = _table(arrays_ptr, t, num_tables, 5)
    elem_base = _table(arrays_ptr, t, num_tables, 6)
    mine = cols[None, :] < dim[:, None]  # each row's own table width
    use_cols = use[:, None] & mine
    s = tl.load(scale_ptr + bag[:, None] + 0 * cols[None, :], mask=use_cols, other=0.0)
    g = tl.load(grad_ptr + b[:, None] * stride_g + column[:, None] + cols[None, :], mask=use_cols, other=0.0)
    g = g.to(tl.float32) * s

    starts = starts.to(tl.int32)
    sums, _ = tl.associative_scan((g, tl.broadcast_to(starts[:, None], (CHUNK, BLOCK_D))), 0, _segmented_add)

    seg_end = valid & (key != next_key)
    done = seg_end & began_here & row_ok
    dest = elem_base[:, None] + (key.to(tl.int64) - row_base)[:, None] * dim[:, None] + cols[None, :]
    tl.store(out_ptr + dest, sums.to(out_ptr.dtype.element_ty), mask=done[:, None] & mine)
    head = seg_end & ~began_here
    tail = valid & (i == CHUNK - 1) & ~seg_end
    part_offs = c * max_dim + cols[None, :] + 0 * i[:, None]
    in_part = cols[None, :] < max_dim
    tl.store(head_ptr + part_offs, sums, mask=head[:, None] & in_part)
    tl.store(tail_ptr + part_offs, sums, mask=tail[:, None] & in_part)


@triton.jit
def _first_chunk(keys_ptr, key, c, search, CHUNK: tl.constexpr, BLOCK_J: tl.constexpr):
    """The chunk where the segment of `key`, which goes on into chunk c, begins (triton.py's search)."""
    lo = c
    while search:
        j = lo - BLOCK_J + tl.arange(0, BLOCK_J)
        last = tl.load(keys_ptr + (j + 1) * CHUNK - 1, mask=j >= 0, other=0)
        found = tl.sum(((j >= 0) & (last == key)).to(tl.int32), 0)
        lo -= found
        search = found == BLOCK_J
    return lo


@direct_launch
@triton.jit(do_not_specialize=["num_indices", "num_rows", "batch", "num_tables"])
def _combine_kernel(
    keys_ptr, perm_ptr, bag_of_ptr, arrays_ptr, tail_ptr, head_ptr, out_ptr,
    num_indices, num_rows, batch, num_tables, max_dim,
    CHUNK: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    pid_d = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    p0 = c * CHUNK
    key = tl.load(keys_ptr + p0)
    row_ok = (key >= 0) & (key < num_rows)
    prev_key = tl.load(keys_ptr + p0 - 1, mask=c > 0, other=0)
    next_key = tl.load(keys_ptr + p0 + CHUNK, mask=p0 + CHUNK < num_indices, other=0)
    owner = (c > 0) & (prev_key == key) & ((p0 + CHUNK >= num_indices) | (next_key != key)) & row_ok
    pos = tl.load(perm_ptr + p0, mask=owner, other=0).to(tl.int64)
    bag = tl.load(bag_of_ptr + pos, mask=owner, other=0).to(tl.int64)
    bag = tl.where(owner & (bag >= 0), bag, 0)
    t = bag // batch
    dim = _table(arrays_ptr, t, num_tables, 2)
    row_base = _table(arrays_ptr, t, num_tables, 5)
    elem_base = _table(arrays_ptr, t, num_tables, 6)
    lo = _first_chunk(keys_ptr, key, c, owner, CHUNK, BLOCK_J)
    write = tl.where(owner, cols < dim, False)
    acc = tl.load(head_ptr + c * max_dim + cols, mask=write, other=0.0)
    for j0 in range(lo, c, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        part = tl.load(
            tail_ptr + j[:, None] * max_dim + cols[None, :], mask=(j < c)[:, None] & (cols < dim)[None, :], other=0.0
        )
        acc += tl.sum(part, 0)
    dest = elem_base + (key.to(tl.int64) - row_base) * dim + cols
    tl.store(out_ptr + dest, acc.to(out_ptr.dtype.element_ty), mask=write)


# --------------------------------------------------------------------------- launchers


def forward(weights, values, offsets, meta: Tables, check_indices: bool):
    device = values.device
    batch = (offsets.numel() - 1) // meta.num_tables
    num_indices = values.numel()
    dtype = weights[0].dtype
    out = buffers.empty((batch, meta.total_dim), dtype=dtype, device=device)
    scale = buffers.empty((meta.num_tables * batch,), dtype=torch.float32, device=device)
    bag_of = buffers.empty((num_indices,), dtype=torch.int32, device=device)
    key_dtype = torch.int32 if meta.num_rows < INT32_MAX else torch.int64
    keys = buffers.empty((num_indices,), dtype=key_dtype, device=device)
    if batch == 0:
        return out, scale, bag_of, keys
    check = CHECK_OFF
    if check_indices:
        check = CHECK_ASSERT if device.type == "cuda" else CHECK_FLAG
    ok = torch.ones(1, dtype=torch.int32, device=device) if check == CHECK_FLAG else scale  # never written otherwise
    block_d = min(pow2_at_least(meta.max_dim), 128)
    grid = (batch, meta.num_tables, cdiv(meta.max_dim, block_d))
    _forward_kernel[grid](
        meta.arrays, values, offsets, out, scale, bag_of, keys, ok,
        batch, meta.num_tables, num_indices, out.stride(0),
        CHECK=check, BLOCK_L=BLOCK_L, BLOCK_D=block_d, BLOCK_T=256, num_warps=2 if block_d <= 64 else 4,
    )  # fmt: skip
    if check == CHECK_FLAG and not ok.item():  # the CPU: no sync to avoid
        raise IndexError(
            "embedding_bag_collection: values: an entry is outside [0, num_rows) of its table, or offsets do not rise "
            "from 0 to len(values) (check_indices=True)"
        )
    return out, scale, bag_of, keys


def backward(grad_out, weights, values, offsets, meta: Tables, check_indices, out, scale, bag_of, keys):
    """One dense gradient per table: views of one flat buffer, filled by one sort and one reduction (the module
    docstring gives the arguments, KernelBackend's calling convention)."""
    device = grad_out.device
    dtype = weights[0].dtype
    batch = grad_out.shape[0]
    num_indices = keys.numel()
    flat = buffers.empty((meta.num_elements,), dtype=dtype, device=device)
    if num_indices == 0 or batch == 0:
        flat.zero_()
    else:
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        segments = sort_for_gradient(keys, meta.num_rows, zero=flat)
        chunks = num_chunks(num_indices, CHUNK)
        block_d = min(pow2_at_least(meta.max_dim), 128)
        tail = buffers.empty((chunks, meta.max_dim), dtype=torch.float32, device=device)
        head = buffers.empty((chunks, meta.max_dim), dtype=torch.float32, device=device)
        grid = (chunks, cdiv(meta.max_dim, block_d))
        _chunk_kernel[grid](
            segments.keys, segments.perm, bag_of, scale, grad_out, meta.arrays,
            flat, tail, head,
            num_indices, meta.num_rows, batch, meta.num_tables, meta.max_dim, grad_out.stride(0),
            CHUNK=CHUNK, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
        if chunks > 1:
            _combine_kernel[grid](
                segments.keys, segments.perm, bag_of, meta.arrays, tail, head, flat,
                num_indices, meta.num_rows, batch, meta.num_tables, meta.max_dim,
                CHUNK=CHUNK, BLOCK_J=BLOCK_J, BLOCK_D=block_d, num_warps=4,
            )  # fmt: skip
    grads, at = [], 0
    for n, d in zip(meta.rows, meta.dims):
        grads.append(flat[at : at + n * d].view(n, d))
        at += n * d
    return grads, None, None, None, None


KERNELS = KernelBackend(forward=forward, backward=backward, backward_reads="saved")
