"""The production presets (experiment=pcvr_large, pcvr_large_gdr, pcvr_long): what they compose to, and two
training steps of each at a CPU size (the same model classes and sparse path, smaller)."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from runtime.accelerators import active_config, set_accelerators
from runtime.nn import EmbeddingBagCollection
from runtime.training import Trainer, config_dir

PRESETS = {
    "pcvr_large": ("TokenFormerPCVR", 1024),
    "pcvr_large_gdr": ("GDRMixerPCVR", 1024),
    "pcvr_long": ("GDRMixerPCVR", 4096),
}
SHRINK = [
    "accelerators=torch",
    "trainer.device=cpu",
    "trainer.progress=false",
    "trainer.steps=2",
    "data.batch_size=8",
    "data.val_batch_size=16",
    "data.seq_len=12",
    "data.n_items=100",
    "data.n_categories=8",
    "data.val_size=16",
    "data.prefetch=0",
    "data.sparse_tables=3",
    "data.sparse_vocab=50",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.head_hidden=16",
    "model.sparse_dim=8",
]


@pytest.fixture(autouse=True)
def _restore_accelerators():
    saved = active_config()
    yield
    set_accelerators(saved)


def _compose(name, *overrides):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[f"experiment={name}", *overrides])


@pytest.mark.parametrize("name", PRESETS)
def test_preset_sizes(name):
    cfg = _compose(name)
    model, seq_len = PRESETS[name]
    assert cfg.model._target_.endswith(model)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers) == (256, 8, 4)
    assert cfg.data.seq_len == seq_len and cfg.data.batch_size * seq_len == 512 * 1024
    assert (cfg.data.sparse_tables, cfg.data.sparse_vocab, cfg.model.sparse_dim) == (26, 1_000_000, 64)
    assert cfg.model.sparse_collection


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_two_steps_at_cpu_size(name, tmp_path):
    trainer = Trainer(_compose(name, *SHRINK), tmp_path)
    tables = [m for m in trainer.model.modules() if isinstance(m, EmbeddingBagCollection)]
    assert len(tables) == 1 and len(tables[0].names) == 3
    assert {tuple(w.shape) for w in tables[0].weights()} == {(51, 8)}
    before = [w.detach().clone() for w in tables[0].weights()]
    metrics = trainer.fit()
    assert len(metrics["losses"]) == 2 and all(torch.isfinite(torch.tensor(metrics["losses"])))
    assert all(not torch.equal(a, w) for a, w in zip(before, tables[0].weights()))  # the tables trained
