"""What a Python backward costs an eager forward+backward call on the GPU machine, against native autograd nodes.

    bash .device/gpu python scripts/autograd_overhead.py [--profile]

--bce-lean: instead, the BCE forward+backward at 256 / 4096 fp32 logits against two leaner ways to carry the gradient its
forward writes (GRAD_IN_FORWARD_MAX_NUMEL): an autograd.Function that calls the Triton module's forward itself and saves
only that gradient (what KernelOp's generic path costs on top), and, for timing only (its value is not the loss), one
native addmv node whose backward multiplies by that gradient in C++ (no Python in backward).

--profile: instead, cProfile of the Triton BCE forward+backward at 256 logits on one thread (the engine's device
threads off, so that the profiler sees the backward too), top functions by own time.

Microseconds per call of torch.autograd.grad over small CUDA tensors (medians over rounds in which the cases take
turns; calls back to back, synchronised once per case and round): native ops, a trivial autograd.Function (one launch
each way: the floor of a Python backward), the public BCE and LayerNorm ops; with the autograd engine's device
threads (the default) and without (torch.autograd.set_multithreading_enabled(False): backward on the calling thread).

Session 15's second run (results/autograd-overhead-2026-11-23-h100-s15-run2.txt) also timed stand-ins for a BCE
forward that writes the logits' gradient: with a Python backward scaling it, 288 / 251 us at 256 / 4096 logits
against 384 / 346 (two launch paths) and torch eager's 286 / 271; with native autograd ops carrying it (no Python in
backward: loss + (x - x.detach()) . gradient), 424 us: slower. The first became bce's GRAD_IN_FORWARD_MAX_NUMEL path.
"""

import cProfile
import pstats
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from runtime.accelerators import binary_cross_entropy_with_logits, layer_norm


def per_call_us(cases: dict, rounds: int = 15, calls: int = 500) -> dict:
    """Median over rounds of us per call; the cases take turns within each round, so that a slow spell of the
    host falls on all of them."""
    for fn in cases.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            samples[name].append(1e6 * (time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_profile(fn, calls: int = 3000, top: int = 22) -> None:
    """cProfile of `calls` back-to-back calls of fn (synchronised at the end), the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


class SumThenScale(torch.autograd.Function):
    """One launch forward (sum), one launch backward (g * x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x


def profile_bce() -> None:
    torch.autograd.set_multithreading_enabled(False)
    x = (3 * torch.randn(256, device="cuda")).requires_grad_()
    y = torch.rand(256, device="cuda")
    g = torch.randn((), device="cuda")

    def step():
        torch.autograd.grad(binary_cross_entropy_with_logits(x, y, backend="triton"), [x], g)

    for _ in range(100):
        step()
    print_profile(step, top=35)


class LeanBCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        from runtime.accelerators.bce import triton as kernels

        loss, unit = kernels.forward(x, y, None, None, "mean", False, True)
        ctx.save_for_backward(unit)
        return loss

    @staticmethod
    def backward(ctx, g):
        (unit,) = ctx.saved_tensors
        return torch.mul(unit, g), None


def addmv_stand_in(x, y):
    """Our forward kernel, then one addmv node carrying its gradient: loss + unit . x (timing only)."""
    from runtime.accelerators.bce import triton as kernels

    loss, unit = kernels.forward(x.detach(), y, None, None, "mean", False, True)
    return torch.addmv(loss.view(1), unit.view(1, -1), x.view(-1)).view(())


def bce_lean() -> None:
    for n in (256, 4096):
        x = (3 * torch.randn(n, device="cuda")).requires_grad_()
        y = torch.rand(n, device="cuda")
        g = torch.ones((), device="cuda")
        grad = lambda out: torch.autograd.grad(out, [x], g)  # noqa: E731
        expected = grad(F.binary_cross_entropy_with_logits(x, y))[0]
        for name, fn in (("lean", LeanBCE.apply), ("addmv", addmv_stand_in)):
            assert torch.allclose(grad(fn(x, y))[0], expected, rtol=1e-5, atol=1e-7), name
        cases = {
            "native F.bce fwd+bwd": lambda: grad(F.binary_cross_entropy_with_logits(x, y)),
            "ours triton fwd+bwd": lambda: grad(binary_cross_entropy_with_logits(x, y, backend="triton")),
            "lean Function fwd+bwd": lambda: grad(LeanBCE.apply(x, y)),
            "addmv stand-in fwd+bwd": lambda: grad(addmv_stand_in(x, y)),
            "Function sum/scale fwd+bwd": lambda: grad(SumThenScale.apply(x)),
        }
        for name, us in per_call_us(cases).items():
            print(f"bce {n:5d} {name:40s} {us:8.1f}", flush=True)


def main() -> None:
    if "--bce-lean" in sys.argv:
        bce_lean()
        return
    if "--profile" in sys.argv:
        profile_bce()
        return
    print("threads:", [t.name for t in threading.enumerate()], "switch interval", sys.getswitchinterval())
    for multithreaded in (True, False):
        torch.autograd.set_multithreading_enabled(multithreaded)
        print(f"--- autograd multithreading {multithreaded}: median over rounds, us per call")
        for n in (256, 4096):
            x = (3 * torch.randn(n, device="cuda")).requires_grad_()
            y = torch.rand(n, device="cuda")
            g = torch.randn((), device="cuda")
            grad = lambda out: torch.autograd.grad(out, [x], g)  # noqa: E731
            cases = {
                "native F.bce fwd+bwd": lambda: grad(F.binary_cross_entropy_with_logits(x, y)),
                "Function sum/scale fwd+bwd": lambda: grad(SumThenScale.apply(x)),
                "ours triton fwd+bwd": lambda: grad(binary_cross_entropy_with_logits(x, y, backend="triton")),
                "ours tilelang fwd+bwd": lambda: grad(binary_cross_entropy_with_logits(x, y, backend="tilelang")),
            }
            for name, us in per_call_us(cases).items():
                print(f"bce {n:5d} {name:40s} {us:8.1f}", flush=True)
        x = torch.randn(8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        cases = {
            "native F.layer_norm fwd": lambda: F.layer_norm(x.detach(), (128,), w.detach(), b.detach()),
            "ours triton fwd": lambda: layer_norm(x.detach(), w.detach(), b.detach(), backend="triton"),
            "native F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x, (128,), w, b), [x, w, b], dy),
            "ours triton fwd+bwd": lambda: torch.autograd.grad(layer_norm(x, w, b, backend="triton"), [x, w, b], dy),
        }
        for name, us in per_call_us(cases).items():
            print(f"ln 8192x128 {name:40s} {us:8.1f}", flush=True)
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
