"""Metric loggers (the `logger` config group): each log step's loss, gradient norm, learning rate and throughput
and every validation result, as they come. A logger that fails while writing is disabled with one warning: it
never stops training."""

from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path

from .checkpoint import write_atomically
from .config import LoggerKind

logger = logging.getLogger("runtime.training")

CSV_COLUMNS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "samples_per_s",
    "step_ms",
    "val_auc",
    "val_logloss",
    "val_ne",
    "val_calibration",
    "val_gauc",
)


class CsvLogger:
    """<run dir>/metrics.csv: one row per call, the columns CSV_COLUMNS (empty where a row has no value).

    history (a resumed run: the checkpoint's rows, as history_rows gives them): at the first row the file is rewritten
    to hold exactly those rows before it, so rows a killed run logged after its last checkpoint are not kept beside the
    resumed run's, and a run resumed into another directory starts its file with the rows before the checkpoint."""

    def __init__(self, run_dir: Path, history: list[tuple[int, dict]] | None = None) -> None:
        self.path = Path(run_dir) / "metrics.csv"
        self.history = history
        self.file = None
        self.writer = None
        if history is None:
            self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.history is not None:
            text = io.StringIO(newline="")
            writer = csv.DictWriter(text, CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for step, values in self.history:
                writer.writerow({**values, "step": step})
            data = text.getvalue().encode()
            write_atomically(self.path, lambda file: file.write(data))
            self.history = None
        new = not self.path.exists()
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 - kept open for the run
        self.writer = csv.DictWriter(self.file, CSV_COLUMNS, extrasaction="ignore")
        if new:
            self.writer.writeheader()

    def write(self, step: int, values: dict) -> None:
        if self.file is None:
            self._open()
        self.writer.writerow({**values, "step": step})
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def has_event_files(directory: Path) -> bool:
    """Whether directory holds TensorBoard event files (TensorBoardLogger writes one once it has a row)."""
    return directory.is_dir() and any(path.name.startswith("events.") for path in directory.iterdir())


class TensorBoardLogger:
    """TensorBoard scalars in <run dir>/tensorboard (train/<key>, val/<key>), the event file opened at the first row.

    history (a resumed run: the checkpoint's rows, as history_rows gives them, the last at the checkpoint's step): where
    the directory holds earlier event files, the file starts with a purge from the step after the checkpoint's (or
    from the first row's, if earlier), which TensorBoard applies to the earlier files, so the rows a killed run logged
    after its last checkpoint are not shown beside the resumed run's; the history rows from that step are written
    again. Into a directory without event files (a run resumed into another directory) every history row is written
    first."""

    def __init__(self, run_dir: Path, history: list[tuple[int, dict]] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                f"logger=tensorboard needs the tensorboard package ({error}); install the extra: "
                "pip install 'taac-runtime[tensorboard]', or choose logger=csv"
            ) from None
        self.summary_writer = SummaryWriter
        self.directory = Path(run_dir) / "tensorboard"
        self.history = history
        self.writer = None

    def _open(self, step: int) -> None:
        history, self.history = self.history, None
        purge_step = None
        if history is not None and has_event_files(self.directory):
            purge_step = min(step, max((row_step + 1 for row_step, _ in history), default=step))
            history = [(row_step, values) for row_step, values in history if row_step >= purge_step]
        self.writer = self.summary_writer(str(self.directory), purge_step=purge_step)
        for row_step, values in history or []:
            self._add(row_step, values)

    def write(self, step: int, values: dict) -> None:
        if self.writer is None:
            self._open(step)
        self._add(step, values)
        self.writer.flush()

    def _add(self, step: int, values: dict) -> None:
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                tag = f"val/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def history_rows(metrics: dict) -> list[tuple[int, dict]]:
    """The (step, values) rows a run's metrics (metrics.json's "log" and "validation") were logged as, in the order
    the loop writes them: by step, a step's training entry before its validation."""
    rows = [(entry["step"], 0, entry) for entry in metrics["log"]]
    rows += [(entry["step"], 1, entry) for entry in metrics["validation"]]
    return [(step, entry) for step, _, entry in sorted(rows, key=lambda row: row[:2])]


class MetricLogger:
    """The configured logger behind a guard: the first exception it raises is logged as a warning and the logger is
    disabled for the rest of the run. history: a resumed run's rows so far (see CsvLogger and TensorBoardLogger)."""

    def __init__(
        self, kind: LoggerKind | str, run_dir: Path, enabled: bool = True, history: list[tuple[int, dict]] | None = None
    ) -> None:
        kind = kind if isinstance(kind, LoggerKind) else LoggerKind(str(kind))
        self.kind = kind
        self.sink = None
        if enabled and kind is LoggerKind.csv:
            self.sink = CsvLogger(run_dir, history)
        elif enabled and kind is LoggerKind.tensorboard:
            self.sink = TensorBoardLogger(run_dir, history)

    def write(self, step: int, values: dict) -> None:
        self._guarded("write", lambda: self.sink.write(step, values))

    def close(self) -> None:
        self._guarded("close", lambda: self.sink.close())
        self.sink = None

    def _guarded(self, what: str, call) -> None:
        if self.sink is None:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a metrics sink never stops training
            logger.warning(
                "logger=%s failed to %s (%s: %s); it is disabled for the rest of the run",
                self.kind.value,
                what,
                type(error).__name__,
                error,
            )
            self.sink = None
