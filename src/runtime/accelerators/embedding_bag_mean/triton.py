"""Embedding-bag mean in Triton: a gather-and-mean forward and an atomic-free weight gradient.

forward(weight, indices, offsets, padding_idx, include_last_offset, check_indices)
    -> (out [B, D], scale [B] fp32 = 1/count or 0, bag_of [N] int32 (ragged bags; empty otherwise))
backward(grad_out, *args, *results) -> (dense weight gradient, None, ...)
backward_sparse(grad_out, *args, *results) -> sparse COO weight gradient (coalesced)

The gradient follows segments.py: sort the flat indices (radix_sort.py's sort, or torch.sort where it does not fit),
then `_chunk_kernel` sums each chunk of CHUNK sorted entries per segment (a segmented scan) and `_combine_kernel` adds
up the partial sums of segments that cross chunks. Both find segment edges from the sorted keys alone (a segment
starts where the key changes), whichever sort made them. The forward's index check is a device-side assert in
the kernel on CUDA (no host sync, no extra launch: the forward stays one CUDA-graph node); under
the CPU interpreter, which ignores device asserts, the kernel clears a flag that is read after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv, pow2_at_least
from ..triton_launch import direct_launch
from . import radix_sort
from .configs import BLOCK_J, CHUNK
from .reference import INDEX_ERROR, index_error
from .segments import Segments, bag_layout, empty_input_gradient, num_chunks, sort_keys, sparse_gradient, sparse_ranks

# The weight gradient sorts its keys with radix_sort.py where they fit (radix_sort.fits), else with torch.sort; the
# dense gradient's zero fill runs in the radix sort's launches (docs/tuning/embedding_bag_mean.md).


# --------------------------------------------------------------------------- kernels


INDEX_MESSAGE = tl.constexpr(INDEX_ERROR)  # a device_assert message must be a constexpr string
# the forward's index check: none, a flag cleared on bad input (the CPU interpreter), device_assert (CUDA)
CHECK_OFF, CHECK_FLAG, CHECK_ASSERT = 0, 1, 2


# Sizes and row numbers are not specialised (one compiled kernel serves every batch); dim and the row strides
# are, so that 16-byte-aligned rows get vector loads. debug=True compiles in tl.device_assert (the CUDA index
# check, CHECK_ASSERT); it also makes Triton check every int32 add, subtract and multiply for overflow, so the
# integer math here is int64, and the only assert is ours.
@direct_launch
@triton.jit(
    debug=True, do_not_specialize=["num_bags", "num_indices", "num_offsets", "num_embeddings", "bag_len", "padding_idx"]
)
def _forward_kernel(
    weight_ptr, indices_ptr, offsets_ptr, out_ptr, scale_ptr, bag_of_ptr, ok_ptr,
    num_bags, num_indices, num_offsets, num_embeddings, dim, bag_len, stride_w, padding_idx,
    FIXED: tl.constexpr, CHECK: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    bags = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    in_batch = bags < num_bags
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    if FIXED:
        start = bags * bag_len
        length = tl.where(in_batch, bag_len, 0).to(tl.int64)
        bad = tl.zeros([BLOCK_B], dtype=tl.int32)
        max_len = bag_len.to(tl.int64)
    else:
        start = tl.load(offsets_ptr + bags, mask=in_batch, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + bags + 1, mask=in_batch & (bags + 1 < num_offsets), other=num_indices).to(tl.int64)
        # offsets must rise from 0 to len(indices) (include_last_offset's last one too)
        malformed = (
            (start < 0) | (end < start) | ((bags == 0) & (start != 0)) | ((bags + 1 == num_bags) & (end != num_indices))
        )
        bad = (in_batch & malformed).to(tl.int32)
        start = tl.minimum(tl.maximum(start, 0), num_indices)  # memory-safe even when unchecked
        end = tl.minimum(tl.maximum(end, start), num_indices)
        length = tl.where(in_batch, end - start, 0)
        max_len = tl.max(length, 0)

    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_B], dtype=tl.float32)  # float: an int32 sum would carry the overflow checks
    for j0 in range(0, max_len, BLOCK_L):
        # unrolled: every row load of the block is in flight before the first add
        for jj in tl.static_range(BLOCK_L):
            in_bag = jj < length - j0
            idx = tl.load(indices_ptr + start + j0 + jj, mask=in_bag, other=0).to(tl.int64)
            in_range = (idx >= 0) & (idx < num_embeddings)
            bad |= (in_bag & ~in_range).to(tl.int32)
            use = in_bag & in_range & (idx != padding_idx)
            count += use.to(tl.float32)
            rows = tl.load(
                weight_ptr + idx[:, None] * stride_w + cols[None, :], mask=use[:, None] & col_ok[None, :], other=0.0
            )
            acc += rows.to(tl.float32)
        if not FIXED:
            if pid_d == 0:  # the entry -> bag map the gradient needs
                for jj in tl.static_range(BLOCK_L):
                    tl.store(bag_of_ptr + start + j0 + jj, bags.to(tl.int32), mask=jj < length - j0)

    scale = tl.where(count > 0, 1.0 / tl.maximum(count, 1.0), 0.0)
    out = acc * scale[:, None]
    out_offs = bags[:, None] * dim + cols[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=in_batch[:, None] & col_ok[None, :])
    if pid_d == 0:
        tl.store(scale_ptr + bags, scale, mask=in_batch)
        if not FIXED:
            # entries no bag covers (past the last offset, or before a malformed first one) get no bag
            t = tl.arange(0, BLOCK_T)
            if pid_b == 0:
                first_start = tl.min(tl.where(bags == 0, start, num_indices), 0)
                for t0 in range(0, first_start, BLOCK_T):
                    tl.store(bag_of_ptr + t0 + t, tl.full([BLOCK_T], -1, tl.int32), mask=t0 + t < first_start)
            if pid_b + 1 == tl.num_programs(0):
                last_end = tl.max(tl.where(in_batch, start + length, 0), 0)
                for t0 in range(last_end, num_indices, BLOCK_T):
                    tl.store(bag_of_ptr + t0 + t, tl.full([BLOCK_T], -1, tl.int32), mask=t0 + t < num_indices)
        if CHECK == 1:  # CHECK_FLAG
            tl.store(ok_ptr, 0, mask=tl.max(bad, 0) > 0)
        if CHECK == 2:  # CHECK_ASSERT
            tl.device_assert(bad == 0, INDEX_MESSAGE)


@triton.jit
def _segmented_add(a, a_starts, b, b_starts):
    return tl.where(b_starts != 0, b, a + b), a_starts | b_starts


@direct_launch
@triton.jit(do_not_specialize=["num_indices", "num_bags", "num_embeddings", "bag_len", "padding_idx"])
def _chunk_kernel(
    keys_ptr, perm_ptr, bag_of_ptr, scale_ptr, grad_ptr, ranks_ptr,
    out_ptr, rows_ptr, tail_ptr, head_ptr,
    num_indices, num_bags, num_embeddings, dim, bag_len, stride_g, padding_idx,
    FIXED: tl.constexpr, SPARSE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    pid_d = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    p = c * CHUNK + i
    valid = p < num_indices
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim

    key = tl.load(keys_ptr + p, mask=valid, other=-1)
    next_key = tl.load(keys_ptr + p + 1, mask=p + 1 < num_indices, other=-1)
    prev_key = tl.load(keys_ptr + p - 1, mask=valid & (i > 0), other=0)
    before_chunk = tl.load(keys_ptr + c * CHUNK - 1, mask=c > 0, other=0)  # the previous chunk's last key
    starts = (key != prev_key) | (i == 0)
    began_here = (key != before_chunk) | (p < CHUNK)  # (c == 0, as a tensor: the interpreter rejects mixing)
    pos = tl.load(perm_ptr + p, mask=valid, other=0).to(tl.int64)  # int64 (torch.sort) or int32 (radix sort)
    if FIXED:
        bag = pos // bag_len
    else:
        bag = tl.load(bag_of_ptr + pos, mask=valid, other=-1).to(tl.int64)
    row_ok = (key >= 0) & (key < num_embeddings) & (key != padding_idx)
    use = valid & row_ok & (bag >= 0) & (bag < num_bags)
    # the bag's scale is loaded as a [CHUNK, BLOCK_D] tile (each row's value repeated): with a [CHUNK] load
    # Triton 3.6 fails to lay out `use` for both shapes on sm_90 (ragged bags, sparse gradient)
    use_cols = use[:, None] & col_ok[None, :]
    s = tl.load(scale_ptr + bag[:, None] + 0 * cols[None, :], mask=use_cols, other=0.0)
    g = tl.load(grad_ptr + bag[:, None] * stride_g + cols[None, :], mask=use_cols, other=0.0)
    g = g.to(tl.float32) * s

    starts = starts.to(tl.int32)
    sums, _ = tl.associative_scan((g, tl.broadcast_to(starts[:, None], (CHUNK, BLOCK_D))), 0, _segmented_add)

    seg_end = valid & (key != next_key)  # the last entry of its segment
    done = seg_end & began_here & row_ok  # the whole segment lies in this chunk: write its row
    if SPARSE:
        # the sparse gradient's row for this segment, as a [CHUNK, BLOCK_D] tile (see the scale load)
        dest = tl.load(ranks_ptr + p[:, None] + 0 * cols[None, :], mask=done[:, None] & col_ok[None, :], other=0).to(
            tl.int64
        )
    else:
        dest = key.to(tl.int64)[:, None] + 0 * cols[None, :]
    tl.store(
        out_ptr + dest * dim + cols[None, :], sums.to(out_ptr.dtype.element_ty), mask=done[:, None] & col_ok[None, :]
    )
    if SPARSE:
        if pid_d == 0:  # the first column of each row stores its key
            keys = key.to(tl.int64)[:, None] + 0 * cols[None, :]
            tl.store(rows_ptr + dest, keys, mask=done[:, None] & (cols == 0)[None, :])
    # partial sums of segments crossing a chunk edge, for _combine_kernel
    head = seg_end & ~began_here  # ends here, began in an earlier chunk
    tail = valid & (i == CHUNK - 1) & ~seg_end  # runs on into the next chunk
    part_offs = c * dim + cols[None, :] + 0 * i[:, None]
    tl.store(head_ptr + part_offs, sums, mask=head[:, None] & col_ok[None, :])
    tl.store(tail_ptr + part_offs, sums, mask=tail[:, None] & col_ok[None, :])


@triton.jit
def _first_chunk(keys_ptr, key, c, search, CHUNK: tl.constexpr, BLOCK_J: tl.constexpr):
    """The chunk where the segment of `key`, which goes on into chunk c, begins (c when not `search`): the chunks
    before c whose last key is `key` (sorted keys: a run of chunks ending at c - 1), BLOCK_J last keys at a time."""
    lo = c
    while search:
        j = lo - BLOCK_J + tl.arange(0, BLOCK_J)
        last = tl.load(keys_ptr + (j + 1) * CHUNK - 1, mask=j >= 0, other=0)
        found = tl.sum(((j >= 0) & (last == key)).to(tl.int32), 0)  # a run ending at lo - 1
        lo -= found
        search = found == BLOCK_J
    return lo


@direct_launch
@triton.jit(do_not_specialize=["num_indices", "num_embeddings", "padding_idx"])
def _combine_kernel(
    keys_ptr, ranks_ptr, tail_ptr, head_ptr, out_ptr, rows_ptr,
    num_indices, num_embeddings, dim, padding_idx,
    SPARSE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    pid_d = tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    p0 = c * CHUNK
    key = tl.load(keys_ptr + p0)
    row_ok = (key >= 0) & (key < num_embeddings) & (key != padding_idx)
    # this chunk finishes a segment that began in an earlier chunk (lo, below): it owns the final sum; the segment
    # goes on while the key does
    prev_key = tl.load(keys_ptr + p0 - 1, mask=c > 0, other=0)
    next_key = tl.load(keys_ptr + p0 + CHUNK, mask=p0 + CHUNK < num_indices, other=0)
    owner = (c > 0) & (prev_key == key) & ((p0 + CHUNK >= num_indices) | (next_key != key)) & row_ok
    lo = _first_chunk(keys_ptr, key, c, owner, CHUNK, BLOCK_J)
    write = tl.where(owner, col_ok, False)  # (not `col_ok & owner`: the interpreter rejects that mask)
    acc = tl.load(head_ptr + c * dim + cols, mask=write, other=0.0)
    for j0 in range(lo, c, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        part = tl.load(tail_ptr + j[:, None] * dim + cols[None, :], mask=(j < c)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(part, 0)
    if SPARSE:
        dest = tl.load(ranks_ptr + p0).to(tl.int64)
    else:
        dest = key.to(tl.int64)
    tl.store(out_ptr + dest * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=write)
    if SPARSE:
        if pid_d == 0:
            tl.store(rows_ptr + dest, key.to(tl.int64), mask=owner)


# --------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class ForwardLaunch:
    """How the forward kernel is launched (FORWARD: the launch the op takes by default)."""

    block_b: int = 0  # bags per program; 0: about 2K [bags, columns] elements per program, at most 64 bags
    num_warps: int = 4


FORWARD = ForwardLaunch()


@dataclass(frozen=True)
class GradientLaunch:
    """How the weight gradient runs: `radix`, the radix sort of its keys (torch.sort where its counts matrix does not
    fit) and the zero-fill of the dense gradient beside it; `block_j`, the chunk partials the combine kernel sums, and
    searches back over, at once (BLOCK_J by default)."""

    radix: radix_sort.RadixLaunch = radix_sort.RADIX
    block_j: int = BLOCK_J


GRADIENT = GradientLaunch()


def forward_config(dim: int, bag_len: int, launch: ForwardLaunch = FORWARD) -> dict:
    """Block sizes (constexprs) and warps of the forward kernel `launch`, for the row width and the (typical) bag
    length."""
    block_d = min(pow2_at_least(dim), 128)
    block_l = min(pow2_at_least(bag_len), 8)
    block_b = launch.block_b or max(1, min(64, 2048 // block_d))
    return dict(BLOCK_B=block_b, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=launch.num_warps)


def forward(
    weight, indices, offsets, padding_idx: int, include_last_offset: bool, check_indices: bool,
    launch: ForwardLaunch = FORWARD,
):  # fmt: skip
    bags = bag_layout(indices, offsets, include_last_offset)
    num_embeddings, dim = weight.shape
    num_indices = bags.flat.numel()
    out = buffers.empty((bags.num_bags, dim), dtype=weight.dtype, device=weight.device)
    scale = buffers.empty((bags.num_bags,), dtype=torch.float32, device=weight.device)
    fixed = bags.offsets is None
    bag_of = buffers.empty((0 if fixed else num_indices,), dtype=torch.int32, device=weight.device)
    if bags.num_bags == 0:
        return out, scale, bag_of
    typical_len = bags.bag_len if fixed else -(-num_indices // bags.num_bags)
    cfg = forward_config(dim, typical_len, launch)
    # the interpreter ignores device_assert: on the CPU the kernel clears a flag, read after it
    check = CHECK_OFF
    if check_indices:
        check = CHECK_ASSERT if weight.device.type == "cuda" else CHECK_FLAG
    ok = (
        torch.ones(1, dtype=torch.int32, device=weight.device) if check == CHECK_FLAG else scale
    )  # never written otherwise
    grid = (cdiv(bags.num_bags, cfg["BLOCK_B"]), cdiv(dim, cfg["BLOCK_D"]))
    _forward_kernel[grid](
        weight, bags.flat, bags.offsets if not fixed else bags.flat, out, scale, bag_of, ok,
        bags.num_bags, num_indices, 0 if fixed else bags.offsets.numel(), num_embeddings, dim, bags.bag_len,
        weight.stride(0), padding_idx,
        FIXED=fixed, CHECK=check, BLOCK_T=256, **cfg,
    )  # fmt: skip
    if check == CHECK_FLAG and not ok.item():  # the CPU: no sync to avoid
        raise index_error(weight, indices, offsets, include_last_offset)
    return out, scale, bag_of


def sort_for_gradient(
    flat: torch.Tensor,
    num_embeddings: int,
    zero: torch.Tensor | None = None,
    radix: radix_sort.RadixLaunch = radix_sort.RADIX,
) -> Segments:
    """The sorted indices behind the weight gradient: the radix sort where it fits, else torch.sort. Zero-fills `zero`
    (the dense gradient) too: in the radix sort's launches, beside its latency-bound work, else before the sort."""
    if radix_sort.fits(flat.numel(), num_embeddings, radix):
        return radix_sort.sort_segments(flat, num_embeddings, radix, zero=zero)
    if zero is not None:
        zero.zero_()
    return sort_keys(flat, num_embeddings)


def _reduce(
    grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, sparse: bool,
    launch: GradientLaunch,
):  # fmt: skip
    """Run both gradient passes; returns the dense gradient, or (rows, values) when sparse."""
    bags = bag_layout(indices, offsets, include_last_offset)
    num_embeddings, dim = weight.shape
    num_indices = bags.flat.numel()
    device = weight.device
    if num_indices == 0 or bags.num_bags == 0:
        return empty_input_gradient(weight, sparse)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dense = None if sparse else buffers.empty((num_embeddings, dim), dtype=weight.dtype, device=device)
    segments = sort_for_gradient(bags.flat, num_embeddings, zero=dense, radix=launch.radix)
    if sparse:
        ranks, count = sparse_ranks(segments, num_embeddings, padding_idx)
        out = buffers.empty((count, dim), dtype=weight.dtype, device=device)
        rows = buffers.empty((count,), dtype=torch.int64, device=device)
    else:
        ranks = rows = segments.keys  # unused placeholders
        out = dense
    chunks = num_chunks(num_indices, CHUNK)
    block_d = min(pow2_at_least(dim), 128)
    tail = buffers.empty((chunks, dim), dtype=torch.float32, device=device)
    head = buffers.empty((chunks, dim), dtype=torch.float32, device=device)
    grid = (chunks, cdiv(dim, block_d))
    fixed = bags.offsets is None
    _chunk_kernel[grid](
        segments.keys, segments.perm, bag_of, scale, grad_out, ranks,
        out, rows, tail, head,
        num_indices, bags.num_bags, num_embeddings, dim, max(bags.bag_len, 1), grad_out.stride(0), padding_idx,
        FIXED=fixed, SPARSE=sparse, CHUNK=CHUNK, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    if chunks > 1:
        _combine_kernel[grid](
            segments.keys, ranks, tail, head, out, rows,
            num_indices, num_embeddings, dim, padding_idx,
            SPARSE=sparse, CHUNK=CHUNK, BLOCK_J=launch.block_j, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return (rows, out) if sparse else out


def backward(
    grad_out, weight, indices, offsets, padding_idx, include_last_offset, check_indices, out, scale, bag_of,
    launch: GradientLaunch = GRADIENT,
):  # fmt: skip
    grad = _reduce(grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, False, launch)
    return grad, None, None, None, None, None


def backward_sparse(
    grad_out, weight, indices, offsets, padding_idx, include_last_offset, check_indices, out, scale, bag_of,
    launch: GradientLaunch = GRADIENT,
):  # fmt: skip
    """backward with a coalesced sparse COO weight gradient (out: None, backward_reads="saved")."""
    rows, values = _reduce(
        grad_out, weight, indices, offsets, padding_idx, include_last_offset, scale, bag_of, True, launch
    )
    return sparse_gradient(rows, values, weight.shape[0]), None, None, None, None, None


KERNELS = KernelBackend(forward=forward, backward=backward)
SPARSE_KERNELS = KernelBackend(forward=forward, backward=backward_sparse, backward_reads="saved")
