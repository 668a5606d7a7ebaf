"""flash_attention's TileLang backend on CUDA against the float64 reference: outputs and dq/dk/dv.

Few specialisations (head dim, dtype, causal, key_lengths, dropout) so compilation stays short;
they are compiled in parallel before the first test.
"""

import pytest
import torch

from runtime.accelerators import BackendUnavailableError, use_accelerators
from runtime.accelerators.flash_attention import dropout, flash_attention
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.seeds import draw_seed_tensor
from runtime.accelerators.testing import RTOL, assert_close, deterministic_algorithms, gradient_tolerance

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
    (3, 4, 4, 300, 130, 128, False, True, f16, "bhld"),
    # the tokenformer model's attention (batch 256, 257 tokens, 4 heads of 16, causal + key_lengths, bf16 views):
    # its TileLang backward gave non-finite gradients in a training run (docs/benchmark/training.md)
    (256, 4, 4, 257, 257, 16, True, True, bf16, "blhd"),
]
DROPOUT_SPEC = (64, bf16, False, False, True)
SPECS = sorted({(c[5], c[8], c[6], c[7], False) for c in CASES} | {DROPOUT_SPEC}, key=str)


@pytest.fixture(scope="module", autouse=True)
def _compiled_in_parallel():
    fa.warm_up(SPECS, torch.device(CUDA))


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


def test_auto_takes_tilelang_at_head_dim_128():
    # the faster backend there on Hopper (input_priority in runtime.accelerators.flash_attention) in the static order
    # (without measuring); the autograd node names the backend that ran (its outputs can equal Triton's to the bit)
    with use_accelerators(autotune=False):
        q, k, v = make(1, 4, 2, 200, 1000, 128, bf16, "blhd")
        out = flash_attention(q, k, v, causal=True)
        assert type(out.grad_fn).__name__ == "flash_attention_forward_tilelangBackward"
        check(out, q, k, v, bf16, causal=True)
        q, k, v = make(1, 4, 2, 200, 1000, 64, bf16)
        assert type(flash_attention(q, k, v).grad_fn).__name__ == "flash_attention_forward_tritonBackward"


def test_deterministic_algorithms_take_triton_and_repeat_the_gradients():
    """Under torch.use_deterministic_algorithms a differentiated call leaves tilelang (its dq reductions have no fixed
    order) for triton, whose gradients repeat bit for bit; a call without gradients may still take tilelang."""
    q, k, v = make(2, 4, 2, 300, 1000, 128, bf16)
    with deterministic_algorithms():
        out = flash_attention(q, k, v, causal=True)
        assert type(out.grad_fn).__name__ == "flash_attention_forward_tritonBackward"
        do = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), do)
        for _ in range(3):
            again = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
        with use_accelerators(fallback="error"):
            with pytest.raises(BackendUnavailableError, match="deterministic algorithms are on"):
                flash_attention(q, k, v, backend="tilelang")
            with torch.no_grad():
                flash_attention(q, k, v, backend="tilelang")


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
    seed = int(draw_seed_tensor(q.device))  # the draw flash_attention made
    torch.manual_seed(11)
    again = flash_attention(q, k, v, dropout_p=p, backend="tilelang")
    assert torch.equal(out, again), "torch.manual_seed must repeat the dropout mask"
    keep = dropout.keep_mask(seed, b, h, lq, lk, p, q.device)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 0.005, f"keep rate {rate:.4f}, expected {1 - p}"
    # the kernels draw exactly this mask in the forward and in every gradient: a dropped position
    # contributes nothing, a kept one is scaled by 1 / (1 - p)
    check(out, q, k, v, bf16, keep=keep, dropout_p=p)


# both backward loops (BwdConfig.overlap with bulk dq reductions, the D >= 64 default; the plain loop with TMA
# reductions, the smaller heads' default) at head dims 48 (K transposed for dQ), 64 and 128: the same checks on ragged
# lengths (not multiples of the blocks or of the accumulator's 8-row sub-tiles), GQA, views, key_lengths, causal and
# dropout
VARIANTS = {
    "ovl-bulk": {"overlap": True, "dq": "bulk"},
    "plain-tma": {"overlap": False, "dq": "tma"},
}
VARIANT_CASES = [  # (B, H, Hkv, Lq, Lk, D, causal, lengths, dropout_p, layout)
    (2, 4, 2, 997, 203, 128, True, True, 0.0, "blhd"),
    (2, 4, 2, 300, 257, 64, False, False, 0.2, "bhld"),
    (2, 2, 1, 130, 517, 48, True, True, 0.1, "blhd"),
]


@pytest.fixture(scope="module")
def _variants_compiled():
    from dataclasses import replace

    from runtime.accelerators.tilelang_common import precompile

    entries = [
        fa.backward_entry(c[5], bf16, c[6], c[7], c[8] > 0, replace(fa.BWD_CONFIGS[c[5]], **fields))
        for fields in VARIANTS.values()
        for c in VARIANT_CASES
    ]
    entries += [fa.forward_entry(c[5], bf16, c[6], c[7], c[8] > 0) for c in VARIANT_CASES]
    precompile(entries, torch.device(CUDA))


@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: f"d{c[5]}")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backward_variants_against_float64(variant, case, _variants_compiled):
    """Each variant passed to the backward launcher the op runs (its cfg), after the forward the op runs."""
    from dataclasses import replace

    b, h, hkv, lq, lk, d, causal, lengths, p, layout = case
    cfg = replace(fa.BWD_CONFIGS[d], **VARIANTS[variant])
    q, k, v = make(b, h, hkv, lq, lk, d, bf16, layout)
    key_lengths = None
    if lengths:  # a batch row without any key
        key_lengths = torch.tensor([0, lk // 2 + 1], device=CUDA, dtype=torch.int32)
    torch.manual_seed(5)
    seed = draw_seed_tensor(q.device) if p > 0 else None  # the draw flash_attention makes
    args = (q, k, v, key_lengths, causal, d**-0.5, p, seed)
    with torch.no_grad():
        o, lse = fa.forward(*args)
        do = torch.randn_like(o)
        dq, dk, dv = fa.backward(do, *args, o, lse, cfg=cfg)[:3]
    keep = dropout.keep_mask(int(seed), b, h, lq, lk, p, q.device) if p > 0 else None
    extra = {"keep": keep, "dropout_p": p} if p > 0 else {}
    ref = attention_float64(q, k, v, causal=causal, key_lengths=key_lengths, **extra)
    assert o.dtype == q.dtype
    assert_close("o", o, ref, RTOL[bf16])
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref, (q, k, v)):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, gradient_tolerance(bf16))
    if lengths:
        assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.equal(dk[0], torch.zeros_like(dk[0]))
    assert dq.stride() == torch.empty_like(q).stride()
