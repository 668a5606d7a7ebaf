"""dropout_add in TileLang: out = residual + x * keep / (1 - p), the mask regenerated in backward.

Element i draws the 32-bit number mix(mix(i ^ key0) ^ key1), where mix is a bijective
xorshift-multiply hash and the keys come from the seed (`reference.tilelang_keys`); it is kept
when the top 24 bits reach `keep_threshold(p)`. The seed is a one-element int64 tensor (drawn on
the device, so CUDA graphs replay a new draw each time); each thread loads it once, at the start,
and derives the keys in registers. The backward loads the forward's seed tensor and computes the
same hash again, so no mask is stored. `reference.tilelang_keep_mask` rebuilds the mask in torch.

Layout as in swiglu's TileLang kernels: flat arrays of dynamic length N, register tiles of
16-byte vectors, unguarded full blocks and a guarded last block.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..swiglu.tilelang import BLOCK, THREADS, flat, flat_layout, load_flat, store_flat, tile_shape
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher
from .reference import HASH_M1, HASH_M2, KEY_MULTIPLIER, keep_threshold

U32 = "uint32"
SEED = "int64"  # the seed tensor's dtype (seeds.draw_seed_tensor)


@T.macro
def _mix(h):
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        h[r, v] = (h[r, v] ^ (h[r, v] >> 16)) * T.uint32(HASH_M1)
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        h[r, v] = (h[r, v] ^ (h[r, v] >> 15)) * T.uint32(HASH_M2)
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        h[r, v] = h[r, v] ^ (h[r, v] >> 16)


def seed_keys(seed):
    """reference.tilelang_keys as expressions of an int64 variable holding the 31-bit seed (int64 math)."""
    return T.cast(seed, U32), T.cast(((seed * T.int64(KEY_MULTIPLIER)) >> 7) & T.int64(0x7FFFFFFF), U32)


@T.macro
def keep_scales(h, m, start, key0, key1, threshold, scale):
    """m[r, v] = scale if element start + r * vec + v is kept, else 0 (h: uint32 scratch tile)."""
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        h[r, v] = T.cast(start + r * h.shape[1] + v, U32) ^ key0
    _mix(h)
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        h[r, v] = h[r, v] ^ key1
    _mix(h)
    for r, v in T.Parallel(h.shape[0], h.shape[1]):
        m[r, v] = T.cast((h[r, v] >> 8) >= T.cast(threshold, U32), ACCUM) * scale


def forward_kernel(dtype: str, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def dropout_add_tile(X, R, Y, x, r_, h, m, start, key0, key1, threshold, scale, guarded):
        load_flat(X, x, start, N, guarded)
        load_flat(R, r_, start, N, guarded)
        keep_scales(h, m, start, key0, key1, threshold, scale)
        for r, v in T.Parallel(rows, vec):
            x[r, v] = r_[r, v] + x[r, v] * m[r, v]
        store_flat(x, Y, start, N, guarded)

    @T.prim_func
    def dropout_add_fwd(
        X: T.Tensor((N,), dtype),
        R: T.Tensor((N,), dtype),
        Y: T.Tensor((N,), dtype),
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            x = T.alloc_fragment((rows, vec), ACCUM)
            r_ = T.alloc_fragment((rows, vec), ACCUM)
            m = T.alloc_fragment((rows, vec), ACCUM)
            h = T.alloc_fragment((rows, vec), U32)
            seed = T.alloc_var(SEED)
            key0 = T.alloc_var(U32)
            key1 = T.alloc_var(U32)
            seed = Seed[0] & T.int64(0x7FFFFFFF)  # the one load of the seed tensor; the keys then live in registers
            key0, key1 = seed_keys(seed)
            layout = flat_layout(rows, vec, threads)
            T.annotate_layout({x: layout, r_: layout, m: layout, h: layout})
            if bx * block + block <= N:
                dropout_add_tile(X, R, Y, x, r_, h, m, bx * block, key0, key1, threshold, scale, False)
            else:
                dropout_add_tile(X, R, Y, x, r_, h, m, bx * block, key0, key1, threshold, scale, True)

    return dropout_add_fwd


def backward_kernel(dtype: str, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def dropout_tile(DY, DX, dy, h, m, start, key0, key1, threshold, scale, guarded):
        load_flat(DY, dy, start, N, guarded)
        keep_scales(h, m, start, key0, key1, threshold, scale)
        for r, v in T.Parallel(rows, vec):
            dy[r, v] = dy[r, v] * m[r, v]
        store_flat(dy, DX, start, N, guarded)

    @T.prim_func
    def dropout_add_bwd(
        DY: T.Tensor((N,), dtype),
        DX: T.Tensor((N,), dtype),
        Seed: T.Tensor((1,), SEED),
        threshold: T.int32,
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            dy = T.alloc_fragment((rows, vec), ACCUM)
            m = T.alloc_fragment((rows, vec), ACCUM)
            h = T.alloc_fragment((rows, vec), U32)
            seed = T.alloc_var(SEED)
            key0 = T.alloc_var(U32)
            key1 = T.alloc_var(U32)
            seed = Seed[0] & T.int64(0x7FFFFFFF)  # the one load of the seed tensor; the keys then live in registers
            key0, key1 = seed_keys(seed)
            layout = flat_layout(rows, vec, threads)
            T.annotate_layout({dy: layout, m: layout, h: layout})
            if bx * block + block <= N:
                dropout_tile(DY, DX, dy, h, m, bx * block, key0, key1, threshold, scale, False)
            else:
                dropout_tile(DY, DX, dy, h, m, bx * block, key0, key1, threshold, scale, True)

    return dropout_add_bwd


def forward_entry(dtype: torch.dtype, block: int = BLOCK, threads: int = THREADS) -> Entry:
    name = TL_DTYPE[dtype]
    return ("dropout_add_fwd", name, block, threads), lambda info: forward_kernel(name, block, threads)


def backward_entry(dtype: torch.dtype, block: int = BLOCK, threads: int = THREADS) -> Entry:
    name = TL_DTYPE[dtype]
    return ("dropout_add_bwd", name, block, threads), lambda info: backward_kernel(name, block, threads)


def forward(
    x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor, block: int = BLOCK, threads: int = THREADS
) -> torch.Tensor:
    """seed: the one-element int64 tensor of seeds.draw_seed_tensor, on x's device."""
    kernel = launcher(forward_entry(x.dtype, block, threads), x.device)
    out = buffers.empty_like(x)
    kernel(flat(x), flat(residual), out.view(-1), seed, keep_threshold(p), 1.0 / (1.0 - p))
    return out


def backward(dout, x, residual, p: float, seed: torch.Tensor, out, block: int = BLOCK, threads: int = THREADS):
    kernel = launcher(backward_entry(x.dtype, block, threads), x.device)
    dx = buffers.empty_like(x)
    kernel(flat(dout), dx.view(-1), seed, keep_threshold(p), 1.0 / (1.0 - p))
    return dx, dout, None, None  # d residual = dout


KERNELS = KernelBackend(forward=forward, backward=backward)
