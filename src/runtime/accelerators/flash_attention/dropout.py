"""The dropout draw of both kernel backends, and its torch rebuild for tests.

Element (b, h, i, j) (query i, key j) is kept when 16 bits of a counter-based hash reach the threshold
round(p * 2^16). The hash costs the kernels one lowbias32 round per two elements:

    pair  = mix(seed ^ (b * H + h) * PAIR_MUL)                          once per (batch, head)
    key   = mix(pair ^ (i >> 16) * QUERY_BLOCK_MUL ^ (j >> 17) * KEY_BLOCK_MUL)      once per tile
    h     = mix(key ^ (i mod 2^16) << 16 ^ pair_index(j))                  once per two keys
    bits  = the high half of h for a key with bit 3 set, else the low half

pair_index(j) maps keys j and j ^ 8 to one 16-bit index (distinct for every other key of the same 2^17
block), so within a block of 2^16 queries x 2^17 keys every element gets its own 16 bits; the blocks
differ by their key. Keys j and j ^ 8 sit in one thread in the tensor-core accumulator layouts of both
orientations ([queries, keys] and [keys, queries]), so the compiler computes their shared round once.
Forward and backward regenerate the same bits: nothing of size L x L is stored, and both backends drop
the same elements for a seed. Only lowbias32 is per element: the per-index terms are shifts and masks,
the multiplied block indices are per tile.
"""

from __future__ import annotations

import torch

BITS = 16
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
PAIR_MUL = 0x9E3779B9  # spreads the (batch, head) index before mixing
QUERY_BLOCK_MUL, KEY_BLOCK_MUL = 0x85EBCA6B, 0xC2B2AE35  # spread the indices of 2^16-query and 2^17-key blocks
QUERY_BLOCK_SHIFT, KEY_BLOCK_SHIFT = 16, 17
_U32 = 0xFFFFFFFF


def keep_threshold(dropout_p: float) -> int:
    """The kernels keep an element whose 16 random bits are >= this."""
    return min(round(dropout_p * (1 << BITS)), (1 << BITS) - 1)


def drop_rate(dropout_p: float) -> float:
    """The rate the kernels drop at: p rounded to a multiple of 2^-16 (at most 7.7e-6 from p; exact in fp32).
    Kept elements are scaled by 1 / (1 - this)."""
    return keep_threshold(dropout_p) / (1 << BITS)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 tensors holding uint32 values"""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & _U32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & _U32
    return x ^ (x >> 16)


def random_bits(seed: int, bh: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The 16 random bits of elements (pair index bh = b * H + h, query i, key j): int64 tensors that broadcast."""
    pair = _mix((seed & _U32) ^ ((bh * PAIR_MUL) & _U32))
    blocks = ((i >> QUERY_BLOCK_SHIFT) * QUERY_BLOCK_MUL) ^ ((j >> KEY_BLOCK_SHIFT) * KEY_BLOCK_MUL)
    key = _mix(pair ^ (blocks & _U32))
    pair_index = (((j >> 4) << 3) | (j & 7)) & 0xFFFF
    h = _mix(key ^ ((i << 16) & _U32) ^ pair_index)
    return torch.where((j & 8) != 0, h >> 16, h & 0xFFFF)


def keep_mask(seed: int, b: int, h: int, lq: int, lk: int, dropout_p: float, device) -> torch.Tensor:
    """The keep mask [B, H, Lq, Lk] the kernels draw for this seed, rebuilt with torch integer ops (for tests:
    it materialises L x L)."""

    def index(n, dim):
        shape = [1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=device).view(shape)

    bh = torch.arange(b * h, dtype=torch.int64, device=device).view(-1, 1, 1)
    bits = random_bits(seed, bh, index(lq, 1), index(lk, 2))
    return (bits >= keep_threshold(dropout_p)).view(b, h, lq, lk)


def varlen_keep_masks(
    seed: int, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, heads: int, dropout_p: float, device
) -> list[torch.Tensor]:
    """The keep masks [H, Lq_s, Lk_s] the kernels draw for packed sequences: sequence s, positions i and j within it,
    is element (s, h, i, j) of the padded batch [N, H, max_q, max_k] (for tests)."""
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths_q = [b - a for a, b in zip(offsets_q, offsets_q[1:])]
    lengths_k = [b - a for a, b in zip(offsets_k, offsets_k[1:])]
    n = len(lengths_q)
    padded = keep_mask(seed, n, heads, max(lengths_q, default=0), max(lengths_k, default=0), dropout_p, device)
    return [padded[s, :, : lengths_q[s], : lengths_k[s]] for s in range(n)]
