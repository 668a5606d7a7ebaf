"""Block sizes and warps of the Triton SwiGLU kernels at 8192 x 4096 bf16, beside torch.compile, on the GPU.

    bash .device/gpu python scripts/swiglu_launch_sweep.py [--rounds 7]
    bash .device/gpu ncu --cache-control all --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python scripts/swiglu_launch_sweep.py --launch-once

Each candidate launches runtime.accelerators.swiglu.triton's forward (and, for forward+backward, its backward after
it) with one (block, warps) pair; torch.compile of silu(g) * u (static shapes, as a one-shape benchmark run compiles
it) runs its forward, and its forward+backward through torch.autograd.grad. GPU time as the benchmark takes it
(CUDA-graph replays, L2 flushed first), median over interleaved rounds (fastest round).

The rows after the launches: forward only, at the product's block and warps, with 32-bit element offsets (the
product kernel computes them in 64 bits, so that tensors past 2^31 elements stay addressable) and the cache hints
named (on the loads of g and u, or on the store of y); "int32 offsets" has the product's hints.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runtime.accelerators.swiglu import triton as kernels
from runtime.benchmark.timing import gpu_time_ms

CANDIDATES = [(4096, 8), (2048, 4), (4096, 4), (8192, 8), (8192, 16), (16384, 16), (1024, 4), (512, 4), (512, 2), (2048, 8)]


@triton.jit
def _forward_hinted(g_ptr, u_ptr, y_ptr, BLOCK: tl.constexpr, LOAD_POLICY: tl.constexpr, STORE_CACHE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + offs, eviction_policy=LOAD_POLICY).to(tl.float32)
    u = tl.load(u_ptr + offs, eviction_policy=LOAD_POLICY).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), cache_modifier=STORE_CACHE)


def forward_hinted(load_policy: str, store_cache: str):
    def run(g, u):
        y = torch.empty_like(g)
        n = g.numel()
        assert n % kernels.BLOCK == 0 and n < 2**31
        _forward_hinted[(n // kernels.BLOCK,)](
            g, u, y, BLOCK=kernels.BLOCK, LOAD_POLICY=load_policy, STORE_CACHE=store_cache, num_warps=kernels.WARPS
        )
        return y

    return run


HINTED = {
    "int32 offsets": (kernels.FORWARD_LOAD_POLICY.value, ""),
    "no hints (before s27)": ("", ""),
    "evict-first loads": ("evict_first", ""),
    "write-back .wb store": ("", ".wb"),
}


def with_matmul(g, u, device, rounds: int) -> None:
    """The forward then y @ w, one CUDA graph per pair: whether a forward's gain survives what runs after it (the
    evict-last loads leave more of y dirty in L2 when the forward ends; the matmul reads y)."""
    w = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16) / 64
    compiled = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
    no_hints = forward_hinted("", "")
    pairs = {
        "product (evict-last loads)": lambda: kernels.forward(g, u) @ w,
        "no hints (before s27)": lambda: no_hints(g, u) @ w,
        "torch.compile": lambda: compiled(g, u) @ w,
        "matmul alone": lambda: g @ w,
    }
    times = {label: [] for label in pairs}
    with torch.no_grad():
        for fn in pairs.values():
            fn()
        for _ in range(rounds):
            for label, fn in pairs.items():
                times[label].append(1e3 * gpu_time_ms(fn, device)[0]["median"])
    print(f"{torch.cuda.get_device_name()}, swiglu 8192x4096 bf16 then @ [4096, 1024], GPU us: median of {rounds} rounds")
    for label, samples in times.items():
        print(f"  {label:28s} {statistics.median(samples):7.2f} ({min(samples):7.2f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--with-matmul", action="store_true", help="time the forward followed by a down projection "
                        "(8192x4096 @ 4096x1024), as in a model: the product, the forward without hints, torch.compile")
    parser.add_argument("--launch-once", action="store_true", help="launch the product forward and the hinted forwards "
                        "once each, time nothing (for ncu --cache-control all: DRAM bytes per variant)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda")
    g, u, dy = (torch.randn(8192, 4096, device=device, dtype=torch.bfloat16) for _ in range(3))
    if args.launch_once:
        kernels.forward(g, u)
        for hints in HINTED.values():
            forward_hinted(*hints)(g, u)
        torch.cuda.synchronize()
        return
    if args.with_matmul:
        return with_matmul(g, u, device, args.rounds)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    compiled = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
    expect = F.silu(g.double()) * u.double()

    def ours(block, warps, backward):
        def run():
            y = kernels.forward(g, u, block, warps)
            return kernels.backward(dy, g, u, y, block, warps) if backward else y

        return run

    cases = {"torch.compile": (lambda: compiled(g, u), lambda: torch.autograd.grad(compiled(gr, ur), (gr, ur), dy))}
    for block, warps in CANDIDATES:
        label = f"block {block} x {warps} warps"
        error = ((kernels.forward(g, u, block, warps).double() - expect).norm() / expect.norm()).item()
        assert error < 1e-2, f"{label}: relative error {error:.1e}"
        cases[label] = (ours(block, warps, False), ours(block, warps, True))
    for label, hints in HINTED.items():
        run = forward_hinted(*hints)
        error = ((run(g, u).double() - expect).norm() / expect.norm()).item()
        assert error < 1e-2, f"{label}: relative error {error:.1e}"
        cases[label] = (lambda run=run: run(g, u), None)
    times = {label: ([], []) for label in cases}
    with torch.no_grad():
        compiled(g, u)
    for _ in range(args.rounds):
        for label, (forward, forward_backward) in cases.items():
            with torch.no_grad():
                times[label][0].append(1e3 * gpu_time_ms(forward, device)[0]["median"])
            if forward_backward is not None:
                times[label][1].append(1e3 * gpu_time_ms(forward_backward, device)[0]["median"])
    print(f"{torch.cuda.get_device_name()}, swiglu 8192x4096 bf16, GPU us: median of {args.rounds} rounds (fastest)")
    for label, (fwd, fwd_bwd) in times.items():
        line = f"  {label:26s} fwd {statistics.median(fwd):7.2f} ({min(fwd):7.2f})"
        if fwd_bwd:
            line += f"  fwd+bwd {statistics.median(fwd_bwd):7.2f} ({min(fwd_bwd):7.2f})"
        print(line)


if __name__ == "__main__":
    main()
