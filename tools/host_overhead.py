"""Host time per eager call of the Triton path, measured on a CPU machine with the GPU launch stubbed out.

    PYTHONPATH=src python tools/host_overhead.py                      # the table
    PYTHONPATH=src python tools/host_overhead.py --profile "rms_norm fwd+bwd"   # plus cProfile of one case
    PYTHONPATH=src python tools/host_overhead.py --aten 2>/dev/null   # plus ATen ops per call (torch.profiler;
                                                                        # its log lines go to stderr)

The tensors live on the CPU and the kernels are real JITFunctions (TRITON_INTERPRET is not set), so every call
takes the path an eager call takes on a GPU host: argument checks, backend selection, the autograd Function,
output allocation, grid and key building in triton_launch.DirectLaunch. Only three things are replaced, in this
process only: the triton backend accepts CPU tensors (as under the interpreter), Triton's driver answers device 0
and stream 0, and `kernel[grid](...)` returns a stand-in compiled kernel whose `run` (the launcher) does nothing.
The first call of each signature therefore "compiles" to the stand-in and later calls launch it directly.

What this leaves out: the launcher itself (a few us on the GPU host), the CUDA caching allocator (CPU malloc here)
and the GPU itself. Times are microseconds of this thread's CPU time per call, back to back, the fastest of several
repeats (the machine is noisy); compare runs on one machine only. The torch rows run the eager torch op on CPU at a tiny size: its host
cost (dispatch, autograd), not a GPU figure.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import os
import pkgutil
import pstats
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1: the harness times the direct (compiled-kernel) launch path")

import torch
import torch.nn.functional as F

import runtime.accelerators as accelerators
from runtime.accelerators import (
    autotune,
    backends,
    binary_cross_entropy_with_logits,
    chunk_gated_delta_rule,
    dropout_add,
    embedding_bag_mean,
    flash_attention,
    layer_norm,
    rms_norm,
    swiglu,
    triton_launch,
)
from runtime.accelerators.norms import norm_key


class _StubCompiled:
    """Stands in for a CompiledKernel: what DirectLaunch reads from it, and a launcher that does nothing."""

    function, packed_metadata = 0, ()

    def run(self, *args):
        pass

    def launch_metadata(self, grid, stream, *args):
        return None


class _StubKernel:
    """Stands in for a JITFunction: `kernel[grid](...)` "compiles" (returns the stand-in) without launching."""

    def __init__(self, fn):
        self.fn = fn  # DirectLaunch reads the kernel's signature from it
        self.compiled = _StubCompiled()

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.compiled


def triton_modules() -> list:
    """Every module of runtime.accelerators whose name says Triton (the ops' kernel modules), and the modules those
    import from runtime.accelerators (helpers holding kernels of their own, such as embedding_bag.radix_sort)."""
    for m in pkgutil.walk_packages(accelerators.__path__, "runtime.accelerators."):
        if "triton" in m.name:
            importlib.import_module(m.name)
    return [module for name, module in list(sys.modules.items()) if name.startswith("runtime.accelerators.")]


def stub_launches() -> None:
    """Make every Triton kernel a direct launch of the stand-in, runnable on CPU tensors."""
    backends.triton_interpret = lambda: True  # the triton backend accepts CPU tensors
    backends.clear_decisions()
    triton_launch._driver = lambda: (lambda: 0, lambda device: 0)
    for module in triton_modules():
        for value in vars(module).values():
            if isinstance(value, triton_launch.DirectLaunch):
                if not value.direct:
                    raise SystemExit(f"{module.__name__}: kernels are interpreted; unset TRITON_INTERPRET")
                value.kernel = _StubKernel(value.kernel.fn)
                value._compiled.clear()


def _forward(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def _forward_backward(fn, inputs, grad_out):
    return lambda: torch.autograd.grad(fn(), inputs, grad_out)


def cases() -> dict:
    """name -> callable, as the benchmark times them: forward under no_grad, forward+backward via autograd.grad."""
    out = {}
    for n, reduction in ((256, "mean"), (256, "none"), (4096, "mean"), (4096, "none")):
        for impl, fn in (
            ("triton", lambda x, y, r: binary_cross_entropy_with_logits(x, y, reduction=r, backend="triton")),
            ("torch", lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, reduction=r)),
        ):
            x = (3 * torch.randn(n)).requires_grad_()
            y = torch.rand(n)
            grad_out = torch.randn(n) if reduction == "none" else torch.randn(())
            call = lambda fn=fn, x=x, y=y, r=reduction: fn(x, y, r)  # noqa: E731
            out[f"bce {n} {reduction} {impl} fwd"] = _forward(call)
            out[f"bce {n} {reduction} {impl} fwd+bwd"] = _forward_backward(call, [x], grad_out)
    for op, impl_fns in (
        ("rms_norm", {
            "triton": lambda x, w, b: rms_norm(x, w, 1e-6, backend="triton"),
            "torch": lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        }),
        ("layer_norm", {
            "triton": lambda x, w, b: layer_norm(x, w, b, 1e-5, backend="triton"),
            "torch": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        }),
    ):  # fmt: skip
        for impl, fn in impl_fns.items():
            rows = 8192 if impl == "triton" else 8  # torch computes on the CPU: a tiny size shows its host cost
            x = torch.randn(rows, 128, dtype=torch.bfloat16, requires_grad=True)
            w = (1 + 0.1 * torch.randn(128, dtype=torch.bfloat16)).requires_grad_()
            b = (0.1 * torch.randn(128, dtype=torch.bfloat16)).requires_grad_()
            params = [x, w, b] if op == "layer_norm" else [x, w]
            call = lambda fn=fn, x=x, w=w, b=b: fn(x, w, b)  # noqa: E731
            shape = f"{rows}x128"
            out[f"{op} {shape} {impl} fwd"] = _forward(call)
            out[f"{op} {shape} {impl} fwd+bwd"] = _forward_backward(
                call, params, torch.randn(rows, 128, dtype=torch.bfloat16)
            )
    out.update(pcvr_layer_cases())
    out.update(measured_auto_cases())
    return out


def measured_auto_cases() -> dict:
    """rms_norm through "auto" when its decision is measured (what select_backend keeps on CUDA: the op's table of
    decisions per shape class, here placed under the CPU call's key): the shape class and its lookup on top of the
    triton rows. The one measurement is faked (no GPU) and happens in the warm-up calls."""
    out = {}
    x = torch.randn(8192, 128, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(128, dtype=torch.bfloat16)).requires_grad_()
    config = accelerators.active_config()
    key = ("rms_norm", "auto", config.fallback, config.autotune, x.device, norm_key(x, w))
    file = autotune.DecisionFile(Path(tempfile.mkdtemp()) / "autotune.json")
    backends._decisions[key] = autotune.Tuned(
        "rms_norm", key[-1], x.device, ("triton",), "triton", timer=lambda run: 1.0, file=file
    )
    _both(
        out,
        "rms_norm 8192x128 auto (measured)",
        lambda: rms_norm(x, w, 1e-6),
        [x, w],
        torch.randn(8192, 128, dtype=torch.bfloat16),
    )
    return out


def _both(out: dict, name: str, call, inputs: list, grad_out) -> None:
    out[f"{name} fwd"] = _forward(call)
    out[f"{name} fwd+bwd"] = _forward_backward(call, inputs, grad_out)


def pcvr_layer_cases() -> dict:
    """The other ops at the PCVR model's sizes (batch 256, 257 tokens, d_model 64, 4 heads), Triton only: their
    kernels are not launched, so the sizes only set what is allocated."""
    out = {}
    bf16 = dict(dtype=torch.bfloat16)
    fp16 = dict(dtype=torch.float16)  # the Triton backend refuses bf16 attention on the CPU (the interpreter's dots)
    q, k, v = (torch.randn(256, 4, 257, 16, **fp16, requires_grad=True) for _ in range(3))
    lengths = torch.randint(1, 258, (256,))
    attention = lambda: flash_attention(q, k, v, causal=True, key_lengths=lengths, backend="triton")  # noqa: E731
    _both(
        out,
        "flash_attention 256x4x257x16 causal+lengths triton",
        attention,
        [q, k, v],
        torch.randn(256, 4, 257, 16, **fp16),
    )
    gate, up = (torch.randn(256 * 257, 256, **bf16, requires_grad=True) for _ in range(2))
    _both(
        out,
        "swiglu 65792x256 triton",
        lambda: swiglu(gate, up, backend="triton"),
        [gate, up],
        torch.randn(256 * 257, 256, **bf16),
    )
    x, residual = (torch.randn(256 * 257, 64, **bf16, requires_grad=True) for _ in range(2))
    _both(
        out, "dropout_add 65792x64 p=0.1 triton", lambda: dropout_add(x, residual, 0.1, True, backend="triton"),
        [x, residual], torch.randn(256 * 257, 64, **bf16),
    )  # fmt: skip
    # a small table: the dense gradient's zero fill and the index sort run as CPU torch ops here (launches on a GPU)
    table = torch.randn(1000, 64, **bf16, requires_grad=True)
    indices = torch.randint(0, 1000, (256, 8))
    _both(
        out,
        "embedding_bag 1000x64 256x8 triton",
        lambda: embedding_bag_mean(table, indices, backend="triton"),
        [table],
        torch.randn(256, 64, **bf16),
    )
    gdr = [torch.randn(256, 256, 4, 16, **bf16, requires_grad=True) for _ in range(3)]
    g = (-torch.rand(256, 256, 4)).to(torch.bfloat16).requires_grad_()
    beta = torch.rand(256, 256, 4, **bf16, requires_grad=True)
    rule = lambda: chunk_gated_delta_rule(*gdr, g, beta, use_qk_l2norm_in_kernel=True, backend="triton")[0]  # noqa: E731
    _both(out, "gated_delta_rule 256x256x4x16 triton", rule, [*gdr, g, beta], torch.randn(256, 256, 4, 16, **bf16))
    return out


def per_call_us(fn, calls: int, repeats: int) -> float:
    """CPU time of this thread per call (nothing waits on a device here, and time spent descheduled by other
    processes on a shared machine is left out), the fastest of `repeats` runs of `calls` calls."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return 1e6 * best


def aten_ops_per_call(fn, calls: int = 20) -> str:
    """Top-level ATen ops per call, by name (each is a dispatcher round trip, a few us on the GPU host)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = collections.Counter(
        e.name for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")
    )
    return ", ".join(f"{name.removeprefix('aten::')} {count / calls:g}" for name, count in sorted(top.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default="", help="time only cases whose name contains this")
    parser.add_argument("--aten", action="store_true", help="also count top-level ATen ops per call")
    parser.add_argument("--profile", default=None, help="cProfile the case with this exact name")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerators.set_accelerators(
        accelerators.AcceleratorConfig(fallback="error")
    )  # a case the Triton backend refuses fails, never times torch
    stub_launches()
    table = cases()
    print(
        f"torch {torch.__version__}, CPU, launches stubbed; thread CPU us per call (fastest of {args.repeats} x {args.calls} calls)"
    )
    for name, fn in table.items():
        if args.only not in name:
            continue
        line = f"{name:40s} {per_call_us(fn, args.calls, args.repeats):8.1f}"
        if args.aten:
            line += f"   ATen ops: {aten_ops_per_call(fn)}"
        print(line, flush=True)
    if args.profile:
        fn = table[args.profile]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            fn()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
