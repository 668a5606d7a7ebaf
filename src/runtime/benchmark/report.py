"""Tables from benchmark results: on the terminal (rich), and the figures section of a docs/benchmark/ page (GPU
time per implementation, the best of ours against the best peer) with its plot (runtime.benchmark.plot)."""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

from . import pages
from .comparison import auto_summary, compare, uses_gpu_time


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


COLUMNS = (
    "shape",
    "mode",
    "impl",
    "status",
    "GPU ms (p20-p80)",
    "eager ms",
    "TB/s",
    "of copy",
    "TFLOP/s",
    "of matmul",
    "max rel err",
    "peak MB",
    "1st call s",
)


def row_cells(row: dict) -> list[str]:
    gpu = row.get("gpu_ms")
    gpu_cell = f"{gpu['median']:.4f} ({gpu['p20']:.4f}-{gpu['p80']:.4f})" if gpu else ""
    round_medians = (row.get("rounds") or {}).get("gpu_ms")
    if round_medians:
        gpu_cell += f", {len(round_medians)} rounds {min(round_medians):.4f}-{max(round_medians):.4f}"
    errors = row.get("errors") or {}
    status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
    return [
        row["shape"],
        row["mode"],
        impl_label(row),
        status,
        gpu_cell + ("" if row.get("graph", True) else " (no graph)"),
        _fmt(row.get("eager_ms"), ".4f"),
        _fmt(row.get("tbs"), ".2f"),
        _fmt(row.get("frac_copy"), ".0%"),
        _fmt(row.get("tflops"), ".0f"),
        _fmt(row.get("frac_matmul"), ".0%"),
        _fmt(max(errors.values()) if errors else None, ".1e"),
        _fmt(row.get("peak_mem_mb"), ".1f"),
        _fmt(row.get("first_call_s"), ".2f"),
    ]


def impl_label(row: dict) -> str:
    """The implementation as the tables name it: peers marked "(peer)", the torch backend "(reference)" (the float32
    reference the others are checked against, not torch's native op, which is the "torch eager" peer)."""
    if row.get("kind") == "peer":
        return f"{row['impl']} (peer)"
    return f"{row['impl']} (reference)" if row["impl"] == "torch" else row["impl"]


def shown_columns(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The columns with a value in some row (a CPU run has no GPU time, bandwidth or FLOP/s) and the rows' cells."""
    cells = [row_cells(row) for row in rows]
    keep = [i for i, column in enumerate(COLUMNS) if i < 4 or any(row[i] for row in cells)]
    return [COLUMNS[i] for i in keep], [[row[i] for i in keep] for row in cells]


def header(result: dict) -> str:
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    ceilings = []
    if result.get("copy_tbs"):
        ceilings.append(f"copy bandwidth {result['copy_tbs']:.2f} TB/s")
    if result.get("matmul_tflops"):
        ceilings.append(f"bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s")
    return f"commit {env['commit']}, {env['gpu'] or result['device']}, {versions}" + (
        f"; measured {', '.join(ceilings)}" if ceilings else ""
    )


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header(result))
    columns, rows = shown_columns(result["rows"])
    for column in columns:
        table.add_column(column)
    for cells in rows:
        table.add_row(*cells)
    console = Console(width=240)
    console.print(table)
    for row in result["rows"]:
        if row.get("kernels"):
            console.print(
                f"{row['shape']} {row['mode']} {row['impl']}: kernels, GPU us per call (eager, torch.profiler)"
            )
            for k in row["kernels"]:
                console.print(f"  {k['us']:9.1f}  x{k['per_call']:<5g} {k['kernel']}", markup=False, highlight=False)


def markdown(results: list[dict]) -> str:
    lines = []
    for result in results:
        columns, rows = shown_columns(result["rows"])
        lines += [
            f"`{result['command']}`",
            "",
            header(result),
            "",
            "| " + " | ".join(columns) + " |",
            "|" + " --- |" * len(columns),
        ]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in rows]
        lines.append("")
    return "\n".join(lines)


def write_csv(result: dict, path: Path) -> None:
    """The result's rows as a CSV table, every column (as the printed table, plus the op and dtype)."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["op", "dtype", *COLUMNS])
        for row in result["rows"]:
            writer.writerow([row.get("op", ""), row.get("dtype", ""), *row_cells(row)])


GENERATOR = "runtime.benchmark.report"
BEGIN, END = pages.begin_marker(GENERATOR), pages.END


def _environment_line(result: dict) -> str:
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return f"{env['gpu'] or result['device']}; {versions}" + (f"; source {env['commit']}" if env.get("commit") else "")


NOT_GRAPHED = " \u2020"  # a dagger after a time measured without CUDA-graph replay


def figures(results: list[dict], plot_name: str | None = None) -> str:
    """The generated figures section of an op's page: where it was measured, the commands, one table of time per
    implementation with the speed-up of the best of ours over the best peer, and the plot."""
    comparisons = compare(results)
    unit = (
        "GPU ms (CUDA-graph replay, median)"
        if uses_gpu_time(results)
        else "eager ms per call (no GPU time in these results)"
    )
    ours = [n for c in comparisons for n in c.ours]
    peers = [n for c in comparisons for n in c.peers]
    others = [n for c in comparisons for n in c.ms if n not in c.ours and n not in c.peers]
    impls = list(dict.fromkeys(ours + others + peers))
    lines = [f"Measured on {line}." for line in dict.fromkeys(_environment_line(r) for r in results)]
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in results] + [""]
    lines += [
        f"Time: {unit}; the last column is the best peer's time over the best of ours (above 1: ours is faster).",
        "",
    ]
    summary = auto_summary(comparisons)
    header = ["shape", "dtype", "mode", *(f"{n} (peer)" if n in peers else n for n in impls), "ours vs best peer"]
    header += ["fastest backend / auto"] if summary else []
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for c in comparisons:
        cells = [c.shape, c.dtype, c.mode]
        for name in impls:
            mark = NOT_GRAPHED if name in c.not_graphed else ""
            cells.append(
                "" if name not in c.ms else c.status[name] if c.ms[name] is None else f"{c.ms[name]:.4f}{mark}"
            )
        speedup, best_ours, best_peer = c.speedup(), c.best(c.ours), c.best(c.peers)
        cells.append(f"{speedup:.2f}x ({best_ours[0]} vs {best_peer[0]})" if speedup is not None else "")
        if summary:
            cells.append(f"{c.auto_ratio():.2f}" if c.auto_ratio() is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    if any(c.not_graphed for c in comparisons):
        lines += [
            "",
            f"{NOT_GRAPHED.strip()}: GPU time of eager launches (the pass could not be captured in a CUDA graph).",
        ]
    if summary:
        lines += ["", summary[0].upper() + summary[1:] + "."]
    if plot_name:
        lines += ["", f"![ours beside the peers]({plot_name})"]
    return "\n".join(lines)


def _with_kept_path(result: dict, path: str) -> dict:
    """The result with its command writing to `path`, where the JSON is kept, instead of the run's scratch path."""
    return {**result, "command": re.sub(r"--json \S+", f"--json {path}", result["command"])}


RESULT_KEYS = ("command", "environment", "device", "rows")
ROW_KEYS = ("shape", "mode", "impl", "status")


def load_result(path: str) -> dict:
    """A benchmark result JSON file, checked for what the report reads (pages.read_result), with at least one row."""
    result = pages.read_result(path, RESULT_KEYS, "taac-benchmark --json")
    rows = result["rows"]
    if not isinstance(rows, list) or not rows:
        raise SystemExit(f"{path}: holds no rows; expected at least one measured case")
    for index, row in enumerate(rows):
        lacking = [key for key in ROW_KEYS if key not in row] if isinstance(row, dict) else list(ROW_KEYS)
        if lacking:
            raise SystemExit(f"{path}: row {index} lacks {lacking}; every row needs {list(ROW_KEYS)}")
    return result


def update_page(page: Path, section: str) -> None:
    """Replace the generated results section of a hand-written op page (appended if the page has none)."""
    pages.update_page(page, section, GENERATOR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Render benchmark JSON files as an op page's figures section and plot")
    parser.add_argument("json", nargs="+")
    parser.add_argument("--page", help="put the figures section into this Markdown page (between the results markers)")
    parser.add_argument("--plot", help="write the plot of ours beside the peers to this PNG file")
    parser.add_argument("--full", action="store_true", help="print every column of every row instead")
    args = parser.parse_args(argv)
    results = [_with_kept_path(load_result(p), p) for p in args.json]
    if args.full:
        print(markdown(results))
        return 0
    plot_name = None
    if args.plot:
        from .plot import plot_speedups

        plot_speedups(results, Path(args.plot))
        plot_name = pages.link_from_page(args.plot, args.page)
    section = figures(results, plot_name)
    if args.page:
        update_page(Path(args.page), section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
