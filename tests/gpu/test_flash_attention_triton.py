"""flash_attention's Triton backend on CUDA against the float64 reference: outputs and dq/dk/dv."""

import pytest
import torch

from runtime.accelerators import BackendUnavailableError, use_accelerators
from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.seeds import draw_seed_tensor
from runtime.accelerators.testing import RTOL, RTOL_ATTENTION_FP32, assert_close, compiled_kernels, gradient_tolerance

CUDA = "cuda"


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


def rtol_for(dtype):
    return RTOL_ATTENTION_FP32 if dtype == torch.float32 else RTOL[dtype]


def check(out, q, k, v, dtype, **ref_kwargs):
    ref = attention_float64(q, k, v, **ref_kwargs)
    assert out.dtype == q.dtype
    assert_close("o", out, ref, rtol_for(dtype))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, gradient_tolerance(dtype, rtol_for(dtype)))


# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout): each feature, head dim, dtype and odd length
# at least once, not the full product.
CASES = [
    (4, 4, 4, 256, 256, 16, False, None, torch.bfloat16, "blhd"),
    (2, 4, 4, 200, 200, 16, True, "random", torch.float16, "bhld"),
    (3, 8, 2, 63, 63, 32, True, None, torch.bfloat16, "bhld"),
    (2, 4, 1, 1000, 1000, 32, False, "random", torch.bfloat16, "blhd"),
    (2, 4, 4, 1000, 1000, 48, True, "random", torch.bfloat16, "bhld"),
    (3, 2, 2, 63, 200, 48, False, None, torch.float16, "bhld"),
    (2, 4, 2, 200, 63, 64, True, None, torch.bfloat16, "bhld"),
    (1, 2, 2, 1, 1000, 64, False, "random", torch.float16, "bhld"),
    (2, 4, 4, 1000, 1000, 128, True, None, torch.bfloat16, "blhd"),
    (2, 8, 4, 200, 1000, 128, False, "random", torch.float16, "bhld"),
    (2, 2, 1, 200, 63, 32, True, "random", torch.float32, "bhld"),
    (1, 2, 2, 1000, 1000, 128, False, None, torch.float32, "bhld"),
]


def _id(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout = case
    return (
        f"{b}x{h}/{hkv}x{lq}x{lk}-d{d}-{str(dtype).removeprefix('torch.')}"
        f"{'-causal' if causal else ''}{'-lengths' if lengths else ''}{'-view' if layout == 'blhd' else ''}"
    )


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_triton_against_float64(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    key_lengths = None
    if lengths:
        key_lengths = torch.randint(0, lk + 1, (b,), device=CUDA)
        key_lengths[0] = 0 if b > 1 else lk // 2 + 1  # one batch row without any key, when there are several
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend="triton")
    check(out, q, k, v, dtype, causal=causal, key_lengths=key_lengths)
    if key_lengths is not None and b > 1:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_scale_and_int32_lengths():
    q, k, v = make(2, 4, 4, 77, 90, 32, torch.bfloat16)
    key_lengths = torch.tensor([90, 41], device=CUDA, dtype=torch.int32)
    out = flash_attention(q, k, v, key_lengths=key_lengths, scale=0.05, backend="triton")
    check(out, q, k, v, torch.bfloat16, key_lengths=key_lengths, scale=0.05)


def _kernel_cache_sizes():
    from runtime.accelerators.flash_attention import triton as kernels

    names = ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_fused_kernel")
    sizes = {name: compiled_kernels(getattr(kernels, name)) for name in names}
    if None in sizes.values():
        pytest.skip("this Triton has no JITFunction.device_caches to count compiled kernels")
    return sizes


def test_one_compilation_serves_all_lengths_and_batches():
    def step(b, h, lq, lk):
        q, k, v = make(b, h, h, lq, lk, 32, torch.bfloat16)
        out = flash_attention(q, k, v, causal=True, backend="triton")
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    step(2, 4, 100, 100)
    before = _kernel_cache_sizes()
    for b, h, lq, lk in [(1, 4, 1, 1), (3, 4, 257, 300), (5, 2, 1000, 33), (2, 1, 64, 64)]:
        step(b, h, lq, lk)
    assert _kernel_cache_sizes() == before


def test_dropout_keep_rate_and_backward_consistency():
    from runtime.accelerators.flash_attention.dropout import keep_mask

    p, (b, h, hkv, lq, lk, d) = 0.2, (2, 4, 2, 300, 257, 64)
    q, k, v = make(b, h, hkv, lq, lk, d, torch.bfloat16)
    torch.manual_seed(11)
    out = flash_attention(q, k, v, causal=True, dropout_p=p, backend="triton")
    torch.manual_seed(11)
    seed = int(draw_seed_tensor(q.device))  # the draw flash_attention made
    torch.manual_seed(11)
    again = flash_attention(q, k, v, causal=True, dropout_p=p, backend="triton")
    assert torch.equal(out, again), "torch.manual_seed must repeat the dropout mask"
    keep = keep_mask(seed, b, h, lq, lk, p, q.device)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 0.005, f"keep rate {rate:.4f}, expected {1 - p}"
    # the same mask drives the forward and every gradient: a dropped position contributes nothing,
    # a kept one is scaled by 1 / (1 - p)
    check(out, q, k, v, torch.bfloat16, causal=True, keep=keep, dropout_p=p)


@pytest.mark.parametrize("backend", ["torch", "triton", "tilelang"])
def test_key_lengths_under_inference_mode(backend):
    q, k, v = (t.detach() for t in make(2, 4, 2, 70, 45, 64, torch.bfloat16, layout="blhd"))
    with torch.inference_mode(), use_accelerators(fallback="error"):
        key_lengths = torch.tensor([45, 17], device=CUDA)
        try:
            out = flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend=backend)
        except BackendUnavailableError as error:
            pytest.skip(str(error))
        assert_close(
            "o", out, attention_float64(q, k, v, causal=True, key_lengths=key_lengths), rtol_for(torch.bfloat16)
        )
        key_lengths.fill_(46)
        with pytest.raises(ValueError, match=r"key_lengths: expected values in \[0, 45\]"):
            flash_attention(q, k, v, key_lengths=key_lengths, backend=backend)
