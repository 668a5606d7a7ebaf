"""Side by side timing for the variant tools (linear_forward_variants.py, linear_backward_pieces.py,
gdr_tilelang_forward.py, sampling_select_filter.py): each variant is checked, then timed by the benchmark's CUDA-graph
timer; a variant that fails to compile, launch or check becomes a row saying so, not a stop. kernel_launches_us lists
one call's kernels with their GPU times."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from runtime.benchmark.timing import gpu_time_ms


def time_variant(case: str, label: str, fn: Callable[[], object], check: Callable[[object], str | None] | None = None):
    """fn's median GPU ms on the current CUDA device, or None (its row printed) where it fails or its check (given
    fn's result, a problem or None) finds one."""
    try:
        result = fn()  # a failing variant fails here, before the timer's warm-up and capture
        problem = check(result) if check is not None else None
        if problem is None:
            return gpu_time_ms(fn, torch.device("cuda"))[0]["median"]
    except Exception as error:
        problem = f"failed: {type(error).__name__}: {str(error)[:120]}"
    print(f"| {case} | {label} | {problem} | |", flush=True)
    return None


def kernel_launches_us(fn) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds) of one call's kernels in launch order (after a warm-up call): a kernel launched
    several times in one call (the GDR split's storing walk, a select's passes) keeps a row per launch."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in kernels]


def write_json(path: str | None, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)
