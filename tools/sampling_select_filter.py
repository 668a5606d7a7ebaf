"""Times top_k's select with and without its threshold filter, both kernel backends beside torch.topk, on one GPU,
and the Triton filter kernel's other launches and its full-tile formulation (FILTER_LAUNCHES), at the top_k shapes of
the sampling benchmark plus a wide-k case (k = 2048) and an all-equal row (every entry passes the bound, so each
program falls back to the select over its whole segment). Each result is checked against torch.topk's values first;
each timed variant's kernels are listed with their GPU times (the passes of a select: where its time goes).
Usage (GPU machine): python tools/sampling_select_filter.py [--cases NAME ...] [--variants LABEL ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
from variant_timing import kernel_launches_us, time_variant, write_json

from runtime.accelerators.sampling import tilelang as sampling_tilelang
from runtime.accelerators.sampling import triton as sampling_triton
from runtime.benchmark.ops.sampling import TOP_K_SHAPES

CASES = {
    **{name: (rows, width, k, "randn") for name, (rows, width, k) in TOP_K_SHAPES.items()},
    "1x16M-k2048-f32": (1, 2**24, 2048, "randn"),
    "64x1M-k64-all-equal": (64, 2**20, 64, "ones"),
}


# the filter kernel's launches beside its default (4096-entry steps, 16 warps, no pipeline); registers per thread
# on sm_90 (bf16, k = 64): 125 pipelined, 64 at 32 warps (8192 steps: 32 B of spills), 194 at 8 warps pipelined.
# Then its full-tile formulation (tiles per iteration; aligned rows, no spills): 128 (bf16 and fp32) at 16 warps
# and 4 tiles, 189 / 195 at 8 warps and 2 tiles, 216 / 240 at 8 warps and 4 tiles
FILTER_LAUNCHES = [
    sampling_triton.FilterLaunch(stages=2),
    sampling_triton.FilterLaunch(warps=32),
    sampling_triton.FilterLaunch(step=8192, warps=32),
    sampling_triton.FilterLaunch(warps=8, stages=2),
    sampling_triton.FilterLaunch(tiles=4),
    sampling_triton.FilterLaunch(warps=8, tiles=2),
    sampling_triton.FilterLaunch(warps=8, tiles=4),
]


def _label(launch) -> str:
    tiles = "" if launch.tiles is None else f"/{launch.tiles}t"
    return f"triton filter {launch.step or sampling_triton.BLOCK}/{launch.warps}w/{launch.stages}st{tiles}"


def _triton_launch(x, k, launch):
    return sampling_triton.top_k_forward(x, k, True, filter_launch=launch)


def variants():
    return {
        "torch.topk": lambda x, k: torch.topk(x, k, dim=-1),
        "triton filter": lambda x, k: sampling_triton.top_k_forward(x, k, True, filter=True),
        "triton no filter": lambda x, k: sampling_triton.top_k_forward(x, k, True, filter=False),
        **{_label(launch): functools.partial(_triton_launch, launch=launch) for launch in FILTER_LAUNCHES},
        "tilelang filter": lambda x, k: sampling_tilelang.top_k_forward(x, k, True, filter=True),
        "tilelang no filter": lambda x, k: sampling_tilelang.top_k_forward(x, k, True, filter=False),
    }


def _check(expected, result):
    return None if torch.equal(result[0].sort(dim=-1).values, expected) else "wrong values"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--variants", nargs="*", default=None, help="labels to time (default: all); torch.topk always")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chosen = {
        label: fn
        for label, fn in variants().items()
        if label == "torch.topk" or not args.variants or label in args.variants
    }
    unknown = set(args.variants or ()) - set(variants())
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(variants())}")
    device = torch.device("cuda")
    results = []
    print("| case | variant | median ms | vs torch.topk | kernels in launch order (us) |")
    print("|---|---|---:|---:|---|")
    for name in args.cases:
        rows, width, k, fill = CASES[name]
        torch.manual_seed(0)
        dtype = torch.float32 if name.endswith("f32") else torch.bfloat16
        x = (
            torch.randn(rows, width, device=device, dtype=dtype)
            if fill == "randn"
            else torch.ones(rows, width, device=device, dtype=dtype)
        )
        expected = torch.topk(x, k, dim=-1).values.sort(dim=-1).values
        topk_ms = None
        for label, fn in chosen.items():
            call = functools.partial(fn, x, k)
            ms = time_variant(name, label, call, check=functools.partial(_check, expected))
            if ms is None:
                continue
            topk_ms = topk_ms or ms
            kernels = kernel_launches_us(call)
            results.append({"case": name, "variant": label, "median_ms": ms, "kernels_us": kernels})
            listed = ", ".join(f"{kernel[:28]} {us:.0f}" for kernel, us in kernels)
            print(f"| {name} | {label} | {ms:.3f} | {topk_ms / ms:.2f}x | {listed} |", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
