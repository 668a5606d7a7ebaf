"""A CPU check of the TileLang kernels' launch arguments, against what each kernel's signature declares.

On the GPU, TileLang's entry point refuses a launch whose arguments do not match the kernel's T.prim_func (a tensor's
dtype, rank, a static size, a dynamic size that differs between two tensors, non-compact strides for a T.Tensor, the
argument count); on the CPU nothing runs it, so such a bug shows only on the GPU. `patch_launchers` puts a stand-in
for tilelang_common.launcher into every TileLang kernel module: it builds the kernel's prim_func (no GPU needed),
checks each launch's arguments against it as the GPU's entry point does, records the kernel's name, and runs nothing.
`kernels_on_cpu` also lets the tilelang backend take CPU tensors, so that the public ops run their TileLang launch
path (input preparation, forward, backward) on the CPU. Outputs are garbage (nothing is written): only the launches
are checked.
"""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import sys
import types

import pytest
import torch

tc = pytest.importorskip(
    "runtime.accelerators.tilelang_common", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

from tilelang import tvm  # noqa: E402
from tvm import tirx  # noqa: E402

import runtime.accelerators as acc  # noqa: E402
from runtime.accelerators import backends  # noqa: E402

DTYPE_NAME = {**tc.TL_DTYPE, torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}
_built: dict = {}  # entry key -> the built prim_func (building is deterministic in the key)


def _function(entry):
    key, build = entry
    func = _built.get(key)
    if func is None:
        func = build(tc.device_info(None))  # the compile-only H100 (sm_90a, 132 SMs)
        func = _built[key] = func.func if isinstance(func, tc.Unchecked) else func
    return func


def _value(expr, sizes: dict, analyzer) -> int | None:
    """expr's value with the dynamic sizes bound so far; None where it still depends on others."""
    found = analyzer.simplify(tirx.stmt_functor.substitute(expr, sizes)) if sizes else expr
    return int(found.value) if isinstance(found, tirx.IntImm) else None


def _relaxed(expected: int, axis_size: int | None) -> bool:
    """A stride the entry point does not check: that of an axis of size 1, or one declared 0 (an empty tensor)."""
    return axis_size is not None and (axis_size == 1 or expected == 0)


def check_launch(name: str, func, args: tuple) -> None:
    """Raise AssertionError where `args` differ from what `func`'s signature declares, as TileLang's entry point
    checks them on the GPU (tvm_ffi_binder.cc): the count; each tensor's dtype, rank, sizes and strides (a T.Tensor's
    compact; sizes of 1 excepted), each dynamic size or stride the same wherever it appears; scalars of the declared
    kind (an int for an integer, a number for a float)."""
    assert len(args) == len(func.params), f"{name}: {len(args)} arguments for {len(func.params)}"
    sizes: dict = {}  # dynamic size or stride (tir.Var) -> its value in this launch
    where: dict = {}  # the same -> where it was bound, for messages
    later = []  # (message, declared expression, actual value, size of the axis): checked once every Var is bound
    for param, arg in zip(func.params, args):
        if param not in func.buffer_map:
            what = f"{name}: scalar {param.name}"
            assert not isinstance(arg, torch.Tensor), f"{what} is a tensor"
            if param.dtype.startswith(("int", "uint")):
                assert isinstance(arg, int), f"{what} ({param.dtype}) is {type(arg).__name__} {arg!r}"
            elif param.dtype.startswith(("float", "bfloat")):
                assert isinstance(arg, (int, float)) and not isinstance(arg, bool), (
                    f"{what} ({param.dtype}) is {type(arg).__name__} {arg!r}"
                )
            continue
        buffer = func.buffer_map[param]
        what = f"{name}: {buffer.name}"
        assert isinstance(arg, torch.Tensor), f"{what} is {type(arg).__name__}, not a tensor"
        assert DTYPE_NAME[arg.dtype] == str(buffer.dtype), f"{what} is {arg.dtype}, the kernel declares {buffer.dtype}"
        shape, strides = list(buffer.shape), list(buffer.strides)
        declared = f"{what} is {tuple(arg.shape)} with strides {arg.stride()}; the kernel declares {shape}"
        assert arg.dim() == len(shape), declared
        if not strides:  # T.Tensor: compact
            expected = 1
            for axis in reversed(range(arg.dim())):
                assert arg.shape[axis] == 1 or expected == 0 or arg.stride(axis) == expected, declared + " (compact)"
                expected *= arg.shape[axis]
        pairs = [(dim, size, None) for dim, size in zip(shape, arg.shape)]  # a size; a stride with its axis' size
        pairs += [(stride, actual, size) for stride, actual, size in zip(strides, arg.stride(), arg.shape)]
        for dim, actual, axis_size in pairs:
            message = f"{declared}, strides {strides}" if strides else declared
            if isinstance(dim, tirx.Var):
                if dim in sizes:
                    bound = int(sizes[dim])
                    assert bound == actual or _relaxed(bound, axis_size), (
                        f"{message}: {dim.name} is {bound} at {where[dim]}"
                    )
                else:
                    sizes[dim], where[dim] = tirx.const(actual, dim.dtype), buffer.name
            else:
                later.append((message, dim, actual, axis_size))
    analyzer = tvm.arith.Analyzer()
    for message, dim, actual, axis_size in later:
        value = _value(dim, sizes, analyzer)
        assert value is None or value == actual or _relaxed(value, axis_size), message


def checking_launcher(launched: list):
    """A stand-in for tilelang_common.launcher: the kernel's entry point checks its arguments (check_launch),
    appends the kernel's name to `launched` and runs nothing."""

    def launcher(entry, device):
        func, name = _function(entry), entry[0][0] if isinstance(entry[0], tuple) else entry[0]

        def run(*args):
            check_launch(str(name), func, args)
            launched.append(name)

        return run

    return launcher


ACCELERATORS = pathlib.Path(acc.__file__).parent


def kernel_modules() -> list[types.ModuleType]:
    """Every module of runtime.accelerators that launches TileLang kernels through tilelang_common.launcher (the op
    folders' tilelang*.py, imported here, and tilelang_common itself: its column sum)."""
    for path in sorted(ACCELERATORS.glob("*/tilelang*.py")):
        importlib.import_module(f"runtime.accelerators.{path.parent.name}.{path.stem}")
    return [
        module
        for name, module in sorted(sys.modules.items())
        if name.startswith("runtime.accelerators.") and getattr(module, "launcher", None) is tc.launcher
    ]


def patch_launchers(monkeypatch) -> list:
    """Patch checking_launcher into every kernel module, also where a function takes the launcher as a default
    argument (`launch=launcher`, keyword-only or not); returns the list each launch appends its kernel's name to."""
    launched: list = []
    stand_in = checking_launcher(launched)
    for module in kernel_modules():
        monkeypatch.setattr(module, "launcher", stand_in)
        for value in vars(module).values():
            if not isinstance(value, types.FunctionType):
                continue
            defaults, keyword_defaults = value.__defaults__ or (), value.__kwdefaults__ or {}
            if any(d is tc.launcher for d in defaults):
                patched = tuple(stand_in if d is tc.launcher else d for d in defaults)
                monkeypatch.setattr(value, "__defaults__", patched)
            if any(d is tc.launcher for d in keyword_defaults.values()):
                patched = {name: stand_in if d is tc.launcher else d for name, d in keyword_defaults.items()}
                monkeypatch.setattr(value, "__kwdefaults__", patched)
    monkeypatch.setattr(tc, "compiled", _no_compile)
    return launched


def _no_compile(entry, device):
    raise AssertionError(f"{entry[0]}: compiled() called outside launcher; this check does not cover it")


@contextlib.contextmanager
def kernels_on_cpu(monkeypatch):
    """The tilelang backend takes CPU tensors (its device check skipped), launch plans see the compile-only H100 as
    the device, and an unsupported input raises instead of falling back to torch; yields the list of launched
    kernels' names (patch_launchers)."""
    launched = patch_launchers(monkeypatch)
    device_reasons = backends.device_reasons

    def cpu_too(backend, device, capability=None):
        if backend == "tilelang" and device.type == "cpu":
            return []
        return device_reasons(backend, device, capability)

    monkeypatch.setattr(backends, "device_reasons", cpu_too)
    # launch plans see the compile-only H100: its SM count (backends.sm_count gives 0 for the CPU, which would take
    # the interpreter's plans), and tilelang_common.device_info(None) for the current device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    sm_count = backends.sm_count

    def h100_sm_count(device):
        return tc.H100_SMS if device.type == "cpu" else sm_count(device)

    for module in list(sys.modules.values()):
        if (
            module is not None
            and module.__name__.startswith("runtime.")
            and getattr(module, "sm_count", None) is sm_count
        ):
            monkeypatch.setattr(module, "sm_count", h100_sm_count)
    backends.clear_decisions()
    try:
        with acc.use_accelerators(fallback="error"):
            yield launched
    finally:
        backends.clear_decisions()
