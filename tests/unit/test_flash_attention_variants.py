"""The variants of the Triton flash attention: forward (FwdConfig: TMA descriptor loads, heavy-first causal order, the
head dim in two column parts) and backward (BwdConfig: TMA descriptor loads in the dk/dv and dq kernels, lse and delta
through descriptors in the dk/dv kernel, the head dim in two column parts).
Under the interpreter the descriptor path runs only when forced (tma=True), never from the tables (whose 16-bit
forward entries at head dims 48-128 ask for it); its sm_90 build is checked by compiling it without a GPU, as
test_triton_compile_sm90.py does for the tables' pointer path (and, for the backward, its attention_tma_backward
case)."""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import test_triton_compile_sm90 as sm90
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.flash_attention import (
    dropout,
    flash_attention,
    triton_blocks,
    triton_dkdv,
    triton_dq,
    triton_forward,
)
from runtime.accelerators.flash_attention import triton as fa
from runtime.accelerators.flash_attention.reference import attention_float64
from runtime.accelerators.flash_attention.triton_launch_args import grid_of
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance

SEED = torch.tensor([1234])  # the dropout seed tensor the kernel functions take (seeds.draw_seed_tensor's form)

FwdConfig = fa.FwdConfig
BwdConfig = fa.BwdConfig
f16 = torch.float16  # the interpreter's bfloat16 dots are wrong (see input_reasons)


def make(b, h, hkv, lq, lk, d, dtype=f16):
    q = torch.randn(b, h, lq, d, dtype=dtype)
    return q, torch.randn(b, hkv, lk, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype)


def run_forward(q, k, v, lengths, causal, cfg, tma):
    key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths is not None else None
    with poison_outputs():
        return fa.forward(q, k, v, key_lengths, causal, q.shape[-1] ** -0.5, 0.0, 0, cfg=cfg, tma=tma)


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, cfg",
    [
        (2, 4, 2, 70, 45, 48, True, [45, 0], FwdConfig(32, 16, 4, 2, tma=True, heavy_first=True)),
        (1, 2, 2, 37, 130, 16, False, [69], FwdConfig(16, 32, 4, 2, tma=True)),
        (3, 2, 1, 65, 63, 32, False, None, FwdConfig(32, 32, 4, 2, tma=True)),
        (2, 2, 2, 33, 80, 64, True, [80, 17], FwdConfig(16, 16, 4, 2, tma=True)),
    ],
    ids=["causal-gqa-d48-lengths-heavy", "lengths-d16", "mqa-d32-odd", "causal-lq<lk-d64-lengths"],
)
def test_tma_path_matches_the_pointer_path(b, h, hkv, lq, lk, d, causal, lengths, cfg):
    q, k, v = make(b, h, hkv, lq, lk, d)
    key_lengths = torch.tensor(lengths) if lengths is not None else None
    expected = attention_float64(q, k, v, causal=causal, key_lengths=key_lengths)
    for i, length in enumerate(lengths or []):  # keys past a length are never read: NaN there changes nothing
        k[i, :, length:], v[i, :, length:] = float("nan"), float("nan")
    assert fa.forward_variant(q, k, v, causal, cfg, tma=True)[1]["TMA"]
    o, lse = run_forward(q, k, v, lengths, causal, cfg, tma=True)
    assert_close("o", o, expected, RTOL[f16])
    # the same products in the same order: bit-identical to the pointer loads
    o_ptr, lse_ptr = run_forward(q, k, v, lengths, causal, cfg, tma=False)
    assert torch.equal(o, o_ptr) and torch.equal(lse, lse_ptr)


def strided_views(d, b=2, lq=21, lk=19, h=4):
    """q as x.view(B, L, H, D).transpose(1, 2); k and v interleaved in one buffer."""
    q = torch.randn(b, lq, h, d, dtype=f16).transpose(1, 2)
    kv = torch.randn(b, lk, 2, 2 * d, dtype=f16)
    return q, kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)


def test_tma_path_reads_strided_views():
    q, k, v = strided_views(16)
    cfg = FwdConfig(16, 16, 4, 2, tma=True)
    assert fa.forward_variant(q, k, v, True, cfg, tma=True)[1]["TMA"]
    o, _ = run_forward(q, k, v, None, True, cfg, tma=True)
    assert_close("o", o, attention_float64(q, k, v, causal=True), RTOL[f16])


def test_unaligned_views_take_the_pointer_path():
    q, k, v = make(2, 2, 2, 20, 20, 16)
    wide = torch.randn(2, 2, 20, 17, dtype=f16)
    cases = {
        "base": wide[..., 1:],  # 2-byte aligned start
        "row stride": wide[..., :16],  # rows 34 bytes apart
        "head stride": torch.randn(2, 2 * 20 * 16 + 1, dtype=f16)[:, 1:].view(2, 2, 20, 16),
    }
    for name, bad in cases.items():
        assert not fa.forward_variant(bad, k, v, False, FwdConfig(16, 16, 4, 2, tma=True), tma=True)[1]["TMA"], name
        o, _ = run_forward(bad, k, v, [20, 5], False, FwdConfig(16, 16, 4, 2, tma=True), tma=True)
        assert_close(f"o ({name})", o, attention_float64(bad, k, v, key_lengths=torch.tensor([20, 5])), RTOL[f16])


def test_a_config_asking_for_descriptors_takes_pointers_under_the_interpreter():
    """A config asking for TMA, as a table entry does (tma left to the config), runs the pointer path here;
    heavy_first applies to causal calls only."""
    variant = FwdConfig(16, 16, 4, 2, tma=True, heavy_first=True)
    q, k, v = make(2, 2, 1, 40, 37, 16)
    assert fa.forward_variant(q, k, v, False, variant)[1] == dict(TMA=False, HEAVY_FIRST=0, D_HI=0)
    assert fa.forward_variant(q, k, v, True, variant)[1] == dict(TMA=False, HEAVY_FIRST=1, D_HI=0)
    for causal in (False, True):
        o, _ = run_forward(q, k, v, None, causal, variant, tma=None)
        assert_close("o", o, attention_float64(q, k, v, causal=causal), RTOL[f16])


@pytest.mark.parametrize("d", [48, 64, 128])
def test_the_default_tma_entries_take_the_pointer_path_here(d):
    """The tables' own TMA entries (as shipped) never reach the descriptor path on the CPU."""
    q, k, v = make(1, 2, 2, 8, 8, d)
    for causal in (False, True):
        cfg, flags = fa.forward_variant(q, k, v, causal)
        assert cfg == fa.config("fwd_causal" if causal else "fwd", d, f16) and not flags["TMA"]
    assert fa.config("fwd", d, f16).tma  # the entries ask for it: only forward_variant keeps it off


def test_plain_tuples_still_configure_the_forward():
    q, k, v = make(1, 2, 2, 30, 30, 32)
    cfg, flags = fa.forward_variant(q, k, v, True, (32, 16, 4, 2))
    assert cfg == FwdConfig(32, 16, 4, 2) and not any(flags.values())
    o, _ = run_forward(q, k, v, None, True, (32, 16, 4, 2), tma=None)
    assert_close("o", o, attention_float64(q, k, v, causal=True), RTOL[f16])


@triton.jit
def _record_heavy_first_order(OUT, n_blocks, SECTION: tl.constexpr, HEAVY_LAST: tl.constexpr):
    block, pair = triton_blocks._block_and_pair(n_blocks, SECTION, HEAVY_LAST)
    launched = tl.program_id(0)
    tl.store(OUT + 2 * launched, block)
    tl.store(OUT + 2 * launched + 1, pair)


@pytest.mark.parametrize("n_blocks, n_pairs, section", [(3, 8, 3), (4, 5, 1), (2, 6, 8), (1, 3, 2), (3, 5, 0)])
@pytest.mark.parametrize("heavy_last", [True, False])
def test_heavy_first_order(n_blocks, n_pairs, section, heavy_last):
    """Launch order -> (block, pair): sections of `section` pairs (the last one shorter), heaviest block rank first
    across a section's pairs (section 0: block fastest, as a (blocks, pairs) grid); every (block, pair) exactly
    once."""
    out = torch.full((n_blocks * n_pairs, 2), -1, dtype=torch.int32)
    _record_heavy_first_order[grid_of(n_blocks, n_pairs)](out, n_blocks, SECTION=section, HEAVY_LAST=heavy_last)
    expected = [(block, pair) for pair in range(n_pairs) for block in range(n_blocks)] if section == 0 else []
    for first in range(0, n_pairs, section) if section else ():
        for rank in range(n_blocks):
            block = n_blocks - 1 - rank if heavy_last else rank
            expected += [(block, pair) for pair in range(first, min(n_pairs, first + section))]
    assert [tuple(row) for row in out.tolist()] == expected


def test_heavy_first_sections_forward_and_backward():
    """Causal forward, dk/dv and dq kernels in sections of 3 (batch, head) pairs over 8 (the last section holds 2),
    with GQA and a key length: against float64."""
    q, k, v = make(2, 4, 2, 40, 40, 32)
    do = torch.randn_like(q)
    o, _ = run_forward(q, k, v, [40, 29], True, FwdConfig(16, 16, 4, 2, heavy_first=3), tma=False)
    assert_close("o", o, attention_float64(q, k, v, causal=True, key_lengths=torch.tensor([40, 29])), RTOL[f16])
    cfg = BwdConfig(16, 16, 4, 2, heavy_first=3)
    assert fa.backward_variant("dq", q, k, v, do, cfg, causal=True)[1]["HEAVY_FIRST"] == 3
    assert fa.backward_variant("dq", q, k, v, do, cfg)[1]["HEAVY_FIRST"] == 0  # not causal: launch order
    grads = run_backward(q, k, v, do, [40, 29], True, cfg, tma=False)
    assert_gradients(grads, q, k, v, do, [40, 29], True)


# --------------------------------------------------------------------------- the head dim in two parts (split_d)


def test_split_head_dim():
    """Head dims that split (no power of two; a power of two >= 16 left over past the largest power of two below) and
    those that stay padded; forward_variant and backward_variant split only where the config asks and the head dim
    splits; the 16-bit forward and dq tables ask at head dim 64's entries (which head dim 48 takes), the dk/dv, the fused
    backward's and the fp32 tables never."""
    expected = {48: (32, 16), 80: (64, 16), 96: (64, 32), 24: (32, 0), 40: (64, 0), 56: (64, 0), 112: (128, 0)}
    expected |= {d: (max(16, d), 0) for d in (8, 16, 32, 64, 128)}
    assert {d: fa.split_head_dim(d) for d in expected} == expected
    for d, d_hi in ((48, 16), (96, 32), (64, 0), (40, 0)):
        q, k, v = make(1, 2, 2, 8, 8, d)
        assert fa.forward_variant(q, k, v, True, FwdConfig(16, 16, 4, 2, split_d=True))[1]["D_HI"] == d_hi
        assert fa.forward_variant(q, k, v, True, FwdConfig(16, 16, 4, 2))[1]["D_HI"] == 0
        for kind in ("dkdv", "dq"):
            assert fa.backward_variant(kind, q, k, v, q, BwdConfig(16, 16, 4, 2, split_d=True))[1]["D_HI"] == d_hi
            assert fa.backward_variant(kind, q, k, v, q, BwdConfig(16, 16, 4, 2))[1]["D_HI"] == 0
    asking = {(id(table), kind, d) for table in (fa.CONFIGS_16BIT, fa.CONFIGS_FP32) for kind in table
              for d, cfg in table[kind].items() if cfg.split_d}  # fmt: skip
    kinds = ("fwd", "fwd_causal", "dq", "dq_causal")
    assert asking == {(id(fa.CONFIGS_16BIT), kind, 64) for kind in kinds}  # the 16-bit tables at 48


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, cfg",
    [
        (2, 4, 2, 70, 45, 48, True, [45, 0], FwdConfig(32, 16, 4, 2, heavy_first=3, split_d=True)),
        (1, 2, 2, 37, 50, 48, False, None, FwdConfig(16, 32, 4, 2, split_d=True)),
        (2, 2, 1, 33, 40, 80, False, [40, 17], FwdConfig(16, 16, 4, 2, split_d=True)),
        (1, 2, 1, 20, 30, 96, True, None, FwdConfig(16, 16, 4, 2, split_d=True)),
    ],
    ids=["causal-gqa-d48-lengths-empty-heavy", "d48-lq<lk", "mqa-d80-lengths", "causal-d96-lq<lk"],
)
def test_split_forward(b, h, hkv, lq, lk, d, causal, lengths, cfg):
    """The head dim as two column parts: float64's output, the padded kernel's lse (to fp32 rounding: its dots add
    zero columns, in another order) and output. Descriptors asked for (tma forced) are not taken: split loads take
    pointers."""
    q, k, v = make(b, h, hkv, lq, lk, d)
    expected = attention_float64(q, k, v, causal=causal, key_lengths=torch.tensor(lengths) if lengths else None)
    for i, length in enumerate(lengths or []):  # keys past a length are never read: NaN there changes nothing
        k[i, :, length:], v[i, :, length:] = float("nan"), float("nan")
    variant = fa.forward_variant(q, k, v, causal, cfg._replace(tma=True), tma=True)[1]
    assert not variant["TMA"] and variant["D_HI"] == fa.split_head_dim(d)[1] > 0
    o, lse = run_forward(q, k, v, lengths, causal, cfg._replace(tma=True), tma=True)
    assert_close("o", o, expected, RTOL[f16])
    o_pad, lse_pad = run_forward(q, k, v, lengths, causal, cfg._replace(split_d=False), tma=False)
    assert_close("o against the padded kernel", o, o_pad, 1e-3)
    torch.testing.assert_close(lse, lse_pad, rtol=1e-6, atol=1e-6)  # +inf at the same rows
    for i, length in enumerate(lengths or []):
        if length == 0:  # no visible key: zeros, lse = +inf
            assert torch.equal(o[i], torch.zeros_like(o[i])) and torch.isinf(lse[i]).all()


def test_split_forward_reads_strided_views():
    q, k, v = strided_views(48)
    cfg = FwdConfig(16, 16, 4, 2, split_d=True)
    assert fa.forward_variant(q, k, v, True, cfg)[1] == dict(TMA=False, HEAVY_FIRST=0, D_HI=16)
    o, _ = run_forward(q, k, v, [19, 7], True, cfg, tma=None)
    assert_close("o", o, attention_float64(q, k, v, causal=True, key_lengths=torch.tensor([19, 7])), RTOL[f16])


def test_split_forward_dropout_and_backward():
    """Dropout in the split forward: the padded kernel's draws (its output, and float64's under the kernels' keep
    mask), and the backward (the tables' entries: dq split, dk/dv padded) from its o and lse gives float64's
    gradients."""
    q, k, v = make(2, 4, 2, 40, 37, 48)
    do = torch.randn_like(q)
    lengths, dropout_p = [37, 20], 0.2
    args = (q, k, v, torch.tensor(lengths, dtype=torch.int32), True, 48**-0.5, dropout_p, SEED)
    split, padded = FwdConfig(16, 16, 4, 2, split_d=True), FwdConfig(16, 16, 4, 2)
    with poison_outputs():
        o, lse = fa.forward(*args, cfg=split)
        o_pad, _ = fa.forward(*args, cfg=padded)
    assert_close("o against the padded kernel", o, o_pad, 1e-3)
    keep = dropout.keep_mask(1234, 2, 4, 40, 37, dropout_p, q.device)
    key_lengths = torch.tensor(lengths)
    expected = attention_float64(q, k, v, causal=True, key_lengths=key_lengths, keep=keep, dropout_p=dropout_p)
    assert_close("o", o, expected, RTOL[f16])
    with poison_outputs():
        grads = fa.backward(do, *args, o, lse)[:3]
    assert_gradients(grads, q, k, v, do, lengths, True, dropout_p)


@pytest.mark.parametrize("causal", [False, True])
def test_split_through_the_public_op(monkeypatch, causal):
    """The forward and dq table entries as shipped (split_d at padded head dim 64) serve flash_attention at head dim
    48 split (the dq kernel writing delta), the dk/dv entry padded, both reading the split forward's lse: float64's
    gradients (GQA, a key length, a row of no visible key)."""
    taken = {"forward_variant": [], "backward_variant": []}
    callers = {"forward_variant": (triton_forward,), "backward_variant": (triton_dq, triton_dkdv)}
    for name, calls in taken.items():
        real = getattr(fa, name)
        for module in callers[name]:
            monkeypatch.setattr(
                module, name, lambda *a, real=real, calls=calls, **kw: calls.append(real(*a, **kw)) or calls[-1]
            )
    q, k, v = (x.requires_grad_() for x in make(2, 4, 2, 40, 37, 48))
    do = torch.randn_like(q)
    lengths = [37, 0] if causal else [37, 9]
    out = flash_attention(q, k, v, causal=causal, key_lengths=torch.tensor(lengths), backend="triton")
    assert [variant["D_HI"] for _, variant in taken["forward_variant"]] == [16]
    assert_close("o", out, attention_float64(q, k, v, causal=causal, key_lengths=torch.tensor(lengths)), RTOL[f16])
    assert_gradients(torch.autograd.grad(out, (q, k, v), do), q, k, v, do, lengths, causal)
    assert [variant["D_HI"] for _, variant in taken["backward_variant"]] == [16, 0]  # the dq, then the dk/dv kernel


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg",
    [
        (2, 4, 2, 45, 37, 48, True, [37, 0], 0.0, BwdConfig(16, 32, 4, 2, heavy_first=3, split_d=True)),
        (1, 2, 2, 33, 50, 48, False, None, 0.0, BwdConfig(32, 16, 4, 2, split_d=True)),
        (2, 2, 1, 30, 40, 80, False, [40, 17], 0.0, BwdConfig(16, 16, 4, 2, split_d=True)),
        (1, 2, 1, 20, 30, 96, True, None, 0.0, BwdConfig(16, 16, 4, 2, split_d=True)),
        (2, 2, 1, 40, 40, 48, True, [40, 23], 0.2, BwdConfig(16, 32, 4, 2, split_d=True)),
    ],
    ids=["causal-gqa-d48-lengths-empty-heavy", "d48-lq<lk", "mqa-d80-lengths", "causal-d96-lq<lk",
         "causal-dropout-mqa-d48"],
)  # fmt: skip
def test_split_backward(b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg):
    """The dk/dv and dq kernels with the head dim as two column parts (BwdConfig.split_d), delta written by the dq
    kernel: float64's gradients, and the padded kernels' (to fp16 rounding: their dots add zero
    columns, in another order). Descriptors asked for (tma forced) are not taken: split loads take pointers."""
    q, k, v = make(b, h, hkv, lq, lk, d)
    do = torch.randn_like(q)
    for kind in ("dkdv", "dq"):
        variant = fa.backward_variant(kind, q, k, v, do, cfg._replace(tma=True), tma=True, causal=causal)[1]
        assert not variant["TMA"] and variant["D_HI"] == fa.split_head_dim(d)[1] > 0
    split = cfg._replace(tma=True)
    grads = run_backward(q, k, v, do, lengths, causal, split, True, dropout_p)
    assert_gradients(grads, q, k, v, do, lengths, causal, dropout_p)
    padded = run_backward(q, k, v, do, lengths, causal, cfg._replace(split_d=False), False, dropout_p)
    for name, g, g_pad in zip(("dq", "dk", "dv"), grads, padded):
        assert_close(f"{name} against the padded kernels", g, g_pad, 1e-3)


# --------------------------------------------------------------------------- backward


def run_backward(q, k, v, do, lengths, causal, cfg, tma, dropout_p=0.0):
    """(dq, dk, dv) of the dq and dk/dv kernels launched with cfg (the forward as the tables say): the dq kernel writes
    delta, the dk/dv kernel reads it after."""
    key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths is not None else None
    args = (q, k, v, key_lengths, causal, q.shape[-1] ** -0.5, dropout_p, SEED)
    o, lse = fa.forward(*args)
    delta = torch.full(q.shape[:3], float("nan"))
    with poison_outputs():
        dq = fa.backward_dq(do, *args, lse, delta, o=o, cfg=cfg, tma=tma)
        dk, dv = fa.backward_dkdv(do, *args, lse, delta, cfg=cfg, tma=tma)
    return dq, dk, dv


def reference_grads(q, k, v, do, lengths, causal, dropout_p=0.0):
    """(dq, dk, dv) of the float64 reference; with dropout, under the keep mask the kernels draw for SEED."""
    b, h, lq, _ = q.shape
    keep = dropout.keep_mask(1234, b, h, lq, k.shape[2], dropout_p, q.device) if dropout_p > 0 else None
    key_lengths = torch.tensor(lengths) if lengths is not None else None
    inputs = [x.double().requires_grad_() for x in (q, k, v)]
    out = attention_float64(*inputs, causal=causal, key_lengths=key_lengths, keep=keep, dropout_p=dropout_p)
    return torch.autograd.grad(out, inputs, do.double())


def assert_gradients(grads, q, k, v, do, lengths, causal, dropout_p=0.0):
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference_grads(q, k, v, do, lengths, causal, dropout_p)):
        assert_close(name, g, g_ref, gradient_tolerance(g.dtype))


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg",
    [
        (2, 4, 2, 70, 45, 48, True, [45, 0], 0.0, BwdConfig(32, 16, 4, 2, tma=True)),
        (1, 2, 2, 37, 130, 16, False, [69], 0.0, BwdConfig(16, 32, 4, 2, tma=True)),
        (3, 2, 1, 65, 63, 32, False, None, 0.0, BwdConfig(32, 32, 4, 2, tma=True)),
        (2, 2, 2, 33, 80, 64, True, [80, 17], 0.0, BwdConfig(16, 16, 4, 2, tma=True)),
        (2, 2, 1, 40, 40, 48, True, [40, 23], 0.2, BwdConfig(16, 32, 4, 2, tma=True)),
    ],
    ids=["causal-gqa-d48-lengths", "lengths-d16-lq<lk", "mqa-d32-odd", "causal-d64-lengths", "causal-dropout-mqa-d48"],
)
def test_backward_tma_path_matches_the_pointer_path(b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg):
    q, k, v = make(b, h, hkv, lq, lk, d)
    do = torch.randn_like(q)
    for kind in ("dkdv", "dq"):
        assert fa.backward_variant(kind, q, k, v, do, cfg, tma=True)[1]["TMA"]
    grads = run_backward(q, k, v, do, lengths, causal, cfg, tma=True, dropout_p=dropout_p)
    assert_gradients(grads, q, k, v, do, lengths, causal, dropout_p)
    # the same tiles (zeros past the ends either way) and products in the same order: bit-identical
    pointer = run_backward(q, k, v, do, lengths, causal, cfg, tma=False, dropout_p=dropout_p)
    for name, g, g_ptr in zip(("dq", "dk", "dv"), grads, pointer):
        assert torch.equal(g, g_ptr), name


def test_backward_tma_path_reads_strided_views():
    b, lq, lk, h, d = 2, 21, 19, 4, 16
    q = torch.randn(b, lq, h, d, dtype=f16).transpose(1, 2)  # x.view(B, L, H, D).transpose(1, 2)
    do = torch.randn(b, lq, h, d, dtype=f16).transpose(1, 2)
    kv = torch.randn(b, lk, 2, 2 * d, dtype=f16)  # k and v interleaved in one buffer
    k, v = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    cfg = BwdConfig(16, 16, 4, 2, tma=True)
    assert fa.backward_variant("dkdv", q, k, v, do, cfg, tma=True)[1]["TMA"]
    assert_gradients(run_backward(q, k, v, do, [19, 7], True, cfg, tma=True), q, k, v, do, [19, 7], True)


def test_backward_unsuitable_strides_take_the_pointer_path():
    """An expanded upstream gradient (rows 0 apart, as the gradient of a mean over the sequence) or an unaligned
    view anywhere: the pointer path, the same gradients."""
    q, k, v = make(2, 2, 2, 20, 20, 16)
    cfg = BwdConfig(16, 16, 4, 2, tma=True)
    wide = torch.randn(2, 2, 20, 17, dtype=f16)
    cases = {
        "expanded do": (q, k, v, torch.randn(2, 2, 1, 16, dtype=f16).expand(2, 2, 20, 16)),
        "unaligned do": (q, k, v, wide[..., 1:]),
        "unaligned v": (q, k, wide[..., :16], torch.randn_like(q)),
    }
    for name, (q_, k_, v_, do) in cases.items():
        for kind in ("dkdv", "dq"):
            assert not fa.backward_variant(kind, q_, k_, v_, do, cfg, tma=True)[1]["TMA"], name
        assert_gradients(run_backward(q_, k_, v_, do, [20, 5], False, cfg, tma=True), q_, k_, v_, do, [20, 5], False)


def test_launch_options_pass_a_register_cap_only_where_a_config_sets_one():
    assert fa.launch_options(BwdConfig(32, 128, 4, 3)) == dict(num_warps=4, num_stages=3)
    assert fa.launch_options(FwdConfig(64, 64, 4, 2, maxnreg=80)) == dict(num_warps=4, num_stages=2, maxnreg=80)
    capped = [(kind, d) for kind, entries in fa.CONFIGS_16BIT.items() for d, cfg in entries.items() if cfg.maxnreg]
    assert capped == [("dkdv", 32), ("dkdv_causal", 32)]  # the head-dim-32 dk/dv entries


def test_a_backward_config_asking_for_descriptors_takes_pointers_under_the_interpreter():
    """A BwdConfig asking for TMA, as the dk/dv table entries do (tma left to the config), runs the pointer path
    here, in the dq and the dk/dv kernel."""
    cfg = BwdConfig(16, 16, 4, 2, tma=True)
    q, k, v = make(2, 2, 1, 40, 37, 16)
    do = torch.randn_like(q)
    for kind in ("dkdv", "dq"):
        for causal in (False, True):
            assert fa.backward_variant(kind, q, k, v, do, cfg, causal=causal) == (
                cfg,
                dict(TMA=False, HEAVY_FIRST=0, D_HI=0),
            )
    grads = run_backward(q, k, v, do, None, True, cfg, tma=None)
    assert_gradients(grads, q, k, v, do, None, True)


def test_plain_tuples_still_configure_the_backward():
    q, k, v = make(1, 2, 2, 30, 30, 32)
    do = torch.randn_like(q)
    assert fa.backward_variant("dq", q, k, v, do, (32, 16, 4, 2)) == (
        BwdConfig(32, 16, 4, 2),
        dict(TMA=False, HEAVY_FIRST=0, D_HI=0),
    )
    assert_gradients(run_backward(q, k, v, do, None, True, (32, 16, 4, 2), tma=None), q, k, v, do, None, True)
    for table in (fa.CONFIGS_16BIT, fa.CONFIGS_FP32):
        assert all(isinstance(cfg, BwdConfig) for kind in ("dkdv", "dq") for cfg in table[kind].values())


# --------------------------------------------------------------------------- lse and delta through descriptors


@pytest.fixture
def lse_delta_taken(monkeypatch):
    """The LSE_DELTA_TMA constexpr of every dk/dv launch that follows, in order."""
    taken, real = [], fa.lse_delta_variant
    monkeypatch.setattr(triton_dkdv, "lse_delta_variant", lambda *args: taken.append(real(*args)) or taken[-1])
    return taken


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg",
    [
        (2, 4, 2, 72, 45, 48, True, [45, 0], 0.0, BwdConfig(32, 16, 4, 2, tma=True, lse_delta_tma=True)),
        (1, 2, 2, 36, 130, 16, False, [69], 0.0, BwdConfig(32, 32, 4, 2, tma=True, lse_delta_tma=True)),
        (2, 2, 2, 36, 80, 64, True, [80, 17], 0.0, BwdConfig(32, 16, 4, 2, tma=True, lse_delta_tma=True)),
        (2, 2, 1, 40, 40, 48, True, [40, 23], 0.2, BwdConfig(32, 32, 4, 2, tma=True, lse_delta_tma=True)),
        (1, 2, 1, 44, 48, 128, True, None, 0.0, BwdConfig(32, 16, 4, 2, tma=True, lse_delta_tma=True)),
        (3, 2, 1, 65, 63, 32, False, None, 0.0, BwdConfig(32, 32, 4, 2, tma=True, lse_delta_tma=True)),
    ],
    ids=["causal-gqa-d48-lengths", "lengths-d16-lq<lk", "causal-d64-lengths-partial-block", "causal-dropout-mqa-d48",
         "causal-d128-partial-block", "odd-lq-pointer-fallback-d32"],
)  # fmt: skip
@pytest.mark.slow
def test_lse_and_delta_through_descriptors(lse_delta_taken, b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg):
    """The dk/dv kernel on its descriptor path reading lse and delta through 1-D descriptors too
    (BwdConfig.lse_delta_tma, where Lq % 4 == 0; an odd Lq falls back to pointer loads): the float64 gradients, and
    bit-identical to the same config reading them through pointers (rows past Lq add exact zeros either way)."""
    q, k, v = make(b, h, hkv, lq, lk, d)
    do = torch.randn_like(q)
    assert fa.backward_variant("dkdv", q, k, v, do, cfg, tma=True)[1]["TMA"]
    grads = run_backward(q, k, v, do, lengths, causal, cfg, tma=True, dropout_p=dropout_p)
    assert lse_delta_taken == [lq % 4 == 0]
    assert_gradients(grads, q, k, v, do, lengths, causal, dropout_p)
    pointer_cfg = cfg._replace(lse_delta_tma=False)
    pointer = run_backward(q, k, v, do, lengths, causal, pointer_cfg, tma=True, dropout_p=dropout_p)
    assert lse_delta_taken[1:] == [False]
    for name, g, g_ptr in zip(("dq", "dk", "dv"), grads, pointer):
        assert torch.equal(g, g_ptr), name


def test_lse_delta_variant():
    """Descriptors for lse and delta (the forward's contiguous rows) only where the config asks, the tiles take
    descriptors (tma), every (b, h) row starts 16-byte aligned and query blocks have 32 rows or more; else pointer
    loads."""
    on, off = BwdConfig(32, 16, 4, 2, tma=True, lse_delta_tma=True), BwdConfig(32, 16, 4, 2, tma=True)
    lse, delta = torch.zeros(2, 3, 40), torch.zeros(2, 3, 40)
    assert fa.lse_delta_variant(on, lse, delta, True)
    assert not fa.lse_delta_variant(off, lse, delta, True)
    assert not fa.lse_delta_variant(on, lse, delta, False)  # pointer tiles (no Hopper, interpreter, strides)
    assert not fa.lse_delta_variant(on, torch.zeros(2, 3, 42), torch.zeros(2, 3, 42), True)  # rows 168 bytes apart
    assert not fa.lse_delta_variant(on, lse, torch.zeros(2 * 3 * 40 + 1)[1:].view(2, 3, 40), True)  # 4-byte aligned
    assert not fa.lse_delta_variant(fa.BwdConfig(*on[:4]), lse, delta, True)  # a plain 4-tuple: off
    assert not fa.lse_delta_variant(on._replace(block_m=16), lse, delta, True)  # 64-byte boxes faulted on an H100


def test_the_dkdv_tables_read_lse_and_delta_through_descriptors_at_head_dims_32_to_128(lse_delta_taken):
    """The 16-bit dk/dv entries at head dims 32, 64 (48 too) and 128 ask for descriptors, lse and delta included;
    under the interpreter (no TMA) the public op still takes pointer loads for all of them. Head dim 16 and fp32 do
    not ask."""
    assert fa.config("dkdv_causal", 128, f16) == BwdConfig(64, 128, 8, 2, tma=True, lse_delta_tma=True, heavy_first=4)
    assert fa.config("dkdv", 128, f16) == BwdConfig(64, 128, 8, 2, tma=True, lse_delta_tma=True)
    assert fa.config("dkdv", 128, torch.bfloat16).lse_delta_tma
    assert all(fa.config(kind, d, f16).lse_delta_tma for kind in ("dkdv", "dkdv_causal") for d in (32, 48, 64))
    assert not any(fa.config(kind, 16, f16).lse_delta_tma for kind in ("dkdv", "dkdv_causal"))
    assert not any(cfg.lse_delta_tma for table in (fa.CONFIGS_16BIT, fa.CONFIGS_FP32)
                   for kind in ("dq", "dq_causal", "fused") for cfg in table[kind].values())  # fmt: skip
    assert not any(cfg.lse_delta_tma for kind in ("dkdv", "dkdv_causal") for cfg in fa.CONFIGS_FP32[kind].values())
    q, k, v = (x.requires_grad_() for x in make(1, 2, 1, 40, 40, 128))
    do = torch.randn_like(q)
    assert not fa.backward_variant("dkdv", q, k, v, do)[1]["TMA"]
    out = flash_attention(q, k, v, causal=True, backend="triton")
    assert_gradients(torch.autograd.grad(out, (q, k, v), do), q, k, v, do, None, True)
    assert lse_delta_taken == [False]


# --------------------------------------------------------------------------- the fused backward


def run_fused(q, k, v, do, lengths, causal, cfg, dropout_p=0.0):
    key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths is not None else None
    args = (q, k, v, key_lengths, causal, q.shape[-1] ** -0.5, dropout_p, SEED)
    o, lse = fa.forward(*args)
    with poison_outputs():
        return fa.backward_fused(do, *args, o, lse, cfg=cfg)


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg",
    [
        # one key block: dq stored
        (2, 4, 2, 70, 45, 48, True, [45, 0], 0.0, BwdConfig(16, 64, 4, 2)),
        (1, 2, 2, 37, 30, 16, False, [19], 0.0, BwdConfig(16, 32, 4, 2)),
        (3, 2, 1, 65, 32, 32, False, None, 0.0, BwdConfig(32, 32, 4, 2)),
        (2, 2, 1, 40, 40, 64, True, [40, 23], 0.2, BwdConfig(16, 64, 4, 2)),
        # several key blocks: dq summed with atomics
        (2, 4, 2, 50, 70, 48, True, [70, 33], 0.0, BwdConfig(16, 32, 4, 2)),
        (1, 2, 1, 21, 90, 16, False, None, 0.1, BwdConfig(16, 16, 4, 2)),
    ],
    ids=["causal-gqa-d48-lengths", "lengths-d16", "mqa-d32-full-block", "causal-dropout-mqa-d64",
         "atomic-causal-gqa-d48-lengths", "atomic-dropout-mqa-d16"],
)  # fmt: skip
def test_fused_backward_matches_float64(b, h, hkv, lq, lk, d, causal, lengths, dropout_p, cfg):
    q, k, v = make(b, h, hkv, lq, lk, d)
    do = torch.randn_like(q)
    grads = run_fused(q, k, v, do, lengths, causal, cfg, dropout_p)
    assert all(g.dtype == f16 for g in grads)
    assert_gradients(grads, q, k, v, do, lengths, causal, dropout_p)


def test_fused_backward_reads_strided_views():
    b, lq, lk, h, d = 2, 21, 19, 4, 16
    q = torch.randn(b, lq, h, d, dtype=f16).transpose(1, 2)
    do = torch.randn(b, lq, h, d, dtype=f16).transpose(1, 2)
    kv = torch.randn(b, lk, 2, 2 * d, dtype=f16)
    k, v = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    grads = run_fused(q, k, v, do, [19, 7], True, BwdConfig(16, 32, 4, 2))
    assert_gradients(grads, q, k, v, do, [19, 7], True)


def test_the_backward_takes_the_fused_kernel_where_keys_fit_one_block():
    cfg = BwdConfig(16, 64, 4, 2)  # the fused kernel's config: keys in one block of 64
    q, k, v = make(2, 4, 2, 40, 64, 16)
    do = torch.randn_like(q)
    lengths = [64, 9]
    args = (q, k, v, torch.tensor(lengths, dtype=torch.int32), True, q.shape[-1] ** -0.5, 0.0, None)
    o, lse = fa.forward(*args)
    with poison_outputs():
        grads = fa.backward(do, *args, o, lse, min_programs=4, fused_cfg=cfg)[:3]
        fused = fa.backward_fused(do, *args, o, lse, cfg=cfg)
    assert_gradients(grads, q, k, v, do, lengths, True)
    for name, g, g_fused in zip(("dq", "dk", "dv"), grads, fused):  # one key block: dq stored, no atomics
        assert torch.equal(g, g_fused), name
    assert fa.use_fused(q, k, 4, cfg)
    assert not fa.use_fused(q, k, cfg=cfg)  # 4 (batch, kv head) pairs: too few by default
    assert not fa.use_fused(*make(2, 4, 2, 40, 65, 16)[:2], 4, cfg)  # a key past the block
    assert fa.use_fused(*make(2, 4, 2, 40, 65, 16)[:2], 4)  # the table's entry: 256 keys a block
    assert not fa.use_fused(*make(1, 4, 2, 40, 64, 16)[:2], 4, cfg)  # too few (batch, kv head) pairs
    assert not fa.use_fused(*make(2, 4, 2, 40, 64, 16, torch.float32)[:2], 4, cfg)  # measured for 16-bit inputs only
    assert not fa.use_fused(*make(2, 4, 2, 40, 64, 32)[:2], 4, cfg)  # head dim 32: the split kernels won


# --------------------------------------------------------------------------- the sm_90 build, no GPU


def _variant_launch(d, causal, lengths, cfg):
    def case():
        b, h, hkv, length = 2, 4, 2, 300
        q, k, v = (t.to(torch.bfloat16) for t in make(b, h, hkv, length, length, d, torch.float32))
        run_forward(q, k, v, [length, 77] if lengths else None, causal, cfg, tma=True)

    return case


def _table_launch(d, causal, lengths):
    """The 16-bit table's own entry (TMA forced on: the interpreter would take the pointer path), padded where the
    head dim would split (split loads take pointers)."""
    cfg = fa.config("fwd_causal" if causal else "fwd", d, torch.bfloat16)
    return _variant_launch(d, causal, lengths, cfg._replace(split_d=False))


VARIANT_CASES = {
    # the tables' TMA defaults (the launches test_triton_compile_sm90.py cannot make under the interpreter):
    # the widest tiles, padded and unpadded head dims, key lengths
    "table_d128_causal_lengths": _table_launch(128, True, True),
    "table_d128": _table_launch(128, False, False),
    "table_d64": _table_launch(64, False, False),
    "table_d48_lengths": _table_launch(48, False, True),
}


@pytest.mark.slow
def test_variants_compile_for_sm90(tmp_path):
    assert fa.config("fwd", 128, torch.bfloat16) == FwdConfig(128, 128, 8, 3, tma=True)
    assert fa.config("fwd_causal", 128, torch.bfloat16) == FwdConfig(128, 128, 8, 3, tma=True, heavy_first=4)
    assert fa.config("fwd", 64, torch.bfloat16) == FwdConfig(128, 64, 8, 4, tma=True, split_d=True)
    compiled = sm90.compile_cases(VARIANT_CASES, Path(tmp_path))
    launches = compiled["flash_attention.triton_forward._fwd_kernel"]
    assert {launch["case"] for launch, _ in launches} == set(VARIANT_CASES)
    for launch, _ in launches:
        names = list(launch["signature"])
        constexprs = {names[path[0]]: value for path, value in launch["constexprs"].items()}
        assert constexprs["TMA"], launch["case"]
    for launch, result in launches:
        assert "error" not in result, f"{launch['case']} does not compile for sm_90:\n{result['error']}"
        shared = result["shared"]
        assert shared <= sm90.H100_SHARED_BYTES, f"{launch['case']} needs {shared} bytes of shared memory"


@pytest.mark.parametrize(
    "b, h, hkv, lq, lk, d, causal, lengths, dropout_p",
    [
        (2, 4, 2, 70, 45, 48, True, [45, 0], 0.0),
        (3, 2, 1, 65, 63, 32, False, None, 0.0),
        (2, 2, 1, 40, 40, 16, True, None, 0.2),
    ],
    ids=["causal-gqa-d48-lengths", "mqa-d32-odd", "causal-dropout-d16"],
)
def test_backward_kinds_match_the_float64_gradients(b, h, hkv, lq, lk, d, causal, lengths, dropout_p):
    """backward(kind="split"): the dq kernel writes delta = rowsum(o * do) and the dk/dv kernel reads it after; the
    gradients of the float64 reference, and kind="fused"'s (one kernel) to fp16 rounding."""
    q, k, v = make(b, h, hkv, lq, lk, d)
    do = torch.randn_like(q)
    key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths is not None else None
    args = (q, k, v, key_lengths, causal, d**-0.5, dropout_p, SEED)
    o, lse = fa.forward(*args)
    grads = {}
    for kind in fa.BACKWARDS:
        with poison_outputs():
            grads[kind] = fa.backward(do, *args, o, lse, kind=kind)[:3]
    assert_gradients(grads["split"], q, k, v, do, lengths, causal, dropout_p)
    for name, g, g_fused in zip(("dq", "dk", "dv"), grads["split"], grads["fused"]):
        assert_close(name, g, g_fused, RTOL[f16])


def test_unknown_backward_kind_is_an_error():
    q, k, v = make(1, 1, 1, 4, 4, 16)
    o, lse = fa.forward(q, k, v, None, False, 0.25, 0.0, SEED)
    with pytest.raises(ValueError, match=r"kind: expected None or one of \('fused', 'split'\), got 'preprocess'"):
        fa.backward(torch.randn_like(q), q, k, v, None, False, 0.25, 0.0, SEED, o, lse, kind="preprocess")
