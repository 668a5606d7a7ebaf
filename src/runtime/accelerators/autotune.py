"""Measured "auto": on CUDA, the first call of an op per shape class times each kernel backend that can run it and
keeps the fastest; the decisions persist in a JSON file, so the next process starts decided.

A shape class is the op's function, whether the call trains (gradients enabled and an input requiring one), the last
size of its first tensor and every tensor input's element count (leading dims folded), each rounded up to a power of
two: a training run with a few batch and sequence sizes measures a handful of times, not every batch. Together with the
op's decision key (dtype, widths, flags: `select_backend`'s key), the GPU's name and the torch, Triton and TileLang
versions it names one decision in the file.

A trial calls the op's public function with an explicit backend (never "auto") on the call's tensors detached (the
same memory; the caller's graph and .grad are untouched): forward, and where the call trains, backward with a
gradient of ones, a few eager calls of it timed by CUDA events as GPU time (the launch gaps hidden, see
cuda_event_timer). Random number generator states are saved and restored around the trials (dropout draws its seeds
from them), a trial that raises excludes its backend (the reason is logged and kept in the file), and none
runs during CUDA-graph capture: `select_backend` does not measure while torch.compile traces, and under capture a
call takes the decision in the file, else the static priority.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # Windows: writes are atomic, but not serialized between processes
    fcntl = None

logger = logging.getLogger("runtime.accelerators")

CACHE_DIR_ENV = "TAAC_CACHE"  # the folder of autotune.json (default ~/.cache/taac-runtime)
SWITCH_ENV = "TAAC_AUTOTUNE"  # 0 (or false, off, no): "auto" keeps the static priority list
FILE_FORMAT = 1
TIMED_REPLAYS = 10
_grad_enabled = torch.is_grad_enabled  # bound once: shape_class runs on every measured call

Timer = Callable[[Callable[[], object]], float]


def off_reason(config) -> str | None:
    """Why "auto" does not measure under this config and environment; None when it does (on CUDA)."""
    if not config.autotune:
        return "autotuning is off (accelerators.autotune=false)"
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return f"autotuning is off ({SWITCH_ENV}={os.environ[SWITCH_ENV]})"
    return None


# --------------------------------------------------------------------------- shape classes


def shape_class(call, inputs: Mapping) -> tuple:
    """(call, trains, ceil(log2(width)), then ceil(log2(numel)) per tensor input), -1 for a size 0.

    width is the last size of the first tensor input with a dim; with it, the first tensor's numel stands for its rows
    (leading dims folded). Runs on every measured call, so it reads as few tensor attributes as it can (each read is a
    few hundred nanoseconds of host time); bit_length() of a size is a small, cached int.
    """
    exponents = [call, False, 0]
    trains = False
    width = None
    for value in inputs.values():
        if isinstance(value, Tensor):
            trains = trains or value.requires_grad
            if width is None and value.dim():
                width = value.shape[-1]
                exponents[2] = (width - 1).bit_length() if width else -1
            n = value.numel()
            exponents.append((n - 1).bit_length() if n else -1)
    exponents[1] = trains and _grad_enabled()
    return tuple(exponents)


def describe_shape(shape: tuple) -> str:
    """A shape class as people read it: "rms_norm(width 128, numel 2^20 2^7) fwd+bwd" (each rounded up)."""
    call, trains, width, *numels = shape
    sizes = " ".join("0" if e < 0 else f"2^{e}" for e in numels)
    width = 0 if width < 0 else 1 << width
    return f"{getattr(call, '__name__', call)}(width {width}, numel {sizes}) {'fwd+bwd' if trains else 'fwd'}"


# --------------------------------------------------------------------------- the environment


@functools.cache
def library_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return gpu_name(torch.cuda.current_device() if device.index is None else device.index)


def environment(device: torch.device) -> dict:
    """What a measured decision holds for: the device's name and the library versions."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": library_version("triton"),
        "tilelang": library_version("tilelang"),
    }


# --------------------------------------------------------------------------- the decisions file


def default_path() -> Path:
    folder = os.environ.get(CACHE_DIR_ENV)
    if folder:
        return Path(folder) / "autotune.json"
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and no password entry for this user (a container run under an arbitrary uid)
        fallback = Path(tempfile.gettempdir()) / "taac-runtime"
        warnings.warn(
            f"autotune: no home directory; the decisions file is {fallback / 'autotune.json'} (set {CACHE_DIR_ENV})",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback / "autotune.json"
    return home / ".cache" / "taac-runtime" / "autotune.json"


class DecisionFile:
    """The measured decisions of every process on this machine: a JSON file, read once, rewritten atomically (a
    temporary file renamed over it) on each new decision, merged with what other processes wrote since."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._entries: dict[str, dict] | None = None

    def _read(self) -> dict[str, dict] | None:
        """The valid entries on disk: none where there is no file or a corrupt one; None where it cannot be read (it
        may hold good decisions: put() leaves it alone)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as error:
            warnings.warn(f"autotune: cannot read {self.path} ({error}); measuring again", RuntimeWarning, stacklevel=2)
            return None
        try:
            data = json.loads(raw)  # raises UnicodeDecodeError (a ValueError) on bytes that are not text
            if (
                not isinstance(data, dict)
                or data.get("format") != FILE_FORMAT
                or not isinstance(data.get("entries"), dict)
            ):
                raise ValueError(f"expected an object with format {FILE_FORMAT} and entries")
            return {key: entry for key, entry in data["entries"].items() if _valid_entry(entry)}
        except (ValueError, RecursionError) as error:  # json.JSONDecodeError is a ValueError; deep nesting recurses
            warnings.warn(
                f"autotune: ignoring the corrupt decisions file {self.path} ({error}); it is rewritten with new measurements",
                RuntimeWarning,
                stacklevel=2,
            )
            return {}

    def entries(self) -> dict[str, dict]:
        if self._entries is None:
            read = self._read()
            self._entries = read if read is not None else {}
        return self._entries

    def get(self, key: str) -> dict | None:
        return self.entries().get(key)

    def put(self, key: str, entry: dict) -> None:
        entries = self.entries()
        entries[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():  # another process's read-merge-rename in between would drop one of the two decisions
                on_disk = self._read_quietly()
                if on_disk is None:
                    logger.warning(
                        "autotune: cannot read %s, so it is left as it is; the decision holds for this process only",
                        self.path,
                    )
                    return
                merged = {**on_disk, **entries}
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
                try:
                    with os.fdopen(fd, "w") as file:
                        json.dump({"format": FILE_FORMAT, "entries": merged}, file, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
        except OSError as error:
            logger.warning("autotune: cannot write %s (%s); the decision holds for this process only", self.path, error)

    @contextlib.contextmanager
    def _locked(self):
        """An exclusive lock on <file>.lock beside the file, held while reading, merging and renaming (none where
        fcntl is missing: Windows)."""
        if fcntl is None:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_quietly(self) -> dict[str, dict] | None:
        """What is on disk now (another process may have added decisions); a corrupt file counts as empty, one that
        cannot be read as None."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._read()


def _valid_entry(entry) -> bool:
    """Whether an entry has the fields "auto" and explain() read, of their types (a hand-edited or foreign file)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("winner"), str):
        return False
    times, failed = entry.get("times_ms"), entry.get("failed", {})
    return (
        isinstance(times, dict)
        and all(isinstance(ms, (int, float)) and not isinstance(ms, bool) for ms in times.values())
        and isinstance(failed, dict)
        and all(isinstance(why, str) for why in failed.values())
        and all(isinstance(entry.get(name, ""), str) for name in ("op", "shape", "key"))
    )


_files: dict[Path, DecisionFile] = {}  # one per path; cleared by forget()


def decision_file() -> DecisionFile:
    """The decisions file at $TAAC_CACHE/autotune.json, else ~/.cache/taac-runtime/autotune.json."""
    path = default_path()
    file = _files.get(path)
    if file is None:
        file = _files[path] = DecisionFile(path)
    return file


def forget() -> None:
    """Drop what was read from decision files (the next lookup reads the file again, as a new process would)."""
    _files.clear()


# --------------------------------------------------------------------------- trials


def cuda_event_timer(run: Callable[[], object], replays: int = TIMED_REPLAYS) -> float:
    """Median GPU milliseconds per call of `run` on the current device, by CUDA events around eager calls after two
    untimed ones (the first compiles the kernel).

    The timed calls are queued behind a GPU sleep that lasts until the host has queued all of them, so the events time
    the GPU's work without the host's launch gaps: what a CUDA-graphed step replays, and what the benchmark reports.
    Timing the eager gaps instead chose the backend with the cheaper launch (Triton's layer_norm at 8192x128: 0.34 ms
    eager against TileLang's 0.68 ms) where the other's kernels ran 25% faster. Eager calls, not a captured graph:
    capturing a trial left the device's random number generator unusable for later draws ("Offset increment outside
    graph capture")."""
    run()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    run()
    torch.cuda.synchronize()
    host_ms = 1e3 * (time.perf_counter() - begin)  # at least the host's time to queue one call
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda._sleep(int(sleep_cycles_per_ms(torch.cuda.current_device()) * (2 * replays * host_ms + 1)))
    for start, end in pairs:
        start.record()
        run()
        end.record()
    pairs[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


@functools.cache
def sleep_cycles_per_ms(index: int) -> float:
    """The GPU clock cycles torch.cuda._sleep spins per millisecond on this device, measured once."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


@functools.cache
def parameter_names(function) -> frozenset[str] | None:
    """The names a function takes by keyword; None when it takes any (**kwargs)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY)


def accepted(function, inputs: Mapping) -> dict:
    """The inputs `function` takes by name (select_backend's inputs hold both the call's arguments and what the reasons
    read)."""
    names = parameter_names(function)
    return dict(inputs) if names is None else {name: value for name, value in inputs.items() if name in names}


def _output_tensors(result) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def trial(call, inputs: Mapping, backend: str, trains: bool) -> Callable[[], object]:
    """A zero-argument replay of the call on `backend`: forward, and forward + backward (a gradient of ones) when the
    call trains. Tensors are detached (leaves of their own when they require a gradient), so the caller's graph and
    .grad are untouched."""
    args = {}
    for name, value in accepted(call, inputs).items():
        if isinstance(value, torch.Tensor):
            value = value.detach().requires_grad_(trains and value.requires_grad)
        args[name] = value
    if not trains:
        return lambda: call(**args, backend=backend)
    leaves = [v for v in args.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    ones: list[torch.Tensor] = []  # made by the first replay (untimed), from its outputs

    def forward_backward():
        outputs = _output_tensors(call(**args, backend=backend))
        if not ones:
            ones.extend(torch.ones_like(t) for t in outputs)
        if outputs:
            torch.autograd.grad(outputs, leaves, ones, allow_unused=True)

    return forward_backward


def measure(
    call, inputs: Mapping, candidates: tuple[str, ...], device: torch.device, *, timer: Timer = cuda_event_timer
):
    """Time each candidate backend on this call: ({backend: ms per call}, {backend: why its trial failed}).

    The generator states of the CPU and of the device are restored afterwards, so the caller draws what it would have.
    """
    trains = torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    times, failed = {}, {}
    cuda = device.type == "cuda"
    index = (torch.cuda.current_device() if device.index is None else device.index) if cuda else None
    on_device = torch.cuda.device(index) if cuda else contextlib.nullcontext()  # the kernels' and the events' device
    with torch.random.fork_rng(devices=[index] if cuda else []), on_device:
        for backend in candidates:
            try:
                times[backend] = float(timer(trial(call, inputs, backend, trains)))
            except Exception as error:  # a kernel that fails to compile or run: excluded, the call goes on
                failed[backend] = f"{type(error).__name__}: {error}"
                logger.warning(
                    "autotune: %s on %s failed its trial and is excluded: %s",
                    getattr(call, "__name__", call),
                    backend,
                    failed[backend],
                )
    return times, failed


# --------------------------------------------------------------------------- per-decision tables


class Tuned:
    """The measured decisions of one op for one decision key and device: shape class -> backend.

    `choose` is the hot path of a measured "auto" call: the shape class and one dict lookup. A new shape class reads
    the decisions file, else measures. The timer, the capture probe (default: whether the current CUDA stream is
    capturing a graph) and the file (default: decision_file()) are parameters, so tests can fake them.
    """

    __slots__ = ("op", "key", "device", "candidates", "static", "table", "timer", "capturing", "file")

    def __init__(
        self,
        op: str,
        key,
        device: torch.device,
        candidates: tuple[str, ...],
        static: str,
        *,
        timer: Timer = cuda_event_timer,
        capturing: Callable[[], bool] | None = None,
        file: DecisionFile | None = None,
    ) -> None:
        self.op, self.key, self.device = op, key, device
        self.candidates, self.static = candidates, static
        self.table: dict[tuple, str] = {}
        self.timer, self.file = timer, file
        self.capturing = capturing if capturing is not None else _stream_capturing if device.type == "cuda" else _never

    def choose(self, call, inputs: Mapping) -> str:
        chosen = self.table.get(shape_class(call, inputs))
        return chosen if chosen is not None else self._resolve(call, inputs)

    def entry_key(self, shape: tuple) -> str:
        env = environment(self.device)
        return " | ".join((self.op, describe_shape(shape), repr(self.key), *(f"{k} {v}" for k, v in env.items())))

    def _resolve(self, call, inputs: Mapping) -> str:
        shape = shape_class(call, inputs)
        if call is None or -1 in shape[2:]:
            return self.static  # nothing to measure: the op runs no kernel on this call (an empty tensor, no dropout)
        file = self.file if self.file is not None else decision_file()
        key = self.entry_key(shape)
        entry = file.get(key)
        if entry is not None and (entry["winner"] in self.candidates or entry["winner"] == "torch"):
            self.table[shape] = entry["winner"]
            return entry["winner"]
        if self.capturing():
            return self.static  # no trial inside a graph being captured; a later eager call measures
        times, failed = measure(call, inputs, self.candidates, self.device, timer=self.timer)
        winner = min(times, key=times.get) if times else "torch"
        logger.info("autotune: %s %s -> %s (%s)", self.op, describe_shape(shape), winner, times)
        if times:  # with every trial failed (out of memory?) torch runs, and the next process measures again
            file.put(
                key,
                {
                    "op": self.op,
                    "shape": describe_shape(shape),
                    "key": repr(self.key),
                    **environment(self.device),
                    "times_ms": times,
                    "failed": failed,
                    "winner": winner,
                },
            )
        self.table[shape] = winner
        return winner


def _stream_capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _never() -> bool:
    return False


def measured_entries(op: str, device: torch.device) -> list[dict]:
    """The decisions in the file for this op that hold here (this device's name and these library versions)."""
    env = environment(device)
    found = []
    for entry in decision_file().entries().values():
        if entry.get("op") == op and all(entry.get(name) == value for name, value in env.items()):
            found.append(entry)
    return sorted(found, key=lambda e: (e.get("shape", ""), e.get("key", "")))
