"""Tables from benchmark results: on the terminal (rich) and as Markdown pages for docs/benchmark/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


COLUMNS = ("shape", "mode", "impl", "status", "GPU ms (p20-p80)", "eager ms", "TB/s", "of copy", "TFLOP/s", "of matmul", "max rel err", "peak MB", "1st call s")


def row_cells(row: dict) -> list[str]:
    gpu = row.get("gpu_ms")
    gpu_cell = f"{gpu['median']:.4f} ({gpu['p20']:.4f}-{gpu['p80']:.4f})" if gpu else ""
    errors = row.get("errors") or {}
    status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
    return [
        row["shape"],
        row["mode"],
        row["impl"],
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


def header(result: dict) -> str:
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    ceilings = []
    if result.get("copy_tbs"):
        ceilings.append(f"copy bandwidth {result['copy_tbs']:.2f} TB/s")
    if result.get("matmul_tflops"):
        ceilings.append(f"bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s")
    return f"commit {env['commit']}, {env['gpu'] or result['device']}, {versions}" + (f"; measured {', '.join(ceilings)}" if ceilings else "")


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header(result))
    for column in COLUMNS:
        table.add_column(column)
    for row in result["rows"]:
        table.add_row(*row_cells(row))
    Console(width=240).print(table)


def markdown(results: list[dict]) -> str:
    lines = []
    for result in results:
        lines += [f"`{result['command']}`", "", header(result), "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row_cells(row)) + " |" for row in result["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Render benchmark JSON files as one Markdown results section")
    parser.add_argument("json", nargs="+")
    parser.add_argument("--out", help="write here (default: stdout)")
    args = parser.parse_args(argv)
    text = markdown([json.loads(Path(p).read_text()) for p in args.json])
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
