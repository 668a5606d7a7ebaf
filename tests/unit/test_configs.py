"""The Hydra configs: every group composes and instantiates; bad op names and backends fail at composition."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from runtime.accelerators import OP_NAMES, AcceleratorConfig, use_accelerators
from runtime.accelerators.backends import BACKENDS, FALLBACKS
from runtime.training.config import BackendName, OpName, accelerator_config, config_dir
from runtime.training.synthetic import SyntheticPCVR

CONFIGS = Path(config_dir())
MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
ACCELERATORS = sorted(p.stem for p in (CONFIGS / "accelerators").glob("*.yaml"))


def _compose(*overrides: str, name: str = "train"):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def test_config_dir_is_the_source_checkout_and_the_configs_package():
    assert (CONFIGS / "train.yaml").is_file()
    assert MODELS == ["baseline", "gdr", "tokenformer"]
    assert ACCELERATORS == ["auto", "tilelang", "torch", "triton"]
    import runtime.configs  # what the wheel ships (src/runtime/configs links to configs/)

    assert (Path(runtime.configs.__file__).parent / "train.yaml").read_text() == (CONFIGS / "train.yaml").read_text()


def test_schema_enums_are_the_accelerator_lists():
    assert [b.value for b in BackendName] == list(BACKENDS)
    assert [op.value for op in OpName] == list(OP_NAMES)


@pytest.mark.parametrize("preset", ACCELERATORS)
def test_accelerator_presets_compose_to_accelerator_configs(preset):
    config = accelerator_config(_compose(f"accelerators={preset}").accelerators)
    assert config == AcceleratorConfig(default=preset, ops={}, fallback="torch")


def test_per_op_override_and_fallback():
    cfg = _compose("accelerators=triton", "accelerators.ops.flash_attention=tilelang", "accelerators.fallback=error")
    config = accelerator_config(cfg.accelerators)
    assert config.backend_for("flash_attention") == "tilelang"
    assert config.backend_for("rms_norm") == "triton"
    assert config.fallback == "error"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("accelerators.default=trion", "expected one of [auto, torch, triton, tilelang]"),
        ("accelerators.ops.swiglu=cuda", "expected one of [auto, torch, triton, tilelang]"),
        ("accelerators.ops.flash_attn=triton", "valid: [" + ", ".join(OP_NAMES) + "]"),
        ("accelerators.fallback=ignore", "expected one of [" + ", ".join(FALLBACKS) + "]"),
        ("accelerators=cuda", "Available options"),
    ],
)
def test_bad_accelerators_fail_at_composition_with_the_allowed_values(override, expected):
    with pytest.raises(ConfigCompositionException) as error:
        _compose(override)
    message = f"{error.value} {error.value.__cause__}"
    assert expected in message, message


def test_other_groups_are_typed():
    with pytest.raises(ConfigCompositionException) as error:
        _compose("trainer.precision=fp8")
    assert "expected one of [auto, bf16, fp32]" in str(error.value.__cause__)
    with pytest.raises(ConfigCompositionException):
        _compose("model.d_modl=32")  # no such key


@pytest.fixture(scope="module")
def tiny_data():
    return SyntheticPCVR(seed=0, seq_len=12, n_items=50, n_categories=5, val_size=8)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streams", [0, 2], ids=["residual", "mhc2"])
def test_every_model_instantiates_and_runs(model, streams, tiny_data):
    cfg = _compose(f"model={model}", "model.d_model=16", "model.n_heads=2", "model.n_layers=1", f"model.mhc_streams={streams}")
    net = instantiate(cfg.model, spec=tiny_data.spec)
    batch = tiny_data.train_batch(0, 3)
    with use_accelerators(default="torch"):
        logits = net(batch)
        logits.sum().backward()
    assert logits.shape == (3,) and torch.isfinite(logits).all()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("preset", ACCELERATORS)
def test_every_combination_composes(model, preset, tiny_data):
    cfg = _compose(f"model={model}", f"accelerators={preset}")
    assert cfg.model._target_.startswith("runtime.models.")
    assert cfg.data.batch_size == 256 and cfg.model.d_model == 64 and cfg.model.n_heads == 4
    instantiate(cfg.model, spec=tiny_data.spec)


def test_parquet_data_and_experiment_presets():
    cfg = _compose("data=parquet", "data.path=/some/dir")
    assert cfg.data.source.value == "parquet" and cfg.data.path == "/some/dir"
    small = _compose("experiment=cpu_small")
    assert small.accelerators.default.value == "torch" and small.model.d_model == 32 and small.trainer.device.value == "cpu"
    # the command line wins over the preset's choice of accelerators
    assert _compose("experiment=cpu_small", "accelerators=triton").accelerators.default.value == "triton"


def test_benchmark_config_composes():
    cfg = _compose(name="benchmark")
    assert list(cfg.models) == ["baseline", "tokenformer", "gdr"]
    assert list(cfg.presets) == ["torch", "triton", "tilelang"]
    assert cfg.steps == 200

