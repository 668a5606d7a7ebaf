"""Where an eager rms_norm call's host time goes on the GPU machine (the issue's eager-per-call target).

    bash .device/gpu python scripts/eager_overhead.py        # (8192, 128) bf16, weight, x requiring grad

Prints microseconds per call, back to back and synchronised once, for the native op, the public
op on each kernel backend (with and without autograd), the kernel module's forward alone and the
bare kernel launch (direct, and through Triton's JIT path), then a cProfile of the triton path (top functions by own time).
"""

import time

import torch
import torch.nn.functional as F

from runtime.accelerators import layer_norm, rms_norm
from runtime.accelerators.layer_norm import triton as ln_triton
from runtime.accelerators.norms_triton import n_tiles, row_tiles
from runtime.accelerators.rms_norm import triton as rms_triton

from autograd_overhead import print_profile  # scripts/ is on sys.path when a script runs


def per_call_us(fn, calls: int = 5000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    rows, width = 8192, 128
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x0, w0, b0 = x.detach(), w.detach(), b.detach()
    y, rstd = rms_triton.forward(x0, w0, 1e-6)
    dy = torch.randn_like(x0)
    tiles = row_tiles(width)

    def launch(kernel):
        return lambda: kernel[(n_tiles(rows, tiles),)](
            x0, w0, y, rstd, rows, width, width, 1e-6, HAS_W=True, STORE_RSTD=True, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps
        )

    cases = {
        "F.rms_norm (x requires grad)": lambda: F.rms_norm(x, (width,), w, 1e-6),
        "F.rms_norm (no grad)": lambda: F.rms_norm(x0, (width,), w0, 1e-6),
        "rms_norm triton (x requires grad)": lambda: rms_norm(x, w, backend="triton"),
        "rms_norm triton (no grad)": lambda: rms_norm(x0, w0, backend="triton"),
        "rms_norm tilelang (x requires grad)": lambda: rms_norm(x, w, backend="tilelang"),
        "rms_norm tilelang (no grad)": lambda: rms_norm(x0, w0, backend="tilelang"),
        "triton module forward (allocations + launch)": lambda: rms_triton.forward(x0, w0, 1e-6),
        "bare launch, direct (triton_launch.py)": launch(rms_triton._forward_kernel),
        "bare launch, Triton's JIT path": launch(rms_triton._forward_kernel.kernel),
        "torch.empty_like x2": lambda: (torch.empty_like(x0), torch.empty_like(rstd)),
        "F.rms_norm fwd+bwd (autograd.grad)": lambda: torch.autograd.grad(F.rms_norm(x, (width,), w, 1e-6), [x, w], dy),
        "rms_norm triton fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w, backend="triton"), [x, w], dy),
        "rms_norm tilelang fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w, backend="tilelang"), [x, w], dy),
        "triton module backward (allocations + 2 launches)": lambda: rms_triton.backward(dy, x0, w0, 1e-6, y, rstd),
        "F.layer_norm (no grad)": lambda: F.layer_norm(x0, (width,), w0, b0),
        "layer_norm triton (no grad)": lambda: layer_norm(x0, w0, b0, backend="triton"),
        "layer_norm triton module forward": lambda: ln_triton.forward(x0, w0, b0, 1e-5),
        "F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x, (width,), w, b), [x, w, b], dy),
        "layer_norm triton fwd+bwd": lambda: torch.autograd.grad(layer_norm(x, w, b, backend="triton"), [x, w, b], dy),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rms_norm ({rows}, {width}) bf16, us per call")
    for name, fn in cases.items():
        print(f"{name:48s} {per_call_us(fn):8.1f}")
    fwd_bwd = cases["rms_norm triton fwd+bwd"]
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread, where cProfile sees it
        print(f"{'rms_norm triton fwd+bwd, backward on the calling thread':48s} {per_call_us(fwd_bwd):8.1f}")
        print(f"{'F.rms_norm fwd+bwd, backward on the calling thread':48s} {per_call_us(cases['F.rms_norm fwd+bwd (autograd.grad)']):8.1f}")
        for name, fn in {"public op, x requiring grad": lambda: rms_norm(x, w, backend="triton"), "fwd+bwd": fwd_bwd}.items():
            print(f"cProfile of the triton {name}")
            print_profile(fn)


if __name__ == "__main__":
    main()
