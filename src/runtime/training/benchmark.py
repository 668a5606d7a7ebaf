"""Training-step benchmark (configs/benchmark.yaml): every model under every accelerators preset.

    python -m runtime.training.benchmark models=[baseline,tokenformer] presets=[torch,triton] steps=200

Each run builds the model from the same seed and trains `steps` optimizer steps on the same batches
(made once and kept on the device, so data making is not timed). Variants per accelerators preset: eager
(`presets`), torch.compile (`compiled`), the whole step as one CUDA graph (`graphed`), and `tuned`: what a
user tuning for speed would pick, torch.compile(mode="max-autotune-no-cudagraphs") of the model captured inside
the whole-step CUDA graph with the fused, capturable AdamW (max-autotune's own CUDA graphs cannot nest inside
the step's graph, so its no-cudagraphs form is the one captured).

Reported per run: the mean step time after `warmup` steps (forward, loss, backward, clipping, AdamW), samples/s, real
(unpadded) history tokens/s, MFU (the step's matmul FLOPs over the step time, against a measured bf16 matmul rate; the
FLOPs are counted by flops.py from the config and the timed batches, averaged per step: jagged batches at their real
sequence lengths, padded ones on the padded grid they compute), peak memory, the first step's time (compilation) and
the capture step's (graphed runs), the loss curve against the all-torch eager run of the same model (`loss_bound`: the
largest difference of the mean loss over the last 50 steps) and every fallback to torch that happened (a requested
backend that could not run an op), so no run silently times torch instead. `dry_run=true` composes every run's config
and prints the plan without training.

`layouts=[padded,jagged]` runs every planned run once per data layout the model reads, side by side: jagged batches
are packed (`cu_seqlens`, no padding; attention through varlen flash_attention), padded ones hold the same samples
padded to data.seq_len, so real tokens/s compares the layouts and the jagged run's loss curve is also
compared with the padded all-torch eager run's. A layout the model cannot read, and on jagged batches the
CUDA-graph variants (graphed, tuned: their token count changes from step to step, see JAGGED_LIMITS), are skipped
with the reason printed. `layouts=[default]` (the default) takes whatever layout data.jagged and the model say.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runtime.accelerators import BackendFallbackWarning
from runtime.accelerators.backends import clear_decisions

from .config import check_train_config, config_dir, data_jagged, model_layouts
from .data import build_data
from .distributed import Run
from .flops import appended_tokens, batch_step_matmul_flops, measured_bf16_matmul_rate
from .loop import JAGGED_GRAPH_BLOCKER, Trainer
from .profiling import profile_steps, triton_compilations

logger = logging.getLogger("runtime.training")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(
    train_cfg, batches, warmup: int, run_dir: Path, profiled_steps: int = 0, matmul_rate: float | None = None
) -> dict:
    """Train on the given batches; the step time is measured after `warmup` steps (each warmup step is timed
    alone: compilation, capture). With `profiled_steps`, that many further steps (on the first batches again)
    run under the profiler."""
    trainer = Trainer(train_cfg, run_dir, Run(_device(train_cfg)))
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, warmup_steps_s = [], []
    _sync(device)
    start = time.perf_counter()
    timed_from = start
    with triton_compilations() as compiled:
        compiled_in_warmup = None
        for i, batch in enumerate(batches):
            began = time.perf_counter()
            if i == warmup:
                _sync(device)
                timed_from = began = time.perf_counter()
                compiled_in_warmup = len(compiled)
            loss, _ = trainer.train_step(batch)
            losses.append(loss)
            if i < warmup:
                _sync(device)
                warmup_steps_s.append(time.perf_counter() - began)
        _sync(device)
        end = time.perf_counter()
    compiled_timed = compiled[compiled_in_warmup:] if compiled_in_warmup is not None else []
    timed = len(batches) - warmup
    step_s = (end - timed_from) / timed if timed > 0 else float("nan")
    # real tokens: each example's history events (+ the target token of the causal models), no padding
    extra = appended_tokens(train_cfg)
    real_tokens = sum(int(b.seq_lengths.sum()) + extra * len(b) for b in batches[warmup:])
    # the matmul FLOPs of the batches timed, per step: jagged ones at their real lengths, padded ones on their grid
    flops = sum(batch_step_matmul_flops(train_cfg, b) for b in batches[warmup:]) / timed if timed > 0 else float("nan")
    graph = trainer.graphed_step
    capture_step = graph.warmup if graph is not None else None
    profiled = {}
    if profiled_steps > 0:
        step = lambda i: trainer.train_step(batches[i % len(batches)])  # noqa: E731
        profiled["profile"] = profile_steps(step, profiled_steps, device)
    return {
        **profiled,
        "losses": torch.stack(losses).float().cpu().tolist(),
        "step_ms": 1000 * step_s,
        "samples_per_s": train_cfg.data.batch_size / step_s,
        "warmup_s": timed_from - start,
        "first_step_s": warmup_steps_s[0] if warmup_steps_s else None,  # compilation, in compiled runs
        "capture_step_s": warmup_steps_s[capture_step]
        if capture_step is not None and capture_step < len(warmup_steps_s)
        else None,
        "real_tokens_per_s": real_tokens / (end - timed_from) if timed > 0 else float("nan"),
        "matmul_flops_per_step": flops,
        "matmul_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / matmul_rate if matmul_rate else None,
        "cuda_graph_on": graph is not None,
        # Triton compilations during the timed steps: each costs that step its compile (or disk-cache load) time
        "triton_compiles_timed": len(compiled_timed),
        "triton_kernels_compiled_timed": sorted(set(compiled_timed)),
        "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "parameters": trainer.metrics["parameters"],
        "precision": trainer.precision_name,
    }


def _device_type(cfg) -> str:
    choice = str(getattr(cfg.trainer.device, "value", cfg.trainer.device))
    return "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def _device(cfg) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _device_type(cfg) == "cuda" else torch.device("cpu")


def compare(losses: list[float], reference: list[float], tail: int = 50) -> dict:
    """How a loss curve departs from the reference curve (same batches, same initial weights)."""
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    tail = min(tail, len(losses))
    mean_tail = sum(losses[-tail:]) / tail
    mean_tail_ref = sum(reference[-tail:]) / tail
    return {
        "first_step_abs_diff": diffs[0],
        "max_abs_diff_first_10": max(diffs[:10]),
        "mean_abs_diff": sum(diffs) / len(diffs),
        f"last_{tail}_mean": mean_tail,
        f"last_{tail}_mean_diff": abs(mean_tail - mean_tail_ref),
    }


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    overrides = list(sys.argv[1:] if argv is None else argv)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        bench = compose("benchmark", overrides=overrides)
        OmegaConf.to_object(bench)  # the checks a type cannot state (layouts)
        results = {"benchmark": OmegaConf.to_container(bench), "environment": _environment(), "runs": []}
        out = Path(bench.output)
        started = time.perf_counter()
        device_type = _device_type(
            compose("train", overrides=_base(bench, bench.models[0]) if bench.models else list(bench.overrides))
        )
        variants = planned_variants(bench, cuda=device_type == "cuda")
        if device_type != "cuda" and (bench.graphed or bench.tuned):
            print(f"the runs are on {device_type}: the CUDA-graph variants (graphed, tuned) are left out", flush=True)
        plan = _plan(bench, variants)
        results["skipped"] = [
            {"model": r.model, "layout": r.data_layout, "accelerators": r.preset, "mode": r.mode, "reason": r.skipped}
            for r in plan
            if r.skipped
        ]
        for run in plan:
            if run.skipped:
                print(f"{run.name}: skipped, {run.skipped}", flush=True)
        plan = [run for run in plan if not run.skipped]
        if bench.dry_run:
            for run in plan:
                check_train_config(compose("train", overrides=run.overrides))  # as each run's Trainer checks it
                print(f"{run.name}: [{run.data_layout} batches] {' '.join(run.overrides)}", flush=True)
            results["plan"] = [{"name": r.name, "layout": r.data_layout, "overrides": r.overrides} for r in plan]
            return results
        rate = measured_bf16_matmul_rate(torch.device(device_type))
        results["bf16_matmul_tflops"] = rate / 1e12 if rate else None
        results["loss_bound"] = bench.loss_bound
        batches, references = {}, {}
        for run in plan:
            if bench.time_budget_s and time.perf_counter() - started > bench.time_budget_s:
                print(f"time budget of {bench.time_budget_s} s spent: {run.name} and later runs skipped", flush=True)
                results["skipped_after_budget"] = True
                _write(out, results)
                return results
            key = (run.model, run.layout)
            if key not in batches:
                batches[key] = _make_batches(compose("train", overrides=run.data_overrides), bench.steps, run.layout)
            entry = {
                "model": run.model,
                "layout": run.data_layout,
                "accelerators": run.preset,
                "mode": run.mode,
                "compiled": run.mode in ("compile", "tuned"),
                "cuda_graph": run.mode in GRAPH_MODES,
            }
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", BackendFallbackWarning)
                    clear_decisions()  # each run decides (and warns) afresh
                    cfg = compose("train", overrides=run.overrides)
                    with tempfile.TemporaryDirectory() as tmp:
                        entry.update(run_one(cfg, batches[key], bench.warmup, Path(tmp), bench.profile_steps, rate))
                entry["fallbacks"] = sorted(
                    {str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)}
                )
                for message in entry["fallbacks"]:
                    print(f"{run.name}: FALLBACK {message}", flush=True)
            except Exception as error:  # reported, and the other runs go on
                entry["error"] = f"{type(error).__name__}: {error}"
                print(f"{run.name}: FAILED {entry['error'][:2000]}", flush=True)
                results["runs"].append(entry)
                _write(out, results)
                continue
            if run.preset == "torch" and run.mode == "eager":
                references[key] = entry
            reference = references.get(key)
            if reference is not None:
                entry["vs_torch_eager"] = compare(entry["losses"], reference["losses"])
                entry["speedup_vs_torch_eager"] = reference["step_ms"] / entry["step_ms"]
                entry["loss_within_bound"] = _tail_diff(entry["vs_torch_eager"]) <= bench.loss_bound
            # the same samples padded: "the same loss curve" across layouts
            padded = references.get((run.model, "padded")) if run.layout == "jagged" else None
            if padded is not None:
                entry["vs_padded_torch_eager"] = compare(entry["losses"], padded["losses"])
                entry["loss_within_bound_vs_padded"] = _tail_diff(entry["vs_padded_torch_eager"]) <= bench.loss_bound
            results["runs"].append(entry)
            _write(out, results)
            print(_line(run.name, entry), flush=True)
    return results


def _tail_diff(comparison: dict) -> float:
    """The difference of the mean loss over the last steps: what `loss_bound` judges."""
    return next(value for key, value in comparison.items() if key.endswith("_mean_diff"))


def planned_variants(bench, cuda: bool) -> list[tuple[str, str, str]]:
    """(preset, mode, layout) in the order they run, each for every model in turn: all models under one variant before
    the next variant, so that with a time budget the eager torch references (of every layout) and the first presets
    finish first. The CUDA-graph variants (graphed, tuned) only on CUDA. bench: the benchmark config, or its copy in a
    result JSON (files from before `layouts` have the default layout)."""
    variants = [(preset, "eager") for preset in bench["presets"]]
    variants += [(preset, "compile") for preset in bench["compiled"]]
    if cuda:
        variants += [(preset, "cuda_graph") for preset in bench["graphed"]]
        variants += [(preset, "tuned") for preset in bench["tuned"]]
    layouts = bench.get("layouts") or ["default"]
    return [(preset, mode, layout) for preset, mode in variants for layout in layouts]


MODES = {
    "eager": ("", ["trainer.compile=false", "trainer.compile_mode=default", "trainer.cuda_graph=false"]),
    "compile": (" / torch.compile", ["trainer.compile=true", "trainer.cuda_graph=false"]),
    "cuda_graph": (
        " / CUDA graph",
        ["trainer.compile=false", "trainer.compile_mode=default", "trainer.cuda_graph=true"],
    ),
    "tuned": (
        " / max-autotune + CUDA graph",
        ["trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs", "trainer.cuda_graph=true"],
    ),
}
GRAPH_MODES = ("cuda_graph", "tuned")
# why a mode is not timed on jagged batches, whose token count changes from step to step
JAGGED_LIMITS = {"cuda_graph": f"the whole-step CUDA graph needs the shapes it captured ({JAGGED_GRAPH_BLOCKER})"}
JAGGED_LIMITS["tuned"] = JAGGED_LIMITS["cuda_graph"]


@dataclass(frozen=True)
class PlannedRun:
    """One run: a model under a preset and mode, on one layout. layout: the benchmark's name (default, padded or
    jagged); data_layout: its batches' layout (default resolves to data.jagged's or the model's own); data_overrides:
    the train config its batches are made from; skipped: why the run is left out (None: it runs)."""

    model: str
    preset: str
    mode: str
    layout: str
    data_layout: str
    name: str
    overrides: list[str]
    data_overrides: list[str]
    skipped: str | None


def _base(bench, model: str) -> list[str]:
    experiment = [f"experiment={bench.experiment_preset}"] if bench.experiment_preset else []
    return [*experiment, f"model={model}", f"trainer.steps={bench.steps}", "trainer.progress=false", *bench.overrides]


def _with_layout(bench, model: str, layout: str) -> list[str]:
    jagged = {"default": [], "padded": ["data.jagged=false"], "jagged": ["data.jagged=true"]}[layout]
    return [*_base(bench, model), *jagged]


def _run(bench, model: str, preset: str, mode: str, layout: str) -> tuple[str, list[str]]:
    suffix, flags = MODES[mode]
    where = model if layout == "default" else f"{model} ({layout})"
    return f"{where} / {preset}{suffix}", [*_with_layout(bench, model, layout), f"accelerators={preset}", *flags]


def _plan(bench, variants) -> list[PlannedRun]:
    """Every planned run in order; those that cannot run carry the reason: a layout the model does not read, or a mode
    that cannot be timed on jagged batches (JAGGED_LIMITS)."""
    layouts = {}  # (model, layout) -> (its batches' layout, or why the model cannot read it)
    planned = []
    for preset, mode, layout in variants:
        for model in bench.models:
            if (model, layout) not in layouts:
                layouts[model, layout] = _data_layout(bench, model, layout)
            data_layout, unreadable = layouts[model, layout]
            skipped = unreadable or (JAGGED_LIMITS.get(mode) if data_layout == "jagged" else None)
            name, overrides = _run(bench, model, preset, mode, layout)
            data_overrides = _with_layout(bench, model, layout)
            planned.append(
                PlannedRun(model, preset, mode, layout, data_layout, name, overrides, data_overrides, skipped)
            )
    return planned


def _data_layout(bench, model: str, layout: str) -> tuple[str, str | None]:
    """The layout of a model's batches under a benchmark layout, and why the model cannot read it (None: it can)."""
    cfg = compose("train", overrides=_with_layout(bench, model, layout))
    if layout == "default":
        try:
            return ("jagged" if data_jagged(cfg) else "padded"), None
        except ValueError as error:  # data.jagged in the overrides, against the model or the data source
            return layout, str(error)
    if str(getattr(cfg.data.source, "value", cfg.data.source)) != "synthetic":
        raise ValueError(
            f"layouts=[{','.join(bench.layouts)}]: the padded and jagged layouts are drawn from the synthetic data set; "
            "take layouts=[default] with data=parquet"
        )
    readable = model_layouts(cfg.model._target_)
    if layout not in readable:
        return layout, f"{cfg.model._target_.rsplit('.', 1)[-1]} reads {' and '.join(readable)} histories only"
    return layout, None


def _make_batches(cfg, steps: int, layout: str) -> list:
    """The run's batches, on its device. The padded and jagged layouts both take the jagged synthetic set's batches
    (one seed: the same users, histories and labels), the padded layout with every history padded to data.seq_len:
    only the packing differs, so their loss curves are comparable. default: the data set the config says."""
    data = build_data(cfg.data, cfg.seed, jagged=data_jagged(cfg) if layout == "default" else True)
    made = [data.train_batch(i, cfg.data.batch_size) for i in range(steps)]
    if layout == "padded":
        made = [batch.padded(cfg.data.seq_len) for batch in made]
    device = _device(cfg)
    return [batch.to(device) for batch in made]


def _line(name: str, entry: dict) -> str:
    text = (
        f"{name}: {entry['step_ms']:.2f} ms/step, {entry['samples_per_s']:,.0f} samples/s, "
        f"{entry['real_tokens_per_s']:,.0f} real tokens/s, {entry['matmul_tflops']:.1f} matmul TFLOP/s"
        + (f" (MFU {100 * entry['mfu']:.1f}%)" if entry.get("mfu") else "")
        + f", first/last loss {entry['losses'][0]:.4f}/{entry['losses'][-1]:.4f}"
    )
    if entry.get("first_step_s") is not None:
        text += f", first step {entry['first_step_s']:.1f} s"
    if entry.get("capture_step_s") is not None:
        text += f", capture step {entry['capture_step_s']:.2f} s"
    if "vs_torch_eager" in entry:
        cmp = entry["vs_torch_eager"]
        tail_key = next(k for k in cmp if k.endswith("_mean_diff"))
        text += (
            f", speedup {entry['speedup_vs_torch_eager']:.2f}x, |dloss| step 1 {cmp['first_step_abs_diff']:.1e}, "
            f"mean {cmp['mean_abs_diff']:.1e}, {tail_key} {cmp[tail_key]:.1e}"
        )
    if "vs_padded_torch_eager" in entry:
        cmp = entry["vs_padded_torch_eager"]
        tail_key = next(k for k in cmp if k.endswith("_mean_diff"))
        text += f", vs padded torch eager: {tail_key} {cmp[tail_key]:.1e}"
    if "profile" in entry:
        prof = entry["profile"]
        text += (
            f", profiled: {prof['wall_ms_per_step']:.2f} ms wall vs {prof['kernel_ms_per_step']:.2f} ms of kernels per step, "
            f"{prof['kernel_launches_per_step']:.0f} launches"
        )
    if entry.get("triton_compiles_timed"):
        kernels = ", ".join(entry["triton_kernels_compiled_timed"])
        text += f", {entry['triton_compiles_timed']} Triton compilations in the timed steps ({kernels})"
    if entry.get("peak_memory_mib"):
        text += f", peak {entry['peak_memory_mib']:.0f} MiB"
    return text


def _environment() -> dict:
    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for module in ("triton", "tilelang"):
        try:
            env[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001 - an environment report
            env[module] = f"unavailable ({type(error).__name__})"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _write(out: Path, results: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
