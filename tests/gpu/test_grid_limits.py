"""Launches past CUDA's gridDim.y / gridDim.z limit of 65535 blocks: inputs whose (batch, head) pairs, sequences or row
blocks number more than 65535, each against a float64 reference on a few rows, forward and every gradient.

The kernels put those counts on x (up to 2^31 - 1 blocks); before, such a launch failed with an invalid-argument
error. The inputs are small (well under 2 GB each) apart from linear's 8.4M rows.
"""

import pytest
import torch
import torch.nn.functional as F

from runtime.accelerators import flash_attention, linear, silu_attention, use_accelerators
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.silu_attention.reference import silu_attention_reference
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

DEVICE = "cuda"
BF16 = torch.bfloat16
MAX_GRID_YZ = 65535

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _kernels_or_error():
    """No silent fallback to the torch reference: a backend that cannot run raises."""
    with use_accelerators(fallback="error"):
        yield
    torch.cuda.empty_cache()


def picked(n: int, total: int) -> torch.Tensor:
    """The first and the last n of range(total)."""
    return torch.cat([torch.arange(n), torch.arange(total - n, total)]).to(DEVICE)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attention_with_more_than_65535_batch_heads(causal, backend):
    """B x H = 70002 pairs (and B x Hkv = 35001 with GQA), 2 query blocks each: forward and backward (Triton: the
    fused backward, one key block); the first and the last batch rows against float64."""
    b, h, hkv, length, d = 35001, 2, 1, 80, 16
    q = torch.randn(b, h, length, d, device=DEVICE, dtype=BF16, requires_grad=True)
    k = torch.randn(b, hkv, length, d, device=DEVICE, dtype=BF16, requires_grad=True)
    v = torch.randn(b, hkv, length, d, device=DEVICE, dtype=BF16, requires_grad=True)
    out = flash_attention(q, k, v, causal=causal, backend=backend)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rows = picked(3, b)
    q64, k64, v64 = (t.detach()[rows].double().requires_grad_() for t in (q, k, v))
    ref = attention_float64(q64, k64, v64, causal=causal)
    grads_ref = torch.autograd.grad(ref, (q64, k64, v64), dout[rows].double())
    assert_close("attention out", out[rows], ref, RTOL[BF16])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(f"attention {name}", g[rows], g_ref, gradient_tolerance(BF16))


def test_flash_attention_triton_split_backward_with_more_than_65535_batch_heads():
    """Keys in several blocks (the dq and dk/dv kernels, not the fused one) over B x H = 66000 pairs."""
    b, h, length, d = 33000, 2, 300, 16
    q, k, v = (torch.randn(b, h, length, d, device=DEVICE, dtype=BF16, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, backend="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rows = picked(2, b)
    q64, k64, v64 = (t.detach()[rows].double().requires_grad_() for t in (q, k, v))
    ref = attention_float64(q64, k64, v64)
    grads_ref = torch.autograd.grad(ref, (q64, k64, v64), dout[rows].double())
    assert_close("attention out", out[rows], ref, RTOL[BF16])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(f"attention {name}", g[rows], g_ref, gradient_tolerance(BF16))


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_packed_flash_attention_with_more_than_65535_sequences(backend):
    """70001 packed sequences of 1-5 tokens, 2 heads (one kv head), causal: output and dq/dk/dv of the first and the
    last sequences against float64, each sequence alone."""
    n, h, hkv, d = 70001, 2, 1, 32
    lengths = torch.randint(1, 6, (n,), generator=torch.Generator().manual_seed(1))
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total, max_len = int(cu[-1]), int(lengths.max())
    q = torch.randn(total, h, d, device=DEVICE, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(total, hkv, d, device=DEVICE, dtype=BF16, requires_grad=True) for _ in range(2))
    cu_dev = cu.to(DEVICE)
    out = flash_attention(
        q, k, v, causal=True, cu_seqlens_q=cu_dev, cu_seqlens_k=cu_dev, max_seqlen_q=max_len, max_seqlen_k=max_len,
        backend=backend,
    )  # fmt: skip
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for s in (0, 1, n - 2, n - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        seq = [t.detach()[lo:hi].double().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v)]
        ref = attention_float64(*seq, causal=True)  # [1, H, L, D]
        grads_ref = torch.autograd.grad(ref, seq, dout[lo:hi].double().transpose(0, 1).unsqueeze(0))
        assert_close("attention out", out[lo:hi], ref[0].transpose(0, 1), RTOL[BF16])
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert_close(f"attention {name}", g[lo:hi], g_ref[0].transpose(0, 1), gradient_tolerance(BF16))


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_silu_attention_with_more_than_65535_sequences(backend):
    """70001 packed sequences of 1-5 tokens, 2 heads, position bias: output and dq/dk/dv of the first and last
    sequences against float64 (the sequences are independent); the position-bias gradient runs, finite."""
    n, h, d = 70001, 2, 32
    lengths = torch.randint(1, 6, (n,), generator=torch.Generator().manual_seed(0))
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total, max_len = int(cu[-1]), int(lengths.max())
    q, k, v = (torch.randn(total, h, d, device=DEVICE, dtype=BF16, requires_grad=True) for _ in range(3))
    pos = torch.randn(h, max_len, device=DEVICE, dtype=torch.float32, requires_grad=True)
    cu_dev = cu.to(DEVICE)
    out = silu_attention(q, k, v, cu_dev, max_seqlen=max_len, position_bias=pos, backend=backend)
    dout = torch.randn_like(out)
    *grads, dpos = torch.autograd.grad(out, (q, k, v, pos), dout)
    assert torch.isfinite(dpos).all()  # the bias sums ran over every sequence (not compared here)
    for first, last in ((0, 3), (n - 3, n)):  # sequences [first, last): their rows and offsets from 0
        lo, hi = int(cu[first]), int(cu[last])
        sub = [t.detach()[lo:hi].double().requires_grad_() for t in (q, k, v)]
        pos64 = pos.detach().double()
        ref = silu_attention_reference(
            *sub, (cu[first : last + 1] - lo).to(DEVICE), max_seqlen=max_len, position_bias=pos64
        )
        grads_ref = torch.autograd.grad(ref, sub, dout[lo:hi].double())
        assert_close("silu_attention out", out[lo:hi], ref, RTOL[BF16])
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert_close(f"silu_attention {name}", g[lo:hi], g_ref, gradient_tolerance(BF16))


def test_linear_tilelang_with_more_than_65535_row_blocks():
    """M = 8.4M rows: 65537 row blocks of 128 in the forward (gelu, bias); the first and the last rows of y against
    float64, and dx there (the backward's elementwise kernel covers all rows in few groups)."""
    m, k, n = 65537 * 128 - 5, 64, 128
    x = torch.randn(m, k, device=DEVICE, dtype=BF16, requires_grad=True)
    w = torch.randn(n, k, device=DEVICE, dtype=BF16, requires_grad=True) / 8
    bias = torch.randn(n, device=DEVICE, dtype=BF16, requires_grad=True)
    y = linear(x, w, bias, activation="gelu", backend="tilelang")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    rows = picked(300, m)
    x64 = x.detach()[rows].double().requires_grad_()
    ref = F.gelu(x64 @ w.detach().double().T + bias.detach().double())
    (dx_ref,) = torch.autograd.grad(ref, x64, dy[rows].double())
    assert_close("linear y", y[rows], ref, RTOL[BF16])
    assert_close("linear dx", dx[rows], dx_ref, gradient_tolerance(BF16))
