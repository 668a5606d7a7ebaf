"""Does the benchmark's L2 flush clear lines loaded with the evict-last hint? Forward rows timed after each flush.

    bash .device/gpu python scripts/l2_flush_check.py [--rounds 5]

Each row is timed as the benchmark times GPU time (CUDA-graph replays, the flush before each, median), once per flush
in every round: "plain" reads the flush buffer with ordinary loads (a torch.sum, the benchmark's flush before session
27), "evict-last" reads it with the evict-last hint (runtime.benchmark.timing.L2Flusher's default). A kernel whose
loads carry the evict-last hint (the SwiGLU forward's "evict-last loads" row, torch.compile's reductions in their
first pass) that runs faster after the plain flush than after the evict-last one found part of its inputs still in
L2: the plain flush did not flush them. Rows whose kernels load without hints should not care which flush ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from swiglu_launch_sweep import forward_hinted  # noqa: E402

from runtime.accelerators import l2norm  # noqa: E402
from runtime.accelerators.l2norm.reference import l2norm_reference  # noqa: E402
from runtime.benchmark.timing import L2Flusher, gpu_time_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    g, u = (torch.randn(8192, 4096, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(32768, 4096, device=device, dtype=torch.bfloat16)
    compiled_swiglu = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
    compiled_l2norm = torch.compile(l2norm_reference, dynamic=False)
    evict_last_loads = forward_hinted("evict_last", "")
    no_hints = forward_hinted("", "")
    rows = {
        "swiglu no hints": lambda: no_hints(g, u),
        "swiglu evict-last loads": lambda: evict_last_loads(g, u),
        "swiglu torch.compile": lambda: compiled_swiglu(g, u),
        "l2norm product (triton)": lambda: l2norm(x, backend="triton"),
        "l2norm torch.compile": lambda: compiled_l2norm(x),
    }
    flushes = {"plain": L2Flusher(device, evict_last=False), "evict-last": L2Flusher(device)}
    times = {(row, flush): [] for row in rows for flush in flushes}
    with torch.no_grad():
        for fn in rows.values():
            fn()
        for _ in range(args.rounds):
            for row, fn in rows.items():
                for name, flush in flushes.items():
                    times[row, name].append(1e3 * gpu_time_ms(fn, device, flush=flush)[0]["median"])
    print(f"{torch.cuda.get_device_name()}, GPU us: median of {args.rounds} rounds (fastest), after each flush")
    print(f"  {'row':28s} {'plain flush':>20s} {'evict-last flush':>20s}")
    for row in rows:
        cells = [f"{statistics.median(times[row, f]):9.2f} ({min(times[row, f]):7.2f})" for f in flushes]
        print(f"  {row:28s} {cells[0]:>20s} {cells[1]:>20s}")


if __name__ == "__main__":
    main()
