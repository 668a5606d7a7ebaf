"""Temporary (not for commit): BCE timing on the GPU machine — TB/s vs torch eager / torch.compile, and block sweeps."""

import sys

import torch
import torch.nn.functional as F
import triton

from runtime.accelerators.bce import binary_cross_entropy_with_logits as bce
from runtime.accelerators.bce import triton as tk
from runtime.benchmark.timing import copy_bandwidth_tbs, eager_time_ms, gpu_time_ms

dev = torch.device("cuda")
copy = copy_bandwidth_tbs(dev)
print(f"copy bandwidth {copy:.3f} TB/s", flush=True)


def report(name, fn, nbytes):
    t, graph = gpu_time_ms(fn, dev)
    tbs = nbytes / (t["median"] * 1e-3) / 1e12
    print(f"{name:48s} {t['median'] * 1e3:8.1f} us  {tbs:6.3f} TB/s  {tbs / copy:6.1%} of copy  graph={graph}", flush=True)


n = 2**24
x = (3 * torch.randn(n, device=dev)).requires_grad_()
y = torch.rand(n, device=dev)
impls = {
    "triton": lambda a, b: bce(a, b, backend="triton"),
    "tilelang": lambda a, b: bce(a, b, backend="tilelang"),
    "torch eager": F.binary_cross_entropy_with_logits,
}
fwd_bytes, bwd_bytes = 8 * n + 4, 12 * n + 4

# PCVR batches: eager time per call (launch-bound)
for b in (256, 4096):
    xs = (3 * torch.randn(b, device=dev)).requires_grad_()
    ys = torch.rand(b, device=dev)
    for name, fn in impls.items():
        try:
            ms_f = eager_time_ms(lambda: fn(xs, ys), dev)
            ms_fb = eager_time_ms(lambda: torch.autograd.grad(fn(xs, ys), xs), dev)
            print(f"B={b:5d} eager per call {name:14s} fwd {ms_f * 1e3:7.1f} us  fwd+bwd {ms_fb * 1e3:7.1f} us", flush=True)
        except Exception as error:
            print(name, "failed:", type(error).__name__, str(error)[:300], flush=True)

if "--sweep" not in sys.argv:
    sys.exit(0)

# Triton block sweep: forward (partials + final sum) and backward kernels alone
xd, yd = x.detach(), y
g = torch.ones((), device=dev)
dx = torch.empty_like(xd)
for block, warps in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]:
    grid = triton.cdiv(n, block)
    part = torch.empty(grid, device=dev)
    out = torch.empty((), device=dev)

    def fwd(block=block, warps=warps, grid=grid, part=part, out=out):
        tk._forward_kernel[(grid,)](xd, yd, xd, xd, part, n, 1, 1, 1, 1, W_MODE=0, PW_MODE=0, REDUCE=True, BLOCK=block, num_warps=warps)
        tk._sum_partials_kernel[(1,)](part, out, grid, float(n), BLOCK=1024, num_warps=4)

    def bwd(block=block, warps=warps, grid=grid):
        tk._backward_kernel[(grid,)](g, xd, yd, xd, xd, dx, dx, n, float(n), 1, 1, 1, 1,
                                     W_MODE=0, PW_MODE=0, G_SCALAR=True, TARGETS_GRAD=False, BLOCK=block, num_warps=warps)

    report(f"triton fwd block={block} warps={warps}", fwd, fwd_bytes)
    report(f"triton bwd block={block} warps={warps}", bwd, bwd_bytes)

# TileLang block sweep (module constants patched for this script only)
import tilelang  # noqa: E402

from runtime.accelerators.bce import tilelang as lk  # noqa: E402
from runtime.accelerators.tilelang_common import device_info  # noqa: E402

target = device_info(torch.cuda.current_device()).target
for threads, rows, vec in [(256, 512, 8), (128, 256, 8), (256, 1024, 8), (512, 1024, 8), (256, 256, 16)]:
    lk.THREADS, lk.ROWS, lk.VEC, lk.BLOCK = threads, rows, vec, rows * vec
    try:
        kf = tilelang.compile(lk.forward_func("float32", "float32", "float32", "float32", "float32", 0, 0, True), target=target)
        kb = tilelang.compile(lk.backward_func("float32", "float32", "float32", "float32", "float32", 0, 0, True, False), target=target)
        ks = tilelang.compile(lk.sum_func("float32"), target=target)
    except Exception as error:
        print("tilelang", threads, rows, vec, "failed:", type(error).__name__, str(error)[:200], flush=True)
        continue
    part = torch.empty(triton.cdiv(n, rows * vec), device=dev)
    out = torch.empty(1, device=dev)
    g1 = torch.ones(1, device=dev)

    def fwd(kf=kf, ks=ks, part=part, out=out):
        kf(xd, yd, xd, xd, 1, 1, part)
        ks(part, float(n), out)

    def bwd(kb=kb):
        kb(g1, xd, yd, xd, xd, 1, 1, float(n), dx, yd)

    report(f"tilelang fwd threads={threads} block={rows * vec} vec={vec}", fwd, fwd_bytes)
    report(f"tilelang bwd threads={threads} block={rows * vec} vec={vec}", bwd, bwd_bytes)
