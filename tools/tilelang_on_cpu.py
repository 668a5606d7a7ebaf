"""Run TileLang kernels written thread by thread (SIMT: T.get_thread_binding, shared memory, barriers, atomics), or
elementwise over fragments with block reductions, on the CPU, from the CUDA source TileLang generates for sm_90a: no
GPU needed.

The source is compiled with g++ against tilelang_simt_shim.h (each CUDA thread a fiber run to its next barrier in
turn, the blocks one after another; with --tsan one std::thread per CUDA thread and a std::barrier per block) and
called through ctypes on CPU tensors. It checks the kernels' logic and, with --tsan (ThreadSanitizer), their
barriers: a shared-memory access left unordered by __syncthreads is reported. It models neither warps nor the GPU's
memory model, and tile operations (T.gemm, T.copy to shared, TMA, warp specialisation) are out of its reach: the GPU
tier stays the judge.

    PYTHONPATH=$PWD/src python tools/tilelang_on_cpu.py sampling|linear|add_norm|mhc|silu_attention [--tsan]

linear: the activations of the kernels' CUDA prelude in fp32 against float64, and the backward's elementwise kernel
(every activation, programs of one and of two row steps, with and without a bias) against autograd in float64.
sampling: top_k of the TileLang backend against the exact reference (random, tied, all-equal, sorted, NaN / signed
zeros / infinities, both directions, each dtype, split rows and their candidates merged in rounds, k = 2048; the
select with and without its threshold filter, and its fallback where more entries pass than the scratch holds) and
sample's ids against reference.restricted_draw.
add_norm: the add_rms_norm / add_layer_norm forward on fp32 rows near 1e30 (squares past fp32) and ordinary ones.
mhc: mhc_pre's forward, backward and dphi kernels (fp32) against autograd of the reference in float64, on ordinary
inputs and on res logits spread past exp's range.
silu_attention: the dk/dv kernel's bias-gradient sums (its macros, grid and query-block loop, fed given ds tiles in
place of its tensor-core products) reduced by the launcher, against float64 sums; causal or not, each bias alone and
both, bf16 and fp16, empty and multi-block sequences; repeatable bit for bit.
Needs g++ (C++20) and nvcc (TileLang compiles the kernel first). Slow on few cores: a minute or more per kernel shape.
"""

import argparse
import ctypes
import hashlib
import math
import os
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(tempfile.gettempdir(), "tilelang_on_cpu")
# prim_func name -> (its runtime arguments by name) -> (blocks in x, blocks in y): the grid, which TileLang's host code
# computes (it is not in the kernel source)
SAMPLING_GRIDS = {
    "sampling_select": lambda v: (v["R"], -(-v["W"] // v["seg_len"])),
    "sampling_sort": lambda v: (v["R"], 1),
    "sampling_draw": lambda v: (v["R"], 1),
}


class CpuKernel:
    """One compiled entry (key, build) as a CPU function taking the prim_func's arguments in order."""

    def __init__(self, entry, grids: dict, tsan: bool):
        import tilelang

        from runtime.accelerators.tilelang_common import SM90A, device_info

        self.func = entry[1](device_info(None))
        self.grid = grids[str(self.func.attrs["global_symbol"])]
        source = tilelang.compile(self.func, target=SM90A).get_kernel_source()
        found = re.search(r"__launch_bounds__\((\d+), \d+\) (\w+)\(([^)]*)\)", source)
        threads, name = int(found.group(1)), found.group(2)
        params = [p.replace("__restrict__", "").strip().rsplit(" ", 1) for p in found.group(3).split(",")]
        self.names = [name for _, name in params]
        self.types = {name: kind for kind, name in params}
        args = ", ".join(f"({t})args[{i}]" if "*" in t else f"*({t}*)args[{i}]" for i, (t, _) in enumerate(params))
        code = (
            '#include "tilelang_simt_shim.h"\n#define __align__(n) alignas(n)\n'
            + self._portable(source)
            + f'\nextern "C" void run(int gx, int gy, void** args) {{\n'
            f"  launch_blocks(gx, gy, {threads}, [=] {{ {name}({args}); }});\n}}\n"
        )
        self.lib = ctypes.CDLL(self._build(code, tsan))
        self.lib.run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]

    @staticmethod
    def _portable(source: str) -> str:
        source = re.sub(r"#if defined\(_MSC_VER\).*?#endif\n", "", source, flags=re.S)
        source = re.sub(r"#ifdef ENABLE_BF16.*?#endif\n", "", source, flags=re.S)
        source = re.sub(r"#include.*\n", "", source)
        return re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)g_shmem;", source)

    @staticmethod
    def _build(code: str, tsan: bool) -> str:
        os.makedirs(BUILD, exist_ok=True)
        with open(os.path.join(HERE, "tilelang_simt_shim.h")) as f:
            shim = f.read()
        digest = hashlib.sha1((code + shim + str(tsan)).encode()).hexdigest()[:16]
        library = os.path.join(BUILD, f"{digest}.so")
        if not os.path.exists(library):
            path = os.path.join(BUILD, f"{digest}.cpp")
            with open(path, "w") as f:
                f.write(code)
            flags = ["-fsanitize=thread", "-O1", "-g"] if tsan else ["-O2"]
            command = ["g++", "-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-w", *flags]
            subprocess.run([*command, "-I", HERE, path, "-o", library], check=True)
        return library

    def __call__(self, *args):
        values, keep = {}, []
        for param, arg in zip(self.func.params, args):
            if param in self.func.buffer_map:
                buffer = self.func.buffer_map[param]
                if not arg.is_contiguous() or arg.device.type != "cpu":
                    raise ValueError(f"{buffer.name}: expected a contiguous CPU tensor")
                values[buffer.name] = ctypes.c_void_p(arg.data_ptr())
                for dim, size in zip(buffer.shape, arg.shape):
                    if hasattr(dim, "name"):
                        values[dim.name] = size
            else:
                values[param.name] = arg
        pointers = (ctypes.c_void_p * len(self.names))()
        for i, name in enumerate(self.names):
            value = values[name]
            if not isinstance(value, ctypes.c_void_p):
                value = ctypes.c_float(value) if self.types[name] == "float" else ctypes.c_int(int(value))
                keep.append(value)
                value = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
            pointers[i] = value.value
        gx, gy = self.grid(values)
        self.lib.run(gx, gy, pointers)


def cpu_launcher(grids: dict, tsan: bool = False):
    """A launch(entry, device) for the kernel modules' host functions that runs the kernels on the CPU (grids: as
    SAMPLING_GRIDS)."""
    kernels = {}

    def launch(entry, device):
        if entry[0] not in kernels:
            kernels[entry[0]] = CpuKernel(entry, grids, tsan)
        return kernels[entry[0]]

    return launch


# --------------------------------------------------------------------------- sampling


def check_sampling(tsan: bool) -> bool:
    from runtime.accelerators.sampling import tilelang as kernels
    from runtime.accelerators.sampling.reference import restricted_draw, top_k_reference

    launch = cpu_launcher(SAMPLING_GRIDS, tsan)
    torch.manual_seed(0)
    failures = []

    def top_k(x, k, largest, segments=None, **select):
        """select: the select's filter and capacity (the launchers' defaults where absent)."""
        values, indices = kernels.top_k_forward(x, k, largest, segments, launch=launch, **select)
        ref_values, ref_indices = top_k_reference(x, k, largest)
        same = torch.equal(indices, ref_indices) and torch.equal(values.nan_to_num(7.0), ref_values.nan_to_num(7.0))
        label = f"top_k {tuple(x.shape)} {x.dtype} k={k} largest={largest} segments={segments} {select}"
        print(label, "ok" if same else "DIFFERS", flush=True)
        if not same:
            failures.append(label)

    def draw(logits, keep_k, temperature, top_p):
        uniforms = torch.rand(logits.shape[0])
        max_k = int(keep_k.max())
        ids = kernels.sample_forward(logits, keep_k, max_k, temperature, top_p, uniforms, launch=launch)
        values, indices = top_k_reference(logits, max_k)
        same = torch.equal(ids, restricted_draw(values, indices, keep_k, temperature, top_p, uniforms))
        label = f"sample {tuple(logits.shape)} {logits.dtype} max_k={max_k}"
        print(label, "ok" if same else "DIFFERS", flush=True)
        if not same:
            failures.append(label)

    if tsan:  # one small case per kernel and select path: ThreadSanitizer is slow
        top_k(torch.randint(-2, 3, (1, 300)).float(), 40, True, segments=3)
        top_k(torch.randint(-2, 3, (1, 300)).float(), 40, True, segments=3, filter=False)
        top_k(torch.randn(1, 300), 40, False, capacity=39)
        draw(torch.randn(1, 300), torch.full((1,), 30, dtype=torch.int32), torch.ones(1), torch.full((1,), 0.8))
        return not failures
    kinds = {
        "random": lambda shape: torch.randn(shape),
        "tied": lambda shape: torch.randint(-3, 4, shape).float(),
        "equal": lambda shape: torch.full(shape, 0.5),
        "ascending": lambda shape: torch.sort(torch.randn(shape)).values,
        "descending": lambda shape: torch.sort(torch.randn(shape), descending=True).values,
    }
    for make in kinds.values():
        for k in (1, 5, 37):
            for largest in (True, False):
                top_k(make((3, 37)), k, largest)
    # both select paths over rows of two 4096-entry steps (groups of two entries), and the fallback: a capacity
    # below k, and one just below (k - 1: overflow) or at (k: fits) what an all-equal row keeps
    for make in kinds.values():
        x = make((2, 8000))
        for largest in (True, False):
            top_k(x, 40, largest)
            top_k(x, 40, largest, filter=False)
        top_k(x, 40, True, capacity=39)
    top_k(kinds["equal"]((2, 8000)), 40, False, capacity=40)
    top_k(kinds["random"]((2, 8000)), 2048, True, capacity=2048)
    special = torch.tensor([[0.0, -0.0, 1.0, math.nan, -0.0, 0.0, math.nan, -1.0, math.inf, -math.inf, 2.0]])
    for k in (1, 3, 6, 11):
        for largest in (True, False):
            top_k(special, k, largest)
    specials = torch.randn(2, 6000)
    for value, where in zip((0.0, -0.0, math.nan, math.inf, -math.inf), torch.randperm(6000)[:200].view(5, 40)):
        specials[:, where] = value
    for k in (30, 100):
        for largest in (True, False):
            top_k(specials, k, largest)
            top_k(specials, k, largest, filter=False)
    for dtype in (torch.bfloat16, torch.float16):
        x = (kinds["tied"]((2, 1000)) / 4 + kinds["random"]((2, 1000)) / 64).to(dtype)
        top_k(x, 50, True)
        top_k(x, 50, False)
    top_k(kinds["random"]((2, 9000)), 300, True)
    for segments, k, largest in ((3, 5, True), (7, 150, False), (7, 200, True), (100, 3, True)):
        top_k(kinds["tied"]((2, 1000)), k, largest, segments)
        top_k(kinds["tied"]((2, 1000)), k, largest, segments, filter=False)
    for make in (kinds["tied"], kinds["equal"]):  # the candidates merged in three rounds (9, 4, 2 segments, then 1)
        top_k(make((2, 1000)), 20, True, (9, 4, 2))
        top_k(make((2, 1000)), 20, False, (9, 4, 2), filter=False)
    top_k(kinds["random"]((1, 5000)), 2048, True)
    top_k(kinds["tied"]((1, 5000)).bfloat16(), 2048, False, 4)
    rows = 16
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(rows, 300) * 2).to(dtype)
        keep_k = torch.randint(1, 60, (rows,), dtype=torch.int32)
        draw(logits, keep_k, torch.rand(rows) + 0.3, torch.rand(rows) * 0.9 + 0.1)
        draw(logits, torch.full((rows,), 300, dtype=torch.int32), torch.full((rows,), 0.5), torch.ones(rows))
    draw(torch.randn(4, 3000), torch.full((4,), 2048, dtype=torch.int32), torch.ones(4), torch.ones(4))
    logits = torch.randn(4, 3000)
    logits[1, 7] = math.nan
    draw(logits, torch.full((4,), 8, dtype=torch.int32), torch.ones(4), torch.ones(4))
    print(f"{len(failures)} differ" if failures else "all agree with the reference", flush=True)
    return not failures


# --------------------------------------------------------------------------- linear


def linear_backward_problems(m: int, n: int, activation: str, with_bias: bool = True, tsan: bool = False) -> list:
    """The backward's elementwise kernel on [m, n] bf16 inputs against autograd of the activation in float64: d_preact
    within one bf16 ulp of the exact value rounded once, the dbias partial sums within 1e-5 of the float64 column
    sums. Returns the problems found (none: it agrees)."""
    from runtime.accelerators.linear import tilelang as kernels
    from runtime.accelerators.linear.reference import activate

    _, bn, _ = kernels.backward_tiles(n)
    launch = cpu_launcher({"linear_bwd": lambda v: (-(-n // bn), v["G"])}, tsan)
    width = 2 * n if activation == "swiglu" else n
    z = (torch.randn(m, width) * 2).bfloat16()
    dy = torch.randn(m, n).bfloat16()
    z64 = z.double().requires_grad_()
    y64 = activate(z64, activation)
    (dz64,) = torch.autograd.grad(y64, z64, dy.double())
    dz, dbias = kernels.preact_gradient(dy, z, y64.detach().bfloat16(), activation, with_bias, launch=launch)
    problems = []
    rounded = dz64.bfloat16().double()  # one bf16 ulp apart where fp32 and float64 straddle a rounding point
    ulps = (dz.double() - rounded).abs() / (2**-7 * torch.maximum(dz.double().abs(), rounded.abs()) + 1e-6)
    if ulps.max() > 1:
        problems.append(f"d_preact {ulps.max():.3g} bf16 ulps from float64")
    if with_bias and not torch.allclose(dbias.double(), dz64.sum(0), rtol=1e-5, atol=1e-4):
        problems.append(f"dbias max error {(dbias.double() - dz64.sum(0)).abs().max():.3g}")
    return problems


def linear_activation_problems() -> list:
    """The activations of the linear kernels' CUDA prelude (gelu, gelu', sigmoid) compiled for the CPU (exact 1 / x
    and exp2f in place of the GPU's rcp.approx and ex2.approx) on fp32 z over [-12, 12], against float64: gelu and
    gelu' within 5e-7 (the rational erfc's 1.5e-7 on erf, halved and scaled by |z|, and fp32 rounding), sigmoid
    within 1.2e-7, and for z in [-8, -1] gelu within 1.5e-2 of float64 relatively (1 + erf formed as erfc(-z), not
    by a cancelling sum: the sum in fp32 loses every digit below z = -5.5). Returns the problems found."""
    from runtime.accelerators.linear.tilelang import PRELUDE

    code = (
        '#include "tilelang_simt_shim.h"\n'
        + PRELUDE
        + """
extern "C" void activations(const float* z, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = taac_gelu(z[i]);
    out[n + i] = taac_dgelu(z[i]);
    out[2 * n + i] = taac_sigmoid(z[i]);
  }
}
"""
    )
    lib = ctypes.CDLL(CpuKernel._build(code, tsan=False))
    z = torch.linspace(-12, 12, 240001)
    out = torch.full((3, len(z)), math.nan)
    lib.activations(ctypes.c_void_p(z.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int(len(z)))
    z64 = z.double()
    one_plus_erf = torch.special.erfc(-z64 * math.sqrt(0.5))
    gelu = 0.5 * z64 * one_plus_erf
    dgelu = 0.5 * one_plus_erf + z64 * torch.exp(-0.5 * z64 * z64) / math.sqrt(2 * math.pi)
    problems = []
    for name, got, ref, bound in zip(
        ("gelu", "gelu'", "sigmoid"), out, (gelu, dgelu, torch.sigmoid(z64)), (5e-7, 5e-7, 1.2e-7)
    ):
        error = (got.double() - ref).abs().max()
        if not error <= bound:
            problems.append(f"{name} {error:.3g} from float64")
    tail = (z >= -8) & (z <= -1)
    relative = ((out[0].double() - gelu).abs() / gelu.abs())[tail].max()
    if not relative <= 1.5e-2:
        problems.append(f"gelu {relative:.3g} from float64 relatively for z in [-8, -1]")
    return problems


def check_linear(tsan: bool) -> bool:
    from runtime.accelerators.linear import tilelang as kernels

    torch.manual_seed(0)
    failures = []

    def case(m: int, n: int, activation: str, with_bias: bool = True):
        problems = linear_backward_problems(m, n, activation, with_bias, tsan)
        rows = kernels.backward_tiles(n)[0]
        label = f"linear backward pass {activation} M={m} N={n} bias={with_bias} (steps of {rows} rows)"
        print(label, "ok" if not problems else "DIFFERS: " + ", ".join(problems), flush=True)
        if problems:
            failures.append(label)

    if tsan:
        case(300, 40, "gelu")
        return not failures
    problems = linear_activation_problems()
    print("linear activations in fp32", "ok" if not problems else "DIFFERS: " + ", ".join(problems), flush=True)
    failures += ["linear activations"] if problems else []
    for activation in ("gelu", "gelu_tanh", "silu", "relu", "swiglu"):
        case(9001, 200, activation)  # 282 row tiles over 256 groups: programs of one and of two steps
    case(70, 16, "gelu")
    case(5, 8, "swiglu")
    case(300, 64, "gelu", with_bias=False)
    print(f"{len(failures)} differ" if failures else "all agree with the reference", flush=True)
    return not failures


# --------------------------------------------------------------------------- add_norm


def add_norm_huge_row_problems(width: int, centre: bool, tsan: bool = False) -> list:
    """The add-norm forward kernel (fp32, with a weight; centre: add_layer_norm, with a bias) on rows near 1e30 and
    ordinary ones: y against float64 of the sum within 1e-5 per row, relative to the row's largest |y|. Returns the
    problems found (none: it agrees)."""
    from runtime.accelerators.add_norm import tilelang as kernels
    from runtime.accelerators.tilelang_common import plan_for

    rows = plan_for(torch.float32, width).block_rows
    entry = kernels.kernel_entries(torch.float32, width, torch.float32, torch.float32 if centre else None, centre)[0]
    kernel = CpuKernel(entry, {"add_norm_fwd": lambda v: (-(-v["n_rows"] // rows), 1)}, tsan)
    scales = torch.tensor([1e30, 1.0, 3e28, 1e32, 0.01, 2e31, 1e16], dtype=torch.float64)[:, None]
    total64 = (torch.randn(len(scales), width, dtype=torch.float64) + (3.0 if centre else 0.0)) * scales
    x, residual = (total64 / 2).float(), (total64 / 2).float()
    weight, bias = 1 + 0.5 * torch.randn(width), torch.randn(width)
    y, total, rstd, mean = (torch.empty_like(x), torch.empty_like(x), torch.empty(len(x)), torch.empty(len(x)))
    eps = 1e-5
    kernel(x, residual, weight, bias if centre else torch.zeros(1), y, total, mean, rstd, eps)
    s = total.double()
    centred = s - s.mean(-1, keepdim=True) if centre else s
    y64 = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps) * weight.double()
    y64 = y64 + bias.double() if centre else y64
    errors = (y.double() - y64).abs().amax(-1) / y64.abs().amax(-1)
    problems = [] if torch.equal(total, x + residual) else ["the sum differs from x + residual"]
    return problems + [
        f"row x{scale:g}: y {error:.2g} from float64"
        for scale, error in zip(scales.flatten().tolist(), errors.tolist())
        if not error <= 1e-5
    ]


def check_add_norm(tsan: bool) -> bool:
    torch.manual_seed(0)
    failures = []
    for width, centre in ((64, False), (64, True), (4096, False), (200, True)):
        problems = add_norm_huge_row_problems(width, centre, tsan)
        label = f"add_{'layer' if centre else 'rms'}_norm forward, rows near 1e30, width {width}"
        print(label, "ok" if not problems else "DIFFERS: " + ", ".join(problems), flush=True)
        failures += [label] if problems else []
    return not failures


# --------------------------------------------------------------------------- mhc


def mhc_pre_problems(x, phi, alpha, bias, eps: float, iters: int = 20, rtol: float = 1e-4, tsan: bool = False) -> list:
    """mhc_pre's TileLang kernels on fp32 x [tokens, n, C] and weights: the outputs within rtol (relative RMS) of
    autograd of the reference in float64, the gradients of x, phi, alpha and bias (random incoming gradients) within
    2 * rtol. Returns the problems found (none: it agrees)."""
    from runtime.accelerators.mhc import tilelang as kernels
    from runtime.accelerators.mhc.layout import allocate_pre
    from runtime.accelerators.mhc.reference import mhc_pre_reference
    from runtime.accelerators.testing import relative_rms_error

    n, C = x.shape[-2], x.shape[-1]
    tokens, m, splits = x.shape[0], n * n + 2 * n, 3
    blocks = -(-tokens // kernels.pre_block_tokens(n))
    grids = {
        "mhc_pre_fwd": lambda v: (blocks, 1),
        "mhc_pre_bwd": lambda v: (blocks, 1),
        "mhc_dphi": lambda v: (-(-n * C // kernels.BLOCK_K), splits),
    }
    out = allocate_pre(x)
    CpuKernel(kernels.pre_entry(x, phi), grids, tsan)(
        out.streams, phi, alpha, bias, out.h_in, out.h_post, out.h_res.view(tokens, n * n), out.h, out.r, eps, iters
    )
    doubled = [t.double().requires_grad_() for t in (x, phi, alpha, bias)]
    refs = mhc_pre_reference(*doubled, eps, iters)
    incoming = [torch.randn(r.shape, dtype=torch.float64) for r in refs]
    ref_grads = torch.autograd.grad(refs, doubled, incoming)
    dx, dg = torch.empty_like(out.streams), torch.empty(tokens, m)
    partial = torch.empty(blocks, m + 3)
    d_h_in, d_h_post, d_h_res = (g.float().reshape(tokens, -1).contiguous() for g in incoming)
    CpuKernel(kernels.pre_backward_entry(x, phi), grids, tsan)(
        out.streams, phi, alpha, bias, out.h, out.r, d_h_in, d_h_post, d_h_res, dx, dg, partial, iters
    )
    dphi = torch.empty(splits, n * C, m)
    CpuKernel(kernels.dphi_entry(x, phi, splits), grids, tsan)(out.streams, dg, dphi)
    sums = partial.sum(0)
    results = {"h_in": out.h_in, "H_post": out.h_post, "H_res": out.h_res}
    results |= {"dx": dx.view(x.shape), "dphi": dphi.sum(0), "dalpha": sums[m:], "dbias": sums[:m]}
    problems = []
    for (name, value), ref in zip(results.items(), (*refs, *ref_grads)):
        bound = rtol if name[0] != "d" else 2 * rtol
        error = relative_rms_error(value, ref)
        if not error <= bound:
            problems.append(f"{name}: relative RMS error {error:.3g} (bound {bound:.1e})")
    return problems


def check_mhc(tsan: bool) -> bool:
    torch.manual_seed(0)
    failures = []
    for n, C, tokens, case in ((4, 40, 37, "ordinary"), (3, 24, 40, "alpha 1e3"), (4, 40, 20, "a low row")):
        m = n * n + 2 * n
        x, phi = torch.randn(tokens, n, C), torch.randn(n * C, m) / (n * C) ** 0.5
        alpha, bias = torch.tensor([0.8, 1.1, 1000.0 if case == "alpha 1e3" else 1.3]), 0.3 * torch.randn(m)
        if case == "alpha 1e3":  # logits exact in fp32 (streams of +-1, rstd 1 with eps = 0, phi in 1/64ths)
            x, phi = x.sign(), (64 * phi).round() / 64
        if case == "a low row":
            bias[2 * n : 3 * n] -= 300
        problems = mhc_pre_problems(x, phi, alpha, bias, 0.0 if case == "alpha 1e3" else 1e-6, tsan=tsan)
        label = f"mhc_pre forward and backward, n={n} C={C} tokens={tokens}, {case}"
        print(label, "ok" if not problems else "DIFFERS: " + ", ".join(problems), flush=True)
        failures += [label] if problems else []
        if tsan:
            break
    return not failures


# --------------------------------------------------------------------------- silu_attention


def silu_bias_sums_kernel(causal: bool, pos: bool, time: bool, dtype: str):
    """The bias-gradient sums of silu_attention's dk/dv kernel (its macros, grid and loop over query blocks) fed with
    ds tiles from a dense DS [sequence, head, query, key] (the dk/dv kernel forms them with tensor-core products,
    which this tool cannot run)."""
    import tilelang.language as T

    from runtime.accelerators.silu_attention import tilelang_backward as bw
    from runtime.accelerators.silu_attention.tilelang_scores import (
        BLOCK_M,
        BLOCK_N,
        MAX_TIME_BUCKETS,
        THREADS,
        TIME_BUCKET_PRELUDE,
        stage_timestamps,
    )
    from runtime.accelerators.tilelang_common import program_of

    n_seqs, heads, padded, n_offsets, n_times, pos_part_len, time_part_len = T.dynamic(
        "n_seqs, heads, padded, n_offsets, n_times, pos_part_len, time_part_len"
    )

    @T.prim_func
    def silu_attention_bias_sums(
        DS: T.Tensor((n_seqs, heads, padded, padded), dtype),
        CU: T.Tensor((n_offsets,), "int32"),
        TS: T.Tensor((n_times,), "int64"),
        PosPart: T.Tensor((pos_part_len,), "float32"),
        TimePart: T.Tensor((time_part_len,), "float32"),
        n_blocks: T.int32,
        t_len: T.int32,
    ):
        code = TIME_BUCKET_PRELUDE + bw.TIME_HISTOGRAM_PRELUDE
        with T.Kernel(n_blocks * heads * (n_offsets - 1), threads=THREADS, prelude=code) as pid:
            bx, by, bz = program_of(pid, n_blocks, heads)
            sums = bw.bias_sums(pos, time, PosPart, TimePart, (bz * heads + by) * n_blocks + bx, n_blocks, dtype)
            tq_s = T.alloc_shared((BLOCK_M,), "int64")
            tk_s = T.alloc_shared((BLOCK_N,), "int64")
            start = CU[bz]
            n = CU[bz + 1] - start
            k0 = bx * BLOCK_N
            t_eff = T.min(t_len, MAX_TIME_BUCKETS)
            m_first, n_steps = bw.query_steps(causal, k0, n)
            if time:
                stage_timestamps(tk_s, TS, start, k0, n)
            bw.bias_sums_begin(sums)
            for step in T.serial(n_steps):
                q0 = (m_first + step) * BLOCK_M
                if time:
                    stage_timestamps(tq_s, TS, start, q0, n)
                for j, i in T.Parallel(BLOCK_N, BLOCK_M):
                    sums.ds_s[j, i] = DS[bz, by, q0 + i, k0 + j]
                T.sync_threads()
                bw.bias_sums_add_tile(sums, tq_s, tk_s, t_eff, step)
            bw.bias_sums_end(sums, n_steps, n_blocks)

    return silu_attention_bias_sums


def silu_bias_sums_problems(causal, pos, time, lengths, dtype=torch.bfloat16, heads=2, p_len=300, t_len=70, tsan=False):
    """The dk/dv kernel's bias partial sums, run on the CPU from random ds in dtype (zero where not visible, and past
    each sequence), reduced by the launcher's reduce_bias_parts, against the float64 sums per position bucket and
    time bucket; and the partial sums bit for bit the same on a second run. Returns the problems found."""
    from runtime.accelerators.silu_attention.reference import time_buckets, visible_mask
    from runtime.accelerators.silu_attention.tilelang_backward import TIME_SLOTS, reduce_bias_parts
    from runtime.accelerators.silu_attention.tilelang_scores import BLOCK_N
    from runtime.accelerators.tilelang_common import TL_DTYPE

    n_blocks = -(-max(lengths) // BLOCK_N)
    padded = n_blocks * BLOCK_N
    n = len(lengths)
    key = ("silu_attention_bias_sums", causal, pos, time, dtype)
    grid = {key[0]: lambda v: (v["n_blocks"] * v["heads"] * (v["n_offsets"] - 1), 1)}
    kernel = CpuKernel((key, lambda _: silu_bias_sums_kernel(causal, pos, time, TL_DTYPE[dtype])), grid, tsan)
    ds = torch.zeros(n, heads, padded, padded, dtype=torch.float64)
    stamps = []
    for s, length in enumerate(lengths):
        ds[s, :, :length, :length] = torch.randn(heads, length, length, dtype=torch.float64) * visible_mask(
            length, causal, None, "cpu"
        )
        # bursts of equal timestamps and jumps up to 2^40 s: equal, near and far buckets, past the table's end
        steps = torch.randint(0, 2, (length,)) * torch.randint(0, 1 << 12, (length,)) ** torch.randint(1, 4, (length,))
        stamps.append(1_700_000_000 + steps.cumsum(0))
    ds = ds.to(dtype).contiguous()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ts = torch.cat(stamps) if sum(lengths) else torch.zeros(1, dtype=torch.int64)
    runs = []
    for _ in range(2):
        pos_part = torch.full((n, heads, n_blocks, n_blocks + 1, BLOCK_N), math.nan) if pos else torch.zeros(1)
        time_part = torch.full((n, heads, n_blocks, TIME_SLOTS), math.nan) if time else torch.zeros(1)
        kernel(ds, cu, ts, pos_part.view(-1), time_part.view(-1), n_blocks, t_len)
        runs.append((pos_part, time_part))
    problems = []
    if not all(torch.equal(a, b) for a, b in zip(*runs)):
        problems.append("the partial sums differ between two runs")
    position_bias = torch.zeros(heads, p_len) if pos else None
    time_bias = torch.zeros(heads, t_len) if time else None
    dpos, dtime = reduce_bias_parts(*runs[0], causal, position_bias, time_bias)
    dpos_ref, dtime_ref = torch.zeros(heads, p_len, dtype=torch.float64), torch.zeros(heads, t_len, dtype=torch.float64)
    for s, (length, t_s) in enumerate(zip(lengths, stamps)):
        g = ds[s, :, :length, :length].double()
        i, j = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
        dpos_ref.index_add_(1, (i - j).abs().clamp_max(p_len - 1).flatten(), g.flatten(1))
        bucket = time_buckets((t_s.view(-1, 1) - t_s.view(1, -1)).abs(), t_len)
        dtime_ref.index_add_(1, bucket.flatten(), g.flatten(1))
    for name, value, ref in (("dposition_bias", dpos, dpos_ref), ("dtime_bias", dtime, dtime_ref)):
        if value is None:
            continue
        error = (value.double() - ref).abs().max().item()
        bound = 1e-5 * (1 + ref.abs().max().item())
        if not error <= bound:
            problems.append(f"{name}: max error {error:.3g} (bound {bound:.3g})")
    return problems


def check_silu_attention(tsan: bool) -> bool:
    torch.manual_seed(0)
    failures = []
    bf16, f16 = torch.bfloat16, torch.float16
    cases = [(True, True, True, [0, 1, 37, 200, 130, 64], bf16), (False, True, True, [63, 200, 5], f16)]
    cases += [(True, True, False, [150, 7], bf16), (False, False, True, [150, 64], bf16)]
    for causal, pos, time, lengths, dtype in cases[:1] if tsan else cases:
        problems = silu_bias_sums_problems(causal, pos, time, lengths, dtype, tsan=tsan)
        label = f"silu_attention bias sums, causal={causal} position={pos} time={time} lengths={lengths} {dtype}"
        print(label, "ok" if not problems else "DIFFERS: " + ", ".join(problems), flush=True)
        failures += [label] if problems else []
    return not failures


CHECKS = {
    "sampling": check_sampling,
    "linear": check_linear,
    "add_norm": check_add_norm,
    "mhc": check_mhc,
    "silu_attention": check_silu_attention,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=sorted(CHECKS))
    parser.add_argument("--tsan", action="store_true", help="build with ThreadSanitizer and report data races")
    args = parser.parse_args()
    if args.tsan and "libtsan" not in os.environ.get("LD_PRELOAD", ""):
        runtime = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
        env = {**os.environ, "LD_PRELOAD": runtime, "TSAN_OPTIONS": "halt_on_error=1 report_signal_unsafe=0"}
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode
    os.environ.pop("LD_PRELOAD", None)  # loaded here already; nvcc and g++ run without it
    return 0 if CHECKS[args.op](args.tsan) else 1


if __name__ == "__main__":
    sys.exit(main())
