"""How fast can any embedding-bag forward be at the issue's shapes, timed as the benchmark times it?

    bash .device/gpu python scripts/embedding_bag_floor.py

Every row is timed by `runtime.benchmark.timing.gpu_time_ms` (a CUDA graph replayed after an L2 flush), on the
benchmark's own tables and bags (1M rows, 8192 bags, 25% padding):
- "empty kernel": one store; what the timing method reports for no work.
- "gather, no index load": each bag sums rows whose numbers a hash of the entry gives, so no index is read: the
  row traffic alone (the same count of rows: the padded entries are skipped at the same rate), one DRAM round trip.
- "gather, indices then rows": reads the indices, then the rows: two dependent round trips, no checks, no
  scale, nothing for the gradient. The least a real forward does.
- "ours (triton)", with and without the index check, and the peer `F.embedding_bag`.
The issue's forward target is 3x the peer: the last column says how far each row is from peer / 3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runtime.accelerators import embedding_bag_mean
from runtime.benchmark.ops.embedding_bag import PAD, VOCAB, make_bags
from runtime.benchmark.timing import gpu_time_ms


@triton.jit
def _store_one(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


@triton.jit
def _gather_hashed(weight_ptr, out_ptr, num_bags, vocab, BAG: tl.constexpr, DIM: tl.constexpr, BLOCK_B: tl.constexpr):
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, DIM)
    acc = tl.zeros([BLOCK_B, DIM], dtype=tl.float32)
    for j in tl.static_range(BAG):
        h = (bags * BAG + j).to(tl.uint32) * 2654435761  # Knuth's multiplicative hash
        row = (h % vocab.to(tl.uint32)).to(tl.int64)
        use = (bags < num_bags) & ((h >> 30) != 0)  # 1 in 4 skipped, as the padding entries
        acc += tl.load(weight_ptr + row[:, None] * DIM + cols[None, :], mask=use[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + bags[:, None] * DIM + cols[None, :], (acc / BAG).to(out_ptr.dtype.element_ty), mask=bags[:, None] < num_bags)


@triton.jit
def _gather_indexed(weight_ptr, idx_ptr, out_ptr, num_bags, pad, BAG: tl.constexpr, DIM: tl.constexpr, BLOCK_B: tl.constexpr):
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, DIM)
    slots = tl.arange(0, BAG)
    idx = tl.load(idx_ptr + bags[:, None] * BAG + slots[None, :], mask=bags[:, None] < num_bags, other=pad)
    acc = tl.zeros([BLOCK_B, DIM], dtype=tl.float32)
    for j in tl.static_range(BAG):
        row = tl.sum(tl.where(slots[None, :] == j, idx, 0), 1)  # column j of the index tile, in registers
        use = row != pad
        acc += tl.load(weight_ptr + row[:, None] * DIM + cols[None, :], mask=use[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + bags[:, None] * DIM + cols[None, :], (acc / BAG).to(out_ptr.dtype.element_ty), mask=bags[:, None] < num_bags)


def _row(name: str, fn, device, peer_us: float | None) -> float:
    times, captured = gpu_time_ms(fn, device)
    us = 1e3 * times["median"]
    goal = "" if peer_us is None else f"  x peer {peer_us / us:5.2f}"
    print(f"  {name:34s} {us:7.2f} us (p20 {1e3 * times['p20']:.2f}, p80 {1e3 * times['p80']:.2f}){goal}  graph {captured}")
    return us


def main() -> None:
    device = torch.device("cuda")
    one = torch.zeros(1024, device=device)
    print(f"{torch.cuda.get_device_name()}, bf16, 1M rows, 8192 bags, 25% padding; GPU time as the benchmark takes it")
    _row("empty kernel", lambda: _store_one[(1,)](one), device, None)
    for dim, bag, dist in [(64, 4, "uniform"), (64, 4, "zipf"), (64, 8, "uniform"), (64, 8, "zipf"), (128, 8, "uniform")]:
        weight = torch.randn(VOCAB, dim, device=device, dtype=torch.bfloat16)
        indices = make_bags(device, bag, dist)
        bags = indices.shape[0]
        out = torch.empty(bags, dim, device=device, dtype=weight.dtype)
        block_b = max(1, 2048 // dim)
        grid = (triton.cdiv(bags, block_b),)
        print(f"1Mx{dim} bag {bag} {dist}")
        peer = _row("F.embedding_bag", lambda: F.embedding_bag(indices, weight, mode="mean", padding_idx=PAD), device, None)
        _row("gather, no index load", lambda: _gather_hashed[grid](weight, out, bags, VOCAB, bag, dim, block_b), device, peer)
        _row("gather, indices then rows", lambda: _gather_indexed[grid](weight, indices, out, bags, PAD, bag, dim, block_b), device, peer)
        _row("ours (triton), index check", lambda: embedding_bag_mean(weight, indices, padding_idx=PAD, backend="triton"), device, peer)
        _row("ours (triton), no check", lambda: embedding_bag_mean(weight, indices, padding_idx=PAD, check_indices=False, backend="triton"), device, peer)
        print(f"  3x the peer needs {peer / 3:.2f} us")


if __name__ == "__main__":
    main()
