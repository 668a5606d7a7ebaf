"""Dropout in the TileLang attention kernels (flash_attention's and silu_attention's): the hash of dropout.py as a
CUDA prelude, the keep test of one tile element, the seed's dtype and the kernels' threshold arguments."""

import tilelang.language as T

from . import dropout

# The dropout hash (dropout.py) as a CUDA helper in the kernels' prelude: written as a TileLang expression, each
# lowbias32 round repeats its input, and the rounds make an expression tree too large to compile fast. nvcc computes
# the tile's key once (its arguments are the same for every element). dropout_keep passes the key index as its pair
# index and half in TileLang's integer division, which TileLang simplifies to the same expression for keys j and
# j ^ 8 (in one thread), so that nvcc computes their shared round once.
DROPOUT_PRELUDE = f"""
__device__ __forceinline__ unsigned taac_mix32(unsigned x) {{
  x ^= x >> 16; x *= {dropout.MIX_A:#x}u; x ^= x >> 15; x *= {dropout.MIX_B:#x}u; x ^= x >> 16;  // lowbias32
  return x;
}}
// {dropout.BITS} random bits of element (bh, query, key) of a dropout draw, in the tile from (q0, k0); the key as
// its pair index (keys j and j ^ 8 share one) and half (bit 3)
__device__ __forceinline__ unsigned taac_dropout_bits(int seed, int bh, int q0, int k0, int query, int pair_index,
                                                      int high) {{
  unsigned key = taac_mix32((unsigned)seed ^ ((unsigned)bh * {dropout.PAIR_MUL:#x}u));
  key = taac_mix32(key ^ ((unsigned)q0 >> {dropout.QUERY_BLOCK_SHIFT}) * {dropout.QUERY_BLOCK_MUL:#x}u
                       ^ ((unsigned)k0 >> {dropout.KEY_BLOCK_SHIFT}) * {dropout.KEY_BLOCK_MUL:#x}u);
  unsigned h = taac_mix32(key ^ ((unsigned)query << 16) ^ ((unsigned)pair_index & 0xffffu));
  return high ? h >> 16 : h & 0xffffu;
}}
"""


def dropout_keep(seed, bh, q0, k0, i, j, threshold):
    """True when element (bh, query q0 + i, key k0 + j) of the tile from (q0, k0) survives dropout: its random bits
    >= the threshold."""
    key = k0 + j
    pair_index, high = key // 16 * 8 + key % 8, key // 8 % 2
    return T.call_pure_extern("int32", "taac_dropout_bits", seed, bh, q0, k0, q0 + i, pair_index, high) >= threshold


SEED = "int64"  # the seed tensor's dtype (seeds.draw_seed_tensor)


def dropout_args(dropout_p: float) -> tuple[int, float]:
    """(threshold on the random bits, 1 / (1 - the rate they drop at)) as the kernels take them."""
    return dropout.keep_threshold(dropout_p), 1.0 / (1.0 - dropout.drop_rate(dropout_p))
