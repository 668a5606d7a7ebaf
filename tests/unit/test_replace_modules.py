"""replace_modules: which modules it swaps, that the model computes the same afterwards with the same parameters,
what it leaves and why, and its arguments."""

import pytest
import torch
from torch import nn

from runtime.accelerators import BackendUnavailableError, use_accelerators
from runtime.accelerators.testing import assert_close
from runtime.nn import GELU, EmbeddingBagMean, LayerNorm, Linear, ReplaceReport, RMSNorm, SiLU, replace_modules

D = torch.float64


class LlamaRMSNorm(nn.Module):
    """HuggingFace's Llama RMSNorm structure: a weight, variance_epsilon, the norm in fp32."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class OtherRMSNorm(nn.Module):
    """Another library's spelling: `eps`, computed in the input dtype."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class GemmaRMSNorm(LlamaRMSNorm):
    """Same structure, another formula: (1 + weight)."""

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 12), nn.SiLU()
        )
        self.norm = nn.LayerNorm(12)
        self.rms = nn.RMSNorm(12, eps=1e-6)
        self.other = OtherRMSNorm(
            12
        )  # computes in the input dtype (LlamaRMSNorm would round a float64 model through fp32)
        self.proj = nn.Linear(12, 3, bias=False)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, ids):
        x = self.mlp(self.bag(ids))
        return self.act(self.proj(self.other(self.rms(self.norm(x)))))


def _ids():
    ids = torch.randint(0, 20, (5, 4))
    ids[1] = 0  # an all-padding bag
    return ids


def test_a_model_computes_the_same_with_the_same_parameters():
    torch.manual_seed(0)
    model = Tower().double()
    ids = _ids()
    expected = model(ids)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    report = replace_modules(model)

    assert {(r.name, r.old, r.new) for r in report.replaced} == {
        ("bag", nn.EmbeddingBag, EmbeddingBagMean),
        ("mlp.0", nn.Linear, Linear), ("mlp.1", nn.ReLU, nn.Identity),
        ("mlp.2", nn.Linear, Linear), ("mlp.3", nn.GELU, nn.Identity),
        ("mlp.4", nn.Linear, Linear), ("mlp.5", nn.SiLU, nn.Identity),
        ("norm", nn.LayerNorm, LayerNorm), ("rms", nn.RMSNorm, RMSNorm), ("other", OtherRMSNorm, RMSNorm),
        ("proj", nn.Linear, Linear), ("act", nn.GELU, GELU),
    }  # fmt: skip
    assert report.left == []
    assert [model.mlp[i].activation for i in (0, 2, 4)] == ["relu", "gelu", "silu"]
    assert model.other.eps == 1e-5 and model.bag.padding_idx == 0
    # the same Parameter objects: the state_dict, dtype and device are unchanged and the optimizer still holds them
    assert dict(model.named_parameters()) == params
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) and model.state_dict()[k].dtype == D for k, v in state.items())
    with use_accelerators(default="torch"):
        assert_close("replaced model", model(ids), expected, 1e-12)
        model(ids).sum().backward()
    before = model.proj.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.proj.weight, before)


def test_replaced_modules_follow_the_config_unless_a_backend_is_pinned():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    replace_modules(model)
    assert model[0].backend is None and model[1].backend is None
    with (
        use_accelerators(default="tilelang", fallback="error"),
        pytest.raises(BackendUnavailableError, match="tilelang"),
    ):
        model(torch.randn(2, 8))
    pinned = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    replace_modules(pinned, backend="torch")
    assert pinned[0].backend == "torch" and pinned[1].backend == "torch"
    with use_accelerators(default="tilelang", fallback="error"):
        assert pinned(torch.randn(2, 8)).shape == (2, 8)


def test_ops_selects_the_op_kinds():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8), nn.RMSNorm(8), nn.SiLU())
    report = replace_modules(model, ops=["layer_norm", "activation"])
    assert [(r.name, r.new) for r in report.replaced] == [("2", LayerNorm), ("4", SiLU)]
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.ReLU and type(model[3]) is nn.RMSNorm


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"ops": ["linear", "conv"]}, r"ops: unknown op kind\(s\) \['conv'\]; expected a subset of \['linear'"),
        ({"backend": "cuda"}, "backend: expected None or one of auto, torch, triton, tilelang, got 'cuda'"),
    ],
)
def test_bad_arguments_are_named(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        replace_modules(nn.Linear(2, 2), **kwargs)


def test_rms_norm_classes_of_other_libraries_are_checked_before_the_swap():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"llama": LlamaRMSNorm(10).to(torch.bfloat16), "other": OtherRMSNorm(10), "gemma": GemmaRMSNorm(10)}
    )
    x = torch.randn(4, 10)
    other_before = model["other"](x)
    report = replace_modules(model)
    assert {r.name for r in report.replaced} == {"llama", "other"}
    assert (
        type(model["llama"]) is RMSNorm and model["llama"].weight.dtype == torch.bfloat16 and model["other"].eps == 1e-5
    )
    with use_accelerators(default="torch"):
        assert_close("eps-spelled RMSNorm", model["other"](x), other_before, 1e-5)
    (left,) = report.left
    assert left.name == "gemma" and left.cls is GemmaRMSNorm and "differs from rms_norm" in left.reason
    assert type(model["gemma"]) is GemmaRMSNorm


def test_what_cannot_be_replaced_is_left_with_a_reason():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda module, args, out: out)
    model = nn.ModuleDict(
        {
            "sum_bag": nn.EmbeddingBag(10, 4, mode="sum"),
            "max_norm_bag": nn.EmbeddingBag(10, 4, mode="mean", max_norm=1.0),
            "wide_norm": nn.LayerNorm((2, 4)),
            "machine_eps": nn.RMSNorm(4),
            "subclass": MyLinear(4, 4),
            "hooked": hooked,
        }
    )
    report = replace_modules(model)
    assert report.replaced == []
    reasons = {entry.name: entry.reason for entry in report.left}
    assert reasons == {
        "sum_bag": "mode='sum': only mode='mean' has a runtime op",
        "max_norm_bag": "max_norm=1.0: renormalising rows is not supported by the runtime op",
        "wide_norm": "normalized_shape=(2, 4): the runtime op normalises over the last dimension only",
        "machine_eps": "eps=None (the input dtype's machine epsilon): the runtime op takes a fixed eps; set one",
        "subclass": "a subclass of nn.Linear: its forward may differ, so it is kept",
        "hooked": "it has forward or backward hooks, which a new module would not carry",
    }
    root = nn.LayerNorm(4)
    assert replace_modules(root).left[0].reason.startswith("the model itself cannot be swapped in place")
    text = str(report)
    assert text.startswith("replaced 0 module(s)\nleft 6 module(s):") and "  subclass  " in text


def test_a_fusion_only_where_the_pattern_is_unambiguous():
    shared_act = nn.ReLU()

    class Doubling(nn.Sequential):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.ModuleDict(
        {
            "shared": nn.Sequential(nn.Linear(4, 4), shared_act),
            "also": nn.Sequential(nn.Linear(4, 4), shared_act),
            "custom": Doubling(nn.Linear(4, 4), nn.ReLU()),
            "last": nn.Sequential(nn.ReLU(), nn.Linear(4, 4)),
        }
    )
    x = torch.randn(3, 4)
    expected = {name: seq(x) for name, seq in model.items()}
    report = replace_modules(model, backend="torch")
    for name, seq in model.items():
        assert type(seq[0 if name != "last" else 1]) is Linear and seq[0 if name != "last" else 1].activation is None, (
            name
        )
        assert_close(name, seq(x), expected[name], 1e-5)
    assert model["shared"][1] is shared_act and type(model["custom"][1]) is nn.ReLU
    assert [entry.name for entry in report.left] == ["shared.0", "also.0"]
    assert all("also used elsewhere" in entry.reason for entry in report.left)


def test_a_shared_module_is_replaced_by_one_module_everywhere():
    norm = nn.LayerNorm(6)
    model = nn.ModuleDict({"a": nn.Sequential(norm), "b": nn.Sequential(norm)})
    replace_modules(model)
    assert type(model["a"][0]) is LayerNorm and model["a"][0] is model["b"][0]


@pytest.mark.parametrize("layout", ["fixed", "offsets", "last_offset"])
def test_embedding_bag_inputs_as_torch(layout):
    bag = nn.EmbeddingBag(30, 5, mode="mean", padding_idx=3, include_last_offset=layout == "last_offset").double()
    ids = torch.randint(0, 30, (4, 3)) if layout == "fixed" else torch.tensor([3, 7, 3, 9, 1, 2, 3, 29])
    offsets = {"fixed": None, "offsets": torch.tensor([0, 2, 2, 5]), "last_offset": torch.tensor([0, 2, 2, 5, 8])}[
        layout
    ]
    expected = bag(ids, offsets)
    model = nn.Sequential(bag)
    replace_modules(model, backend="torch")
    assert type(model[0]) is EmbeddingBagMean
    assert_close(layout, model[0](ids, offsets), expected, 1e-12)


def test_embedding_bag_called_with_torch_keywords():
    """A model calling its bag as nn.EmbeddingBag.forward allows (per_sample_weights=None) still runs once replaced;
    weights are refused as torch refuses them for mode='mean'."""
    bag = nn.EmbeddingBag(30, 5, mode="mean").double()
    ids, offsets = torch.tensor([3, 7, 3, 9, 1]), torch.tensor([0, 2])
    expected = bag(ids, offsets, per_sample_weights=None)
    model = nn.Sequential(bag)
    replace_modules(model, backend="torch")
    assert_close("per_sample_weights=None", model[0](ids, offsets, per_sample_weights=None), expected, 1e-12)
    with pytest.raises(ValueError, match="per_sample_weights: .*mode='sum'"):
        model[0](ids, offsets, torch.ones(5, dtype=D))


def test_the_report_is_readable():
    report = replace_modules(nn.Sequential(nn.Linear(3, 3), nn.SiLU()))
    assert isinstance(report, ReplaceReport)
    assert str(report) == "replaced 2 module(s):\n  0  nn.Linear -> runtime.nn.Linear\n  1  nn.SiLU -> nn.Identity"
