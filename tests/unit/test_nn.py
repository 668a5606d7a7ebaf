"""runtime.nn: each module follows the active accelerator config, matches plain torch math, and the
gated delta rule's chunked form matches its step-by-step definition (values and every gradient)."""

import math

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import BackendUnavailableError, use_accelerators
from runtime.accelerators.gated_delta_rule.reference import recurrent_gated_delta_rule_reference
from runtime.accelerators.testing import assert_close
from runtime.nn import (
    BCEWithLogitsLoss,
    CrossAttention,
    DropoutAdd,
    EmbeddingBagCollection,
    EmbeddingBagMean,
    GatedDeltaBlock,
    GatedDeltaRuleMixer,
    HSTUBlock,
    HyperConnection,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    SwiGLUFeedForward,
    TransformerBlock,
    expand_streams,
    merge_streams,
)

D = torch.float64
TORCH = {"default": "torch"}


def _x(*shape, dtype=D):
    return torch.randn(*shape, dtype=dtype)


# each module with inputs that reach its op(s); the config alone (no backend argument) must decide
MODULE_CASES = {
    "RMSNorm": lambda: (RMSNorm(8), (_x(3, 8, dtype=torch.float32),)),
    "LayerNorm": lambda: (LayerNorm(8), (_x(3, 8, dtype=torch.float32),)),
    "MultiHeadAttention": lambda: (MultiHeadAttention(16, 2), (_x(2, 5, 16, dtype=torch.float32),)),
    "CrossAttention": lambda: (
        CrossAttention(16, 2),
        (_x(2, 1, 16, dtype=torch.float32), _x(2, 5, 16, dtype=torch.float32)),
    ),
    "SwiGLUFeedForward": lambda: (SwiGLUFeedForward(8, 12), (_x(3, 8, dtype=torch.float32),)),
    "DropoutAdd": lambda: (DropoutAdd(0.1), (_x(3, 8, dtype=torch.float32), _x(3, 8, dtype=torch.float32))),
    "EmbeddingBagMean": lambda: (EmbeddingBagMean(10, 4, padding_idx=0), (torch.randint(0, 10, (3, 2)),)),
    "BCEWithLogitsLoss": lambda: (BCEWithLogitsLoss(), (_x(5, dtype=torch.float32), torch.rand(5).round())),
    "GatedDeltaRuleMixer": lambda: (GatedDeltaRuleMixer(16, 2), (_x(2, 5, 16, dtype=torch.float32),)),
}


@pytest.mark.parametrize("name", sorted(MODULE_CASES))
def test_modules_follow_the_active_config(name):
    module, inputs = MODULE_CASES[name]()
    with use_accelerators(default="tilelang", fallback="error"):  # tilelang cannot run CPU tensors
        with pytest.raises(BackendUnavailableError, match="tilelang"):
            module(*inputs)
    with use_accelerators(**TORCH):
        assert torch.isfinite(module(*inputs)).all()


def test_a_module_backend_argument_pins_it():
    norm = RMSNorm(8, backend="torch")
    with use_accelerators(default="tilelang", fallback="error"):
        out = norm(_x(3, 8, dtype=torch.float32))
    assert out.shape == (3, 8)


def _sdpa_reference(q, k, v, causal, lengths):
    """Textbook attention in float64 with a key-padding and (top-left) causal mask."""
    lq, lk = q.shape[2], k.shape[2]
    visible = torch.arange(lk)[None, :] < lengths[:, None]  # [B, Lk]
    mask = visible[:, None, None, :].expand(-1, 1, lq, lk)
    if causal:
        mask = mask & torch.ones(lq, lk, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~mask, -math.inf).softmax(-1).nan_to_num(0.0)
    return probs @ v


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_self_attention_matches_textbook_math(causal):
    attn = MultiHeadAttention(24, 3, causal=causal).double()
    x, lengths = _x(2, 7, 24), torch.tensor([7, 4])
    with use_accelerators(**TORCH):
        out = attn(x, lengths)
    q, k, v = (t.view(2, 7, 3, 8).transpose(1, 2) for t in attn.qkv(x).chunk(3, -1))
    ref = attn.out(_sdpa_reference(q, k, v, causal, lengths).transpose(1, 2).reshape(2, 7, 24))
    assert_close("self-attention", out, ref, 1e-10)


def test_cross_attention_matches_textbook_math():
    attn = CrossAttention(16, 2).double()
    x, context, lengths = _x(3, 1, 16), _x(3, 9, 16), torch.tensor([9, 1, 5])
    with use_accelerators(**TORCH):
        out = attn(x, context, lengths)
    q = attn.q(x).view(3, 1, 2, 8).transpose(1, 2)
    k, v = (t.view(3, 9, 2, 8).transpose(1, 2) for t in attn.kv(context).chunk(2, -1))
    ref = attn.out(_sdpa_reference(q, k, v, False, lengths).transpose(1, 2).reshape(3, 1, 16))
    assert_close("cross-attention", out, ref, 1e-10)


def test_attention_modules_reject_padded_arguments_with_packed_sequences_and_the_reverse():
    """key_lengths was dropped silently with packed sequences, and max_seqlen without them."""
    self_attn, cross = MultiHeadAttention(16, 2), CrossAttention(16, 2)
    cu, lengths = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([1, 2])
    with use_accelerators(**TORCH):
        with pytest.raises(ValueError, match="key_lengths: not taken with cu_seqlens"):
            self_attn(torch.randn(7, 16), lengths, cu_seqlens=cu, max_seqlen=4)
        with pytest.raises(ValueError, match="key_lengths: not taken with cu_seqlens"):
            cross(torch.randn(2, 16), torch.randn(7, 16), lengths, context_cu_seqlens=cu, context_max_seqlen=4)
        with pytest.raises(ValueError, match="max_seqlen_q: only taken with cu_seqlens_q and cu_seqlens_k"):
            self_attn(torch.randn(2, 5, 16), max_seqlen=5)
        with pytest.raises(ValueError, match="max_seqlen_k: only taken with cu_seqlens_q and cu_seqlens_k"):
            cross(torch.randn(2, 1, 16), torch.randn(2, 5, 16), context_max_seqlen=5)
        with pytest.raises(ValueError, match="key_lengths: not taken with cu_seqlens"):
            TransformerBlock(16, 2, 32)(torch.randn(7, 16), lengths, cu, 4)


def test_gated_delta_modules_name_packed_input_as_the_error():
    """They take padded batches: packed input failed with 'takes 2 positional arguments' or 'not enough values to
    unpack'."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with use_accelerators(**TORCH):
        with pytest.raises(ValueError, match=r"cu_seqlens: GatedDeltaBlock takes padded batches \[B, L, d\] only"):
            GatedDeltaBlock(16, 2, 32)(torch.randn(7, 16), None, cu, 4)
        with pytest.raises(ValueError, match=r"x: expected a padded batch \[B, T, d_model\], got shape \(7, 16\)"):
            GatedDeltaRuleMixer(16, 2)(torch.randn(7, 16))


def test_norms_feedforward_bag_and_loss_match_torch():
    x = _x(5, 37)
    with use_accelerators(**TORCH):
        rms, ln, ffn = (
            RMSNorm(37).double(),
            LayerNorm(37).double(),
            SwiGLUFeedForward(37, 20, d_out=3, bias=True).double(),
        )
        assert_close("RMSNorm", rms(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6), 1e-12)
        assert_close("LayerNorm", ln(x), F.layer_norm(x, (37,), eps=1e-5), 1e-12)
        gate, up = F.linear(x, ffn.gate_up.weight, ffn.gate_up.bias).chunk(2, -1)
        assert_close("SwiGLU FFN", ffn(x), ffn.down(F.silu(gate) * up), 1e-12)

        bag = EmbeddingBagMean(11, 6, padding_idx=0).double()
        assert torch.equal(bag.weight[0], torch.zeros(6, dtype=D))
        ids = torch.tensor([[3, 0, 5], [0, 0, 0], [1, 2, 10]])
        ref = F.embedding_bag(ids, bag.weight, mode="mean", padding_idx=0)
        assert_close("EmbeddingBagMean", bag(ids), ref, 1e-12)

        logits, targets = _x(200), torch.rand(200, dtype=D).round()
        loss = BCEWithLogitsLoss(pos_weight=2.0)(logits, targets)
        ref = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), pos_weight=torch.tensor([2.0]))
        assert_close("BCE", loss, ref, 1e-5)


@pytest.mark.parametrize("padding_idx", [10, -11])
def test_embedding_bag_rejects_a_padding_row_outside_the_table(padding_idx):
    """As nn.EmbeddingBag: padding_idx in [-num_embeddings, num_embeddings), else an error naming it (not an
    IndexError from zeroing the row, nor -11 taken as the last row)."""
    with pytest.raises(ValueError, match=r"padding_idx: expected None or an int in \[-10, 10\) \(num_embeddings\)"):
        EmbeddingBagMean(10, 4, padding_idx=padding_idx)
    assert EmbeddingBagMean(10, 4, padding_idx=-10).padding_idx == 0


@pytest.mark.slow
def test_embedding_bag_with_index_checks_compiles_in_a_full_graph():
    """check_indices=True under torch.compile(fullgraph=True): the check is an op of the graph (reading its flag on
    the host would break the graph); bad ids still raise. The kernel backends' op compiles in a full graph with its
    index checks (the default) in test_compile_ops.py, on both tiers."""
    bag = EmbeddingBagMean(40, 8, padding_idx=0, check_indices=True, backend="torch")
    head = torch.nn.Linear(8, 1)
    model = lambda ids, offsets=None: head(bag(ids, offsets)).squeeze(-1)  # noqa: E731
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids, offsets = torch.randint(0, 40, (6, 3)), torch.tensor([0, 2, 2, 7])
    for args in ((ids,), (ids.flatten()[:10], offsets)):
        out, expected = compiled(*args), model(*args)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.sum(), [bag.weight, head.weight])
        for grad, ref in zip(grads, torch.autograd.grad(expected.sum(), [bag.weight, head.weight])):
            torch.testing.assert_close(grad, ref)
    for args in ((torch.tensor([[1, 40, 2]]),), (ids.flatten()[:10], torch.tensor([0, 5, 3]))):
        with pytest.raises(RuntimeError, match=r"embedding_bag_mean: an index is outside \[0, num_embeddings\)"):
            compiled(*args)


def test_dropout_add_is_the_sum_in_eval_and_drops_in_training():
    x, residual = torch.randn(64, 64), torch.randn(64, 64)
    module = DropoutAdd(0.5)
    with use_accelerators(**TORCH):
        module.eval()
        assert torch.equal(module(x, residual), x + residual)
        module.train()
        kept = module(x, residual) != residual
    assert 0.4 < kept.float().mean() < 0.6
    with pytest.raises(ValueError, match="p: expected"):
        DropoutAdd(1.0)


def test_dropout_add_takes_a_bf16_branch_on_an_fp32_residual():
    x, residual = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)
    with use_accelerators(**TORCH):
        out = DropoutAdd(0.0)(x, residual)
    assert out.dtype == torch.float32
    assert torch.equal(out, residual + x.float())


# ------------------------------------------------------------------ the gated delta rule


def test_mixer_and_blocks_are_causal():
    torch.manual_seed(1)
    mixer = GatedDeltaRuleMixer(16, 2).double()
    gdr_block = GatedDeltaBlock(16, 2, 32).double()
    attn_block = TransformerBlock(16, 2, 32, causal=True).double()
    x = _x(2, 11, 16)
    changed = x.clone()
    changed[:, 7:] += 1.0  # a different future
    with use_accelerators(**TORCH):
        for name, module in (("mixer", mixer), ("gdr block", gdr_block), ("attention block", attn_block)):
            module.eval()
            before, after = module(x), module(changed)
            assert torch.allclose(before[:, :7], after[:, :7], atol=1e-12), name
            assert not torch.allclose(before[:, 7:], after[:, 7:]), name


def test_mixer_matches_its_definition():
    mixer = GatedDeltaRuleMixer(12, 3).double()
    x = _x(2, 9, 12)
    with use_accelerators(**TORCH):
        out = mixer(x)
    q, k, v = (F.silu(z).view(2, 9, 3, 4) for z in F.linear(x, mixer.qkv.weight).chunk(3, -1))
    q, k = (z * torch.rsqrt(z.square().sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    a, b = mixer.decay_beta(x).chunk(2, -1)
    g = -mixer.A_log.exp() * F.softplus(a + mixer.dt_bias)
    o, _ = recurrent_gated_delta_rule_reference(q, k, v, g, b.sigmoid())
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-6)
    ref = mixer.out((F.silu(mixer.gate(x).view(2, 9, 3, 4)) * normed).reshape(2, 9, 12))
    assert_close("mixer", out, ref, 1e-10)


# ------------------------------------------------------------------ hyper-connections (mHC)


def test_hyper_connection_is_mhc_pre_block_post():
    from runtime.accelerators.mhc.reference import mhc_post_reference, mhc_pre_reference

    block = torch.nn.Linear(8, 8).double()
    hyper = HyperConnection(block, 4, 8).double()
    x = _x(3, 5, 4, 8)
    with use_accelerators(**TORCH):
        out = hyper(x)
    h_in, h_post, h_res = mhc_pre_reference(x, hyper.phi, hyper.alpha, hyper.bias, 1e-6, 20)
    assert_close("mhc block", out, mhc_post_reference(x, block(h_in), h_post, h_res), 1e-12)


def test_hyper_connection_starts_near_a_residual():
    block = torch.nn.Linear(8, 8).double()
    hyper = HyperConnection(block, 4, 8).double()
    x = _x(6, 8)
    with use_accelerators(**TORCH):
        out = merge_streams(hyper(expand_streams(x, 4)))
    assert_close("near x + block(x)", out, x + block(x), 0.05)


def test_hyper_connection_rejects_no_streams():
    with pytest.raises(ValueError, match="streams: expected an int >= 1 .*, got 0"):
        HyperConnection(torch.nn.Identity(), 0, 8)
    # a float reached torch.empty: "empty() takes 1 positional argument but 2 were given"
    with pytest.raises(TypeError, match="streams: expected an int >= 1 .*, got float 2.5"):
        HyperConnection(torch.nn.Identity(), 2.5, 8)
    with pytest.raises(TypeError, match="width: expected an int >= 1 .*, got float 8.0"):
        HyperConnection(torch.nn.Identity(), 2, 8.0)
    with pytest.raises(ValueError, match="width: expected an int >= 1 .*, got 0"):
        HyperConnection(torch.nn.Identity(), 2, 0)


def test_bce_loss_keeps_float64_as_torch_does():
    logits = _x(6).requires_grad_()
    targets = torch.rand(6, dtype=D)
    ours = BCEWithLogitsLoss(pos_weight=2.0)
    theirs = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0], dtype=D))
    with use_accelerators(**TORCH):
        loss = ours(logits, targets)
        assert loss.dtype == D
        torch.testing.assert_close(loss, theirs(logits, targets))
        assert torch.autograd.gradcheck(lambda x: ours(x, targets), (logits,))
        assert ours(logits.detach().to(torch.bfloat16), targets).dtype == torch.float32


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: MultiHeadAttention(8, 2, dropout=1.5),
            ValueError,
            r"dropout: expected a dropout probability in \[0, 1\)",
        ),
        (lambda: MultiHeadAttention(8, 2, dropout=-0.1), ValueError, r"dropout: expected a dropout probability"),
        (lambda: MultiHeadAttention(8, 2, causal="yes"), TypeError, r"causal: expected a bool"),
        (lambda: CrossAttention(8, 2, dropout=1.0), ValueError, r"dropout: expected a dropout probability in \[0, 1\)"),
        (lambda: DropoutAdd("0.1"), TypeError, "p: expected a dropout probability"),
        (lambda: DropoutAdd(True), TypeError, "p: expected a dropout probability"),
        (lambda: LayerNorm((2, 8)), ValueError, r"dim: expected the width of the last dimension .* got \(2, 8\)"),
        (lambda: RMSNorm(0), ValueError, "dim: expected an int >= 1"),
        (lambda: RMSNorm(8.0), TypeError, "dim: expected an int >= 1"),
        (lambda: RMSNorm(8, eps=-1.0), ValueError, "eps: expected a finite float >= 0"),
        (lambda: LayerNorm(8, eps=math.nan), ValueError, "eps: expected a finite float >= 0"),
        (lambda: LayerNorm(8, elementwise_affine="no"), TypeError, "elementwise_affine: expected a bool"),
    ],
    ids=[
        "mha-dropout-high",
        "mha-dropout-negative",
        "mha-causal-str",
        "cross-dropout-one",
        "dropout-add-str",
        "dropout-add-bool",
        "layer-norm-2d-shape",
        "rms-norm-zero",
        "rms-norm-float",
        "rms-norm-eps",
        "layer-norm-eps-nan",
        "layer-norm-affine-str",
    ],
)
def test_module_arguments_are_checked_when_the_module_is_built(make, error, message):
    # before, these built a module that failed only at a later forward (or, for attention dropout, never in eval)
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_a_norm_without_weight_checks_the_width_it_was_built_for(cls):
    # as torch's nn.RMSNorm / nn.LayerNorm(elementwise_affine=False): a width other than dim is an error, not a
    # silent normalisation over another width
    norm = cls(8, elementwise_affine=False)
    with use_accelerators(**TORCH):
        assert norm(torch.randn(3, 8)).shape == (3, 8)
        with pytest.raises(ValueError, match=r"x: expected the last dimension of size 8"):
            norm(torch.randn(3, 16))
    assert cls((8,)).weight.shape == (8,)  # a one-element normalized_shape, as torch's modules take it


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: EmbeddingBagMean(10, 4, padding_idx=True),
            TypeError,
            r"padding_idx: expected None or an int in \[-10, 10\) \(num_embeddings\), got bool True",
        ),
        (
            lambda: EmbeddingBagMean(10, 4, padding_idx=3.0),
            TypeError,
            r"padding_idx: expected None or an int in \[-10, 10\) \(num_embeddings\), got float 3.0",
        ),
        (lambda: BCEWithLogitsLoss(reduction="avg"), ValueError, "reduction: expected one of 'none', 'mean', 'sum'"),
        (lambda: BCEWithLogitsLoss(pos_weight=[2.0]), TypeError, "pos_weight: expected a number or None, got list"),
    ],
    ids=["padding-bool", "padding-float", "bce-reduction", "bce-pos-weight-list"],
)
def test_embedding_and_loss_arguments_are_checked_when_built(make, error, message):
    # padding_idx=True was taken as row 1; a bad reduction failed only at the first forward
    with pytest.raises(error, match=message):
        make()


def test_embedding_bag_takes_a_numpy_padding_row():
    np = pytest.importorskip("numpy")
    bag = EmbeddingBagMean(10, 4, padding_idx=np.int64(-1))
    assert bag.padding_idx == 9 and type(bag.padding_idx) is int
    assert torch.equal(bag.weight[9], torch.zeros(4))


@pytest.mark.parametrize("head_dim, error", [(0, ValueError), (-4, ValueError), (4.0, TypeError)])
def test_gated_delta_mixer_checks_an_explicit_head_dim(head_dim, error):
    # head_dim=0 was read as "not given" (d_model // n_heads taken silently); a negative one failed inside Linear
    with pytest.raises(error, match="head_dim: expected None or an int >= 1"):
        GatedDeltaRuleMixer(8, 2, head_dim=head_dim)
    assert GatedDeltaRuleMixer(8, 2, head_dim=16).head_dim == 16


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: MultiHeadAttention(8, 2.0), TypeError, "n_heads: expected a positive divisor of d_model=8, got float"),
        (lambda: CrossAttention(8, 2.0), TypeError, "n_heads: expected a positive divisor of d_model=8, got float"),
        (
            lambda: GatedDeltaRuleMixer(8, 2.0),
            TypeError,
            "n_heads: expected a positive divisor of d_model=8, got float",
        ),
        (lambda: HSTUBlock(8, "2"), TypeError, "n_heads: expected an int >= 1, got str"),
        (lambda: HSTUBlock(8, 2, head_dim=4.0), TypeError, "head_dim: expected None or an int >= 1, got float"),
        (lambda: HSTUBlock(8, 2, time_buckets=-1), ValueError, "time_buckets: expected an integer >= 0"),
        (lambda: Linear(8.0, 4), TypeError, "in_features: expected an int >= 0, got float"),
        (lambda: EmbeddingBagMean(10.0, 4), TypeError, "num_embeddings: expected an int >= 0, got float"),
        (lambda: EmbeddingBagCollection({"user": 3}), TypeError, r"tables\['user'\]: expected a pair"),
        (lambda: EmbeddingBagCollection({"user": (5, 2.5)}), TypeError, r"dim of tables\['user'\]: expected an int"),
    ],
)
def test_module_sizes_are_checked_as_ints(make, error, message):
    """A float head count was taken by the attention modules (failing in forward's view); other float or malformed
    sizes failed inside torch.empty or a tuple unpacking, naming nothing."""
    with pytest.raises(error, match=message):
        make()


def test_module_sizes_take_numpy_ints():
    np = pytest.importorskip("numpy")
    block = HSTUBlock(8, np.int64(2), position_buckets=np.int64(5))
    assert block.n_heads == 2 and block.position_bias.shape == (2, 5)
    assert Linear(np.int32(3), 4).weight.shape == (4, 3)


def test_attention_inputs_of_the_wrong_rank_are_named():
    """x [total, d_model] without cu_seqlens failed unpacking a projection's shape ('not enough values to unpack')."""
    with pytest.raises(ValueError, match=r"x: expected \[B, L, d_model\] \(packed tokens"):
        MultiHeadAttention(8, 2)(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"context: expected \[B, L, d_model\]"):
        CrossAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"x: expected packed tokens \[total, d_model\] with cu_seqlens"):
        MultiHeadAttention(8, 2)(torch.randn(1, 5, 8), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


@pytest.mark.parametrize("convert", ["double", "half", "bfloat16", "float"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bce_loss_follows_the_logits_whatever_the_modules_dtype(convert, backend):
    """As nn.BCEWithLogitsLoss: converting the module (its pos_weight buffer) changes neither the loss dtype nor the
    backend that runs it (fallback=error: a float64 pos_weight would keep the kernels from it)."""
    ours = getattr(BCEWithLogitsLoss(pos_weight=2.0, backend=backend), convert)()
    theirs = getattr(torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0])), convert)()
    cases = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
    cases += [(D, D)] if backend == "torch" else []  # the kernels take no float64 logits
    for dtype, expected in cases:
        logits, targets = torch.randn(37, dtype=dtype), torch.rand(37, dtype=dtype).round()
        with use_accelerators(fallback="error"):
            loss = ours(logits, targets)
        assert loss.dtype == expected, (dtype, loss.dtype)
        torch.testing.assert_close(loss, theirs(logits.to(expected), targets.to(expected)))
