"""HSTUBlock against a padded float64 implementation; model=hstu trains; jagged synthetic batches and their
invariants; baseline/tokenformer on jagged batches give the padded run's losses; the layout settings' errors."""

import hashlib

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from runtime.accelerators import active_config, set_accelerators, use_accelerators
from runtime.models import PCVRBatch
from runtime.models.features import append_targets, positions_in_sequence
from runtime.nn import HSTUBlock
from runtime.training import Trainer, config_dir
from runtime.training.config import check_train_config
from runtime.training.loop import use_cuda_graph
from runtime.training.synthetic import SyntheticPCVR

TINY = [
    "accelerators=torch",
    "trainer.device=cpu",
    "trainer.progress=false",
    "data.batch_size=32",
    "data.seq_len=24",
    "data.n_items=200",
    "data.n_categories=8",
    "data.val_size=256",
    "data.prefetch=1",
    "trainer.cpu_threads=1",  # the CPU tier shares its cores: one thread avoids oversubscription
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.ffn_mult=2",
    "model.head_hidden=32",
]


@pytest.fixture(autouse=True)
def _restore_accelerators():
    saved = active_config()
    yield
    set_accelerators(saved)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=[*TINY, *overrides])


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ------------------------------------------------------------------ HSTUBlock vs a padded float64 implementation


def _padded_hstu(block: HSTUBlock, x, lengths, timestamps, num_targets, max_seqlen: int):
    """The HSTU layer written out on padded [N, L, d] float64 tensors, one mask for padding, causality and targets."""
    n, length, _ = x.shape
    h, d = block.n_heads, block.head_dim
    p = {name: t.double() for name, t in block.named_parameters()}
    normed = F.layer_norm(x, (x.shape[-1],), p["input_norm.weight"], p["input_norm.bias"], block.input_norm.eps)
    u, v, q, k = F.silu(normed @ p["uvqk.weight"].T + p["uvqk.bias"]).split(h * d, dim=-1)
    q, k, v = (t.reshape(n, length, h, d).transpose(1, 2) for t in (q, k, v))  # [N, H, L, D]
    scores = d**-0.5 * q @ k.transpose(-1, -2)
    i = torch.arange(length).view(-1, 1)
    j = torch.arange(length).view(1, -1)
    if block.position_bias is not None:
        bias = p["position_bias"]
        scores = scores + bias[:, (i - j).abs().clamp_max(bias.shape[1] - 1)][None]
    if block.time_bias is not None:
        bias = p["time_bias"]
        dt = (timestamps[:, :, None] - timestamps[:, None, :]).abs().double()
        bucket = torch.floor(torch.log2(1 + dt)).long().clamp_max(bias.shape[1] - 1)  # [N, L, L]
        scores = scores + bias[:, bucket].permute(1, 0, 2, 3)
    ln = lengths.view(-1, 1, 1)
    history = ln - num_targets.view(-1, 1, 1)
    visible = (i[None] < ln) & (j[None] < ln) & (j[None] <= i[None]) & ((j[None] < history) | (i[None] == j[None]))
    weights = torch.where(visible[:, None], F.silu(scores) / max_seqlen, 0.0)
    a = (weights @ v).transpose(1, 2).reshape(n, length, h * d)
    gated = F.layer_norm(a, (h * d,), p["output_norm.weight"], p["output_norm.bias"], block.output_norm.eps) * u
    return x + gated @ p["out.weight"].T + p["out.bias"]


def _pad(packed: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    valid = torch.arange(width)[None] < lengths[:, None]
    out = packed.new_zeros(lengths.shape[0], width, *packed.shape[1:])
    out[valid] = packed
    return out, valid


@pytest.mark.parametrize(
    "backend, dtype, bound",
    [("torch", torch.float64, 1e-12), ("triton", torch.float32, 1e-4)],
    ids=["torch-fp64", "triton-fp32"],
)
@pytest.mark.parametrize("buckets", [(7, 5), (0, 0)], ids=["biases", "no-bias"])
def test_hstu_block_matches_a_padded_float64_layer(backend, dtype, bound, buckets):
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 19, 12])  # odd sizes, a one-token sequence
    num_targets = torch.tensor([1, 1, 3, 0], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    total, width = int(lengths.sum()), int(lengths.max())
    gaps = torch.randint(1, 5000, (total,))
    timestamps = torch.cat([g.cumsum(0) for g in gaps.split(lengths.tolist())]) + 1_700_000_000
    block = HSTUBlock(24, 2, 16, *buckets, dropout=0.0, dtype=dtype, backend=backend)
    with torch.no_grad():  # non-trivial norms (ones / zeros would hide a swapped weight)
        for norm in (block.input_norm, block.output_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_(std=0.1)
    x = torch.randn(total, 24, dtype=dtype, requires_grad=True)
    grad = torch.randn(total, 24, dtype=torch.float64)
    with use_accelerators(default="torch"):
        out = block(x, cu, width + 2, timestamps, num_targets)
    (out.double() * grad).sum().backward()

    x_ref = x.detach().double().requires_grad_(True)
    x_pad, valid = _pad(x_ref, lengths, width)
    t_pad, _ = _pad(timestamps, lengths, width)
    ref = _padded_hstu(block, x_pad, lengths, t_pad, num_targets.long(), width + 2)[valid]
    params = [q for q in block.parameters()]
    grads_ref = torch.autograd.grad((ref * grad).sum(), [x_ref, *params])
    assert _rel(out, ref) < bound
    assert _rel(x.grad, grads_ref[0]) < 2 * bound
    for (name, param), expected in zip(block.named_parameters(), grads_ref[1:]):
        assert _rel(param.grad, expected) < 2 * bound, name


@pytest.mark.parametrize("offsets", [[0], [0, 0, 0]], ids=["no-sequence", "empty-sequences"])
def test_hstu_block_takes_no_tokens(offsets):
    block = HSTUBlock(32, 2, time_buckets=4)
    x = torch.randn(0, 32, requires_grad=True)
    out = block(x, torch.tensor(offsets, dtype=torch.int32), 1, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 32)
    out.sum().backward()
    assert x.grad.shape == (0, 32)


def test_hstu_block_errors_name_the_argument():
    with pytest.raises(
        ValueError, match="head_dim: None takes d_model // n_heads, but n_heads=5 does not divide d_model=24"
    ):
        HSTUBlock(24, 5)
    with pytest.raises(ValueError, match="position_buckets: expected an integer >= 0"):
        HSTUBlock(24, 2, position_buckets=-1)
    block = HSTUBlock(32, 2, time_buckets=4)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="timestamps: required by the time bias"):
        block(torch.randn(3, 32), cu, 3)
    with pytest.raises(ValueError, match=r"x: expected packed tokens \[total, d_model\]"):
        block(torch.randn(1, 3, 32), cu, 3, torch.arange(3))


def test_append_targets_and_positions():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    tokens = torch.arange(5.0)[:, None]
    targets = torch.tensor([[10.0], [11.0], [12.0]])
    x, grown = append_targets(tokens, targets, cu)
    assert grown.tolist() == [0, 3, 4, 8]
    assert x[:, 0].tolist() == [0, 1, 10, 11, 2, 3, 4, 12]
    assert positions_in_sequence(cu, 5).tolist() == [0, 1, 0, 1, 2]


# ------------------------------------------------------------------ synthetic jagged data


def _digest(batch: PCVRBatch) -> str:
    h = hashlib.sha256()
    for name in (
        "sparse",
        "dense",
        "seq_items",
        "seq_categories",
        "seq_actions",
        "seq_lengths",
        "target_item",
        "target_category",
        "label",
        "user_id",
    ):
        t = getattr(batch, name)
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_padded_synthetic_batches_are_unchanged():
    # digests of the padded data as drawn before jagged data existed
    data = SyntheticPCVR(seed=7, seq_len=48, n_items=300, n_categories=9, val_size=40)
    batch = data.train_batch(3, 33)
    assert _digest(batch) == "1698eed86ae576d5866a0e9d26a5f7c983be059ec9d08fbe349611b3baf79e18"
    assert _digest(data.val_set()) == "67a4be3c27a10ff522e8c5ecd5e574bcfe179a20aeb43135552dfb171766344a"
    assert not batch.jagged and batch.seq_timestamps is None and batch.max_seqlen is None


def test_jagged_synthetic_batches_keep_their_invariants():
    seq_len = 200
    data = SyntheticPCVR(seed=1, seq_len=seq_len, n_items=300, n_categories=9, val_size=40, jagged=True)
    batch = data.train_batch(0, 2000)
    lengths, cu, ts = batch.seq_lengths, batch.seq_offsets, batch.seq_timestamps
    total = int(lengths.sum())
    assert batch.jagged and cu.dtype == torch.int32 and cu.shape == (2001,)
    assert cu[0] == 0 and cu[-1] == total and torch.equal(cu.diff().long(), lengths)
    assert batch.max_seqlen == int(lengths.max()) and isinstance(batch.max_seqlen, int)
    for name in ("seq_items", "seq_categories", "seq_actions", "seq_timestamps"):
        assert getattr(batch, name).shape == (total,), name
    assert (batch.seq_items > 0).all() and (batch.seq_actions > 0).all()  # no padding anywhere
    assert torch.equal(data.item_category[batch.seq_items], batch.seq_categories)
    # lengths from 16 to seq_len, skewed short, some cut at seq_len
    assert lengths.min() == 16 and lengths.max() == seq_len
    assert lengths.float().median() < (16 + seq_len) / 4
    assert 0.005 < (lengths == seq_len).float().mean() < 0.2
    # timestamps: int64 seconds, strictly increasing within each history (not across a history boundary)
    assert ts.dtype == torch.int64
    step = ts.diff()
    inside = torch.ones(total - 1, dtype=torch.bool)
    inside[cu[1:-1].long() - 1] = False
    assert (step[inside] > 0).all() and (step[~inside] != 0).any()
    # deterministic by (seed, index); the padded form holds the same examples
    again = SyntheticPCVR(seed=1, seq_len=seq_len, n_items=300, n_categories=9, val_size=40, jagged=True).train_batch(
        0, 2000
    )
    assert torch.equal(again.seq_timestamps, ts) and torch.equal(again.seq_items, batch.seq_items)
    padded = batch.padded(seq_len)
    valid = torch.arange(seq_len)[None] < lengths[:, None]
    assert padded.seq_items.shape == (2000, seq_len) and ((padded.seq_items > 0) == valid).all()
    assert torch.equal(padded.seq_timestamps[valid], ts)


def test_jagged_batches_slice_select_and_concatenate():
    data = SyntheticPCVR(seed=2, seq_len=30, n_items=100, n_categories=6, val_size=50, jagged=True)
    batch = data.train_batch(0, 9)
    padded = batch.padded(30)
    part = batch.slice(2, 7)
    assert part.seq_offsets[0] == 0 and part.max_seqlen == int(batch.seq_lengths[2:7].max())
    assert torch.equal(part.padded(30).seq_items, padded.slice(2, 7).seq_items)
    index = torch.tensor([8, 0, 3])
    assert torch.equal(batch.rows(index).padded(30).seq_timestamps, padded.rows(index).seq_timestamps)
    joined = PCVRBatch.concat([batch.slice(0, 4), batch.slice(4, 9)])
    for name in ("seq_items", "seq_timestamps", "seq_offsets", "seq_lengths", "label"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
    assert joined.max_seqlen == batch.max_seqlen
    assert len(data.val_set()) == 50 and data.val_set().seq_offsets[-1] == data.val_set().seq_items.shape[0]


# ------------------------------------------------------------------ training


def test_hstu_trains_and_lowers_the_loss(tmp_path):
    cfg = _compose("model=hstu", "model.position_buckets=24", "model.time_buckets=16", "data.batch_size=64", "trainer.steps=40",
                   "trainer.log_every=10", "trainer.val_every=0", "optim.lr=3e-3", "optim.warmup_steps=5")  # fmt: skip
    trainer = Trainer(cfg, tmp_path)
    assert trainer.data.jagged and trainer.graphed_step is None
    before = trainer.evaluate()
    metrics = trainer.fit()
    after, losses = metrics["validation"][-1], metrics["losses"]
    assert len(losses) == 40 and all(map(torch.isfinite, torch.tensor(losses)))
    assert after["val_logloss"] < before["val_logloss"] - 0.03, (before, after)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, losses


def test_an_hstu_prediction_does_not_depend_on_the_examples_batched_with_it():
    # silu_attention divides by max_seqlen: a per-batch value would change a row's logit with its batch-mates (and
    # the validation metrics with data.val_batch_size)
    from runtime.models import HSTUPCVR

    data = SyntheticPCVR(seed=0, seq_len=64, n_items=200, n_categories=8, val_size=10, jagged=True)
    torch.manual_seed(0)
    model = HSTUPCVR(data.spec, d_model=16, n_heads=2, n_layers=1, head_hidden=32).double().eval()
    batch = data.train_batch(0, 8)
    batch.dense = batch.dense.double()
    assert len({int(n) for n in batch.seq_lengths}) > 1
    with torch.no_grad(), use_accelerators(default="torch"):
        together = model(batch)
        alone = torch.cat([model(batch.slice(i, i + 1)) for i in range(len(batch))])
    torch.testing.assert_close(alone, together, rtol=1e-12, atol=1e-12)


def test_hstu_reads_a_batch_whose_histories_are_all_empty():
    from runtime.models import HSTUPCVR

    data = SyntheticPCVR(seed=0, seq_len=20, n_items=200, n_categories=8, val_size=10, jagged=True)
    batch = data.train_batch(0, 3)
    for name in ("seq_items", "seq_categories", "seq_actions", "seq_timestamps"):
        setattr(batch, name, getattr(batch, name)[:0])
    batch.seq_lengths = torch.zeros_like(batch.seq_lengths)
    batch.seq_offsets, batch.max_seqlen = torch.zeros_like(batch.seq_offsets), 0
    torch.manual_seed(0)
    model = HSTUPCVR(data.spec, d_model=16, n_heads=2, n_layers=1, head_hidden=32).eval()
    with torch.no_grad(), use_accelerators(default="torch"):
        together = model(batch)
        alone = torch.cat([model(batch.slice(i, i + 1)) for i in range(len(batch))])
    assert together.shape == (3,) and torch.isfinite(together).all()
    torch.testing.assert_close(alone, together)


def test_hstu_bias_tables_get_no_weight_decay():
    from omegaconf import OmegaConf

    from runtime.models import HSTUPCVR
    from runtime.training.loop import make_optimizer

    data = SyntheticPCVR(seed=0, seq_len=20, n_items=200, n_categories=8, val_size=10, jagged=True)
    model = HSTUPCVR(data.spec, d_model=16, n_heads=2, n_layers=1, head_hidden=32)
    optim = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.98], "eps": 1e-8})
    decay, no_decay = make_optimizer(model, optim, torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    block = model.blocks[0]
    decayed = {id(p) for p in decay["params"]}
    assert id(block.position_bias) not in decayed and id(block.time_bias) not in decayed
    assert id(block.uvqk.weight) in decayed and id(block.out.weight) in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


class _PaddedView:
    """The same examples as `data`, padded to the spec's seq_len."""

    def __init__(self, data) -> None:
        self.data, self.spec = data, data.spec

    def train_batch(self, index: int, batch_size: int) -> PCVRBatch:
        return self.data.train_batch(index, batch_size).padded(self.spec.seq_len)

    def val_set(self) -> PCVRBatch:
        return self.data.val_set().padded(self.spec.seq_len)


@pytest.mark.parametrize("model", ["baseline", "tokenformer"])
@pytest.mark.parametrize("streams", [0, 2], ids=["residual", "mhc2"])
def test_jagged_training_gives_the_padded_losses(model, streams, tmp_path):
    # fp32 on the CPU, dropout off: the packed run does the same math as the padded one (padding is masked out), so
    # the losses agree to rounding (measured: 0 at the first step, under 1e-7 over five)
    overrides = [
        f"model={model}",
        f"model.mhc_streams={streams}",
        "model.dropout=0.0",
        "model.n_layers=2",
        "trainer.steps=5",
    ]
    jagged = Trainer(_compose(*overrides, "data.jagged=true"), tmp_path / "jagged")
    padded = Trainer(_compose(*overrides, "data.jagged=false"), tmp_path / "padded")
    padded.data = _PaddedView(jagged.data)
    assert all(
        torch.equal(a, b) for a, b in zip(jagged.model.state_dict().values(), padded.model.state_dict().values())
    )
    losses = {}
    for name, trainer in (("jagged", jagged), ("padded", padded)):
        losses[name] = [trainer.train_step(trainer.data.train_batch(i, 32))[0].item() for i in range(5)]
    first = abs(losses["jagged"][0] - losses["padded"][0])
    drift = max(abs(a - b) for a, b in zip(losses["jagged"], losses["padded"]))
    assert first < 1e-5 and drift < 1e-5, losses
    assert jagged.evaluate()["val_logloss"] == pytest.approx(padded.evaluate()["val_logloss"], abs=1e-4)


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model=hstu", "data.jagged=false"],
            "data.jagged=false: model HSTUPCVR reads jagged histories only; set data.jagged=true (or null)",
        ),
        (
            ["model=gdr", "data.jagged=true"],
            "data.jagged=true: model GDRMixerPCVR reads padded histories only; set data.jagged=false (or null)",
        ),
        (
            ["model=baseline", "data=parquet", "data.path=/d", "data.jagged=true"],
            "data.jagged=true with data=parquet: jagged (packed) batches are not yet read from Parquet",
        ),
        (["model=hstu", "data=parquet", "data.path=/d"], "data.jagged=true with data=parquet"),
        (["model=hstu", "model.mhc_streams=2"], "model.mhc_streams: expected 0 for model=hstu"),
        (["model=hstu", "model.position_buckets=-1"], "model.position_buckets: expected an integer >= 0, got -1"),
        (["model=hstu", "model.head_dim=0"], "model.head_dim: expected an integer >= 1, got 0"),
    ],
)
def test_layout_settings_are_checked_at_composition(overrides, expected):
    with pytest.raises(ValueError) as error:
        check_train_config(_compose(*overrides))
    assert str(error.value).startswith(expected), error.value


def test_the_layout_defaults_follow_the_model(tmp_path):
    assert not Trainer(_compose("trainer.steps=1"), tmp_path / "b").data.jagged  # baseline: padded by default
    assert Trainer(_compose("model=hstu", "trainer.steps=1"), tmp_path / "h").data.jagged
    with pytest.raises(ValueError, match="data.jagged: packed batches change their token count"):
        use_cuda_graph(
            _compose("model=tokenformer", "data.jagged=true", "trainer.cuda_graph=true"), torch.device("cuda"), False
        )
    with pytest.raises(ValueError, match="GDRMixerPCVR reads padded histories only"):
        gdr = Trainer(_compose("model=gdr", "trainer.steps=1"), tmp_path / "g").model
        gdr(SyntheticPCVR(seed=0, seq_len=24, n_items=200, n_categories=8, val_size=4, jagged=True).train_batch(0, 2))
