"""A progress bar with loss and throughput (rich), or periodic log lines where rich is missing or off."""

from __future__ import annotations

import logging

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
                self._bar.start()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def update(self, loss: float, samples_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, loss=f"{loss:.4f}", speed=f"{samples_per_s:,.0f} samples/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
