"""flash_attention on packed (varlen) sequences, on the CPU: the torch path against float64 math per sequence, the
Triton kernels under the interpreter (forward and backward), dropout, torch.compile and every argument error."""

import math
import warnings

import pytest
import torch

from conftest import SM90A, requires_nvcc
from runtime.accelerators import BackendFallbackWarning
from runtime.accelerators.flash_attention import dropout, flash_attention, input_reasons
from runtime.accelerators.flash_attention import triton as fa_triton
from runtime.accelerators.flash_attention.reference import attention_float64_varlen, flash_attention_varlen_reference
from runtime.accelerators.seeds import draw_seed_tensor
from runtime.accelerators.testing import RTOL_ATTENTION_FP32, assert_close, gradient_tolerance
from tma_source import misaligned_tma_copies

GRAD_RTOL = gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32)
LENGTHS = [0, 1, 5, 17]  # an empty sequence, a single row, odd lengths, one past the 16-row tiles
KEY_LENGTHS = [3, 0, 7, 17]  # cross attention: another packing of the keys


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lengths_q, lengths_k, h, hkv, d, dtype=torch.float32):
    q = torch.randn(sum(lengths_q), h, d, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), hkv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), hkv, d, dtype=dtype, requires_grad=True)
    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def textbook(q, k, v, cu_q, cu_k, causal, scale=None, keeps=None, dropout_p=0.0):
    """Attention per sequence, written out in float64: scores, mask, softmax, dropout, product."""
    outs = []
    for s in range(cu_q.numel() - 1):
        rq = slice(int(cu_q[s]), int(cu_q[s + 1]))
        rk = slice(int(cu_k[s]), int(cu_k[s + 1]))
        qs, ks, vs = q[rq].double(), k[rk].double(), v[rk].double()
        group = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * (scale or qs.shape[-1] ** -0.5)
        if causal:
            visible = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool).tril()
            scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no visible key: zeros
        if keeps is not None:
            probs = probs * keeps[s] / (1 - dropout_p)
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
    return torch.cat(outs)


def check_gradients(out, ref, inputs):
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, do)
    grads_ref = torch.autograd.grad(ref, inputs, do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, g, g_ref, GRAD_RTOL)


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_backend_and_float64_reference_match_textbook_per_sequence(causal):
    q, k, v, cu_q, cu_k = packed(LENGTHS, KEY_LENGTHS, 4, 2, 16)
    expected = textbook(q, k, v, cu_q, cu_k, causal, scale=0.3)
    assert_close("float64", attention_float64_varlen(q, k, v, cu_q, cu_k, causal, scale=0.3), expected, 1e-12)
    out = flash_attention(q, k, v, causal=causal, scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    assert out.shape == q.shape
    assert_close("torch", out, expected, RTOL_ATTENTION_FP32)
    check_gradients(out, expected, (q, k, v))
    # the query of sequence 1 (row 0: sequence 0 has none) sees no key: zeros
    assert torch.equal(out[0:1], torch.zeros_like(out[0:1]))


def test_packed_equals_the_op_on_each_sequence():
    q, k, v, cu_q, cu_k = packed(LENGTHS, LENGTHS, 2, 1, 16)
    out = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    for s in range(len(LENGTHS)):
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        if rows.stop == rows.start:
            continue
        alone = flash_attention(
            q[rows].transpose(0, 1)[None],
            k[rows].transpose(0, 1)[None],
            v[rows].transpose(0, 1)[None],
            causal=True,
            backend="torch",
        )
        torch.testing.assert_close(out[rows], alone[0].transpose(0, 1))


@pytest.mark.parametrize("group_scores", [1, 4 * 17 * 17, 1 << 25], ids=["one-each", "some", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_backend_pads_groups_of_sequences(group_scores, causal):
    """The torch backend pads groups of sequences of similar lengths and runs each group at once, within a budget of score
    elements: every sequence alone, groups of some, all in one; the same results and gradients as the textbook, GQA
    and cross attention with empty sequences on either side."""
    lengths_q, lengths_k = [*LENGTHS, 2, 0, 9], [*KEY_LENGTHS, 0, 4, 9]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 16)
    out = flash_attention_varlen_reference(q, k, v, cu_q, cu_k, causal, 0.0, 0.3, group_scores)
    expected = textbook(q, k, v, cu_q, cu_k, causal, scale=0.3)
    assert_close("torch", out, expected, RTOL_ATTENTION_FP32)
    check_gradients(out, expected, (q, k, v))


# --------------------------------------------------------------------------- Triton under the interpreter


@pytest.mark.parametrize(
    "causal, hkv, cross",
    [(False, 2, False), (True, 1, False), (False, 1, True), (True, 2, True)],
    ids=["full-mha", "causal-mqa", "cross-mqa", "causal-cross-mha"],
)
def test_triton_interpreter_forward_and_backward(causal, hkv, cross):
    q, k, v, cu_q, cu_k = packed(LENGTHS, KEY_LENGTHS if cross else LENGTHS, 2, hkv, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)  # the kernels run, not the reference
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    ref = textbook(q, k, v, cu_q, cu_k, causal)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    check_gradients(out, ref, (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_kernels_at_a_padded_head_dim(causal):
    """Head dim 24 (zero-padded to 32 columns) through the kernel module's packed entry points."""
    q, k, v, cu_q, cu_k = packed(LENGTHS, KEY_LENGTHS, 2, 1, 24)
    scale = 24**-0.5
    with torch.no_grad():
        o, lse = fa_triton.varlen_forward(q, k, v, cu_q, cu_k, 17, 17, causal, scale, 0.0, None)
        do = torch.randn_like(o)
        dq, dk, dv = fa_triton.varlen_backward(do, q, k, v, cu_q, cu_k, 17, 17, causal, scale, 0.0, None, o, lse)[:3]
    ref = textbook(q, k, v, cu_q, cu_k, causal)
    assert_close("o", o, ref, RTOL_ATTENTION_FP32)
    assert lse.shape == (2, q.shape[0])
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert_close(name, g, g_ref, GRAD_RTOL)


def test_triton_max_seqlen_is_only_a_bound():
    """A larger max_seqlen (more programs, the extra ones past every sequence) gives the same result."""
    q, k, v, cu_q, cu_k = packed(LENGTHS, KEY_LENGTHS, 2, 2, 16)
    exact = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    loose = flash_attention(
        q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=33, backend="triton"
    )
    torch.testing.assert_close(loose, exact, rtol=0, atol=0)


def test_triton_strided_packed_views():
    """q/k/v as column slices of one projection [total, 3, H, D] (rows far apart), read in place."""
    cu = offsets(LENGTHS)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 16, requires_grad=True)
    q, k, v = qkv.unbind(1)
    out = flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend="triton")
    ref = textbook(q, k, v, cu, cu, False)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    do = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, do)
    (grad_ref,) = torch.autograd.grad(ref, qkv, do.double())
    assert_close("dqkv", grad, grad_ref, GRAD_RTOL)


@pytest.mark.parametrize("hkv", [1, 2], ids=["mqa", "mha"])
def test_triton_dropout_matches_the_padded_batch_mask(hkv):
    """Sequence s, positions i and j within it, is dropped as element (s, h, i, j) of the padded batch; forward and
    backward agree with that mask."""
    p = 0.3
    q, k, v, cu_q, cu_k = packed(LENGTHS, KEY_LENGTHS, 2, hkv, 16)
    torch.manual_seed(11)
    out = flash_attention(q, k, v, causal=True, dropout_p=p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    torch.manual_seed(11)
    seed = int(draw_seed_tensor(q.device))  # the draw flash_attention makes
    keeps = dropout.varlen_keep_masks(seed, cu_q, cu_k, 2, p, "cpu")
    rate = dropout.drop_rate(p)
    ref = textbook(q, k, v, cu_q, cu_k, True, keeps=keeps, dropout_p=rate)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    check_gradients(out, ref, (q, k, v))
    assert keeps[3].float().mean().item() == pytest.approx(1 - p, abs=0.1)  # the mask drops at about p


def test_varlen_keep_masks_are_the_padded_batch_mask():
    cu_q, cu_k = offsets([2, 3]), offsets([4, 1])
    padded = dropout.keep_mask(5, 2, 3, 3, 4, 0.5, "cpu")
    keeps = dropout.varlen_keep_masks(5, cu_q, cu_k, 3, 0.5, "cpu")
    assert torch.equal(keeps[0], padded[0, :, :2, :4]) and torch.equal(keeps[1], padded[1, :, :3, :1])


def test_triton_every_sequence_empty_and_no_keys():
    q, k, v, cu_q, cu_k = packed([0, 0], [0, 0], 2, 1, 16)
    out = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    assert out.shape == (0, 2, 16)
    q, k, v, cu_q, cu_k = packed([3, 2], [0, 0], 2, 1, 16)
    out = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_sequence_keeps_q_k_and_v_in_the_graph(backend):
    """cu_seqlens [0] (no sequence): the torch backend returned q * 0, so differentiating k or v raised 'appears to not
    have been used in the graph' where the kernels give zero gradients (GQA: k and v have fewer heads than q)."""
    q = torch.randn(0, 4, 16, requires_grad=True)
    k, v = (torch.randn(0, 2, 16, requires_grad=True) for _ in range(2))
    cu = torch.zeros(1, dtype=torch.int32)
    out = flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, backend=backend)
    assert out.shape == (0, 4, 16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    reference = attention_float64_varlen(q, k, v, cu, cu)
    assert [g.shape for g in torch.autograd.grad(reference.sum(), (q, k, v))] == [q.shape, k.shape, v.shape]


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("given", [True, False], ids=["max-given", "max-bounded"])
def test_compiled_full_graph_on_triton(given):
    """No value of the offsets is read while tracing: fullgraph compiles, and one graph serves other packings of the
    same sizes; without max_seqlen the packed lengths bound the grid."""

    def attention(q, k, v, cu_q, cu_k):
        extra = dict(max_seqlen_q=17, max_seqlen_k=17) if given else {}
        return flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton", **extra)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    for lengths in (LENGTHS, [17, 5, 1, 0]):
        q, k, v, cu_q, cu_k = packed(lengths, lengths, 2, 1, 16)
        out = compiled(q, k, v, cu_q, cu_k)
        ref = textbook(q, k, v, cu_q, cu_k, True)
        assert_close("o", out, ref, RTOL_ATTENTION_FP32)
        check_gradients(out, ref, (q, k, v))


# --------------------------------------------------------------------------- dispatch and errors


def test_tilelang_takes_packed_sequences_with_gradients():
    """The tilelang backward runs packed sequences: no reason with gradients (as without); on the CPU the one reason
    left is the device."""
    q, k, v, cu_q, cu_k = packed([3, 0, 2], [3, 1, 2], 2, 1, 16, dtype=torch.bfloat16)
    assert input_reasons("tilelang", q=q, k=k, v=v) == []
    with torch.no_grad():
        assert input_reasons("tilelang", q=q, k=k, v=v) == []
    assert input_reasons("triton", q=q.detach().half(), k=k.detach().half(), v=v.detach().half()) == []
    with pytest.warns(BackendFallbackWarning) as record:
        out = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="tilelang")
    messages = " ".join(str(w.message) for w in record)
    assert "tensors are on cpu" in messages and "packed" not in messages
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_without_packed_sequences_is_an_error(name):
    """A padded call ignored it: a user who meant packed sequences but forgot cu_seqlens got no hint."""
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match=rf"{name}: only taken with cu_seqlens_q and cu_seqlens_k .*, got 5"):
        flash_attention(q, q, q, backend="torch", **{name: 5})


def _call(lengths_q=(2, 3), lengths_k=(2, 3), d=16, **kwargs):
    q, k, v, cu_q, cu_k = packed(list(lengths_q), list(lengths_k), 2, 1, d)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch") | kwargs
    return flash_attention(q, k, v, **args)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k: expected a tensor together with cu_seqlens_q"),
        (dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q: expected a tensor together with cu_seqlens_k"),
        (dict(key_lengths=torch.tensor([1, 2])), ValueError, "key_lengths: not taken with cu_seqlens"),
        (dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)), ValueError, "attn_mask: not taken with cu_seqlens"),
        (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q: expected dtype int32, got int64"),
        (dict(cu_seqlens_k=[0, 2, 5]), TypeError, "cu_seqlens_k: expected an int32 torch.Tensor"),
        (dict(cu_seqlens_q=torch.tensor([[0, 2, 5]], dtype=torch.int32)), ValueError, r"cu_seqlens_q: expected a 1-D"),
        (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "cu_seqlens_k: expected 3 offsets"),
        (
            dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_q: expected offsets starting at 0, got 1",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_k: expected non-decreasing",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens_q: expected the last offset to equal the packed length q.shape\[0\] = 5, got 4",
        ),
        (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q: 2 is smaller than the longest sequence \(3\)"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k: expected None or an int >= 0"),
        (dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q: expected None or an int"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a dropout probability in \[0, 1\)"),
    ],
    ids=[
        "k-missing",
        "q-missing",
        "key-lengths",
        "attn-mask",
        "int64",
        "list",
        "2-d",
        "count",
        "start",
        "decreasing",
        "last",
        "max-too-small",
        "max-negative",
        "max-float",
        "dropout",
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_layout_errors():
    q, k, v, cu_q, cu_k = packed([2, 3], [2, 3], 2, 1, 16)
    with pytest.raises(ValueError, match=r"q: expected a 3-D tensor \[total_q, H, D\] with cu_seqlens"):
        flash_attention(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="k: the number of kv heads"):
        flash_attention(q, torch.randn(5, 3, 16), torch.randn(5, 3, 16), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match=r"v: expected the shape of k"):
        flash_attention(q, k, v[:4], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_offsets_under_inference_mode(backend):
    # inference tensors have no version counter: the offsets are read (and checked) on every call
    with torch.inference_mode():
        q, k, v, cu_q, cu_k = packed([2, 5], [3, 4], 2, 1, 16)
        out = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)
        assert_close("o", out, textbook(q, k, v, cu_q, cu_k, causal=True), RTOL_ATTENTION_FP32)
        cu_k[1] = 8
        with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing offsets"):
            flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)


# --------------------------------------------------------------------------- TileLang, compiled for sm_90a


@requires_nvcc
def test_tilelang_packed_forward_compiles_for_sm90a():
    """The forward on packed sequences (head dim 64 with causal masking and dropout) lowers and builds; the GPU tier
    checks its numbers."""
    fa_tilelang = pytest.importorskip(
        "runtime.accelerators.flash_attention.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
    )
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    key, build = fa_tilelang.forward_entry(64, torch.bfloat16, True, False, True, varlen=True)
    assert key != fa_tilelang.forward_entry(64, torch.bfloat16, True, False, True)[0]  # beside the padded forward's
    kernel = tilelang.compile(build(device_info(None)), target=SM90A)
    source = kernel.get_kernel_source()
    assert "taac_dropout_bits" in source and "flash_fwd" in source
    assert not misaligned_tma_copies(source), "TMA copies at a sequence's offset should keep it off the innermost axis"
