"""Times linear's Triton forward variants side by side on one GPU: torch eager (cuBLAS, then the activation), the
portable kernel, and the op's own choice, the Hopper persistent TMA kernel with its default tiles (tile loop flattened
or nested, the epilogue whole or in two column halves), with 128 x 256 tiles at 3 stages, and with two stages and the
epilogue in halves, one and two programs an SM. bf16 inference (no saved pre-activation), every shape of the linear
benchmark.
Usage (GPU machine): python tools/linear_forward_variants.py [--shapes NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
from variant_timing import time_variant, write_json

from runtime.accelerators.linear import triton as linear_triton
from runtime.accelerators.linear import triton_persistent
from runtime.accelerators.linear.launch import GemmConfig, persistent_forward_config
from runtime.accelerators.linear.reference import linear_reference
from runtime.benchmark.ops.linear import SHAPES


def persistent(x, w, b, activation, cfg=None, flatten=True, subtile=False, per_sm=1):
    swiglu = activation == "swiglu"
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    z = torch.empty(0, device=x.device, dtype=x.dtype)
    triton_persistent.launch(x, w, b, y, z, activation, False, cfg, flatten, subtile, per_sm)
    return y


def variants(activation: str, m: int, k: int, n: int):
    out = {
        "torch eager": lambda x, w, b: linear_reference(x, w, b, activation),
        "portable": lambda x, w, b: linear_triton.infer(x, w, b, activation, persistent=False),
        "op (its selection)": lambda x, w, b: linear_triton.infer(x, w, b, activation),
        "persistent flat": lambda x, w, b: persistent(x, w, b, activation),
        "persistent nested": lambda x, w, b: persistent(x, w, b, activation, flatten=False),
        "persistent subtiled": lambda x, w, b: persistent(x, w, b, activation, subtile=True),
    }
    if activation != "swiglu":
        default = persistent_forward_config(m, n, k)
        wide = GemmConfig(128, 256, default.block_k, 8, 3, 8)
        out["persistent 128x256x3"] = lambda x, w, b: persistent(x, w, b, activation, cfg=wide)
        # two programs an SM: two stages and the halved epilogue (about 100 registers) leave room for a second
        two = GemmConfig(default.block_m, default.block_n, default.block_k, 8, 2, 8)
        out["persistent 2/SM subtiled 2 stages"] = lambda x, w, b: persistent(
            x, w, b, activation, cfg=two, subtile=True, per_sm=2
        )
        out["persistent subtiled 2 stages"] = lambda x, w, b: persistent(x, w, b, activation, cfg=two, subtile=True)
    return out


def _record_diff(diffs: list, expected, y) -> None:
    """A check that never fails: it records y's largest difference from torch eager's result."""
    diffs.append((y.float() - expected).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    print("| shape | variant | median us | vs torch eager | max abs diff vs eager |")
    print("|---|---|---:|---:|---:|")
    for name in args.shapes:
        m, k, rows, activation = SHAPES[name]
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = (torch.randn(rows, k, device=device) / k**0.5).to(torch.bfloat16)
        b = torch.randn(rows, device=device, dtype=torch.bfloat16)
        expected = linear_reference(x, w, b, activation).float()
        eager_us = None
        for label, fn in variants(activation, m, k, rows).items():
            diffs = []
            ms = time_variant(
                name, label, functools.partial(fn, x, w, b), check=functools.partial(_record_diff, diffs, expected)
            )
            if ms is None:
                continue
            us, diff = ms * 1e3, diffs[0]
            eager_us = eager_us or us
            results.append({"shape": name, "variant": label, "median_us": us, "max_abs_diff": diff})
            print(f"| {name} | {label} | {us:.1f} | {eager_us / us:.2f}x | {diff:.3g} |", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
