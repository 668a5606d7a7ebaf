"""Host time per eager call of the Triton path, measured on a CPU machine with the GPU launch stubbed out.

    PYTHONPATH=src python tools/host_overhead.py                      # the table
    PYTHONPATH=src python tools/host_overhead.py --profile "rms_norm fwd+bwd"   # plus cProfile of one case
    PYTHONPATH=src python tools/host_overhead.py --aten 2>/dev/null   # plus ATen ops per call (torch.profiler;
                                                                        # its log lines go to stderr)

The tensors live on the CPU and every call takes the path an eager call takes on a GPU host: argument checks, backend
selection, the autograd Function, output allocation, grid and key building in triton_launch.DirectLaunch. The tool runs
under TRITON_INTERPRET=1 (set here), the documented way the triton backend takes CPU tensors, and times the direct
launch path through triton_launch.stand_in_launches: within it every Triton kernel of the package launches directly
against a stand-in whose first call per signature "compiles" to a stand-in compiled kernel whose launcher does
nothing (the current device and stream read as 0), so later calls run exactly a direct launch's host work.

What this leaves out: the launcher itself (a few us on the GPU host), the CUDA caching allocator (CPU malloc here)
and the GPU itself. Times are microseconds of this thread's CPU time per call, back to back, the fastest of several
repeats (the machine is noisy); compare runs on one machine only. The torch rows run the eager torch op on CPU at a tiny size: its host
cost (dispatch, autograd), not a GPU figure.

    PYTHONPATH=src python tools/host_overhead.py --step baseline               # a whole training step, per preset
    PYTHONPATH=src python tools/host_overhead.py --step gdr --profile triton   # plus cProfile of the step

--step MODEL times a whole eager training step (runtime.training's Trainer.train_step: forward under autocast,
loss, backward, gradient clipping, fused AdamW, the scheduler) of the model at the training benchmark's
architecture (d_model 64, 4 heads, 2 layers, dropout off) on tiny data (batch 2, histories of 8 events, a 64-item
table), so that the CPU's arithmetic is small beside the host path; the presets take turns within each repeat. Per
preset (torch, triton): thread CPU ms per step (the fastest step, each timed alone), our op calls per step (select_backend's
calls), with --aten the top-level ATen ops per step (torch.profiler), with --profile PRESET a cProfile of --steps
steps. The triton preset runs with fallback "error" (no op silently runs torch). The step runs under float16 autocast
where the training benchmark's runs bf16: on CPU tensors the triton backends of the ops with dot products refuse
bfloat16 (the interpreter computes those wrongly), and float16 takes the same host path (the same casts and launches,
another dtype in the keys). What it leaves out or counts differently from a GPU host: every torch op (both presets' casts, embeddings, the linear backward's matmuls,
torch's own attention and norms in the torch preset, AdamW and clipping) computes on the CPU, which is small but
not nothing (a bf16 matmul is tens of us here, a launch of a few us there); a CUDA launch's own cost per torch op;
the CUDA caching allocator; CPU autocast's op lists (CUDA's differ a little); and any wait on the GPU (a sync).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import importlib
import os
import pkgutil
import pstats
import sys
import tempfile
import time
from pathlib import Path

# the triton backend takes CPU tensors under the interpreter (read when the kernels are defined: before any import);
# stand_in_launches then times the direct path, never the interpreter
os.environ["TRITON_INTERPRET"] = "1"

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
    linear,
    rms_norm,
    swiglu,
    triton_launch,
)
from runtime.accelerators.norms import norm_key


def triton_modules() -> list:
    """Every module of runtime.accelerators whose name says Triton (the ops' kernel modules), and the modules those
    import from runtime.accelerators (helpers holding kernels of their own, such as embedding_bag.radix_sort)."""
    for m in pkgutil.walk_packages(accelerators.__path__, "runtime.accelerators."):
        if "triton" in m.name:
            importlib.import_module(m.name)
    return [module for name, module in list(sys.modules.items()) if name.startswith("runtime.accelerators.")]


def direct_launches() -> list:
    """Every Triton kernel of the package (the DirectLaunch objects its modules define)."""
    found = {}
    for module in triton_modules():
        for value in vars(module).values():
            if isinstance(value, triton_launch.DirectLaunch):
                found[id(value)] = value
    return list(found.values())


def stand_in_launches() -> contextlib.AbstractContextManager:
    """Every Triton kernel a direct launch of a stand-in (see the module docstring), within the block; decisions made
    before are forgotten."""
    backends.clear_decisions()
    return triton_launch.stand_in_launches(direct_launches())


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
    decisions per shape class, here placed for the CPU call by backends.place_decision): the shape class and its lookup on top of the
    triton rows. The one measurement is faked (no GPU) and happens in the warm-up calls."""
    out = {}
    x = torch.randn(8192, 128, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(128, dtype=torch.bfloat16)).requires_grad_()
    key = norm_key(x, w)
    file = autotune.DecisionFile(Path(tempfile.mkdtemp()) / "autotune.json")
    tuned = autotune.Tuned("rms_norm", key, x.device, ("triton",), "triton", timer=lambda run: 1.0, file=file)
    backends.place_decision("rms_norm", key, x.device, tuned)
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
    # linear as the models call it: float16 autocast over fp32 parameters (two casts a call, as F.linear makes them);
    # few rows, as its backward's two matmuls compute on the CPU here (launches on a GPU)
    x = torch.randn(2, 64, **fp16, requires_grad=True)
    weight = torch.randn(192, 64, requires_grad=True)
    bias = torch.randn(192, requires_grad=True)

    for impl, fn in (("triton", functools.partial(linear, backend="triton")), ("torch", F.linear)):

        def projection(fn=fn):
            with torch.autocast("cpu", dtype=torch.float16):
                return fn(x, weight, bias)

        _both(out, f"linear 2x64->192 autocast {impl}", projection, [x, weight, bias], torch.randn(2, 192, **fp16))
    gdr = [torch.randn(256, 256, 4, 16, **bf16, requires_grad=True) for _ in range(3)]
    g = (-torch.rand(256, 256, 4)).to(torch.bfloat16).requires_grad_()
    beta = torch.rand(256, 256, 4, **bf16, requires_grad=True)
    rule = lambda: chunk_gated_delta_rule(*gdr, g, beta, use_qk_l2norm_in_kernel=True, backend="triton")[0]  # noqa: E731
    _both(out, "gated_delta_rule 256x256x4x16 triton", rule, [*gdr, g, beta], torch.randn(256, 256, 4, 16, **bf16))
    return out


def per_call_us(fn, calls: int, repeats: int, warmup: int = 20) -> float:
    """CPU time of this thread per call (nothing waits on a device here, and time spent descheduled by other
    processes on a shared machine is left out), the fastest of `repeats` runs of `calls` calls."""
    for _ in range(warmup):
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


STEP_PRESETS = ("torch", "triton")


def step_trainer(model: str, preset: str, run_dir: Path, batch_size: int = 2, seq_len: int = 8):
    """A Trainer of `model` under the accelerators preset, on the CPU with float16 autocast (for the bf16 of the
    training benchmark's CUDA runs) and fused AdamW (as those), and a batch of its data."""
    from hydra import compose, initialize_config_dir

    from runtime.training.config import config_dir
    from runtime.training.distributed import Run
    from runtime.training.loop import Trainer, make_optimizer

    class Float16Trainer(Trainer):
        def autocast(self):  # float16 for bfloat16: see the module docstring
            return torch.autocast(self.device.type, dtype=torch.float16)

    overrides = [
        f"model={model}",
        f"accelerators={preset}",
        "accelerators.fallback=error",
        "model.dropout=0.0",
        "trainer.device=cpu",
        "trainer.precision=bf16",
        "trainer.cuda_graph=false",
        "trainer.progress=false",
        "logger=none",
        f"data.batch_size={batch_size}",
        f"data.seq_len={seq_len}",
        "data.val_size=16",
        "data.n_items=64",  # the item table's size sets only arithmetic (its gradient, AdamW), not the host path
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    trainer = Float16Trainer(cfg, run_dir, Run(torch.device("cpu")))
    # make_optimizer asks for fused AdamW on CUDA only; the step on a GPU host runs the fused one
    trainer.optimizer = make_optimizer(trainer.model, cfg.optim, torch.device("cuda"))
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, trainer.scheduler.lr_lambdas[0])
    return trainer, trainer.data.train_batch(0, batch_size)


def op_calls_per_step(step, steps: int) -> tuple[float, pstats.Stats]:
    """The cProfile of `steps` steps (in thread CPU time: other processes' share of a noisy machine is left out), and
    the calls of select_backend per step (one per call of one of our ops)."""
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    calls = sum(nc for (_, _, name), (_, nc, *_) in stats.stats.items() if name == "select_backend")
    return calls / steps, stats


def time_steps(model: str, args) -> dict[str, float]:
    """Thread CPU ms per step of each preset, the fastest of the repeats; the presets take turns within each repeat,
    so that a busy spell of the machine slows both. Returns preset -> ms."""
    print(
        f"torch {torch.__version__}, CPU, launches stubbed; {model} training step (batch 2, histories of 8), "
        f"thread CPU ms per step (the fastest of {args.repeats} x {args.steps} steps, each timed alone)"
    )
    steps = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for preset in args.presets:
            trainer, batch = step_trainer(model, preset, Path(run_dir) / preset)
            steps[preset] = (trainer.accelerators, lambda trainer=trainer, batch=batch: trainer.train_step(batch))
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(args.repeats):
            for preset, (config, step) in steps.items():
                accelerators.set_accelerators(config)  # each Trainer set its own; the last one built is active
                # each step timed alone: on a busy machine the fastest single step is the likeliest to have run alone
                best[preset] = min(best[preset], per_call_us(step, 1, args.steps, warmup=3) / 1000)
        for preset, (config, step) in steps.items():
            accelerators.set_accelerators(config)
            calls, stats = op_calls_per_step(step, args.steps)
            line = f"{model:12s} {preset:8s} {best[preset]:8.2f} ms/step   {calls:g} op calls"
            if args.aten:
                line += f"   ATen ops: {aten_ops_per_call(step, calls=3)}"
            print(line, flush=True)
            if args.profile == preset:
                print(f"cProfile of {args.steps} steps (thread CPU time; the profiler's own cost inflates each call)")
                stats.sort_stats("tottime").print_stats(40)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default="", help="time only cases whose name contains this")
    parser.add_argument("--aten", action="store_true", help="also count top-level ATen ops per call")
    parser.add_argument("--profile", default=None, help="cProfile the case with this exact name (--step: the preset)")
    parser.add_argument("--step", default=None, metavar="MODEL", help="time a whole training step of this model")
    parser.add_argument("--steps", type=int, default=20, help="--step: steps per repeat")
    parser.add_argument(
        "--presets", nargs="+", default=list(STEP_PRESETS), choices=STEP_PRESETS, help="--step: presets"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.step:
        with stand_in_launches():
            time_steps(args.step, args)
        return
    accelerators.set_accelerators(
        accelerators.AcceleratorConfig(fallback="error")
    )  # a case the Triton backend refuses fails, never times torch
    with stand_in_launches():
        run_cases(args)


def run_cases(args) -> None:
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
