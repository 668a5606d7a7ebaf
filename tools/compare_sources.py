"""Benchmarks our kernel backends in two source trees on one GPU, case by case in turn (the first tree, then the
second), and writes a table of their times: for checking that a change which should not move a kernel did not.
Peers are not timed (they are the same in both trees).

Usage (GPU machine, repository root; the other tree's `src` unpacked beside it, e.g. with
`git archive <commit> src | tar -x -C before`):
    python tools/compare_sources.py --before before/src --after src --out DIR [--cases OP[:SHAPE] ...] [--mode both]
        [--gpus N]
Writes DIR/<tree>--<op>--<shape>.json per run and DIR/comparison.md; a case is an op with all its shapes or one shape.
--gpus N deals the cases to N GPUs in turn (both trees of a case run on the same GPU, one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# each op's target shapes (norms, flash_attention, gated delta rule, embedding bag, bce, swiglu, mhc)
DEFAULT_CASES = [
    "rms_norm",
    "layer_norm",
    "l2norm",
    "bce_with_logits",
    "swiglu",
    "dropout_add",
    "mhc",
    "embedding_bag_mean:1Mx64-B8192-bag4-uniform",
    "embedding_bag_mean:1Mx128-B8192-bag8-zipf",
    "gated_delta_rule:chunk-B4-T4096-H16-D128",
    "gated_delta_rule:chunk-B256-T256-H4-D16",
    "gated_delta_rule:chunk-packed32768-H16-HV32-D128",
    "flash_attention:pcvr-256x4x256x16-causal",
    "flash_attention:pcvr-128x8x1024x32-causal-lengths",
    "flash_attention:pcvr-64x4x2048x48-causal",
    "flash_attention:large-4x16x4096x128-causal",
]
SLOWER = 1.03  # within 3% is run-to-run noise on the GPU machine


def _environment(tree: Path, gpu: int | None = None) -> dict[str, str]:
    """This process's environment with `tree` first on PYTHONPATH in place of any other copy of the package (and
    only `gpu` visible, where given)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "runtime").is_dir()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), *paths])}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def run_case(
    tree: Path, label: str, case: str, mode: str, out: Path, timeout: float, gpu: int | None = None
) -> Path | None:
    op, _, shape = case.partition(":")
    path = out / f"{label}--{op}--{shape or 'all'}.json"
    command = [sys.executable, "-m", "runtime.benchmark", "--operator", op, "--shape", shape or "all"]
    command += ["--backends", "triton,tilelang", "--no-peers", "--mode", mode, "--json", str(path)]
    print(f"== {label}: {op} {shape or 'all'}" + ("" if gpu is None else f" (GPU {gpu})"), flush=True)
    try:
        subprocess.run(command, env=_environment(tree, gpu), timeout=timeout, check=False, stdout=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"   timed out after {timeout:.0f} s", flush=True)
    return path if path.exists() else None


def _times(path: Path | None) -> dict[tuple[str, str, str, str], float]:
    if path is None:
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {
        (r["op"], r["shape"], r["mode"], r["impl"]): r["gpu_ms"]["median"]
        for r in rows
        if r.get("status") == "ok" and r.get("gpu_ms")
    }


def comparison_table(pairs: list[tuple[Path | None, Path | None]]) -> str:
    lines = [
        "| op | shape | mode | backend | before ms | after ms | before / after |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for before, after in pairs:
        old, new = _times(before), _times(after)
        for key in sorted(old.keys() & new.keys()):
            ratio = old[key] / new[key]
            flag = " **slower**" if ratio < 1 / SLOWER else ""
            lines.append(f"| {' | '.join(key)} | {old[key]:.4f} | {new[key]:.4f} | {ratio:.3f}{flag} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the first tree's src directory")
    parser.add_argument("--after", type=Path, required=True, help="the second tree's src directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="OP or OP:SHAPE")
    parser.add_argument("--mode", default="both", choices=["fwd", "fwd+bwd", "both"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--gpus", type=int, default=1, help="deal the cases to this many GPUs")
    args = parser.parse_args()
    if args.gpus < 1:
        parser.error(f"--gpus: expected an int >= 1, got {args.gpus}")
    args.out.mkdir(parents=True, exist_ok=True)
    pairs: dict[int, tuple[Path | None, Path | None]] = {}
    lock = threading.Lock()

    def run_cases(gpu: int) -> None:
        for index in range(gpu, len(args.cases), args.gpus):
            device = None if args.gpus == 1 else gpu
            case = args.cases[index]
            before = run_case(args.before, "before", case, args.mode, args.out, args.timeout, device)
            after = run_case(args.after, "after", case, args.mode, args.out, args.timeout, device)
            with lock:  # the table after every case, in the cases' order: a cut call keeps it
                pairs[index] = (before, after)
                (args.out / "comparison.md").write_text(comparison_table([pairs[i] for i in sorted(pairs)]))

    with ThreadPoolExecutor(args.gpus) as pool:
        list(pool.map(run_cases, range(args.gpus)))
    print((args.out / "comparison.md").read_text())


if __name__ == "__main__":
    main()
