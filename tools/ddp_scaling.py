"""DDP scaling of the training presets: samples/s and scaling efficiency per process count, the loss against one
process at the same global batch, and checkpoint resume on N processes and on 1.

    python tools/ddp_scaling.py --nproc 1 2 --experiment baseline tokenformer gdr --steps 200 --out $OUT/ddp
    PYTHONPATH=src python tools/ddp_scaling.py --device cpu --nproc 1 2 --experiment baseline --steps 8 \\
        --log-every 2 --warmup 2 --out /tmp/ddp -- data.batch_size=32 model.d_model=16

Every run is `torchrun --standalone --nproc_per_node N -m runtime.training` with the same per-process batch
(`data.batch_size`: the global batch is N times it), eager: the whole-step CUDA graph (trainer.cuda_graph) does not
capture DistributedDataParallel, so it is off in every run, the 1-process ones included. Per experiment and N > 1:
- scaling: samples/s over the log windows after --warmup steps (from metrics.json), efficiency = samples/s(N) /
  (N x samples/s(1));
- the loss of the N-process run against one process with data.batch_size N times larger (the same global batch):
  the largest relative difference of the log windows' mean loss. The two runs draw different examples (a synthetic
  batch is a function of its index and size) and the N-process loss is rank 0's share, so this is a statistical
  comparison, not a numerical one;
- resume: the N-process run checkpoints at steps/2; resumed on N processes, its next losses are compared with the
  uninterrupted run's (bitwise, or within --resume-rtol); resumed on 1 process (trainer.resume_overrides=allow, same
  per-process batch) its first loss is that of the uninterrupted run's rank 0 (same weights, same batch) within
  --resume-rtol, and the mean loss of the rest within --continue-rtol of the uninterrupted run's.
Extra key=value arguments (after --) go to every run. Writes <out>/ddp_scaling.json (after each experiment and N, so
a cut-short call keeps what finished) and <out>/ddp_scaling.md, each run's directory (metrics.json, torchrun.log)
under <out>/runs, checkpoints removed once checked; exit status 1 when a run or a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))
from runtime.training.config import config_dir  # noqa: E402

GRAPH_NOTE = (
    "eager steps: the whole-step CUDA graph (trainer.cuda_graph) does not capture DistributedDataParallel, so it is "
    "off in every run, the 1-process ones included"
)


class RunFailed(RuntimeError):
    pass


def torchrun(nproc: int, overrides: list[str], run_dir: Path, timeout: float, threads: str) -> dict:
    """One taac-train run on nproc processes, `threads` CPU threads each; its metrics.json. The whole process group is
    killed on timeout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "-m", "runtime.training", *overrides, f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": threads}
    with open(run_dir / "torchrun.log", "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RunFailed(
                f"{run_dir.name}: no result after {timeout:.0f} s (log: {run_dir / 'torchrun.log'})"
            ) from None
    if code != 0:
        tail = (run_dir / "torchrun.log").read_text().splitlines()[-15:]
        raise RunFailed(f"{run_dir.name}: exit status {code}; log ends:\n" + "\n".join(tail))
    return json.loads((run_dir / "metrics.json").read_text())


def throughput(metrics: dict, warmup: int) -> dict:
    """samples/s and ms/step over the log windows that start at or after step `warmup` (all windows if none do)."""
    windows, start = [], 0
    for entry in metrics["log"]:
        windows.append((start, entry["step"] - start, entry["step_ms"]))
        start = entry["step"]
    timed = [w for w in windows if w[0] >= warmup] or windows
    steps = sum(n for _, n, _ in timed)
    seconds = sum(n * ms for _, n, ms in timed) / 1000
    global_batch = metrics["config"]["data"]["batch_size"] * metrics["world_size"]
    return {"samples_per_s": steps * global_batch / seconds, "step_ms": 1000 * seconds / steps, "timed_steps": steps}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def against_global_batch(metrics: dict, reference: dict) -> dict:
    ours = {e["step"]: e["loss"] for e in metrics["log"]}
    theirs = {e["step"]: e["loss"] for e in reference["log"]}
    steps = sorted(set(ours) & set(theirs))
    return {
        "logged_steps": steps,
        "loss": [ours[s] for s in steps],
        "reference_loss": [theirs[s] for s in steps],
        "max_rel_loss_diff": max(relative(ours[s], theirs[s]) for s in steps),
        "final_validation": reference["validation"][-1] if reference["validation"] else None,
    }


def resumed_at(metrics: dict) -> int | None:
    resumes = metrics.get("resumes") or []
    return resumes[-1]["step"] if resumes else None


def resume_same(straight: dict, resumed: dict, step: int, rtol: float) -> dict:
    ours, theirs = resumed["losses"][step:], straight["losses"][step:]
    diff = max(relative(a, b) for a, b in zip(ours, theirs, strict=True))
    ok = resumed_at(resumed) == step and (ours == theirs or diff <= rtol)
    return {"from_step": step, "resumed_at": resumed_at(resumed), "bitwise": ours == theirs, "max_rel_diff": diff,
            "rtol": rtol, "ok": ok}  # fmt: skip


def resume_on_one(straight: dict, resumed: dict, step: int, rtol: float, continue_rtol: float) -> dict:
    ours, theirs = resumed["losses"][step:], straight["losses"][step:]
    first = relative(ours[0], theirs[0])
    mean = relative(sum(ours) / len(ours), sum(theirs) / len(theirs))
    ok = resumed_at(resumed) == step and first <= rtol and mean <= continue_rtol
    return {"from_step": step, "resumed_at": resumed_at(resumed), "first_step_bitwise": ours[0] == theirs[0],
            "first_step_rel_diff": first, "mean_rel_diff": mean, "rtol": rtol, "continue_rtol": continue_rtol,
            "losses": ours, "uninterrupted_losses": theirs, "ok": ok}  # fmt: skip


def remove_checkpoints(run_dir: Path, keep: Path | None = None) -> None:
    for path in (run_dir / "checkpoints").glob("*.pt"):
        if path != keep:
            path.unlink()


def measure(args, preset: str | None, model: str, nproc: int, base: list[str], batch: int, runs: Path) -> dict:
    """The scaling run of one experiment on nproc processes, and for nproc > 1 its reference and resume runs."""
    name = f"{preset}/{model}" if preset else model
    entry = {"experiment": name, "model": model, "preset": preset, "nproc": nproc, "per_process_batch": batch,
             "global_batch": nproc * batch}  # fmt: skip
    directory = runs / name.replace("/", "-") / f"n{nproc}"
    half = args.steps // 2
    source = directory / "checkpoints" / f"step_{half:07d}.pt"

    def train(processes: int, extra: list[str], suffix: str = "") -> dict:
        run_dir = directory.with_name(directory.name + suffix)
        metrics = torchrun(processes, [*base, *extra], run_dir, args.timeout, args.threads)
        if not args.keep_checkpoints:  # at once: at pcvr_large sizes a checkpoint is about 20 GB
            remove_checkpoints(run_dir, keep=source if nproc > 1 else None)
        return metrics

    try:
        straight = train(nproc, [])
        entry.update(throughput(straight, args.warmup))
        entry["final_validation"] = straight["validation"][-1] if straight["validation"] else None
        if nproc > 1:
            reference = train(1, [f"data.batch_size={nproc * batch}"], "_ref1")
            entry["vs_one_process_same_global_batch"] = against_global_batch(straight, reference)
            checkpoint = f"trainer.resume={source}"
            again = train(nproc, [checkpoint], f"_resume{nproc}")
            entry["resume_same_nproc"] = resume_same(straight, again, half, args.resume_rtol)
            one = train(1, [checkpoint, "trainer.resume_overrides=allow"], "_resume1")
            entry["resume_on_one_process"] = resume_on_one(straight, one, half, args.resume_rtol, args.continue_rtol)
    except RunFailed as error:
        entry["error"] = str(error)
    finally:
        if not args.keep_checkpoints:
            for run_dir in [directory, *directory.parent.glob(f"n{nproc}_*")]:
                remove_checkpoints(run_dir)
    return entry


def add_efficiency(results: list[dict]) -> None:
    single = {r["experiment"]: r["samples_per_s"] for r in results if r["nproc"] == 1 and "samples_per_s" in r}
    for r in results:
        if "samples_per_s" in r and r["experiment"] in single:
            r["efficiency"] = r["samples_per_s"] / (r["nproc"] * single[r["experiment"]])


def checks_pass(entry: dict) -> bool:
    return "error" not in entry and all(
        entry[key]["ok"] for key in ("resume_same_nproc", "resume_on_one_process") if key in entry
    )


def table(results: list[dict]) -> str:
    lines = [
        "| experiment | N | samples/s | efficiency | loss diff vs 1 GPU, same global batch | resume N->N | resume N->1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r and "samples_per_s" not in r:
            lines.append(f"| {r['experiment']} | {r['nproc']} | failed | | | | |")
            continue
        efficiency = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        vs = r.get("vs_one_process_same_global_batch")
        same, one = r.get("resume_same_nproc"), r.get("resume_on_one_process")
        same_text = "-" if same is None else "bitwise" if same["bitwise"] else f"max rel {same['max_rel_diff']:.1e}"
        one_text = "-"
        if one is not None:
            first = "bitwise" if one["first_step_bitwise"] else f"rel {one['first_step_rel_diff']:.1e}"
            one_text = f"first step {first}, mean {one['mean_rel_diff']:.1%}"
        cells = [
            r["experiment"], str(r["nproc"]), f"{r['samples_per_s']:,.0f}", efficiency,
            "-" if vs is None else f"{vs['max_rel_loss_diff']:.1%}",
            same_text + ("" if same is None or same["ok"] else " FAIL"),
            one_text + ("" if one is None or one["ok"] else " FAIL"),
        ]  # fmt: skip
        if "error" in r:
            cells[-1] += " (a run failed)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(device: str) -> dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": device}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count())
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DDP scaling and resume checks of the training presets (torchrun).")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="process counts (include 1)")
    parser.add_argument("--experiment", nargs="+", default=["baseline", "tokenformer", "gdr"], help="model configs")
    parser.add_argument("--preset", nargs="*", default=[], help="size presets (experiment=...), e.g. pcvr_large")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of samples/s")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--accelerators", default=None, help="accelerators preset (default: triton on CUDA, torch on CPU)"
    )
    parser.add_argument("--resume-rtol", type=float, default=1e-2, help="bound where a resume is not bitwise")
    parser.add_argument("--continue-rtol", type=float, default=0.05, help="mean loss after resuming on 1 process")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per torchrun")
    parser.add_argument("--time-budget-s", type=float, default=0, help="> 0: start no experiment/N after this")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args(argv)
    if any("=" in name for name in [*args.experiment, *args.preset]):
        parser.error("key=value overrides go after -- (or after a one-value option such as --out)")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the resume checks start from a checkpoint at steps/2)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    accelerators = args.accelerators or ("triton" if device == "cuda" else "torch")
    # the same CPU threads per process in every run (torchrun would set 1 for N > 1 only)
    args.threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(args.nproc)))
    out = args.out.resolve()
    settings = {"nproc": args.nproc, "experiments": args.experiment, "presets": args.preset, "steps": args.steps,
                "log_every": args.log_every, "warmup": args.warmup, "accelerators": accelerators,
                "checkpoint_step": args.steps // 2, "cpu_threads_per_process": args.threads,
                "overrides": args.overrides}  # fmt: skip
    summary = {"settings": settings, "note": GRAPH_NOTE, "environment": environment(device), "results": []}
    started = time.perf_counter()
    for preset in args.preset or [None]:
        for model in args.experiment:
            base = [
                *([f"experiment={preset}"] if preset else []), f"model={model}", f"accelerators={accelerators}",
                f"trainer.device={device}", f"trainer.steps={args.steps}", f"trainer.log_every={args.log_every}",
                "trainer.val_every=0", f"trainer.checkpoint_every={args.steps // 2}", "trainer.keep_checkpoints=0",
                "trainer.cuda_graph=false", "trainer.compile=false", "trainer.progress=false", *args.overrides,
            ]  # fmt: skip
            with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
                batch = compose("train", overrides=base).data.batch_size
            for nproc in sorted(args.nproc):
                if args.time_budget_s and time.perf_counter() - started > args.time_budget_s:
                    summary["skipped_after_budget"] = True
                    print(f"time budget spent: {model} on {nproc} and later runs skipped", flush=True)
                    break
                entry = measure(args, preset, model, nproc, base, batch, out / "runs")
                summary["results"].append(entry)
                add_efficiency(summary["results"])
                summary["all_checks_pass"] = all(map(checks_pass, summary["results"]))
                (out / "ddp_scaling.json").write_text(json.dumps(summary, indent=1))
                print(entry.get("error") or f"{entry['experiment']} on {nproc}: {entry['samples_per_s']:,.0f} samples/s",
                      flush=True)  # fmt: skip
    text = (
        f"{table(summary['results'])}\n\n{device}, accelerators={accelerators}, {args.steps} steps, samples/s after "
        f"step {args.warmup}, per-process batch fixed; {GRAPH_NOTE}.\n"
    )
    (out / "ddp_scaling.md").write_text(text)
    print(text, flush=True)
    return 0 if summary.get("all_checks_pass") else 1


if __name__ == "__main__":
    sys.exit(main())
