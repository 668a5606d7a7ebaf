"""Embedding-bag mean in TileLang: the same algorithm and module interface as triton.py.

forward(weight, indices, offsets, padding_idx, include_last_offset, check_indices)
    -> (out [B, D], scale [B] fp32, bag_of [N] int32 for ragged bags, else empty)
backward / backward_sparse: the weight gradient, dense or sparse COO (see segments.py).

Batch, entry count, vocabulary and bag length are dynamic (T.dynamic / scalar arguments); the
compiled kernels are cached by (dtypes, embedding width, target; the forward also by its FORWARD tiling). Bad indices or offsets trip a
device-side assert inside the forward kernel (no host sync, no extra launch).
"""

# no `from __future__ import annotations`: TileLang evaluates the kernels' annotations, which name closure variables
from dataclasses import dataclass

import torch

from .. import buffers
from ..launch_math import pow2_at_least
from ..tilelang_common import Entry, launcher  # first: checks the tilelang version
from ..tilelang_common import precompile as precompile_entries

import tilelang.language as T  # noqa: E402  isort: skip
from ..kernel_backend import KernelBackend
from .reference import INDEX_ERROR
from .segments import bag_layout, empty_input_gradient, num_chunks, sort_segments, sparse_gradient, sparse_ranks

CHUNK = 32  # sorted entries per block of the gradient's first pass
BLOCK_J = 32  # chunk partials summed at once in the second pass
THREADS = 128  # gradient kernels


@dataclass(frozen=True)
class ForwardLaunch:
    """The forward kernel's tiling (FORWARD: the tiling the op takes by default)."""

    block_b: int = 16  # bags per block
    block_l: int = 8  # bag entries gathered per unrolled step (their indices are loaded together first)
    threads: int = 128


FORWARD = ForwardLaunch()

_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def padded_width(dim: int) -> int:
    """The tile width for a row of `dim`: dim itself when it tiles evenly over the threads, else the next power of two."""
    if dim % 32 == 0:
        return dim
    return 1 << max(3, (dim - 1).bit_length())


def combine_width(dim: int) -> int:
    """The tile width of the gradient's second pass: a power of two. It sums a [BLOCK_J, width] fragment
    over its rows into a 1-D one, for which TileLang finds no layout at other widths (96, 160, 384...)."""
    return pow2_at_least(padded_width(dim))


# --------------------------------------------------------------------------- kernel builders


def forward_program(dim: int, dtype: str, index_dtype: str, offset_dtype: str, launch: ForwardLaunch = ForwardLaunch()):
    width = padded_width(dim)
    block_b, block_l, threads = launch.block_b, launch.block_l, launch.threads
    num_embeddings, num_indices, num_offsets, num_bags, num_bag_of = T.dynamic("V N NO B NB")

    @T.prim_func
    def embedding_bag_forward(
        weight: T.Tensor((num_embeddings, dim), dtype),
        indices: T.Tensor((num_indices,), index_dtype),
        offsets: T.Tensor((num_offsets,), offset_dtype),
        out: T.Tensor((num_bags, dim), dtype),
        scale: T.Tensor((num_bags,), "float32"),
        bag_of: T.Tensor((num_bag_of,), "int32"),
        bag_len: T.int32,  # > 0: fixed bags of this length (offsets unused); 0: ragged bags
        padding_idx: T.int64,  # -1: none
        check: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_bags, block_b), threads=threads) as bx:
            start = T.alloc_shared((block_b,), "int64")
            length = T.alloc_shared((block_b,), "int64")
            rows = T.alloc_shared((block_b, block_l), "int64")  # row to add, or -1
            acc = T.alloc_fragment((block_b, width), "float32")
            count = T.alloc_fragment((block_b,), "float32")
            max_len = T.alloc_var("int64")
            T.clear(acc)
            T.clear(count)

            for i in T.Parallel(block_b):
                b = bx * block_b + i
                if bag_len > 0:
                    start[i] = T.cast(b, "int64") * bag_len
                    length[i] = T.if_then_else(b < num_bags, T.cast(bag_len, "int64"), T.int64(0))
                else:
                    lo = T.if_then_else(b < num_bags, T.cast(offsets[T.min(b, num_offsets - 1)], "int64"), T.int64(0))
                    hi = T.if_then_else(
                        b + 1 < num_offsets,
                        T.cast(offsets[T.min(b + 1, num_offsets - 1)], "int64"),
                        T.cast(num_indices, "int64"),
                    )
                    if check != 0 and b < num_bags:
                        # offsets must rise from 0 to len(indices) (include_last_offset's last one too)
                        T.device_assert(
                            lo >= 0 and hi >= lo and (b != 0 or lo == 0) and (b != num_bags - 1 or hi == num_indices),
                            INDEX_ERROR,
                        )
                    lo = T.min(T.max(lo, T.int64(0)), T.cast(num_indices, "int64"))  # memory-safe even unchecked
                    start[i] = lo
                    length[i] = T.if_then_else(
                        b < num_bags, T.min(T.max(hi, lo), T.cast(num_indices, "int64")) - lo, T.int64(0)
                    )

            max_len = T.cast(bag_len, "int64")
            if bag_len == 0:
                for i in T.serial(block_b):
                    max_len = T.max(max_len, length[i])

            for j0 in T.serial(T.ceildiv(max_len, block_l)):
                for i, j in T.Parallel(block_b, block_l):
                    p = start[i] + j0 * block_l + j
                    in_bag = j0 * block_l + j < length[i]
                    v = T.if_then_else(
                        in_bag, T.cast(indices[T.min(p, T.cast(num_indices, "int64") - 1)], "int64"), T.int64(-1)
                    )
                    in_range = v >= 0 and v < num_embeddings
                    if check != 0 and in_bag:
                        T.device_assert(in_range, INDEX_ERROR)
                    rows[i, j] = T.if_then_else(in_bag and in_range and v != padding_idx, v, T.int64(-1))
                    if bag_len == 0 and in_bag:
                        bag_of[p] = bx * block_b + i  # the entry -> bag map the gradient needs
                for j in T.unroll(block_l):
                    for i, d in T.Parallel(block_b, width):
                        # a select, not an `if`: columns past dim read zeros (TileLang guards the access)
                        acc[i, d] += T.if_then_else(
                            rows[i, j] >= 0, T.cast(weight[rows[i, j], d], "float32"), T.float32(0)
                        )
                    for i in T.Parallel(block_b):
                        count[i] += T.if_then_else(rows[i, j] >= 0, T.float32(1), T.float32(0))

            for i, d in T.Parallel(block_b, width):
                if bx * block_b + i < num_bags and d < dim:
                    out[bx * block_b + i, d] = T.cast(acc[i, d] / T.max(count[i], T.float32(1)), dtype)
            for i in T.Parallel(block_b):
                if bx * block_b + i < num_bags:
                    scale[bx * block_b + i] = T.if_then_else(count[i] > 0, T.float32(1) / count[i], T.float32(0))

            if bag_len == 0 and bx == T.ceildiv(num_bags, block_b) - 1:
                # entries no bag covers (only with malformed, unchecked offsets) get no bag
                first = T.min(T.max(T.cast(offsets[0], "int64"), T.int64(0)), T.cast(num_indices, "int64"))
                for t0 in T.serial(T.ceildiv(first, threads)):
                    for t in T.Parallel(threads):
                        if t0 * threads + t < first:
                            bag_of[t0 * threads + t] = -1
                end = T.if_then_else(
                    num_bags < num_offsets,
                    T.cast(offsets[T.min(num_bags, num_offsets - 1)], "int64"),
                    T.int64(0) + num_indices,
                )
                last = T.min(T.max(end, T.int64(0)), T.cast(num_indices, "int64"))
                for t0 in T.serial(T.ceildiv(num_indices - last, threads)):
                    for t in T.Parallel(threads):
                        if last + t0 * threads + t < num_indices:
                            bag_of[last + t0 * threads + t] = -1

    return embedding_bag_forward


def chunk_program(dim: int, dtype: str, key_dtype: str, chunk: int = CHUNK):
    """First gradient pass: one block per CHUNK sorted entries (see segments.py)."""
    width = padded_width(dim)
    num_indices, num_bag_of, num_bags, num_ranks, num_out, num_rows, num_chunks_ = T.dynamic("N NB B NR R RR NC")

    @T.prim_func
    def embedding_bag_chunks(
        keys: T.Tensor((num_indices,), key_dtype),
        perm: T.Tensor((num_indices,), "int64"),
        first: T.Tensor((num_indices,), "int32"),
        bag_of: T.Tensor((num_bag_of,), "int32"),
        scale: T.Tensor((num_bags,), "float32"),
        grad: T.Tensor((num_bags, dim), dtype),
        ranks: T.Tensor((num_ranks,), "int32"),
        out: T.Tensor((num_out, dim), dtype),
        out_rows: T.Tensor((num_rows,), "int64"),
        tail: T.Tensor((num_chunks_, dim), "float32"),
        head: T.Tensor((num_chunks_, dim), "float32"),
        bag_len: T.int32,  # > 0: fixed bags (bag = entry // bag_len); 0: ragged (bag_of)
        num_embeddings: T.int64,
        padding_idx: T.int64,
        sparse: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_indices, chunk), threads=THREADS) as c:
            key = T.alloc_shared((chunk,), "int64")
            start = T.alloc_shared((chunk,), "int32")  # 1 where a segment starts within the chunk
            flags = T.alloc_shared((chunk,), "int32")  # 1: write the row; 2: head partial; 4: tail partial
            bag = T.alloc_shared((chunk,), "int64")
            weight_of = T.alloc_shared((chunk,), "float32")
            dest = T.alloc_shared((chunk,), "int64")
            sums = T.alloc_shared((chunk, width), "float32")

            for i in T.Parallel(chunk):
                p = c * chunk + i
                valid = p < num_indices
                k = T.if_then_else(valid, T.cast(keys[T.min(p, num_indices - 1)], "int64"), T.int64(-1))
                nxt = T.if_then_else(
                    p + 1 < num_indices, T.cast(keys[T.min(p + 1, num_indices - 1)], "int64"), T.int64(-1)
                )
                f = T.if_then_else(valid, first[T.min(p, num_indices - 1)], 0)
                pos = T.if_then_else(valid, perm[T.min(p, num_indices - 1)], T.int64(0))
                b = T.if_then_else(
                    bag_len > 0,
                    pos // T.max(bag_len, 1),
                    T.if_then_else(
                        valid, T.cast(bag_of[T.min(pos, T.cast(num_bag_of, "int64") - 1)], "int64"), T.int64(-1)
                    ),
                )
                row_ok = k >= 0 and k < num_embeddings and k != padding_idx
                use = valid and row_ok and b >= 0 and b < num_bags
                key[i] = k
                bag[i] = T.if_then_else(use, b, T.int64(-1))
                weight_of[i] = T.if_then_else(
                    use, scale[T.min(T.max(b, T.int64(0)), T.cast(num_bags, "int64") - 1)], T.float32(0)
                )
                start[i] = T.if_then_else(p == f or i == 0, 1, 0)
                seg_end = valid and k != nxt
                began_here = f >= c * chunk
                flags[i] = (
                    T.if_then_else(seg_end and began_here and row_ok, 1, 0)
                    + T.if_then_else(seg_end and not began_here, 2, 0)
                    + T.if_then_else(valid and i == chunk - 1 and not seg_end, 4, 0)
                )
                dest[i] = T.if_then_else(sparse != 0, T.cast(ranks[T.min(p, num_ranks - 1)], "int64"), k)

            for i, d in T.Parallel(chunk, width):
                sums[i, d] = T.if_then_else(
                    bag[i] >= 0 and d < dim,
                    T.cast(grad[T.max(bag[i], T.int64(0)), T.min(d, dim - 1)], "float32") * weight_of[i],
                    T.float32(0),
                )
            # segmented inclusive scan down the chunk: each column restarts where a segment starts
            for i in T.serial(1, chunk):
                for d in T.Parallel(width):
                    if start[i] == 0:
                        sums[i, d] += sums[i - 1, d]

            for i, d in T.Parallel(chunk, width):
                if d < dim:
                    if flags[i] % 2 == 1:
                        out[dest[i], d] = T.cast(sums[i, d], dtype)
                    if flags[i] // 2 % 2 == 1:
                        head[c, d] = sums[i, d]
                    if flags[i] // 4 == 1:
                        tail[c, d] = sums[i, d]
            if sparse != 0:
                for i in T.Parallel(chunk):
                    if flags[i] % 2 == 1:
                        out_rows[dest[i]] = key[i]

    return embedding_bag_chunks


def combine_program(dim: int, dtype: str, key_dtype: str, chunk: int = CHUNK, block_j: int = BLOCK_J):
    """Second gradient pass: a chunk that ends a segment begun earlier adds up that segment's partials."""
    width = combine_width(dim)
    num_indices, num_ranks, num_out, num_rows, num_chunks_ = T.dynamic("N NR R RR NC")

    @T.prim_func
    def embedding_bag_combine(
        keys: T.Tensor((num_indices,), key_dtype),
        first: T.Tensor((num_indices,), "int32"),
        ranks: T.Tensor((num_ranks,), "int32"),
        tail: T.Tensor((num_chunks_, dim), "float32"),
        head: T.Tensor((num_chunks_, dim), "float32"),
        out: T.Tensor((num_out, dim), dtype),
        out_rows: T.Tensor((num_rows,), "int64"),
        num_embeddings: T.int64,
        padding_idx: T.int64,
        sparse: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_indices, chunk), threads=THREADS) as c:
            parts = T.alloc_fragment((block_j, width), "float32")
            part_sum = T.alloc_fragment((width,), "float32")
            acc = T.alloc_fragment((width,), "float32")
            p0 = c * chunk
            key = T.cast(keys[p0], "int64")
            f = first[p0]
            next_f = T.if_then_else(p0 + chunk < num_indices, first[T.min(p0 + chunk, num_indices - 1)], -1)
            owner = f < p0 and next_f != f and key >= 0 and key < num_embeddings and key != padding_idx
            lo = T.if_then_else(owner, f // chunk, c)
            T.clear(acc)
            if owner:
                for d in T.Parallel(width):
                    acc[d] = T.if_then_else(d < dim, head[c, T.min(d, dim - 1)], T.float32(0))
                for jb in T.serial(T.ceildiv(c - lo, block_j)):
                    for j, d in T.Parallel(block_j, width):
                        jj = lo + jb * block_j + j
                        parts[j, d] = T.if_then_else(
                            jj < c and d < dim, tail[T.min(jj, c), T.min(d, dim - 1)], T.float32(0)
                        )
                    T.reduce_sum(parts, part_sum, dim=0)
                    for d in T.Parallel(width):
                        acc[d] += part_sum[d]
                row = T.if_then_else(sparse != 0, T.cast(ranks[T.min(p0, num_ranks - 1)], "int64"), key)
                for d in T.Parallel(width):
                    if d < dim:
                        out[row, d] = T.cast(acc[d], dtype)
                if sparse != 0:
                    out_rows[row] = key

    return embedding_bag_combine


# --------------------------------------------------------------------------- compile cache


def forward_entry(
    dim: int, dtype: torch.dtype, index_dtype: torch.dtype, offset_dtype: torch.dtype, launch: ForwardLaunch = FORWARD
) -> Entry:
    key = ("embedding_bag_forward", dim, dtype, index_dtype, offset_dtype, launch)
    return key, lambda _: forward_program(dim, _DTYPES[dtype], _DTYPES[index_dtype], _DTYPES[offset_dtype], launch)


def chunk_entry(dim: int, dtype: torch.dtype, key_dtype: torch.dtype) -> Entry:
    return ("embedding_bag_chunks", dim, dtype, key_dtype), lambda _: chunk_program(
        dim, _DTYPES[dtype], _DTYPES[key_dtype]
    )


def combine_entry(dim: int, dtype: torch.dtype, key_dtype: torch.dtype) -> Entry:
    return ("embedding_bag_combine", dim, dtype, key_dtype), lambda _: combine_program(
        dim, _DTYPES[dtype], _DTYPES[key_dtype]
    )


def precompile(specs, device: torch.device) -> None:
    """Compile ahead of use, in parallel: specs are (dim, weight dtype, index dtype, offsets dtype)."""
    if device.index is None:  # the kernels are cached per device as tensors name it ("cuda:0")
        device = torch.device(device.type, torch.cuda.current_device())
    entries = {}
    for dim, dtype, index_dtype, offset_dtype in specs:
        for key, build in (
            forward_entry(dim, dtype, index_dtype, offset_dtype),
            chunk_entry(dim, dtype, torch.int32),
            combine_entry(dim, dtype, torch.int32),
        ):
            entries[key] = build
    precompile_entries(list(entries.items()), device)


# --------------------------------------------------------------------------- module interface


def forward(
    weight, indices, offsets, padding_idx: int, include_last_offset: bool, check_indices: bool,
    launch: ForwardLaunch = FORWARD,
):  # fmt: skip
    bags = bag_layout(indices, offsets, include_last_offset)
    num_embeddings, dim = weight.shape
    fixed = bags.offsets is None
    out = buffers.empty((bags.num_bags, dim), dtype=weight.dtype, device=weight.device)
    scale = buffers.empty((bags.num_bags,), dtype=torch.float32, device=weight.device)
    bag_of = buffers.empty((0 if fixed else bags.flat.numel(),), dtype=torch.int32, device=weight.device)
    if bags.num_bags == 0:
        return out, scale, bag_of
    if bags.flat.numel() == 0:  # every bag is empty (kernels take no empty buffers)
        if check_indices and not fixed:
            torch._assert_async((bags.offsets == 0).all(), INDEX_ERROR)
        out.zero_(), scale.zero_()
        return out, scale, bag_of
    offs = bags.flat if fixed else bags.offsets
    kernel = launcher(forward_entry(dim, weight.dtype, bags.flat.dtype, offs.dtype, launch), weight.device)
    bag_of_arg = bag_of if not fixed else scale.new_empty(1, dtype=torch.int32)
    kernel(weight, bags.flat, offs, out, scale, bag_of_arg, bags.bag_len, padding_idx, int(check_indices))
    return out, scale, bag_of


def _reduce(grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, sparse: bool):
    bags = bag_layout(indices, offsets, include_last_offset)
    num_embeddings, dim = weight.shape
    num_indices = bags.flat.numel()
    device = weight.device
    if num_indices == 0 or bags.num_bags == 0:
        return empty_input_gradient(weight, sparse)
    grad_out = grad_out.contiguous()
    segments = sort_segments(bags.flat, num_embeddings)
    placeholder = segments.first[:1]
    if sparse:
        ranks, count = sparse_ranks(segments, num_embeddings, padding_idx)
        out = buffers.empty((max(count, 1), dim), dtype=weight.dtype, device=device)
        rows = buffers.empty((max(count, 1),), dtype=torch.int64, device=device)
    else:
        ranks, count = placeholder, num_embeddings
        out = torch.zeros((num_embeddings, dim), dtype=weight.dtype, device=device)
        rows = torch.empty(1, dtype=torch.int64, device=device)
    chunks = num_chunks(num_indices, CHUNK)
    tail = buffers.empty((chunks, dim), dtype=torch.float32, device=device)
    head = buffers.empty((chunks, dim), dtype=torch.float32, device=device)
    key_dtype = segments.keys.dtype
    bag_of_arg = bag_of if bag_of.numel() else placeholder
    launcher(chunk_entry(dim, weight.dtype, key_dtype), device)(
        segments.keys, segments.perm, segments.first, bag_of_arg, scale, grad_out, ranks,
        out, rows, tail, head, bags.bag_len, num_embeddings, padding_idx, int(sparse),
    )  # fmt: skip
    if chunks > 1:
        launcher(combine_entry(dim, weight.dtype, key_dtype), device)(
            segments.keys, segments.first, ranks, tail, head, out, rows, num_embeddings, padding_idx, int(sparse)
        )
    if sparse:
        return rows[:count], out[:count]
    return out


def backward(grad_out, weight, indices, offsets, padding_idx, include_last_offset, check_indices, out, scale, bag_of):
    grad = _reduce(grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, sparse=False)
    return grad, None, None, None, None, None


def backward_sparse(
    grad_out, weight, indices, offsets, padding_idx, include_last_offset, check_indices, out, scale, bag_of
):
    """backward with a coalesced sparse COO weight gradient (out: None, backward_reads="saved")."""
    rows, values = _reduce(
        grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, sparse=True
    )
    return sparse_gradient(rows, values, weight.shape[0]), None, None, None, None, None


KERNELS = KernelBackend(forward=forward, backward=backward)
SPARSE_KERNELS = KernelBackend(forward=forward, backward=backward_sparse, backward_reads="saved")
