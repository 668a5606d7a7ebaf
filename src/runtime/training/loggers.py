"""Metric loggers (the `logger` config group): each log step's loss, gradient norm, learning rate and throughput
and every validation result, as they come. A logger that fails while writing is disabled with one warning: it
never stops training."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

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
    """<run dir>/metrics.csv: one row per call, the columns CSV_COLUMNS (empty where a row has no value)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 - kept open for the run
        self.writer = csv.DictWriter(self.file, CSV_COLUMNS, extrasaction="ignore")
        if new:
            self.writer.writeheader()

    def write(self, step: int, values: dict) -> None:
        self.writer.writerow({**values, "step": step})
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """TensorBoard scalars in <run dir>/tensorboard (train/<key>, val/<key>)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                f"logger=tensorboard needs the tensorboard package ({error}); install the extra: "
                "pip install 'taac-runtime[tensorboard]', or choose logger=csv"
            ) from None
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, values: dict) -> None:
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                tag = f"val/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricLogger:
    """The configured logger behind a guard: the first exception it raises is logged as a warning and the logger is
    disabled for the rest of the run."""

    def __init__(self, kind: LoggerKind | str, run_dir: Path, enabled: bool = True) -> None:
        kind = kind if isinstance(kind, LoggerKind) else LoggerKind(str(kind))
        self.kind = kind
        self.sink = None
        if enabled and kind is not LoggerKind.none:
            self.sink = (CsvLogger if kind is LoggerKind.csv else TensorBoardLogger)(run_dir)

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
