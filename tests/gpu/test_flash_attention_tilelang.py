"""flash_attention's TileLang backend on CUDA against the float64 reference: outputs and dq/dk/dv,
by the split backward (preprocess and dk/dv kernel adding dq) and by the fused one (keys in one block).

Few specialisations (head dim, dtype, causal, key_lengths, dropout) so compilation stays short;
they are compiled in parallel before the first test.
"""

import pytest
import torch

from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.seeds import draw_seed
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance
from runtime.accelerators.tilelang_common import precompile

fa = pytest.importorskip(
    "runtime.accelerators.flash_attention.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

CUDA = "cuda"
bf16, f16 = torch.bfloat16, torch.float16


def make(b, h, hkv, lq, lk, d, dtype, layout="bhld"):
    """q [B,H,Lq,D], k/v [B,Hkv,Lk,D]; layout "blhd" gives x.view(B, L, H, D).transpose(1, 2) views."""
    if layout == "blhd":
        q = torch.randn(b, lq, h, d, device=CUDA, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, lk, hkv, d, device=CUDA, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, lk, hkv, d, device=CUDA, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, lq, d, device=CUDA, dtype=dtype)
        k = torch.randn(b, hkv, lk, d, device=CUDA, dtype=dtype)
        v = torch.randn(b, hkv, lk, d, device=CUDA, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def check(out, q, k, v, dtype, **ref_kwargs):
    ref = attention_float64(q, k, v, **ref_kwargs)
    assert out.dtype == q.dtype
    assert_close("o", out, ref, RTOL[dtype])
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, gradient_tolerance(dtype))
    return grads


# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout): every head dim, both dtypes, causal and
# not, key_lengths and not, GQA, views, odd lengths (1, 63, 200, 1000), batch 1 -- not the product.
CASES = [
    (4, 4, 4, 256, 256, 16, False, False, bf16, "blhd"),
    (3, 4, 2, 200, 200, 16, True, True, f16, "bhld"),
    (3, 8, 2, 63, 63, 32, True, False, bf16, "bhld"),
    (2, 4, 4, 1, 1, 32, True, False, bf16, "blhd"),
    (2, 4, 1, 63, 1000, 48, False, True, bf16, "blhd"),
    (2, 2, 2, 1000, 200, 64, True, True, f16, "bhld"),
    (1, 4, 2, 200, 1000, 128, True, False, bf16, "blhd"),
    # the tokenformer model's attention (batch 256, 257 tokens, 4 heads of 16, causal + key_lengths, bf16 views):
    # its TileLang backward gave non-finite gradients in a training run of stop 10 (docs/benchmark/training.md)
    (256, 4, 4, 257, 257, 16, True, True, bf16, "blhd"),
]
DROPOUT_SPEC = (64, bf16, False, False, True)
SPECS = sorted({(c[5], c[8], c[6], c[7], False) for c in CASES} | {DROPOUT_SPEC}, key=str)

# the fused backward, every key of a (batch, kv head) in one block (Lk <= FUSED_CONFIGS[D].block_n): the same
# case fields; head dims 16 (256 keys), 32, 48, 64, 128, both dtypes, GQA/MQA, views, Lq above and below Lk
FUSED_CASES = [
    (4, 4, 2, 256, 256, 16, True, True, bf16, "blhd"),  # all 256 keys of the block
    (3, 4, 4, 63, 200, 16, False, True, f16, "bhld"),
    (2, 8, 4, 100, 90, 32, False, False, f16, "bhld"),
    (2, 4, 2, 77, 57, 48, True, True, bf16, "blhd"),
    (2, 4, 1, 300, 128, 64, True, False, bf16, "bhld"),
    (1, 2, 2, 1, 1, 64, True, False, f16, "blhd"),
    (2, 2, 2, 129, 100, 128, False, True, bf16, "blhd"),
    (3, 4, 2, 200, 128, 128, True, True, f16, "bhld"),
]
FUSED_DROPOUT = [(16, 256, True), (64, 100, False)]  # (D, Lk, causal), bf16
FUSED_SPECS = sorted(
    {(c[5], c[8], c[6], c[7], False) for c in FUSED_CASES}
    | {(d, bf16, causal, False, True) for d, _, causal in FUSED_DROPOUT},
    key=str,
)


@pytest.fixture(scope="module", autouse=True)
def _compiled_in_parallel():
    split = [(fa.forward_entry(*spec), fa.preprocess_entry(*spec[:2]), fa.backward_entry(*spec)) for spec in SPECS]
    fused = [(fa.forward_entry(*spec), fa.fused_backward_entry(*spec)) for spec in FUSED_SPECS]
    precompile([entry for entries in split + fused for entry in entries], torch.device(CUDA))


def _id(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout = case
    return (
        f"{b}x{h}/{hkv}x{lq}x{lk}-d{d}-{str(dtype).removeprefix('torch.')}"
        f"{'-causal' if causal else ''}{'-lengths' if lengths else ''}{'-view' if layout == 'blhd' else ''}"
    )


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_tilelang_against_float64(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    key_lengths = None
    if lengths:
        key_lengths = torch.randint(1, lk + 1, (b,), device=CUDA)
        key_lengths[0] = 0 if b > 1 else lk // 2 + 1  # a batch row without any key, when there are several
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend="tilelang")
    dq, dk, dv = check(out, q, k, v, dtype, causal=causal, key_lengths=key_lengths)
    if lengths and b > 1:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dk[0], torch.zeros_like(dk[0]))
    # gradients keep the inputs' dimension order (views stay views of [B, L, H, D] memory)
    assert dq.stride() == torch.empty_like(q).stride() and dk.stride() == torch.empty_like(k).stride()


def test_scale_and_int64_lengths():
    q, k, v = make(2, 4, 1, 63, 1000, 48, bf16)
    key_lengths = torch.tensor([1000, 417], device=CUDA, dtype=torch.int64)
    out = flash_attention(q, k, v, key_lengths=key_lengths, scale=0.05, backend="tilelang")
    check(out, q, k, v, bf16, key_lengths=key_lengths, scale=0.05)


def test_one_compilation_serves_all_lengths_batches_and_groups():
    from runtime.accelerators import tilelang_common

    def step(b, h, hkv, lq, lk):
        q, k, v = make(b, h, hkv, lq, lk, 32, bf16)
        out = flash_attention(q, k, v, causal=True, backend="tilelang")
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    step(2, 4, 4, 100, 100)
    before = len(tilelang_common._kernels)
    for b, h, hkv, lq, lk in [(1, 4, 2, 1, 1), (3, 4, 1, 257, 300), (5, 2, 2, 1000, 33), (2, 8, 4, 64, 64)]:
        step(b, h, hkv, lq, lk)
    assert len(tilelang_common._kernels) == before


def test_dropout_keep_rate_and_backward_consistency():
    p, (b, h, hkv, lq, lk, d) = 0.2, (2, 4, 2, 300, 257, 64)
    q, k, v = make(b, h, hkv, lq, lk, d, bf16)
    torch.manual_seed(11)
    out = flash_attention(q, k, v, dropout_p=p, backend="tilelang")
    torch.manual_seed(11)
    seed = draw_seed()  # the draw flash_attention made
    torch.manual_seed(11)
    again = flash_attention(q, k, v, dropout_p=p, backend="tilelang")
    assert torch.equal(out, again), "torch.manual_seed must repeat the dropout mask"
    keep = fa.dropout_keep_mask(seed, b, h, lq, lk, p, q.device)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 0.005, f"keep rate {rate:.4f}, expected {1 - p}"
    # the kernels draw exactly this mask in the forward and in every gradient: a dropped position
    # contributes nothing, a kept one is scaled by 1 / (1 - p)
    check(out, q, k, v, bf16, keep=keep, dropout_p=p)


# --------------------------------------------------------------------------- the fused backward


def lengths_for(b, lk):
    key_lengths = torch.randint(1, lk + 1, (b,), device=CUDA, dtype=torch.int32)
    key_lengths[0] = 0 if b > 1 else lk // 2 + 1  # a batch row without any key, when there are several
    return key_lengths


def record_fused(monkeypatch) -> list:
    """Calls of the fused backward from here on (the split one's kernels are then left unrun)."""
    calls = []
    real = fa.backward_fused
    monkeypatch.setattr(fa, "backward_fused", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("case", FUSED_CASES, ids=[_id(c) for c in FUSED_CASES])
def test_fused_backward_against_float64(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout = case
    q, k, v = (x.detach() for x in make(b, h, hkv, lq, lk, d, dtype, layout))
    do = torch.randn_like(q)  # q's layout
    key_lengths = lengths_for(b, lk) if lengths else None
    args = (q, k, v, key_lengths, causal, d**-0.5, 0.0, 0)
    o, lse = fa.forward(*args)
    grads = fa.backward_fused(do, *args, o, lse)  # outputs poisoned by the conftest
    inputs = [x.double().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(attention_float64(*inputs, causal=causal, key_lengths=key_lengths), inputs, do.double())
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, expected, (q, k, v)):
        assert g.dtype == x.dtype and g.stride() == torch.empty_like(x).stride()
        assert_close(name, g, g_ref, gradient_tolerance(dtype))
    if lengths and b > 1:  # a batch row without keys: exactly zero gradients
        assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in grads)


@pytest.mark.parametrize("d, lk, causal", FUSED_DROPOUT, ids=["d16-lk256-causal", "d64-lk100"])
def test_fused_backward_dropout_consistency(monkeypatch, d, lk, causal):
    """The fused backward regenerates the forward's dropout mask: a dropped position contributes nothing, a kept
    one is scaled by 1 / (1 - p)."""
    monkeypatch.setattr(fa, "BACKWARD", "fused")
    calls = record_fused(monkeypatch)
    p, (b, h, hkv, lq) = 0.2, (2, 4, 2, 150)
    q, k, v = make(b, h, hkv, lq, lk, d, bf16)
    torch.manual_seed(11)
    out = flash_attention(q, k, v, causal=causal, dropout_p=p, backend="tilelang")
    torch.manual_seed(11)
    seed = draw_seed()  # the draw flash_attention made
    keep = fa.dropout_keep_mask(seed, b, h, lq, lk, p, q.device)
    check(out, q, k, v, bf16, causal=causal, keep=keep, dropout_p=p)
    assert calls == [1]


def test_fused_one_compilation_serves_all_lengths_batches_and_groups(monkeypatch):
    from runtime.accelerators import tilelang_common

    monkeypatch.setattr(fa, "BACKWARD", "fused")
    calls = record_fused(monkeypatch)

    def step(b, h, hkv, lq, lk):
        q, k, v = make(b, h, hkv, lq, lk, 16, bf16)
        out = flash_attention(q, k, v, causal=True, backend="tilelang")
        check(out, q, k, v, bf16, causal=True)

    step(2, 4, 4, 100, 100)
    before = len(tilelang_common._kernels)
    for b, h, hkv, lq, lk in [(1, 4, 2, 1, 1), (3, 4, 1, 257, 255), (5, 2, 2, 1000, 33), (2, 8, 4, 64, 256)]:
        step(b, h, hkv, lq, lk)
    assert len(tilelang_common._kernels) == before
    assert len(calls) == 5


def test_the_public_op_takes_the_fused_backward_at_pcvr_shapes(monkeypatch):
    monkeypatch.setattr(fa, "BACKWARD", None)  # use_fused's choice
    calls = record_fused(monkeypatch)
    q, k, v = make(256, 4, 4, 256, 256, 16, bf16, "blhd")
    assert fa.use_fused(q, k)
    key_lengths = lengths_for(256, 256)
    out = flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend="tilelang")
    dq, dk, dv = check(out, q, k, v, bf16, causal=True, key_lengths=key_lengths)
    assert calls == [1]
    assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dk[0], torch.zeros_like(dk[0]))
