"""Training curves: the loss and every validation metric over steps, one panel each, runs overlaid.

    python -m runtime.training.plot RUN_DIR [RUN_DIR ...] [-o curves.png]

Reads each run's metrics.json. matplotlib (the extra taac-runtime[plot]) is imported only when a plot is drawn,
with the Agg canvas (no display).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

LABELS = {
    "loss": "training loss",
    "val_auc": "validation AUC",
    "val_gauc": "validation GAUC",
    "val_logloss": "validation log-loss",
    "val_ne": "validation normalized entropy",
    "val_calibration": "validation calibration",
}


def _series(metrics: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Panel key -> (steps, values): the loss per log window, then each validation metric."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for source, keys in ((metrics.get("log", []), ("loss",)), (metrics.get("validation", []), None)):
        for entry in source:
            for key in keys or [k for k in entry if k.startswith("val_")]:
                value = entry.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    steps, values = out.setdefault(key, ([], []))
                    steps.append(entry["step"])
                    values.append(value)
    return out


def plot_runs(runs: dict[str, dict], path: Path | str) -> Path:
    """runs: label -> metrics (the content of a metrics.json). Writes one PNG with a panel per curve and returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = {label: _series(metrics) for label, metrics in runs.items()}
    keys = [k for k in LABELS if any(k in s for s in series.values())]
    keys += sorted({k for s in series.values() for k in s} - set(keys))
    columns = min(3, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / columns))
    figure = Figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for ax, key in zip(axes, keys):
        for label, curves in series.items():
            if key in curves:
                steps, values = curves[key]
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label)
        ax.set_title(LABELS.get(key, key), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    if keys and len(runs) > 1:
        axes[0].legend(fontsize=8)
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


def read_metrics(run_dir: Path | str) -> dict:
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.json; expected a taac-train run directory")
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Overlay the training curves of taac-train runs in one PNG.")
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with metrics.json)")
    parser.add_argument("-o", "--output", default="curves.png", help="the PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    try:
        runs = {str(d): read_metrics(d) for d in args.run_dirs}
    except FileNotFoundError as error:
        parser.error(str(error))
    try:
        path = plot_runs(runs, args.output)
    except ImportError as error:
        parser.exit(2, f"plotting needs matplotlib ({error}): pip install 'taac-runtime[plot]'\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
