"""flash_attention on the CPU: references, dispatch, every error, the Triton kernels under the interpreter."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import (
    AcceleratorConfig,
    BackendFallbackWarning,
    BackendUnavailableError,
    explain,
    use_accelerators,
)
from runtime.accelerators.flash_attention import SPEC, _kernel_lengths, dropout, flash_attention, input_reasons
from runtime.accelerators.flash_attention.reference import attention_float64, flash_attention_reference
from runtime.accelerators.seeds import draw_seed_tensor
from runtime.accelerators.testing import (
    RTOL,
    RTOL_ATTENTION_FP32,
    assert_close,
    deterministic_algorithms,
    gradient_tolerance,
)


def make(b, h, hkv, lq, lk, d, dtype=torch.float32, requires_grad=True):
    q = torch.randn(b, h, lq, d, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def check_against_float64(out, q, k, v, rtol, grad_rtol, **ref_kwargs):
    """Output and dq/dk/dv of `out` (computed from q, k, v) against the float64 reference."""
    ref = attention_float64(q, k, v, **ref_kwargs)
    assert_close("o", out, ref, rtol)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, g, g_ref, grad_rtol)


# --------------------------------------------------------------------------- references


def test_float64_reference_matches_sdpa():
    q, k, v = (t.double() for t in make(2, 3, 3, 11, 13, 16, requires_grad=False))
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert_close("textbook", attention_float64(q, k, v, causal=causal), expected, 1e-12)


@pytest.mark.parametrize(
    "causal, lengths, gqa, masked",
    [(False, False, False, False), (True, False, True, False), (False, True, True, False), (True, True, False, True)],
    ids=["plain", "causal-gqa", "lengths-gqa", "causal-lengths-mask"],
)
def test_torch_backend(causal, lengths, gqa, masked):
    q, k, v = make(3, 4, 2 if gqa else 4, 37, 29, 32)
    key_lengths = torch.tensor([29, 0, 7]) if lengths else None
    attn_mask = torch.rand(37, 29) > 0.3 if masked else None
    if masked:
        attn_mask[5] = False  # a row with no visible key
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, attn_mask=attn_mask, backend="torch")
    kwargs = dict(causal=causal, key_lengths=key_lengths, attn_mask=attn_mask)
    check_against_float64(
        out, q, k, v, RTOL_ATTENTION_FP32, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32), **kwargs
    )


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("shape", [(29,), ()], ids=["keys-only", "scalar"])
def test_attn_mask_of_fewer_than_two_dims_broadcasts(shape, causal):
    """A bool mask broadcastable to [B, H, Lq, Lk] may have one dim (a key mask [Lk]) or none, as the contract says."""
    q, k, v = make(2, 4, 2, 13, 29, 16)
    attn_mask = torch.rand(shape) > 0.3 if shape else torch.tensor(True)
    out = flash_attention(q, k, v, causal=causal, attn_mask=attn_mask, backend="torch")
    full = attn_mask.expand(13, 29)
    check_against_float64(
        out, q, k, v, RTOL_ATTENTION_FP32, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32),
        causal=causal, attn_mask=full,
    )  # fmt: skip


def test_rows_without_keys_give_zeros_and_finite_gradients():
    q, k, v = make(2, 2, 2, 9, 8, 16)
    out = flash_attention(q, k, v, key_lengths=torch.tensor([0, 8]), backend="torch")
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))


def test_no_keys_at_all():
    q, k, v = make(2, 2, 2, 5, 0, 16)
    out = flash_attention(q, k, v, causal=True, backend="torch")
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))  # empty gradients for the empty k and v
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


def test_empty_batch():
    q, k, v = make(0, 2, 2, 5, 6, 16)
    assert flash_attention(q, k, v, backend="triton").shape == (0, 2, 5, 16)


def test_reference_dropout_keeps_expectation():
    q, k, v = make(1, 1, 1, 4, 6, 16, requires_grad=False)
    plain = flash_attention_reference(q, k, v)
    average = torch.stack([flash_attention_reference(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert_close("dropout average", average, plain, 0.15)


def test_autocast_runs_in_the_autocast_dtype():
    q, k, v = make(1, 2, 2, 7, 7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attention(q, k, v, backend="torch")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32


def test_autocast_takes_mixed_dtypes_as_sdpa():
    # a learned fp32 query against keys and values from bf16 autocast matmuls
    q, k, v = make(1, 2, 2, 7, 7, 16)
    k16, v16 = k.detach().bfloat16().requires_grad_(), v.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attention(q, k16, v16, backend="torch")
        expected = F.scaled_dot_product_attention(q, k16, v16)
    assert out.dtype == torch.bfloat16
    assert_close("o", out, expected, RTOL[torch.bfloat16])
    out.float().sum().backward()
    assert (q.grad.dtype, k16.grad.dtype, v16.grad.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)


# --------------------------------------------------------------------------- dispatch


def test_reasons_per_backend():
    q, k, v = make(1, 2, 2, 4, 4, 24, requires_grad=False)
    assert any("head dim 24" in r for r in input_reasons("triton", q=q, k=k, v=v))
    assert input_reasons("triton", q=q[..., :16].to(torch.float16)) == []
    assert any("float32" in r for r in input_reasons("tilelang", q=q[..., :16]))
    assert any(
        "attn_mask" in r for r in input_reasons("triton", q=q[..., :16], attn_mask=torch.ones(4, 4, dtype=torch.bool))
    )
    assert input_reasons("triton") == []  # explain() may pass no inputs


def test_interpreter_bf16_is_a_reason():
    q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
    assert any("interpreter" in r for r in input_reasons("triton", q=q))


def test_auto_prefers_triton_under_the_interpreter():
    q, k, v = make(1, 2, 2, 5, 5, 16, requires_grad=False)
    assert SPEC.priority[0] == "triton"
    assert not SPEC.not_supported_reasons("triton", q.device, q=q, k=k, v=v)


def test_auto_tries_tilelang_first_at_head_dim_128_and_with_dropout_from_48():
    for d in (16, 32, 48, 64):
        assert SPEC.priority_for(q=torch.empty(1, 1, 2, d))[0] == "triton"
    for d, first in ((16, "triton"), (32, "triton"), (48, "tilelang"), (64, "tilelang"), (128, "tilelang")):
        assert SPEC.priority_for(q=torch.empty(1, 1, 2, d), dropout_p=0.1)[0] == first
    q, k, v = make(1, 2, 2, 5, 5, 128, requires_grad=False)
    assert SPEC.priority_for(q=q) == ("tilelang", "triton")
    # tilelang needs CUDA: auto then takes the next in the order (the interpreter's triton)
    text = explain("flash_attention", q=q, k=k, v=v)
    assert "configured 'auto' -> runs triton; auto priority tilelang > triton > torch" in text


def test_deterministic_algorithms_keep_a_differentiated_call_off_tilelang():
    q, k, v = make(1, 2, 2, 5, 5, 128)
    frozen = [t.detach() for t in (q, k, v)]
    with deterministic_algorithms(), use_accelerators(fallback="error"):
        assert any("deterministic" in r for r in input_reasons("tilelang", q=q, k=k, v=v))
        assert not any("deterministic" in r for r in input_reasons("triton", q=q, k=k, v=v))
        with torch.no_grad():  # nothing to differentiate: the tilelang forward is deterministic
            assert not any("deterministic" in r for r in input_reasons("tilelang", q=q, k=k, v=v))
        assert not any("deterministic" in r for r in input_reasons("tilelang", q=frozen[0], k=frozen[1], v=frozen[2]))
        with pytest.raises(BackendUnavailableError, match="deterministic algorithms are on"):
            flash_attention(q, k, v, backend="tilelang")
        text = explain("flash_attention", q=q, k=k, v=v)
        assert "deterministic algorithms: on" in text.splitlines()[0]
        assert "tilelang: " in text and "deterministic algorithms are on" in text
    # the decision cache tells the modes apart
    with use_accelerators(fallback="error"), pytest.raises(BackendUnavailableError) as raised:
        flash_attention(q, k, v, backend="tilelang")
    assert "deterministic" not in str(raised.value)


def test_attn_mask_on_a_kernel_backend_falls_back_with_a_warning():
    q, k, v = make(1, 2, 2, 5, 6, 16, requires_grad=False)
    mask = torch.rand(5, 6) > 0.5
    with pytest.warns(BackendFallbackWarning, match="attn_mask"):
        out = flash_attention(q, k, v, attn_mask=mask, backend="triton")
    assert_close("fallback", out, attention_float64(q, k, v, attn_mask=mask), RTOL_ATTENTION_FP32)


def test_dropout_seed_is_a_tensor_on_the_device_and_no_capture_reason():
    """The kernels load their seed from a device tensor drawn by the device's generator: a captured CUDA graph draws a
    new one on every replay, so capturing is no reason to leave the kernels (nothing about it in the reasons)."""
    q, k, v = make(1, 2, 2, 5, 6, 16, requires_grad=False)
    assert input_reasons("triton", q=q, dropout_p=0.1) == []
    torch.manual_seed(3)
    out = flash_attention(q, k, v, dropout_p=0.5, backend="triton")
    torch.manual_seed(3)
    seed = draw_seed_tensor(q.device)
    assert seed.shape == (1,) and seed.dtype == torch.int64 and seed.device == q.device
    keep = dropout.keep_mask(int(seed), 1, 2, 5, 6, 0.5, q.device)
    assert_close("dropout", out, attention_float64(q, k, v, keep=keep, dropout_p=0.5), RTOL_ATTENTION_FP32)


def test_fallback_error_names_every_reason():
    q, k, v = make(1, 2, 2, 5, 6, 24, requires_grad=False)
    mask = torch.ones(5, 6, dtype=torch.bool)
    with use_accelerators(AcceleratorConfig(fallback="error")):
        with pytest.raises(BackendUnavailableError, match="flash_attention.*triton.*attn_mask.*head dim 24"):
            flash_attention(q, k, v, attn_mask=mask, backend="triton")


def test_auto_without_reasons_does_not_warn():
    q, k, v = make(1, 2, 2, 5, 6, 24, requires_grad=False)  # head dim 24: auto quietly takes torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention(q, k, v, backend="auto")


def test_explain_lists_input_reasons():
    q, k, v = make(1, 2, 2, 5, 6, 24, requires_grad=False)
    text = explain("flash_attention", q=q, k=k, v=v)
    assert "flash_attention" in text and "head dim 24" in text


# --------------------------------------------------------------------------- errors

Q, K = (1, 4, 5, 16), (1, 2, 6, 16)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(q=[1.0]), TypeError, "q: expected a torch.Tensor"),
        (dict(q=torch.ones(Q, dtype=torch.int32)), TypeError, "q: expected a floating-point"),
        (dict(q=torch.randn(4, 5, 16)), ValueError, r"q: expected a 4-D tensor \[B, H, Lq, D\]"),
        (dict(k=torch.randn(1, 2, 6)), ValueError, r"k: expected a 4-D tensor \[B, Hkv, Lk, D\]"),
        (dict(k=torch.randn(K, dtype=torch.float16)), TypeError, "k: expected dtype float32 like q"),
        (dict(v=torch.randn(1, 2, 7, 16)), ValueError, "v: expected the shape of k"),
        (dict(k=torch.randn(2, 2, 6, 16), v=torch.randn(2, 2, 6, 16)), ValueError, "k: expected batch size 1"),
        (dict(k=torch.randn(1, 2, 6, 32), v=torch.randn(1, 2, 6, 32)), ValueError, "k: expected head dim 16"),
        (
            dict(k=torch.randn(1, 3, 6, 16), v=torch.randn(1, 3, 6, 16)),
            ValueError,
            r"kv heads \(3\) must divide .* \(4\)",
        ),
        (
            dict(q=torch.randn(1, 4, 5, 0), k=torch.randn(1, 2, 6, 0), v=torch.randn(1, 2, 6, 0)),
            ValueError,
            "head dim is empty",
        ),
        (dict(key_lengths=[3]), TypeError, "key_lengths: expected an integer torch.Tensor"),
        (dict(key_lengths=torch.tensor([3.0])), TypeError, "key_lengths: expected dtype int32 or int64"),
        (dict(key_lengths=torch.tensor([3, 3])), ValueError, r"key_lengths: expected shape \(1,\)"),
        (dict(key_lengths=torch.tensor([7])), ValueError, r"key_lengths: expected values in \[0, 6\]"),
        (dict(key_lengths=torch.tensor([-1])), ValueError, r"key_lengths: expected values in \[0, 6\]"),
        (dict(attn_mask=torch.ones(5, 6)), TypeError, "attn_mask: expected a bool tensor"),
        (dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)), ValueError, "attn_mask: expected a shape broadcastable"),
        (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a dropout probability in \[0, 1\)"),
        (dict(dropout_p=-0.1), ValueError, "dropout_p"),
        (dict(scale="big"), TypeError, "scale: expected a float > 0 or None, got str"),
        (dict(scale=0.0), ValueError, "scale: expected a finite float > 0 or None, got 0.0"),
        (dict(scale=-0.5), ValueError, "scale: expected a finite float > 0 or None, got -0.5"),
        (dict(scale=float("nan")), ValueError, "scale: expected a finite float > 0 or None, got nan"),
        (dict(scale=float("inf")), ValueError, "scale: expected a finite float > 0 or None, got inf"),
        (dict(causal="yes"), TypeError, "causal: expected a bool \\(True or False\\), got str 'yes'"),
        (dict(causal=1), TypeError, "causal: expected a bool \\(True or False\\), got int 1"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input(change, error, match):
    args = dict(q=torch.randn(Q), k=torch.randn(K), v=torch.randn(K))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **args)


def test_lengths_changed_in_place_are_checked_again():
    q, k, v = torch.randn(Q), torch.randn(K), torch.randn(K)
    key_lengths = torch.tensor([6])
    flash_attention(q, k, v, key_lengths=key_lengths, backend="torch")
    key_lengths.fill_(9)
    with pytest.raises(ValueError, match=r"key_lengths: expected values in \[0, 6\]"):
        flash_attention(q, k, v, key_lengths=key_lengths, backend="torch")
    k7 = torch.randn(1, 2, 7, 16)
    key_lengths.fill_(7)
    flash_attention(q, k7, k7, key_lengths=key_lengths, backend="torch")
    with pytest.raises(ValueError, match=r"key_lengths: expected values in \[0, 6\]"):
        flash_attention(q, k, v, key_lengths=key_lengths, backend="torch")


def test_kernel_lengths_cast_once_per_unchanged_tensor():
    # the int32 copy the kernels read is made once for lengths passed again unchanged (every layer of a model)
    lengths = torch.tensor([6, 2])
    first = _kernel_lengths(lengths)
    assert first.dtype == torch.int32 and first.tolist() == [6, 2]
    assert _kernel_lengths(lengths) is first
    lengths.fill_(3)  # changed in place: cast again
    again = _kernel_lengths(lengths)
    assert again is not first and again.tolist() == [3, 3]
    other = torch.tensor([6, 2])  # another tensor: its own copy
    assert _kernel_lengths(other) is not again and _kernel_lengths(other).tolist() == [6, 2]
    as_is = torch.tensor([1, 2], dtype=torch.int32)  # already what the kernels read
    assert _kernel_lengths(as_is) is as_is
    with torch.inference_mode():
        frozen = torch.tensor([4, 5])  # no version counter: never reused
    assert _kernel_lengths(frozen) is not _kernel_lengths(frozen)


def test_lengths_cast_under_inference_mode_are_not_reused_for_training():
    """An evaluation under torch.inference_mode, then a training step with the same key_lengths: the int32 cast made
    in inference mode is an inference tensor, which autograd cannot save ("Inference tensors cannot be saved for
    backward")."""
    q, k, v = make(2, 2, 1, 9, 11, 16, requires_grad=False)
    lengths = torch.tensor([11, 4])  # int64: cast for the kernels
    with torch.inference_mode():
        flash_attention(q, k, v, key_lengths=lengths, backend="triton")
    assert not _kernel_lengths(lengths).is_inference()
    q.requires_grad_()
    out = flash_attention(q, k, v, key_lengths=lengths, backend="triton")
    (dq,) = torch.autograd.grad(out.sum(), q)
    q64 = q.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(attention_float64(q64, k, v, key_lengths=lengths).sum(), q64)
    assert_close("dq", dq, ref, 2 * RTOL_ATTENTION_FP32)


def test_triton_reads_lengths_changed_in_place():
    q, k, v = make(2, 2, 1, 9, 11, 16, requires_grad=False)
    lengths = torch.tensor([11, 4])
    flash_attention(q, k, v, key_lengths=lengths, backend="triton")
    lengths[1] = 7
    out = flash_attention(q, k, v, key_lengths=lengths, backend="triton")
    assert_close("o", out, attention_float64(q, k, v, key_lengths=lengths), RTOL_ATTENTION_FP32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_key_lengths_under_inference_mode(backend):
    # an inference tensor has no version counter: its values are checked on every call
    q, k, v = make(2, 2, 1, 9, 11, 16, requires_grad=False)
    with torch.inference_mode():
        key_lengths = torch.tensor([11, 4])
        out = flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend=backend)
        assert_close("o", out, attention_float64(q, k, v, causal=True, key_lengths=key_lengths), RTOL_ATTENTION_FP32)
        key_lengths.fill_(12)
        with pytest.raises(ValueError, match=r"key_lengths: expected values in \[0, 11\]"):
            flash_attention(q, k, v, key_lengths=key_lengths, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        flash_attention(torch.randn(Q), torch.randn(K), torch.randn(K), backend="cuda")


# --------------------------------------------------------------------------- Triton under the interpreter


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dtype",
    [
        (2, 2, 2, 37, 45, 16, False, None, torch.float32),
        (2, 4, 2, 70, 33, 48, True, None, torch.float32),
        (3, 2, 1, 37, 63, 32, True, [63, 0, 20], torch.float32),
        (1, 2, 2, 1, 130, 16, False, [69], torch.float16),
        (2, 4, 2, 70, 45, 64, True, [45, 0], torch.float16),
    ],
    ids=[
        "plain-d16",
        "causal-gqa-d48-lq>lk",
        "causal-lengths-mqa-d32",
        "lq1-lengths-fp16",
        "causal-lengths-gqa-d64-fp16",
    ],
)
def test_triton_interpreter(b, h, hkv, lq, lk, d, causal, lengths, dtype):
    q, k, v = make(b, h, hkv, lq, lk, d, dtype)
    key_lengths = torch.tensor(lengths) if lengths is not None else None
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend="triton")
    rtol = RTOL_ATTENTION_FP32 if dtype == torch.float32 else RTOL[dtype]
    kwargs = dict(causal=causal, key_lengths=key_lengths)
    check_against_float64(out, q, k, v, rtol, gradient_tolerance(dtype, rtol), **kwargs)
    if lengths is not None and 0 in lengths:
        assert torch.equal(out[lengths.index(0)], torch.zeros_like(out[0]))


def test_triton_interpreter_strided_views():
    b, lq, lk, h, d = 2, 21, 19, 4, 16
    x = torch.randn(b, lq, h, d)
    kv = torch.randn(b, lk, 2, 2 * d)  # k and v interleaved in one buffer
    q = x.transpose(1, 2).requires_grad_()
    kvt = kv.requires_grad_()
    k, v = kvt[..., :d].transpose(1, 2), kvt[..., d:].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out = flash_attention(q, k, v, causal=True, scale=0.3, backend="triton")
    ref = attention_float64(q, k, v, causal=True, scale=0.3)
    assert_close("o", out, ref, RTOL_ATTENTION_FP32)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, kvt), do)
    grads_ref = torch.autograd.grad(ref, (q, kvt), do.double())
    for name, g, g_ref in zip(("dq", "dkv"), grads, grads_ref):
        assert_close(name, g, g_ref, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32))


def test_dropout_mask_keep_rate_and_determinism():
    p = 0.3
    keep = dropout.keep_mask(1234, 2, 3, 70, 90, p, "cpu")
    assert keep.shape == (2, 3, 70, 90) and keep.dtype == torch.bool
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 0.01, f"keep rate {rate:.4f}, expected {1 - p}"
    assert torch.equal(keep, dropout.keep_mask(1234, 2, 3, 70, 90, p, "cpu"))
    other = dropout.keep_mask(1235, 2, 3, 70, 90, p, "cpu")
    assert (keep != other).float().mean().item() > 0.3, "another seed must give another mask"
    # rows, columns and heads are not copies of each other
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep[0, 0, :, 0], keep[0, 0, :, 1])
    assert not torch.equal(keep[0, 0], keep[0, 1])


def test_dropout_threshold_and_rate():
    assert dropout.keep_threshold(0.0) == 0 and dropout.drop_rate(0.0) == 0.0
    assert dropout.keep_threshold(0.25) == 1 << 14 and dropout.drop_rate(0.25) == 0.25
    assert dropout.keep_threshold(1 - 1e-9) == (1 << 16) - 1  # a rate below 1 keeps something
    for p in (0.1, 0.3, 0.777):
        rate = dropout.drop_rate(p)
        assert abs(rate - p) <= 2**-17 and torch.tensor(rate, dtype=torch.float32).item() == rate  # exact in fp32


def test_dropout_draws_are_independent():
    """The keep rate over half a million draws, and pairs of neighbours kept together as often as chance says:
    keys j and j ^ 8 (the two halves of one hash), adjacent keys, adjacent queries and the two heads' draws."""
    p = 0.5
    keep = dropout.keep_mask(99, 1, 2, 512, 512, p, "cpu").float()
    n = keep.numel()
    assert abs(keep.mean().item() - 0.5) < 5 * (0.25 / n) ** 0.5
    j = torch.arange(512)
    pairs = {
        "keys j, j ^ 8": (keep, keep[..., j ^ 8]),
        "keys j, j + 1": (keep[..., :-1], keep[..., 1:]),
        "queries i, i + 1": (keep[..., :-1, :], keep[..., 1:, :]),
        "heads": (keep[:, 0], keep[:, 1]),
    }
    for name, (a, b) in pairs.items():
        both = (a * b).mean().item()
        assert abs(both - 0.25) < 5 * (0.1875 / a.numel()) ** 0.5, f"{name}: kept together {both:.4f}, chance 0.25"


def test_dropout_blocks_of_queries_and_keys_differ():
    """Queries 2^16 apart and keys 2^17 apart share their low index bits; their blocks' keys set them apart."""
    i, j = torch.arange(64).view(-1, 1), torch.arange(256).view(1, -1)
    bh = torch.tensor(3)
    base = dropout.random_bits(7, bh, i, j)
    for far_i, far_j in ((i + (1 << 16), j), (i, j + (1 << 17)), (i + (5 << 16), j + (3 << 17))):
        far = dropout.random_bits(7, bh, far_i, far_j)
        assert (far != base).float().mean().item() > 0.99


def test_triton_interpreter_dropout():
    p, (b, h, hkv, lq, lk, d) = 0.25, (2, 2, 1, 33, 40, 16)
    q, k, v = make(b, h, hkv, lq, lk, d)
    torch.manual_seed(7)
    out = flash_attention(q, k, v, causal=True, dropout_p=p, backend="triton")
    torch.manual_seed(7)
    seed = int(draw_seed_tensor(q.device))  # the draw flash_attention makes
    torch.manual_seed(7)
    assert torch.equal(out, flash_attention(q, k, v, causal=True, dropout_p=p, backend="triton")), "not repeatable"
    keep = dropout.keep_mask(seed, b, h, lq, lk, p, q.device)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    kwargs = dict(causal=True, keep=keep, dropout_p=p)
    check_against_float64(
        out, q, k, v, RTOL_ATTENTION_FP32, gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32), **kwargs
    )


def test_triton_under_torch_compile():
    q, k, v = make(2, 2, 1, 9, 12, 16)
    key_lengths = torch.tensor([12, 5])

    def f(q, k, v):
        return flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend="triton")

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    check_against_float64(
        out,
        q,
        k,
        v,
        RTOL_ATTENTION_FP32,
        gradient_tolerance(torch.float32, RTOL_ATTENTION_FP32),
        causal=True,
        key_lengths=key_lengths,
    )


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
@pytest.mark.parametrize(
    "causal, lengths, dropout_p",
    [(False, False, 0.0), (True, True, 0.0), (False, False, 0.25), (True, True, 0.25)],
    ids=["plain", "causal-lengths", "dropout", "causal-lengths-dropout"],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_compiled_with_dynamic_shapes_matches_eager(backend, causal, lengths, dropout_p, dynamic):
    # Dynamo makes a float argument symbolic (SymFloat) under dynamic shapes, the default dropout_p and scale
    # included; the backend decision used to fail on it. Without dropout the defaults are used, with it dropout_p
    # and scale are arguments of the compiled function.
    def f(q, k, v, key_lengths, dropout_p, scale):
        if dropout_p == 0.0:
            return flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend=backend)
        return flash_attention(
            q, k, v, causal=causal, key_lengths=key_lengths, dropout_p=dropout_p, scale=scale, backend=backend
        )

    torch._dynamo.reset()  # f's code is shared by every case: start without the graphs (and recompiles) of the others
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for b, lq, lk in ((2, 9, 12), (3, 7, 10)):  # the second shape takes the graph (or makes it) dynamic
        q, k, v = make(b, 2, 1, lq, lk, 16)
        key_lengths = torch.randint(0, lk + 1, (b,)) if lengths else None
        results = []
        for run in (compiled, f):
            torch.manual_seed(1)  # the same dropout mask for both
            out = run(q, k, v, key_lengths, dropout_p, 0.3)
            results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
        for name, got, expected in zip(("o", "dq", "dk", "dv"), *results):
            torch.testing.assert_close(got, expected, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton", "tilelang"])
def test_scale_and_causal_are_checked_on_every_backend(backend):
    q, k, v = make(1, 2, 2, 5, 5, 16, requires_grad=False)
    with pytest.raises(ValueError, match="scale: expected a finite float > 0"):
        flash_attention(q, k, v, scale=0.0, backend=backend)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        flash_attention(q, k, v, causal="yes", backend=backend)
