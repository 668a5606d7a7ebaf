"""The Hydra configs: every group composes and instantiates; bad op names and backends fail at composition."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate

from runtime.accelerators import OP_NAMES, AcceleratorConfig, use_accelerators
from runtime.accelerators.backends import BACKENDS, FALLBACKS
from runtime.training.config import BackendName, OpName, accelerator_config, config_dir, model_layouts
from runtime.training.synthetic import SyntheticPCVR

CONFIGS = Path(config_dir())
MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
ACCELERATORS = sorted(p.stem for p in (CONFIGS / "accelerators").glob("*.yaml"))


def _compose(*overrides: str, name: str = "train"):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def test_config_dir_is_the_source_checkout_and_the_configs_package():
    assert (CONFIGS / "train.yaml").is_file()
    assert MODELS == ["baseline", "gdr", "hstu", "tokenformer"]
    assert ACCELERATORS == ["auto", "tilelang", "torch", "triton", "triton_unfused"]
    import runtime.configs  # what the wheel ships (src/runtime/configs links to configs/)

    assert (Path(runtime.configs.__file__).parent / "train.yaml").read_text() == (CONFIGS / "train.yaml").read_text()


def test_schema_enums_are_the_accelerator_lists():
    assert [b.value for b in BackendName] == list(BACKENDS)
    assert [op.value for op in OpName] == list(OP_NAMES)


@pytest.mark.parametrize("preset", [name for name in ACCELERATORS if name in BACKENDS])
def test_accelerator_presets_compose_to_accelerator_configs(preset):
    config = accelerator_config(_compose(f"accelerators={preset}").accelerators)
    assert config == AcceleratorConfig(default=preset, ops={}, fallback="torch")


def test_the_unfused_preset_runs_the_fused_block_ops_as_torch_does():
    config = accelerator_config(_compose("accelerators=triton_unfused").accelerators)
    unfused = {"linear": "torch", "add_norm": "torch", "activation": "torch"}
    assert config == AcceleratorConfig(default="triton", ops=unfused, fallback="torch")


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


@pytest.fixture(scope="module")
def tiny_jagged_data():
    return SyntheticPCVR(seed=0, seq_len=12, n_items=50, n_categories=5, val_size=8, jagged=True)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("streams", [0, 2], ids=["residual", "mhc2"])
def test_every_model_instantiates_and_runs(model, streams, tiny_data, tiny_jagged_data):
    cfg = _compose(
        f"model={model}", "model.d_model=16", "model.n_heads=2", "model.n_layers=1", f"model.mhc_streams={streams}"
    )
    if model == "hstu" and streams:
        with pytest.raises(InstantiationException, match="mhc_streams: expected 0 for HSTU"):
            instantiate(cfg.model, spec=tiny_data.spec)
        return
    net = instantiate(cfg.model, spec=tiny_data.spec)
    jagged = model_layouts(cfg.model._target_)[0] == "jagged"
    batch = (tiny_jagged_data if jagged else tiny_data).train_batch(0, 3)
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
    assert (
        small.accelerators.default.value == "torch"
        and small.model.d_model == 32
        and small.trainer.device.value == "cpu"
    )
    # the command line wins over the preset's choice of accelerators
    assert _compose("experiment=cpu_small", "accelerators=triton").accelerators.default.value == "triton"


def test_benchmark_config_composes():
    cfg = _compose(name="benchmark")
    assert list(cfg.models) == ["baseline", "tokenformer", "gdr"]
    assert list(cfg.presets) == ["torch", "triton", "tilelang"]
    assert cfg.steps == 200


def test_warmup_defaults_to_a_tenth_of_the_steps():
    from runtime.training.config import check_train_config, warmup_steps

    assert warmup_steps(_compose()) == 30  # trainer.steps=300
    assert warmup_steps(_compose("trainer.steps=4")) == 0
    assert warmup_steps(_compose("trainer.steps=40", "optim.warmup_steps=5")) == 5
    # a preset's short benchmark run keeps a warm-up shorter than itself
    short_large = _compose("experiment=pcvr_large", "trainer.steps=60")
    check_train_config(short_large)
    assert warmup_steps(short_large) == 6


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.grad_clip=-1", "trainer.grad_clip: expected a value > 0, or null to switch clipping off; got -1.0"),
        ("trainer.grad_clip=0", "trainer.grad_clip: expected a value > 0, or null to switch clipping off; got 0.0"),
        ("trainer.grad_clip=nan", "trainer.grad_clip: expected a value > 0, or null to switch clipping off; got nan"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio: expected a value in [0, 1], got 1.5"),
        ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio: expected a value in [0, 1], got -0.1"),
        ("optim.warmup_steps=-1", "optim.warmup_steps: expected an integer >= 0, got -1"),
        (
            "optim.warmup_steps=300",
            "optim.warmup_steps: expected fewer than trainer.steps=300 (the run would end inside "
            "its warm-up, before the learning rate reaches optim.lr), or null for a tenth of the steps; got 300",
        ),
        ("optim.betas=[0.9]", "optim.betas: expected two values in [0, 1), got [0.9]"),
        ("optim.betas=[0.9,0.98,0.5]", "optim.betas: expected two values in [0, 1), got [0.9, 0.98, 0.5]"),
        ("optim.betas=[0.9,1.0]", "optim.betas: expected two values in [0, 1), got [0.9, 1.0]"),
        ("optim.lr=0", "optim.lr: expected a value in (0, inf), got 0.0"),
        ("optim.lr=-1e-3", "optim.lr: expected a value in (0, inf), got -0.001"),
        ("optim.eps=0", "optim.eps: expected a value in (0, inf), got 0.0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay: expected a value in [0, inf), got -0.1"),
        ("model.n_layers=0", "model.n_layers: expected an integer >= 1, got 0"),
        ("model.ffn_mult=0", "model.ffn_mult: expected an integer >= 1, got 0"),
        ("model.d_model=30", "model.d_model: expected a positive multiple of model.n_heads=4, got 30"),
        ("model.d_model=0", "model.d_model: expected an integer >= 1, got 0"),
        ("model.n_heads=-2", "model.n_heads: expected an integer >= 1, got -2"),
        ("model.head_hidden=0", "model.head_hidden: expected an integer >= 1, got 0"),
        ("model.mhc_streams=-1", "model.mhc_streams: expected an integer >= 0, got -1"),
        ("model.dropout=1.0", "model.dropout: expected a value in [0, 1), got 1.0"),
        ("seed=18446744073709551616", "seed: expected an integer in [0, 2**32), got 18446744073709551616"),
        ("seed=-1", "seed: expected an integer in [0, 2**32), got -1"),
        ("model.sparse_dim=8", "model.sparse_dim: expected null with model.sparse_collection=false (it is the width"),
        ("trainer.steps=0", "trainer.steps: expected an integer >= 1, got 0"),
        ("trainer.keep_checkpoints=-1", "trainer.keep_checkpoints: expected an integer >= 0, got -1"),
        (
            "trainer.resume=",
            "trainer.resume: expected a checkpoint file or a run directory, or null for a new run; got ''",
        ),
        ("trainer.cpu_threads=0", "trainer.cpu_threads: expected an integer >= 1, got 0"),
        ("trainer.val_every=-5", "trainer.val_every: expected an integer >= 0, got -5"),
        ("trainer.checkpoint_every=-1", "trainer.checkpoint_every: expected an integer >= 0, got -1"),
        ("data.prefetch=-1", "data.prefetch: expected an integer >= 0, got -1"),
        ("data.seq_len=0", "data.seq_len: expected an integer >= 1, got 0"),
        ("data.n_items=0", "data.n_items: expected an integer >= 1, got 0"),
        (
            "data.n_items=2",
            "data.n_items: expected at least data.n_categories=64 (every synthetic category holds an item), got 2",
        ),
        (
            "data=parquet",
            "data.path: expected the directory of train.parquet and val.parquet for data=parquet, got None",
        ),
        ("data.source=parquet", "data.path: expected the directory of train.parquet and val.parquet for data=parquet"),
        ("+trainer.unknown_key=3", "trainer.unknown_key: no such key in trainer; expected one of [steps, log_every"),
        ("+model.d_modl=32", "model.d_modl: no such key in model; expected one of [_target_, d_model"),
        (
            "+sed=1",
            "sed: no such key in the config; expected one of [seed, data, model, accelerators, trainer, optim, logger]",
        ),
    ],
)
def test_out_of_range_and_unknown_settings_are_refused_by_name(override, expected):
    from runtime.training.config import check_train_config

    cfg = _compose(override)
    with pytest.raises(ValueError) as error:
        check_train_config(cfg)
    assert str(error.value).startswith(expected), error.value


def test_the_defaults_presets_and_null_clipping_pass_the_checks():
    from runtime.training.config import check_train_config

    for overrides in (
        [],
        ["experiment=cpu_small"],
        ["model=gdr", "data=parquet", "data.path=/d"],
        ["trainer.grad_clip=null"],
    ):
        checked = check_train_config(_compose(*overrides))
        assert checked.model.d_model % checked.model.n_heads == 0
    assert check_train_config(_compose("trainer.grad_clip=null")).trainer.grad_clip is None


def test_a_missing_experiment_fails_and_lists_the_presets():
    with pytest.raises(ConfigCompositionException) as error:
        _compose("experiment=cpu_smal")
    message = str(error.value)
    assert "Could not find 'experiment/cpu_smal'" in message and "cpu_small" in message.split("Available options")[1], (
        message
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.device=cpu"], "it needs a CUDA device, the run is on cpu (trainer.device=cpu)"),
        (["model=hstu"], "data.jagged: packed batches change their token count"),
        (
            ["trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
            "trainer.compile_mode=reduce-overhead makes CUDA graphs of its own",
        ),
    ],
)
def test_a_cuda_graph_the_config_rules_out_is_refused_at_composition(overrides, expected):
    from runtime.training.config import check_train_config

    with pytest.raises(ValueError) as error:
        check_train_config(_compose("trainer.cuda_graph=true", *overrides))
    message = str(error.value)
    assert message.startswith("trainer.cuda_graph=true cannot run: ") and expected in message, message
    assert message.endswith("; set trainer.cuda_graph=false or auto")
    assert check_train_config(_compose("trainer.cuda_graph=auto", *overrides)).trainer.cuda_graph == "auto"


def test_a_compile_mode_without_compile_is_refused_at_composition():
    from runtime.training.config import check_train_config

    with pytest.raises(ValueError) as error:
        check_train_config(_compose("trainer.compile_mode=max-autotune-no-cudagraphs"))
    message = str(error.value)
    assert "trainer.compile_mode=max-autotune-no-cudagraphs" in message and "trainer.compile is false" in message
    assert check_train_config(_compose("trainer.compile_mode=default")).trainer.compile_mode == "default"
    compiled = check_train_config(_compose("trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs"))
    assert compiled.trainer.compile_mode == "max-autotune-no-cudagraphs"
