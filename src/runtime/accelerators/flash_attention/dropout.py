"""The dropout draw of both kernel backends, and its torch rebuild for tests.

Element (b, h, i, j) is kept when 24 bits of a counter-based hash of (seed, b * H + h, query i, key j) reach
the threshold round(p * 2^24). The hash is three rounds of lowbias32: one of the seed and the (batch, head)
pair, one of the query, one of the key, so a kernel mixes the first two once per row and only the last per
element. Forward and backward regenerate the same bits, so nothing of size L x L is stored, and both backends
drop the same elements for a seed.
"""

from __future__ import annotations

import torch

BITS = 24
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
PAIR_MUL, KEY_MUL = 0x9E3779B9, 0x85EBCA6B  # spread the (batch, head) index and the key index before mixing


def keep_threshold(dropout_p: float) -> int:
    """The kernels keep an element whose 24 random bits are >= this."""
    return min(round(dropout_p * (1 << BITS)), (1 << BITS) - 1)


def drop_rate(dropout_p: float) -> float:
    """The rate the kernels drop at: p rounded to a multiple of 2^-24 (exact in fp32). Kept elements are scaled by
    1 / (1 - this)."""
    return keep_threshold(dropout_p) / (1 << BITS)


def keep_mask(seed: int, b: int, h: int, lq: int, lk: int, dropout_p: float, device) -> torch.Tensor:
    """The keep mask [B, H, Lq, Lk] the kernels draw for this seed, rebuilt with torch integer ops (for tests:
    it materialises L x L)."""
    u32 = 0xFFFFFFFF

    def mix(x):
        x = x ^ (x >> 16)
        x = (x * MIX_A) & u32
        x = x ^ (x >> 15)
        x = (x * MIX_B) & u32
        return x ^ (x >> 16)

    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, dtype=torch.int64, device=device).view(shape)

    pair = index(b, 0) * h + index(h, 1)
    x = mix((seed & u32) ^ ((pair * PAIR_MUL) & u32))
    x = mix(x ^ index(lq, 2))
    x = mix(x ^ ((index(lk, 3) * KEY_MUL) & u32))
    return (x >> (32 - BITS)) >= keep_threshold(dropout_p)
