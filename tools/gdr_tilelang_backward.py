"""Times the chunked gated-delta-rule forward + backward of the TileLang and Triton backends side by side on one GPU,
through the public op (bf16, l2norm in the kernel, the chunked shapes of the gated_delta_rule benchmark, the
benchmark's inputs): forward and forward + backward GPU times, and each kernel of the backward alone through the
profiler (forward + backward minus the forward, per kernel name: the backward's rerun of the forward's state walk
shows as the walk's second call).
Usage (GPU machine): python tools/gdr_tilelang_backward.py [--backends tilelang,triton] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
from variant_timing import kernel_launches_us  # tools/ is on sys.path when run as a script

from runtime.accelerators import use_accelerators
from runtime.benchmark.ops.gated_delta_rule import CASES, NAMES
from runtime.benchmark.timing import gpu_time_ms


def kernel_times_us(fn) -> dict[str, float]:
    """GPU microseconds per kernel name over one call (a kernel launched several times summed)."""
    totals: dict[str, float] = {}
    for name, us in kernel_launches_us(fn):
        totals[name] = totals.get(name, 0.0) + us
    return totals


def calls(case, backend: str, device: torch.device):
    """(forward, forward + backward) of the benchmark's case on backend, on fresh inputs."""
    inputs = case.make_inputs(device, torch.bfloat16)
    args = [inputs[n] for n in NAMES]
    grad_o = torch.randn_like(inputs["v"])

    def forward():
        with torch.no_grad():
            return case.run(backend, inputs)

    def forward_backward():
        return torch.autograd.grad(case.run(backend, inputs), args, grad_o)

    return forward, forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tilelang,triton")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    print("| shape | backend | fwd ms | fwd+bwd ms | backward kernels (us, fwd+bwd minus fwd) |")
    print("|---|---|---:|---:|---|")
    for case in (case for case in CASES if case.shape.startswith("chunk-")):
        name = case.shape.removeprefix("chunk-")
        for backend in args.backends.split(","):
            torch.manual_seed(0)
            try:
                with use_accelerators(fallback="error"):  # a backend that cannot run fails here, never falls back
                    forward, forward_backward = calls(case, backend, device)
                    fwd, _ = gpu_time_ms(forward, device)
                    both, _ = gpu_time_ms(forward_backward, device)
                    fwd_kernels, both_kernels = kernel_times_us(forward), kernel_times_us(forward_backward)
            except Exception as error:  # a backend that fails is a finding, not a stop
                print(f"| {name} | {backend} | failed: {type(error).__name__}: {str(error)[:120]} | | |", flush=True)
                continue
            backward = {k: t - fwd_kernels.get(k, 0.0) for k, t in both_kernels.items()}
            backward = {k: t for k, t in sorted(backward.items(), key=lambda kv: -kv[1]) if t > 0.5}
            results.append({
                "shape": name, "backend": backend, "forward_ms": fwd["median"], "forward_backward_ms": both["median"],
                "forward_kernels_us": fwd_kernels, "forward_backward_kernels_us": both_kernels,
                "backward_kernels_us": backward,
            })  # fmt: skip
            listed = ", ".join(f"{k[:32]} {t:.0f}" for k, t in backward.items())
            print(f"| {name} | {backend} | {fwd['median']:.3f} | {both['median']:.3f} | {listed} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
