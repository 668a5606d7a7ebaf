"""C++ autograd nodes for the backward of eager Triton calls (backward_node.cpp).

An eager call through `autograd.Function` runs its backward in Python on autograd's device thread; on the GPU
machine handing the GIL to that thread and back costs more than a small norm's whole native backward. An op whose
backward is one Triton launch can instead give its output a node from here (`NativeBackward.attach`), built from the
LaunchPlan its eager backward runs: the node saves the tensors the launch reads and launches the compiled kernel
through the CUDA driver, without Python.

The extension is compiled from source with the C++ compiler on first use (about 15 s, cached per torch and Python
version under $TAAC_NATIVE_CACHE or ~/.cache/taac-runtime). Where that cannot be, or TAAC_NATIVE_BACKWARD=0, or
the Triton version's launch convention is not one this module knows, `reasons()` says why and the ops keep their
autograd.Function.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .. import buffers
from ..backends import logger
from ..launch_plan import LaunchPlan
from .build import load_extension

try:
    from ..triton_launch import _driver, _signature
except ImportError:  # no triton: reasons() says so, and no plan is made
    pass

# Triton versions whose kernels take their parameters as backward_node.cpp passes them: the non-constexpr
# arguments in order, then the global and profile scratch pointers
KNOWN_TRITON = ("3.6.0",)


class _Marker:
    """Stands in a backward kernel's arguments for a tensor that exists only at backward time."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


GRAD = _Marker("GRAD")  # the gradient of the op's output
OUTPUT = _Marker("OUTPUT")  # the op's output (saved for backward)
GRAD_OF = tuple(_Marker(f"GRAD_OF[{i}]") for i in range(4))  # the gradient of the op's input i, allocated like it


@functools.cache
def reasons() -> tuple[str, ...]:
    """Why eager calls cannot use native backward nodes here (empty: they can). Builds the extension if need be."""
    found = _environment_reasons()
    if not found and extension() is None:
        found = (f"the C++ extension did not build: {_build_error}",)
    return found


def describe() -> str:
    """One line for explain(), without building anything."""
    found = _environment_reasons()
    if not found and extension.cache_info().currsize:
        found = reasons()
    if found:
        return "eager backward of triton norms: autograd.Function (" + "; ".join(found) + ")"
    built = "" if extension.cache_info().currsize else ", compiled on first use"
    return f"eager backward of triton norms: C++ nodes{built}"


def _environment_reasons() -> tuple[str, ...]:
    if os.environ.get("TAAC_NATIVE_BACKWARD", "1") == "0":
        return ("TAAC_NATIVE_BACKWARD=0",)
    try:
        import triton
    except ImportError:
        return ("triton is not installed",)
    if triton.__version__ not in KNOWN_TRITON:
        return (f"triton {triton.__version__}'s launch convention is not checked (known: {', '.join(KNOWN_TRITON)})",)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("TRITON_INTERPRET=1",)
    return ()


_build_error = ""


@functools.cache
def extension():
    """The compiled extension, or None (the error in _build_error, warned once)."""
    global _build_error
    try:
        module = load_extension()
    except Exception as error:  # a missing compiler or headers: the ops keep their autograd.Function
        _build_error = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"runtime.accelerators.native: {_build_error}; eager backward stays in Python", RuntimeWarning, stacklevel=2
        )
        return None
    module.set_poison(buffers.poisoning())
    return module


def _tell_extension(poisoning: bool) -> None:
    """buffers.poison_outputs() reaches the gradients the C++ nodes allocate (where the extension is loaded)."""
    if extension.cache_info().currsize and extension() is not None:
        extension().set_poison(poisoning)


buffers.on_poison_change(_tell_extension)


class NativeBackward:
    """The backward of one op's eager calls as a C++ node that launches `kernel` (a @direct_launch kernel). Per call,
    with `launch` the op's backward LaunchPlan (runtime.accelerators.launch_plan) of `kernel`, one launch:

        plan = NATIVE.plan(output_dtype, inputs, launch)   # None: this call cannot
        ... run the forward ...
        NATIVE.attach(plan, output, inputs, launch)

    `inputs`: the op's differentiable inputs (None: no gradient); attach gives `output` the node, with an edge to
    each, and returns False, attaching nothing, where an input carries a forward-mode tangent. `launch.args`: the
    kernel's arguments as the eager backward passes them (a contiguous gradient), with GRAD for the output's
    gradient, OUTPUT for the output and GRAD_OF[i] for the gradient of inputs[i] (allocated like it);
    `launch.scratch`: zero-filled buffers among them that the kernel leaves zeroed (a CUDA graph captures fresh
    ones). Every other tensor among the arguments is saved for backward.
    """

    def __init__(self, name: str, kernel) -> None:
        self.name = name
        self.kernel = kernel
        self._plans: dict = {}

    def plan(self, output_dtype: torch.dtype, inputs: tuple, launch: LaunchPlan):
        """The extension's Plan of this launch (the kernel compiled now if need be), or None where native nodes
        cannot run here or the compiled kernel needs more than a plain launch."""
        # the current device's: Triton compiles and loads a kernel for it, and launches go to its stream
        key = (
            _driver()[0](),
            output_dtype,
            *[None if t is None else t.dtype for t in inputs],
            *launch.constexprs.values(),
            *_signature(launch.args),
        )
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._plans[key] = self._new_plan(output_dtype, inputs, launch)
        return plan

    def attach(self, plan, output: torch.Tensor, inputs: tuple, launch: LaunchPlan) -> bool:
        current_device, current_stream = _driver()
        stream = current_stream(current_device())
        return extension().attach(
            plan, output, inputs, launch.args, launch.scratch, GRAD, OUTPUT, GRAD_OF, launch.grid, stream
        )

    def _new_plan(self, output_dtype, inputs, launch: LaunchPlan):
        if launch.kernel is not self.kernel or launch.after:
            raise ValueError(f"{self.name}: a native node runs one launch of its own kernel")
        if reasons():
            return None
        args = launch.args
        stand_ins = [_stand_in(a, output_dtype, inputs) for a in args]
        compiled = self.kernel.kernel.warmup(*stand_ins, grid=launch.grid, **launch.constexprs)
        compiled._init_handles()
        metadata = compiled.metadata
        plain = (
            getattr(metadata, "num_ctas", 1) == 1
            and not metadata.launch_cooperative_grid
            and not metadata.launch_pdl
            and not metadata.global_scratch_size
            and not metadata.profile_scratch_size
        )
        types = _parameter_types(compiled.src.signature, len(args))
        if not plain or types is None:
            logger.info(
                "%s: the compiled kernel needs more than a plain launch; its backward stays in Python", self.name
            )
            return None
        positions, codes = zip(*types) if types else ((), ())
        threads = metadata.num_warps * 32
        return extension().Plan(self.name, compiled.function, threads, metadata.shared, list(positions), "".join(codes))


_TYPE_CODES = {"i32": "i", "i64": "l", "fp32": "f"}


def _parameter_types(signature: dict, n_positional: int) -> list[tuple[int, str]] | None:
    """[(argument position, type code)] of a compiled kernel's parameters (constexprs left out, as Triton's launcher
    leaves them out), from its signature {name: type}; None where a type is not one the extension passes. Only
    positional arguments may be parameters: the keyword ones are constexprs."""
    types = []
    for position, kind in enumerate(signature.values()):
        if kind == "constexpr":
            continue
        code = "p" if kind.startswith("*") else _TYPE_CODES.get(kind)
        if code is None or position >= n_positional:
            return None
        types.append((position, code))
    return types


def _stand_in(arg, output_dtype: torch.dtype, inputs: tuple):
    """What Triton compiles `arg` as: a marker's tensor by its dtype (Triton's warmup takes a dtype for a tensor)."""
    if arg is GRAD or arg is OUTPUT:
        return output_dtype
    if isinstance(arg, _Marker):
        return inputs[GRAD_OF.index(arg)].dtype
    return arg
