"""runtime.nn modules: device= and dtype= as torch's modules take them, torch's state_dicts loaded unchanged (and
then the same outputs as the torch module), and L2Norm."""

import io
import pickle

import pytest
import torch
from torch import nn

from runtime.accelerators import use_accelerators
from runtime.accelerators.testing import assert_close
from runtime.nn import (
    AddLayerNorm,
    AddRMSNorm,
    BCEWithLogitsLoss,
    CrossAttention,
    EmbeddingBagCollection,
    EmbeddingBagMean,
    GatedDeltaBlock,
    GatedDeltaRuleMixer,
    HSTUBlock,
    HyperConnection,
    L2Norm,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    SwiGLUFeedForward,
    TransformerBlock,
)

D = torch.float64

# every runtime.nn module with parameters or buffers, built from keyword arguments device and dtype
FACTORIES = {
    "RMSNorm": lambda **f: RMSNorm(8, **f),
    "LayerNorm": lambda **f: LayerNorm(8, **f),
    "AddRMSNorm": lambda **f: AddRMSNorm(8, **f),
    "AddLayerNorm": lambda **f: AddLayerNorm(8, **f),
    "Linear": lambda **f: Linear(8, 4, activation="swiglu", **f),
    "EmbeddingBagMean": lambda **f: EmbeddingBagMean(10, 4, padding_idx=0, **f),
    "EmbeddingBagCollection": lambda **f: EmbeddingBagCollection({"a": (10, 4), "b": (6, 3)}, padding_idx=-1, **f),
    "MultiHeadAttention": lambda **f: MultiHeadAttention(8, 2, bias=True, **f),
    "CrossAttention": lambda **f: CrossAttention(8, 2, **f),
    "SwiGLUFeedForward": lambda **f: SwiGLUFeedForward(8, 6, bias=True, **f),
    "GatedDeltaRuleMixer": lambda **f: GatedDeltaRuleMixer(8, 2, **f),
    "HyperConnection": lambda **f: HyperConnection(nn.Identity(), 3, 8, **f),
    "TransformerBlock": lambda **f: TransformerBlock(8, 2, 16, hyper_streams=2, **f),
    "GatedDeltaBlock": lambda **f: GatedDeltaBlock(8, 2, 16, **f),
    "HSTUBlock": lambda **f: HSTUBlock(8, 2, 4, position_buckets=5, time_buckets=3, **f),
    "BCEWithLogitsLoss": lambda **f: BCEWithLogitsLoss(pos_weight=2.0, **f),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_device_and_dtype_place_every_parameter_and_buffer(name):
    module = FACTORIES[name](device="meta", dtype=D)
    tensors = [*module.parameters(), *module.buffers()]
    assert tensors and all(t.device.type == "meta" and t.dtype == D for t in tensors), name
    default = FACTORIES[name]()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in [*default.parameters(), *default.buffers()])


def _randomised(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param))
    return module.double()


def _load(ours: nn.Module, theirs: nn.Module) -> nn.Module:
    ours = ours.double()
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys and shapes
    return ours


def test_norms_linear_and_bags_load_torch_state_dicts():
    x, residual = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    with use_accelerators(default="torch"):
        torch_rms = _randomised(nn.RMSNorm(8, eps=1e-6))
        assert_close("RMSNorm", _load(RMSNorm(8), torch_rms)(x), torch_rms(x), 1e-12)
        y, stream = _load(AddRMSNorm(8), torch_rms)(x, residual)
        assert_close("AddRMSNorm", y, torch_rms(x + residual), 1e-12)
        for bias in (True, False):
            torch_ln = _randomised(nn.LayerNorm(8, bias=bias))
            assert_close(f"LayerNorm bias={bias}", _load(LayerNorm(8, bias=bias), torch_ln)(x), torch_ln(x), 1e-12)
            y, _ = _load(AddLayerNorm(8, bias=bias), torch_ln)(x, residual)
            assert_close(f"AddLayerNorm bias={bias}", y, torch_ln(x + residual), 1e-12)
        for bias in (True, False):
            torch_linear = _randomised(nn.Linear(8, 5, bias=bias))
            assert_close(f"Linear bias={bias}", _load(Linear(8, 5, bias=bias), torch_linear)(x), torch_linear(x), 1e-12)
        torch_bag = _randomised(nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0))
        ids = torch.tensor([[1, 0, 3], [0, 0, 0], [9, 9, 2]])
        assert_close(
            "EmbeddingBagMean", _load(EmbeddingBagMean(10, 4, padding_idx=0), torch_bag)(ids), torch_bag(ids), 1e-12
        )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_attention_loads_nn_multihead_attention(bias):
    torch.manual_seed(0)
    theirs = _randomised(nn.MultiheadAttention(12, 3, bias=bias, batch_first=True))
    x, context = torch.randn(2, 5, 12, dtype=D), torch.randn(2, 7, 12, dtype=D)
    lengths = torch.tensor([7, 4])
    padding = torch.arange(7)[None] >= lengths[:, None]
    theirs.eval()
    with use_accelerators(default="torch"):
        self_attention = _load(MultiHeadAttention(12, 3, bias=bias), theirs)
        assert_close("self-attention", self_attention(x), theirs(x, x, x, need_weights=False)[0], 1e-12)
        cross = _load(CrossAttention(12, 3, bias=bias), theirs)
        expected = theirs(x, context, context, key_padding_mask=padding, need_weights=False)[0]
        assert_close("cross-attention", cross(x, context, lengths), expected, 1e-12)
    assert set(self_attention.state_dict()) == {"qkv.weight", "out.weight"} | (
        {"qkv.bias", "out.bias"} if bias else set()
    )
    roundtrip = MultiHeadAttention(12, 3, bias=bias).double()
    roundtrip.load_state_dict(self_attention.state_dict())  # its own keys still load
    assert all(torch.equal(a, b) for a, b in zip(roundtrip.state_dict().values(), self_attention.state_dict().values()))


def test_l2norm_module_matches_its_definition():
    x = torch.randn(3, 7, 37, dtype=D)
    with use_accelerators(default="torch"):
        out = L2Norm()(x)
        assert_close("L2Norm", out, x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6), 1e-12)
        assert_close("L2Norm eps", L2Norm(eps=0.5)(x), x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 0.5), 1e-12)
    assert list(L2Norm().state_dict()) == [] and "eps=1e-06" in repr(L2Norm())


def test_l2norm_follows_the_config():
    from runtime.accelerators import BackendUnavailableError

    with use_accelerators(default="tilelang", fallback="error"), pytest.raises(BackendUnavailableError, match="l2norm"):
        L2Norm()(torch.randn(2, 8))
    with use_accelerators(default="tilelang", fallback="error"):
        assert L2Norm(backend="torch")(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_modules_pickle_whole_and_still_load_torch_keys(name):
    module = FACTORIES[name]()
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    again = pickle.loads(pickle.dumps(module))
    assert again.state_dict().keys() == module.state_dict().keys()
    if isinstance(module, MultiHeadAttention):  # the unpickled module still takes nn.MultiheadAttention's keys
        theirs = nn.MultiheadAttention(8, 2, bias=True, batch_first=True)
        loaded.load_state_dict(theirs.state_dict())
        assert torch.equal(loaded.out.weight, theirs.out_proj.weight)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_meta_built_modules_are_initialised_by_to_empty_and_reset_parameters(name):
    """The deferred-init recipe: build on meta, to_empty on the device, then every module's reset_parameters."""
    module = FACTORIES[name](device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for param in module.parameters():
            param.fill_(float("nan"))
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    fresh = FACTORIES[name]()
    for key, value in module.state_dict().items():
        assert torch.isfinite(value).all(), key
        if value.numel() > 1 and value.unique().numel() == 1:  # a constant initialisation is the constructor's
            assert torch.equal(value, fresh.state_dict()[key]), key
