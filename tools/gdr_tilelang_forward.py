"""Times the TileLang chunked gated-delta-rule forward two ways side by side on one GPU: the state walk storing the
states and an output kernel over every chunk (the default), and the walk computing the output itself; the Triton
forward beside them. Also each way's kernels alone (prepare, walk, output) through the profiler. bf16, l2norm in the
kernel, the chunked shapes of the gated_delta_rule benchmark.
Usage (GPU machine): python tools/gdr_tilelang_forward.py [--json PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from variant_timing import time_variant, write_json

from runtime.accelerators.gated_delta_rule import tilelang as gdr_tilelang
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.benchmark.ops.gated_delta_rule import SHAPES


def kernel_times_us(fn) -> dict[str, float]:
    """GPU microseconds per kernel name of one call (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    print("| shape | forward | median ms | kernels (us) |")
    print("|---|---|---:|---|")
    for name, shape in SHAPES.items():
        B, T, H, HV, K, V, packed = shape
        torch.manual_seed(0)
        bf16 = dict(device=device, dtype=torch.bfloat16)
        x = [
            torch.randn(B, T, H, K, **bf16),
            torch.randn(B, T, H, K, **bf16),
            torch.randn(B, T, HV, V, **bf16),
            F.logsigmoid(torch.randn(B, T, HV, device=device) + 2.0).to(torch.bfloat16),
            torch.rand(B, T, HV, **bf16),
        ]
        cu_seqlens = torch.tensor([0, T]) if packed else None  # one sequence, boundaries on the host
        rest = (K**-0.5, None, False, True, cu_seqlens)
        ways = {
            "tilelang, output kernel": functools.partial(gdr_tilelang.chunk_forward, *x, *rest),
            "tilelang, output in the walk": functools.partial(gdr_tilelang.chunk_forward, *x, *rest, fused_output=True),
            "triton": functools.partial(gdr_triton.chunk_forward, *x, *rest),
        }
        for label, fn in ways.items():
            ms = time_variant(name, label, fn)
            if ms is None:
                continue
            kernels = kernel_times_us(fn)
            results.append({"shape": name, "forward": label, "median_ms": ms, "kernels_us": kernels})
            listed = ", ".join(f"{k[:28]} {v:.0f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
            print(f"| {name} | {label} | {ms:.3f} | {listed} |", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
