"""What a Python backward costs an eager forward+backward call on the GPU machine, against native autograd nodes.

    bash .device/gpu python scripts/autograd_overhead.py

Microseconds per call (back to back, synchronised once) of torch.autograd.grad over small CUDA tensors, for native
ops, trivial autograd.Functions (one launch each way), the public BCE / LayerNorm ops, and two ways to hand autograd
a gradient the forward already computed: a Python backward that multiplies it by the incoming gradient, and native
ops whose backward does the same (no Python runs in backward).
"""

import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from runtime.accelerators import binary_cross_entropy_with_logits, layer_norm
from runtime.accelerators.bce import triton as bce_triton


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


class PrecomputedGrad(torch.autograd.Function):
    """The loss and its unit gradient from the forward; backward scales the saved gradient (one ATen op)."""

    @staticmethod
    def forward(ctx, x, y, fused):
        loss, unit = fused_forward(x, y) if fused else loss_and_unit_grad(x, y)
        ctx.save_for_backward(unit)
        return loss

    @staticmethod
    def backward(ctx, g):
        (unit,) = ctx.saved_tensors
        return g * unit, None, None


ONE = None


def loss_and_unit_grad(x, y):
    """Stands in for a fused forward: the forward kernel, then the backward kernel with an incoming gradient of one."""
    x0, y0 = x.detach(), y.detach()
    loss = bce_triton.forward(x0, y0, None, None, "mean", False)
    unit = bce_triton.backward(ONE, x0, y0, None, None, "mean", False, loss)[0]
    return loss, unit


def fused_forward(x, y):
    """The host cost of a forward kernel that also writes the unit gradient: one launch, one more allocation (the
    gradient it returns is not computed: timing only)."""
    x0 = x.detach()
    return bce_triton.forward(x0, y.detach(), None, None, "mean", False), torch.empty_like(x0)


def native_backward_bce(x, y, fused=False):
    """loss + (x - x.detach()) . unit: the value is the loss (the product is exactly zero for finite x), the
    gradient of x is g * unit, and every backward node is a native one."""
    loss, unit = fused_forward(x, y) if fused else loss_and_unit_grad(x, y)
    zero = x - x.detach()
    return torch.addmv(loss.view(1), zero.view(1, -1), unit).view(())


def main() -> None:
    global ONE
    ONE = torch.ones((), device="cuda")
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
                "precomputed (2 launches), Python bwd": lambda: grad(PrecomputedGrad.apply(x, y, False)),
                "precomputed (2 launches), native bwd": lambda: grad(native_backward_bce(x, y)),
                "fused stand-in, Python bwd": lambda: grad(PrecomputedGrad.apply(x, y, True)),
                "fused stand-in, native bwd": lambda: grad(native_backward_bce(x, y, True)),
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
    check_x = (3 * torch.randn(4096, device="cuda")).requires_grad_()
    check_y = torch.rand(4096, device="cuda")
    expected = F.binary_cross_entropy_with_logits(check_x, check_y)
    ref = torch.autograd.grad(expected, [check_x])[0]
    out = native_backward_bce(check_x, check_y)
    got = torch.autograd.grad(out, [check_x])[0]
    print("native-backward trick: loss diff", (out - expected).abs().item(), "grad max diff", (got - ref).abs().max().item())


if __name__ == "__main__":
    main()
