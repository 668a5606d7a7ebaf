"""Every launched Triton kernel compiled for sm_90 (Hopper), no GPU needed.

The interpreter (TRITON_INTERPRET=1, set by conftest) runs kernels as Python and so misses what only
the compiler rejects: a non-constexpr module global read inside a kernel, an op with no GPU lowering,
tiles that overflow shared memory. Here the launchers run at typical (bf16) shapes with every launch
intercepted instead of interpreted: Triton's own launch binder works out the signature, constexprs,
alignment attributes and options a real launch would compile. A fresh process without the
interpreter (sm90_compile.py) then compiles each recorded specialisation with
triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)).

Every kernel that a module of runtime.accelerators launches (`name[grid](...)` in any module defining a Triton kernel)
gets a test;
one that no case below launches fails, naming the missing case.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import runtime
import runtime.accelerators as acc
from conftest import built_once
from runtime.accelerators import norms_triton
from runtime.accelerators.add_norm import triton as add_norm_triton
from runtime.accelerators.embedding_bag_mean import radix_sort
from runtime.accelerators.flash_attention import triton as fa_triton
from runtime.accelerators.gated_delta_rule import triton as gdr_triton
from runtime.accelerators.gated_delta_rule import triton_backward as gdr_backward
from runtime.accelerators.gated_delta_rule import triton_shared as gdr_shared
from runtime.accelerators.layer_norm import triton as layer_norm_triton
from runtime.accelerators.linear import launch as linear_launch
from runtime.accelerators.linear import triton as linear_triton
from runtime.accelerators.linear import triton_persistent as linear_persistent_triton
from runtime.accelerators.mhc import triton as mhc_triton
from runtime.accelerators.rms_norm import triton as rms_norm_triton
from runtime.accelerators.testing import differentiable
from runtime.accelerators.triton_launch import DirectLaunch
from sm90_compile import PTX_MARKERS

H100_SHARED_BYTES = 232448  # opt-in shared memory per block on sm_90 (227 KiB)
SM_SHARED_BYTES = 233472  # shared memory per SM on sm_90 (228 KiB), for all its blocks
COMPILER = Path(__file__).with_name("sm90_compile.py")
COMPILE_TIMEOUT_S = 1800  # a hang guard: the compile took over 10 minutes on a loaded 2-core machine

bf16, f32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------- the kernels


def kernel_modules() -> list[str]:
    """Every module of runtime.accelerators that defines a Triton kernel (read from its source, not imported)."""
    names = []
    for info in pkgutil.walk_packages(acc.__path__, prefix="runtime.accelerators."):
        origin = importlib.util.find_spec(info.name).origin
        if origin and origin.endswith(".py") and "@triton.jit" in Path(origin).read_text():
            names.append(info.name)
    return sorted(names)


def launched_kernels() -> dict[str, tuple[str, str]]:
    """Readable id ("rms_norm._forward_kernel") -> (module, name) of each jit function the package launches: as
    `name[grid](...)`, handed to a LaunchPlan (`LaunchPlan(name, ...)`) or the default of a parameter or field that a
    launcher launches (`kernel: DirectLaunch = name`), in any module (the row norms' shared kernels are launched by
    the ops' modules)."""
    launched = set()
    for info in pkgutil.walk_packages(acc.__path__, prefix="runtime.accelerators."):
        origin = importlib.util.find_spec(info.name).origin
        if origin and origin.endswith(".py"):
            text = Path(origin).read_text()
            launched.update(re.findall(r"(?:\b(\w+)\[|LaunchPlan\(\s*(\w+)\s*,|DirectLaunch\s*=\s*(\w+))", text))
    launched = {name for names in launched for name in names if name}
    kernels = {}
    for module_name in kernel_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            value = value.kernel if isinstance(value, DirectLaunch) else value
            is_jit = isinstance(value, (InterpretedFunction, JITFunction)) and value.fn.__module__ == module_name
            if is_jit and name in launched:
                short = module_name.removeprefix("runtime.accelerators.").removesuffix(".triton")
                kernels[f"{short}.{name}"] = (module_name, name)
    return kernels


KERNELS = launched_kernels()


# --------------------------------------------------------------------------- the cases: typical launches


def _randn(*shape, dtype=bf16, grad=True):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


TWO_LAUNCH_BACKWARD = norms_triton.ParameterBackwardLaunch(finish_max_steps=0)


def _backward(*outputs):
    torch.autograd.backward(outputs, [torch.randn_like(o) for o in outputs])


def norms():
    x = _randn(8, 256)
    weight, bias = _randn(256, dtype=f32), _randn(256, dtype=f32)  # fp32 parameters under autocast
    _backward(acc.rms_norm(x, weight), acc.layer_norm(x, weight, bias), acc.l2norm(_randn(8, 4, 32)))
    with torch.no_grad():  # the partials added in a second launch, as wide rows do on a GPU
        dy = _randn(8, 256, grad=False)
        rstd = torch.rand(8)  # the statistics the forward stores, fp32 per row
        rms_norm_triton.backward(dy, x, weight, 1e-6, None, rstd, launch=TWO_LAUNCH_BACKWARD)
        layer_norm_triton.backward(dy, x, weight, bias, 1e-5, None, torch.randn(8), rstd, launch=TWO_LAUNCH_BACKWARD)
    with torch.no_grad():  # the forward kernels without the statistics (infer), and with them (the custom ops' path)
        acc.rms_norm(x, weight), acc.layer_norm(x, weight, bias)
        rms_norm_triton.forward(x, weight, 1e-6), layer_norm_triton.forward(x, weight, bias, 1e-5)


def elementwise():
    _backward(acc.swiglu(_randn(8, 1024), _randn(8, 1024)), acc.dropout_add(_randn(8, 256), _randn(8, 256), p=0.1))


def add_norm_and_activation():
    """add_rms_norm / add_layer_norm forward (with and without statistics) and backward, both gradients flowing in, the
    partials added in the kernel and in a second launch; gelu (exact and tanh) and silu forward and backward."""
    x, residual = _randn(8, 256), _randn(8, 256)
    weight, bias = _randn(256, dtype=f32), _randn(256, dtype=f32)
    _backward(*acc.add_rms_norm(x, residual, weight), *acc.add_layer_norm(x, residual, weight, bias))
    with torch.no_grad():  # the partials added in a second launch
        dy, dnew = _randn(8, 256, grad=False), _randn(8, 256, grad=False)
        args = x, residual, weight, 1e-6
        add_norm_triton.rms_backward(dy, dnew, *args, *add_norm_triton.rms_forward(*args), launch=TWO_LAUNCH_BACKWARD)
        args = x, residual, weight, bias, 1e-5
        results = add_norm_triton.layer_forward(*args)
        add_norm_triton.layer_backward(dy, dnew, *args, *results, launch=TWO_LAUNCH_BACKWARD)
    with torch.no_grad():
        acc.add_rms_norm(x, residual, weight), acc.add_layer_norm(x, residual, weight, bias)
    x = _randn(8, 1024)
    _backward(acc.gelu(x), acc.gelu(x, "tanh"), acc.silu(x))


@contextlib.contextmanager
def _launched_as_on_a_gpu(*modules):
    """The launchers of `modules` set the flags a GPU launch sets (inline PTX) while the interpreter records them."""
    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            patch.setattr(module, "triton_interpret", lambda: False)
        yield


def linear():
    """The forward GEMM at each table entry (128 x 256 tiles at K = N = 256, 128 x 128 at K = 64, swiglu's two
    accumulators, narrow column blocks for few rows), saving the pre-activation and not (infer), K = 40 (masked K),
    and the backward's elementwise pass for every activation that has one, with and without dbias partials; with a
    GPU launch's flags (inline PTX)."""
    with _launched_as_on_a_gpu(linear_triton):
        _linear_cases()


def _linear_cases():
    for m, k, n, activation, bias in ((2048, 256, 256, "gelu", True), (256, 64, 256, "silu", False),
                                      (256, 256, 512, "swiglu", True), (37, 40, 64, "gelu_tanh", True),
                                      (37, 64, 64, "relu", True), (1, 4096, 4096, None, True)):  # fmt: skip
        rows = 2 * n if activation == "swiglu" else n
        x, w = _randn(m, k, grad=False), _randn(rows, k, grad=False)
        b = _randn(rows, grad=False) if bias else None
        y, z = linear_triton.forward(x, w, b, activation)
        linear_triton.infer(x, w, b, activation)
        linear_triton.preact_gradient(torch.randn_like(y), z, y, activation, bias)


def linear_persistent():
    """The Hopper persistent TMA forward (no CPU launch takes it by itself) at the shapes of its table: 128 x 128
    tiles over K = 256 (gelu, saving z; infer), swiglu's two accumulators and two z descriptors, a partial K block
    (K = 40) and narrow N, every other activation, bias and not; the tile loop flattened and not; the epilogue whole
    and in two column halves; with a GPU launch's flags (inline PTX)."""
    with _launched_as_on_a_gpu(linear_triton, linear_persistent_triton):
        _linear_persistent_cases()


def _linear_persistent_cases():
    for m, k, n, activation, bias in ((4096, 256, 1024, "gelu", True), (1024, 256, 512, "swiglu", True),
                                      (37, 40, 24, "gelu_tanh", False), (300, 64, 256, "silu", False),
                                      (300, 64, 256, "relu", True), (300, 64, 256, None, True)):  # fmt: skip
        rows = 2 * n if activation == "swiglu" else n
        x, w = _randn(m, k, grad=False), _randn(rows, k, grad=False)
        b = _randn(rows, grad=False) if bias else None
        linear_triton.forward(x, w, b, activation, persistent=True)
        linear_triton.infer(x, w, b, activation, persistent=True)
    x, w = _randn(4096, 256, grad=False), _randn(1024, 256, grad=False)
    cfg = linear_launch.persistent_forward_config(4096, 1024, 256)  # two programs an SM, the epilogue in halves
    one_program = cfg._replace(num_stages=4, subtile=False, per_sm=1, max_registers=None)
    linear_persistent_triton.launch(
        x, w, None, torch.empty(4096, 1024, dtype=bf16), torch.empty(0, dtype=bf16), "gelu", False, one_program, False
    )
    for activation, rows in (("gelu", 1024), ("swiglu", 2048)):  # the epilogue in two column halves, z saved
        w = _randn(rows, 256, grad=False)
        y, z = torch.empty(4096, 1024, dtype=bf16), torch.empty(4096, rows, dtype=bf16)
        subtiled = linear_launch.persistent_forward_config(4096, 1024, 256, activation == "swiglu")
        linear_persistent_triton.launch(x, w, None, y, z, activation, True, subtiled._replace(subtile=True), True)
    for saved in (False, True):  # the default: two programs an SM
        y, z = torch.empty(4096, 1024, dtype=bf16), torch.empty(4096 if saved else 0, 1024, dtype=bf16)
        linear_persistent_triton.launch(x, w[:1024], None, y, z, "gelu", saved, cfg, True)


def bce():
    logits, targets = _randn(576), torch.rand(576)  # one block: the reduction ends in the forward kernel
    _backward(acc.binary_cross_entropy_with_logits(logits, targets, pos_weight=torch.tensor(2.0)))
    logits, targets = _randn(5000), torch.rand(5000)  # two blocks: partial sums and _sum_partials_kernel
    _backward(acc.binary_cross_entropy_with_logits(logits, targets))  # dlogits written by the forward
    logits, targets = _randn(5000), torch.rand(5000, requires_grad=True)  # a target gradient: the backward kernel
    _backward(acc.binary_cross_entropy_with_logits(logits, targets))


def embedding_bag():
    weight = _randn(1000, 64, dtype=f32)
    _backward(acc.embedding_bag_mean(weight, torch.randint(0, 1000, (128, 8))))  # > CHUNK entries: both passes
    # ragged bags (offsets: the entry -> bag map), padding, and the sparse gradient: other specialisations
    # (autograd.grad, not backward: the kernels do not run here, so the sparse gradient's rows are
    # garbage, and accumulating it into weight.grad would read out of bounds)
    out = acc.embedding_bag_mean(
        weight, torch.randint(0, 1000, (400,)), torch.arange(0, 400, 5), padding_idx=3, sparse=True
    )
    torch.autograd.grad(out, weight, torch.randn_like(out))


def embedding_bag_collection():
    """Three tables of different widths in one launch forward, and the one-pass backward (its sort and segment
    passes), fixed and ragged bags."""
    weights = [_randn(1000, 64, dtype=f32), _randn(300, 24, dtype=f32), _randn(50, 200, dtype=f32)]
    values = torch.cat([torch.randint(0, n, (600,)) for n in (1000, 300, 50)])
    offsets = torch.arange(0, 1801, 10)  # 3 tables x 60 bags of 10
    _backward(acc.embedding_bag_collection(weights, values, offsets))


def embedding_bag_radix():
    """The radix sort's kernels over a 1M-row table (two 10-bit passes: the first and the last) from int32
    and int64 indices, and at the sweep's largest tile (2048 keys, 8 warps), over 2**26 rows (three 9-bit passes: a
    middle one), and the gradient kernels that find segment edges from the keys (FIRST=False, int32 permutation; 1000
    rows: one pass), dense and sparse (as embedding_bag)."""
    for dtype in (torch.int32, torch.int64):
        radix_sort.sort(torch.randint(0, 1_000_000, (32768,), dtype=dtype), 1_000_000)
    radix_sort.sort(torch.randint(0, 1_000_000, (32768,)), 1_000_000, radix_sort.RadixLaunch(tile=2048, num_warps=8))
    radix_sort.sort(torch.randint(0, 1 << 26, (4096,)), 1 << 26)
    weight = _randn(1000, 64, dtype=f32)
    _backward(acc.embedding_bag_mean(weight, torch.randint(0, 1000, (128, 8))))
    out = acc.embedding_bag_mean(
        weight, torch.randint(0, 1000, (400,)), torch.arange(0, 400, 5), padding_idx=3, sparse=True
    )
    torch.autograd.grad(out, weight, torch.randn_like(out))


def mhc():
    # n = 4 at a C multiple of 16 (vector loads), n = 8 (the widest tiles), C = 1000 (element-by-element loads); with
    # a GPU launch's flags (inline PTX)
    with _launched_as_on_a_gpu(mhc_triton):
        _mhc_cases()


def _mhc_cases():
    for n, C in ((4, 256), (8, 256), (4, 1000)):
        m = n * n + 2 * n
        x = _randn(2, 33, n, C)
        h_in, h_post, h_res = acc.mhc_pre(x, _randn(n * C, m, dtype=f32), _randn(3, dtype=f32), _randn(m, dtype=f32))
        _backward(acc.mhc_post(x, h_in, h_post, h_res))


def _attention(
    head_dim: int,
    causal: bool,
    with_lengths: bool,
    dropout_p: float,
    backward_tma: bool | None = None,
    kind: str | None = None,
):
    """The kernel module's launchers: the public op refuses bf16 on the CPU (interpreter dots), not on a GPU.
    backward_tma: True/False forces the backward kernels' descriptor path on/off with the tables' tiles, padded where
    the head dim would split (split loads take pointers; the interpreter never takes descriptors by itself); None runs
    the module's backward as autograd does, or with kind ("fused" / "split") that backward."""
    b, h, hkv, lq, lk = 2, 4, 2, 200, 200
    q, do = torch.randn(b, h, lq, head_dim).to(bf16), torch.randn(b, h, lq, head_dim).to(bf16)
    k, v = torch.randn(b, hkv, lk, head_dim).to(bf16), torch.randn(b, hkv, lk, head_dim).to(bf16)
    lengths = torch.tensor([lk, 77], dtype=torch.int32) if with_lengths else None
    args = (q, k, v, lengths, causal, head_dim**-0.5, dropout_p, torch.tensor([1234]) if dropout_p > 0 else None)
    o, lse = fa_triton.forward(*args)
    if backward_tma is None:
        fa_triton.backward(do, *args, o, lse, kind=kind)
    else:
        delta = torch.empty(q.shape[:3])
        dkdv, dq = (
            fa_triton.config(fa_triton.backward_kind(name, causal), head_dim, bf16)._replace(split_d=False)
            for name in ("dkdv", "dq")
        )
        fa_triton.backward_dq(do, *args, lse, delta, o=o, cfg=dq, tma=backward_tma)
        fa_triton.backward_dkdv(do, *args, lse, delta, cfg=dkdv, tma=backward_tma)


def attention_padded():
    _attention(head_dim=32, causal=False, with_lengths=True, dropout_p=0.0)


def attention_causal_dropout():
    _attention(head_dim=48, causal=True, with_lengths=False, dropout_p=0.1)


def attention_widest():
    """The widest head dim: the most shared memory (the forward needs ~224 KiB of the H100's 227)."""
    _attention(head_dim=128, causal=True, with_lengths=True, dropout_p=0.0)


def attention_tma_backward():
    """The backward kernels' TMA variants (dk/dv and dq) with the tables' tiles: at head dim 128 beside
    attention_widest's pointer launch, at 64 beside a pointer launch of its own, and padded (48 -> 64)."""
    _attention(head_dim=128, causal=True, with_lengths=True, dropout_p=0.0, backward_tma=True)
    for tma in (False, True):
        _attention(head_dim=64, causal=False, with_lengths=False, dropout_p=0.0, backward_tma=tma)
    _attention(head_dim=48, causal=False, with_lengths=True, dropout_p=0.0, backward_tma=True)


def attention_fused_backward():
    """The fused backward at every padded head dim with the table's tiles: dq stored (every key in one block) with
    causal + key lengths, and dq summed with atomics (two key blocks)."""
    for head_dim in (16, 32, 48, 128):
        block_n = fa_triton.config("fused", head_dim, bf16).block_n
        for lk, causal, lengths in ((block_n, True, [block_n, 77]), (block_n + 1, False, None)):
            q, do = torch.randn(2, 4, 90, head_dim).to(bf16), torch.randn(2, 4, 90, head_dim).to(bf16)
            k, v = torch.randn(2, 2, lk, head_dim).to(bf16), torch.randn(2, 2, lk, head_dim).to(bf16)
            key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths else None
            args = (q, k, v, key_lengths, causal, head_dim**-0.5, 0.0, None)
            fa_triton.backward_fused(do, *args, *fa_triton.forward(*args))


def attention_delta_in_dq():
    """The split backward (the dq kernel writes delta, the dk/dv kernel reads it): pointer loads at head dims 32 and
    48 (as the tables say: two column parts), descriptors at 128."""
    _attention(head_dim=32, causal=True, with_lengths=True, dropout_p=0.0, kind="split")
    _attention(head_dim=48, causal=False, with_lengths=False, dropout_p=0.1, kind="split")
    delta = torch.empty(2, 4, 200)
    q, do = torch.randn(2, 4, 200, 128).to(bf16), torch.randn(2, 4, 200, 128).to(bf16)
    k, v = torch.randn(2, 2, 200, 128).to(bf16), torch.randn(2, 2, 200, 128).to(bf16)
    args = (q, k, v, None, True, 128**-0.5, 0.0, None)
    o, lse = fa_triton.forward(*args)
    fa_triton.backward_dq(do, *args, lse, delta, o=o, tma=True)


def attention_lse_delta_tma():
    """The dk/dv kernel on its descriptor path reading lse and delta through descriptors too (BwdConfig.lse_delta_tma),
    with the table's tiles: at head dim 128 (causal, key lengths), at 128 with Lq % 4 != 0 (lse and delta fall back to
    pointer loads, the tiles keep descriptors), and padded (48 -> 64, not split) with dropout."""
    d64, d128 = (
        fa_triton.config("dkdv", d, bf16)._replace(tma=True, lse_delta_tma=True, split_d=False) for d in (64, 128)
    )
    for head_dim, lq, causal, dropout_p, cfg in ((128, 200, True, 0.0, d128), (128, 198, False, 0.0, d128),
                                                 (48, 200, False, 0.1, d64)):  # fmt: skip
        q, do = torch.randn(2, 4, lq, head_dim).to(bf16), torch.randn(2, 4, lq, head_dim).to(bf16)
        k, v = torch.randn(2, 2, 200, head_dim).to(bf16), torch.randn(2, 2, 200, head_dim).to(bf16)
        args = (
            q,
            k,
            v,
            torch.tensor([200, 77], dtype=torch.int32),
            causal,
            head_dim**-0.5,
            dropout_p,
            torch.tensor([1234]) if dropout_p > 0 else None,
        )
        o, lse = fa_triton.forward(*args)
        delta = (o.float() * do.float()).sum(-1)  # as the dq kernel writes it
        fa_triton.backward_dkdv(do, *args, lse, delta, cfg=cfg, tma=True)


def attention_split_d():
    """The forward holding a head dim as two column parts (FwdConfig.split_d, pointer loads) at the 16-bit table's
    tiles (the causal entry with its heavy_first), beside the padded forward through descriptors at the same tiles:
    48 = 32 + 16, causal and not; 80 = 64 + 16 with key lengths and dropout; 96 = 64 + 32 causal (split only)."""
    b, h, hkv, length = 2, 4, 2, 200
    for head_dim, causal, lengths, dropout_p, padded in (
        (48, False, None, 0.0, True),
        (48, True, None, 0.0, True),
        (80, True, [length, 77], 0.1, False),
        (96, True, None, 0.0, False),
    ):
        q = torch.randn(b, h, length, head_dim).to(bf16)
        k, v = torch.randn(b, hkv, length, head_dim).to(bf16), torch.randn(b, hkv, length, head_dim).to(bf16)
        key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths else None
        cfg = fa_triton.config("fwd_causal" if causal else "fwd", head_dim, bf16)
        args = (
            q,
            k,
            v,
            key_lengths,
            causal,
            head_dim**-0.5,
            dropout_p,
            torch.tensor([1234]) if dropout_p > 0 else None,
        )
        fa_triton.forward(*args, cfg=cfg._replace(split_d=True))
        if padded:
            fa_triton.forward(*args, cfg=cfg._replace(split_d=False), tma=True)


def attention_split_backward():
    """The dk/dv and dq kernels holding head dim 48 as 32 + 16 columns (BwdConfig.split_d, pointer loads) at the 16-bit
    tables' tiles, causal (with heavy_first and key lengths) and not, the dq kernel writing delta (DELTA_IN_DQ) and
    not; beside the padded launches at the same tiles and loads as the tables ask (the dk/dv kernel's descriptors)."""
    b, h, hkv, length, head_dim = 2, 4, 2, 200, 48
    for causal, lengths in ((False, None), (True, [length, 77])):
        q, do = torch.randn(b, h, length, head_dim).to(bf16), torch.randn(b, h, length, head_dim).to(bf16)
        k, v = torch.randn(b, hkv, length, head_dim).to(bf16), torch.randn(b, hkv, length, head_dim).to(bf16)
        key_lengths = torch.tensor(lengths, dtype=torch.int32) if lengths else None
        args = (q, k, v, key_lengths, causal, head_dim**-0.5, 0.0, None)
        o, lse = fa_triton.forward(*args)
        delta = torch.empty(b, h, length)
        for split in (True, False):
            dkdv, dq = (fa_triton.config(kind, head_dim, bf16)._replace(split_d=split) for kind in ("dkdv", "dq"))
            fa_triton.backward_dq(do, *args, lse, delta, o=o, cfg=dq, tma=dq.tma)
            fa_triton.backward_dkdv(do, *args, lse, delta, cfg=dkdv, tma=dkdv.tma)
        fa_triton.backward_dq(do, *args, lse, delta, tma=True)  # the table's split entry, delta given, tma asked for


def attention_varlen():
    """Packed sequences (VARLEN: pointer loads, per-sequence row offsets), the kernel module's launchers (bf16, see
    _attention), forward and split backward: head dim 48 (split columns in the forward and dq kernels) causal with
    dropout and GQA, and 64 plain."""
    cu = torch.tensor([0, 0, 1, 130, 333], dtype=torch.int32)
    for head_dim, causal, dropout_p, hkv in ((48, True, 0.1, 2), (64, False, 0.0, 4)):
        q, do = torch.randn(333, 4, head_dim).to(bf16), torch.randn(333, 4, head_dim).to(bf16)
        k, v = torch.randn(333, hkv, head_dim).to(bf16), torch.randn(333, hkv, head_dim).to(bf16)
        seed = torch.tensor([1234]) if dropout_p > 0 else None
        args = (q, k, v, cu, cu, 203, 203, causal, head_dim**-0.5, dropout_p, seed)
        o, lse = fa_triton.varlen_forward(*args)
        fa_triton.varlen_backward(do, *args, o, lse)


def silu_attention():
    """The forward and the three backward kernels through the kernel module's launchers (bf16 on the CPU: see
    _attention) with the flags a GPU launch sets (inline PTX: clz and tanh.approx): bf16 at head dim 32 with every
    feature (targets, both biases, dropout), fp32 at 64 not causal with a shared position bias, bf16 at 128 causal
    without biases; and the forward at the benchmark's flags (bf16, 32, causal, both biases, no targets or dropout)."""
    from runtime.accelerators.silu_attention import triton as silu_triton

    forward_module = importlib.import_module("runtime.accelerators.silu_attention.triton_forward")
    cu = torch.tensor([0, 0, 70, 270], dtype=torch.int32)
    with _launched_as_on_a_gpu(forward_module):
        for d, dtype, causal, features in ((32, bf16, True, True), (64, f32, False, False), (128, bf16, True, None)):
            q, k, v, do = (torch.randn(270, 4, d).to(dtype) for _ in range(4))
            targets = torch.tensor([0, 5, 9], dtype=torch.int32) if features else None
            position = None if features is None else torch.randn(4, 300) if features else torch.randn(300).expand(4, -1)
            time, timestamps = (torch.randn(4, 20), torch.randint(0, 10**6, (270,))) if features else (None, None)
            args = (cu, targets, position, time, timestamps, torch.tensor([1234]) if features else None, 200,
                    d**-0.5, causal, 0.1 if features else 0.0)  # fmt: skip
            silu_triton.forward(q, k, v, *args)
            silu_triton.backward(do, q, k, v, *args)
        q, k, v = (torch.randn(270, 4, 32).to(bf16) for _ in range(3))
        timestamps = torch.randint(0, 10**6, (270,))
        silu_triton.forward(q, k, v, cu, None, torch.randn(4, 300), torch.randn(4, 20), timestamps, None, 200,
                            32**-0.5, True, 0.0)  # fmt: skip


def _delta_rule_inputs(B, T, H, HV, K, V, sequences=None, dtype=bf16):
    q, k = (
        F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype),
        F.normalize(torch.randn(B, T, H, K), dim=-1).to(dtype),
    )
    n = B if sequences is None else len(sequences) - 1
    return dict(
        q=q, k=k, v=torch.randn(B, T, HV, V).to(dtype),
        g=F.logsigmoid(torch.randn(B, T, HV)).to(dtype), beta=torch.rand(B, T, HV).to(dtype),
        initial_state=torch.randn(n, HV, K, V), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=None if sequences is None else torch.tensor(sequences),
    )  # fmt: skip


def _chunk_delta_rule(inputs: dict, tuning) -> tuple:
    """The chunked Triton kernels with these variants (gdr_triton.Tuning), forward and backward through autograd."""
    run = differentiable(
        functools.partial(gdr_triton.chunk_forward, tuning=tuning),
        functools.partial(gdr_backward.chunk_backward, tuning=tuning),
        2,
    )
    x, cu = inputs, inputs["cu_seqlens"]
    return run(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, x["initial_state"], x["output_final_state"],
        x["use_qk_l2norm_in_kernel"], None if cu is None else cu.to(torch.int64),
    )  # fmt: skip


def gated_delta_rule(tuning=None):
    """The op's kernels at K = 16, 64 and 128; with tuning (a gdr_triton.Tuning), the chunked ones with those variants."""
    if tuning is None:
        acc.fused_recurrent_gated_delta_rule(
            **_delta_rule_inputs(1, 63, 2, 4, 64, 64, sequences=[0, 20, 63])
        )  # forward-only
    cases = [
        _delta_rule_inputs(2, 200, 4, 4, 16, 16),  # PCVR's K = 16; HV = H: the final dtypes written by the kernels
        _delta_rule_inputs(2, 200, 2, 4, 64, 64),
        _delta_rule_inputs(1, 200, 1, 2, 128, 128, sequences=[0, 70, 200]),
        _delta_rule_inputs(1, 100, 1, 1, 128, 16),  # K = 128, V = 16: the reverse walk's masked V block
    ]
    for inputs in cases:
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            inputs[name].requires_grad_()
        if tuning is None:
            _backward(*acc.chunk_gated_delta_rule(**inputs))  # the forward and backward kernels
        else:
            _backward(*_chunk_delta_rule(inputs, tuning))


def gated_delta_rule_grad_wy_variants():
    """The backward's step 5 as each variant (Tuning.grad_wy), at the shapes of gated_delta_rule (K = 16, 64, 128)."""
    for variant in ("single", "fused"):
        gated_delta_rule(gdr_triton.Tuning(grad_wy=variant))


def sampling():
    """top_k through one program per row (bf16, k = 100; the select with its threshold filter and without) and split
    rows (fp32, k = 2048, smallest), and sample's draw at top_k = 50."""
    from runtime.accelerators.sampling import triton as sampling_triton

    x = torch.randn(4, 5000).to(bf16)
    sampling_triton.top_k_forward(x, 100, True)
    sampling_triton.top_k_forward(x, 100, True, filter=False)
    sampling_triton.top_k_forward(x, 100, True, filter_launch=sampling_triton.FilterLaunch(step=16384, stages=2))
    sampling_triton.top_k_forward(x.float(), 2048, False, segments=2)
    ones = torch.ones(4)
    sampling_triton.sample_forward(x, torch.full((4,), 50, dtype=torch.int32), 50, ones, ones, torch.rand(4))


def sampling_filter_tiles():
    """top_k's filter in its full-tile formulation (FilterLaunch.tiles) on aligned rows, as 1M-wide ones are: bf16 and
    fp32 at 16 warps, bf16 at 8 warps over split rows (the candidates' pass with indices)."""
    from runtime.accelerators.sampling import triton as sampling_triton

    x = torch.randn(4, 8192).to(bf16)
    for launch in (sampling_triton.FilterLaunch(tiles=4), sampling_triton.FilterLaunch(tiles=2, warps=8)):
        sampling_triton.top_k_forward(x, 64, True, filter_launch=launch)
        sampling_triton.top_k_forward(x.float(), 64, True, filter_launch=launch)
    sampling_triton.top_k_forward(x, 100, True, segments=2, filter_launch=sampling_triton.FilterLaunch(tiles=4))


def gated_delta_rule_half_backward():
    """The backward with its products on bf16 or tf32 operands forced (Tuning.half_backward; by default it depends on
    K), each step-5 variant, at the shapes of gated_delta_rule (K = 16, 64, 128)."""
    for half in (True, False):
        for variant in ("single", "fused"):
            gated_delta_rule(gdr_triton.Tuning(grad_wy=variant, half_backward=half))


def gated_delta_rule_fp16_storage():
    """fp16 inputs with their intermediates and product operands in fp16 (Tuning.fp16_storage), forward and backward,
    at K = 16, 64 and 128 (V = 128: the WY kernel and the fused step 5 with HALF fp16, T = (I + A)^-1 in fp16)."""
    fp16 = gdr_triton.Tuning(fp16_storage=True)
    for shape in ((2, 200, 4, 4, 16, 16), (2, 200, 2, 4, 64, 64), (1, 200, 1, 2, 128, 128)):
        inputs = _delta_rule_inputs(*shape, dtype=torch.float16)
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            inputs[name].requires_grad_()
        _backward(*_chunk_delta_rule(inputs, fp16))


def gated_delta_rule_one_wave():
    """gated_delta_rule as on a GPU of 132 SMs (sm_count is 0 on the CPU): the launches of grids of at most one
    program per SM, the forward walk's 4 stages and the reverse walk's BV 32 at K = 128."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gdr_shared, "sm_count", lambda device: 132)
        patch.setattr(gdr_backward, "sm_count", lambda device: 132)
        gated_delta_rule()


def gated_delta_rule_fp32_widest():
    """fp32 at K = V = 128, forward: the launcher pipelines fewer stages there to fit shared memory.
    (Its backward is left out: the fp32 chunk-gradient kernel alone takes ~100 s to compile.)"""
    acc.chunk_gated_delta_rule(**_delta_rule_inputs(1, 128, 1, 2, 128, 128, dtype=f32))


def gated_delta_rule_split():
    """The context-parallel split (forced: the occupancy rule decides on a GPU), forward and backward: segment
    maps and the chain both ways at K = V = 128 (the widest maps), varlen; fp32 forward (IEEE dots in the chain)."""
    split = gdr_triton.Tuning(segment_chunks=2)
    inputs = _delta_rule_inputs(1, 600, 1, 1, 128, 128, sequences=[0, 100, 600])
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        inputs[name].requires_grad_()
    _backward(*_chunk_delta_rule(inputs, split))
    with torch.no_grad():
        _chunk_delta_rule(_delta_rule_inputs(2, 300, 1, 1, 64, 32, dtype=f32), split)


CASES = {
    "norms": norms,
    "elementwise": elementwise,
    "add_norm_and_activation": add_norm_and_activation,
    "bce": bce,
    "linear": linear,
    "linear_persistent": linear_persistent,
    "embedding_bag": embedding_bag,
    "embedding_bag_radix": embedding_bag_radix,
    "embedding_bag_collection": embedding_bag_collection,
    "mhc": mhc,
    "attention_padded": attention_padded,
    "attention_causal_dropout": attention_causal_dropout,
    "attention_widest": attention_widest,
    "attention_tma_backward": attention_tma_backward,
    "attention_fused_backward": attention_fused_backward,
    "attention_delta_in_dq": attention_delta_in_dq,
    "attention_lse_delta_tma": attention_lse_delta_tma,
    "attention_split_d": attention_split_d,
    "attention_split_backward": attention_split_backward,
    "attention_varlen": attention_varlen,
    "silu_attention": silu_attention,
    "sampling": sampling,
    "sampling_filter_tiles": sampling_filter_tiles,
    "gated_delta_rule": gated_delta_rule,
    "gated_delta_rule_grad_wy_variants": gated_delta_rule_grad_wy_variants,
    "gated_delta_rule_half_backward": gated_delta_rule_half_backward,
    "gated_delta_rule_one_wave": gated_delta_rule_one_wave,
    "gated_delta_rule_fp32_widest": gated_delta_rule_fp32_widest,
    "gated_delta_rule_split": gated_delta_rule_split,
    "gated_delta_rule_fp16_storage": gated_delta_rule_fp16_storage,
}


# --------------------------------------------------------------------------- recording and compiling


class LaunchRecorder:
    """Stands in for InterpretedFunction.run: records what a GPU launch would compile, runs nothing."""

    def __init__(self):
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders: dict[int, tuple[JITFunction, object]] = {}
        self.launches: dict[str, dict] = {}  # a key per distinct specialisation
        self.case = ""

    def run(self, kernel: InterpretedFunction, *args, grid, warmup, **kwargs):
        if id(kernel) not in self.binders:
            jit = JITFunction(kernel.fn, **kernel.kwargs)  # same decorator arguments as on the GPU
            self.binders[id(kernel)] = jit, create_function_from_signature(jit.signature, jit.params, self.backend)
        jit, binder = self.binders[id(kernel)]
        bound, specialization, options = binder(*args, **kwargs)
        with warnings.catch_warnings():  # 3.9 parses the options here and warns about an fp-fusion default
            warnings.simplefilter("ignore", UserWarning)
            _, signature, constexprs, attrs = jit._pack_args(self.backend, kwargs, bound, specialization, options)
        launch = dict(
            module=kernel.fn.__module__, name=kernel.fn.__name__, signature=signature,
            constexprs=constexprs, attrs=attrs, options=dict(options), case=self.case,
        )  # fmt: skip
        key = repr({k: v for k, v in launch.items() if k != "case"})
        self.launches.setdefault(key, launch)


def _compile_all(launches: list[dict], tmp: Path) -> list[dict]:
    (tmp / "launches.pkl").write_bytes(pickle.dumps(launches))
    # strict and real: no interpreter, and no leniency for non-constexpr globals (a GPU run has none)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")}
    # TAAC_SM90_TRITON: a folder holding another Triton to compile with (.ci/run puts the GPU machine's 3.6 there)
    paths = [os.environ.get("TAAC_SM90_TRITON", ""), str(Path(runtime.__file__).parents[1]), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default; silences 3.9's warning
    done = subprocess.run(
        [sys.executable, str(COMPILER), str(tmp / "launches.pkl"), str(tmp / "results.pkl")],
        env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, f"sm90_compile.py failed:\n{done.stdout}\n{done.stderr}"
    return pickle.loads((tmp / "results.pkl").read_bytes())


def compile_cases(cases: dict, tmp: Path) -> dict[str, list[tuple[dict, dict]]]:
    """Kernel id -> [(launch, result)] for every distinct specialisation that `cases` launch."""
    recorder = LaunchRecorder()
    with pytest.MonkeyPatch.context() as patch, acc.use_accelerators(default="triton", fallback="error"):
        patch.setattr(InterpretedFunction, "run", lambda kernel, *a, **kw: recorder.run(kernel, *a, **kw))
        for name, case in cases.items():
            recorder.case = name
            torch.manual_seed(0)
            case()
    launches = list(recorder.launches.values())
    results = _compile_all(launches, tmp)
    by_kernel: dict[str, list[tuple[dict, dict]]] = {}
    for launch, result in zip(launches, results):
        short = launch["module"].removeprefix("runtime.accelerators.").removesuffix(".triton")
        by_kernel.setdefault(f"{short}.{launch['name']}", []).append((launch, result))
    return by_kernel


def _compile_into(folder: Path) -> None:
    (folder / "compiled.pkl").write_bytes(pickle.dumps(compile_cases(CASES, folder)))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[tuple[dict, dict]]]:
    return pickle.loads((built_once(tmp_path_factory, "sm90", _compile_into) / "compiled.pkl").read_bytes())


def constexprs(launch: dict) -> dict:
    names = list(launch["signature"])
    return {names[path[0]]: value for path, value in launch["constexprs"].items()}


def _describe(launch: dict) -> str:
    arguments = {name: kind for name, kind in launch["signature"].items() if kind != "constexpr"}
    return f"case {launch['case']!r}: {arguments} constexprs {constexprs(launch)} options {launch['options']}"


def test_the_modules_have_kernels():
    assert len(KERNELS) >= 20, sorted(KERNELS)


@pytest.mark.slow
def test_every_launch_is_of_a_listed_kernel(compiled):
    assert set(compiled) <= set(KERNELS), (
        f"launched but not found by launched_kernels(): {set(compiled) - set(KERNELS)}"
    )


def test_the_backward_attention_kernels_compile_both_paths(compiled):
    """attention_tma_backward forces the descriptor path (no CPU launch takes it by itself)."""
    for kernel in ("flash_attention.triton_dkdv._bwd_dkdv_kernel", "flash_attention.triton_dq._bwd_dq_kernel"):
        launches = [launch for launch, _ in compiled[kernel] if launch["case"] == "attention_tma_backward"]
        assert {constexprs(launch)["TMA"] for launch in launches} == {False, True}, kernel


def test_the_gated_delta_rule_backward_kernels_compile_both_operand_dtypes(compiled):
    """gated_delta_rule_half_backward compiles the backward's kernels with bf16 operands (HALF "bf16"), the others
    without (but the single step-5 kernel, _chunk_grad_wy_kernel, which takes tf32 always: see Tuning.half_backward,
    and the fused one at K = 16: Tuning.half_step5); gated_delta_rule_fp16_storage with fp16 operands."""
    names = (
        "triton_backward._chunk_local_grad_kernel",
        "triton_backward._state_grad_kernel",
        "triton_backward._chunk_grad_qk_state_kernel",
        "triton_backward_wy._chunk_grad_wy_fused_kernel",
    )
    assert all(
        "HALF" not in constexprs(launch)
        for launch, _ in compiled["gated_delta_rule.triton_backward_wy._chunk_grad_wy_kernel"]
    )
    for name in names:
        kernel = f"gated_delta_rule.{name}"
        assert {constexprs(launch)["HALF"] for launch, _ in compiled[kernel]} == {"", "bf16", "fp16"}, kernel
        on = {constexprs(launch)["K"] for launch, _ in compiled[kernel] if constexprs(launch)["HALF"]}
        expected = {64, 128} if name.endswith("_fused_kernel") else {16, 64, 128}
        assert on == expected, f"{kernel}: HALF compiled at K = {sorted(on)}, expected {sorted(expected)}"


def test_the_sampling_select_compiles_with_and_without_the_filter(compiled):
    """The select over rows, with the threshold filter (the default) and without; over split rows' candidates with;
    the filter at its default launch, at a wider, pipelined one and in its full-tile formulation."""
    launches = [constexprs(launch) for launch, _ in compiled["sampling._select"]]
    assert {(c["HAS_IDX"], c["FILTER"]) for c in launches} == {(False, True), (False, False), (True, True)}
    filters = {
        (c["BLOCK"], c["STAGES"], c["TILES"], c["HAS_IDX"])
        for c in map(constexprs, (launch for launch, _ in compiled["sampling.triton_filter._filter_segment"]))
    }
    assert {(4096, 1, 0, False), (16384, 2, 0, False), (4096, 1, 4, False), (4096, 1, 4, True)} <= filters


def test_silu_attention_compiles_the_gpu_path(compiled):
    """The silu_attention case records a GPU launch's flags: inline PTX (clz for the time buckets) everywhere,
    tanh.approx for 16-bit inputs only; and the forward's unmasked loop at the benchmark's flags."""
    launches = [constexprs(launch) for kernel, runs in compiled.items() if kernel.startswith("silu_attention.")
                for launch, _ in runs]  # fmt: skip
    assert launches and all(c["PTX"] for c in launches)
    assert {c["TANH_APPROX"] for c in launches} == {False, True}
    forward = [constexprs(launch) for launch, _ in compiled["silu_attention.triton_forward._fwd_kernel"]]
    assert any(c["CAUSAL"] and c["HAS_TIME"] and not c["DROPOUT"] and not c["HAS_TARGETS"] for c in forward)


def test_the_dq_kernel_compiles_writing_delta(compiled):
    """attention_delta_in_dq compiles the dq kernel that writes delta, with pointer loads and with descriptors."""
    launches = [constexprs(launch) for launch, _ in compiled["flash_attention.triton_dq._bwd_dq_kernel"]]
    assert {c["TMA"] for c in launches if c["WRITE_DELTA"]} == {False, True}


def test_the_dkdv_kernel_compiles_reading_lse_and_delta_through_descriptors(compiled):
    """attention_lse_delta_tma compiles the dk/dv kernel's descriptor path with lse and delta through descriptors (head
    dims 128 and 48) and through pointers (128, Lq % 4 != 0); no launch takes descriptors for lse and delta without
    the tiles'."""
    launches = [constexprs(launch) for launch, _ in compiled["flash_attention.triton_dkdv._bwd_dkdv_kernel"]]
    variants = {(c["HEAD_DIM"], c["TMA"], c["LSE_DELTA_TMA"]) for c in launches}
    assert {(128, True, True), (128, True, False), (48, True, True)} <= variants
    assert not any(c["LSE_DELTA_TMA"] and not c["TMA"] for c in launches)


def test_the_forward_compiles_split_head_dims(compiled):
    """attention_split_d compiles the forward with the head dim as two column parts (D_HI > 0, pointer loads: 48, 80
    and 96) beside the padded forward through descriptors at head dim 48."""
    launches = [constexprs(launch) for launch, _ in compiled["flash_attention.triton_forward._fwd_kernel"]]
    split = {(c["HEAD_DIM"], c["BLOCK_D"], c["D_HI"], c["TMA"], c["CAUSAL"]) for c in launches if c["D_HI"]}
    expected = {(48, 32, 16, False, causal) for causal in (False, True)}
    assert expected | {(80, 64, 16, False, True), (96, 64, 32, False, True)} == split
    padded = {(c["HEAD_DIM"], c["BLOCK_D"], c["TMA"]) for c in launches if not c["D_HI"]}
    assert (48, 64, True) in padded


def test_the_backward_compiles_split_head_dims(compiled):
    """attention_split_backward compiles the dk/dv and dq kernels with head dim 48 as two column parts (D_HI > 0,
    pointer loads even where tma is asked for), causal and not, the dq kernel writing delta and not; beside the padded
    launches at the same tiles."""
    for kernel, write_delta in (("triton_dkdv._bwd_dkdv_kernel", (None,)), ("triton_dq._bwd_dq_kernel", (False, True))):
        launches = [constexprs(launch) for launch, _ in compiled[f"flash_attention.{kernel}"]]
        split = {(c["HEAD_DIM"], c["BLOCK_D"], c["D_HI"], c["TMA"], c["CAUSAL"], c.get("WRITE_DELTA")) for c in launches
                 if c["D_HI"]}  # fmt: skip
        assert {(48, 32, 16, False, causal, w) for causal in (False, True) for w in write_delta} <= split, kernel
        assert all(c["HEAD_DIM"] == 48 for c in launches if c["D_HI"]), kernel
        padded = {(c["HEAD_DIM"], c["BLOCK_D"], c["CAUSAL"]) for c in launches if not c["D_HI"]}
        assert {(48, 64, causal) for causal in (False, True)} <= padded, kernel


def test_the_attention_kernels_compile_for_packed_sequences(compiled):
    """attention_varlen compiles the forward, dq and dk/dv kernels with VARLEN (never with descriptors)."""
    for kernel in ("triton_forward._fwd_kernel", "triton_dq._bwd_dq_kernel", "triton_dkdv._bwd_dkdv_kernel"):
        launches = [constexprs(launch) for launch, _ in compiled[f"flash_attention.{kernel}"]]
        assert {c["HEAD_DIM"] for c in launches if c["VARLEN"]} == {48, 64}, kernel
        assert not any(c["VARLEN"] and c["TMA"] for c in launches), kernel


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.slow
def test_compiles_for_sm90(kernel, compiled):
    assert kernel in compiled, f"{kernel}: no case in CASES launches it; add one at a typical shape"
    for launch, result in compiled[kernel]:
        assert "error" not in result, f"{kernel} does not compile for sm_90 ({_describe(launch)}):\n{result['error']}"
        assert result["shared"] <= H100_SHARED_BYTES, (
            f"{kernel} needs {result['shared']} bytes of shared memory, the H100 has {H100_SHARED_BYTES} ({_describe(launch)})"
        )


def test_the_linear_forward_compiles_persistent_with_tma_and_wgmma(compiled):
    """linear_persistent compiles the Hopper forward for every activation, saving z and not, with the epilogue whole
    and split, and its PTX loads and stores through TMA (cp.async.bulk.tensor, both directions) and multiplies with
    wgmma."""
    launches = compiled["linear.triton_persistent._linear_forward_persistent"]
    variants = {(constexprs(launch)["ACT"], constexprs(launch)["SAVE"]) for launch, _ in launches}
    assert {act for act, _ in variants} == set(range(6)) and {save for _, save in variants} == {False, True}
    assert {constexprs(launch)["SUBTILE"] for launch, _ in launches} == {False, True}
    for launch, result in launches:
        assert "error" not in result, f"{_describe(launch)}:\n{result['error']}"
        assert result["ptx_markers"] == list(PTX_MARKERS), f"{result['ptx_markers']}: {_describe(launch)}"


def test_the_default_linear_forward_leaves_room_for_two_programs_an_sm(compiled):
    """The persistent forward's default launch (two programs an SM, at most 128 registers a thread, the epilogue in
    halves) must fit two programs of 256 threads on an SM: the register cap held and half of the SM's shared memory
    each, z saved or not."""
    launches = [
        (launch, result)
        for launch, result in compiled["linear.triton_persistent._linear_forward_persistent"]
        if launch["options"].get("maxnreg") == 128
    ]
    assert {constexprs(launch)["SAVE"] for launch, _ in launches} == {False, True}, [_describe(l) for l, _ in launches]
    for launch, result in launches:
        flags = constexprs(launch)
        assert flags["SUBTILE"] and flags["PTX"] and launch["options"]["num_warps"] == 8, _describe(launch)
        # the cap may cost a few spilled registers (16 bytes with gelu saving z under Triton 3.6), no more
        assert result["registers"] <= 128 and result["stack_bytes"] <= 32, f"{result}: {_describe(launch)}"
        room = SM_SHARED_BYTES // 2 - 1024  # each block also reserves 1 KiB
        assert result["shared"] <= room, f"{result['shared']} bytes shared: {_describe(launch)}"
