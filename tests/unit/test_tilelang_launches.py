"""Every TileLang launch of every op passes what its kernel's signature declares (dtypes, ranks, sizes, strides,
scalars, the argument count): the public ops run their tilelang path on CPU tensors with the checking launcher of
tilelang_launch_check (nothing runs; a mismatch is refused only on the GPU otherwise), forward and backward, in bf16
and fp16 (fp32 where the kernels take it), with and without their optional inputs, packed (varlen) where they have it.

Launch plans are the H100's (its SM count: rows split into segments where the GPU would split them). Outputs are
garbage (no kernel writes them): a path that reads a kernel's result on the host would go wrong here, and none of these
does (embedding_bag_mean's sparse gradient reads a count on the host, but from the sorted indices, not from a kernel).
Not covered here: gated_delta_rule's context-parallel split, which the public op takes on CUDA devices alone (its
occupancy rule); test_gated_delta_rule_tilelang.py checks it with the split forced, and the chunked forward and
backward of fixed-length sequences at K = 64.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import op_cases
import runtime.accelerators as acc
from tilelang_launch_check import kernels_on_cpu

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
HALF = (bf16, f16)
ALL = (bf16, f16, f32)


def leaf(*shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape)).to(dtype).requires_grad_()


# --------------------------------------------------------------------------- cases: fn(dtype) -> outputs


def norm(op, width, params, dtype, param_dtype=None):
    x = leaf(6, 3, width, dtype=dtype)
    ps = [leaf(width, dtype=param_dtype or dtype) for _ in range(params)]
    return getattr(acc, op)(x, *ps, backend="tilelang")


def add_norm(op, width, params, dtype, param_dtype=None):
    x, residual = leaf(6, 3, width, dtype=dtype), leaf(6, 3, width, dtype=dtype)
    ps = [leaf(width, dtype=param_dtype or dtype) for _ in range(params)]
    return getattr(acc, op)(x, residual, *ps, backend="tilelang")


def l2norm(width, dtype):
    return acc.l2norm(leaf(6, 3, width, dtype=dtype), backend="tilelang")


def activation(name, dtype):
    x = leaf(5, 37, dtype=dtype)
    if name == "silu":
        return acc.silu(x, backend="tilelang")
    return acc.gelu(x, name.removeprefix("gelu-"), backend="tilelang")


def swiglu(dtype):
    gate_up = leaf(5, 2, 37, dtype=dtype)
    return acc.swiglu(*gate_up.unbind(1), backend="tilelang")


def dropout_add(p, training, dtype):
    x, residual = leaf(5, 37, dtype=dtype), leaf(5, 37, dtype=dtype)
    return acc.dropout_add(x, residual, p, training, backend="tilelang")


def bce(reduction, weighted, dtype):
    logits, targets = leaf(7, 10, dtype=dtype), torch.rand(7, 10).to(dtype)
    weight = torch.rand(10).to(dtype) if weighted else None
    pos_weight = torch.rand(10).to(dtype) if weighted else None
    return acc.binary_cross_entropy_with_logits(logits, targets, weight, pos_weight, reduction, backend="tilelang")


def bce_large(reduction, weighted, summed, dtype):
    """Past GRAD_IN_FORWARD_MAX_NUMEL logits: the backward kernel (smaller inputs get their gradient from the
    forward); summed: the gradient of reduction="none" is one value everywhere (loss.sum())."""
    n = acc.bce_with_logits.GRAD_IN_FORWARD_MAX_NUMEL // 128 + 1
    logits, targets = leaf(n, 128, dtype=dtype), torch.rand(n, 128).to(dtype)
    weight = torch.rand(n, 1).to(dtype) if weighted else None
    pos_weight = torch.rand(128).to(dtype) if weighted else None
    loss = acc.binary_cross_entropy_with_logits(logits, targets, weight, pos_weight, reduction, backend="tilelang")
    return loss.sum() if summed else loss


def bce_targets_requiring_grad(dtype):
    logits, targets = leaf(7, 10, dtype=dtype), torch.rand(7, 10).to(dtype).requires_grad_()
    return acc.binary_cross_entropy_with_logits(logits, targets, backend="tilelang")


def embedding_bag(layout, dim, dtype):
    weight = leaf(40, dim, dtype=dtype)
    if layout == "fixed":  # 60 indices: two chunks of the gradient's first pass, and the pass combining them
        return acc.embedding_bag_mean(weight, torch.randint(0, 40, (20, 3)), backend="tilelang")
    if layout == "sparse":
        return acc.embedding_bag_mean(weight, torch.randint(0, 40, (6, 3)), sparse=True, backend="tilelang")
    indices, offsets = torch.randint(0, 40, (13,)), torch.tensor([0, 3, 3, 9, 13])
    if layout == "offsets-last":
        return acc.embedding_bag_mean(weight, indices, offsets, include_last_offset=True, backend="tilelang")
    return acc.embedding_bag_mean(weight, indices, offsets[:-1], padding_idx=2, backend="tilelang")


def flash_attention(d, causal, lengths, gqa, dropout, dtype):
    b, h, lq, lk = 2, 4, 70, 45
    hkv = 2 if gqa else h
    q, k, v = leaf(b, h, lq, d, dtype=dtype), leaf(b, hkv, lk, d, dtype=dtype), leaf(b, hkv, lk, d, dtype=dtype)
    key_lengths = torch.tensor([45, 17], dtype=torch.int32) if lengths else None
    return acc.flash_attention(
        q, k, v, causal=causal, key_lengths=key_lengths, dropout_p=0.1 if dropout else 0.0, backend="tilelang"
    )


def flash_attention_strided(dtype):
    """q, k, v unbound from one fused projection (non-contiguous views), as models make them."""
    b, lq, h, d = 2, 33, 4, 32
    x = leaf(b, lq, 3 * h * d, dtype=dtype)
    q, k, v = (t.transpose(1, 2) for t in x.view(b, lq, 3, h, d).unbind(2))
    return acc.flash_attention(q, k, v, causal=True, backend="tilelang")


def flash_attention_varlen(d, causal, gqa, dropout, dtype):
    h = 4
    hkv = 2 if gqa else h
    cu_q = torch.tensor([0, 30, 30, 101], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 41, 90], dtype=torch.int32)
    q, k, v = leaf(101, h, d, dtype=dtype), leaf(90, hkv, d, dtype=dtype), leaf(90, hkv, d, dtype=dtype)
    return acc.flash_attention(
        q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=71, max_seqlen_k=49,
        dropout_p=0.1 if dropout else 0.0, backend="tilelang",
    )  # fmt: skip


def mhc(n, dtype):
    b, s, c = 2, 3, 40
    m = n * n + 2 * n
    x = leaf(b, s, n, c, dtype=dtype)
    phi, alpha, bias = leaf(n * c, m, dtype=f32, scale=0.05), leaf(3, dtype=f32), leaf(m, dtype=f32, scale=0.3)
    h_in, h_post, h_res = acc.mhc_pre(x, phi, alpha, bias, backend="tilelang")
    y = leaf(b, s, c, dtype=dtype)
    return h_in, h_post, h_res, acc.mhc_post(x, y, h_post, h_res, backend="tilelang")


def linear(activation, bias, dtype):
    n = 48 if activation == "swiglu" else 24
    x, weight = leaf(5, 3, 40, dtype=dtype), leaf(n, 40, dtype=dtype, scale=0.2)
    b = leaf(n, dtype=dtype) if bias else None
    return acc.linear(x, weight, b, activation, backend="tilelang")


def silu_attention(d, variant, dtype):
    total, h = 47, 2
    cu = torch.tensor([0, 12, 12, 47], dtype=torch.int32)
    q, k, v = (leaf(total, h, d, dtype=dtype) for _ in range(3))
    extra = {}
    if variant == "biases":
        extra = dict(
            position_bias=leaf(36, dtype=f32),
            time_bias=leaf(h, 12, dtype=f32),
            timestamps=torch.arange(total) * 37,
            alpha=0.5,
        )
    elif variant == "targets-dropout":
        extra = dict(num_targets=torch.tensor([2, 0, 5], dtype=torch.int32), dropout_p=0.1)
    elif variant == "not-causal":
        extra = dict(causal=False, position_bias=leaf(h, 36, dtype=f32))
    return acc.silu_attention(q, k, v, cu, max_seqlen=35, backend="tilelang", **extra)


def top_k(n, k, largest, dtype, rows=3):
    """n = 40000 over 3 rows: each row split into two segments (the H100's plan), then their candidates selected; one
    16M row at k = 2048: 264 segments, then their candidates in rounds of 33, 4 and 1 segments."""
    scores = torch.randn(rows, n).to(dtype)
    return acc.top_k(scores, k, largest=largest, backend="tilelang")


def sample(n, top_k, dtype, rows=3):
    logits = torch.randn(rows, n).to(dtype)
    return acc.sample(logits, temperature=0.7, top_k=top_k, top_p=0.9, backend="tilelang")


def gated_delta_rule(mode, varlen, dtype):
    b, t, h, hv, k, v = 2, 70, 1, 2, 32, 32
    q, kk = leaf(b, t, h, k, dtype=dtype), leaf(b, t, h, k, dtype=dtype)
    vv, beta = leaf(b, t, hv, v, dtype=dtype), torch.rand(b, t, hv).to(dtype).requires_grad_()
    g = F.logsigmoid(torch.randn(b, t, hv)).to(dtype).requires_grad_()
    state = leaf(b, hv, k, v, dtype=f32)
    cu = None
    if varlen:
        q, kk, vv, g, beta = (x.detach().flatten(0, 1)[None].requires_grad_() for x in (q, kk, vv, g, beta))
        cu, state = torch.tensor([0, 30, 30, 140]), leaf(3, hv, k, v, dtype=f32)
    if mode == "recurrent":
        for x in (q, kk, vv, g, beta, state):
            x.requires_grad_(False)
        function = acc.fused_recurrent_gated_delta_rule
    else:
        function = acc.chunk_gated_delta_rule
    return function(
        q, kk, vv, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu, backend="tilelang",
    )  # fmt: skip


def layer_norm_mixed(dtype):
    """A weight in x's dtype beside an fp32 bias: their gradients reduced together through fp32."""
    x, weight, bias = leaf(6, 3, 200, dtype=dtype), leaf(200, dtype=dtype), leaf(200, dtype=f32)
    return acc.layer_norm(x, weight, bias, backend="tilelang")


def add_layer_norm_mixed(dtype):
    x, residual, weight, bias = leaf(6, 200, dtype=dtype), leaf(6, 200, dtype=dtype), leaf(200, dtype=f32), None
    return acc.add_layer_norm(x, residual, weight, bias, backend="tilelang")


def bce_mixed(large, dtype):
    """fp32 targets, weight and pos_weight beside logits in `dtype`."""
    n = acc.bce_with_logits.GRAD_IN_FORWARD_MAX_NUMEL // 16 + 1 if large else 7
    logits, targets = leaf(n, 16, dtype=dtype), torch.rand(n, 16)
    return acc.binary_cross_entropy_with_logits(
        logits, targets, torch.rand(n, 16), torch.rand(16), "mean", backend="tilelang"
    )


def embedding_bag_int32(dtype):
    weight, indices, offsets = leaf(40, 16, dtype=dtype), torch.randint(0, 40, (50,), dtype=torch.int32), None
    offsets = torch.tensor([0, 3, 3, 40], dtype=torch.int32)
    return acc.embedding_bag_mean(weight, indices, offsets, backend="tilelang")


def flash_attention_int64_lengths(dtype):
    q, k, v = leaf(2, 2, 40, 64, dtype=dtype), leaf(2, 2, 50, 64, dtype=dtype), leaf(2, 2, 50, 64, dtype=dtype)
    return acc.flash_attention(q, k, v, key_lengths=torch.tensor([50, 3]), backend="tilelang")


def mhc_params_in(param_dtype, dtype):
    """phi, alpha and bias in param_dtype (fp32 in mhc())."""
    n, c = 4, 32
    m = n * n + 2 * n
    x, y = leaf(5, n, c, dtype=dtype), leaf(5, c, dtype=dtype)
    phi = leaf(n * c, m, dtype=param_dtype, scale=0.05)
    alpha, bias = leaf(3, dtype=param_dtype), leaf(m, dtype=param_dtype, scale=0.3)
    h_in, h_post, h_res = acc.mhc_pre(x, phi, alpha, bias, backend="tilelang")
    return h_in, h_post, h_res, acc.mhc_post(x, y, h_post, h_res, backend="tilelang")


def silu_attention_biases_in(dtype):
    """Biases in q's dtype, int32 timestamps and int64 num_targets."""
    total, h, d = 30, 2, 32
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    q, k, v = (leaf(total, h, d, dtype=dtype) for _ in range(3))
    return acc.silu_attention(
        q, k, v, cu, max_seqlen=20, position_bias=leaf(20, dtype=dtype), time_bias=leaf(8, dtype=dtype),
        timestamps=torch.arange(total, dtype=torch.int32) * 5, num_targets=torch.tensor([1, 3]), backend="tilelang",
    )  # fmt: skip


def autocast(op, dtype):
    """fp32 inputs under autocast to `dtype` (on the CPU: the ops cast for their inputs' device type)."""
    with torch.autocast("cpu", dtype=dtype):
        if op == "linear":
            x, weight, bias = leaf(7, 32, dtype=f32), leaf(16, 32, dtype=f32), leaf(16, dtype=f32)
            return acc.linear(x, weight, bias, "silu", backend="tilelang")
        if op == "flash_attention":
            q, k, v = (leaf(2, 2, 40, 32, dtype=f32) for _ in range(3))
            return acc.flash_attention(q, k, v, causal=True, backend="tilelang")
        if op == "silu_attention":
            q, k, v = (leaf(30, 2, 32, dtype=f32) for _ in range(3))
            cu = torch.tensor([0, 10, 30], dtype=torch.int32)
            return acc.silu_attention(q, k, v, cu, max_seqlen=20, position_bias=leaf(20, dtype=f32), backend="tilelang")
        if op == "mhc":
            return mhc(4, f32)
        if op == "layer_norm":
            return norm("layer_norm", 200, 2, f32)
        if op == "bce":
            return bce_large("mean", True, False, f32)
    raise ValueError(op)


def sample_per_row(dtype):
    logits = torch.randn(3, 300).to(dtype)
    return acc.sample(
        logits, temperature=torch.tensor([0.5, 1.0, 2.0]), top_k=torch.tensor([1, 5, 9]),
        top_p=torch.tensor([0.9, 1.0, 0.5]), backend="tilelang",
    )  # fmt: skip


def gated_delta_rule_fp32_gates(mode, dtype):
    """g and beta in fp32 beside q, k, v in `dtype`; no initial state, no l2norm."""
    b, t, h, k = 1, 100, 2, 64
    q, kk, vv = leaf(b, t, h, k, dtype=dtype), leaf(b, t, h, k, dtype=dtype), leaf(b, t, h, k, dtype=dtype)
    g, beta = F.logsigmoid(torch.randn(b, t, h)).requires_grad_(), torch.rand(b, t, h).requires_grad_()
    if mode == "recurrent":
        for x in (q, kk, vv, g, beta):
            x.requires_grad_(False)
    function = acc.fused_recurrent_gated_delta_rule if mode == "recurrent" else acc.chunk_gated_delta_rule
    return function(q, kk, vv, g, beta, backend="tilelang")


p = functools.partial
# name -> (fn(dtype), dtypes, whether backward launches a kernel)
CASES = {
    "rms_norm-200": (p(norm, "rms_norm", 200, 0), ALL, True),
    "rms_norm-200-weight": (p(norm, "rms_norm", 200, 1), ALL, True),
    "rms_norm-1024-weight-f32": (p(norm, "rms_norm", 1024, 1, param_dtype=f32), HALF, True),
    "layer_norm-200": (p(norm, "layer_norm", 200, 0), ALL, True),
    "layer_norm-200-weight": (p(norm, "layer_norm", 200, 1), HALF, True),
    "layer_norm-96-weight-bias": (p(norm, "layer_norm", 96, 2), ALL, True),
    "layer_norm-1024-weight-bias-f32": (p(norm, "layer_norm", 1024, 2, param_dtype=f32), HALF, True),
    "l2norm-200": (p(l2norm, 200), ALL, True),
    "l2norm-1024": (p(l2norm, 1024), HALF, True),
    "add_rms_norm-200": (p(add_norm, "add_rms_norm", 200, 0), ALL, True),
    "add_rms_norm-200-weight": (p(add_norm, "add_rms_norm", 200, 1), ALL, True),
    "add_rms_norm-1024-weight-f32": (p(add_norm, "add_rms_norm", 1024, 1, param_dtype=f32), HALF, True),
    "add_layer_norm-200": (p(add_norm, "add_layer_norm", 200, 0), HALF, True),
    "add_layer_norm-96-weight-bias": (p(add_norm, "add_layer_norm", 96, 2), ALL, True),
    "add_layer_norm-1024-weight-bias-f32": (p(add_norm, "add_layer_norm", 1024, 2, param_dtype=f32), HALF, True),
    "gelu": (p(activation, "gelu-none"), ALL, True),
    "gelu-tanh": (p(activation, "gelu-tanh"), ALL, True),
    "silu": (p(activation, "silu"), ALL, True),
    "swiglu": (swiglu, ALL, True),
    "dropout_add": (p(dropout_add, 0.25, True), ALL, True),
    # backward False: the forward writes the logits' gradient, which backward scales (torch)
    "bce-mean": (p(bce, "mean", False), ALL, False),
    "bce-sum-weighted": (p(bce, "sum", True), ALL, False),
    "bce-none": (p(bce, "none", False), ALL, False),
    "bce-none-weighted": (p(bce, "none", True), HALF, False),
    "bce-large-mean": (p(bce_large, "mean", False, False), ALL, True),
    "bce-large-sum-weighted": (p(bce_large, "sum", True, False), HALF, True),
    "bce-large-none-weighted": (p(bce_large, "none", True, False), HALF, True),
    "bce-large-none-summed": (p(bce_large, "none", False, True), (bf16,), True),
    "bce-targets-grad": (bce_targets_requiring_grad, HALF, True),
    "embedding_bag-fixed-16": (p(embedding_bag, "fixed", 16), ALL, True),
    "embedding_bag-fixed-96": (p(embedding_bag, "fixed", 96), HALF, True),
    "embedding_bag-offsets-padding-24": (p(embedding_bag, "offsets", 24), ALL, True),
    "embedding_bag-offsets-last-16": (p(embedding_bag, "offsets-last", 16), HALF, True),
    "embedding_bag-sparse-16": (p(embedding_bag, "sparse", 16), HALF, True),
    "flash_attention-d64": (p(flash_attention, 64, False, False, False, False), HALF, True),
    "flash_attention-d64-causal-lengths": (p(flash_attention, 64, True, True, False, False), HALF, True),
    "flash_attention-d32-gqa-dropout": (p(flash_attention, 32, False, False, True, True), HALF, True),
    "flash_attention-d128-causal-lengths-dropout": (p(flash_attention, 128, True, True, False, True), (bf16,), True),
    "flash_attention-d16-causal": (p(flash_attention, 16, True, False, False, False), (f16,), True),
    "flash_attention-d48": (p(flash_attention, 48, False, False, False, False), (bf16,), True),
    "flash_attention-strided": (flash_attention_strided, HALF, True),
    "flash_attention-varlen-d64": (p(flash_attention_varlen, 64, False, False, False), HALF, True),
    "flash_attention-varlen-d32-causal-gqa": (p(flash_attention_varlen, 32, True, True, False), HALF, True),
    "flash_attention-varlen-d128-causal-dropout": (p(flash_attention_varlen, 128, True, False, True), (bf16,), True),
    "mhc-4": (p(mhc, 4), ALL, True),
    "mhc-1": (p(mhc, 1), (bf16,), True),
    "linear": (p(linear, None, False), HALF, False),  # backward: cuBLAS products alone
    "linear-bias": (p(linear, None, True), (bf16,), False),
    "linear-relu-bias": (p(linear, "relu", True), HALF, True),
    "linear-gelu": (p(linear, "gelu", False), HALF, True),
    "linear-gelu_tanh-bias": (p(linear, "gelu_tanh", True), (f16,), True),
    "linear-silu-bias": (p(linear, "silu", True), (bf16,), True),
    "linear-swiglu": (p(linear, "swiglu", False), HALF, True),
    "linear-swiglu-bias": (p(linear, "swiglu", True), (bf16,), True),
    "silu_attention-d32": (p(silu_attention, 32, "plain"), HALF, True),
    "silu_attention-d64-biases": (p(silu_attention, 64, "biases"), HALF, True),
    "silu_attention-d32-targets-dropout": (p(silu_attention, 32, "targets-dropout"), HALF, True),
    "silu_attention-d128-not-causal": (p(silu_attention, 128, "not-causal"), (bf16,), True),
    "top_k-300-7": (p(top_k, 300, 7, True), ALL, False),
    "top_k-300-300-smallest": (p(top_k, 300, 300, False), (bf16,), False),
    "top_k-40000-7-segments": (p(top_k, 40000, 7, True), HALF, False),
    "top_k-16M-2048-rounds": (p(top_k, 2**24, 2048, False, rows=1), (f32,), False),
    "sample-300": (p(sample, 300, 5), ALL, False),
    "sample-40000-segments": (p(sample, 40000, 50), (bf16,), False),
    "sample-16M-2048-rounds": (p(sample, 2**24, 2048, rows=1), (bf16,), False),
    "chunk_gated_delta_rule-varlen": (p(gated_delta_rule, "chunk", True), (bf16,), True),
    "fused_recurrent_gated_delta_rule": (p(gated_delta_rule, "recurrent", False), HALF, False),
    "fused_recurrent_gated_delta_rule-varlen": (p(gated_delta_rule, "recurrent", True), (bf16,), False),
    # mixed precision and other index dtypes
    "layer_norm-weight-bias_f32": (layer_norm_mixed, HALF, True),
    "add_layer_norm-weight_f32": (add_layer_norm_mixed, HALF, True),
    "bce-f32-targets-weights": (p(bce_mixed, False), HALF, False),
    "bce-large-f32-targets-weights": (p(bce_mixed, True), HALF, True),
    "embedding_bag-int32-offsets": (embedding_bag_int32, HALF, True),
    "flash_attention-int64-lengths": (flash_attention_int64_lengths, (bf16,), True),
    "mhc-params-bf16": (p(mhc_params_in, bf16), (bf16,), True),
    "mhc-params-f16": (p(mhc_params_in, f16), (f16,), True),
    "silu_attention-biases-in-q-dtype": (silu_attention_biases_in, HALF, True),
    "autocast-linear": (p(autocast, "linear"), HALF, True),
    "autocast-flash_attention": (p(autocast, "flash_attention"), HALF, True),
    "autocast-silu_attention": (p(autocast, "silu_attention"), HALF, True),
    "autocast-mhc": (p(autocast, "mhc"), (bf16,), True),
    "autocast-layer_norm": (p(autocast, "layer_norm"), (bf16,), True),
    "autocast-bce": (p(autocast, "bce"), (bf16,), True),
    "sample-per-row": (sample_per_row, (bf16,), False),
    "chunk_gated_delta_rule-f32-gates": (p(gated_delta_rule_fp32_gates, "chunk"), HALF, True),
    "fused_recurrent_gated_delta_rule-f32-gates": (p(gated_delta_rule_fp32_gates, "recurrent"), (bf16,), False),
}
# the launches of paths a case is there for
EXPECTED = {
    "embedding_bag-fixed-16": {"embedding_bag_combine": 1},  # the gradient's first pass in more than one chunk
    "embedding_bag-fixed-96": {"embedding_bag_combine": 1},
    "top_k-40000-7-segments": {"sampling_select": 2},  # segments, then their candidates
    "sample-40000-segments": {"sampling_select": 2},
    "top_k-16M-2048-rounds": {"sampling_select": 4},  # segments, then their candidates in three rounds
    "sample-16M-2048-rounds": {"sampling_select": 4},
}
PARAMS = [
    pytest.param(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
    for name, (_, dtypes, _) in CASES.items()
    for dtype in dtypes
]


def _outputs(results) -> list:
    results = results if isinstance(results, (tuple, list)) else (results,)
    return [r for r in results if isinstance(r, torch.Tensor)]


@pytest.mark.parametrize("name, dtype", PARAMS)
def test_every_launch_passes_what_its_kernel_declares(monkeypatch, name, dtype):
    """The op's forward launches kernels, its backward (where it has kernels) too, and every launch passes the
    dtypes, ranks, sizes, strides and scalars its kernel declares."""
    fn, _, backward_kernels = CASES[name]
    with kernels_on_cpu(monkeypatch) as launched:
        outputs = _outputs(fn(dtype))
        forward = len(launched)
        assert forward, f"{name}: no TileLang kernel launched"
        differentiable = [o for o in outputs if o.requires_grad]
        if differentiable:
            grads = [torch.randn(o.shape).to(o.dtype) for o in differentiable]
            torch.autograd.backward(differentiable, grads)
        for kernel, count in EXPECTED.get(name, {}).items():
            assert launched.count(kernel) == count, f"{name}: {kernel} launched {launched.count(kernel)} times"
        if backward_kernels:
            assert len(launched) > forward, f"{name}: the backward launched no TileLang kernel ({launched})"


# op cases the tilelang backend refuses (their contiguous counterparts are in CASES)
REFUSED = {
    "embedding_bag_mean": "the weight is a strided view; the tilelang kernels take a contiguous table",
    "embedding_bag_mean-offsets": "the weight is a strided view; the tilelang kernels take a contiguous table",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.skip(reason=REFUSED[n])) if n in REFUSED else n for n in op_cases.CASES],
)
def test_the_op_cases_strided_views_launch_what_their_kernels_declare(monkeypatch, name):
    """op_cases: every public op on strided views of leaf inputs, as models make them, floating inputs in bf16."""
    make, fn = op_cases.CASES[name]
    inputs = [x.detach().to(bf16).requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in make()]
    with kernels_on_cpu(monkeypatch) as launched:
        op_cases.run_case(functools.partial(fn, "tilelang"), inputs)
        assert launched, f"{name}: no TileLang kernel launched"
