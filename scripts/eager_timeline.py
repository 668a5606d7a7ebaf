"""Timeline of one eager forward+backward on the GPU machine, medians over calls in us: the forward, from its return to
the start of the Python backward (torch.autograd.grad's preamble, the engine, the hand-off to its device thread), the
backward's body, and from its end to autograd.grad's return; with the engine's device threads on (the default) and
off. LayerNorm (also without bias) and RMSNorm 8192x128 bf16 and BCE at 4096 logits (ours), a trivial autograd.Function, native ops (totals).

    bash .device/gpu python scripts/eager_timeline.py

Session 18 (results/eager-timeline-2026-11-23-h100-s18.txt): every step is slower with the device threads on (the
hand-off alone costs a trivial Function about 60 us a call); our LayerNorm's forward with grad costs 57-86 us against
a trivial Function's 22-50.
"""

import math
import statistics
import time

import torch
import torch.nn.functional as F

from runtime.accelerators import layer_norm, rms_norm
from runtime.accelerators import binary_cross_entropy_with_logits as bce
from runtime.accelerators.bce import tilelang as bce_tilelang
from runtime.accelerators.bce import triton as bce_triton
from runtime.accelerators.layer_norm import triton as ln_triton
from runtime.accelerators.rms_norm import triton as rms_triton

clock = time.perf_counter
marks = {}


def timed_backward(original):
    def backward(*args):
        marks["b0"] = clock()
        out = original(*args)
        marks["b1"] = clock()
        return out
    return backward


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        marks["b0"] = clock()
        out = g * 2
        marks["b1"] = clock()
        return out


def timeline(forward, inputs, grad, calls=600):
    rows = []
    for i in range(calls):
        marks.clear()
        t0 = clock()
        out = forward()
        t1 = clock()
        torch.autograd.grad(out, inputs, grad)
        t2 = clock()
        if i >= 100:  # nan: the kernel module's backward was not called (a BCE forward that computed the gradient)
            b0, b1 = marks.get("b0", math.nan), marks.get("b1", math.nan)
            rows.append((t1 - t0, b0 - t1, b1 - b0, t2 - b1, t2 - t0))
    torch.cuda.synchronize()
    return [1e6 * statistics.median(col) for col in zip(*rows)]


def main():
    for module in (ln_triton, rms_triton, bce_triton, bce_tilelang):
        module.backward = timed_backward(module.backward)
    logits = (3 * torch.randn(4096, device="cuda")).requires_grad_()
    targets = torch.rand(4096, device="cuda")
    scalar = torch.randn((), device="cuda")
    x = torch.randn(8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    small = torch.randn(4096, device="cuda", requires_grad=True)
    g = torch.randn_like(small)
    cases = {
        "ours triton LN": (lambda: layer_norm(x, w, b, backend="triton"), [x, w, b], dy),
        "ours triton LN, x only": (lambda: layer_norm(x, w.detach(), b.detach(), backend="triton"), [x], dy),
        "ours triton LN, no bias": (lambda: layer_norm(x, w, None, backend="triton"), [x, w], dy),
        "ours triton RMS": (lambda: rms_norm(x, w, backend="triton"), [x, w], dy),
        "trivial Function": (lambda: Scale.apply(small), [small], g),
        "ours triton bce 4096": (lambda: bce(logits, targets, backend="triton"), [logits], scalar),
        "ours tilelang bce 4096": (lambda: bce(logits, targets, backend="tilelang"), [logits], scalar),
    }
    print(f"{'case':28s} {'fwd':>7s} {'to bwd':>7s} {'bwd':>7s} {'back':>7s} {'total':>7s}")
    for mt in (True, False):
        torch.autograd.set_multithreading_enabled(mt)
        print(f"--- multithreading {mt}")
        for rep in range(2):
            for name, (fwd, inputs, grad) in cases.items():
                cols = timeline(fwd, inputs, grad)
                print(f"{name:28s} " + " ".join(f"{c:7.1f}" for c in cols), flush=True)
    # native for reference (total only)
    native = {
        "native LN": lambda: torch.autograd.grad(F.layer_norm(x, (128,), w, b), [x, w, b], dy),
        "native RMS": lambda: torch.autograd.grad(F.rms_norm(x, (128,), w), [x, w], dy),
        "native bce 4096": lambda: torch.autograd.grad(F.binary_cross_entropy_with_logits(logits, targets), [logits], scalar),
    }
    for mt in (True, False):
        torch.autograd.set_multithreading_enabled(mt)
        for name, fn in native.items():
            ts = []
            for i in range(600):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
            print(f"{name} total (MT {mt})", f"{1e6 * statistics.median(ts[100:]):.1f}")


main()
