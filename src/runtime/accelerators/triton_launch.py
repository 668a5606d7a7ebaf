"""Direct launches of compiled Triton kernels: the host time of an eager call.

`kernel[grid](...)` on a JITFunction binds and specialises every argument in Python, reads Triton's
knobs and checks the module globals the kernel reads, on every call: about 10 us of host time on the
GPU machine, more than a norm kernel takes on the GPU at PCVR sizes. A kernel decorated with
`@direct_launch` (over `@triton.jit`) is launched the same way, `kernel[grid](*args, **constexprs)`:
the first call with a given argument signature goes through Triton (compiling if needed) and keeps
the CompiledKernel Triton returns; later calls with that signature launch it directly.

The signature (`_arg_key`) holds everything Triton specialises a compiled kernel on, and more: the
constexprs and launch options as passed, the current device, and per argument its dtype and 16-byte
alignment (tensors), its integer width class, divisibility by 16 and == 1 (ints), or its type. Two
calls with the same signature therefore get the same compiled kernel from Triton; a finer key only
costs an extra first call. The key is one flat tuple of scalars (hashing and comparing nested tuples
was a good part of a launch's host time). Under TRITON_INTERPRET=1 (the CPU tier) every call goes
through Triton.

`stand_in_launches` times that host path on a machine without a GPU (tools/host_overhead.py): within its block the
given launches take the direct path against stand-ins that compile to nothing and launch nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Iterator

import torch
import triton
from triton.runtime.jit import JITFunction

_INT32 = range(-(2**31), 2**31)
_U64 = 2**63  # ints from here on are unsigned 64-bit for Triton
_Tensor = torch.Tensor
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return "constexpr" in str(parameter.annotation)  # tl.constexpr, or its name under postponed annotations


def _arg_key(arg):
    """One hashable value per argument: a tensor's dtype (paired with False when its data is not 16-byte aligned),
    an int's flags as bits (_int_key), else the argument's type."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype if arg.data_ptr() % 16 == 0 else (arg.dtype, False)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return type(arg)
    return _int_key(arg)


_INT_KEYS: dict[int, int] = {}  # int argument -> _int_key: kernels see the same sizes and strides call after call
_INT_KEYS_MAX = 1 << 16


def _int_key(arg: int, known: dict[int, int] = _INT_KEYS, bound: int = _INT_KEYS_MAX) -> int:
    """An int's flags as bits: == 1, divisible by 16, 32-bit, unsigned 64-bit (working them out costs several times
    the lookup in _INT_KEYS), remembered in `known` while it holds fewer than `bound` ints."""
    key = (arg == 1) | (arg % 16 == 0) << 1 | (arg in _INT32) << 2 | (arg >= _U64) << 3
    if len(known) < bound:
        known[arg] = key
    return key


def _signature(args: tuple) -> list:
    """[_arg_key(a) for a in args], with plain tensors, ints, floats and None keyed inline: this runs on every launch,
    and a function call per argument was a good part of its host time (tests/unit/test_triton_launch.py checks that
    both agree). An int whose key is 0 (falsy) has it worked out again: the same key."""
    return [
        (a.dtype if a.data_ptr() % 16 == 0 else (a.dtype, False)) if type(a) is _Tensor
        else _INT_KEYS.get(a) or _int_key(a) if type(a) is int
        else type(a) if a is None or type(a) is float
        else _arg_key(a)
        for a in args
    ]  # fmt: skip


def _launcher(compiled) -> tuple:
    """(launch, extra): launch(grid_x, grid_y, grid_z, stream, function, *extra, packed metadata, launch metadata,
    enter hook, exit hook, *arguments, *constexprs) runs `compiled`. That is compiled.run (a property in Triton 3.6:
    read here once), or, for Triton 3.6.0's CudaLauncher (the GPU machine's) when it has no scratch memory to
    allocate, the launch function it calls, given the four arguments its Python __call__ adds (three frames and a
    closure per launch). Other versions change that __call__, so they keep compiled.run."""
    run = compiled.run
    if (
        triton.__version__ == "3.6.0"
        and type(run).__name__ == "CudaLauncher"
        and not run.global_scratch_size
        and not run.profile_scratch_size
    ):
        return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)
    return run, ()


@functools.cache
def _driver():
    """(current device, current stream) getters. torch.cuda.current_device, Triton's, first checks CUDA's lazy
    initialisation in two more Python frames per call: a launch reads the device of CUDA tensors, so CUDA is
    initialised, and torch's C getter alone answers the same."""
    active = triton.runtime.driver.active
    current_device = active.get_current_device
    if current_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
        current_device = torch._C._cuda_getDevice
    return current_device, active.get_current_stream


class DirectLaunch:
    """A @triton.jit kernel launched directly once compiled (see the module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction)  # an InterpretedFunction under TRITON_INTERPRET=1
        self._tail_names: dict[int, tuple[str, ...]] = {}
        self._compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch if self.direct else self._interpret, grid)

    def _interpret(self, grid, *args, **constexprs):
        self._tail(len(args), constexprs)  # the argument rules of a direct launch hold on the CPU tier too
        return self.kernel[grid](*args, **constexprs)

    def _launch(self, grid, *args, **constexprs):
        current_device, current_stream = _driver()
        device = current_device()
        # the number of constexprs first: the names, values and argument keys that follow split one way only
        key = (device, len(constexprs), *constexprs, *constexprs.values(), *_signature(args))
        found = self._compiled.get(key)
        if found is None:
            tail = self._tail(len(args), constexprs)
            compiled = self.kernel[grid](*args, **constexprs)
            self._compiled[key] = (compiled, tail, *_launcher(compiled))
            return compiled
        compiled, tail, launch, extra = found
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        stream = current_stream(device)
        # launch hooks, None where there is none: Triton 3.6 keeps empty HookChains until a profiler adds a hook, and
        # the launcher calls whatever it is given around every launch
        hooks = triton.knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        if enter is not None and not getattr(enter, "calls", True):
            enter = None
        if leave is not None and not getattr(leave, "calls", True):
            leave = None
        metadata = None if enter is None and leave is None else compiled.launch_metadata(grid, stream, *args, *tail)
        launch(
            grid_x, grid_y, grid_z, stream, compiled.function, *extra, compiled.packed_metadata, metadata, enter, leave,
            *args, *tail,
        )  # fmt: skip
        return compiled

    def _tail(self, n_positional: int, constexprs: dict) -> tuple:
        """The values of the parameters after the positional ones, in the kernel's order (Triton's launcher takes
        every parameter, constexprs included). The key holds keyword values and only the kind of each positional
        value, so runtime arguments must come by position and constexprs by name."""
        names = self._tail_names.get(n_positional)
        if names is None:
            parameters = list(inspect.signature(self.kernel.fn).parameters.values())
            by_position = [p.name for p in parameters[:n_positional] if _is_constexpr(p)]
            by_name = [p.name for p in parameters[n_positional:] if not _is_constexpr(p)]
            if by_position or by_name:
                raise TypeError(
                    f"{self.kernel.fn.__name__}: pass runtime arguments by position and constexprs by name; "
                    f"got constexprs {by_position} by position, runtime arguments {by_name} by name"
                )
            names = self._tail_names[n_positional] = tuple(p.name for p in parameters[n_positional:])
        missing = [name for name in names if name not in constexprs]
        unknown = set(constexprs) - set(names) - LAUNCH_OPTIONS
        if missing or unknown:
            raise TypeError(
                f"{self.kernel.fn.__name__}: constexprs missing: {missing}; unknown keywords: {sorted(unknown)}"
            )
        return tuple(constexprs[name] for name in names)


class _StandInCompiled:
    """Stands in for a CompiledKernel: what a direct launch reads from it, and a launcher that does nothing."""

    function, packed_metadata = 0, ()

    def run(self, *args) -> None:
        pass

    def launch_metadata(self, grid, stream, *args) -> None:
        return None


class _StandInKernel:
    """Stands in for a JITFunction: `kernel[grid](...)` "compiles" to the stand-in without launching anything."""

    def __init__(self, fn) -> None:
        self.fn = fn  # the kernel's signature, which DirectLaunch reads
        self.compiled = _StandInCompiled()

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.compiled


@contextlib.contextmanager
def stand_in_driver(device: int = 0, stream: int = 0) -> Iterator[None]:
    """Within the block, direct launches read `device` as the current device and `stream` as its current stream
    instead of asking Triton's driver (none is active on a machine without a GPU)."""
    global _driver
    previous = _driver
    getters = (lambda: device, lambda index: stream)
    _driver = functools.cache(lambda: getters)
    try:
        yield
    finally:
        _driver = previous


@contextlib.contextmanager
def stand_in_launches(launches: Iterable[DirectLaunch], *, device: int = 0, stream: int = 0) -> Iterator[None]:
    """For timing the host path of eager calls on a machine without a GPU: within the block each of `launches` takes
    the direct path (under TRITON_INTERPRET=1 too) against a stand-in kernel, whose first call per signature
    "compiles" to a stand-in compiled kernel whose launcher does nothing, so later calls run exactly the host work of
    a direct launch on the GPU machine; the current device and stream are `device` and `stream` (stand_in_driver).
    Kernels computing nothing, outputs hold whatever their memory held. On exit every launch gets back its kernel,
    its path and the compiled kernels it had."""
    saved = [(launch, launch.kernel, launch.direct, launch._compiled) for launch in launches]
    with stand_in_driver(device, stream):
        try:
            for launch, kernel, _, _ in saved:
                launch.kernel, launch.direct, launch._compiled = _StandInKernel(kernel.fn), True, {}
            yield
        finally:
            for launch, kernel, direct, compiled in saved:
                launch.kernel, launch.direct, launch._compiled = kernel, direct, compiled


def direct_launch(kernel) -> DirectLaunch:
    """Decorator over @triton.jit: launches skip Triton's per-call binding once compiled."""
    return DirectLaunch(kernel)
