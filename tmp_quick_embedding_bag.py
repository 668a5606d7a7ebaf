"""Temporary minimal GPU check for issue 6 (deleted afterwards)."""
import time, torch, torch.nn.functional as F
from runtime.accelerators.embedding_bag import embedding_bag_mean
from runtime.accelerators.testing import relative_rms_error
from runtime.benchmark.ops.embedding_bag import PAD, VOCAB, make_bags
from runtime.benchmark.timing import gpu_time_ms
dev = torch.device("cuda")
t0 = time.time()

def us(fn):
    return round(gpu_time_ms(fn, dev, replays=20)[0]["median"] * 1e3, 1)

def check(backend, dtype, dim, layout):
    w = torch.randn(3000, dim, device=dev).to(dtype).requires_grad_()
    idx = make_bags(dev, 6, "zipf", bags=1200, vocab=3000, seed=1)
    offsets = None
    if layout == "offsets":
        idx, offsets = idx.reshape(-1), torch.arange(0, idx.numel(), 6, device=dev)
        offsets[5] = offsets[4]  # an empty bag (bag 4 gets 12 entries)
    for sparse in (False, True):
        y = embedding_bag_mean(w, idx, offsets, PAD, sparse=sparse, backend=backend)
        g = torch.randn_like(y) if not sparse else g
        (gw,) = torch.autograd.grad(y, w, g)
        w64 = w.detach().double().requires_grad_()
        y64 = F.embedding_bag(idx, w64, offsets, mode="mean", padding_idx=PAD)
        (g64,) = torch.autograd.grad(y64, w64, g.double())
        print(backend, dtype, dim, layout, "sparse" if sparse else "dense", "out %.1e grad %.1e" % (relative_rms_error(y, y64), relative_rms_error(gw.to_dense() if sparse else gw, g64)), flush=True)

for layout in ("2d", "offsets"):
    check("triton", torch.bfloat16, 64, layout)
print("t", round(time.time() - t0), flush=True)
for dim, bag in ((64, 4), (128, 8)):
    w = torch.randn(VOCAB, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for dist in ("uniform", "zipf"):
        idx = make_bags(dev, bag, dist)
        go = torch.randn(idx.shape[0], dim, device=dev, dtype=torch.bfloat16)
        fns = {"torch": lambda: F.embedding_bag(idx, w, mode="mean", padding_idx=PAD),
               "triton": lambda: embedding_bag_mean(w, idx, padding_idx=PAD, backend="triton")}
        row = {}
        for name, fn in fns.items():
            with torch.no_grad():
                row[name + " fwd"] = us(lambda fn=fn: fn())
            row[name + " f+b"] = us(lambda fn=fn: torch.autograd.grad(fn(), w, go))
        print(dim, bag, dist, row, flush=True)
print("t", round(time.time() - t0), flush=True)
for layout in ("2d", "offsets"):
    check("tilelang", torch.bfloat16, 64, layout)
print("t", round(time.time() - t0), flush=True)
