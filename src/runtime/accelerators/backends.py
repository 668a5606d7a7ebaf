"""Environment probes, per-op capability declarations and backend resolution (the names of backends and ops, and
AcceleratorConfig, are config.py's).

Every op declares an `OpSpec`: its name (the config key), the kernel backends that `"auto"`
tries in order, and a function giving the input reasons a backend cannot run some inputs.
`select_backend` turns the requested backend (argument, else the active config) into the
backend that runs, applying the fallback rule; its decision is cached per op, request and
an op-chosen key (device, dtype, widths, flags), so the hot path is one dict lookup. On CUDA,
"auto" with more than one kernel backend able to run decides per shape class by measurement
(autotune.py): the cached entry is then that op's table of measured decisions.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import operator
import os
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from . import autotune
from . import config as _config
from .config import BACKENDS, FALLBACKS, KERNEL_BACKENDS, OP_NAMES, Backend, Fallback  # noqa: F401  (re-exported)

TILELANG_VERSION = "0.1.15"
TILELANG_MIN_CAPABILITY = (8, 0)

logger = logging.getLogger("runtime.accelerators")


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run these inputs and the fallback rule is "error"."""


class BackendFallbackWarning(RuntimeWarning):
    """An explicitly requested backend cannot run these inputs; the torch reference runs instead."""


# --------------------------------------------------------------------------- environment


def triton_interpret() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1): the triton backend then accepts CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device; 0 for any other device (the interpreter's CPU)."""
    if device.type != "cuda":
        return 0
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def library_reasons(backend: str) -> tuple[str, ...]:
    """Why the backend's library cannot be used in this environment (empty when it can)."""
    if backend == "triton":
        try:
            importlib.import_module("triton")
        except ImportError as error:
            return (f"triton is not importable ({error}); install it with `pip install triton` (Linux only)",)
        return ()
    if backend == "tilelang":
        problem = tilelang_version_problem()
        return () if problem is None else (problem,)
    return ()


def tilelang_version_problem() -> str | None:
    """Why the installed tilelang cannot serve the kernels (missing, or another release: its API changes between
    releases), saying what to install; None when it can."""
    try:
        version = importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        return f"tilelang is not installed; install it with `pip install tilelang=={TILELANG_VERSION}`"
    if version != TILELANG_VERSION:
        return (
            f"tilelang {version} is installed but this package is written for {TILELANG_VERSION}; "
            f"install it with `pip install tilelang=={TILELANG_VERSION}`"
        )
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability as (major, minor), read once per device: torch.cuda.get_device_capability
    builds the device's whole properties object on every call, a few us on a launch's host path."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


def device_reasons(backend: str, device: torch.device, capability: tuple[int, int] | None = None) -> list[str]:
    """Why the backend cannot run on this device (empty when it can). capability: the CUDA device's compute
    capability as (major, minor); None: the device's own."""
    if backend == "torch":
        return []
    if backend == "triton":
        if device.type == "cuda" or (device.type == "cpu" and triton_interpret()):
            return []
        return [
            f"tensors are on {device.type}; the triton backend needs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)"
        ]
    if backend == "tilelang":
        if device.type != "cuda":
            return [f"tensors are on {device.type}; the tilelang backend needs CUDA tensors"]
        if capability is None:
            capability = device_capability(device)
        major, minor = capability
        if (major, minor) < TILELANG_MIN_CAPABILITY:
            need = ".".join(map(str, TILELANG_MIN_CAPABILITY))
            return [f"GPU compute capability {major}.{minor} is below {need}, the oldest the tilelang kernels target"]
        return []
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def environment_reasons(backend: str, device: torch.device, capability: tuple[int, int] | None = None) -> list[str]:
    """Why the backend cannot run here: its library, then the device (capability: as device_reasons')."""
    return list(library_reasons(backend)) + device_reasons(backend, device, capability)


# --------------------------------------------------------------------------- op declarations


InputReasons = Callable[..., list[str]]
REGISTRY: dict[str, "OpSpec"] = {}  # op name -> spec, filled as the op packages import


@dataclass(frozen=True)
class OpSpec:
    """An op's capabilities as data.

    name:       the config key (one of OP_NAMES)
    priority:   kernel backends in the order `"auto"` tries them (chosen from benchmark evidence)
    reasons:    (backend, **inputs) -> list of reasons this backend cannot run these inputs,
                beyond the environment (dtype, width, mask kind, gradients...)
    input_priority: (**inputs) -> another order for inputs where the benchmarks show it winning, or None
                (priority); its docstring says where. It may name "torch" where the torch path is itself one
                tuned library call (linear without an activation: cuBLAS); measured "auto" then times it too.
                Like reasons, it may read only what the op's decision key holds.
    widths:     the tensor inputs whose last size reasons or input_priority read: a feature width (row width,
                head dim, embedding dim), which a graph compiled with torch.compile specialises on

    reasons and input_priority receive the inputs their signature names (select_backend's inputs also
    hold the arguments a measurement replays the call with). From a tensor they read its dtype, rank,
    device and requires_grad, and the last size of those in `widths`; any other size (a rank-1 input's
    length is a count of tokens, indices or sequences, different in every jagged batch), a comparison of
    numel() with a limit or a layout flag, they take as a value the op passes (see _describe).
    """

    name: str
    priority: tuple[str, ...]
    reasons: InputReasons
    input_priority: Callable[..., tuple[str, ...] | None] | None = None
    widths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in OP_NAMES:
            raise ValueError(f"OpSpec: unknown op {self.name!r}; expected one of {OP_NAMES}")
        read = [autotune.parameter_names(f) for f in (self.reasons, self.input_priority) if f is not None]
        read_inputs = None if None in read else frozenset().union(*read)
        if read_inputs is not None and not read_inputs.issuperset(self.widths):
            raise ValueError(f"OpSpec {self.name}: widths {self.widths} name inputs its reasons do not take")
        REGISTRY[self.name] = self
        object.__setattr__(self, "read_inputs", read_inputs)

    def priority_for(self, **inputs) -> tuple[str, ...]:
        """The order `"auto"` tries the kernel backends in for these inputs."""
        if self.input_priority is not None:
            return self.input_priority(**autotune.accepted(self.input_priority, inputs)) or self.priority
        return self.priority

    def not_supported_reasons(
        self, backend: str, device: torch.device, capability: tuple[int, int] | None = None, /, **inputs
    ) -> list[str]:
        """Every reason the backend cannot run these inputs here; empty means supported. capability: the CUDA
        device's compute capability (None: the device's own)."""
        if backend == "torch":
            return []
        environment = environment_reasons(backend, device, capability)
        return environment + self.reasons(backend, **autotune.accepted(self.reasons, inputs))

    def auto_candidates(
        self, device: torch.device, capability: tuple[int, int] | None = None, /, **inputs
    ) -> tuple[tuple[str, ...], dict[str, list[str]]]:
        """The kernel backends that can run these inputs in `"auto"`'s order, and the others' reasons (capability:
        as not_supported_reasons')."""
        candidates, skipped = [], {}
        for backend in self.priority_for(**inputs):
            reasons = self.not_supported_reasons(backend, device, capability, **inputs)
            if reasons:
                skipped[backend] = reasons
            else:
                candidates.append(backend)
        return tuple(candidates), skipped


# --------------------------------------------------------------------------- resolution

_decisions: dict[Hashable, "str | autotune.Tuned"] = {}
_warned: set[Hashable] = set()


def select_backend(
    spec: OpSpec, backend: Backend | None, device: torch.device, key: Hashable, call=None, /, **inputs
) -> str:
    """The backend ("torch", "triton" or "tilelang") that runs this call.

    `key` must capture everything `spec.reasons` reads from `inputs` (dtype, widths, flags);
    the decision is cached under it, so the reasons are computed once per distinct key.
    `call` is the op's public function and `inputs` hold its arguments by name (with what the
    reasons read): "auto" on CUDA replays the call on each kernel backend to measure them.
    Without it (or None: a call that runs no kernel), "auto" keeps the static priority.
    """
    if torch.compiler.is_compiling():  # key is not passed: under dynamic shapes it may hold symbolic sizes
        return _decide_while_compiling(spec.name, backend, device, _describe(spec, inputs))
    config = _config._stack[-1]  # _config.active_config(), inline (this runs on every call of every op)
    requested = backend if backend is not None else config.backend_for(spec.name)
    cache_key = (spec.name, requested, config.fallback, config.autotune, device, key)
    try:
        decided = _decisions.get(cache_key)
    except TypeError:  # an unhashable backend argument (a list...) is not a backend: say so, not "unhashable type"
        _check_requested(spec, requested)
        raise
    if decided is None:
        decided = _decisions[cache_key] = _decide_or_tune(spec, requested, config, device, key, inputs)
    if decided.__class__ is str:
        return decided
    return decided.choose(call, inputs)


def _decide_or_tune(
    spec: OpSpec,
    requested: str,
    config,
    device: torch.device,
    key: Hashable,
    inputs: dict,
    capability: tuple[int, int] | None = None,
):
    """The static decision, or for "auto" on CUDA with autotuning on and two or more kernel backends able to run
    the inputs, the op's table of measured decisions for this key. capability: the CUDA device's compute
    capability (None: the device's own; select_backend passes None, once per decision key)."""
    if requested == "auto" and device.type == "cuda" and autotune.off_reason(config) is None:
        candidates, _ = spec.auto_candidates(device, capability, **inputs)
        if len(candidates) >= 2:
            return autotune.Tuned(spec.name, key, device, candidates, static=candidates[0])
    return _decide(spec, requested, config.fallback, device, inputs, capability)


# Whether Dynamo traces guard_scalar (into a constant and a guard): from torch 2.8 on. Torch 2.4 to 2.7 skip it, a
# graph break in every compiled op with a bool, int or float input (fullgraph fails), constant ones included.
_TRACES_GUARD_SCALAR = torch.__version__ >= (2, 8)


def _describe(spec: OpSpec, inputs: dict, traces_guard_scalar: bool = _TRACES_GUARD_SCALAR) -> tuple:
    """The inputs as constants for torch.compile: a tensor by dtype, rank, requires_grad and, for the inputs the
    spec names in `widths`, its last size, which the graph specialises on. Other sizes are left out: they may be
    symbolic, and a rank-1 input's length (values, offsets, timestamps, cu_seqlens) changes from batch to batch,
    so describing it would compile a graph per length. A bool, int or float value (symbolic under dynamic shapes)
    is specialised: the graph guards on it (traces_guard_scalar: see _constant).
    """
    read, widths = spec.read_inputs, spec.widths  # only what the reasons read: a call's eps or p would be specialised
    return tuple(
        (
            name,
            (
                "tensor",
                v.dtype,
                v.dim(),
                operator.index(v.shape[-1]) if name in widths and v.dim() else None,
                v.requires_grad,
            )
            if isinstance(v, torch.Tensor)
            else ("value", _constant(v, traces_guard_scalar)),
        )
        for name, v in inputs.items()
        if read is None or name in read
    )


def _constant(value, traces_guard_scalar: bool = _TRACES_GUARD_SCALAR):
    """A symbolic bool, int or float as the constant the graph then guards on.

    Dynamo makes a float argument symbolic under dynamic shapes (dropout_p, scale, eps, also a default value), and
    it sees symbolic numbers as plain bool/int/float (isinstance(x, torch.SymFloat) is False while tracing), where
    float() and int() would keep them symbolic: guard_scalar is the call Dynamo turns into a constant and a guard.
    Where Dynamo does not trace it (traces_guard_scalar False, before torch 2.8: _TRACES_GUARD_SCALAR), only what
    isinstance finds symbolic is specialised.
    """
    if not traces_guard_scalar:
        if isinstance(value, torch.SymInt):
            return operator.index(value)
        if isinstance(value, torch.SymBool):
            return True if value else False
        return value
    if isinstance(value, (int, float)):  # bool is an int
        from torch.fx.experimental.symbolic_shapes import guard_scalar  # loaded by then: this runs while compiling

        return guard_scalar(value)
    return value


def _decide_while_compiling(op: str, backend: str | None, device: torch.device, described: tuple) -> str:
    """Runs (untraced) while torch.compile traces an op: the decision is a constant of the compiled graph."""
    config = _config.active_config()
    requested = backend if backend is not None else config.backend_for(op)
    return _decide(REGISTRY[op], requested, config.fallback, device, _stand_ins(described, device))


def _stand_ins(described: tuple, device: torch.device) -> dict:
    """The inputs _describe describes, tensors as empty ones of the same dtype, rank and requires_grad on the same
    device, their last size the described one (a width) or 2, as every other size."""
    inputs = {}
    for name, (kind, *rest) in described:
        if kind == "tensor":
            dtype, rank, last, requires_grad = rest
            shape = (2,) * (rank - 1) + (2 if last is None else last,) if rank else ()
            inputs[name] = torch.empty(shape, dtype=dtype, device=device).requires_grad_(
                requires_grad and dtype.is_floating_point
            )
        else:
            inputs[name] = rest[0]
    return inputs


# what torch.compiler.assume_constant_result does, without importing torch._dynamo (over a second) at
# package import; tests/unit/test_compile.py proves the compiler honours it
_decide_while_compiling._dynamo_marked_constant = True


def _check_requested(spec: OpSpec, requested) -> None:
    if requested not in BACKENDS:
        raise ValueError(f"{spec.name}: unknown backend {requested!r}; expected one of {BACKENDS}")


def _decide(
    spec: OpSpec,
    requested: str,
    fallback: str,
    device: torch.device,
    inputs: dict,
    capability: tuple[int, int] | None = None,
) -> str:
    """The static decision (capability: as _decide_or_tune's)."""
    _check_requested(spec, requested)
    if requested == "torch":
        return "torch"
    if requested == "auto":
        candidates, skipped = spec.auto_candidates(device, capability, **inputs)
        if candidates:
            return candidates[0]
        logger.debug("%s: auto chose torch; %s", spec.name, skipped)
        return "torch"
    reasons = spec.not_supported_reasons(requested, device, capability, **inputs)
    if not reasons:
        return requested
    message = f"{spec.name}: the {requested} backend cannot run these inputs: " + "; ".join(reasons)
    if fallback == "error":
        raise BackendUnavailableError(message)
    warn_key = (spec.name, requested, tuple(reasons))
    if warn_key not in _warned:
        _warned.add(warn_key)
        warnings.warn(message + ". Running the torch reference instead.", BackendFallbackWarning, stacklevel=4)
    return "torch"


def place_decision(
    op: str, key: Hashable, device: torch.device, decision: "str | autotune.Tuned", backend: Backend | None = None
) -> None:
    """Make `decision` what select_backend answers for calls of `op` with this decision key on `device`, `backend`
    requested (None: what the active config asks for the op), under the active config: for tools and tests that time
    or check a decision select_backend would not make here, such as a table of measured decisions (autotune.Tuned,
    with a timer of theirs) on the CPU. clear_decisions() forgets it."""
    config = _config.active_config()
    requested = backend if backend is not None else config.backend_for(op)
    _decisions[(op, requested, config.fallback, config.autotune, device, key)] = decision


def clear_decisions() -> None:
    """Forget cached decisions (measured ones too: the decisions file is read again, as by a new process) and
    emitted warnings (tests; after changing TRITON_INTERPRET, TAAC_AUTOTUNE or TAAC_CACHE)."""
    _decisions.clear()
    _warned.clear()
    autotune.forget()
