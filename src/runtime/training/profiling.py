"""Where a training step's time goes: host time per step against device (kernel) time per step.

At PCVR sizes a step is many small kernels, so the question the training benchmark cannot answer
alone is whether the host (Python, dispatch, launches) or the device sets the pace. `profile_steps`
runs a few steps under torch.profiler and reports per step: the wall time, the kernel time summed
over launches, the launch count, and the costliest kernels and host-side ops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

try:
    from triton import knobs as _triton_knobs
except ImportError:  # no Triton, or one without knobs: nothing is counted
    _triton_knobs = None


def profile_steps(step: Callable[[int], object], steps: int, device: torch.device, top: int = 12) -> dict:
    """Run `step(i)` for i in range(steps) under the profiler; per-step figures in ms."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        _sync(device)
        wall_s = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if _device_time_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    host_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    per_step = lambda us: us / 1000 / steps  # noqa: E731
    return {
        "steps": steps,
        "wall_ms_per_step": 1000 * wall_s / steps,
        "kernel_ms_per_step": per_step(sum(_device_time_us(e) for e in kernels)),
        "kernel_launches_per_step": sum(e.count for e in kernels) / steps,
        "top_kernels": [
            {"name": e.key[:120], "ms_per_step": per_step(_device_time_us(e)), "launches_per_step": e.count / steps}
            for e in sorted(kernels, key=_device_time_us, reverse=True)[:top]
        ],
        "top_host_ops": [
            {
                "name": e.key[:120],
                "self_ms_per_step": per_step(e.self_cpu_time_total),
                "calls_per_step": e.count / steps,
            }
            for e in sorted(host_ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        ],
    }


def _device_time_us(event) -> float:
    # renamed from cuda_time_total to device_time_total in torch 2.4+; both stacks have the new name
    return getattr(event, "self_device_time_total", 0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def triton_compilations() -> Iterator[list[str]]:
    """Within the block, the names of the Triton kernels compiled (or loaded from Triton's disk cache), in order, by
    Triton's post-compile hook. A compilation in a timed training step is host time a step pays for a new
    specialisation (e.g. a packed length's new "divisible by 16" flag); none happen under the interpreter."""
    compiled: list[str] = []
    runtime = getattr(_triton_knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        yield compiled
        return
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        info = kwargs.get("fn")
        compiled.append(getattr(info, "name", "?"))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_post_compile_hook = previous
