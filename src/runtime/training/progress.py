"""A progress bar with loss and throughput (rich), or periodic log lines where rich is missing or off."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("runtime.training")


class ProgressBar:
    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
            except ImportError:
                logger.info("rich is not installed: progress is logged every log_every steps instead of a bar")
            else:
                self._bar = Progress(
                    TextColumn("[bold]train"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"),
                    TextColumn("{task.fields[speed]}"),
                    TimeElapsedColumn(),
                    TimeRemainingColumn(),
                )
                self._task = self._bar.add_task("train", total=total, completed=start, loss="-", speed="-")
                streams = (sys.stdout, sys.stderr)
                self._bar.start()  # rich redirects sys.stdout and sys.stderr above the bar while it shows
                self._rerouted = _reroute_log_handlers(streams, (sys.stdout, sys.stderr))

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def update(self, loss: float, samples_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, loss=f"{loss:.4f}", speed=f"{samples_per_s:,.0f} samples/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            for handler, stream in self._rerouted:
                handler.setStream(stream)


def _reroute_log_handlers(old: tuple, new: tuple) -> list[tuple[logging.StreamHandler, object]]:
    """Points the root logger's console handlers (Hydra's job logging among them), which hold the terminal streams
    from before the bar started, at rich's redirected streams, so log lines print above the bar instead of through
    it. Returns (handler, its stream before) to undo it."""
    rerouted = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            for before, after in zip(old, new):
                if handler.stream is before and after is not before:
                    rerouted.append((handler, handler.setStream(after)))
                    break
    return rerouted
