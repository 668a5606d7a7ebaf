"""Throwaway timing script for the Triton norms (not part of the package). GPU time: one call captured in
a CUDA graph, replayed under do_bench (L2 flushed, median); eager: wall clock per call over back-to-back
calls, one sync at the end."""

import math
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from runtime.accelerators import l2norm, layer_norm, rms_norm
from runtime.accelerators import norms_triton as nt
from runtime.accelerators.l2norm.reference import l2norm_reference

try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except Exception as error:  # noqa: BLE001
    print("liger not importable:", error)
    LigerRMSNormFunction = LigerLayerNormFunction = None

SHAPES = [(32768, 4096), (8192, 128), (131072, 64)]
DT = torch.bfloat16


def eager_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fn):
    """GPU time of one call: the call captured in a CUDA graph, replayed by do_bench (L2 flushed between replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return do_bench(g.replay, warmup=10, rep=60) * 1e3


def setup(op, impl, shape):
    x = torch.randn(shape, dtype=DT, device="cuda", requires_grad=True)
    n = shape[-1]
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT).requires_grad_()
    b = (0.1 * torch.randn(n, device="cuda")).to(DT).requires_grad_()
    dy = torch.randn_like(x)
    if op == "rms_norm":
        params = [w]
        f = {
            "triton": lambda: rms_norm(x, w, backend="triton"),
            "torch": lambda: F.rms_norm(x, (n,), w, 1e-6),
            "liger": (lambda: LigerRMSNormFunction.apply(x, w, 1e-6)) if LigerRMSNormFunction else None,
        }[impl]
    elif op == "layer_norm":
        params = [w, b]
        f = {
            "triton": lambda: layer_norm(x, w, b, backend="triton"),
            "torch": lambda: F.layer_norm(x, (n,), w, b, 1e-5),
            "liger": (lambda: LigerLayerNormFunction.apply(x, w, b, 1e-5)) if LigerLayerNormFunction else None,
        }[impl]
    else:
        params = []
        f = {"triton": lambda: l2norm(x, backend="triton"), "torch": lambda: l2norm_reference(x), "liger": None}[impl]
    if f is None:
        return None
    elems = x.numel() * x.element_size()
    pbytes = sum(p.numel() * p.element_size() for p in params)

    def fwdbwd():
        return torch.autograd.grad(f(), [x, *params], dy)

    return {"fwd": (f, 2 * elems + pbytes), "fwd+bwd": (fwdbwd, 5 * elems + 3 * pbytes)}


def measure(op, impl, shape, mode, eager=True):
    cases = setup(op, impl, shape)
    if cases is None:
        return None
    fn, nbytes = cases[mode]
    us = graph_us(fn)
    out = {"us": us, "gbs": nbytes / us / 1e3}
    if eager:
        out["eager_us"] = eager_us(fn)
    return out


def copy_bandwidth():
    x = torch.randn(SHAPES[0], dtype=DT, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200)
    return 2 * x.numel() * x.element_size() / ms / 1e6


def apply(cfg):
    nt.TILE_ELEMENTS, nt.ELEMENTS_PER_THREAD, nt.RESIDENT_WARPS = cfg
    nt.row_tiles.cache_clear()
    nt._resident_programs.cache_clear()


def sweep():
    """Graph-timed configs; returns the one with the lowest geometric-mean time over the cases."""
    configs = [  # (TILE_ELEMENTS, ELEMENTS_PER_THREAD, RESIDENT_WARPS)
        (2048, 16, 16), (2048, 16, 32), (2048, 16, 64), (4096, 16, 32), (2048, 8, 32), (1024, 16, 32), (4096, 32, 32),
    ]  # fmt: skip
    cases = [("rms_norm", sh, m) for sh in SHAPES for m in ("fwd", "fwd+bwd")] + [("layer_norm", sh, "fwd+bwd") for sh in SHAPES]
    times = {}
    for cfg in configs:
        apply(cfg)
        line = [f"cfg tile={cfg[0]} ept={cfg[1]} resident={cfg[2]}:"]
        for op, shape, mode in cases:
            try:
                r = measure(op, "triton", shape, mode, eager=False)
            except Exception as error:  # noqa: BLE001
                print("sweep failed", cfg, op, shape, mode, repr(error)[:300])
                r = {"us": float("inf"), "gbs": 0}
            times[cfg, op, shape, mode] = r["us"]
            line.append(f"{op[:2]} {shape[0]}x{shape[1]} {mode} {r['us']:.1f}us {r['gbs']:.0f}GB/s |")
        print(" ".join(line), flush=True)
    base = configs[0]
    score = {c: sum(math.log(times[c, *k] / times[base, *k]) for k in cases) / len(cases) for c in configs}
    best = min(configs, key=score.get)
    print("scores (mean log time ratio vs first):", {str(c): round(v, 4) for c, v in score.items()}, "best:", best, flush=True)
    return best


def overheads():
    """Eager host cost per call (us) of the pieces of one rms_norm call at (8192, 128) bf16."""
    from runtime.accelerators.rms_norm import triton as rt

    x = torch.randn(8192, 128, dtype=DT, device="cuda")
    w = torch.randn(128, dtype=DT, device="cuda")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    y, rstd = rt.forward(x, w, 1e-6)
    tiles = nt.row_tiles(128)
    yy = torch.empty_like(x)
    programs = nt.backward_programs(8192, tiles, x.device)
    partial = torch.randn(programs, 128, device="cuda")
    items = {
        "bare triton launch (fwd kernel)": lambda: rt._forward_kernel[(nt.n_tiles(8192, tiles),)](
            x, w, yy, rstd, 8192, 128, 128, 1e-6, HAS_W=True, BLOCK_N=tiles.block, ROWS=tiles.rows, num_warps=tiles.warps
        ),
        "module forward()": lambda: rt.forward(x, w, 1e-6),
        "module backward()": lambda: rt.backward(dy, x, w, 1e-6, y, rstd),
        "sum_partials (triton)": lambda: nt.sum_partials(partial, w),
        "partial.sum(0).to(bf16) (torch)": lambda: partial.sum(0).to(DT),
        "rms_norm(no grad)": lambda: rms_norm(x, w, backend="triton"),
        "rms_norm(grad) fwd": lambda: rms_norm(xg, wg, backend="triton"),
        "rms_norm(grad) fwd+bwd": lambda: torch.autograd.grad(rms_norm(xg, wg, backend="triton"), [xg, wg], dy),
        "F.rms_norm(no grad)": lambda: F.rms_norm(x, (128,), w, 1e-6),
        "F.rms_norm(grad) fwd": lambda: F.rms_norm(xg, (128,), wg, 1e-6),
        "F.rms_norm(grad) fwd+bwd": lambda: torch.autograd.grad(F.rms_norm(xg, (128,), wg, 1e-6), [xg, wg], dy),
        "torch.empty_like": lambda: torch.empty_like(x),
    }
    for name, fn in items.items():
        print(f"overhead {name:<34} {eager_us(fn, 500):7.1f} us", flush=True)


def main():
    print(f"copy bandwidth (32768x4096 bf16): {copy_bandwidth():.0f} GB/s", flush=True)
    overheads()
    if "sweep" in sys.argv:
        best = sweep()
        apply(best)
        print("final table with", best)
    print(f"{'op':<11} {'shape':<12} {'mode':<8} {'impl':<7} {'GPU us':>9} {'GB/s':>7} {'eager us':>9}")
    for op in ("rms_norm", "layer_norm", "l2norm"):
        for shape in SHAPES:
            for mode in ("fwd", "fwd+bwd"):
                for impl in ("triton", "torch", "liger"):
                    try:
                        r = measure(op, impl, shape, mode)
                    except Exception as error:  # noqa: BLE001
                        print(op, shape, mode, impl, "failed:", repr(error)[:300])
                        continue
                    if r is None:
                        continue
                    print(
                        f"{op:<11} {shape[0]}x{shape[1]:<7} {mode:<8} {impl:<7} {r['us']:9.1f} {r['gbs']:7.0f} {r['eager_us']:9.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
