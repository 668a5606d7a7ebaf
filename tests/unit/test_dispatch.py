"""Backend selection, the fallback rule, the config and explain()."""

import warnings

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators import backends
from runtime.accelerators.backends import OpSpec, select_backend


def _x(dtype=torch.float32):
    return torch.randn(3, 8, dtype=dtype)


def test_auto_on_cpu_runs_a_kernel_only_under_the_interpreter():
    x = _x()
    from runtime.accelerators.rms_norm import SPEC as spec

    assert (
        select_backend(spec, "auto", x.device, ("k",), x=x, weight=None) == "triton"
    )  # TRITON_INTERPRET=1 in this tier
    assert select_backend(spec, "torch", x.device, ("k",), x=x, weight=None) == "torch"


def test_explicit_backend_that_cannot_run_falls_back_to_torch_with_one_warning():
    x = _x()
    with pytest.warns(
        acc.BackendFallbackWarning, match="rms_norm: the tilelang backend cannot run these inputs: tensors are on cpu"
    ):
        y = acc.rms_norm(x, backend="tilelang")
    torch.testing.assert_close(y, acc.rms_norm(x, backend="torch"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.rms_norm(x, backend="tilelang")  # the same op, backend and reasons: no second warning


def test_fallback_warning_is_a_runtime_warning():
    assert issubclass(acc.BackendFallbackWarning, RuntimeWarning)


def test_fallback_error_lists_every_reason():
    x = _x(torch.float64)
    with acc.use_accelerators(fallback="error"):
        with pytest.raises(acc.BackendUnavailableError) as error:
            acc.layer_norm(x, backend="tilelang")
    message = str(error.value)
    assert "layer_norm" in message and "tilelang" in message
    assert "tensors are on cpu" in message and "x has dtype float64" in message


def test_input_reason_dtype_makes_auto_choose_torch_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = acc.rms_norm(_x(torch.float64))
    assert y.dtype == torch.float64


def test_config_default_and_per_op_override():
    with acc.use_accelerators(default="torch", ops={"l2norm": "tilelang"}):
        config = acc.active_config()
        assert config.backend_for("rms_norm") == "torch"
        assert config.backend_for("l2norm") == "tilelang"
        with acc.use_accelerators(fallback="error"):  # nested blocks change only what they name
            inner = acc.active_config()
            assert inner.backend_for("l2norm") == "tilelang" and inner.fallback == "error"
    assert acc.active_config().default == "auto"


def test_argument_beats_config():
    x = _x()
    with acc.use_accelerators(default="tilelang", fallback="error"):
        acc.rms_norm(x, backend="torch")  # no error: the argument wins
        with pytest.raises(acc.BackendUnavailableError):
            acc.rms_norm(x)


def test_set_accelerators_sets_the_process_default():
    previous = acc.active_config()
    try:
        acc.set_accelerators(acc.AcceleratorConfig(default="torch"))
        assert acc.active_config().default == "torch"
    finally:
        acc.set_accelerators(previous)
    with pytest.raises(TypeError, match="expected an AcceleratorConfig"):
        acc.set_accelerators({"default": "torch"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"default": "cuda"},
            "accelerators.default: unknown backend 'cuda'; expected one of auto, torch, triton, tilelang",
        ),
        ({"ops": {"rmsnorm": "triton"}}, "unknown op 'rmsnorm'; expected one of rms_norm, layer_norm"),
        ({"ops": {"rms_norm": "cutlass"}}, "accelerators.ops.rms_norm: unknown backend 'cutlass'"),
        ({"fallback": "ignore"}, "accelerators.fallback: unknown rule 'ignore'; expected one of torch, error"),
    ],
)
def test_config_rejects_unknown_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        acc.AcceleratorConfig(**kwargs)


def test_config_ops_must_be_a_mapping():
    # a list of op names (what "these ops on triton" might be written as) raised AttributeError from inside the config
    with pytest.raises(TypeError, match=r"accelerators.ops: expected a mapping of op name -> backend, got list"):
        acc.AcceleratorConfig(ops=["rms_norm"])
    with pytest.raises(TypeError, match=r"^ops: expected a mapping of op name -> backend, got list"):
        with acc.use_accelerators(ops=["rms_norm"]):
            pass
    with pytest.raises(TypeError, match=r"config: expected an AcceleratorConfig or None, got dict"):
        with acc.use_accelerators({"default": "torch"}):
            pass
    # from_mapping (the Hydra group's path) read ops with dict(), which failed on a list of names with a cryptic message
    with pytest.raises(TypeError, match=r"accelerators.ops: expected a mapping of op name -> backend, got list"):
        acc.AcceleratorConfig.from_mapping({"ops": ["rms_norm"]})
    with pytest.raises(TypeError, match=r"accelerators: expected a mapping with the keys default, ops, .*got list"):
        acc.AcceleratorConfig.from_mapping(["default"])


def test_config_from_mapping_drops_null_overrides_and_rejects_unknown_keys():
    config = acc.AcceleratorConfig.from_mapping(
        {"default": "triton", "ops": {"rms_norm": None, "l2norm": "torch"}, "fallback": "error"}
    )
    assert config.ops == {"l2norm": "torch"} and config.default == "triton" and config.fallback == "error"
    with pytest.raises(ValueError, match="unknown keys"):
        acc.AcceleratorConfig.from_mapping({"defaults": "triton"})


def test_unknown_backend_argument_is_an_error():
    with pytest.raises(ValueError, match="rms_norm: unknown backend 'cuda'"):
        acc.rms_norm(_x(), backend="cuda")
    # an unhashable one failed in the decision cache's lookup: "unhashable type: 'list'"
    with pytest.raises(ValueError, match=r"rms_norm: unknown backend \['torch'\]"):
        acc.rms_norm(_x(), backend=["torch"])


def test_decisions_are_cached_per_key():
    calls = []

    def reasons(backend, x):
        calls.append(backend)
        return ["never"]

    previous = backends.REGISTRY.get("mhc")
    spec = OpSpec("mhc", priority=("triton", "tilelang"), reasons=reasons)
    try:
        x = _x()
        for _ in range(3):
            assert select_backend(spec, "auto", x.device, ("same",), x=x) == "torch"
        assert calls == ["triton", "tilelang"]
        select_backend(spec, "auto", x.device, ("other",), x=x)
        assert calls == ["triton", "tilelang"] * 2
    finally:
        if previous is None:
            backends.REGISTRY.pop("mhc")
        else:
            backends.REGISTRY["mhc"] = previous


def test_input_priority_orders_auto_where_it_answers():
    def input_priority(x=None, **_):
        """tilelang first for wide rows"""
        return ("tilelang", "triton") if x is not None and x.shape[-1] > 4 else None

    previous = backends.REGISTRY.get("mhc")
    tried = []
    spec = OpSpec("mhc", priority=("triton", "tilelang"), reasons=lambda backend, x: tried.append(backend) or ["never"],
                  input_priority=input_priority)  # fmt: skip
    try:
        assert spec.priority_for(x=torch.randn(2, 8)) == ("tilelang", "triton")
        assert spec.priority_for(x=torch.randn(2, 4)) == spec.priority_for() == ("triton", "tilelang")
        x = torch.randn(2, 8)
        assert select_backend(spec, "auto", x.device, ("wide",), x=x) == "torch"
        assert tried == ["tilelang", "triton"]
        assert "auto priority triton > tilelang > torch (tilelang first for wide rows)" in acc.explain("mhc")
    finally:
        if previous is None:
            backends.REGISTRY.pop("mhc")
        else:
            backends.REGISTRY["mhc"] = previous


def test_opspec_rejects_unknown_op_name():
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        OpSpec("softmax", priority=(), reasons=lambda backend: [])


def test_tilelang_version_mismatch_says_what_to_install(monkeypatch):
    monkeypatch.setattr(backends.importlib.metadata, "version", lambda name: "0.1.6")
    reasons = backends.library_reasons.__wrapped__("tilelang")
    assert reasons == (
        "tilelang 0.1.6 is installed but this package is written for 0.1.15; install it with `pip install tilelang==0.1.15`",
    )


def test_missing_tilelang_says_what_to_install(monkeypatch):
    def missing(name):
        raise backends.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(backends.importlib.metadata, "version", missing)
    assert "pip install tilelang==0.1.15" in backends.library_reasons.__wrapped__("tilelang")[0]


def test_explain_lists_every_op_and_reason():
    text = acc.explain()
    for op in ("rms_norm", "layer_norm", "l2norm"):
        assert f"{op}: configured 'auto' -> runs triton" in text
    assert "tilelang: tensors are on cpu; the tilelang backend needs CUDA tensors" in text


def test_explain_with_sample_inputs_adds_input_reasons():
    text = acc.explain("rms_norm", x=_x(torch.float64))
    assert "x has dtype float64" in text and "runs torch" in text
    with pytest.raises(ValueError, match="unknown op 'norm'"):
        acc.explain("norm")
    with pytest.raises(ValueError, match=r"unknown op \['rms_norm'\]; expected one of"):  # was "unhashable type"
        acc.explain(["rms_norm"])
    with pytest.raises(ValueError, match="need the op"):
        acc.explain(x=_x())


def test_explain_for_a_device_that_is_not_here_is_an_error_naming_it(monkeypatch):
    # was torch's AssertionError "Torch not compiled with CUDA enabled" (or its RuntimeError without a driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"device: cuda is not available here \(torch.cuda.is_available\(\) is False\)"
    ):
        acc.explain("rms_norm", device="cuda")
    with pytest.raises(ValueError, match=r"device: 'gpu' is not a device; expected cpu, cuda or cuda:N"):
        acc.explain("rms_norm", device="gpu")


def test_explain_follows_the_fallback_rule():
    with acc.use_accelerators(default="tilelang"):
        assert "rms_norm: configured 'tilelang' -> runs torch (fallback)" in acc.explain("rms_norm")
    with acc.use_accelerators(default="tilelang", fallback="error"):
        assert "rms_norm: configured 'tilelang' -> runs nothing: raises BackendUnavailableError" in acc.explain(
            "rms_norm"
        )


def test_explain_takes_each_op_called_by_its_own_argument_names():
    x, q = _x(), torch.randn(1, 5, 2, 24)  # K = 24: no gated-delta-rule kernel
    samples = {
        "rms_norm": dict(x=x, weight=torch.ones(8), eps=1e-6),
        "dropout_add": dict(x=x, residual=x, p=0.1, training=True),
        "bce_with_logits": dict(logits=x, targets=x, reduction="sum"),
        "gated_delta_rule": dict(q=q, k=q, v=q, g=torch.randn(1, 5, 2), beta=torch.rand(1, 5, 2), scale=None),
        "mhc": dict(
            x=torch.randn(3, 9, 8), phi=torch.randn(72, 99), alpha=torch.ones(3), bias=torch.zeros(99), eps=1e-6
        ),
    }
    for op, inputs in samples.items():
        assert f"{op}: configured 'auto'" in acc.explain(op, **inputs)
    assert "K (the q/k head dim) is 24" in acc.explain("gated_delta_rule", **samples["gated_delta_rule"])
    assert "x has 9 streams" in acc.explain("mhc", **samples["mhc"])
    with pytest.raises(TypeError, match="sample inputs of swiglu lack an argument .*'up'"):
        acc.explain("swiglu", gate=x)


def test_explain_cli_runs():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "runtime.accelerators"], capture_output=True, text=True, check=True
    ).stdout
    assert "rms_norm: configured 'auto'" in out
