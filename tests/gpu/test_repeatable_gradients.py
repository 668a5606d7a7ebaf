"""Every kernel's forward and backward repeat bit for bit on the same inputs, as docs/DESIGN.md claims: reductions
(parameter gradients, the BCE mean, embedding-bag rows, mHC and gated delta rule sums) run in a fixed order. The one
exception, flash_attention's TileLang backward (dq by reductions in no fixed order), is what the deterministic-mode
reason keeps out (test_flash_attention_tilelang.py); its forward is checked here.

Each case builds its inputs from a fixed seed, runs forward + backward twice under torch.use_deterministic_algorithms
(so a torch op on any op's path without a deterministic implementation raises), and compares every output and
gradient with torch.equal. Sizes are large enough that the reductions span many programs."""

import os
import sys
from pathlib import Path

import pytest
import torch

from runtime.accelerators import (
    binary_cross_entropy_with_logits,
    chunk_gated_delta_rule,
    dropout_add,
    embedding_bag_mean,
    flash_attention,
    l2norm,
    layer_norm,
    rms_norm,
    swiglu,
    use_accelerators,
)
from runtime.accelerators.testing import deterministic_algorithms

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from gdr_checks import make_inputs as gdr_inputs  # noqa: E402
from test_mhc import make_inputs as mhc_inputs  # noqa: E402
from test_mhc import pre_block_post

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS asks for (mHC's products)
BACKENDS = ("triton", "tilelang")
bf16 = torch.bfloat16


def tensor(*shape, dtype=bf16, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda")).to(dtype).requires_grad_()


def norms(op):
    def case(backend):
        x, w, b = tensor(8192, 1000), tensor(1000), tensor(1000)
        if op is l2norm:
            return l2norm(x, backend=backend), [x]
        if op is rms_norm:
            return rms_norm(x, w, backend=backend), [x, w]
        return layer_norm(x, w, b, backend=backend), [x, w, b]

    return case


def swiglu_case(backend):
    gate, up = tensor(4097, 1000), tensor(4097, 1000)
    return swiglu(gate, up, backend=backend), [gate, up]


def dropout_add_case(backend):
    x, residual = tensor(4097, 1000), tensor(4097, 1000)
    return dropout_add(x, residual, 0.1, True, backend=backend), [x, residual]


def bce_case(backend):
    logits, targets = tensor(2**20 + 3, dtype=torch.float32, scale=3.0), torch.rand(2**20 + 3, device="cuda")
    return binary_cross_entropy_with_logits(logits, targets, backend=backend), [logits]


def embedding_bag_case(sparse):
    def case(backend):
        table = tensor(10000, 64)
        hot = torch.randint(0, 50, (4096, 8), device="cuda")  # repeated rows within and across bags
        indices = torch.where(
            torch.rand(4096, 8, device="cuda") < 0.5, hot, torch.randint(0, 10000, (4096, 8), device="cuda")
        )
        return embedding_bag_mean(table, indices, sparse=sparse, backend=backend), [table]

    return case


def mhc_case(backend):
    inputs = {k: v.detach().cuda().requires_grad_() for k, v in mhc_inputs(4, 1280, (2, 500), bf16, seed=1).items()}
    return pre_block_post(inputs, backend), list(inputs.values())


def gdr_case(backend):
    inputs = {k: v.requires_grad_() for k, v in gdr_inputs(2, 1000, 4, 4, 64, 64, bf16).items()}
    x = inputs
    out, _ = chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True, backend=backend
    )
    return out, list(inputs.values())


def attention_case(shape, causal):
    def case(backend):
        q, k, v = tensor(*shape), tensor(*shape), tensor(*shape)
        return flash_attention(q, k, v, causal=causal, backend=backend), [q, k, v]

    return case


CASES = {
    "rms_norm": norms(rms_norm),
    "layer_norm": norms(layer_norm),
    "l2norm": norms(l2norm),
    "swiglu": swiglu_case,
    "dropout_add": dropout_add_case,
    "bce_mean": bce_case,
    "embedding_bag_dense": embedding_bag_case(sparse=False),
    "embedding_bag_sparse": embedding_bag_case(sparse=True),
    "mhc": mhc_case,
    "gated_delta_rule": gdr_case,
    "attention": attention_case((2, 4, 1000, 64), causal=False),
    "attention_causal": attention_case((2, 4, 1000, 128), causal=True),
    "attention_fused_backward": attention_case((128, 4, 100, 64), causal=False),  # Triton's one-kernel backward
}
FORWARD_ONLY = {("attention", "tilelang"), ("attention_causal", "tilelang"), ("attention_fused_backward", "tilelang")}


def run(case: str, backend: str) -> list[torch.Tensor]:
    """Every output and gradient of one forward + backward, from seed 0 (inputs, dropout seeds, output gradients)."""
    torch.manual_seed(0)
    if (case, backend) in FORWARD_ONLY:  # without gradients, which deterministic mode keeps off TileLang attention
        with torch.no_grad():
            outs, _ = CASES[case](backend)
        return [outs]
    outs, inputs = CASES[case](backend)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    grads = torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs])
    return [o.detach() for o in outs] + [g.to_dense() if g.is_sparse else g for g in grads]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_repeat_bit_for_bit(case, backend):
    with deterministic_algorithms(), use_accelerators(fallback="error"):  # the kernels, never the torch reference
        first, second = run(case, backend), run(case, backend)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"{case} on {backend}: result {i} differs in {int((a != b).sum())} elements"
