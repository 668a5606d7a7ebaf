"""Times linear's backward piece by piece beside eager torch's, on one GPU: where forward+backward loses to torch.

Per GELU shape of the linear benchmark (bf16; --shapes chooses): torch's GELU backward plus its dbias column sum,
our elementwise pass (d_preact and dbias partial sums in one pass) at several launches,
the two backward GEMMs (dx = d_preact @ w, dw = d_preact^T @ x), and each whole backward: ours
(`linear.triton.backward`) and eager torch's (autograd through F.linear and the activation).
Usage (GPU machine): python tools/linear_backward_pieces.py [--shapes NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from variant_timing import time_variant, write_json

from runtime.accelerators.linear import triton as linear_triton
from runtime.accelerators.linear.launch import ROW_GROUPS, BackwardLaunch
from runtime.accelerators.linear.reference import linear_reference
from runtime.benchmark.ops.linear import SHAPES

GELU_SHAPES = [name for name in SHAPES if name.endswith("-gelu")]
PASS_LAUNCHES = (
    BackwardLaunch(),
    BackwardLaunch(ROW_GROUPS * 4),
    BackwardLaunch(ROW_GROUPS, block_m=16),
    BackwardLaunch(ROW_GROUPS, block_m=64, num_warps=8),
    BackwardLaunch(ROW_GROUPS, num_warps=8),
)


def torch_gelu_backward(dy, z):
    """Eager torch's backward of GELU and of the bias: the gradient at z and its column sum."""
    dz = torch.ops.aten.gelu_backward(dy, z)
    return dz, dz.sum(0)


def torch_whole_backward(x, w, b, dy, activation):
    """Eager torch's backward alone: the autograd graph is recorded once and replayed by each call."""
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = linear_reference(x, w, b, activation)
    return lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)


def pieces(m, k, n, device, activation="gelu"):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device=device, dtype=torch.bfloat16)
    z = F.linear(x, w, b)
    y = linear_reference(x, w, b, activation)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    dz, _ = linear_triton.preact_gradient(dy, z, y, activation, True)
    variants = {
        "torch: gelu backward + dbias sum": lambda: torch_gelu_backward(dy, z),
        **{
            f"ours: elementwise pass, {launch}": functools.partial(
                linear_triton.preact_gradient, dy, z, y, activation, True, launch
            )
            for launch in PASS_LAUNCHES
        },
        "dx = d_preact @ w (cuBLAS)": lambda: torch.matmul(dz, w),
        "dw = d_preact^T @ x (cuBLAS)": lambda: torch.matmul(dz.t(), x),
        "torch: whole backward (autograd)": torch_whole_backward(x, w, b, dy, activation),
        "ours: whole backward": lambda: linear_triton.backward(dy, x, w, b, activation, y, z),
    }
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=GELU_SHAPES, choices=GELU_SHAPES)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    print("| shape | piece | median us |")
    print("|---|---|---:|")
    for name in args.shapes:
        m, k, n, _ = SHAPES[name]
        for label, fn in pieces(m, k, n, torch.device("cuda")).items():
            ms = time_variant(name, label, fn)
            if ms is not None:
                results.append({"shape": name, "piece": label, "median_us": ms * 1e3})
                print(f"| {name} | {label} | {ms * 1e3:.1f} |", flush=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
