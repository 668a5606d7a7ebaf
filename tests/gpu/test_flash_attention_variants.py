"""The Triton flash attention's variants on CUDA against the float64 reference: forward (FwdConfig: TMA descriptor
loads, heavy-first causal order, the head dim in two column parts) and backward (BwdConfig: TMA descriptor loads in
the dk/dv and dq kernels, lse and delta through descriptors in the dk/dv kernel, the head dim in two column parts),
each forced at a few shapes whatever the tables say, and TMA table entries through the backward launcher; and dropout past
2^16 queries and 2^17 keys and inside a CUDA graph on both kernel backends."""

import pytest
import torch

from conftest import capture_graph
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.config import use_accelerators
from runtime.accelerators.flash_attention import dropout, flash_attention, triton_dkdv
from runtime.accelerators.flash_attention import triton as fa
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.seeds import draw_seed_tensor, saved_seeds
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
    # heavy-first sections of 5 (batch, head) pairs over 12: the last section holds 2
    (3, 4, 2, 1000, 1000, 128, True, True, torch.bfloat16, "blhd", Fwd(128, 128, 8, 3, tma=True, heavy_first=5)),
]
IDS = [
    "d128-causal-lengths-gqa-view-heavy", "d48-lengths-lq<lk", "d32-fp16-gqa-view", "d128-causal-n64-heavy",
    "d128-causal-lengths-gqa-sections",
]  # fmt: skip


def forward_inputs(case):
    """q, k, v, key_lengths and float64's output of a forward case (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype,
    layout, config), with NaN in the keys past each length: they are never read, so NaN there changes nothing."""
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout, _ = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    key_lengths = lengths_for(b, lk) if lengths else None
    expected = attention_float64(q, k, v, causal=causal, key_lengths=key_lengths)
    if key_lengths is not None:
        for i, n in enumerate(key_lengths.tolist()):
            k[i, :, n:], v[i, :, n:] = float("nan"), float("nan")
    return q, k, v, key_lengths, expected


@needs_tma
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tma_forward(case):
    d, causal, dtype, cfg = case[5], case[6], case[8], case[10]
    q, k, v, key_lengths, expected = forward_inputs(case)
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
    """The tables' TMA entries (as shipped) serve flash_attention on Hopper, except at head dim 48, which the forward
    and dq entries' split_d holds as 32 + 16 columns through pointers (the dk/dv entry stays padded, through
    descriptors); the backward reads their lse."""
    assert fa.config("fwd_causal" if causal else "fwd", d, torch.bfloat16).tma
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 300, 300, d, torch.bfloat16, "blhd"))
    variant = fa.forward_variant(q, k, v, causal)[1]
    assert variant["TMA"] == (hopper() and d != 48) and variant["D_HI"] == (16 if d == 48 else 0)
    assert fa.backward_variant("dq", q, k, v, q)[1]["D_HI"] == (16 if d == 48 else 0)
    assert fa.backward_variant("dkdv", q, k, v, q)[1]["D_HI"] == 0
    out = flash_attention(q, k, v, causal=causal, backend="triton")
    ref = attention_float64(q, k, v, causal=causal)
    assert_close("o", out, ref, RTOL[torch.bfloat16])
    do = torch.randn_like(out)
    grads, grads_ref = torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


# --------------------------------------------------------------------------- the head dim in two parts (split_d)

# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout, config): S64 holds the 16-bit table's head-dim-64 entry (the
# causal entry adds heavy_first=16), S128 head dim 128's tiles; a split forward loads through pointers, tma or not
S64 = Fwd(128, 64, 8, 4, tma=True, split_d=True)
S128 = Fwd(128, 128, 8, 3, tma=True, split_d=True)
SPLIT_CASES = [
    (3, 2, 2, 63, 200, 48, False, True, torch.bfloat16, "bhld", S64),
    (2, 8, 4, 200, 63, 48, True, True, torch.float16, "blhd", S64._replace(tma=False, heavy_first=16)),
    (3, 4, 1, 1000, 1000, 48, True, False, torch.bfloat16, "bhld", S64._replace(heavy_first=5)),
    (2, 4, 2, 200, 200, 48, False, False, torch.float16, "blhd", S64),
    (2, 4, 2, 333, 500, 80, True, True, torch.bfloat16, "blhd", S128._replace(heavy_first=4)),
    (2, 4, 2, 500, 333, 96, False, True, torch.bfloat16, "bhld", Fwd(128, 64, 8, 3, split_d=True)),
]
SPLIT_IDS = [
    "d48-lengths-lq<lk", "d48-fp16-causal-lengths-gqa-lq>lk-view-heavy", "d48-causal-mqa-sections",
    "d48-fp16-gqa-view", "d80-causal-lengths-gqa-view", "d96-lengths-lq>lk",
]  # fmt: skip


@pytest.mark.parametrize("case", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_forward(case):
    """The head dim as two column parts (FwdConfig.split_d), forced: float64's output, zeros and lse = +inf where no
    key is visible, and the padded kernel's lse (the backward reads it)."""
    d, causal, dtype, cfg = case[5], case[6], case[8], case[10]
    q, k, v, key_lengths, expected = forward_inputs(case)
    variant = fa.forward_variant(q, k, v, causal, cfg)[1]
    assert variant["D_HI"] == fa.split_head_dim(d)[1] > 0 and not variant["TMA"]
    with poison_outputs():
        o, lse = fa.forward(q, k, v, key_lengths, causal, d**-0.5, 0.0, 0, cfg=cfg)
        o_pad, lse_pad = fa.forward(q, k, v, key_lengths, causal, d**-0.5, 0.0, 0, cfg=cfg._replace(split_d=False))
    assert_close("o", o, expected, RTOL[dtype])
    assert_close("o against the padded kernel", o, o_pad, RTOL[dtype])
    assert_close("lse against the padded kernel", lse.nan_to_num(posinf=0.0), lse_pad.nan_to_num(posinf=0.0), 1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_pad))
    if key_lengths is not None and key_lengths[0] == 0:
        assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isinf(lse[0]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_forward_through_the_public_api(causal):
    """The table's head-dim-64 entry (split_d) serves flash_attention at head dim 48; the backward (the dq entry split
    too, the dk/dv entry padded) reads its lse: every gradient within the bf16 bound of float64."""
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 500, 500, 48, torch.bfloat16, "blhd"))
    key_lengths = lengths_for(2, 500)
    variant = fa.forward_variant(q, k, v, causal)[1]
    assert variant["D_HI"] == 16 and not variant["TMA"]
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend="triton")
    assert_close("o", out, attention_float64(q, k, v, causal=causal, key_lengths=key_lengths), RTOL[torch.bfloat16])
    do = torch.randn_like(out)
    with poison_outputs():
        grads = torch.autograd.grad(out, (q, k, v), do)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, key_lengths, causal)):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


def assert_close_under_mask(o, grads, q, k, v, do, keep, p, causal):
    """o and (dq, dk, dv) against float64 under the dropout keep mask, within the bf16 bounds."""
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = attention_float64(*inputs, causal=causal, keep=keep, dropout_p=p)
    assert_close("o", o, expected, RTOL[torch.bfloat16])
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(expected, inputs, do.double())):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


def test_split_forward_dropout():
    """Dropout in the split forward: the kernels' keep mask (float64 under it), and the
    backward from its o and lse within the bf16 gradient bound."""
    b, h, hkv, length, d, p = 2, 4, 2, 300, 48, 0.1
    q, k, v = make(b, h, hkv, length, length, d, torch.bfloat16, "bhld")
    do = torch.randn_like(q)
    args = (q, k, v, None, True, d**-0.5, p, torch.tensor([1234], device=CUDA))
    with poison_outputs():
        o, lse = fa.forward(*args, cfg=Fwd(128, 64, 8, 4, tma=True, split_d=True))
    with poison_outputs():
        grads = fa.backward(do, *args, o, lse)[:3]
    keep = dropout.keep_mask(1234, b, h, length, length, p, q.device)
    assert_close_under_mask(o, grads, q, k, v, do, keep, p, causal=True)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
@pytest.mark.parametrize("lq, lk", [((1 << 16) + 40, 24), (24, (1 << 17) + 40)], ids=["queries>2^16", "keys>2^17"])
def test_dropout_past_a_block(backend, lq, lk):
    """Queries past 2^16 and keys past 2^17 draw with their block's key (dropout.py) in every kernel of both
    backends, as the torch rebuild does: forward and gradients against float64 under the rebuilt mask."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    b, h, d, p = 1, 2, 64, 0.25
    q, k, v = (x.requires_grad_() for x in make(b, h, 1, lq, lk, d, torch.bfloat16, "bhld"))
    torch.manual_seed(5)
    with poison_outputs():
        o = flash_attention(q, k, v, dropout_p=p, backend=backend)
    torch.manual_seed(5)
    keep = dropout.keep_mask(int(draw_seed_tensor(q.device)), b, h, lq, lk, p, q.device)
    do = torch.randn_like(o)
    with poison_outputs():
        grads = torch.autograd.grad(o, (q, k, v), do)
    assert_close_under_mask(o, grads, q, k, v, do, keep, p, causal=False)


@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_dropout_in_a_cuda_graph_draws_a_new_mask_per_replay(backend):
    """Forward + backward with dropout captured in one CUDA graph on a kernel backend (no fallback), replayed twice:
    each replay's output and gradients match float64 under the mask rebuilt from the seed that replay drew (the
    graph's own seed tensor), and the two replays drew different seeds."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    b, h, length, d, p = 2, 2, 200, 64, 0.2
    q, k, v = (x.requires_grad_() for x in make(b, h, h, length, length, d, torch.bfloat16, "bhld"))
    do = torch.randn_like(q)
    seeds: list[torch.Tensor] = []

    def step():
        with saved_seeds() as saved:
            o = flash_attention(q, k, v, causal=True, dropout_p=p, backend=backend)
        seeds[:] = saved  # after capture: the graph's seed tensor, which every replay refills
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    with use_accelerators(fallback="error"):
        graph, results = capture_graph(step)
    (seed,) = seeds
    drawn = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        drawn.append(seed.item())
        keep = dropout.keep_mask(drawn[-1], b, h, length, length, p, q.device)
        assert_close_under_mask(results[0], results[1:], q, k, v, do, keep, p, causal=True)
    assert drawn[0] != drawn[1], "the two replays drew one seed"


# --------------------------------------------------------------------------- backward (BwdConfig)

Bwd = fa.BwdConfig

# (B, H, Hkv, Lq, Lk, D, causal, lengths, layout, dk/dv config, dq config)
BWD_CASES = [
    (2, 4, 2, 1000, 1000, 128, True, True, "blhd", Bwd(64, 128, 8, 2, tma=True), Bwd(128, 64, 8, 3, tma=True)),
    (2, 4, 4, 777, 1000, 128, False, True, "bhld", Bwd(32, 128, 8, 2, tma=True), Bwd(128, 128, 8, 2, tma=True)),
    (3, 4, 2, 300, 200, 48, False, True, "bhld", Bwd(32, 128, 4, 3, tma=True), Bwd(64, 64, 4, 3, tma=True)),
    (2, 4, 2, 500, 500, 48, True, True, "blhd", Bwd(64, 128, 8, 2, tma=True), Bwd(128, 64, 8, 3, tma=True)),
    (2, 2, 2, 500, 500, 64, True, False, "blhd", Bwd(32, 128, 4, 3, tma=True), Bwd(64, 64, 4, 3, tma=True)),
    (2, 4, 1, 300, 300, 64, False, False, "bhld", Bwd(16, 128, 8, 2, tma=True), Bwd(128, 32, 8, 4, tma=True)),
    # heavy-first sections: 5 of the 6 (batch, kv head) pairs for dk/dv, of the 12 (batch, head) pairs for dq
    (3, 4, 2, 1000, 1000, 128, True, True, "blhd", Bwd(64, 128, 8, 2, tma=True, heavy_first=5),
     Bwd(128, 64, 8, 3, tma=True, heavy_first=5)),
]  # fmt: skip
BWD_IDS = [
    "d128-causal-lengths-gqa-view", "d128-lengths-lq<lk", "d48-lengths-gqa-lq>lk", "d48-causal-lengths-view",
    "d64-causal-view", "d64-mqa", "d128-causal-lengths-gqa-sections",
]  # fmt: skip


def backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg, dq_cfg, tma):
    """(dq, dk, dv) of the dq and dk/dv kernels at these configs: the dq kernel writes delta, the dk/dv kernel reads it
    after (as backward's split kind)."""
    args = (q, k, v, key_lengths, causal, q.shape[-1] ** -0.5, 0.0, 0)
    o, lse = fa.forward(*args)
    delta = torch.full(q.shape[:3], float("nan"), device=CUDA)
    with poison_outputs():
        dq = fa.backward_dq(do, *args, lse, delta, o=o, cfg=dq_cfg, tma=tma)
        dk, dv = fa.backward_dkdv(do, *args, lse, delta, cfg=dkdv_cfg, tma=tma)
    return dq, dk, dv


def reference_grads(do, q, k, v, key_lengths, causal):
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = attention_float64(*inputs, causal=causal, key_lengths=key_lengths)
    return torch.autograd.grad(out, inputs, do.double())


@needs_tma
@pytest.mark.parametrize("case", BWD_CASES, ids=BWD_IDS)
def test_tma_backward(case):
    b, h, hkv, lq, lk, d, causal, lengths, layout, dkdv_cfg, dq_cfg = case
    dtype = torch.bfloat16
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    do = torch.randn_like(q)  # q's layout
    key_lengths = lengths_for(b, lk) if lengths else None
    assert fa.backward_variant("dkdv", q, k, v, do, dkdv_cfg)[1]["TMA"]
    assert fa.backward_variant("dq", q, k, v, do, dq_cfg)[1]["TMA"]
    grads = backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg, dq_cfg, tma=None)
    pointer = backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg, dq_cfg, tma=False)
    expected = reference_grads(do, q, k, v, key_lengths, causal)
    for name, g, g_ref, g_ptr in zip(("dq", "dk", "dv"), grads, expected, pointer):
        assert_close(name, g, g_ref, gradient_tolerance(dtype))
        assert_close(f"{name} against the pointer path", g, g_ptr, 1e-3)  # the same tiles and products


@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (48, False)])
def test_backward_tma_entries_through_the_backward_launcher(d, causal):
    """TMA entries for the dkdv/dq kernels (the tables' own with tma, as a sweep may make them; padded: split loads
    take pointers), passed to the backward the op runs, serve it on Hopper with tma left to the config."""
    dtype = torch.bfloat16
    dkdv_cfg, dq_cfg = (
        fa.config(fa.backward_kind(kind, causal), d, dtype)._replace(tma=True, split_d=False) for kind in ("dkdv", "dq")
    )
    q, k, v = make(2, 4, 2, 300, 300, d, dtype, "blhd")
    args = (q, k, v, None, causal, d**-0.5, 0.0, None)
    o, lse = fa.forward(*args)
    do = torch.randn_like(o)
    for kind, cfg in (("dkdv", dkdv_cfg), ("dq", dq_cfg)):
        assert fa.backward_variant(kind, q, k, v, do, cfg, causal=causal)[1]["TMA"] == hopper()
    with poison_outputs():
        grads = fa.backward(do, *args, o, lse, kind="split", dq_cfg=dq_cfg, dkdv_cfg=dkdv_cfg)[:3]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, None, causal)):
        assert_close(name, g, g_ref, gradient_tolerance(dtype))


# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout, dk/dv config, dq config): SB_DQ is the 16-bit dq table's
# head-dim-64 entry, SB_DKDV the dk/dv entry's tiles with split_d (its tma is not taken: split loads take pointers)
SB_DKDV, SB_DQ = Bwd(32, 128, 4, 3, tma=True, split_d=True), Bwd(64, 64, 4, 3, split_d=True)
SPLIT_BWD_CASES = [
    (3, 2, 2, 63, 200, 48, False, True, torch.bfloat16, "bhld", SB_DKDV, SB_DQ),
    (2, 8, 4, 200, 63, 48, True, True, torch.float16, "blhd", SB_DKDV._replace(heavy_first=16),
     SB_DQ._replace(heavy_first=16)),
    (3, 4, 1, 1000, 1000, 48, True, False, torch.bfloat16, "bhld", SB_DKDV._replace(heavy_first=5),
     SB_DQ._replace(heavy_first=5)),
    (2, 4, 2, 200, 200, 48, False, False, torch.float16, "blhd", Bwd(32, 128, 8, 2, split_d=True),
     Bwd(128, 64, 8, 3, split_d=True)),
    (2, 4, 2, 333, 500, 80, True, True, torch.bfloat16, "blhd", Bwd(32, 128, 8, 2, heavy_first=4, split_d=True),
     Bwd(128, 64, 8, 3, heavy_first=4, split_d=True)),
    (2, 4, 2, 500, 333, 96, False, True, torch.float16, "bhld", Bwd(32, 64, 4, 3, split_d=True), SB_DQ),
]  # fmt: skip
SPLIT_BWD_IDS = [
    "d48-lengths-lq<lk", "d48-fp16-causal-lengths-gqa-lq>lk-view-heavy", "d48-causal-mqa-sections",
    "d48-fp16-gqa-view-8w", "d80-causal-lengths-gqa-view", "d96-fp16-lengths-lq>lk",
]  # fmt: skip


@pytest.mark.parametrize("case", SPLIT_BWD_CASES, ids=SPLIT_BWD_IDS)
def test_split_backward(case):
    """The dk/dv and dq kernels holding the head dim as two column parts (BwdConfig.split_d), forced, delta written by
    the dq kernel: every gradient within the dtype's bound of float64, and the padded kernels'
    at the same tiles (their dots add zero columns, in another order)."""
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout, dkdv_cfg, dq_cfg = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    do = torch.randn_like(q)  # q's layout
    key_lengths = lengths_for(b, lk) if lengths else None
    for kind, cfg in (("dkdv", dkdv_cfg), ("dq", dq_cfg)):
        variant = fa.backward_variant(kind, q, k, v, do, cfg)[1]
        assert variant["D_HI"] == fa.split_head_dim(d)[1] > 0 and not variant["TMA"]
    grads = backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg, dq_cfg, None)
    padded_cfgs = (dkdv_cfg._replace(split_d=False), dq_cfg._replace(split_d=False))
    padded = backward_grads(do, q, k, v, key_lengths, causal, *padded_cfgs, None)
    expected = reference_grads(do, q, k, v, key_lengths, causal)
    for name, g, g_ref, g_pad in zip(("dq", "dk", "dv"), grads, expected, padded):
        assert_close(name, g, g_ref, gradient_tolerance(dtype))
        assert_close(f"{name} against the padded kernels", g, g_pad, RTOL[dtype])


def test_an_expanded_upstream_gradient_takes_the_pointer_path():
    """The gradient of a mean over the sequence reaches the backward expanded (rows 0 apart): no descriptor."""
    q, k, v = (t.requires_grad_() for t in make(2, 4, 2, 300, 300, 128, torch.bfloat16, "bhld"))
    do = torch.randn(2, 4, 1, 128, device=CUDA, dtype=torch.bfloat16).expand(2, 4, 300, 128)
    assert not fa.backward_variant("dq", q, k, v, do, Bwd(128, 64, 8, 3, tma=True))[1]["TMA"]
    out = flash_attention(q, k, v, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), do)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, None, False)):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


# --------------------------------------------------------------------------- lse and delta through descriptors


@pytest.fixture
def lse_delta_taken(monkeypatch):
    """The LSE_DELTA_TMA constexpr of every dk/dv launch that follows, in order."""
    taken, real = [], fa.lse_delta_variant
    monkeypatch.setattr(triton_dkdv, "lse_delta_variant", lambda *args: taken.append(real(*args)) or taken[-1])
    return taken


# (B, H, Hkv, Lq, Lk, D, causal, lengths, layout, dk/dv config with lse_delta_tma)
LSE_DELTA_CASES = [
    (2, 4, 2, 1000, 1000, 128, True, True, "blhd", Bwd(64, 128, 8, 2, tma=True, lse_delta_tma=True)),
    (2, 4, 4, 780, 1000, 128, False, True, "bhld", Bwd(32, 128, 8, 2, tma=True, lse_delta_tma=True)),
    (3, 4, 2, 300, 200, 48, False, True, "bhld", Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True)),
    (2, 2, 2, 500, 500, 64, True, False, "blhd", Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True)),
]
LSE_DELTA_IDS = ["d128-causal-lengths-gqa-view", "d128-m32-lengths-lq<lk", "d48-lengths-gqa-lq>lk", "d64-causal-view"]


@needs_tma
@pytest.mark.parametrize("case", LSE_DELTA_CASES, ids=LSE_DELTA_IDS)
def test_lse_delta_tma_backward(case, lse_delta_taken):
    """The dk/dv kernel reading lse and delta through descriptors (BwdConfig.lse_delta_tma), forced at a few tiles:
    every gradient within the bf16 bound of float64, and the same as with lse and delta through pointers."""
    b, h, hkv, lq, lk, d, causal, lengths, layout, dkdv_cfg = case
    q, k, v = make(b, h, hkv, lq, lk, d, torch.bfloat16, layout)
    do = torch.randn_like(q)
    key_lengths = lengths_for(b, lk) if lengths else None
    dq_cfg = fa.config(fa.backward_kind("dq", causal), d, torch.bfloat16)
    grads = backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg, dq_cfg, tma=None)
    pointer = backward_grads(do, q, k, v, key_lengths, causal, dkdv_cfg._replace(lse_delta_tma=False), dq_cfg, None)
    assert lse_delta_taken == [True, False]
    expected = reference_grads(do, q, k, v, key_lengths, causal)
    for name, g, g_ref, g_ptr in zip(("dq", "dk", "dv"), grads, expected, pointer):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))
        assert_close(f"{name} against lse and delta through pointers", g, g_ptr, 1e-3)


# (B, H, Hkv, Lq, Lk, D, causal, lengths, layout), bf16, through flash_attention with the tables as shipped: the dk/dv
# entries that read lse and delta through descriptors (head dims 128 and 32, the latter with a register cap)
DEFAULT_DKDV_CASES = [
    (2, 4, 2, 1000, 1000, 128, True, True, "blhd"),
    (2, 4, 2, 1000, 1000, 128, False, True, "blhd"),
    (2, 4, 4, 600, 1000, 128, True, False, "bhld"),
    (2, 4, 4, 520, 300, 128, False, False, "bhld"),
    (2, 4, 2, 999, 1000, 128, True, True, "blhd"),
    (2, 4, 2, 333, 200, 128, False, False, "bhld"),
    (2, 4, 2, 1000, 700, 32, False, True, "blhd"),
    (2, 4, 1, 201, 1000, 32, False, False, "bhld"),
    (2, 4, 2, 700, 1000, 32, True, True, "blhd"),
]
DEFAULT_DKDV_IDS = [
    "causal-lengths-gqa-view", "lengths-gqa-view", "causal-lq<lk", "lq>lk",
    "causal-lengths-odd-lq-pointer-fallback", "odd-lq-pointer-fallback",
    "d32-lengths-gqa-view-lq>lk", "d32-mqa-odd-lq-pointer-fallback", "d32-causal-lengths-gqa-view-lq<lk",
]  # fmt: skip


@pytest.mark.parametrize("case", DEFAULT_DKDV_CASES, ids=DEFAULT_DKDV_IDS)
def test_dkdv_descriptor_entries_through_the_public_api(case, lse_delta_taken):
    """The dk/dv tables' entries that read tiles, lse and delta through descriptors (head dim 128: 64x128, 8 warps, 2
    stages; head dim 32: 32x128, 4 warps, 3 stages, at most 168 registers) serve flash_attention's backward:
    descriptors for lse and delta on Hopper where Lq % 4 == 0, pointer loads for them otherwise (odd Lq; before
    Hopper the whole kernel takes pointers); every gradient within the bf16 bound."""
    b, h, hkv, lq, lk, d, causal, lengths, layout = case
    expected_cfg = {
        (128, True): Bwd(64, 128, 8, 2, tma=True, lse_delta_tma=True, heavy_first=4),
        (128, False): Bwd(64, 128, 8, 2, tma=True, lse_delta_tma=True),
        (32, False): Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
        (32, True): Bwd(32, 128, 4, 3, tma=True, lse_delta_tma=True, maxnreg=168),
    }[d, causal]
    assert fa.config(fa.backward_kind("dkdv", causal), d, torch.bfloat16) == expected_cfg
    q, k, v = (t.requires_grad_() for t in make(b, h, hkv, lq, lk, d, torch.bfloat16, layout))
    key_lengths = lengths_for(b, lk) if lengths else None
    assert not fa.use_fused(q, k)
    out = flash_attention(q, k, v, causal=causal, key_lengths=key_lengths, backend="triton")
    do = torch.randn_like(out)
    assert fa.backward_variant("dkdv", q, k, v, do, causal=causal)[1]["TMA"] == hopper()
    with poison_outputs():
        grads = torch.autograd.grad(out, (q, k, v), do)
    assert lse_delta_taken == [hopper() and lq % 4 == 0]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, key_lengths, causal)):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


def test_unaligned_lse_and_delta_take_pointer_loads(lse_delta_taken):
    """delta not 16-byte aligned: pointer loads for lse and delta (the tiles keep their descriptors on Hopper), the
    same gradients as the aligned run. (lse and delta are always the forward's contiguous [B, H, Lq] rows.)"""
    cfg = Bwd(64, 128, 8, 2, tma=True, lse_delta_tma=True)
    q, k, v = make(2, 4, 2, 500, 500, 128, torch.bfloat16, "bhld")
    do = torch.randn_like(q)
    args = (q, k, v, None, True, 128**-0.5, 0.0, 0)
    o, lse = fa.forward(*args)
    delta = torch.empty(q.shape[:3], device=CUDA)
    fa.backward_dq(do, *args, lse, delta, o=o)  # writes delta
    shifted = torch.empty(delta.numel() + 1, device=CUDA)[1:].view(delta.shape).copy_(delta)  # 4-byte aligned
    with poison_outputs():
        expected = fa.backward_dkdv(do, *args, lse, delta, cfg=cfg)
        for g, g_ref, grad in zip(fa.backward_dkdv(do, *args, lse, shifted, cfg=cfg), expected, ("dk", "dv")):
            assert_close(f"{grad} (unaligned delta)", g, g_ref, 1e-3)
    assert lse_delta_taken == [hopper(), False]


# (B, H, Hkv, Lq, Lk, D, causal, lengths, dtype, layout, config): dq stored (Lk <= block_n) or added with atomics
FUSED_CASES = [
    (4, 4, 2, 256, 256, 16, True, True, torch.bfloat16, "blhd", None),
    (3, 4, 4, 63, 200, 32, False, True, torch.float16, "bhld", None),
    (2, 4, 1, 300, 128, 48, True, False, torch.bfloat16, "bhld", None),
    (2, 2, 2, 129, 100, 128, False, True, torch.bfloat16, "blhd", None),
    (2, 4, 2, 1000, 1000, 32, True, True, torch.bfloat16, "blhd", Bwd(32, 128, 4, 2)),
    (2, 2, 1, 500, 777, 128, False, False, torch.float16, "bhld", Bwd(64, 128, 8, 2)),
    (2, 2, 2, 200, 300, 64, True, True, torch.float32, "bhld", None),
]
FUSED_IDS = [
    "d16-causal-lengths-gqa-view", "d32-fp16-lengths-lq<lk", "d48-causal-mqa-lq>lk", "d128-lengths-view",
    "atomic-d32-causal-lengths", "atomic-d128-fp16-mqa", "atomic-fp32-d64-causal-lengths",
]  # fmt: skip


@pytest.mark.parametrize("case", FUSED_CASES, ids=FUSED_IDS)
def test_fused_backward(case):
    b, h, hkv, lq, lk, d, causal, lengths, dtype, layout, cfg = case
    q, k, v = make(b, h, hkv, lq, lk, d, dtype, layout)
    do = torch.randn_like(q)
    key_lengths = lengths_for(b, lk) if lengths else None
    args = (q, k, v, key_lengths, causal, d**-0.5, 0.0, 0)
    o, lse = fa.forward(*args)
    with poison_outputs():
        grads = fa.backward_fused(do, *args, o, lse, cfg=cfg)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, key_lengths, causal)):
        assert g.dtype == dtype
        assert_close(name, g, g_ref, gradient_tolerance(dtype))


def test_the_public_op_takes_the_fused_backward_at_pcvr_shapes():
    q, k, v = (t.requires_grad_() for t in make(256, 4, 4, 256, 256, 16, torch.bfloat16, "blhd"))
    assert fa.use_fused(q, k)
    key_lengths = lengths_for(256, 256)
    out = flash_attention(q, k, v, causal=True, key_lengths=key_lengths, backend="triton")
    do = torch.randn_like(out)
    with poison_outputs():
        grads = torch.autograd.grad(out, (q, k, v), do)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, key_lengths, True)):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))


@pytest.mark.parametrize("kind", ["split", "fused"])
@pytest.mark.parametrize("case", BWD_CASES[:4], ids=BWD_IDS[:4])
def test_backward_kinds(case, kind):
    """backward's kind forced: "split" (the dq kernel writes delta, the dk/dv kernel runs after it) or "fused" (one
    kernel; dq added with atomics where the keys span several blocks), with the tables' tiles and loads: every
    gradient within the bf16 bound of float64."""
    b, h, hkv, lq, lk, d, causal, lengths, layout, _, _ = case
    q, k, v = make(b, h, hkv, lq, lk, d, torch.bfloat16, layout)
    do = torch.randn_like(q)
    key_lengths = lengths_for(b, lk) if lengths else None
    args = (q, k, v, key_lengths, causal, d**-0.5, 0.0, 0)
    with poison_outputs():
        grads = fa.backward(do, *args, *fa.forward(*args), kind=kind)[:3]
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(do, q, k, v, key_lengths, causal)):
        assert_close(name, g, g_ref, gradient_tolerance(torch.bfloat16))
