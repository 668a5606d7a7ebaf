"""Temporary timing script for the TileLang flash-attention backend (device runs; not part of the package).

python tmp_fa_tilelang_bench.py compile   # compile every kernel the tests and timings use, in parallel
python tmp_fa_tilelang_bench.py measure   # GPU times (CUDA graph, L2 flushed) vs SDPA backends, config sweep
"""

import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import tilelang as fa
from runtime.accelerators.flash_attention.reference import visible_mask

DEV = torch.device("cuda")
BF16 = torch.bfloat16
PCVR = [(256, 4, 256, 16), (128, 8, 1024, 32), (64, 4, 2048, 48)]
LARGE = (4, 16, 4096, 128)
# config sweep: alternatives to the defaults, timed at the PCVR / large shapes (non-causal, no lengths)
FWD_ALT = {
    16: [fa.FwdConfig(64, 64, 2, 128, 3), fa.FwdConfig(128, 64, 2, 256, 2)],
    32: [fa.FwdConfig(64, 64, 2, 128, 3), fa.FwdConfig(128, 128, 2, 256, 1)],
    48: [fa.FwdConfig(128, 128, 2, 256, 1)],
    128: [],
}
BWD_ALT = {
    16: [fa.BwdConfig(128, 64, 2, 256, 1), fa.BwdConfig(64, 64, 1, 128, 2)],
    32: [fa.BwdConfig(64, 32, 2, 128, 2), fa.BwdConfig(64, 64, 2, 128, 2)],
    48: [fa.BwdConfig(64, 32, 2, 128, 2), fa.BwdConfig(128, 32, 2, 256, 1)],
    128: [],
}


def test_specs():
    sys.path.insert(0, "tests/gpu")
    from test_flash_attention_tilelang import SPECS

    return SPECS


def all_entries():
    specs = set(test_specs())
    for *_, d in PCVR:
        for causal in (False, True):
            for lengths in (False, True):
                specs.add((d, BF16, causal, lengths, False))
    specs |= {(128, BF16, False, False, False), (128, BF16, True, False, False)}
    entries = [e for s in sorted(specs, key=str) for e in fa.entries(*s)]
    for d, cfgs in FWD_ALT.items():
        entries += [fa.forward_entry(d, BF16, False, False, False, c) for c in cfgs]
    for d, cfgs in BWD_ALT.items():
        entries += [fa.backward_entry(d, BF16, False, False, False, c) for c in cfgs]
    return entries


def compile_all():
    t = time.time()
    entries = all_entries()
    fa.precompile(entries, DEV)
    print(f"compiled {len(entries)} kernels in {time.time() - t:.1f} s", flush=True)


_flush = None


def gpu_ms(fn, reps=25):
    """Median GPU time of fn replayed as a CUDA graph, L2 flushed before each replay."""
    global _flush
    if _flush is None:
        _flush = torch.empty(256 << 20, dtype=torch.int8, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        _flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def eager_ms(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def inputs(b, h, length, d, lengths):
    q, k, v = (torch.randn(b, h, length, d, device=DEV, dtype=BF16, requires_grad=True) for _ in range(3))
    kl = torch.randint(length // 2, length + 1, (b,), device=DEV, dtype=torch.int32) if lengths else None
    return q, k, v, kl, torch.randn(b, h, length, d, device=DEV, dtype=BF16)


def runners(q, k, v, kl, do, causal):
    def ours(bwd):
        def run():
            o = flash_attention(q, k, v, causal=causal, key_lengths=kl, backend="tilelang")
            if bwd:
                torch.autograd.grad(o, (q, k, v), do)
        return run

    def sdpa(name, bwd):
        mask = None if kl is None else visible_mask(q.shape[0], q.shape[2], k.shape[2], DEV, causal, kl)
        backend = getattr(torch.nn.attention.SDPBackend, name)

        def run():
            with torch.nn.attention.sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
            if bwd:
                torch.autograd.grad(o, (q, k, v), do)
        return run

    out = {"tilelang": ours}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        out[name.split("_")[0].lower()] = lambda bwd, name=name: sdpa(name, bwd)
    return out


def flops(b, h, length, d, causal, mode):
    f = 4.0 * b * h * length * length * d * (0.5 if causal else 1.0)
    return f if mode == "fwd" else 3.5 * f


def measure_shape(shape, causal, lengths, eager=True):
    b, h, length, d = shape
    q, k, v, kl, do = inputs(b, h, length, d, lengths)
    res = {}
    for name, make in runners(q, k, v, kl, do, causal).items():
        for mode in ("fwd", "fwd+bwd"):
            try:
                fn = make(mode == "fwd+bwd")
                res[(name, mode)] = (gpu_ms(fn), eager_ms(fn) if eager else float("nan"))
            except Exception as error:  # a backend that cannot run these inputs
                res[(name, mode)] = None
                if name == "tilelang":
                    traceback.print_exc()
                else:
                    print(f"    {name} {mode}: unavailable ({str(error).splitlines()[0][:90]})")
    tag = f"{shape} causal={causal} lengths={lengths}"
    for mode in ("fwd", "fwd+bwd"):
        peers = {n: r[0] for (n, m), r in res.items() if m == mode and r is not None and n != "tilelang"}
        best = min(peers, key=peers.get) if peers else None
        ours = res.get(("tilelang", mode))
        line = f"{tag:52s} {mode:8s} tilelang " + (f"{ours[0]:.4f} ms (eager {ours[1]:.4f})" if ours else "FAILED")
        line += "  | " + " ".join(f"{n} {t:.4f}" for n, t in peers.items())
        if ours and best:
            line += f"  | best SDPA {best}: x{peers[best] / ours[0]:.2f} speedup"
        if d == 128 and ours:
            line += f"  | tilelang {flops(b, h, length, d, causal, mode) / ours[0] / 1e9:.0f} TFLOP/s"
            if "cudnn" in peers:
                line += f", cudnn {flops(b, h, length, d, causal, mode) / peers['cudnn'] / 1e9:.0f} TFLOP/s"
        print(line, flush=True)


def sweep():
    shapes = {s[3]: s for s in PCVR + [LARGE]}
    for d, shape in shapes.items():
        b, h, length, _ = shape
        q, k, v, _, do = inputs(b, h, length, d, False)
        scale = d**-0.5
        for cfg in [fa.FWD_CONFIGS[d]] + FWD_ALT[d]:
            try:
                ms = gpu_ms(lambda: fa.forward(q, k, v, None, False, scale, 0.0, 0, cfg=cfg))
                print(f"sweep fwd d={d} {shape} {cfg}: {ms:.4f} ms", flush=True)
            except Exception:
                traceback.print_exc()
        o, lse = fa.forward(q, k, v, None, False, scale, 0.0, 0)
        for cfg in [fa.BWD_CONFIGS[d]] + BWD_ALT[d]:
            try:
                ms = gpu_ms(lambda: fa.backward(do, q, k, v, None, False, scale, 0.0, 0, o, lse, cfg=cfg))
                print(f"sweep bwd d={d} {shape} {cfg}: {ms:.4f} ms", flush=True)
            except Exception:
                traceback.print_exc()


def measure():
    print(torch.cuda.get_device_name(), flush=True)
    for shape in PCVR:
        for causal in (False, True):
            for lengths in (False, True):
                measure_shape(shape, causal, lengths)
    for causal in (False, True):
        measure_shape(LARGE, causal, False, eager=False)
    sweep()


if __name__ == "__main__":
    {"compile": compile_all, "measure": measure}[sys.argv[1]]()
