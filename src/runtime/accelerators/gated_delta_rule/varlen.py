"""Packed sequences (cu_seqlens) cut into fixed-size pieces, numbered on the device (shared by the Triton and
TileLang kernels).

Pieces (the 64-step chunks, or the context-parallel split's segments of several chunks, split.py) are numbered
sequence by sequence: sequence n owns cdiv(len_n, size) of them (none when empty), from first[n] on. The boundaries are
validated on the host, so the number of pieces (the size of what is written) is known there without a
device sync; one kernel (one program per sequence) writes the per-piece numbers from the device copy.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import buffers
from ..triton_launch import direct_launch


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceCopies:
    """The device copies of host boundaries, by (device, dtype, the host dtype and bytes): [copy, kept, made], made:
    (the stream the copy was made on, an event recorded after it) on CUDA, else None. A copy used while a CUDA graph
    is captured is kept for good (the graph reads it at every replay); the others go, oldest first, past
    max_copies. capturing(device): whether a CUDA graph is being captured on the device's current stream (tests pass
    their own)."""

    def __init__(self, max_copies: int = 256, capturing: Callable[[torch.device], bool] = _capturing):
        self.max_copies = max_copies
        self.capturing = capturing
        self.copies: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # calls from several threads (the autograd engine's among them) share copies

    def on_device(self, cu_host: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The host boundaries on `device` (in `dtype`, default theirs), copied once per distinct value.

        CUDA-graph capture refuses a copy from pageable host memory, so a call inside a capture takes the copy an
        earlier call with the same boundaries made (the warm-up every capture needs anyway), and fails without one.
        The copy is shared by the calls: kernels only read it. The copy runs asynchronously on the stream of the call
        that made it, so a call on another stream waits for it (an event) and marks the copy in use there
        (record_stream), so that it is freed only after that stream's kernels. Inside a capture neither is done: the
        copy is kept for good, and it was made before the capture (torch.cuda.graph synchronizes the device as it
        begins)."""
        dtype = cu_host.dtype if dtype is None else dtype
        if cu_host.device == device:
            return cu_host.to(dtype)
        key = (device, dtype, cu_host.dtype, cu_host.numpy().tobytes())
        capturing = self.capturing(device)
        with self._lock:
            entry = self.copies.get(key)
            if entry is None:
                if capturing:
                    raise RuntimeError(
                        "cu_seqlens: its copy to the device cannot be made while a CUDA graph is captured; call the op "
                        "once with the same cu_seqlens before capturing (a warm-up), which keeps that copy for the "
                        "capture"
                    )
                copy = cu_host.to(device=device, dtype=dtype, non_blocking=True)
                made = None
                if device.type == "cuda":
                    stream = torch.cuda.current_stream(device)
                    made = (stream, stream.record_event())
                entry = self.copies[key] = [copy, False, made]
                self._drop_oldest()
            else:
                self.copies.move_to_end(key)
                if entry[2] is not None and not capturing:
                    stream = torch.cuda.current_stream(device)
                    if stream != entry[2][0]:
                        stream.wait_event(entry[2][1])
                        entry[0].record_stream(stream)
            entry[1] = entry[1] or capturing
            return entry[0]

    def _drop_oldest(self) -> None:
        while len(self.copies) > self.max_copies:
            dropped = next((key for key, (_, kept, _) in self.copies.items() if not kept), None)
            if dropped is None:
                return
            del self.copies[dropped]


DEVICE_COPIES = DeviceCopies()  # the copies every op call shares
on_device = DEVICE_COPIES.on_device


@direct_launch
@triton.jit
def _pieces_kernel(
    cu_seqlens,
    first_piece,
    table,
    starts,
    chunk_offsets,
    first_chunks,
    SIZE,
    CHUNK,
    TABLE: tl.constexpr,
    BOUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_n = tl.program_id(0)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(first_piece + i_n).to(tl.int64)
    count = (eos - bos + SIZE - 1) // SIZE
    for block in range(0, count, BLOCK):
        within = block + tl.arange(0, BLOCK)
        mask = within < count
        piece = first + within
        if TABLE:
            tl.store(table + piece * 2, tl.full([BLOCK], 0, tl.int32) + i_n, mask=mask)
            tl.store(table + piece * 2 + 1, within.to(tl.int32), mask=mask)
        if BOUNDS:
            tl.store(starts + piece, bos + within * SIZE, mask=mask)
            sequence_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
            tl.store(first_chunks + piece, (sequence_chunk + within * (SIZE // CHUNK)).to(tl.int32), mask=mask)
    if BOUNDS and i_n == tl.num_programs(0) - 1:
        tl.store(starts + first + count, eos)  # the end of the last piece


def piece_counts(cu_seqlens: torch.Tensor, size: int) -> torch.Tensor:
    """[N] pieces of each sequence (on the tensor's device, in its dtype)."""
    return (cu_seqlens[1:] - cu_seqlens[:-1] + size - 1) // size


def _first_pieces(cu_seqlens: torch.Tensor, size: int) -> torch.Tensor:
    counts = piece_counts(cu_seqlens, size)
    return (torch.cumsum(counts, 0) - counts).to(torch.int32)


def _launch(cu_seqlens, first, size: int, table=None, starts=None, chunk_offsets=None, first_chunks=None, chunk=1):
    _pieces_kernel[(cu_seqlens.numel() - 1,)](
        cu_seqlens,
        first,
        table,
        starts,
        chunk_offsets,
        first_chunks,
        size,
        chunk,
        TABLE=table is not None,
        BOUNDS=starts is not None,
        BLOCK=256,
        num_warps=2,
    )


def chunk_table(cu_seqlens: torch.Tensor, cu_host: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([pieces, 2] int32 (sequence, piece within it), [N] int32 first piece of each sequence) on cu_seqlens' device.

    cu_seqlens: the boundaries on the device (int32 or int64); cu_host: the same boundaries on the host.
    """
    total = int(piece_counts(cu_host, size).sum())
    first = _first_pieces(cu_seqlens, size)
    table = buffers.empty((total, 2), dtype=torch.int32, device=cu_seqlens.device)
    _launch(cu_seqlens, first, size, table=table)
    return table, first


def piece_bounds(
    cu_seqlens: torch.Tensor, cu_host: torch.Tensor, size: int, chunk: int, dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces as sequences of their own, on cu_seqlens' device: ([pieces + 1] boundaries in `dtype` (int64, or
    int32 for kernels that index with it), [pieces] int32 global index of each piece's first chunk (chunks of `chunk`
    tokens, a divisor of size, numbered sequence by sequence), [N] int32 first piece of each sequence)."""
    total = int(piece_counts(cu_host, size).sum())
    first = _first_pieces(cu_seqlens, size)
    device = cu_seqlens.device
    starts = buffers.empty((total + 1,), dtype=dtype, device=device)
    first_chunks = buffers.empty((total,), dtype=torch.int32, device=device)
    chunk_offsets = _first_pieces(cu_seqlens, chunk)
    _launch(cu_seqlens, first, size, starts=starts, chunk_offsets=chunk_offsets, first_chunks=first_chunks, chunk=chunk)
    return starts, first_chunks, first
