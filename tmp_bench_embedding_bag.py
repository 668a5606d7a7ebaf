"""Temporary timing script for issue 6 (embedding_bag_mean): run on the GPU machine, deleted afterwards."""

import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from runtime.accelerators.embedding_bag import embedding_bag_mean
from runtime.accelerators.embedding_bag import tilelang as lk
from runtime.accelerators.embedding_bag import triton as tk
from runtime.accelerators.embedding_bag.segments import sort_segments
from runtime.benchmark.ops.embedding_bag import PAD, VOCAB, make_bags
from runtime.benchmark.timing import eager_time_ms, gpu_time_ms

dev = torch.device("cuda")
bf16, f16 = torch.bfloat16, torch.float16
OUT = os.environ.get("OUT", "/tmp")
results = []
QUICK = "--quick" in sys.argv


def gpu(fn):
    times, captured = gpu_time_ms(fn, dev, replays=30)
    return round(times["median"] * 1e3, 1), captured  # microseconds


def eager(fn):
    return round(eager_time_ms(fn, dev, calls=50, min_seconds=0.05) * 1e3, 1)


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def section(name, body):
    start = time.time()
    try:
        body()
    except Exception:
        print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)
    print(f"[{name}] {time.time() - start:.1f}s", flush=True)


def warmup():
    lk.precompile([(d, dt, torch.int64, torch.int64) for d in (64, 128) for dt in (bf16, f16)], dev)


def main_table():
    for dtype in (bf16, f16):
        for dim in (64, 128):
            weight = torch.randn(VOCAB, dim, device=dev, dtype=dtype, requires_grad=True)
            for bag in (4, 8):
                for dist in ("uniform", "zipf"):
                    idx = make_bags(dev, bag, dist)
                    go = torch.randn(idx.shape[0], dim, device=dev, dtype=dtype)
                    impls = {
                        "torch": lambda: F.embedding_bag(idx, weight, mode="mean", padding_idx=PAD),
                        "triton": lambda: embedding_bag_mean(weight, idx, padding_idx=PAD, backend="triton"),
                        "tilelang": lambda: embedding_bag_mean(weight, idx, padding_idx=PAD, backend="tilelang"),
                        "triton-nocheck": lambda: embedding_bag_mean(weight, idx, padding_idx=PAD, check_indices=False, backend="triton"),
                        "tilelang-nocheck": lambda: embedding_bag_mean(weight, idx, padding_idx=PAD, check_indices=False, backend="tilelang"),
                    }
                    row = dict(dtype=str(dtype)[6:], dim=dim, bag=bag, dist=dist)
                    for name, fn in impls.items():
                        row[f"{name} fwd"], cap = gpu(no_grad(fn))
                        if not cap:
                            row[f"{name} fwd"] = f"{row[f'{name} fwd']} (no graph)"
                        if "nocheck" not in name:
                            row[f"{name} f+b"], cap = gpu(lambda fn=fn: torch.autograd.grad(fn(), weight, go))
                            if not cap:
                                row[f"{name} f+b"] = f"{row[f'{name} f+b']} (no graph)"
                            if dtype == bf16 and not QUICK:
                                row[f"{name} eager fwd"] = eager(no_grad(fn))
                                row[f"{name} eager f+b"] = eager(lambda fn=fn: torch.autograd.grad(fn(), weight, go))
                    t = row["torch fwd"], row["torch f+b"]
                    for b in ("triton", "tilelang"):
                        if isinstance(row[f"{b} fwd"], float) and isinstance(t[0], float):
                            row[f"{b} x fwd"] = round(t[0] / row[f"{b} fwd"], 2)
                        if isinstance(row[f"{b} f+b"], float) and isinstance(t[1], float):
                            row[f"{b} x f+b"] = round(t[1] / row[f"{b} f+b"], 2)
                    print(json.dumps(row), flush=True)
                    results.append(row)
            del weight
            torch.cuda.empty_cache()


def breakdown():
    for dim, bag, dist in ((128, 8, "zipf"), (128, 8, "uniform"), (64, 4, "zipf")):
        weight = torch.randn(VOCAB, dim, device=dev, dtype=bf16, requires_grad=True)
        idx = make_bags(dev, bag, dist)
        go = torch.randn(idx.shape[0], dim, device=dev, dtype=bf16)
        flat = idx.reshape(-1)
        keys = flat.to(torch.int32)
        row = dict(what="backward breakdown", dim=dim, bag=bag, dist=dist)
        row["zeros"] = gpu(lambda: torch.zeros(VOCAB, dim, device=dev, dtype=bf16))[0]
        row["sort int32"] = gpu(lambda: torch.sort(keys, stable=True))[0]
        row["sort int64"] = gpu(lambda: torch.sort(flat, stable=True))[0]
        row["sort_segments"] = gpu(lambda: sort_segments(flat, VOCAB))[0]
        for name, mod in (("triton", tk), ("tilelang", lk)):
            out, scale, bag_of = mod.forward(weight.detach(), idx, None, PAD, False, True)
            row[f"{name} bwd"] = gpu(lambda mod=mod, out=out, scale=scale, bag_of=bag_of: mod.backward(go, weight, idx, None, PAD, False, True, out, scale, bag_of))[0]
        segs = sort_segments(flat, VOCAB)
        row["max segment"] = int(torch.bincount(segs.first.long()).max())
        row["sparse f+b eager (triton)"] = eager(lambda: torch.autograd.grad(embedding_bag_mean(weight, idx, padding_idx=PAD, sparse=True, backend="triton"), weight, go))
        row["sparse f+b eager (tilelang)"] = eager(lambda: torch.autograd.grad(embedding_bag_mean(weight, idx, padding_idx=PAD, sparse=True, backend="tilelang"), weight, go))
        print(json.dumps(row), flush=True)
        results.append(row)


def triton_sweep():
    for dim in (64, 128):
        weight = torch.randn(VOCAB, dim, device=dev, dtype=bf16)
        for bag in (4, 8):
            idx = make_bags(dev, bag, "uniform")
            row = dict(what="triton fwd sweep", dim=dim, bag=bag)
            for block_b in (8, 16, 32, 64):
                for warps in (2, 4, 8):
                    if not 512 <= block_b * dim <= 8192:
                        continue
                    cfg = dict(BLOCK_B=block_b, BLOCK_L=bag, BLOCK_D=dim, num_warps=warps)
                    row[f"B{block_b}w{warps}"] = gpu(lambda cfg=cfg: tk.forward(weight, idx, None, PAD, False, True, config=cfg))[0]
            print(json.dumps(row), flush=True)
            results.append(row)


def tilelang_sweep():
    import tilelang

    variants = [(dim, block_b, block_l) for dim in (64, 128) for block_b in (8, 16, 32) for block_l in (4, 8)]
    progs = [lk.forward_program(dim, "bfloat16", "int64", "int64", block_b, block_l) for dim, block_b, block_l in variants]
    from runtime.accelerators.tilelang_common import device_info

    kernels = tilelang.par_compile(progs, target=device_info(0).target)
    for (dim, block_b, block_l), kernel in zip(variants, kernels):
        weight = torch.randn(VOCAB, dim, device=dev, dtype=bf16)
        row = dict(what="tilelang fwd sweep", dim=dim, block_b=block_b, block_l=block_l)
        for bag in (4, 8):
            idx = make_bags(dev, bag, "uniform")
            flat = idx.reshape(-1)
            out = torch.empty(idx.shape[0], dim, device=dev, dtype=bf16)
            scale = torch.empty(idx.shape[0], device=dev)
            dummy = torch.empty(1, device=dev, dtype=torch.int32)
            row[f"bag{bag}"] = gpu(lambda: kernel(weight, flat, flat, out, scale, dummy, bag, PAD, 1))[0]
        print(json.dumps(row), flush=True)
        results.append(row)


section("warmup", warmup)
section("main", main_table)
section("breakdown", breakdown)
if not QUICK:
    section("triton sweep", triton_sweep)
    section("tilelang sweep", tilelang_sweep)
with open(os.path.join(OUT, "timings.json"), "w") as f:
    json.dump(results, f, indent=1)
