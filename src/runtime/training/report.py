"""The figures section of the training-step page and its plot, from the JSON files of runtime.training.benchmark.

    python -m runtime.training.report JSON [JSON ...] [--page docs/benchmark/training.md] [--plot training.png]

Several files (separate benchmark runs on the same GPU) are merged into one table, its rows grouped by model; with
more than one file each row names its run (1, 2, ... in the order given). Every ratio is taken within the row's own
run: the step times of separate runs are not side by side. Where the rows have more than one data layout (padded,
jagged), a layout column names each row's, and each jagged row gets its real tokens/s over that of the padded row of
the same model, preset and mode, and whether its loss curve is within the bound of the padded all-torch eager run's.
The page's section between its results markers is replaced (runtime.benchmark.pages, as for the op pages); without
--page the section is printed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from runtime.benchmark import pages

from .benchmark import planned_variants

GENERATOR = "runtime.training.report"
MODES = {"eager": "eager", "compile": "torch.compile", "cuda_graph": "CUDA graph", "tuned": "tuned"}
MODE_LABELS = {**MODES, "tuned": "tuned (max-autotune + CUDA graph)"}
TORCH = "torch"
# the benchmark keys a reproduce command always names (the plan), then those it names where they are not the default
PLAN_KEYS = ("models", "presets", "compiled", "graphed", "tuned")
OPTIONAL_KEYS = ("time_budget_s", "profile_steps", "loss_bound", "experiment_preset")
OPTIONAL_LISTS = ("layouts", "overrides")  # named (quoted) where not the default


@dataclass(frozen=True)
class Run:
    """One result file: its number in the merged table, its path (for the reproduce command) and how the page
    links it."""

    number: int
    path: str
    link: str
    result: dict


@dataclass(frozen=True)
class Row:
    run: Run
    entry: dict

    @property
    def model(self) -> str:
        return self.entry["model"]

    @property
    def accelerators(self) -> str:
        return self.entry["accelerators"]

    @property
    def mode(self) -> str:
        return self.entry["mode"]

    @property
    def layout(self) -> str | None:
        """padded or jagged; None in files from before the benchmark recorded it."""
        return self.entry.get("layout")

    @property
    def step_ms(self) -> float | None:
        return None if "error" in self.entry else self.entry.get("step_ms")


def merged_rows(runs: list[Run]) -> list[Row]:
    """Every run's rows, grouped by model (in order of first appearance), then by run, mode, preset and layout."""
    rows = [Row(run, entry) for run in runs for entry in run.result["runs"]]
    models = list(dict.fromkeys(r.model for r in rows))
    presets = list(dict.fromkeys(r.accelerators for r in rows))
    modes = list(MODES) + sorted({r.mode for r in rows} - set(MODES))
    layouts = list(dict.fromkeys(r.layout for r in rows))
    return sorted(
        rows,
        key=lambda r: (
            models.index(r.model),
            r.run.number,
            modes.index(r.mode),
            presets.index(r.accelerators),
            layouts.index(r.layout),
        ),
    )


def several_layouts(rows: list[Row]) -> bool:
    return len({r.layout for r in rows}) > 1


def _same_run_torch(rows: list[Row], row: Row) -> list[Row]:
    return [
        r
        for r in rows
        if r.run is row.run
        and r.model == row.model
        and r.layout == row.layout
        and r.accelerators == TORCH
        and r.step_ms is not None
    ]


def torch_eager(rows: list[Row], row: Row) -> Row | None:
    """The all-torch eager row of the row's model and layout in the row's run."""
    return next((r for r in _same_run_torch(rows, row) if r.mode == "eager"), None)


def fastest_torch(rows: list[Row], row: Row) -> Row | None:
    """The strongest torch setup of the row's model and layout in the row's run: its fastest torch-preset row (tuned,
    graphed, compiled, or eager where the run has no other)."""
    return min(_same_run_torch(rows, row), key=lambda r: r.step_ms, default=None)


def padded_twin(rows: list[Row], row: Row) -> Row | None:
    """For a jagged row, the padded row of the same run, model, preset and mode (the same samples, padded)."""
    if row.layout != "jagged":
        return None
    return next(
        (
            r
            for r in rows
            if r.run is row.run
            and r.layout == "padded"
            and (r.model, r.accelerators, r.mode) == (row.model, row.accelerators, row.mode)
            and r.step_ms is not None
        ),
        None,
    )


def _ratio(reference: Row | None, row: Row) -> str:
    if reference is None or row.step_ms is None:
        return ""
    return f"{reference.step_ms / row.step_ms:.2f}x"


def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "" if value is None else format(value * scale, spec) + suffix


def columns(numbered: bool, layouts: bool = False) -> list[str]:
    names = ["model", "accelerators", "mode", *(["layout"] if layouts else [])]
    names += ["ms/step", "samples/s", "real tokens/s", "MFU (%)", "peak MiB"]
    names += ["first step s", "vs torch eager", "vs fastest torch", "loss within bound"]
    names += ["real tokens/s vs padded", "loss within bound of padded"] if layouts else []
    return (["run"] if numbered else []) + names


def _yes_no(value, failed: bool) -> str:
    return "" if value is None or failed else ("yes" if value else "no")


def cells(rows: list[Row], row: Row, numbered: bool, layouts: bool = False) -> list[str]:
    e = row.entry
    failed = row.step_ms is None
    strongest = fastest_torch(rows, row)
    values = [
        row.model,
        row.accelerators,
        MODE_LABELS.get(row.mode, row.mode),
        *([row.layout or ""] if layouts else []),
        "failed" if failed else f"{row.step_ms:.2f}",
        "" if failed else _fmt(e.get("samples_per_s"), ",.0f"),
        "" if failed else _fmt(e.get("real_tokens_per_s"), ".2f", 1e-6, "M"),
        "" if failed else _fmt(e.get("mfu"), ".1f", 100),
        "" if failed else _fmt(e.get("peak_memory_mib"), ",.0f"),
        "" if failed else _fmt(e.get("first_step_s"), ".2f"),
        _ratio(torch_eager(rows, row), row),
        _ratio(strongest, row) + (f" ({MODES.get(strongest.mode, strongest.mode)})" if _ratio(strongest, row) else ""),
        _yes_no(e.get("loss_within_bound"), failed),
    ]
    if layouts:
        padded = padded_twin(rows, row)
        values += [
            "" if padded is None or failed else f"{e['real_tokens_per_s'] / padded.entry['real_tokens_per_s']:.2f}x",
            _yes_no(e.get("loss_within_bound_vs_padded"), failed),
        ]
    return ([str(row.run.number)] if numbered else []) + values


def table(runs: list[Run]) -> list[str]:
    """The merged table as Markdown lines."""
    numbered = len(runs) > 1
    rows = merged_rows(runs)
    layouts = several_layouts(rows)
    header = columns(numbered, layouts)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += [
        "| " + " | ".join(c.replace("|", "/") for c in cells(rows, row, numbered, layouts)) + " |" for row in rows
    ]
    return lines


def _per_run(runs: list[Run], text) -> str:
    """One value for all runs, or each run's value with its number where they differ (text: Run -> str)."""
    values = {run.number: text(run) for run in runs}
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return ", ".join(f"{value} (run {number})" for number, value in values.items())


def _environment(run: Run) -> str:
    env = dict(run.result.get("environment") or {})
    gpu = env.pop("gpu", None) or "no GPU"
    return f"{gpu}; " + ", ".join(f"{name} {version}" for name, version in env.items())


def _default_benchmark() -> dict:
    """configs/benchmark.yaml (also in the wheel, under runtime/configs)."""
    path = Path(__file__).resolve().parents[1] / "configs" / "benchmark.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}


def _value(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def command(bench: dict, output: str, defaults: dict | None = None) -> str:
    """The command that reproduces a result file, from the benchmark config it records: steps, warmup and the plan
    always, the other settings where they differ from the default, the kept JSON path as the output."""
    defaults = _default_benchmark() if defaults is None else defaults
    args = [f"{key}={_value(bench[key])}" for key in ("steps", "warmup") if key in bench]
    args += [
        f"{key}={_value(bench[key])}"
        for key in OPTIONAL_KEYS
        if key in bench and bench[key] != defaults.get(key) and bench[key] not in (None, 0)
    ]
    quoted = [f'"{key}={_value(bench[key])}"' for key in PLAN_KEYS if key in bench]
    quoted += [
        f'"{key}={_value(bench[key])}"' for key in OPTIONAL_LISTS if key in bench and bench[key] != defaults.get(key)
    ]
    return " ".join(["python -m runtime.training.benchmark", *args, *quoted, f"output={output}"])


def skipped_runs(run: Run, rows: list[Row]) -> list[str]:
    """The planned runs (model / preset / mode, and the layout where named) of a result file that have no row and that
    the benchmark did not leave out for a reason (its `skipped`): those the time budget skipped."""
    bench = run.result.get("benchmark")
    if not bench:
        return []
    cuda = bool((run.result.get("environment") or {}).get("gpu"))
    done = [(r.model, r.accelerators, r.mode, r.layout) for r in rows if r.run is run]
    done += [(s["model"], s["accelerators"], s["mode"], s["layout"]) for s in run.result.get("skipped") or []]
    planned = [
        (model, p, mode, layout) for p, mode, layout in planned_variants(bench, cuda) for model in bench["models"]
    ]
    return [
        f"{m} / {p} / {MODES.get(mode, mode)}" + ("" if layout == "default" else f" / {layout}")
        for m, p, mode, layout in planned
        if not any(d[:3] == (m, p, mode) and layout in ("default", d[3]) for d in done)
    ]


def left_out(run: Run) -> dict[str, list[str]]:
    """The runs the benchmark left out (a layout the model does not read, a CUDA graph over jagged batches), by
    reason."""
    reasons: dict[str, list[str]] = {}
    for s in run.result.get("skipped") or []:
        name = f"{s['model']} / {s['accelerators']} / {MODES.get(s['mode'], s['mode'])} / {s['layout']}"
        reasons.setdefault(s["reason"], []).append(name)
    return reasons


def _steps(run: Run) -> str:
    bench = run.result.get("benchmark") or {}
    if "steps" not in bench or "warmup" not in bench:
        return "the timed steps"
    return f"steps {bench['warmup'] + 1}-{bench['steps']}"


def _bound(run: Run) -> str:
    bound = run.result.get("loss_bound")
    return "not recorded" if bound is None else f"{bound:g}"


def figures(runs: list[Run], plot_link: str | None = None) -> str:
    """The generated figures section: where and with what it was measured, the commands, the merged table with the
    runs named under it, what the columns mean, the plot."""
    rows = merged_rows(runs)
    numbered = len(runs) > 1
    rate = _per_run(
        runs, lambda r: _fmt(r.result.get("bf16_matmul_tflops"), ".0f", suffix=" TFLOP/s") or "not measured"
    )
    lines = [
        f"- Measured on {_per_run(runs, _environment)}.",
        f"- bf16 matmul rate measured by the benchmark, the denominator of MFU: {rate}.",
        f"- Loss bound: {_per_run(runs, _bound)} (loss within bound: the mean loss over the last 50 steps within it of"
        " the same run's all-torch eager run).",
    ]
    for run in runs:
        where = f"Run {run.number}" if numbered else "The run"
        lines += [f"- {where} left out {', '.join(names)}: {reason}." for reason, names in left_out(run).items()]
        if run.result.get("skipped_after_budget"):
            skipped = skipped_runs(run, rows)
            budget = (run.result.get("benchmark") or {}).get("time_budget_s")
            lines.append(
                f"- {where} stopped at its time budget"
                + (f" (`time_budget_s={_value(budget)}`)" if budget else "")
                + ": some planned runs were skipped"
                + (f" ({', '.join(skipped)})." if skipped else ".")
            )
    lines.append("")
    for run in runs:
        source = f"Run {run.number}, [{run.link}]({run.link})" if numbered else f"[{run.link}]({run.link})"
        bench = run.result.get("benchmark")
        lines += [f"{source}, on the GPU machine:", ""]
        lines += [f"    {command(bench, run.path)}" if bench else "    (the file records no benchmark settings)", ""]
    lines += table(runs)
    lines.append("")
    if numbered:
        repeated = {}
        for r in rows:
            if r.step_ms is not None:
                repeated.setdefault((r.model, r.accelerators, MODES.get(r.mode, r.mode)), []).append(r)
        same = [
            " / ".join(key) + ": " + ", ".join(f"{r.step_ms:.2f} ms in run {r.run.number}" for r in group)
            for key, group in repeated.items()
            if len({r.run.number for r in group}) > 1
        ]
        lines += [
            "Runs: "
            + "; ".join(f"{run.number} = [{run.link}]({run.link})" for run in runs)
            + ". Each ratio is within its row's own run; ratios and step times of different runs are not side by"
            " side (separate processes)."
            + (f" Setups measured in more than one run: {'; '.join(same)}." if same else ""),
            "",
        ]
    lines += [
        f"ms/step: the mean over {_per_run(runs, _steps)} (forward, loss, backward, clipping, AdamW). Real tokens: "
        "history events (and the target token of the causal models), no padding. First step s: the first step's wall "
        "time (compilation: torch.compile's in compiled and tuned runs, Triton's in the first run to launch a kernel). vs torch eager: that run's all-torch eager step time over the row's (above 1: faster). vs "
        "fastest torch: the fastest torch-preset row of the model in that run (its mode in brackets) over the row's. "
        "Tuned: torch.compile(mode=max-autotune-no-cudagraphs) of the model captured inside the whole-step CUDA graph."
        + (
            " Layout: the batches' layout, padded (histories padded to data.seq_len) or jagged (packed, cu_seqlens, no "
            "padding); with `layouts=[padded,jagged]` both hold the same samples, and the ratios to torch and the loss "
            "bound are within the row's layout. Real tokens/s vs padded: the jagged row's real tokens/s over the padded "
            "row's of the same model, preset and mode (above 1: jagged is faster). Loss within bound of padded: the "
            "jagged row's mean loss over the last 50 steps within the bound of the padded all-torch eager run's."
            if several_layouts(rows)
            else ""
        ),
    ]
    notes = [
        f"- Run {r.run.number} {r.model} / {r.accelerators} / {MODES.get(r.mode, r.mode)}: " + message
        for r in rows
        for message in ([r.entry["error"][:300]] if "error" in r.entry else [])
        + [f"fell back to torch: {m}" for m in r.entry.get("fallbacks") or []]
    ]
    if notes:
        lines += ["", "Failures and fallbacks (a fallback times torch for that op):", "", *notes]
    if plot_link:
        lines += ["", f"![step time per preset and mode, per model]({plot_link})"]
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> Path:
    """The step-time plot: one panel per model, a bar per preset and mode (and run), torch beside ours."""
    from .plot import StepBar, plot_step_times

    numbered = len(runs) > 1
    rows = merged_rows(runs)
    layouts = several_layouts(rows)
    groups: dict[str, list] = {}
    for row in rows:
        if row.step_ms is None:
            continue
        label = (
            f"{row.accelerators} / {MODES.get(row.mode, row.mode)}"
            + (f" / {row.layout}" if layouts else "")
            + (f" (run {row.run.number})" if numbered else "")
        )
        groups.setdefault(row.model, []).append(StepBar(label, row.step_ms, row.accelerators, row.run.number))
    gpu = _per_run(runs, lambda r: (r.result.get("environment") or {}).get("gpu") or "CPU")
    note = "; runs are not side by side" if numbered else ""
    return plot_step_times(groups, path, title=f"Training step time, {gpu}{note}")


def load(paths: list[str], page: str | None = None) -> list[Run]:
    return [
        Run(
            i,
            path,
            pages.link_from_page(path, page) if page else path,
            pages.read_result(path, ("runs",), "python -m runtime.training.benchmark"),
        )
        for i, path in enumerate(paths, 1)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Render training-benchmark JSON files (merged, runs numbered) as the training page's figures"
    )
    parser.add_argument("json", nargs="+", help="result files of python -m runtime.training.benchmark")
    parser.add_argument("--page", help="put the figures section into this Markdown page (between the results markers)")
    parser.add_argument("--plot", help="write the step-time plot to this PNG file")
    args = parser.parse_args(argv)
    runs = load(args.json, args.page)
    plot_link = None
    if args.plot:
        try:
            plot(runs, Path(args.plot))
        except ImportError as error:
            parser.exit(2, f"plotting needs matplotlib ({error}): pip install 'taac-runtime[plot]'\n")
        plot_link = pages.link_from_page(args.plot, args.page)
    section = figures(runs, plot_link)
    if args.page:
        pages.update_page(Path(args.page), section, GENERATOR)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
