"""flash_attention on packed (varlen) sequences on CUDA: the Triton and TileLang backends (forward and backward)
against float64 attention per sequence, every gradient; dropout against the rebuilt mask; one compiled kernel for
every packing; torch.compile."""

import warnings

import pytest
import torch

from runtime.accelerators import BackendFallbackWarning
from runtime.accelerators.flash_attention import dropout, flash_attention
from runtime.accelerators.flash_attention import triton as fa_triton
from runtime.accelerators.flash_attention.reference import attention_float64_varlen
from runtime.accelerators.seeds import draw_seed_tensor
from runtime.accelerators.testing import RTOL, RTOL_ATTENTION_FP32, assert_close, compiled_kernels, gradient_tolerance

CUDA = "cuda"


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)


def packed(lengths_q, lengths_k, h, hkv, d, dtype, requires_grad=True):
    q = torch.randn(sum(lengths_q), h, d, device=CUDA, dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, d, device=CUDA, dtype=dtype)
    v = torch.randn(sum(lengths_k), hkv, d, device=CUDA, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)] + [offsets(lengths_q), offsets(lengths_k)]


def rtol_for(dtype):
    return RTOL_ATTENTION_FP32 if dtype == torch.float32 else RTOL[dtype]


def check(out, q, k, v, cu_q, cu_k, dtype, gradients=True, **ref_kwargs):
    ref = attention_float64_varlen(q, k, v, cu_q, cu_k, **ref_kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("o", out, ref, rtol_for(dtype))
    if not gradients:
        return
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref, x in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.dtype == x.dtype
        assert_close(name, g, g_ref, gradient_tolerance(dtype, rtol_for(dtype)))


# (query lengths, key lengths or None (the same), H, Hkv, D, causal, dtype): lengths 0, 1, odd and up to 2048, each
# head dim and dtype, GQA and cross attention at least once, not the full product.
CASES = [
    ([0, 1, 63, 200, 2048], None, 4, 2, 32, True, torch.bfloat16),
    ([37, 0, 1000, 1], [5, 300, 0, 999], 4, 1, 64, False, torch.float16),
    ([200, 1, 513, 0], None, 4, 4, 48, True, torch.bfloat16),
    ([1000, 0, 77], [63, 1, 1000], 8, 2, 128, True, torch.float16),
    ([63, 200, 1], None, 2, 1, 16, False, torch.float32),
]


def case_id(case):
    lengths_q, lengths_k, h, hkv, d, causal, dtype = case
    cross = "" if lengths_k is None else "-cross"
    return f"N{len(lengths_q)}-max{max(lengths_q)}{cross}-h{h}kv{hkv}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton(case):
    lengths_q, lengths_k, h, hkv, d, causal, dtype = case
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k or lengths_q, h, hkv, d, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton")
    check(out, q, k, v, cu_q, cu_k, dtype, causal=causal)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_max_seqlen_given_and_strided_views(backend):
    """q/k/v as slices of one [total, 3, H, D] projection, max_seqlen given (no host read) and larger than needed."""
    lengths = [300, 0, 1, 777]
    cu = offsets(lengths)
    qkv = torch.randn(sum(lengths), 3, 4, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        out = flash_attention(
            q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=800, backend=backend
        )
    check(out, q, k, v, cu, cu, torch.bfloat16, causal=True)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_dropout_matches_the_padded_batch_mask(backend):
    """Both backends drop element (s, h, i, j) of the padded batch's mask, forward and backward."""
    p, lengths_q, lengths_k = 0.2, [130, 1, 0, 257], [64, 0, 9, 300]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 32, torch.float16)
    torch.manual_seed(5)
    out = flash_attention(q, k, v, causal=True, dropout_p=p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)
    torch.manual_seed(5)
    seed = int(draw_seed_tensor(q.device))  # the draw flash_attention makes
    keeps = dropout.varlen_keep_masks(seed, cu_q, cu_k, 4, p, CUDA)
    check(
        out,
        q,
        k,
        v,
        cu_q,
        cu_k,
        torch.float16,
        causal=True,
        keeps=keeps,
        dropout_p=dropout.drop_rate(p),
    )


# TileLang, forward and backward: each head dim once (D=16 adds dq by TMA reductions in the plain loop, the others by
# bulk reductions in the overlapped one; D=48 reads a transposed K), GQA, MQA and cross attention, causal and not
TILELANG_CASES = [
    ([0, 1, 63, 200, 2048], [5, 0, 63, 300, 2048], 4, 2, 64, True, torch.bfloat16),
    ([37, 0, 1000, 1], None, 4, 4, 128, False, torch.float16),
    ([1, 0, 129, 513, 0], None, 8, 2, 32, True, torch.bfloat16),
    ([200, 1, 513, 0], None, 4, 1, 16, False, torch.float16),
    ([1000, 0, 77], [63, 1, 1000], 4, 2, 48, True, torch.bfloat16),
]


@pytest.mark.parametrize("case", TILELANG_CASES, ids=case_id)
def test_tilelang(case):
    lengths_q, lengths_k, h, hkv, d, causal, dtype = case
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k or lengths_q, h, hkv, d, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendFallbackWarning)
        out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="tilelang")
    check(out, q, k, v, cu_q, cu_k, dtype, causal=causal)


def test_tilelang_forward_without_gradients():
    q, k, v, cu_q, cu_k = packed([37, 0, 1000, 1], [37, 0, 1000, 1], 4, 4, 128, torch.float16, requires_grad=False)
    out = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="tilelang")
    check(out, q, k, v, cu_q, cu_k, torch.float16, gradients=False)


def test_tilelang_one_compiled_kernel_serves_every_packing():
    from runtime.accelerators import tilelang_common

    def run(lengths):
        q, k, v, cu_q, cu_k = packed(lengths, lengths, 4, 2, 32, torch.bfloat16)
        out = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="tilelang")
        out.sum().backward()

    run([100, 3, 700])
    before = set(tilelang_common._kernels)
    run([1, 1500, 0, 33, 257])
    assert set(tilelang_common._kernels) == before


def test_triton_one_compiled_kernel_serves_every_packing():
    def run(lengths):
        q, k, v, cu_q, cu_k = packed(lengths, lengths, 4, 2, 32, torch.bfloat16)
        flash_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="triton").sum().backward()

    run([100, 3, 700])
    kernels = [fa_triton._fwd_kernel, fa_triton._bwd_dq_kernel, fa_triton._bwd_dkdv_kernel]
    before = [compiled_kernels(kernel) for kernel in kernels]
    if None in before:
        pytest.skip("this Triton keeps no count of its compiled kernels")
    run([1, 1500, 0, 33, 257])
    assert [compiled_kernels(kernel) for kernel in kernels] == before


def test_compiled_full_graph():
    """torch.compile(fullgraph=True) on non-contiguous packed views: the same output and gradients as eager."""
    lengths = [63, 0, 500, 1]
    cu = offsets(lengths)

    def attention(qkv):
        q, k, v = qkv.unbind(1)
        return flash_attention(
            q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=500, max_seqlen_k=500, backend="triton"
        )

    qkv = torch.randn(sum(lengths), 3, 4, 32, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(attention, fullgraph=True)
    out = compiled(qkv)
    do = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, do)
    eager = attention(qkv)
    (grad_eager,) = torch.autograd.grad(eager, qkv, do)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(grad, grad_eager, rtol=0, atol=0)
