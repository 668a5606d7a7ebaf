"""The Triton flash attention's forward variants (FwdConfig: TMA descriptor loads, heavy-first causal order) on CUDA
against the float64 reference, each forced at a few shapes whatever the tables say, and the tables' own TMA entries
through the public API."""

import pytest
import torch

from runtime.accelerators.flash_attention import flash_attention
from runtime.accelerators.flash_attention import triton as fa
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

CUDA = "cuda"
Fwd = fa.FwdConfig


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


needs_tma = pytest.mark.skipif(not hopper(), reason="TMA descriptors need CUDA capability >= 9.0")


def make(b, h, hkv, lq, lk, d, dtype, layout):
    """q [B,H,Lq,D], k/v [B,Hkv,Lk,D]; layout "blhd" gives x.view(B, L, H, D).transpose(1, 2) views."""
    if layout == "blhd":
        shapes = [(b, lq, h, d), (b, lk, hkv, d), (b, lk, hkv, d)]
        return [torch.randn(s, device=CUDA, dtype=dtype).transpose(1, 2) for s in shapes]
    return [torch.randn(s, device=CUDA, dtype=dtype) for s in [(b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, d)]]


def lengths_for(b, lk):
    key_lengths = torch.randint(0, lk + 1, (b,), device=CUDA, dtype=torch.int32)
    key_lengths[0] = 0 if b > 1 else lk // 2 + 1
    return key_lengths


# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout, config)
CASES = [
    (2, 4, 2, 1000, 1000, 128, True, True, torch.bfloat16, "blhd", Fwd(128, 128, 8, 3, tma=True, heavy_first=True)),
    (3, 2, 2, 63, 200, 48, False, True, torch.bfloat16, "bhld", Fwd(128, 64, 8, 4, tma=True)),
    (2, 8, 4, 200, 1000, 32, False, False, torch.float16, "blhd", Fwd(64, 64, 4, 3, tma=True)),
    (2, 4, 4, 1000, 1000, 128, True, False, torch.bfloat16, "bhld", Fwd(128, 64, 8, 3, tma=True, heavy_first=True)),
]
IDS = ["d128-causal-lengths-gqa-view-heavy", "d48-lengths-lq<lk", "d32-fp16-gqa-view", "d128-causal-n64-heavy"]


@needs_tma
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tma_forward(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout, cfg = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    key_lengths = lengths_for(b, lk) if lengths else None
    expected = attention_float64(q, k, v, causal=causal, key_lengths=key_lengths)
    if key_lengths is not None:  # keys past a length are never read: NaN there changes nothing
        for i, n in enumerate(key_lengths.tolist()):
            k[i, :, n:], v[i, :, n:] = float("nan"), float("nan")
    assert fa.forward_variant(q, k, v, causal, cfg)[1]["TMA"]
    o, lse = fa.forward(q, k, v, key_lengths, causal, d**-0.5, 0.0, 0, cfg=cfg)
    assert_close("o", o, expected, RTOL[dtype])
    o_ptr, lse_ptr = fa.forward(q, k, v, key_lengths, causal, d**-0.5, 0.0, 0, cfg=cfg, tma=False)
    assert_close("lse against the pointer path", lse.nan_to_num(posinf=0.0), lse_ptr.nan_to_num(posinf=0.0), 1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ptr))


def test_heavy_first_pointer_forward():
    q, k, v = make(2, 4, 4, 1000, 1000, 64, torch.bfloat16, "bhld")
    o, _ = fa.forward(q, k, v, None, True, 0.125, 0.0, 0, cfg=Fwd(128, 64, 8, 4, heavy_first=True), tma=False)
    assert_close("o", o, attention_float64(q, k, v, causal=True), RTOL[torch.bfloat16])


@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (64, False), (48, False)])
def test_table_variant_through_the_public_api(d, causal):
    """The tables' TMA entries (as shipped) serve flash_attention on Hopper; the backward reads their lse."""
    assert fa.config("fwd_causal" if causal else "fwd", d, torch.bfloat16).tma
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 300, 300, d, torch.bfloat16, "blhd"))
    assert fa.forward_variant(q, k, v, causal)[1]["TMA"] == hopper()
    out = flash_attention(q, k, v, causal=causal, backend="triton")
    ref = attention_float64(q, k, v, causal=causal)
    assert_close("o", out, ref, RTOL[torch.bfloat16])
    do = torch.randn_like(out)
    grads, grads_ref = torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))
