"""tilelang_common's compile path: a builder's Unchecked kernel is compiled without the safe-memory pass, every other
kernel with TileLang's defaults, one at a time and in parallel (precompile)."""

import pytest
import torch

common = pytest.importorskip(
    "runtime.accelerators.tilelang_common", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)


@pytest.fixture
def calls(monkeypatch):
    """The (function, pass_configs) pairs handed to tilelang.compile / par_compile, which return the function."""
    seen = []

    def compile_(func, target=None, pass_configs=None):
        seen.append((func, pass_configs))
        return func

    def par_compile(funcs, target=None, pass_configs=None):
        return [compile_(func, target, pass_configs) for func in funcs]

    monkeypatch.setattr(common.tilelang, "compile", compile_)
    monkeypatch.setattr(common.tilelang, "par_compile", par_compile)
    return seen


def test_compile_built_passes_the_unchecked_configs(calls):
    assert common.compile_built("plain", common.SM90A) == "plain"
    assert common.compile_built(common.Unchecked("guarded"), common.SM90A) == "guarded"
    assert calls == [("plain", None), ("guarded", common.UNCHECKED_PASS_CONFIGS)]


def test_precompile_compiles_each_kind_with_its_configs(calls):
    kernels = {}
    device = torch.device("cpu")
    entries = [(("a",), lambda _: "a"), (("b",), lambda _: common.Unchecked("b")), (("c",), lambda _: "c")]
    # the compile-only target (no CUDA device here), into a cache of the test's own
    common.precompile(entries, device, info=common.device_info(None), kernels=kernels)
    assert sorted(calls) == [("a", None), ("b", common.UNCHECKED_PASS_CONFIGS), ("c", None)]
    assert {key: common.compiled((key, None), device, kernels) for key in (("a",), ("b",), ("c",))} == {
        ("a",): "a",
        ("b",): "b",
        ("c",): "c",
    }
