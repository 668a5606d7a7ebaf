"""What the TileLang kernel modules share: version check, targets, dtype names, the compile
cache, and the pieces of row-wise kernels (the per-width plan and the column-sum kernel that
reduces per-block partial sums of parameter gradients).

Imported only by the tilelang kernel modules, so the package imports without tilelang.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from . import buffers
from .backends import sm_count, tilelang_version_problem
from .norms import SCALE_ABOVE


def _check_version() -> None:
    problem = tilelang_version_problem()
    if problem is not None:
        raise ImportError(problem)


_check_version()

import tilelang  # noqa: E402
import tilelang.language as T  # noqa: E402

SM90A = {"kind": "cuda", "arch": "sm_90a"}
H100_SMS = 132  # used when compiling without a device (CPU tests)

TL_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ACCUM = "float32"


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class DeviceInfo:
    target: dict  # tilelang.compile's target, in dict form
    sm_count: int


@functools.cache
def device_info(index: int | None) -> DeviceInfo:
    """Compile target and SM count of CUDA device `index`; None: an H100 (sm_90a), for compile-only use."""
    if index is None:
        return DeviceInfo(SM90A, H100_SMS)
    major, minor = torch.cuda.get_device_capability(index)
    # the "a" variants unlock wgmma/TMA features on Hopper and Blackwell
    arch = f"sm_{major}{minor}" + ("a" if major in (9, 10) else "")
    return DeviceInfo({"kind": "cuda", "arch": arch}, sm_count(torch.device("cuda", index)))


# --------------------------------------------------------------------------- launch grids

MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on gridDim.x
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


def program_of(pid, n_blocks, heads):
    """(block, head, sequence) of program pid of a launch of n_blocks x heads x sequences programs, all on x, block
    fastest, then head: the order of a (blocks, heads, sequences) grid. Each bound once (T.alloc_var): as expressions
    TileLang would recompute the divisions at every use."""
    block = T.alloc_var("int32", init=pid % n_blocks)
    head = T.alloc_var("int32", init=pid // n_blocks % heads)
    sequence = T.alloc_var("int32", init=pid // (n_blocks * heads))
    return block, head, sequence


def program_grid(blocks, heads, sequences, fold: bool) -> tuple:
    """T.Kernel's extents for (blocks, heads, sequences) programs: the 3-D grid, or with fold every program on x,
    for counts past gridDim.y / z's 65535 (program_ids decodes either). The 3-D grid costs no index arithmetic:
    folded, flash_attention's small-tile kernels measured 7-8% slower (H200, 256 x 4 heads x 256 tokens)."""
    return (blocks * heads * sequences,) if fold else (blocks, heads, sequences)


def program_ids(ids, blocks, heads, fold: bool):
    """(block, head, sequence) of the program T.Kernel(*program_grid(...)) bound to ids."""
    return program_of(ids, blocks, heads) if fold else ids


def needs_fold(heads: int, sequences: int) -> bool:
    """Whether a (blocks, heads, sequences) launch must fold its grid onto x (program_grid)."""
    return heads > MAX_GRID_YZ or sequences > MAX_GRID_YZ


def check_program_count(programs: int, what: str) -> None:
    """A launch of `programs` programs on grid x, or a ValueError that names what made it too large."""
    if programs > MAX_PROGRAMS:
        raise ValueError(
            f"{what}: {programs} programs; one launch of the tilelang kernels takes at most {MAX_PROGRAMS}"
        )


# --------------------------------------------------------------------------- compile cache

# A kernel entry is (key, build): key names what changes the code (kernel, dtypes, width,
# flags); build(device_info) returns the T.prim_func. Keys never hold row counts.
Entry = tuple[Hashable, Callable[[DeviceInfo], object]]
_kernels: dict[Hashable, object] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass(frozen=True)
class Unchecked:
    """What a builder returns for a kernel whose every global read and write is guarded by its own conditions or in
    range by construction (for arguments that passed the op's checks): compiled without TileLang's safe-memory pass.
    That pass wraps each access in bounds conditions built from the index expressions; nested indices (a timestamp
    read inside a bias index) made TVM's simplifier run for minutes on them."""

    func: object


UNCHECKED_PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def compile_built(built, target):
    """tilelang.compile of a builder's result: a T.prim_func, or an Unchecked one."""
    if isinstance(built, Unchecked):
        return tilelang.compile(built.func, target=target, pass_configs=UNCHECKED_PASS_CONFIGS)
    return tilelang.compile(built, target=target)


def compiled(entry: Entry, device: torch.device, kernels: dict[Hashable, object] = _kernels):
    """The compiled kernel of `entry` for `device`: compiled on first use, then one dict lookup
    (TileLang also keeps compiled kernels on disk across processes, under TILELANG_CACHE_DIR). kernels: the
    cache, (key, device) -> kernel (the process's own by default)."""
    key, build = entry
    kernel = kernels.get((key, device))
    if kernel is None:
        info = device_info(_index(device))
        kernel = kernels[(key, device)] = compile_built(build(info), info.target)
    return kernel


def precompile(
    entries: list[Entry],
    device: torch.device,
    *,
    info: DeviceInfo | None = None,
    kernels: dict[Hashable, object] = _kernels,
) -> None:
    """Compile the entries not compiled yet for `device`, in parallel (nvcc runs in subprocesses).

    Useful before a test suite or a benchmark sweep; calls to `compiled` then find them. info: the compile target
    and SM count (default: the device's; device_info(None) compiles for sm_90a without a GPU); kernels: the cache
    `compiled` reads (the process's own by default)."""
    if info is None:
        info = device_info(_index(device))
    missing = {key: build for key, build in entries if (key, device) not in kernels}
    if not missing:
        return
    built = {key: build(info) for key, build in missing.items()}  # the TileLang builder is not thread-safe
    for unchecked in (False, True):
        keys = [key for key, func in built.items() if isinstance(func, Unchecked) == unchecked]
        funcs = [built[key].func if unchecked else built[key] for key in keys]
        configs = UNCHECKED_PASS_CONFIGS if unchecked else None
        for key, kernel in zip(keys, tilelang.par_compile(funcs, target=info.target, pass_configs=configs)):
            kernels[(key, device)] = kernel


_launchers: dict[Hashable, Callable] = {}


def launcher(entry: Entry, device: torch.device) -> Callable:
    """The compiled kernel's entry point, called directly with every argument (outputs included).

    JITKernel.__call__ re-packs the arguments in Python on every call and then calls the
    module's `main`; that TVM-FFI function takes the torch tensors as they are and launches on
    torch's current stream, so calling it directly saves host time per launch. Kernels that
    allocate their own outputs (out_idx) keep the JITKernel."""
    fn = _launchers.get((entry[0], device))
    if fn is None:
        fn = kernel = compiled(entry, device)
        adapter = getattr(kernel, "adapter", None)
        if adapter is not None and not adapter.result_idx and hasattr(adapter, "get_exportable_executable"):
            # a fresh compile holds a tvm Executable (to be jitted), a disk-cache hit the loaded Module
            module = adapter.get_exportable_executable()
            if getattr(type(module), "jit", None) is not None:
                module = module.jit()
            fn = module["main"]
        _launchers[(entry[0], device)] = fn
    return fn


_placeholders: dict[Hashable, torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-element tensor passed for an absent optional argument (the kernel never reads it)."""
    key = (device, dtype)
    tensor = _placeholders.get(key)
    if tensor is None:
        tensor = _placeholders[key] = torch.zeros(1, dtype=dtype, device=device)
    return tensor


def param_or_placeholder(param: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A per-feature parameter as the kernels take it (contiguous), or the placeholder when absent."""
    return placeholder(x.device) if param is None else param.contiguous()


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous, 16-byte-aligned [rows, width] tensor (the kernels use vector loads)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if rows.data_ptr() % 16:
        rows = rows.clone()
    return rows


# --------------------------------------------------------------------------- row-wise kernels


@dataclass(frozen=True)
class RowPlan:
    """How a row-wise kernel lays out rows of `width` elements.

    Each row is padded to `padded` columns (masked loads, zero fill) so that a fragment
    [block_rows, padded] splits evenly over `threads` threads in 16-byte vectors: TileLang
    finds no fragment layout for a width wider than the thread count and not a multiple of
    it. Narrow rows share a block (`block_rows` > 1).
    """

    width: int
    padded: int
    threads: int
    block_rows: int
    vec: int  # elements per 16-byte vector of the row dtype

    @property
    def row_threads(self) -> int:
        return self.threads // self.block_rows

    @property
    def exact(self) -> bool:  # no padded columns: the column mask can be left out
        return self.padded == self.width


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def row_plan(width: int, elem_bytes: int, min_threads: int = 128, max_threads: int = 512) -> RowPlan:
    vec = 16 // elem_bytes
    chunks = -(-width // vec)
    # about two vectors per thread; more for the widest rows, where threads run out
    row_threads = min(max_threads, _next_pow2(-(-chunks // 2)))
    padded = -(-width // (row_threads * vec)) * row_threads * vec
    threads = max(row_threads, min_threads)
    return RowPlan(width, padded, threads, threads // row_threads, vec)


def plan_for(dtype: torch.dtype, width: int) -> RowPlan:
    return row_plan(width, dtype.itemsize)


def row_layout(plan: RowPlan):
    """Fragment layout of a [block_rows, padded] tile: row i belongs to `row_threads`
    consecutive threads; each holds 16-byte vectors of consecutive columns, the threads of a
    row covering `row_threads * vec` consecutive columns per step (coalesced). Declared
    explicitly so every such fragment of a kernel shares it and loads stay 16 bytes wide."""
    rt, vec = plan.row_threads, plan.vec

    def thread(i, j):
        return i * rt + (j // vec) % rt

    def index(i, j):
        return (j // (rt * vec)) * vec + j % vec

    return T.Fragment((plan.block_rows, plan.padded), forward_thread_fn=thread, forward_index_fn=index)


@T.macro
def load_rows(Src, tile, row0, n_rows, width):
    """tile[i, j] = Src[row0 + i, j], zero outside the tensor (rows past the end, padded columns)."""
    for i, j in T.Parallel(tile.shape[0], tile.shape[1]):
        tile[i, j] = T.if_then_else((row0 + i < n_rows) and (j < width), Src[row0 + i, j], T.cast(0, tile.dtype))


@T.macro
def store_rows(tile, Dst, row0, n_rows, width):
    """Dst[row0 + i, j] = tile[i, j] inside the tensor."""
    for i, j in T.Parallel(tile.shape[0], tile.shape[1]):
        if (row0 + i < n_rows) and (j < width):
            Dst[row0 + i, j] = tile[i, j]


EXPONENT_BITS = 0x7F800000  # of an fp32


@T.macro
def scaled_squares(x, sq, inv):
    """sq = (x inv)^2 where inv[i] is 1 when row i's largest |x|, m, is at most norms.SCALE_ABOVE, else the power of two
    2^(1 - e) for m in [2^e, 2^(e+1)) (scaled |x| below 4): squares that cannot overflow fp32, for
    rsqrt(mean(sq) + eps inv^2) inv. One register reduction (the max) more. A power of two scales exactly, and is
    taken from m's exponent bits, not by dividing: fp32 division's slow-path call cost layer_norm's forward 6
    registers (48 -> 54 at 4096 columns: 4 blocks of 256 threads per SM instead of 5; see docs/tuning/norms.md).
    m = inf gives inv = 0 (a NaN row, as 1 / m did)."""
    for i, j in T.Parallel(x.shape[0], x.shape[1]):
        sq[i, j] = T.abs(x[i, j])
    T.reduce_max(sq, inv, dim=1)
    for i in T.Parallel(x.shape[0]):
        # 2^(1 - e)'s exponent field is 255 - (e + 127): all exponent bits less m's
        inv[i] = T.if_then_else(
            inv[i] > SCALE_ABOVE,
            T.reinterpret(T.int32(EXPONENT_BITS) - (T.reinterpret(inv[i], "int32") & EXPONENT_BITS), "float32"),
            1.0,
        )
    for i, j in T.Parallel(x.shape[0], x.shape[1]):
        sq[i, j] = (x[i, j] * inv[i]) * (x[i, j] * inv[i])


@functools.cache
def blocks_per_sm(plan: RowPlan, registers_per_element: int) -> int:
    """Resident blocks per SM of a persistent backward kernel (passed to __launch_bounds__ as the
    minimum, and the grid is this many blocks per SM, so that all of them run at once).

    The register budget of a thread is about `registers_per_element` times the fp32 row
    elements it holds (at least 64): measured with ptxas on sm_90a, rms_norm needs about 4,
    layer_norm about 8 (it also keeps dbias and the centred row). More than 4 blocks did not
    pay on an H100.
    """
    per_thread = plan.padded * plan.block_rows // plan.threads
    registers = max(64, registers_per_element * per_thread)
    return max(1, min(4, 65536 // (plan.threads * registers)))


def persistent_row_grid(
    dtype: torch.dtype, width: int, sm_count: int, registers_per_element: int
) -> tuple[RowPlan, int, int]:
    """(plan, blocks per SM, blocks) of a persistent row-wise backward kernel of `registers_per_element`
    (see blocks_per_sm) on `sm_count` SMs."""
    plan = plan_for(dtype, width)
    per_sm = blocks_per_sm(plan, registers_per_element)
    return plan, per_sm, per_sm * sm_count


def info_for(device: torch.device | None) -> DeviceInfo:
    """The device's compile target and SM count; None: the compile-only H100 default."""
    return device_info(None if device is None else _index(device))


def column_sum_kernel(out_dtype: str, n_rows: int, block_cols: int = 16, block_rows: int = 64, threads: int = 128):
    """out[k] = sum_g partial[g, k] in fp32, written as out_dtype. The row count (the persistent
    grid) is static so that every load of a column block is issued at once (unrolled); the
    width is dynamic."""
    G = n_rows
    K = T.dynamic("K")

    @T.prim_func
    def column_sum(Partial: T.Tensor((G, K), ACCUM), Out: T.Tensor((K,), out_dtype)):
        with T.Kernel(T.ceildiv(K, block_cols), threads=threads) as bx:
            acc = T.alloc_fragment((block_rows, block_cols), ACCUM)
            total = T.alloc_fragment((block_cols,), ACCUM)
            T.clear(acc)
            for step in T.unroll(-(-G // block_rows)):
                for i, j in T.Parallel(block_rows, block_cols):
                    g, k = step * block_rows + i, bx * block_cols + j
                    acc[i, j] += T.if_then_else((g < G) and (k < K), Partial[g, k], 0.0)
            T.reduce_sum(acc, total, dim=0)
            for j in T.Parallel(block_cols):
                if bx * block_cols + j < K:
                    Out[bx * block_cols + j] = T.cast(total[j], out_dtype)

    return column_sum


def column_sum_entry(out_dtype: torch.dtype, n_rows: int) -> Entry:
    return ("column_sum", out_dtype, n_rows), lambda _: column_sum_kernel(TL_DTYPE[out_dtype], n_rows)


def column_sum(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reduce partial [G, K] fp32 over its rows into out [K] (any kernel dtype)."""
    launcher(column_sum_entry(out.dtype, partial.shape[0]), partial.device)(partial, out)
    return out


def reduce_dtype(dtypes: list) -> torch.dtype:
    """The dtype one column sum of several parameter gradients writes: theirs when they agree, else fp32."""
    return dtypes[0] if all(d == dtypes[0] for d in dtypes) else torch.float32


def reduce_partials(partial: torch.Tensor, params: list) -> list:
    """Per-block partial sums [G, n_params * K] of the gradients of `params` (each [K], in that order) added up in one
    column-sum launch, split into one gradient per parameter (through fp32 when their dtypes differ)."""
    width = params[0].shape[0]
    dtype = reduce_dtype([p.dtype for p in params])
    total = column_sum(partial, buffers.empty((partial.shape[1],), dtype=dtype, device=partial.device))
    return [total[k * width : (k + 1) * width].to(p.dtype) for k, p in enumerate(params)]
