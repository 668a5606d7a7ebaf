"""linear's forward on Hopper (sm_90+): a persistent TMA GEMM with the same epilogue as triton.py's _linear_forward.

One program per SM walks the output tiles (tile, tile + programs, ...) in the same GROUP_M-row grouped order as the
portable kernel. x and w tiles come through device-side tensor descriptors (TMA: the hardware zero-fills rows and
columns past the ends, so K needs no mask), in a K loop that Triton software-pipelines over num_stages buffers; the
tile loop is flattened into the K loop (tl.range flatten) so that the next tile's loads start during this tile's
epilogue. The epilogue (bias, activation, the saved pre-activation; swiglu's two accumulators) is the portable
kernel's; y and z are stored through descriptors, which clip the rows and columns past M and N.

For swiglu the weight is one [2F, K] descriptor (gate rows at j, up rows at F + j); a gate tile running past F reads
up rows, whose columns the y store clips. z is [M, 2F]: its gate and up halves are two [M, F] descriptors (row
stride 2F), so that neither half's tile writes into the other's columns.

Descriptors need 16-byte aligned bases and row strides (K and N multiples of 8 for bf16/fp16, as the op requires)
and, compiled, a global scratch allocator (triton.set_allocator) for the descriptors made on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backends import device_capability, sm_count, triton_interpret
from ..launch_math import cdiv
from ..triton_launch import direct_launch
from .launch import GemmConfig, persistent_flattens, persistent_forward_config
from .triton_activations import ACTIVATION_CODES, SWIGLU, _activate, _sigmoid

try:
    from triton.runtime import _allocation
except ImportError:  # a Triton without device-side descriptors
    _allocation = None


@direct_launch
@triton.jit(do_not_specialize=["M", "PROGRAMS"])
def _linear_forward_persistent(
    x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, N, K, PROGRAMS,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """y[M, N] (N = F for swiglu, whose weight has 2N rows); z: the pre-activation [M, N] ([M, 2N] for swiglu).
    SUBTILE: the epilogue in two [BLOCK_M, BLOCK_N / 2] halves, each activated and stored on its own."""
    dtype = y_ptr.dtype.element_ty
    STORE_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, [M, N], [N, 1], [BLOCK_M, STORE_N])
    W_ROWS: tl.constexpr = 2 if ACT == SWIGLU else 1
    w_desc = tl.make_tensor_descriptor(w_ptr, [W_ROWS * N, K], [K, 1], [BLOCK_N, BLOCK_K])
    z_desc = y_desc  # placeholders where z is not saved: never stored through
    z_up_desc = y_desc
    if SAVE:
        z_desc = tl.make_tensor_descriptor(z_ptr, [M, N], [W_ROWS * N, 1], [BLOCK_M, STORE_N])
        if ACT == SWIGLU:
            z_up_desc = tl.make_tensor_descriptor(z_ptr + N, [M, N], [2 * N, 1], [BLOCK_M, STORE_N])

    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        off_m = (first_m + (tile % per_group) % group_m) * BLOCK_M
        off_n = ((tile % per_group) // group_m) * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = x_desc.load([off_m, off_k])
            acc = tl.dot(a, w_desc.load([off_n, off_k]).T, acc)
            if ACT == SWIGLU:
                acc_up = tl.dot(a, w_desc.load([N + off_n, off_k]).T, acc_up)

        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            in_n = cols < N
            acc += tl.load(b_ptr + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
            if ACT == SWIGLU:
                acc_up += tl.load(b_ptr + N + cols, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if SUBTILE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            left_up, right_up = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            _store_epilogue(y_desc, z_desc, z_up_desc, left, left_up, off_m, off_n, ACT, SAVE, PTX, dtype)
            _store_epilogue(
                y_desc, z_desc, z_up_desc, right, right_up, off_m, off_n + BLOCK_N // 2, ACT, SAVE, PTX, dtype
            )
        else:
            _store_epilogue(y_desc, z_desc, z_up_desc, acc, acc_up, off_m, off_n, ACT, SAVE, PTX, dtype)


@triton.jit
def _store_epilogue(
    y_desc,
    z_desc,
    z_up_desc,
    acc,
    acc_up,
    off_m,
    off_n,
    ACT: tl.constexpr,
    SAVE: tl.constexpr,
    PTX: tl.constexpr,
    dtype,
):
    """Stores the pre-activation (where saved) and the activated tile at (off_m, off_n)."""
    if SAVE:
        z_desc.store([off_m, off_n], acc.to(dtype))
        if ACT == SWIGLU:
            z_up_desc.store([off_m, off_n], acc_up.to(dtype))
    if ACT == SWIGLU:
        out = acc * _sigmoid(acc, PTX) * acc_up
    else:
        out = _activate(acc, ACT, PTX)
    y_desc.store([off_m, off_n], out.to(dtype))


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def hopper_ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this launch can take the persistent TMA kernel: compiled (not interpreting) on a CUDA device of
    capability 9.0 or later, a Triton with device-side descriptors, contiguous x and weight with 16-byte aligned bases
    and row strides (y and z are fresh buffers, aligned)."""
    if not x.is_cuda or triton_interpret() or _allocation is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return device_capability(x.device) >= (9, 0) and all(t.is_contiguous() and _aligned(t) for t in (x, weight))


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # on the current device and stream, as the launch; torch's blocks are 512-byte aligned
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Set a torch scratch allocator for device-side descriptors where none is set (a per-thread context variable),
    never replacing one the user set; nothing under the interpreter."""
    if _linear_forward_persistent.direct and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def programs(m: int, n: int, cfg: GemmConfig, device: torch.device) -> int:
    """cfg.per_sm programs an SM (a few under the interpreter, which has none), never more than there are tiles."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    return max(1, min(tiles, cfg.per_sm * sm_count(device) or 3))


def launch(x, weight, bias, y, z, activation, saved: bool, cfg: GemmConfig | None = None, flatten: bool | None = None):
    """Run the persistent kernel into y (and z where saved). cfg: persistent_forward_config's by default (its
    subtile, per_sm and max_registers included); flatten: persistent_flattens's by default."""
    k, n = x.shape[-1], y.shape[-1]
    m = y.numel() // n  # x and y: [..., K] and [..., N], contiguous
    swiglu = activation == "swiglu"
    cfg = cfg or persistent_forward_config(m, n, k, swiglu)
    flatten = persistent_flattens(k, swiglu) if flatten is None else flatten
    count = programs(m, n, cfg, x.device)
    registers = {} if cfg.max_registers is None else {"maxnreg": cfg.max_registers}
    _ensure_scratch_allocator()
    _linear_forward_persistent[(count,)](
        x, weight, x if bias is None else bias, y, z, m, n, k, count,
        HAS_BIAS=bias is not None, ACT=ACTIVATION_CODES[activation], SAVE=saved,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FLATTEN=flatten, SUBTILE=cfg.subtile, PTX=not triton_interpret(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **registers,
    )  # fmt: skip
