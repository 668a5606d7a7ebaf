"""FlashAttention in TileLang: forward (online softmax, saves the log-sum-exp), backward
preprocess (delta = rowsum(o * do), the log-sum-exp in base 2) and one backward kernel that
computes dk/dv per key block and adds dq into an fp32 accumulator with TMA reductions.

Layout: q [B, H, Lq, D], k/v [B, Hkv, Lk, D] are read in place whatever their strides (views such
as x.view(B, L, H, D).transpose(1, 2)): the kernels take strided tensors and TMA reads them (a
copy is made only when a stride is not a multiple of 16 bytes or the last one is not 1). o and
lse are contiguous; dq/dk/dv keep the dimension order of q/k/v (like torch.empty_like).

One compiled kernel serves every batch size, head count, GQA group and sequence length: they are
dynamic; the code is specialised on (head dim, dtype, causal, key_lengths given, dropout).

Masks: causal is top-left (query i sees keys j <= i) and key_lengths[b] hides keys j >= length;
both bound the key blocks a program visits and, only on the blocks that straddle a boundary,
mask elements. A row that sees no key (length 0) gets o = 0 and lse = -inf; the backward never
visits it (its key blocks are empty), so its gradients are exactly zero.

Dropout: keep(b, h, i, j) is the counter-based hash of dropout.py, which the backward
recomputes (no mask is stored); kept probabilities are scaled by 1 / (1 - p), p as drawn (dropout.drop_rate).

Packed sequences (varlen_forward, varlen_backward; layout in varlen.py): the same kernels built with `varlen`, one
program per (block, head, sequence) reading its sequence's offsets; the grid's blocks come from max_seqlen, so one
compiled kernel serves every packing. The backward adds each sequence's dq into accumulator blocks of its own
(dq_first_block), so rows past a sequence's end never reach another's; the host gathers dq from them. Its delta and
log-sum-exp rows lie in the same blocks, so that each sequence's rows start at a whole block for TMA.

The kernel builders: tilelang_kernels.py; their configurations: tilelang_configs.py.
"""

import math

import torch

from .. import buffers
from ..kernel_backend import KernelBackend
from ..launch_math import cdiv
from ..tilelang_common import TL_DTYPE, Entry, check_program_count, launcher, needs_fold, placeholder, precompile
from .tilelang_configs import BWD_CONFIGS, DQ_SUBTILE, FWD_CONFIGS, PREP_ROWS, BwdConfig, FwdConfig
from .tilelang_dropout import dropout_args
from .tilelang_kernels import backward_kernel, dq_first_block, forward_kernel, preprocess_kernel

# --------------------------------------------------------------------------- compile entries


def forward_entry(
    dim: int,
    dtype: torch.dtype,
    causal: bool,
    has_lengths: bool,
    dropout: bool,
    cfg: FwdConfig | None = None,
    varlen: bool = False,
    fold: bool = False,
) -> Entry:
    cfg = cfg or FWD_CONFIGS[dim]
    flags = (causal, has_lengths, dropout, varlen, fold)
    key = ("flash_attention_fwd", dim, dtype, *flags, cfg)  # the config last (tests)
    return key, lambda _: forward_kernel(dim, TL_DTYPE[dtype], causal, has_lengths, dropout, cfg, varlen, fold)


def preprocess_entry(dim: int, dtype: torch.dtype, varlen: bool = False, fold: bool = False) -> Entry:
    key = ("flash_attention_prep", dim, dtype, varlen, fold)
    return key, lambda _: preprocess_kernel(dim, TL_DTYPE[dtype], varlen, fold)


def backward_entry(
    dim: int,
    dtype: torch.dtype,
    causal: bool,
    has_lengths: bool,
    dropout: bool,
    cfg: BwdConfig | None = None,
    varlen: bool = False,
    fold: bool = False,
) -> Entry:
    cfg = cfg or BWD_CONFIGS[dim]
    flags = (causal, has_lengths, dropout, varlen, fold)
    key = ("flash_attention_bwd", dim, dtype, *flags, cfg)  # the config last (tests)
    return key, lambda _: backward_kernel(dim, TL_DTYPE[dtype], causal, has_lengths, dropout, cfg, varlen, fold)


def entries(dim: int, dtype: torch.dtype, causal: bool, has_lengths: bool, dropout: bool) -> list[Entry]:
    """Every kernel one specialisation runs, forward and backward (for `precompile`)."""
    return [
        forward_entry(dim, dtype, causal, has_lengths, dropout),
        preprocess_entry(dim, dtype),
        backward_entry(dim, dtype, causal, has_lengths, dropout),
    ]


def warm_up(specs, device: torch.device) -> None:
    """Compile the kernels of (dim, dtype, causal, has_lengths, dropout) specs in parallel."""
    precompile([e for spec in specs for e in entries(*spec)], device)


# --------------------------------------------------------------------------- tensors


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself when TMA can read it (last stride 1, other strides and the address 16-byte
    aligned), else a contiguous copy."""
    size = x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st > 0 and st * size % 16 == 0 for st in x.stride()[:-1]):
        return x
    return x.contiguous()


def _is_dense(x: torch.Tensor) -> bool:
    """x covers its memory exactly once (some permutation of a contiguous tensor)."""
    expected = 1
    dims = [(size, stride) for size, stride in zip(x.shape, x.stride()) if size != 1]
    for size, stride in sorted(dims, key=lambda t: t[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _empty_as(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor with x's strides, as torch.empty_like(x) gives for a dense x (so a
    view of [B, L, H, D] memory gets gradients in that layout), when TMA can use them; else
    contiguous. Allocated through buffers (NaN-poisoned in tests)."""
    dtype = dtype or x.dtype
    size = torch.finfo(dtype).bits // 8
    if _is_dense(x) and x.stride(-1) == 1 and all(st > 0 and st * size % 16 == 0 for st in x.stride()[:-1]):
        return buffers.empty((x.numel(),), dtype=dtype, device=x.device).as_strided(x.shape, x.stride())
    return buffers.empty(x.shape, dtype=dtype, device=x.device)


def _lengths(key_lengths: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return placeholder(device, torch.int32) if key_lengths is None else key_lengths


def _seed(seed: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The dropout seed tensor (seeds.draw_seed_tensor), or a placeholder where there is no dropout."""
    return placeholder(device, torch.int64) if seed is None else seed


def _check_programs(what: str, sequences: int, *launches: tuple[int, int, int]) -> None:
    """Each kernel's programs, (rows, rows a program takes, heads) per sequence, fit one launch (grid x)."""
    for rows, block, heads in launches:
        check_program_count(cdiv(rows, block) * heads * sequences, what)


# --------------------------------------------------------------------------- entry points


def forward(q, k, v, key_lengths, causal, scale, dropout_p, seed, *, cfg: FwdConfig | None = None):
    """(o [B, H, Lq, D] in q's dtype, lse [B, H, Lq] fp32; -inf for rows that see no key).
    cfg overrides the tile configuration (benchmark sweeps)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    o = buffers.empty((b, h, lq, d), dtype=q.dtype, device=q.device)
    lse = buffers.empty((b, h, lq), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if lk == 0:
        return o.zero_(), lse.fill_(-math.inf)
    _check_programs("q", b, (lq, (cfg or FWD_CONFIGS[d]).block_m, h))
    dropout = dropout_p > 0
    threshold, inv_keep = dropout_args(dropout_p)
    fold = needs_fold(h, b)
    kernel = launcher(
        forward_entry(d, q.dtype, bool(causal), key_lengths is not None, dropout, cfg, fold=fold), q.device
    )
    unused = placeholder(q.device, torch.int32)
    kernel(
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        _lengths(key_lengths, q.device),
        o,
        lse,
        float(scale),
        h // hkv,
        _seed(seed, q.device),
        threshold,
        inv_keep,
        unused,
        unused,
        unused,
    )
    return o, lse


_blocks: dict[torch.device, torch.Tensor] = {}


def _grid_extent(n: int, device: torch.device) -> torch.Tensor:
    """A tensor of n elements (never read): the varlen kernels take their grid's query (forward) or key (backward)
    blocks from its length."""
    buffer = _blocks.get(device)
    if buffer is None or buffer.numel() < n:
        size = max(n, 64, 2 * (0 if buffer is None else buffer.numel()))
        buffer = _blocks[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return buffer[:n]


def varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    scale,
    dropout_p,
    seed,
    *,
    cfg: FwdConfig | None = None,
):
    """(o [total_q, H, D] in q's dtype, lse [H, total_q] fp32; -inf for rows that see no key) of packed sequences (see
    flash_attention/varlen.py)."""
    total_q, h, d = q.shape
    hkv = k.shape[1]
    o = buffers.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = buffers.empty((h, total_q), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if k.shape[0] == 0 or max_seqlen_q == 0:
        return o.zero_(), lse.fill_(-math.inf)
    cfg = cfg or FWD_CONFIGS[d]
    _check_programs("cu_seqlens_q", cu_seqlens_q.numel() - 1, (max_seqlen_q, cfg.block_m, h))
    threshold, inv_keep = dropout_args(dropout_p)
    fold = needs_fold(h, cu_seqlens_q.numel() - 1)
    entry = forward_entry(d, q.dtype, bool(causal), False, dropout_p > 0, cfg, varlen=True, fold=fold)
    launcher(entry, q.device)(
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        placeholder(q.device, torch.int32),
        o,
        lse,
        float(scale),
        h // hkv,
        _seed(seed, q.device),
        threshold,
        inv_keep,
        cu_seqlens_q,
        cu_seqlens_k,
        _grid_extent(-(-max_seqlen_q // cfg.block_m), q.device),
    )
    return o, lse


def backward(do, q, k, v, key_lengths, causal, scale, dropout_p, seed, o, lse, *, cfg: BwdConfig | None = None):
    """(dq, dk, dv, None x 5): gradients in the inputs' dtypes and dimension orders, dk/dv summed
    over each kv head's query heads. cfg overrides the tile configuration (benchmark sweeps)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dq, dk, dv = _empty_as(q), _empty_as(k), _empty_as(v)
    rest = (None,) * 5
    if dq.numel() == 0 or lk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), *rest
    cfg = cfg or BWD_CONFIGS[d]
    _check_programs("q", b, (lq, PREP_ROWS, h), (lk, cfg.block_n, hkv))
    do = _tma_ready(do)
    lq_padded = -(-lq // 4) * 4  # fp32 rows of a multiple of 16 bytes, as TMA needs
    delta = buffers.empty((b, h, lq_padded), dtype=torch.float32, device=q.device)
    lse2 = buffers.empty((b, h, lq_padded), dtype=torch.float32, device=q.device)
    if cfg.dq == "tma":
        dq_acc = torch.zeros_like(dq, dtype=torch.float32)  # dq's layout; the backward adds into it
    else:  # a block of block_m queries after another (the last padded), each in sub-tiles
        dq_acc = torch.zeros((b, h, -(-lq // cfg.block_m), cfg.block_m * d), dtype=torch.float32, device=q.device)
    fold = needs_fold(h, b)
    launcher(preprocess_entry(d, q.dtype, fold=fold), q.device)(
        o, do, lse, delta, lse2, placeholder(q.device, torch.int64)
    )
    dropout = dropout_p > 0
    threshold, inv_keep = dropout_args(dropout_p)
    entry = backward_entry(d, q.dtype, bool(causal), key_lengths is not None, dropout, cfg, fold=fold)
    kernel = launcher(entry, q.device)
    unused = placeholder(q.device, torch.int32)
    kernel(
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        do,
        lse2,
        delta,
        _lengths(key_lengths, q.device),
        dq_acc,
        dk,
        dv,
        float(scale),
        h // hkv,
        _seed(seed, q.device),
        threshold,
        inv_keep,
        unused,
        unused,
        unused,
    )
    if cfg.dq == "tma":
        dq.copy_(dq_acc)
    else:
        _unblock(dq_acc, dq)
    return dq, dk, dv, *rest


def _unblock(acc: torch.Tensor, dq: torch.Tensor) -> None:
    """dq = the blocked accumulator [B, H, query blocks, block_m * D] (BwdConfig.dq "bulk"): rows of
    DQ_SUBTILE x DQ_SUBTILE sub-tiles, each row-major."""
    b, h, lq, d = dq.shape
    sub = DQ_SUBTILE
    tiles = acc.view(b, h, -1, d // sub, sub, sub).transpose(3, 4)  # [B, H, row groups, sub rows, D / sub, sub]
    whole = lq // sub
    dq[:, :, : whole * sub].unflatten(2, (whole, sub)).unflatten(-1, (d // sub, sub)).copy_(tiles[:, :, :whole])
    if lq % sub:
        dq[:, :, whole * sub :].copy_(tiles[:, :, whole, : lq % sub].flatten(-2))


# --------------------------------------------------------------------------- packed sequences: backward


def varlen_backward(
    do,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    scale,
    dropout_p,
    seed,
    o,
    lse,
    *,
    cfg: BwdConfig | None = None,
    launch=launcher,
):
    """(dq, dk, dv, None x 8) of varlen_forward: gradients in the inputs' dtypes and dimension orders, dk/dv summed
    over each kv head's query heads. cfg overrides the tile configuration (benchmark sweeps). launch(entry, device):
    the kernels' entry point (tests pass one that records the launches)."""
    total_q, h, d = q.shape
    hkv = k.shape[1]
    dq, dk, dv = _empty_as(q), _empty_as(k), _empty_as(v)
    rest = (None,) * 8
    if dq.numel() == 0 or dk.numel() == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:  # no query sees a key
        return dq.zero_(), dk.zero_(), dv.zero_(), *rest
    cfg = cfg or BWD_CONFIGS[d]
    n = cu_seqlens_q.numel() - 1
    _check_programs("cu_seqlens_q", n, (max_seqlen_k, cfg.block_n, hkv))
    _check_programs("q", 1, (total_q, PREP_ROWS, h))
    do = _tma_ready(do)
    blocks = -(-total_q // cfg.block_m) + n  # each sequence's query blocks apart (dq_first_block)
    rows = packed_dq_rows(cu_seqlens_q, total_q, cfg.block_m)
    # delta and the log-sum-exp in those blocks too: TMA loads them from a whole block (its innermost coordinate must
    # be 16-byte aligned; a sequence's first row need not be); the rows between sequences stay 0
    delta = torch.zeros((h, blocks * cfg.block_m), dtype=torch.float32, device=q.device)
    lse2 = torch.zeros((h, blocks * cfg.block_m), dtype=torch.float32, device=q.device)
    launch(preprocess_entry(d, q.dtype, varlen=True, fold=needs_fold(h, 1)), q.device)(
        o.contiguous(), do, lse.contiguous(), delta, lse2, rows
    )
    if cfg.dq == "tma":
        dq_acc = torch.zeros((blocks * cfg.block_m, h, d), dtype=torch.float32, device=q.device)
    else:
        dq_acc = torch.zeros((h, blocks, cfg.block_m * d), dtype=torch.float32, device=q.device)
    threshold, inv_keep = dropout_args(dropout_p)
    entry = backward_entry(d, q.dtype, bool(causal), False, dropout_p > 0, cfg, varlen=True, fold=needs_fold(h, n))
    launch(entry, q.device)(
        _tma_ready(q),
        _tma_ready(k),
        _tma_ready(v),
        do,
        lse2,
        delta,
        placeholder(q.device, torch.int32),
        dq_acc,
        dk,
        dv,
        float(scale),
        h // hkv,
        _seed(seed, q.device),
        threshold,
        inv_keep,
        cu_seqlens_q,
        cu_seqlens_k,
        _grid_extent(-(-max_seqlen_k // cfg.block_n), q.device),
    )
    if cfg.dq == "tma":
        dq.copy_(dq_acc.index_select(0, rows))
    else:
        _unblock_packed(dq_acc, dq, rows, cfg.block_m)
    return dq, dk, dv, *rest


def packed_dq_rows(cu_seqlens_q: torch.Tensor, total_q: int, block_m: int) -> torch.Tensor:
    """int64 [total_q]: the row of the varlen backward's dq accumulator (blocks of block_m rows, see dq_first_block)
    that holds each packed query row. Computed on the device from the offsets: no synchronisation."""
    row = torch.arange(total_q, dtype=torch.int32, device=cu_seqlens_q.device)
    sequence = torch.searchsorted(cu_seqlens_q, row, right=True) - 1  # the last sequence starting at or before row
    start = cu_seqlens_q[sequence].long()
    return dq_first_block(start, sequence, block_m) * block_m + (row - start)


def _unblock_packed(acc: torch.Tensor, dq: torch.Tensor, rows: torch.Tensor, block_m: int) -> None:
    """dq [total_q, H, D] = the varlen backward's blocked accumulator [H, blocks, block_m * D] (BwdConfig.dq "bulk":
    DQ_SUBTILE x DQ_SUBTILE sub-tiles, each row-major) at the accumulator rows `rows` (packed_dq_rows)."""
    h, blocks, _ = acc.shape
    d = dq.shape[-1]
    sub = DQ_SUBTILE
    tiles = acc.view(h, blocks, block_m // sub, d // sub, sub, sub)  # [H, blocks, row groups, D / sub, sub, sub]
    block, within = rows // block_m, rows % block_m
    # the indexed dimensions (blocks, row groups, sub rows) are not adjacent: their index comes first
    dq.copy_(tiles[:, block, within // sub, :, within % sub, :].flatten(-2))  # [total_q, H, D / sub, sub]


KERNELS = KernelBackend(forward=forward, backward=backward)
VARLEN_KERNELS = KernelBackend(forward=varlen_forward, backward=varlen_backward)
