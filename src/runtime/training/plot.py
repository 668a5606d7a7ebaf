"""Training plots. Curves: the loss and every validation metric over steps, one panel each, runs overlaid.

    python -m runtime.training.plot RUN_DIR [RUN_DIR ...] [-o curves.png]

reads each run's metrics.json. Step times of the training-step benchmark, ours beside torch: plot_step_times, drawn
by runtime.training.report. matplotlib (the extra taac-runtime[plot]) is imported only when a plot is drawn, with
the Agg canvas (no display).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from runtime.benchmark.pages import OUR_COLOURS, PEER_COLOURS, PEER_HATCH, new_figure, save_figure

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
    series = {label: _series(metrics) for label, metrics in runs.items()}
    keys = [k for k in LABELS if any(k in s for s in series.values())]
    keys += sorted({k for s in series.values() for k in s} - set(keys))
    columns = min(3, max(1, len(keys)))
    rows = max(1, math.ceil(len(keys) / columns))
    figure = new_figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
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
    return save_figure(figure, path, dpi=100)


@dataclass(frozen=True)
class StepBar:
    """One bar of the step-time plot: a benchmark run's label (preset, mode, run), its ms per step, its preset and
    the number of the result file it is from (bars of different files are set apart by a dotted line)."""

    label: str
    step_ms: float
    accelerators: str
    run: int = 1


def plot_step_times(groups: dict[str, list[StepBar]], path: Path | str, title: str = "") -> Path:
    """groups: model -> its bars, top to bottom. One panel of horizontal bars per model on a shared ms axis; the
    torch preset hatched in cool colours, ours (every other preset) solid in warm colours, one colour per preset.
    Writes a PNG and returns its path."""
    groups = {model: bars for model, bars in groups.items() if bars}
    presets = list(dict.fromkeys(bar.accelerators for bars in groups.values() for bar in bars))
    torch_presets = [p for p in presets if p == "torch"]
    ours = [p for p in presets if p != "torch"]
    colours = dict(zip(torch_presets, PEER_COLOURS)) | {
        p: OUR_COLOURS[i % len(OUR_COLOURS)] for i, p in enumerate(ours)
    }
    heights = [len(bars) for bars in groups.values()] or [1]
    figure = new_figure(figsize=(8.5, 1.0 + 0.32 * sum(heights) + 0.5 * len(heights)), layout="constrained")
    axes = figure.subplots(len(heights), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    longest = max((bar.step_ms for bars in groups.values() for bar in bars), default=1.0)
    for ax, (model, bars) in zip(axes, groups.items()):
        for y, bar in enumerate(bars):
            if y and bar.run != bars[y - 1].run:
                ax.axhline(y - 0.5, color="grey", linestyle=":", linewidth=0.8)
            ours_bar = bar.accelerators in ours
            ax.barh(
                y,
                bar.step_ms,
                0.7,
                color=colours[bar.accelerators],
                hatch=None if ours_bar else PEER_HATCH,
                edgecolor="white" if ours_bar else "black",
                linewidth=0.4,
            )
            ax.text(bar.step_ms + 0.01 * longest, y, f"{bar.step_ms:.2f}", va="center", fontsize=7)
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels([bar.label for bar in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(model, fontsize=9, loc="left")
        ax.grid(axis="x", linewidth=0.3)
        ax.set_xlim(0, longest * 1.12)
    axes[-1].set_xlabel("ms per training step (lower is faster)")
    if title:
        figure.suptitle(title, fontsize=9)
    if presets:
        from matplotlib.patches import Patch

        handles = [
            Patch(
                facecolor=colours[p],
                hatch=None if p in ours else PEER_HATCH,
                edgecolor="white" if p in ours else "black",
                label=f"{p} (ours)" if p in ours else p,
            )
            for p in presets
        ]
        figure.legend(handles=handles, fontsize=8, ncol=len(presets), loc="outside lower center", frameon=False)
    return save_figure(figure, path, dpi=110)


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
