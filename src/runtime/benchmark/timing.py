"""Timing: GPU time (CUDA-graph replays, L2 flushed before each) and eager time per call."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": statistics.median(ordered), "p20": at(0.2), "p80": at(0.8)}


class L2Flusher:
    """Reads a buffer twice the L2 size so every replay starts with a cold cache.

    Reading, not writing: a flush by writes leaves L2 full of dirty lines, whose write-back then lands inside
    the timed kernel (up to 2 x L2 size of extra DRAM traffic, more or less of it from replay to replay).
    The reads carry the evict-last hint (evict_last=True, a Triton kernel). A plain read (evict_last=False, a
    torch.sum) was suspected of leaving lines that the timed kernel had loaded with that hint in L2 for its next
    replay; a check did not confirm it (H100: a SwiGLU forward with evict-last loads
    was 2% faster after either flush), and every row timed 0.1-0.4 us faster after this one, peers and ours alike.
    It stays, as the stricter of the two.
    """

    def __init__(self, device: torch.device, evict_last: bool = True) -> None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
        self.buffer = torch.ones(2 * l2 // 4, dtype=torch.int32, device=device)
        self.total = torch.empty((), dtype=torch.int32, device=device)
        self.evict_last = evict_last
        if evict_last:  # imported here: the benchmark also runs on machines without Triton (CPU rows, no flush)
            from .l2_flush import EvictLastReader

            self.read = EvictLastReader(self.buffer)

    def __call__(self) -> None:
        if self.evict_last:
            self.read()
        else:
            torch.sum(self.buffer, dim=0, dtype=torch.int32, out=self.total)


def gpu_time_ms(
    fn: Callable[[], object], device: torch.device, replays: int = 100, flush: L2Flusher | None = None
) -> tuple[dict[str, float], bool]:
    """Median/p20/p80 GPU milliseconds of fn, replayed in a CUDA graph with L2 flushed before each replay.

    The replays are queued back to back and synchronised once. With a host sync after each (the GPU idle between
    replays), bandwidth-bound kernels replayed in two modes, e.g. about 180 and 207 us for LayerNorm at 32768x4096
    on an H100, whose median then jumped between runs, while back-to-back calls of the same kernels took 182 us.
    The GPU is kept busy for 50 ms first (_keep_busy). Falls back to timing eager launches with events when fn cannot
    be captured (returns graph=False). Calls slower than 0.1 s get 5 timings without warm-up, so a step-by-step
    reference stays measurable. flush: the L2 flush to run before each replay (default: an L2Flusher).
    """
    flush = flush or L2Flusher(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        launch, captured = graph.replay, True
    except Exception:  # host syncs or uncapturable launches: time eager launches instead
        torch.cuda.synchronize(device)
        _end_generator_capture(device)
        launch, captured = fn, False
    _keep_busy(flush, device)
    first = _timed(flush, launch, 1)
    if first[0] > 100.0:
        return percentiles(first + _timed(flush, launch, 4)), captured
    _timed(flush, launch, 5)  # warm-up after the capture and the first timing's sync
    return percentiles(_timed(flush, launch, replays)), captured


def _end_generator_capture(device: torch.device) -> None:
    """Makes random draws work again after a capture that raised. torch ends such a capture before it tells the
    device's random number generator, which then stays marked as capturing: every later draw on the device raised
    "Offset increment outside graph capture encountered unexpectedly" (torch 2.11, H200). A capture of nothing
    begins and ends the generator's capture properly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        with torch.cuda.device(device), torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass


def _keep_busy(flush: Callable[[], None], device: torch.device, seconds: float = 0.05) -> None:
    """Runs the flush back to back for `seconds` before a timing, so that the GPU is at its working clocks: the 100
    replays of a small kernel last a few milliseconds, too short for the clocks to ramp up after a compile or the
    host-bound eager loop, and the first rows of a run were timed slow and spread (a 6 us forward at
    12-24 us p20-p80)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            flush()
        torch.cuda.synchronize(device)


def _timed(flush: Callable[[], None], launch: Callable[[], object], replays: int) -> list[float]:
    """Milliseconds of `replays` launches queued back to back, each after an L2 flush, synchronised once."""
    events = []
    for _ in range(replays):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        events.append((start, end))
    events[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in events]


def eager_time_ms(
    fn: Callable[[], object], device: torch.device, calls: int = 200, min_seconds: float = 0.2, windows: int = 5
) -> float:
    """Wall-clock milliseconds per call over back-to-back calls, synchronised once at the end of a window: the median
    of `windows` windows, each lasting about min_seconds / windows. One window alone lets a single host hiccup (another
    process, the garbage collector) decide a launch-bound row.

    Slow calls (a step-by-step reference) are timed over as few calls as fill a window, at least one."""
    window_seconds = min_seconds / windows
    start = time.perf_counter()
    for _ in range(3):
        fn()
    _sync(device)
    warmup_call = (time.perf_counter() - start) / 3
    n = max(1, min(calls, math.ceil(window_seconds / max(warmup_call, 1e-9))))
    while True:  # the calls per window: grow n until a window lasts long enough
        elapsed = _eager_window(fn, device, n)
        if elapsed >= window_seconds or n >= 100 * calls:
            break
        n *= 4
    per_call = [elapsed / n] + [_eager_window(fn, device, n) / n for _ in range(windows - 1)]
    return 1e3 * statistics.median(per_call)


def _eager_window(fn: Callable[[], object], device: torch.device, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return time.perf_counter() - start


def kernel_breakdown(fn: Callable[[], object], calls: int = 5, top: int | None = 12) -> list[dict]:
    """GPU time per call of each kernel fn launches (torch.profiler, eager calls), largest first (the top ones, or
    all with top None)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return [
        {"kernel": e.key[:100], "us": e.device_time_total / calls, "per_call": e.count / calls} for e in events[:top]
    ]


def first_call_seconds(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def peak_memory_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def copy_bandwidth_tbs(device: torch.device, nbytes: int = 2**28) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second), in TB/s.

    256 MiB each way, the size of the large benchmark cases' tensors. A 1 GiB copy (the size used before)
    ran at 2.44 TB/s on an H100 of the GPU machine, whatever the dtype, against 3.05-3.06 at 256 MiB (the target
    figure is 3.02), so the "of copy" fractions of earlier runs are about 25% too high."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times, _ = gpu_time_ms(lambda: dst.copy_(src), device, replays=20)
    return 2 * nbytes / (times["median"] * 1e-3) / 1e12


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """Measured bf16 matmul rate on random data, in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times, _ = gpu_time_ms(lambda: a @ b, device, replays=10)
    return 2 * n**3 / (times["median"] * 1e-3) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
