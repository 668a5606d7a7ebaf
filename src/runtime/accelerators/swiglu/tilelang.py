"""SwiGLU in TileLang: y = silu(g) * u forward, one pass each way, fp32 math.

The tensors are flat arrays of a dynamic length N: one compiled kernel per (dtype, block,
threads) serves every shape. Each block loads `block` consecutive elements into register
tiles, computes, and stores. The tiles have an explicit layout (each thread holds 16-byte
vectors of consecutive elements) so every global access is a 16-byte vector access. Full
blocks run unguarded; only the last, partial block checks each element against N.

The flat-tile helpers here (layout, guarded load/store) are shared with dropout_add.
"""

import tilelang.language as T
import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..tilelang_common import ACCUM, TL_DTYPE, Entry, launcher

BLOCK = 4096
THREADS = 256
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------- flat tiles


def tile_shape(dtype: str, block: int) -> tuple[int, int]:
    """A block of `block` elements as a [rows, vec] tile; vec elements make one 16-byte vector."""
    vec = 16 // ELEMENT_BYTES[dtype]
    return block // vec, vec


def flat_layout(rows: int, vec: int, threads: int):
    """Row r of the tile (vec consecutive elements) belongs to thread r % threads: each warp
    access covers consecutive 16-byte vectors (coalesced)."""
    return T.Fragment(
        (rows, vec), forward_thread_fn=lambda r, v: r % threads, forward_index_fn=lambda r, v: (r // threads) * vec + v
    )


@T.macro
def load_flat(Src, tile, start, n, guarded):
    """tile[r, v] = Src[start + r * vec + v] as tile's dtype; zero past n when guarded."""
    for r, v in T.Parallel(tile.shape[0], tile.shape[1]):
        if guarded:
            k = start + r * tile.shape[1] + v
            tile[r, v] = T.if_then_else(k < n, T.cast(Src[k], tile.dtype), T.cast(0, tile.dtype))
        else:
            tile[r, v] = T.cast(Src[start + r * tile.shape[1] + v], tile.dtype)


@T.macro
def store_flat(tile, Dst, start, n, guarded):
    """Dst[start + r * vec + v] = tile[r, v] as Dst's dtype; only below n when guarded."""
    for r, v in T.Parallel(tile.shape[0], tile.shape[1]):
        if guarded:
            if start + r * tile.shape[1] + v < n:
                Dst[start + r * tile.shape[1] + v] = T.cast(tile[r, v], Dst.dtype)
        else:
            Dst[start + r * tile.shape[1] + v] = T.cast(tile[r, v], Dst.dtype)


def flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous, 16-byte-aligned 1-D tensor (the kernels use 16-byte vector accesses)."""
    t = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return t if t.data_ptr() % 16 == 0 else t.clone()


# --------------------------------------------------------------------------- kernels


def forward_kernel(dtype: str, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def swiglu_tile(G, U, Y, g, u, start, guarded):
        load_flat(G, g, start, N, guarded)
        load_flat(U, u, start, N, guarded)
        for r, v in T.Parallel(rows, vec):
            g[r, v] = g[r, v] / (1.0 + T.exp(-g[r, v])) * u[r, v]
        store_flat(g, Y, start, N, guarded)

    @T.prim_func
    def swiglu_fwd(G: T.Tensor((N,), dtype), U: T.Tensor((N,), dtype), Y: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            g = T.alloc_fragment((rows, vec), ACCUM)
            u = T.alloc_fragment((rows, vec), ACCUM)
            T.annotate_layout({g: flat_layout(rows, vec, threads), u: flat_layout(rows, vec, threads)})
            if bx * block + block <= N:
                swiglu_tile(G, U, Y, g, u, bx * block, False)
            else:
                swiglu_tile(G, U, Y, g, u, bx * block, True)

    return swiglu_fwd


def backward_kernel(dtype: str, block: int = BLOCK, threads: int = THREADS):
    N = T.dynamic("N")
    rows, vec = tile_shape(dtype, block)

    @T.macro
    def swiglu_tile(DY, G, U, DG, DU, dy, g, u, start, guarded):
        load_flat(DY, dy, start, N, guarded)
        load_flat(G, g, start, N, guarded)
        load_flat(U, u, start, N, guarded)
        for r, v in T.Parallel(rows, vec):
            s = 1.0 / (1.0 + T.exp(-g[r, v]))
            dy[r, v] = dy[r, v] * s
            u[r, v] = dy[r, v] * u[r, v] * (1.0 + g[r, v] * (1.0 - s))  # d silu(g)/dg = s (1 + g (1 - s))
            g[r, v] = dy[r, v] * g[r, v]  # dy * silu(g)
        store_flat(u, DG, start, N, guarded)
        store_flat(g, DU, start, N, guarded)

    @T.prim_func
    def swiglu_bwd(
        DY: T.Tensor((N,), dtype),
        G: T.Tensor((N,), dtype),
        U: T.Tensor((N,), dtype),
        DG: T.Tensor((N,), dtype),
        DU: T.Tensor((N,), dtype),
    ):
        with T.Kernel(T.ceildiv(N, block), threads=threads) as bx:
            dy = T.alloc_fragment((rows, vec), ACCUM)
            g = T.alloc_fragment((rows, vec), ACCUM)
            u = T.alloc_fragment((rows, vec), ACCUM)
            layout = flat_layout(rows, vec, threads)
            T.annotate_layout({dy: layout, g: layout, u: layout})
            if bx * block + block <= N:
                swiglu_tile(DY, G, U, DG, DU, dy, g, u, bx * block, False)
            else:
                swiglu_tile(DY, G, U, DG, DU, dy, g, u, bx * block, True)

    return swiglu_bwd


def forward_entry(dtype: torch.dtype, block: int = BLOCK, threads: int = THREADS) -> Entry:
    name = TL_DTYPE[dtype]
    return ("swiglu_fwd", name, block, threads), lambda info: forward_kernel(name, block, threads)


def backward_entry(dtype: torch.dtype, block: int = BLOCK, threads: int = THREADS) -> Entry:
    name = TL_DTYPE[dtype]
    return ("swiglu_bwd", name, block, threads), lambda info: backward_kernel(name, block, threads)


def forward(gate: torch.Tensor, up: torch.Tensor, block: int = BLOCK, threads: int = THREADS) -> torch.Tensor:
    kernel = launcher(forward_entry(gate.dtype, block, threads), gate.device)
    y = buffers.empty_like(gate)
    kernel(flat(gate), flat(up), y.view(-1))
    return y


def backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, block: int = BLOCK, threads: int = THREADS
):
    kernel = launcher(backward_entry(gate.dtype, block, threads), gate.device)
    dgate, dup = buffers.empty_like(gate), buffers.empty_like(up)
    kernel(flat(dy), flat(gate), flat(up), dgate.view(-1), dup.view(-1))
    return dgate, dup


KERNELS = KernelBackend(forward=forward, backward=backward)
