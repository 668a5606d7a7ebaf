"""The smallest GPU time the benchmark can report on this machine: a one-store Triton kernel and a 4 KB zero_, timed
as `runtime.benchmark.timing.gpu_time_ms` times every op (a CUDA graph replayed after an L2 flush).

    bash .device/gpu python scripts/timing_floor.py

Session 18, H100 (results/timing-floor-2026-11-23-h100-s18.txt): 3.30 us and 3.58 us. A ratio target against a peer
that takes 15 us (the embedding-bag forward at 1Mx64 bag 4) therefore leaves about 2 us for the kernel itself.
"""

import torch
import triton
import triton.language as tl

from runtime.benchmark.timing import gpu_time_ms


@triton.jit
def _store_one(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


def main() -> None:
    x = torch.zeros(1024, device="cuda")
    for name, fn in {"empty triton kernel": lambda: _store_one[(1,)](x), "zero_ 4 KB": x.zero_}.items():
        times, captured = gpu_time_ms(fn, x.device)
        print(f"{name:24s} median {1e3 * times['median']:.2f} us  p20 {1e3 * times['p20']:.2f}  graph {captured}")


if __name__ == "__main__":
    main()
