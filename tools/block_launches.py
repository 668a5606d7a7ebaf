"""Ops (kernel launches) per block of each PCVR model, in the steady state of a stack of blocks.

    PYTHONPATH=src python tools/block_launches.py                 # CPU: the ops of the torch.compile graph
    PYTHONPATH=src python tools/block_launches.py --device cuda   # GPU: CUDA kernels of an eager forward (profiler)

Per block = (count with 3 blocks - count with 1 block) / 2, so the embeddings, the head and whatever a model does
once around its blocks drop out. The model runs in eval mode (dropout draws nothing), all ops on --preset.

On the CPU the Triton kernels run under Triton's interpreter, and the count is read from the graph torch.compile
captures (fullgraph): each `taac::<op>_forward` node is one kernel launch; every other node that computes (not a
view or a size; a cast or reshape only where it copies) is at least one launch of a torch kernel in eager mode. On CUDA the count is the CUDA
kernels torch.profiler records during one eager forward, as launched.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "0" if "cuda" in sys.argv else "1")  # read when kernels are defined

import torch  # noqa: E402

# graph nodes that never launch anything (views, shapes), and those that launch a copy only when their result does
# not share the input's storage (a dtype cast, a reshape of a transposed tensor, an advanced index)
VIEWS = {"view", "transpose", "chunk", "split", "unsqueeze", "squeeze", "expand", "size", "dim", "getattr", "sym_size"}
MAYBE_COPIES = {"to", "float", "contiguous", "reshape", "flatten", "type_as", "getitem"}


def _storage(value):
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def _launches(node, name: str) -> bool:
    if name in VIEWS:
        return False
    if name in MAYBE_COPIES:
        source = node.args[0].meta.get("example_value") if node.args and hasattr(node.args[0], "meta") else None
        if not isinstance(source, torch.Tensor):
            return False  # an item of a tuple (an op's results)
        return _storage(node.meta.get("example_value")) != _storage(source)
    return True


def _spec():
    from runtime.models import FeatureSpec

    return FeatureSpec(
        n_items=500, n_categories=16, n_actions=4, sparse_fields={"a": 50, "b": 40}, sparse_hotness=2, n_dense=8,
        seq_len=24,
    )  # fmt: skip


def _batch(spec, b: int, device):
    from runtime.models import PCVRBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, spec.seq_len + 1, (b,), generator=g)
    valid = torch.arange(spec.seq_len)[None] < lengths[:, None]
    ids = lambda n, *shape: torch.randint(1, n + 1, shape, generator=g)  # noqa: E731
    batch = PCVRBatch(
        sparse=torch.stack([ids(v, b, spec.sparse_hotness) for v in spec.sparse_fields.values()], dim=1),
        dense=torch.randn(b, spec.n_dense, generator=g),
        seq_items=ids(spec.n_items, b, spec.seq_len) * valid,
        seq_categories=ids(spec.n_categories, b, spec.seq_len) * valid,
        seq_actions=ids(spec.n_actions, b, spec.seq_len) * valid,
        seq_lengths=lengths,
        target_item=ids(spec.n_items, b),
        target_category=ids(spec.n_categories, b),
        label=torch.randint(0, 2, (b,), generator=g).float(),
    )
    return batch.to(device)


def _name(node) -> str:
    target = node.target
    if node.op == "call_method":
        return target
    name = getattr(target, "__name__", str(target))
    if "taac" in str(getattr(target, "namespace", "")) or str(target).startswith("taac."):
        return f"taac::{str(target).removeprefix('taac.').removesuffix('.default')}"
    return name


def graph_ops(model, batch) -> Counter:
    """The compute nodes of the fullgraph torch.compile graph of model(batch), by name."""
    counts: Counter = Counter()

    def count(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                name = _name(node)
                if _launches(node, name):
                    counts[name] += 1
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=count, fullgraph=True)(batch)
    return counts


def cuda_kernels(model, batch) -> Counter:
    """The CUDA kernels one eager forward launches, by name (after a warm-up forward)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(batch)
            torch.cuda.synchronize()
    return Counter(e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def per_block(model_cls, device, counter, **sizes) -> Counter:
    spec = _spec()
    batch = _batch(spec, 4, device)
    counts = []
    for n_layers in (1, 3):
        torch.manual_seed(0)
        model = model_cls(spec, n_layers=n_layers, dropout=0.0, **sizes).to(device).eval()
        counts.append(counter(model, batch))
    diff = Counter({k: (counts[1][k] - counts[0][k]) / 2 for k in set(counts[0]) | set(counts[1])})
    return Counter({k: int(v) if float(v).is_integer() else v for k, v in diff.items() if v})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="triton", help="the backend of every op (torch, triton, tilelang, auto)")
    args = parser.parse_args(argv)
    from runtime.accelerators import use_accelerators
    from runtime.models import BaselinePCVR, GDRMixerPCVR, TokenFormerPCVR

    counter = graph_ops if args.device == "cpu" else cuda_kernels
    # fp16 on the CPU: the kernel backends take half precision there (the linear kernels no fp32)
    dtype = torch.float16 if args.device == "cpu" and args.preset != "torch" else None
    sizes = dict(d_model=64, n_heads=4, ffn_mult=4, head_hidden=64)
    with use_accelerators(default=args.preset, fallback="torch"):
        for name, cls in (("baseline", BaselinePCVR), ("tokenformer", TokenFormerPCVR), ("gdr", GDRMixerPCVR)):
            if dtype is not None:
                cls = _in_dtype(cls, dtype)
            counts = per_block(cls, torch.device(args.device), counter, **sizes)
            ops = ", ".join(f"{k} x{v}" if v != 1 else k for k, v in sorted(counts.items()))
            print(f"{name}: {sum(counts.values())} per block: {ops}")


def _in_dtype(cls, dtype):
    """cls whose instances are cast to dtype, with the floating inputs cast on the way in."""

    class Cast(torch.nn.Module):
        def __init__(self, spec, **kwargs):
            super().__init__()
            self.model = cls(spec, **kwargs).to(dtype)

        def forward(self, batch):
            return self.model(batch._map(lambda t: t.to(dtype) if t.is_floating_point() else t))

    return Cast


if __name__ == "__main__":
    main()
