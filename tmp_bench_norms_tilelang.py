"""Quick timing of the TileLang row norms on the GPU machine (a helper's scratch script, not the harness).

GPU time: CUDA graph replays with L2 flushed (runtime.benchmark.timing); eager: wall clock per call.
Prints TB/s (bytes as in runtime.benchmark.ops.norms) and the fraction of the measured copy bandwidth.
Then sweeps backward variants (threads per row, persistent blocks per SM) of rms_norm.
"""

import importlib
import sys
import time

import torch
import torch.nn.functional as F

from runtime.accelerators import l2norm, layer_norm, rms_norm
from runtime.benchmark.timing import copy_bandwidth_tbs, eager_time_ms, gpu_time_ms

dev = torch.device("cuda", 0)
bf16 = torch.bfloat16
tc = importlib.import_module("runtime.accelerators.tilelang_common")
SHAPES = [(32768, 4096), (8192, 128), (131072, 64)]
BACKENDS = ("triton", "tilelang") if "lite" in sys.argv else ("torch", "triton", "tilelang")
copy = copy_bandwidth_tbs(dev)
print(f"copy bandwidth {copy:.3f} TB/s", flush=True)


def make(op, rows, width):
    x = torch.randn(rows, width, device=dev, dtype=bf16, requires_grad=True)
    p = {}
    if op in ("rms_norm", "layer_norm"):
        p["weight"] = (1 + 0.1 * torch.randn(width, device=dev, dtype=bf16)).requires_grad_()
    if op == "layer_norm":
        p["bias"] = (0.1 * torch.randn(width, device=dev, dtype=bf16)).requires_grad_()
    return x, p


def fns(op, x, p):
    width = x.shape[-1]
    out = {}
    for backend in BACKENDS:
        if op == "l2norm":
            out[backend] = lambda b=backend: l2norm(x, 1e-6, backend=b)
        else:
            f = {"rms_norm": rms_norm, "layer_norm": layer_norm}[op]
            out[backend] = lambda b=backend, f=f: f(x, **p, backend=b)
    if op == "rms_norm":
        out["F.rms_norm"] = lambda: F.rms_norm(x, (width,), p["weight"], 1e-6)
    if op == "layer_norm":
        out["F.layer_norm"] = lambda: F.layer_norm(x, (width,), p["weight"], p["bias"], 1e-5)
    return out


def nbytes(x, p, mode):
    n = x.numel() * x.element_size()
    pb = sum(t.numel() * t.element_size() for t in p.values())
    fwd = 2 * n + pb
    return fwd if mode == "fwd" else fwd + 3 * n + 2 * pb


def main_table():
    entries = []
    for _, width in SHAPES:
        entries += importlib.import_module("runtime.accelerators.rms_norm.tilelang").kernel_entries(bf16, width, bf16, dev)
        entries += importlib.import_module("runtime.accelerators.layer_norm.tilelang").kernel_entries(bf16, width, bf16, bf16, dev)
        entries += importlib.import_module("runtime.accelerators.l2norm.tilelang").kernel_entries(bf16, width)
    t0 = time.time()
    tc.precompile(entries, dev)
    print(f"precompiled {len(entries)} tilelang kernels in {time.time() - t0:.1f}s", flush=True)
    for op in ("rms_norm", "layer_norm", "l2norm"):
        for rows, width in SHAPES:
            x, p = make(op, rows, width)
            dy = torch.randn(rows, width, device=dev, dtype=bf16)
            leaves = [x, *p.values()]
            for name, fwd in fns(op, x, p).items():
                try:
                    with torch.no_grad():
                        t_f, g_f = gpu_time_ms(fwd, dev)
                        e_f = eager_time_ms(fwd, dev)

                    def fb(fwd=fwd):
                        return torch.autograd.grad(fwd(), leaves, dy)

                    t_b, g_b = gpu_time_ms(fb, dev)
                    e_b = eager_time_ms(fb, dev)
                except Exception as error:  # noqa: BLE001
                    print(f"{op:10s} {rows}x{width} {name:12s} ERROR {type(error).__name__}: {str(error)[:200]}", flush=True)
                    continue
                line = f"{op:10s} {rows:6d}x{width:<5d} {name:12s}"
                for mode, t, g, e in (("fwd", t_f, g_f, e_f), ("fwd+bwd", t_b, g_b, e_b)):
                    ms = t["median"]
                    tbs = nbytes(x, p, mode) / (ms * 1e-3) / 1e12
                    line += f" | {mode:7s} gpu {ms * 1e3:8.1f} us {tbs:5.2f} TB/s {tbs / copy:5.1%}{'' if g else '(no graph)'} eager {e * 1e3:7.1f} us"
                print(line, flush=True)
            del x, p, dy


def sweep():
    """Backward kernels alone (plus the column sum) for plan / grid / min-blocks-per-SM variants."""
    import tilelang

    info = tc.device_info(0)
    rms = importlib.import_module("runtime.accelerators.rms_norm.tilelang")
    ln = importlib.import_module("runtime.accelerators.layer_norm.tilelang")
    for op, (rows, width) in [("rms_norm", s) for s in SHAPES] + [("layer_norm", SHAPES[0])]:
        x = torch.randn(rows, width, device=dev, dtype=bf16)
        dy = torch.randn_like(x)
        w = torch.randn(width, device=dev, dtype=bf16)
        rstd = torch.rand(rows, device=dev) + 0.5
        mean = torch.randn(rows, device=dev)
        dx = torch.empty_like(x)
        variants = []
        for min_threads, max_threads, per_thread in ((128, 512, 2), (256, 512, 2), (128, 512, 1), (128, 512, 4)):
            vec = 8
            chunks = -(-width // vec)
            rt = min(max_threads, tc._next_pow2(-(-chunks // per_thread)))
            padded = -(-width // (rt * vec)) * rt * vec
            threads = max(rt, min_threads)
            plan = tc.RowPlan(width, padded, threads, threads // rt, vec)
            for per_sm in (1, 2, 4, 8):
                if threads * per_sm <= 2048:
                    variants.append((plan, per_sm, per_sm))
            variants.append((plan, 2048 // threads, None))
        variants = list(dict.fromkeys(variants))
        t0 = time.time()
        if op == "rms_norm":
            funcs = [rms.backward_kernel("bfloat16", "bfloat16", p, k * info.sm_count, m) for p, k, m in variants]
        else:
            funcs = [ln.backward_kernel("bfloat16", "bfloat16", "bfloat16", p, k * info.sm_count, m) for p, k, m in variants]
        kernels = tilelang.par_compile(funcs, target=info.target, ignore_error=True)
        print(f"sweep {op} {rows}x{width}: compiled {len(kernels)} variants in {time.time() - t0:.1f}s", flush=True)
        for (plan, per_sm, min_blocks), k in zip(variants, kernels):
            if k is None:
                continue
            n_params = 1 if op == "rms_norm" else 2
            colsum = tc.launcher(tc.column_sum_entry(bf16, per_sm * info.sm_count), dev)
            partial = torch.empty(per_sm * info.sm_count, n_params * width, device=dev)
            dw = torch.empty(n_params * width, device=dev, dtype=bf16)
            if op == "rms_norm":
                launch = lambda k=k, partial=partial: k(dy, x, w, rstd, dx, partial)  # noqa: E731
            else:
                launch = lambda k=k, partial=partial: k(dy, x, w, mean, rstd, dx, partial.view(-1, 2, width))  # noqa: E731

            def run(launch=launch, partial=partial, dw=dw):
                launch()
                colsum(partial, dw)

            t, _ = gpu_time_ms(run, dev)
            t_k, _ = gpu_time_ms(launch, dev)
            ms = t["median"]
            tbs = (3 * x.numel() * 2) / (ms * 1e-3) / 1e12
            print(
                f"  threads {plan.threads:4d} rows/block {plan.block_rows:3d} padded {plan.padded:5d} blocks/SM {per_sm} "
                f"min_blocks {min_blocks}: bwd+colsum {ms * 1e3:7.1f} us ({tbs:.2f} TB/s, {tbs / copy:.1%}), "
                f"kernel alone {t_k['median'] * 1e3:7.1f} us",
                flush=True,
            )


def overhead(rows=8192, width=128):
    """Host time per call (wall clock, back-to-back, one sync) of the pieces of an eager rms_norm call."""
    mod = importlib.import_module("runtime.accelerators.rms_norm.tilelang")
    x = torch.randn(rows, width, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(width, device=dev, dtype=bf16, requires_grad=True)
    y, rstd = mod.forward(x.detach(), w.detach(), 1e-6)
    dy = torch.randn_like(y)
    entry = mod._forward_entry(bf16, width, bf16)
    jit, direct = tc.compiled(entry, dev), tc.launcher(entry, dev)
    out = torch.empty_like(y)
    pieces = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "JITKernel call": lambda: jit(x.detach(), w.detach(), out, rstd, 1e-6),
        "direct TVM-FFI call": lambda: direct(x.detach(), w.detach(), out, rstd, 1e-6),
        "module forward()": lambda: mod.forward(x.detach(), w.detach(), 1e-6),
        "module backward()": lambda: mod.backward(dy, x.detach(), w.detach(), 1e-6, y, rstd),
        "rms_norm no_grad": lambda: rms_norm(x.detach(), w.detach(), backend="tilelang"),
        "rms_norm fwd (autograd)": lambda: rms_norm(x, w, backend="tilelang"),
        "rms_norm fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w, backend="tilelang"), [x, w], dy),
        "F.rms_norm fwd (autograd)": lambda: F.rms_norm(x, (width,), w, 1e-6),
        "F.rms_norm fwd+bwd": lambda: torch.autograd.grad(F.rms_norm(x, (width,), w, 1e-6), [x, w], dy),
    }
    for name, fn in pieces.items():
        print(f"overhead {rows}x{width} {name:28s} {eager_time_ms(fn, dev) * 1e3:7.1f} us/call", flush=True)


if __name__ == "__main__":
    which = sys.argv[1:] or ["table", "overhead"]
    if "table" in which:
        main_table()
    if "overhead" in which:
        overhead()
    if "sweep" in which:
        sweep()
