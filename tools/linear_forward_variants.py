"""Times linear's Triton forward variants side by side on one GPU: torch eager (cuBLAS, then the activation), the
portable kernel, and the op's own choice, the Hopper persistent TMA kernel with its default tiles (tile loop flattened or nested, the epilogue whole or in two column halves), and with
128 x 256 tiles at 3 stages. bf16 inference (no saved pre-activation), every shape of the linear benchmark.
Usage (GPU machine): python tools/linear_forward_variants.py [--shapes NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from runtime.accelerators.linear import triton as linear_triton
from runtime.accelerators.linear import triton_persistent
from runtime.accelerators.linear.launch import GemmConfig, persistent_forward_config
from runtime.accelerators.linear.reference import linear_reference
from runtime.benchmark.ops.linear import SHAPES
from runtime.benchmark.timing import gpu_time_ms


def persistent(x, w, b, activation, cfg=None, flatten=True, subtile=False):
    swiglu = activation == "swiglu"
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    z = torch.empty(0, device=x.device, dtype=x.dtype)
    triton_persistent.launch(x, w, b, y, z, activation, False, cfg, flatten, subtile)
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
        wide = GemmConfig(128, 256, persistent_forward_config(m, n, k).block_k, 8, 3, 8)
        out["persistent 128x256x3"] = lambda x, w, b: persistent(x, w, b, activation, cfg=wide)
    return out


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
            try:
                diff = (fn(x, w, b).float() - expected).abs().max().item()
                times, _ = gpu_time_ms(functools.partial(fn, x, w, b), device)
            except Exception as error:  # a variant that does not compile or launch is a finding, not a stop
                print(f"| {name} | {label} | failed: {type(error).__name__}: {str(error)[:120]} | | |", flush=True)
                continue
            us = times["median"] * 1e3
            eager_us = eager_us or us
            results.append({"shape": name, "variant": label, "median_us": us, "max_abs_diff": diff})
            print(f"| {name} | {label} | {us:.1f} | {eager_us / us:.2f}x | {diff:.3g} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
