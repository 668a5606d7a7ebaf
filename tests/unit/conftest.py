"""CPU tier: runs Triton kernels under Triton's interpreter (TRITON_INTERPRET=1).

The flag is read when a kernel is defined, so it is set here, before any kernel module imports.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
# xdist's workers share the cores: each worker's torch and BLAS threads take its share (two workers of two threads
# each on two cores ran interpreter tests about 12% slower than with one thread each)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )

import inspect  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from filelock import FileLock  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle  # noqa: E402

from runtime.accelerators.backends import clear_decisions  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # torch may have been imported before the variable was set
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _round_to_bf16(bits: np.ndarray) -> np.ndarray:
    """fp32 bit patterns to bf16 ones, rounded to nearest even (NaN stays a quiet NaN)."""
    bits = bits.astype(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, ((bits >> 16) | 0x0040).astype(np.uint16), rounded)


def _rounding_fp32_to_bf16(method):
    """The interpreter truncates fp32 -> bf16 (a bias of up to one bf16 unit, always towards zero); the GPU's
    conversion rounds to nearest even. Kernels that keep intermediates in bf16 are judged by what the GPU does."""

    def cast(self, src, dst_type, *rest):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data).view(np.uint32)
            return TensorHandle(_round_to_bf16(bits), dst_type.scalar)
        return method(self, src, dst_type, *rest)

    return cast


InterpreterBuilder.cast_impl = _rounding_fp32_to_bf16(InterpreterBuilder.cast_impl)
InterpreterBuilder.create_fp_to_fp = _rounding_fp32_to_bf16(InterpreterBuilder.create_fp_to_fp)


_BUILTIN_NAMES: dict[object, list[str]] = {}


def _patch_listed_builtins(pkg, builder, scope):
    """The interpreter wraps triton.language's builtins before every launch and again at every call of a jit helper
    inside a kernel, each time listing the package's members with inspect.getmembers (about a third of a small
    kernel's interpreted time). Here the names of a package's builtins are listed once, on its first (unpatched)
    listing, and each call wraps those that are still builtins: the attributes a full listing would wrap."""
    if pkg not in _BUILTIN_NAMES:
        _BUILTIN_NAMES[pkg] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
    for name in _BUILTIN_NAMES[pkg]:
        member = getattr(pkg, name)
        if tl.core.is_builtin(member):
            interpreter._patch_attr(pkg, name, member, builder, scope)


def _listing_is_patchable() -> bool:
    """Whether the interpreter has the internals _patch_listed_builtins was written against (Triton 3.9's); another
    version keeps its own listing."""
    listing = getattr(interpreter, "_patch_builtin", None)
    names = list(inspect.signature(listing).parameters) if listing else []
    return names == ["pkg", "builder", "scope"] and hasattr(interpreter, "_patch_attr")


if _listing_is_patchable():
    interpreter._patch_builtin = _patch_listed_builtins

NVCC = shutil.which("nvcc")
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: TileLang kernels cannot be compiled here")
SM90A = {"kind": "cuda", "arch": "sm_90a"}
requires_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not on PATH: generated kernels cannot run here"
)


def tilelang_on_cpu():
    """tools/tilelang_on_cpu.py as a module: TileLang's generated CUDA run on the CPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "tilelang_on_cpu.py"
    spec = importlib.util.spec_from_file_location("tilelang_on_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder of the whole run filled by build(folder) once: with -n, by the first xdist worker that asks, the others
    waiting for it (a module fixture would be built once per worker)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / name
    with FileLock(f"{folder}.lock"):
        if not folder.exists():
            partial = folder.with_name(f"{name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            build(partial)
            partial.rename(folder)
    return folder


def pytest_collection_modifyitems(items):
    """The files that hold slow tests run first, each file's tests in their order (its module fixtures are set up
    once): with -n auto the workers then end together on short tests, instead of one waiting on a long test that
    was collected last."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    """Each test starts with no cached backend decisions or emitted fallback warnings."""
    clear_decisions()
    torch.manual_seed(0)
    yield
    clear_decisions()
