"""Benchmark rows grouped per (shape, dtype, mode): our kernel backends beside the peers, as the reports and plots
compare them."""

from __future__ import annotations

from dataclasses import dataclass, field

KERNEL_BACKENDS = ("triton", "tilelang")
BACKENDS = ("torch", *KERNEL_BACKENDS)  # what "auto" chooses from
AUTO_SLACK = 1.05  # auto counts as choosing the fastest backend within 5% of its time


@dataclass
class Comparison:
    """One (shape, dtype, mode) of the results: each implementation's time in ms (None: not timed, its status in
    `status`), which are ours (the kernel backends) and which are peers, in the order they were measured. The torch
    backend is neither: it is the reference the others are checked against."""

    shape: str
    dtype: str
    mode: str
    ms: dict[str, float | None] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    ours: list[str] = field(default_factory=list)
    peers: list[str] = field(default_factory=list)
    not_graphed: set[str] = field(default_factory=set)  # GPU time of eager launches: the pass could not be captured

    def best(self, names: list[str]) -> tuple[str, float] | None:
        timed = [(self.ms[n], n) for n in names if self.ms.get(n) is not None]
        return (min(timed)[1], min(timed)[0]) if timed else None

    def speedup(self) -> float | None:
        """Best peer's time over the best of ours: above 1, ours is faster."""
        ours, peer = self.best(self.ours), self.best(self.peers)
        return peer[1] / ours[1] if ours and peer else None

    def auto_ratio(self) -> float | None:
        """The fastest backend's time over auto's (1: auto took the fastest; below 1/AUTO_SLACK: a slower one), where
        auto and a backend were timed."""
        fastest = self.best([name for name in BACKENDS if name in self.ms])
        auto = self.ms.get("auto")
        return fastest[1] / auto if fastest and auto else None


def auto_summary(comparisons: list[Comparison]) -> str | None:
    """How often auto ran within AUTO_SLACK of the fastest backend, and its worst row; None without auto rows."""
    ratios = [(c.auto_ratio(), c) for c in comparisons if c.auto_ratio() is not None]
    if not ratios:
        return None
    good = sum(ratio * AUTO_SLACK >= 1 for ratio, _ in ratios)
    worst, row = min(ratios, key=lambda pair: pair[0])
    return (
        f"auto ran within {AUTO_SLACK - 1:.0%} of the fastest backend on {good} of {len(ratios)} rows; worst: "
        f"{worst:.2f} ({row.shape}, {row.mode})"
    )


def _is_ours(row: dict) -> bool:
    return row.get("kind", "backend") == "backend" and row["impl"] in KERNEL_BACKENDS


def _is_peer(row: dict) -> bool:
    return row.get("kind") == "peer"


def uses_gpu_time(results: list[dict]) -> bool:
    return any(row.get("gpu_ms") for result in results for row in result["rows"])


def _time(row: dict, gpu: bool) -> float | None:
    if gpu:
        return row["gpu_ms"]["median"] if row.get("gpu_ms") else None
    return row.get("eager_ms")


def compare(results: list[dict]) -> list[Comparison]:
    """Every row of the results grouped by (shape, dtype, mode), in first-seen order; GPU time (median) when the
    results have it, else eager time. A later result's row replaces an earlier one of the same implementation. Where
    the results hold several ops (gelu and silu on one page), the shape is named "op shape"."""
    gpu = uses_gpu_time(results)
    several_ops = len({row.get("op") for result in results for row in result["rows"]}) > 1
    groups: dict[tuple[str, str, str], Comparison] = {}
    for result in results:
        for row in result["rows"]:
            shape = f"{row.get('op')} {row['shape']}" if several_ops else row["shape"]
            key = (shape, row.get("dtype", ""), row["mode"])
            group = groups.setdefault(key, Comparison(*key))
            group.ms[row["impl"]] = _time(row, gpu) if row["status"] == "ok" else None
            group.status[row["impl"]] = row["status"]
            if gpu and not row.get("graph", True):
                group.not_graphed.add(row["impl"])
            names = group.ours if _is_ours(row) else group.peers if _is_peer(row) else None
            if names is not None and row["impl"] not in names:
                names.append(row["impl"])
    return list(groups.values())
