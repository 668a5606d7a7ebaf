"""taac-benchmark CLI: python -m runtime.benchmark --operator rms_norm --device cuda --backends torch,triton,tilelang"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import tempfile
from pathlib import Path

import torch

from ..accelerators.autotune import CACHE_DIR_ENV
from ..accelerators.backends import triton_interpret
from . import ops as ops_package
from .case import Case
from .runner import MODES, Machine, environment, merge_rounds, run_case

BACKENDS = ("torch", "triton", "tilelang")  # the default selection
SELECTABLE = (*BACKENDS, "auto")  # auto: the op's own choice, timed as a row beside the backends it chooses from
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def all_cases() -> dict[str, list[Case]]:
    """Operator name -> its cases, from every module in runtime.benchmark.ops (each exposes CASES)."""
    cases: dict[str, list[Case]] = {}
    for module in pkgutil.iter_modules(ops_package.__path__):
        for case in importlib.import_module(f"{ops_package.__name__}.{module.name}").CASES:
            cases.setdefault(case.op, []).append(case)
    return cases


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="taac-benchmark", description=__doc__)
    parser.add_argument("--operator", help="op to measure (see --list)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--backends",
        help="comma-separated backends (default: torch,triton,tilelang on CUDA, those that run on the CPU there); "
        "auto adds a row for the op's own choice (on CUDA measured in this run, in a fresh decisions file unless "
        f"${CACHE_DIR_ENV} is set)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--shape", default="all", help="a shape preset of the op (see --list), or all")
    parser.add_argument("--mode", default="both", choices=[*MODES, "both"])
    parser.add_argument("--no-peers", action="store_true", help="time only our backends")
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--list", action="store_true", help="list operators and shape presets")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every implementation of a case this many times, round after round, and report the median round "
        "(for rows within a few tenths of a percent of each other)",
    )
    parser.add_argument("--kernels", action="store_true", help="also profile each row's kernels (GPU time per call)")
    parser.add_argument("--dry-run", action="store_true", help="resolve the selection and print it, measure nothing")
    return parser.parse_args(argv)


def _device(name: str) -> torch.device | None:
    """The --device as a torch.device, or None after saying on stderr why it cannot be used here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        print(f"taac-benchmark: unknown device {name!r}; expected cpu, cuda or cuda:N", file=sys.stderr)
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"taac-benchmark: --device {name}: CUDA is not available here; use --device cpu --dtype float32",
            file=sys.stderr,
        )
        return None
    return device


def _cpu_reason(backend: str) -> str | None:
    """Why a backend cannot run on the CPU, or None."""
    if backend == "tilelang":
        return "tilelang compiles CUDA kernels only"
    if backend == "triton" and not triton_interpret():
        return "triton runs on the CPU only under its interpreter (set TRITON_INTERPRET=1 before the run)"
    return None


def _backends(requested: str | None, device: torch.device) -> list[str] | None:
    """The backends to time, or None after saying on stderr why the selection cannot run."""
    if requested is None:  # the default: every backend that can run on the device
        return [b for b in BACKENDS if device.type == "cuda" or _cpu_reason(b) is None]
    backends = [b.strip() for b in requested.split(",") if b.strip()]
    if not backends:
        print(
            f"taac-benchmark: --backends {requested!r} selects no backend; expected some of {', '.join(SELECTABLE)}",
            file=sys.stderr,
        )
        return None
    unknown = [b for b in backends if b not in SELECTABLE]
    if unknown:
        print(f"taac-benchmark: unknown backends {unknown}; expected {', '.join(SELECTABLE)}", file=sys.stderr)
        return None
    if device.type == "cpu":
        reasons = [f"{b}: {_cpu_reason(b)}" for b in backends if _cpu_reason(b)]
        if reasons:
            print(f"taac-benchmark: --device cpu cannot run {'; '.join(reasons)}", file=sys.stderr)
            return None
    return backends


def _writable(path: str) -> bool:
    """Whether --json can be written, tried before any timing (an unwritable path after a long run loses it)."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        print(f"taac-benchmark: --json {path}: cannot write it ({error.strerror or error})", file=sys.stderr)
        return False
    if not existed:
        os.remove(path)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = all_cases()
    if args.list or args.operator is None:
        if not args.list:
            print("taac-benchmark: --operator is required; the operators and their shape presets:", file=sys.stderr)
        for op, op_cases in sorted(cases.items()):
            print(f"{op}: {', '.join(c.shape for c in op_cases)}", file=sys.stdout if args.list else sys.stderr)
        return 0 if args.list else 2
    if args.operator not in cases:
        print(
            f"taac-benchmark: unknown operator {args.operator!r}; expected one of {', '.join(sorted(cases))}",
            file=sys.stderr,
        )
        return 2
    selected = [c for c in cases[args.operator] if args.shape in ("all", c.shape)]
    if not selected:
        shapes = ", ".join(c.shape for c in cases[args.operator])
        print(
            f"taac-benchmark: unknown shape {args.shape!r} for {args.operator}; expected all or one of {shapes}",
            file=sys.stderr,
        )
        return 2
    if args.rounds < 1:
        print(f"taac-benchmark: --rounds {args.rounds}: expected a count of at least 1", file=sys.stderr)
        return 2
    modes = list(MODES) if args.mode == "both" else [args.mode]
    device = _device(args.device)
    if device is None:
        return 2
    backends = _backends(args.backends, device)
    if backends is None or (args.json and not args.dry_run and not _writable(args.json)):
        return 2
    if args.dry_run:
        for case in selected:
            print(
                f"{case.op} {case.shape} {args.dtype} {'/'.join(modes)}: backends {backends}, peers {list(case.peers) if not args.no_peers else []}"
            )
        return 0
    if "auto" in backends and device.type == "cuda" and not os.environ.get(CACHE_DIR_ENV):
        # measured afresh: decisions cached by earlier runs (other code, other clocks) would not be this run's
        os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="taac-benchmark-auto-")
    machine = Machine.measure(device, need_matmul=any(c.flops is not None for c in selected))
    result = {
        "command": "taac-benchmark " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(),
        "device": str(device),
        "copy_tbs": machine.copy_tbs,
        "matmul_tflops": machine.matmul_tflops,
        "rows": [],
    }
    for case in selected:
        for mode in modes:
            rounds = [
                run_case(case, backends, not args.no_peers, DTYPES[args.dtype], mode, machine, args.kernels)
                for _ in range(args.rounds)
            ]
            result["rows"] += rounds[0] if args.rounds == 1 else merge_rounds(rounds, machine)
            if args.json:  # after every case: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    from .report import print_table

    print_table(result)
    if args.json:
        write_csv_and_plot(result, Path(args.json))
    return 0


def write_csv_and_plot(result: dict, path: Path) -> None:
    """The table as CSV and, where there are peers to compare with and matplotlib is installed, the speed-up plot
    (as the docs pages show it), beside the JSON: rms_norm.json -> rms_norm.csv, rms_norm.png."""
    from .comparison import compare
    from .report import write_csv

    write_csv(result, path.with_suffix(".csv"))
    if not any(c.speedup() is not None for c in compare([result])):
        return
    try:
        from .plot import plot_speedups

        plot_speedups([result], path.with_suffix(".png"))
    except ImportError:
        print("taac-benchmark: no plot (matplotlib is not installed: pip install taac-runtime[plot])", file=sys.stderr)
