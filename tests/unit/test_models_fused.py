"""The models on the fused ops (linear with its activation, add + RMSNorm): the same results as the unfused
composition and as textbook float64 math, the same random stream for dropout, unchanged state_dict keys, full-graph
torch.compile."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import use_accelerators
from runtime.accelerators.testing import assert_close
from runtime.models import BaselinePCVR, GDRMixerPCVR, TokenFormerPCVR
from runtime.nn import GatedDeltaBlock, SwiGLUFeedForward, TransformerBlock, run_blocks
from runtime.nn.blocks import join
from runtime.training.synthetic import SyntheticPCVR

TORCH = {"default": "torch"}
MODELS = {"baseline": BaselinePCVR, "tokenformer": TokenFormerPCVR, "gdr": GDRMixerPCVR}


def _x(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def _attention(q, k, v, causal, lengths):
    lq, lk = q.shape[2], k.shape[2]
    mask = (torch.arange(lk)[None, :] < lengths[:, None])[:, None, None, :].expand(-1, 1, lq, lk)
    if causal:
        mask = mask & torch.ones(lq, lk, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~mask, -math.inf).softmax(-1).nan_to_num(0.0) @ v


def _textbook_block(block, x, lengths, causal):
    """A TransformerBlock in plain float64 math from its parameters."""
    attn, ffn = block.mix.branch.layer, block.ffn.branch.layer
    b, length, width = x.shape
    heads = attn.n_heads
    q, k, v = (
        t.view(b, length, heads, -1).transpose(1, 2)
        for t in F.linear(_rms(x, block.mix.branch.norm.weight), attn.qkv.weight).chunk(3, -1)
    )
    o = _attention(q, k, v, causal, lengths).transpose(1, 2).reshape(b, length, width)
    x = x + F.linear(o, attn.out.weight)
    gate, up = F.linear(_rms(x, block.ffn.branch.norm.weight), ffn.gate_up.weight).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, ffn.down.weight)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_transformer_block_matches_textbook_math(causal):
    block = TransformerBlock(24, 3, 40, causal=causal, dropout=0.2).double().eval()
    x, lengths = _x(2, 7, 24), torch.tensor([7, 4])
    with use_accelerators(**TORCH):
        out = block(x, lengths)
    assert_close("block", out, _textbook_block(block, x, lengths, causal), 1e-12)


def _unfused(block, x, lengths):
    """The block as two plain residual sub-layers: dropout_add, then each sub-layer's own RMSNorm."""
    if isinstance(block, GatedDeltaBlock):
        return block.ffn(block.mix(x))
    return block.ffn(block.mix(x, lengths))


@pytest.mark.parametrize("mode", ["eval", "train-p0", "train-p0.3"])
@pytest.mark.parametrize("kind", ["attention", "gdr"])
def test_fused_blocks_equal_the_unfused_residuals_and_draw_the_same_dropout(kind, mode):
    p = 0.3 if mode == "train-p0.3" else 0.0
    torch.manual_seed(0)
    make = (
        (lambda: TransformerBlock(16, 2, 32, dropout=p))
        if kind == "attention"
        else (lambda: GatedDeltaBlock(16, 2, 32, dropout=p))
    )
    blocks = [make().double().train(mode != "eval") for _ in range(2)]
    final = blocks[0].mix.branch.norm  # any RMSNorm with weights: the model's final norm
    torch.nn.init.normal_(final.weight)
    x, lengths = _x(3, 9, 16).requires_grad_(), torch.tensor([9, 2, 5])
    results = []
    with use_accelerators(**TORCH):
        for fused in (True, False):
            torch.manual_seed(1)
            if fused:
                normed, stream = run_blocks(blocks, x, lengths, norm=final)
            else:
                stream = x
                for block in blocks:
                    stream = _unfused(block, stream, lengths)
                normed = final(stream)
            grads = torch.autograd.grad((normed * normed.detach().cos()).sum(), [x, *blocks[0].parameters()])
            results.append((normed, stream, grads))
    (normed, stream, grads), (normed_ref, stream_ref, grads_ref) = results
    assert torch.equal(normed, normed_ref) and torch.equal(stream, stream_ref)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_block_forward_is_run_blocks_of_one():
    block = TransformerBlock(16, 2, 32).double().eval()
    x = _x(2, 5, 16)
    with use_accelerators(**TORCH):
        assert torch.equal(block(x), run_blocks([block], x))
        assert torch.equal(block(x), join(*block.step(x, None)))


@pytest.mark.parametrize("change", ["replaced by a LayerNorm", "hooked"])
def test_a_replaced_or_hooked_feed_forward_norm_is_called(change):
    """The fused add + norm read the norm's weight without calling it: a LayerNorm put in its place crashed (no
    `backend`) and a forward hook on it never ran."""
    block = TransformerBlock(16, 2, 32).double().eval()
    x, calls = _x(2, 5, 16), []
    if change == "hooked":
        norm = block.ffn.branch.norm
    else:
        norm = block.ffn.branch.norm = torch.nn.LayerNorm(16, dtype=torch.float64)
        torch.nn.init.normal_(norm.weight)
    norm.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0]))
    with use_accelerators(**TORCH):
        out = block(x)
        stream = x + block.mix.branch.layer(block.mix.branch.norm(x))
        expected = stream + block.ffn.branch.layer(norm(stream))
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])  # the block's call, then the one above
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_state_dict_keys_are_unchanged():
    assert sorted(TransformerBlock(8, 2, 16).state_dict()) == [
        "ffn.branch.layer.down.weight", "ffn.branch.layer.gate_up.weight", "ffn.branch.norm.weight",
        "mix.branch.layer.out.weight", "mix.branch.layer.qkv.weight", "mix.branch.norm.weight",
    ]  # fmt: skip
    assert {k: tuple(v.shape) for k, v in GatedDeltaBlock(8, 2, 16).mix.branch.layer.state_dict().items()} == {
        "qkv.weight": (24, 8), "gate.weight": (8, 8), "decay_beta.weight": (4, 8), "A_log": (2,), "dt_bias": (2,),
        "norm.weight": (4,), "out.weight": (8, 8),
    }  # fmt: skip


def test_swiglu_feedforward_loads_the_two_linear_layout():
    """gate_up.weight is [2F, K], gate rows first (what the unfused nn.Linear held): old checkpoints load as they are."""
    gate_up, down = torch.nn.Linear(12, 2 * 10, bias=True).double(), torch.nn.Linear(10, 12, bias=True).double()
    ffn = SwiGLUFeedForward(12, 10, bias=True).double()
    ffn.load_state_dict(
        {f"gate_up.{k}": v for k, v in gate_up.state_dict().items()}
        | {f"down.{k}": v for k, v in down.state_dict().items()}
    )
    x = _x(4, 12)
    gate, up = gate_up(x).chunk(2, -1)
    with use_accelerators(**TORCH):
        assert_close("ffn", ffn(x), down(F.silu(gate) * up), 1e-12)


def _data():
    return SyntheticPCVR(seq_len=12, n_items=300, n_categories=8, val_size=16)


class _Unfused(torch.nn.Module):
    """A block whose step runs the unfused computation (what the models ran before the add + norm fusion)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def step(self, x, pending, key_lengths=None):
        return _unfused(self.block, join(x, pending), key_lengths), None


@pytest.mark.parametrize("mhc", [0, 2], ids=["residual", "mhc"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_equal_their_unfused_composition(name, train, mhc):
    data = _data()
    batch = data.train_batch(0, 6)
    torch.manual_seed(0)
    model = MODELS[name](
        data.spec, d_model=16, n_heads=2, n_layers=2, ffn_mult=2, dropout=0.1, head_hidden=24, mhc_streams=mhc
    )
    model.train(train)
    outputs = []
    with use_accelerators(**TORCH):
        for unfused in (False, True):
            if unfused:
                model.blocks = torch.nn.ModuleList(_Unfused(b) for b in model.blocks)
            torch.manual_seed(1)
            out = model(batch)
            outputs.append((out, torch.autograd.grad(out.sum(), list(model.parameters()))))
    (out, grads), (ref, grads_ref) = outputs
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_compile_in_a_full_graph(name):
    data = _data()
    batch = data.train_batch(0, 6)
    torch.manual_seed(0)
    model = MODELS[name](data.spec, d_model=16, n_heads=2, n_layers=2, ffn_mult=2, dropout=0.0, head_hidden=24).train()
    with use_accelerators(**TORCH):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out_c = compiled(batch)
        grads_c = torch.autograd.grad(out_c.sum(), list(model.parameters()))
        out = model(batch)
        grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    torch.testing.assert_close(out_c, out)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_transformer_block_on_the_triton_kernels_matches_textbook_math(causal):
    """fp16 on the Triton interpreter (the linear, add_norm and flash_attention kernels), output and gradients."""
    torch.manual_seed(0)
    block = TransformerBlock(32, 2, 40, causal=causal).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    fp16 = TransformerBlock(32, 2, 40, causal=causal).half()
    fp16.load_state_dict(block.state_dict())
    x, lengths = _x(2, 9, 32), torch.tensor([9, 5])
    x16 = x.half().requires_grad_()
    with use_accelerators(default="triton", fallback="error"):
        out = run_blocks([fp16, fp16], x16, lengths)
    x64 = x.clone().requires_grad_()
    ref = _textbook_block(block, _textbook_block(block, x64, lengths, causal), lengths, causal)
    assert_close("block fp16", out, ref, 5e-3)
    weight = _x(*out.shape, seed=3)
    (dx,) = torch.autograd.grad((out.double() * weight).sum(), [x16])
    (dx_ref,) = torch.autograd.grad((ref * weight).sum(), [x64])
    assert_close("block fp16 dx", dx, dx_ref, 1e-2)


@pytest.mark.parametrize("sparse_collection", [False, True], ids=["tables", "collection"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_take_a_batch_of_no_examples(name, sparse_collection):
    data = _data()
    batch = data.train_batch(0, 6)
    empty = dataclasses.replace(
        batch, **{f.name: getattr(batch, f.name)[:0] for f in dataclasses.fields(batch) if _per_example(batch, f.name)}
    )
    model = MODELS[name](data.spec, d_model=16, n_heads=2, n_layers=2, sparse_collection=sparse_collection)
    with use_accelerators(**TORCH):
        out = model(empty)
        out.sum().backward()
    assert out.shape == (0,)


def _per_example(batch, name: str) -> bool:
    value = getattr(batch, name)
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == batch.label.shape[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_built_on_meta_load_a_checkpoint_or_initialise(name):
    """Deferred init: on the meta device, to_empty, then a state_dict (or every reset_parameters) makes the model
    whole, its buffers out of the state_dict included."""
    data = _data()
    batch = data.train_batch(0, 6)
    kwargs = dict(d_model=16, n_heads=2, n_layers=2, ffn_mult=2, head_hidden=24)
    model = MODELS[name](data.spec, **kwargs).eval()
    with torch.device("meta"):
        loaded = MODELS[name](data.spec, **kwargs)
    loaded = loaded.to_empty(device="cpu").eval()
    loaded.load_state_dict(model.state_dict())
    with use_accelerators(**TORCH):
        torch.testing.assert_close(loaded(batch), model(batch), rtol=0, atol=0)
        for module in loaded.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        assert torch.isfinite(loaded(batch)).all()
    assert torch.equal(loaded.features.field_offsets, model.features.field_offsets)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_cast_with_to_read_the_float32_batch(name, dtype):
    """model.to(dtype) (or .double() / .bfloat16()) on the batches the data layer gives (float32 dense features)."""
    data = _data()
    batch = data.train_batch(0, 6)
    torch.manual_seed(0)
    model = MODELS[name](data.spec, d_model=16, n_heads=2, n_layers=2, ffn_mult=2, head_hidden=24).eval()
    with use_accelerators(**TORCH):
        ref = model(batch)
        out = model.to(dtype)(batch)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float64 else 0.1
    torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance)
