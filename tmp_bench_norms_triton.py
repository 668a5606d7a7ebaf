"""Throwaway timing script for the Triton norms (not part of the package). GPU time: triton do_bench
(L2 flushed, median ms); eager: wall clock per call over back-to-back calls, one sync at the end."""

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


def graph_us(fn, n=20):
    """Pure GPU time per call: n calls captured in a CUDA graph (no L2 flush)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ms = do_bench(g.replay, warmup=10, rep=50)
    return ms * 1e3 / n


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


def measure(op, impl, shape, mode, graph=False, eager=True):
    cases = setup(op, impl, shape)
    if cases is None:
        return None
    fn, nbytes = cases[mode]
    ms = do_bench(fn, warmup=25, rep=100)
    out = {"ms": ms, "gbs": nbytes / ms / 1e6}
    if eager:
        out["eager_us"] = eager_us(fn)
    if graph:
        try:
            out["graph_us"] = graph_us(fn)
        except Exception as error:  # noqa: BLE001
            out["graph_us"] = float("nan")
            print("graph failed", op, impl, shape, mode, repr(error)[:200])
    return out


def copy_bandwidth():
    x = torch.randn(SHAPES[0], dtype=DT, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200)
    return 2 * x.numel() * x.element_size() / ms / 1e6


def sweep():
    configs = [  # (TILE_ELEMENTS, ELEMENTS_PER_THREAD, RESIDENT_WARPS)
        (2048, 16, 16), (2048, 16, 8), (2048, 16, 32), (2048, 8, 16), (2048, 8, 32),
        (4096, 16, 16), (4096, 8, 32), (1024, 16, 16),
    ]  # fmt: skip
    default = (nt.TILE_ELEMENTS, nt.ELEMENTS_PER_THREAD, nt.RESIDENT_WARPS)
    for cfg in configs:
        nt.TILE_ELEMENTS, nt.ELEMENTS_PER_THREAD, nt.RESIDENT_WARPS = cfg
        nt.row_tiles.cache_clear()
        nt._resident_programs.cache_clear()
        line = [f"cfg tile={cfg[0]} ept={cfg[1]} resident={cfg[2]}:"]
        for op in ("rms_norm", "layer_norm"):
            for shape in SHAPES if op == "rms_norm" else SHAPES[:1]:
                for mode in ("fwd", "fwd+bwd"):
                    r = measure(op, "triton", shape, mode, eager=False)
                    line.append(f"{op[:2]} {shape[0]}x{shape[1]} {mode} {r['gbs']:.0f}GB/s {r['ms'] * 1e3:.1f}us |")
        print(" ".join(line), flush=True)
    nt.TILE_ELEMENTS, nt.ELEMENTS_PER_THREAD, nt.RESIDENT_WARPS = default
    nt.row_tiles.cache_clear()
    nt._resident_programs.cache_clear()


def main():
    print(f"copy bandwidth (32768x4096 bf16): {copy_bandwidth():.0f} GB/s", flush=True)
    if "sweep" in sys.argv:
        sweep()
    print(f"{'op':<11} {'shape':<12} {'mode':<8} {'impl':<7} {'GPU us':>9} {'GB/s':>7} {'graph us':>9} {'eager us':>9}")
    for op in ("rms_norm", "layer_norm", "l2norm"):
        for shape in SHAPES:
            for mode in ("fwd", "fwd+bwd"):
                for impl in ("triton", "torch", "liger"):
                    try:
                        r = measure(op, impl, shape, mode, graph=shape[1] <= 128)
                    except Exception as error:  # noqa: BLE001
                        print(op, shape, mode, impl, "failed:", repr(error)[:300])
                        continue
                    if r is None:
                        continue
                    print(
                        f"{op:<11} {shape[0]}x{shape[1]:<7} {mode:<8} {impl:<7} {r['ms'] * 1e3:9.1f} {r['gbs']:7.0f}"
                        f" {r.get('graph_us', float('nan')):9.2f} {r['eager_us']:9.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
