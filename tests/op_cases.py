"""The cases every op-wide test runs: one call of each public op on strided (non-contiguous) views of leaf inputs,
as models make them (transposes, slices, the unbound heads of a fused projection). Each case is (make the leaf inputs
on the CPU, fn(backend, *inputs)); the GPU tier moves the inputs to CUDA, so fn makes every other tensor on its
inputs' device."""

import functools

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import runtime.accelerators as acc

B, L, H, D = 2, 9, 4, 16


def randn_leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape)).requires_grad_()


def _norm_inputs():
    return randn_leaf(48, 7), randn_leaf(96), randn_leaf(96)


def fused_qkv_attention(backend, x, key_lengths):
    q, k, v = x.view(B, L, 3, H, D).unbind(2)  # a fused QKV projection
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return acc.flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend=backend)


def _gdr_inputs(requires_grad=True):
    T, heads, K = 21, 2, 16
    tensors = (
        torch.randn(B, T, 2 * heads * K),  # q and k from one projection
        torch.randn(B, heads, T, K),  # v, heads first
        torch.randn(B, 2 * heads, T),  # g and beta, heads first
        torch.randn(B, heads, K, K, 2)[..., 0],  # the initial state, strided
    )
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


def _gdr(function, backend, qk, v, gb, state):
    heads, K = v.shape[1], v.shape[-1]
    q, k = qk.view(B, -1, 2, heads, K).unbind(2)
    g, beta = gb.transpose(1, 2).chunk(2, dim=-1)
    return function(
        q, k, v.transpose(1, 2), F.logsigmoid(g), beta.sigmoid(), initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True, backend=backend,
    )  # fmt: skip


def _mhc_inputs(n=4, C=8):
    m = n * n + 2 * n
    return (
        randn_leaf(C, B, 3, n).detach().permute(1, 2, 3, 0).requires_grad_(),  # x [B, 3, n, C], C not innermost
        randn_leaf(m, n * C, scale=(n * C) ** -0.5),
        (torch.tensor([0.8, 1.1, 1.3]) + 0.1 * torch.randn(3)).requires_grad_(),
        randn_leaf(2 * m, scale=0.3),
        randn_leaf(C, B, 3),
    )


def _mhc(backend, x, phi, alpha, bias, y):
    h_in, h_post, h_res = acc.mhc_pre(x, phi.t(), alpha, bias[::2], backend=backend)
    return h_in, h_post, h_res, acc.mhc_post(x, h_in * y.permute(1, 2, 0), h_post, h_res, backend=backend)


def _bags():
    return randn_leaf(80, 5), torch.randint(0, 40, (6, 8))  # the table: every other row of the weight


CASES = {
    "rms_norm": (lambda: _norm_inputs()[:2], lambda backend, x, w: acc.rms_norm(x.t(), w[::2], backend=backend)),
    "layer_norm": (_norm_inputs, lambda backend, x, w, b: acc.layer_norm(x.t(), w[::2], b[1::2], backend=backend)),
    "l2norm": (lambda: _norm_inputs()[:1], lambda backend, x: acc.l2norm(x.t(), backend=backend)),
    "flash_attention": (
        lambda: (randn_leaf(B, L, 3 * H * D), torch.tensor([9, 4])),
        fused_qkv_attention,
    ),
    "chunk_gated_delta_rule": (_gdr_inputs, functools.partial(_gdr, acc.chunk_gated_delta_rule)),
    "fused_recurrent_gated_delta_rule": (
        lambda: _gdr_inputs(requires_grad=False),  # forward-only kernels
        functools.partial(_gdr, acc.fused_recurrent_gated_delta_rule),
    ),
    "binary_cross_entropy_with_logits": (
        lambda: (randn_leaf(7, 2, 10), torch.rand(10, 7), torch.rand(7, 20), torch.rand(20)),
        lambda backend, x, y, w, pw: acc.binary_cross_entropy_with_logits(
            x[:, 0], y.t(), w[:, ::2], pw[::2], reduction="none", backend=backend
        ),
    ),
    "binary_cross_entropy_with_logits-mean": (
        lambda: (randn_leaf(7, 2, 10), torch.rand(10, 7, requires_grad=True)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x[:, 1], y.t(), backend=backend),
    ),
    "swiglu": (lambda: (randn_leaf(5, 2, 24),), lambda backend, x: acc.swiglu(*x.unbind(1), backend=backend)),
    "dropout_add": (
        lambda: (randn_leaf(24, 5), randn_leaf(5, 48)),
        lambda backend, x, r: acc.dropout_add(x.t(), r[:, ::2], 0.25, backend=backend),
    ),
    "embedding_bag_mean": (_bags, lambda backend, w, i: acc.embedding_bag_mean(w[::2], i[:, ::2], backend=backend)),
    "embedding_bag_mean-offsets": (
        lambda: (*_bags(), torch.tensor([0, 3, 3, 9])),
        lambda backend, w, i, offsets: acc.embedding_bag_mean(
            w[::2], i.t().flatten()[::3], offsets, padding_idx=2, backend=backend
        ),
    ),
    "mhc_pre-mhc_post": (_mhc_inputs, _mhc),
    "add_rms_norm": (
        lambda: (randn_leaf(48, 7), randn_leaf(7, 96), randn_leaf(96)),
        lambda backend, x, r, w: acc.add_rms_norm(x.t(), r[:, ::2], w[::2], backend=backend),
    ),
    "add_layer_norm": (
        lambda: (randn_leaf(48, 7), randn_leaf(7, 96), randn_leaf(96), randn_leaf(96)),
        lambda backend, x, r, w, b: acc.add_layer_norm(x.t(), r[:, ::2], w[::2], b[1::2], backend=backend),
    ),
    "gelu-silu": (
        lambda: (randn_leaf(24, 5),),
        lambda backend, x: (
            acc.gelu(x.t(), backend=backend),
            acc.gelu(x.t(), "tanh", backend=backend),
            acc.silu(x.t(), backend=backend),
        ),
    ),
    "silu_attention": (
        lambda: (
            randn_leaf(21, 3 * 2 * 16),
            torch.tensor([0, 5, 5, 21], dtype=torch.int32),
            randn_leaf(16),
            randn_leaf(2, 12),
        ),
        lambda backend, x, cu, position, time_bias: acc.silu_attention(
            *x.view(21, 3, 2, 16).unbind(1),
            cu,
            max_seqlen=16,
            position_bias=position[::2],
            time_bias=time_bias[:, ::2],
            timestamps=torch.arange(21, device=x.device) * 37,
            backend=backend,
        ),
    ),
    "top_k-sample": (  # forward-only kernels: no input requires grad
        lambda: (torch.randn(300, 3),),
        lambda backend, x: (
            *acc.top_k(x.t(), 7, backend=backend),
            acc.sample(x.t(), temperature=0.7, top_k=5, top_p=0.9, backend=backend),
        ),
    ),
    "linear": (  # fp16: the interpreter's bf16 dot is wrong, and the kernels take no fp32
        lambda: tuple(
            t.half().requires_grad_() for t in (torch.randn(16, 40), 0.2 * torch.randn(64, 16), torch.randn(64))
        ),
        lambda backend, x, w, b: acc.linear(x.t(), w[::2], b[::2], "gelu", backend=backend),
    ),
}

# public names of runtime.accelerators that are not ops
NOT_OPS = {"explain", "active_config", "set_accelerators", "use_accelerators"}
# ops that run outside the compiled graph today (a graph break, so fullgraph=True fails): strict xfails, which turn
# into failures the day they compile
GRAPH_BREAKS = {
    "embedding_bag_collection": (
        lambda: (
            [randn_leaf(10, 8), randn_leaf(12, 16)],
            torch.tensor([1, 2, 3, 4, 5, 11]),
            torch.tensor([0, 2, 3, 3, 6]),
        ),
        lambda backend, weights, values, offsets: acc.embedding_bag_collection(
            weights, values, offsets, backend=backend
        ),
    ),
}


def run_case(fn, inputs):
    """fn's outputs and the gradients of a weighted sum of them (fixed weights), with respect to every input that
    requires one."""
    outputs = tuple(o for o in tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not leaves:
        return outputs, ()
    generator = torch.Generator().manual_seed(1)
    loss = sum(
        (o.float() * torch.randn(o.shape, generator=generator).to(o.device)).sum() for o in outputs if o.requires_grad
    )
    return outputs, torch.autograd.grad(loss, leaves)


# Second derivatives: every case whose op takes a gradient, and a few eager paths of their own
EXTRA_CASES = {
    # the eager path of a loss whose logits' gradient is written by the forward (targets need no gradient)
    "binary_cross_entropy_with_logits-unit-gradient": (
        lambda: (torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x, y, backend=backend),
    ),
    "binary_cross_entropy_with_logits-none": (
        lambda: (torch.randn(7, 10, requires_grad=True), torch.rand(7, 10)),
        lambda backend, x, y: acc.binary_cross_entropy_with_logits(x, y, reduction="none", backend=backend),
    ),
    "embedding_bag_mean-sparse": (
        lambda: (torch.randn(40, 5, requires_grad=True), torch.randint(0, 40, (6, 3))),
        lambda backend, w, i: acc.embedding_bag_mean(w, i, sparse=True, backend=backend),
    ),
}
FORWARD_ONLY = ("fused_recurrent", "top_k")  # kernels that take no gradient: nothing to differentiate twice
DIFFERENTIABLE = {
    name: case for name, case in {**CASES, **EXTRA_CASES}.items() if not any(op in name for op in FORWARD_ONLY)
}


def second_backward(fn, inputs):
    """A Hessian-vector product: the gradients of fn's weighted outputs with create_graph=True, then the gradient
    of their weighted sum."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    outputs = [o for o in tree_leaves(fn(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    generator = torch.Generator().manual_seed(1)

    def randn_like(t):
        return torch.randn(t.shape, generator=generator).to(t.device, t.dtype)

    grads = torch.autograd.grad(outputs, leaves, [randn_like(o) for o in outputs], create_graph=True)
    dense = [g.to_dense() if g.is_sparse else g for g in grads]
    return torch.autograd.grad(sum((g * randn_like(g)).sum() for g in dense), leaves, allow_unused=True)
