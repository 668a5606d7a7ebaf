"""runtime.accelerators.native: the C++ backward nodes of eager Triton calls.

The node is built from source here and driven on CPU tensors against a stand-in for libcuda
(native_fake_driver.c), which logs each launch instead of running it: what the node hands the driver (the kernel,
grid, stream, context and every parameter) is checked against the tensors it must point at. The GPU tier
(tests/gpu/test_native_backward.py) runs the real kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import built_once
from runtime.accelerators import buffers, native
from runtime.accelerators.native import build

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="needs gcc and g++")


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", str(HERE / "native_fake_driver.c"), "-o", str(folder / "libcuda.so.1")], check=True
    )
    return folder


def _build_extension(folder: Path) -> None:
    os.environ["TAAC_NATIVE_CACHE"] = str(folder)
    try:
        build.load_extension()
    finally:
        del os.environ["TAAC_NATIVE_CACHE"]


@pytest.fixture(scope="module")
def extension_cache(tmp_path_factory) -> Path:
    """A cache holding the extension built once for this run's tests."""
    return built_once(tmp_path_factory, "native_cache", _build_extension)


# The scenario: a backward kernel of 12 parameters (7 pointers, 4 int32, an fp32), attached to y.
SCENARIO = """
import ctypes, json, os, sys, torch
from runtime.accelerators import buffers
from runtime.accelerators.native import GRAD, GRAD_OF, OUTPUT, build
ctypes.CDLL("libcuda.so.1").fake_make_current(ctypes.c_void_p(0xC0FFEE))
ext = build.load_extension()
plan = ext.Plan("TestBackward", 0x1234, 256, 4096, list(range(12)), "pppppppiiiif")
x = torch.randn(6, 16, requires_grad=True)
w = torch.randn(16, requires_grad=True)
counter, partial = torch.zeros(1, dtype=torch.int32), torch.zeros(64)
y = torch.empty(6, 16)
args = (GRAD, x, w, GRAD_OF[0], partial, GRAD_OF[1], counter, 6, 16, 16, -7, 1e-6)
report = {"attached": ext.attach(plan, y, [x, w], args, [counter, partial], GRAD, OUTPUT, GRAD_OF, [3, 2], 0x5EED)}
report["node"] = y.grad_fn.name()
report["pointers"] = {"x": x.data_ptr(), "w": w.data_ptr(), "partial": partial.data_ptr(), "counter": counter.data_ptr()}
"""


def run_scenario(
    fake_driver: Path, extension_cache: Path, tmp_path: Path, body: str, capturing: bool = False
) -> tuple[dict, list]:
    """Runs SCENARIO then `body` in a fresh process against the fake driver; returns (its report, the launches)."""
    log = tmp_path / "launches.txt"
    script = SCENARIO + textwrap.dedent(body) + "\nprint(json.dumps(report))\n"
    env = dict(
        os.environ, LD_LIBRARY_PATH=str(fake_driver), FAKE_CUDA_LOG=str(log), FAKE_CUDA_CAPTURING="1" if capturing else "0",
        TAAC_NATIVE_CACHE=str(extension_cache),
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    launches = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return json.loads(done.stdout.strip().splitlines()[-1]), launches


@pytest.mark.slow
def test_the_node_launches_the_kernel_with_every_parameter_in_place(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        dy = torch.randn(6, 16)
        dx, dw = torch.autograd.grad(y, [x, w], dy)
        report.update(dy=dy.data_ptr(), dx=dx.data_ptr(), dw=dw.data_ptr(), shapes=[list(dx.shape), list(dw.shape)])
    """,
    )
    assert report["attached"] and report["node"] == "TestBackward"
    assert report["shapes"] == [[6, 16], [16]]
    (launch,) = launches
    function, grid, threads, shared, stream, context, params = (
        launch[0],
        launch[1:4],
        launch[4],
        launch[5],
        launch[6],
        launch[7],
        launch[8:],
    )
    assert (int(function, 16), grid, threads, shared, int(stream, 16)) == (
        0x1234,
        ["3", "2", "1"],
        "256",
        "4096",
        0x5EED,
    )
    assert int(context, 16) == 0xC0FFEE  # the forward's context, made current for the launch
    p = report["pointers"]
    expected_pointers = [report["dy"], p["x"], p["w"], report["dx"], p["partial"], report["dw"], p["counter"]]
    assert [int(v, 16) for v in params[:7]] == expected_pointers
    # int32 parameters fill 4 bytes of their 8-byte slots; the upper half is left zero
    assert [int(v, 16) for v in params[7:11]] == [6, 16, 16, 2**32 - 7]
    assert int(params[11], 16) == int.from_bytes(torch.tensor([1e-6], dtype=torch.float32).numpy().tobytes(), "little")
    assert params[12:] == ["0", "0"]  # Triton's global and profile scratch pointers


def test_a_gradient_that_is_not_contiguous_is_copied_before_the_launch(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        dy = torch.ones(()).expand(6, 16)
        torch.autograd.grad(y, [x, w], dy)
        report["dy"] = dy.data_ptr()
    """,
    )
    (launch,) = launches
    assert int(launch[8], 16) != report["dy"]  # a contiguous copy of the expanded gradient


def test_under_capture_the_scratch_buffers_are_fresh(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver, extension_cache, tmp_path, "torch.autograd.grad(y, [x, w], torch.randn(6, 16))", capturing=True
    )
    (launch,) = launches
    params = [int(v, 16) for v in launch[8:]]
    assert params[4] != report["pointers"]["partial"] and params[6] != report["pointers"]["counter"]


def test_backward_errors_name_the_node(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        errors = []
        for create_graph in (True, False):
            try:
                torch.autograd.grad(y, [x, w], torch.randn(6, 16), create_graph=create_graph)
            except RuntimeError as error:
                errors.append(str(error).splitlines()[0])
        try:  # the saved tensors were released by the first backward
            torch.autograd.grad(y, [x, w], torch.randn(6, 16))
        except RuntimeError as error:
            errors.append(str(error).splitlines()[0])
        report["errors"] = errors
    """,
    )
    double, second_time = report["errors"]
    assert double.startswith("TestBackward: double backward (create_graph=True) is not supported")
    assert "backward through the graph a second time" in second_time
    assert len(launches) == 1


def test_an_input_modified_in_place_after_the_forward_is_caught(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        with torch.no_grad():
            w.mul_(2)
        try:
            torch.autograd.grad(y, [x, w], torch.randn(6, 16))
            report["error"] = None
        except RuntimeError as error:
            report["error"] = str(error)
    """,
    )
    assert "modified by an inplace operation" in report["error"]
    assert launches == []


def test_poisoned_outputs_and_inputs_without_gradient(fake_driver, extension_cache, tmp_path):
    report, launches = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        ext.set_poison(True)
        dx, dw = torch.autograd.grad(y, [x, w], torch.randn(6, 16))  # the fake launch writes nothing
        report["nan"] = bool(dx.isnan().all() and dw.isnan().all())
        y2 = torch.empty(6, 16)
        args2 = (GRAD, x, x, GRAD_OF[0], partial, x, counter, 6, 16, 16, 16, 1e-6)
        ext.attach(plan, y2, [x, None], args2, [counter, partial], GRAD, OUTPUT, GRAD_OF, [1], 0)
        report["edges"] = [None if f is None else type(f).__name__ for f, _ in y2.grad_fn.next_functions]
        try:
            ext.attach(plan, torch.empty(6, 16), [x, None], args, [counter, partial], GRAD, OUTPUT, GRAD_OF, [1], 0)
        except RuntimeError as error:
            report["error"] = str(error).splitlines()[0]
    """,
    )
    assert report["nan"]
    assert report["edges"] == ["AccumulateGrad", None]
    assert report["error"] == "TestBackward: the gradient of input 1 is written, but that input is None"


def test_an_input_with_a_forward_mode_tangent_attaches_nothing(fake_driver, extension_cache, tmp_path):
    report, _ = run_scenario(
        fake_driver,
        extension_cache,
        tmp_path,
        """
        import torch.autograd.forward_ad as fwAD
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.detach(), torch.ones(6, 16))
            out = torch.empty(6, 16)
            report["dual"] = ext.attach(plan, out, [dual, w], args, [counter, partial], GRAD, OUTPUT, GRAD_OF, [1], 0)
            report["dual_grad_fn"] = out.grad_fn is not None
    """,
    )
    assert report["dual"] is False and report["dual_grad_fn"] is False


def test_parameter_types_follow_the_compiled_signature():
    signature = {
        "a_ptr": "*bf16",
        "b_ptr": "*fp32",
        "n": "i32",
        "stride": "i64",
        "eps": "fp32",
        "ONE": "constexpr",
        "BLOCK": "constexpr",
    }
    assert native._parameter_types(signature, 6) == [(0, "p"), (1, "p"), (2, "i"), (3, "l"), (4, "f")]
    assert native._parameter_types({**signature, "flag": "i1"}, 8) is None  # a type the extension does not pass
    assert native._parameter_types({"a_ptr": "*bf16", "n": "i32"}, 1) is None  # a runtime parameter passed by name


def test_reasons_and_the_explain_line(monkeypatch, tmp_path):
    monkeypatch.setenv("TAAC_NATIVE_BACKWARD", "0")
    assert native._environment_reasons() == ("TAAC_NATIVE_BACKWARD=0",)
    assert "autograd.Function (TAAC_NATIVE_BACKWARD=0)" in native.describe()
    monkeypatch.delenv("TAAC_NATIVE_BACKWARD")
    import triton

    if triton.__version__ not in native.KNOWN_TRITON:
        assert "launch convention is not checked" in native._environment_reasons()[0]


def test_a_failed_build_warns_once_and_leaves_the_python_backward(monkeypatch, tmp_path):
    monkeypatch.setenv("TAAC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    native.extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="compiling backward_node.cpp failed"):
            assert native.extension() is None
        assert native.extension() is None  # cached: no second warning, no second build
    finally:
        native.extension.cache_clear()


def test_poison_setting_reaches_the_extension(extension_cache, monkeypatch):
    monkeypatch.setenv("TAAC_NATIVE_CACHE", str(extension_cache))
    native.extension.cache_clear()
    seen = []
    try:
        module = native.extension()
        monkeypatch.setattr(module, "set_poison", seen.append, raising=False)
        with buffers.poison_outputs():
            pass
    finally:
        native.extension.cache_clear()
    assert seen[-2:] == [True, False]
