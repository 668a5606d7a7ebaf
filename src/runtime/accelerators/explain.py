"""explain(): which backend each op takes on this machine, and why the others would not."""

from __future__ import annotations

import inspect

import torch

from . import autotune, native
from .backends import KERNEL_BACKENDS, REGISTRY, environment_reasons
from .config import active_config


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def explain(op: str | None = None, device: torch.device | str | None = None, **inputs) -> str:
    """A report, one block per op: the configured backend, what "auto" picks, each kernel backend's reasons, and how
    "auto" decides: the measured times and winner of each shape class measured on this GPU (with these library
    versions), else why it keeps the static priority.

    With `op` and sample `inputs` (the op's tensor arguments by name, e.g. explain("rms_norm", x=x)),
    the input reasons (dtype, width, mask kind...) are added to the environment ones.
    """
    if op is not None and (not isinstance(op, str) or op not in REGISTRY):  # a list of names is unhashable
        raise ValueError(f"explain: unknown op {op!r}; expected one of {', '.join(sorted(REGISTRY))}")
    if inputs and op is None:
        raise ValueError("explain: sample inputs need the op they belong to (op=...)")
    device = _device(device) if device is not None else _inputs_device(inputs) or default_device()
    config = active_config()
    mode = "; deterministic algorithms: on" if torch.are_deterministic_algorithms_enabled() else ""
    lines = [f"device: {device}; fallback rule: {config.fallback}{mode}", _versions(device), native.describe()]
    for name in [op] if op is not None else sorted(REGISTRY):
        spec = REGISTRY[name]
        if inputs:
            accepted = _accepted(name, spec.reasons, inputs)
            reasons = {b: spec.not_supported_reasons(b, device, **accepted) for b in KERNEL_BACKENDS}
            priority, note = spec.priority_for(**accepted), ""
        else:
            reasons = {b: environment_reasons(b, device) for b in KERNEL_BACKENDS}
            priority, note = spec.priority, _priority_note(spec)
        reasons["torch"] = []  # an input priority may name torch (linear without an activation)
        auto = next((b for b in priority if not reasons[b]), "torch")
        order = priority if "torch" in priority else (*priority, "torch")
        configured = config.backend_for(name)
        if configured == "auto":
            runs = auto
        elif configured == "torch" or not reasons[configured]:
            runs = configured
        else:
            runs = (
                "torch (fallback)"
                if config.fallback == "torch"
                else "nothing: raises BackendUnavailableError (fallback 'error')"
            )
        lines.append(f"{name}: configured {configured!r} -> runs {runs}; auto priority {' > '.join(order)}{note}")
        for backend in KERNEL_BACKENDS:
            lines.append(f"  {backend}: " + ("available" if not reasons[backend] else "; ".join(reasons[backend])))
        lines += _auto_lines(name, device, config, [b for b in priority if not reasons[b]])
    return "\n".join(lines)


def _device(name) -> torch.device:
    """The device asked for, which must be on this machine (its name and capability are read)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {name!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: cuda is not available here (torch.cuda.is_available() is False); use 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: no {device} here, this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def _versions(device: torch.device) -> str:
    gpu = autotune.device_name(device) if device.type == "cuda" else "none"
    libraries = ", ".join(f"{name} {autotune.library_version(name)}" for name in ("torch", "triton", "tilelang"))
    return f"{libraries}; GPU: {gpu}"


def _auto_lines(op: str, device: torch.device, config, runnable: list[str]) -> list[str]:
    """How "auto" decides for this op here: why it keeps the static priority, or that it measures; then the times and
    winner of every shape class measured on this device with these library versions."""
    off = autotune.off_reason(config)
    if device.type != "cuda":
        lines = [f"  auto: static priority (tensors on {device.type}; measuring needs CUDA)"]
    elif off is not None:
        lines = [f"  auto: static priority ({off})"]
    elif len(runnable) < 2:
        lines = [
            f"  auto: static priority (only {runnable[0] if runnable else 'torch'} can run here: nothing to measure)"
        ]
    else:
        lines = [f"  auto: measures on the first call per shape class (decisions in {autotune.decision_file().path})"]
    for entry in autotune.measured_entries(op, device):
        times = ", ".join(f"{b} {ms:.4f} ms" for b, ms in sorted(entry["times_ms"].items(), key=lambda item: item[1]))
        failed = "".join(f"; {b} failed: {why}" for b, why in sorted(entry.get("failed", {}).items()))
        lines.append(
            f"  measured {entry.get('shape')} {entry.get('key')}: {times or 'no backend ran'}{failed} -> {entry['winner']}"
        )
    return lines


def _priority_note(spec) -> str:
    """Where the op's priority depends on its inputs, where (the input_priority docstring)."""
    if spec.input_priority is None:
        return ""
    return f" ({' '.join(spec.input_priority.__doc__.split())})"


def _inputs_device(inputs) -> torch.device | None:
    return next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), None)


def _accepted(op: str, reasons, inputs: dict) -> dict:
    """The sample inputs the op's reasons read: its other arguments (k, eps, p...) are left out."""
    signature = inspect.signature(reasons)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        inputs = {name: value for name, value in inputs.items() if name in signature.parameters}
    try:
        signature.bind("backend", **inputs)
    except TypeError as error:
        raise TypeError(f"explain: the sample inputs of {op} lack an argument its reasons read ({error})") from None
    return inputs
