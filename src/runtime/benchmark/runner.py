"""Runs the cases of an op: correctness against the float64 reference first, then the timings."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..accelerators import use_accelerators
from ..accelerators.testing import RTOL, relative_rms_error
from . import timing
from .case import Case, Inputs

MODES = ("fwd", "fwd+bwd")


@dataclass
class Machine:
    """What one run measures once: the ceilings results are compared with."""

    device: torch.device
    copy_tbs: float | None = None
    matmul_tflops: float | None = None

    @classmethod
    def measure(cls, device: torch.device, need_matmul: bool) -> "Machine":
        if device.type != "cuda":
            return cls(device)
        return cls(device, timing.copy_bandwidth_tbs(device), timing.matmul_tflops(device) if need_matmul else None)


def environment() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "tilelang", "liger_kernel", "fla"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # not installed, or no __version__
            versions[name] = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"commit": _commit(), "gpu": gpu, "versions": versions}


def _commit() -> str | None:
    """TAAC_COMMIT, else HEAD's short hash, marked "+modified" where tracked files differ from it (a copied tree on
    another machine can keep a stale .git: the label then says it is not that commit's tree)."""
    if os.environ.get("TAAC_COMMIT"):
        return os.environ["TAAC_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        modified = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True).returncode == 1
    except Exception:  # not a checkout
        return None
    return f"{head}+modified" if modified else head


def _double(inputs: Inputs) -> Inputs:
    doubled = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().double().requires_grad_(value.requires_grad)
        doubled[name] = value
    return doubled


def _outputs(out) -> tuple:
    """An op's outputs as a tuple (one tensor, or the tuple some ops return)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _grad_inputs(inputs: Inputs) -> list[str]:
    return [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]


def _pass(fn: Callable[[Inputs], torch.Tensor], inputs: Inputs, mode: str, grad_out: torch.Tensor | None):
    """A callable running one forward (no autograd graph) or one forward+backward pass."""
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return fn(inputs)

        return forward
    names = _grad_inputs(inputs)

    def forward_backward():
        out = fn(inputs)
        return torch.autograd.grad(out, [inputs[n] for n in names], grad_out)

    return forward_backward


def check(case: Case, fn: Callable[[Inputs], torch.Tensor], inputs: Inputs, mode: str, grad_out) -> dict:
    """Relative RMS errors of the output (and every input gradient) against the float64 reference."""
    dtype = next(v.dtype for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    bound = case.rtol.get(dtype, RTOL.get(dtype, 1e-2))
    # a forward pass is checked as it is timed: without autograd (forward-only kernels can run it)
    with torch.set_grad_enabled(mode != "fwd"):
        out = fn(inputs)
        ref_inputs = _double(inputs)
        ref = case.reference(ref_inputs)
    outs, refs = _outputs(out), _outputs(ref)
    keys = ["out"] if len(outs) == 1 else [f"out{i}" for i in range(len(outs))]
    errors = {k: relative_rms_error(o, r) for k, o, r in zip(keys, outs, refs)}
    if mode == "fwd+bwd":
        names = _grad_inputs(inputs)
        grads = torch.autograd.grad(out, [inputs[n] for n in names], grad_out)
        ref_grads = torch.autograd.grad(ref, [ref_inputs[n] for n in names], [g.double() for g in _outputs(grad_out)])
        errors.update({f"d{n}": relative_rms_error(g, r) for n, g, r in zip(names, grads, ref_grads)})
    ok = all(e <= (bound if k.startswith("out") else 2 * bound) for k, e in errors.items())  # NaN fails
    return {"errors": errors, "bound": bound, "correct": ok}


def measure(
    case: Case, name: str, kind: str, fn, dtype: torch.dtype, mode: str, machine: Machine, kernels: bool = False
) -> dict:
    """One row: correctness, then GPU and eager time, bandwidth/FLOP rates, memory and compile time; with kernels,
    the GPU time of each kernel launched (torch.profiler)."""
    device = machine.device
    row = {
        "op": case.op,
        "shape": case.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "mode": mode,
        "impl": name,
        "kind": kind,
    }
    inputs = case.make_inputs(device, dtype)
    grad_out = None
    try:
        compile_s = timing.first_call_seconds(_pass(fn, inputs, "fwd", None), device)
        if mode == "fwd+bwd":
            with torch.no_grad():  # one incoming gradient per output (an op may return several: add_norm)
                grad_out = tuple(torch.randn_like(o) for o in _outputs(fn(inputs)))
        row.update(check(case, fn, inputs, mode, grad_out))
    except Exception as error:  # an unsupported or failing implementation is reported, never timed
        row.update(status="error", error=f"{type(error).__name__}: {error}".splitlines()[0][:300])
        return row
    if not row["correct"]:
        row["status"] = "wrong"
        return row
    run = _pass(fn, inputs, mode, grad_out)
    row.update(status="ok", first_call_s=compile_s, eager_ms=timing.eager_time_ms(run, device))
    if device.type == "cuda":
        times, captured = timing.gpu_time_ms(run, device)
        row.update(gpu_ms=times, graph=captured, peak_mem_mb=timing.peak_memory_mb(run, device))
        if kernels:
            row["kernels"] = timing.kernel_breakdown(run)
        passes = ["fwd"] if mode == "fwd" else ["fwd", "bwd"]
        if case.bytes is not None:
            row["bytes"] = sum(case.bytes(inputs, p) for p in passes)
        if case.flops is not None:
            row["flops"] = sum(case.flops(inputs, p) for p in passes)
        _add_rates(row, machine)
    return row


def _add_rates(row: dict, machine: Machine) -> None:
    """TB/s and TFLOP/s at the row's median GPU time, and their fractions of the run's copy and matmul rates."""
    seconds = row["gpu_ms"]["median"] * 1e-3
    if "bytes" in row:
        row["tbs"] = row["bytes"] / seconds / 1e12
        if machine.copy_tbs:
            row["frac_copy"] = row["tbs"] / machine.copy_tbs
    if "flops" in row:
        row["tflops"] = row["flops"] / seconds / 1e12
        if machine.matmul_tflops:
            row["frac_matmul"] = row["tflops"] / machine.matmul_tflops


def merge_rounds(rounds: list[list[dict]], machine: Machine) -> list[dict]:
    """One row per implementation from several rounds of the same case (each round times every implementation once,
    so slow drifts of clock or memory speed fall on all of them alike): the first round's row, with the median over
    rounds of each timing and the per-round medians under "rounds". A row that is not ok in some round is that
    round's row (an error or a wrong result is reported, never averaged away)."""
    merged = []
    for rows in zip(*rounds):
        failed = [r for r in rows if r["status"] != "ok"]
        if failed:
            merged.append(failed[0])
            continue
        row = dict(rows[0])
        row["rounds"] = {"eager_ms": [r["eager_ms"] for r in rows]}
        row["eager_ms"] = statistics.median(row["rounds"]["eager_ms"])
        if "gpu_ms" in row:
            row["rounds"]["gpu_ms"] = [r["gpu_ms"]["median"] for r in rows]
            row["gpu_ms"] = {q: statistics.median(r["gpu_ms"][q] for r in rows) for q in ("median", "p20", "p80")}
            row["peak_mem_mb"] = max(r["peak_mem_mb"] for r in rows)
            _add_rates(row, machine)
        merged.append(row)
    return merged


def run_case(
    case: Case, backends: list[str], peers: bool, dtype: torch.dtype, mode: str, machine: Machine, kernels: bool = False
) -> list[dict]:
    rows = []
    with use_accelerators(fallback="error"):  # the benchmark never falls back
        for backend in backends:
            run = lambda inputs, b=backend: case.run(b, inputs)  # noqa: E731
            rows.append(measure(case, backend, "backend", run, dtype, mode, machine, kernels))
        if peers:
            for name, fn in case.peers.items():
                rows.append(measure(case, name, "peer", fn, dtype, mode, machine, kernels))
    return rows
