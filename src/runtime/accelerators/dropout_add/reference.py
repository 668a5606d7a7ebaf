"""dropout_add in plain torch, and the kernels' keep masks rebuilt in plain torch.

`dropout_add_reference` is the torch backend: residual + F.dropout(x, p, training) as eager
torch computes it (torch's own RNG). The kernel backends draw their masks from counter-based generators of
(seed, element index); `triton_keep_mask` and `tilelang_keep_mask` rebuild those masks exactly,
so tests can compare a kernel's mask element by element and compute float64 references. They take
the seed as the kernels get it (the one-element int64 tensor the op drew, read back here with one
host sync) or as a plain integer.

Both kernels keep an element when the top 24 bits of its 32-bit random number are at least
`keep_threshold(p)`, and scale kept elements by 1 / (1 - p).
"""

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF
TRITON_BLOCK = 8192  # elements per program of the Triton kernels: part of their random stream


def seed_value(seed: int | torch.Tensor) -> int:
    """The seed as a Python int: a one-element seed tensor (the kernels' argument) is read back."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex:
            raise ValueError(
                f"seed: expected a one-element integer tensor, got {seed.dtype} of shape {tuple(seed.shape)}"
            )
        return int(seed.reshape(()).item())
    return int(seed)


def dropout_add_reference(
    x: torch.Tensor, residual: torch.Tensor, p: float = 0.0, training: bool = True
) -> torch.Tensor:
    return residual + F.dropout(x, p, training)


def dropout_add_masked(x: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """residual + x * keep / (1 - p) for a given boolean keep mask (the kernels' math)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return (residual.to(compute) + x.to(compute) * keep.to(compute) / (1.0 - p)).to(x.dtype)


def keep_threshold(p: float) -> int:
    """Keep an element when its 24-bit random number is >= this: a keep rate of 1 - p (to 2^-25)."""
    return round(p * 2**24)


# --------------------------------------------------------------------------- 32-bit arithmetic on int64 tensors


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 32-bit words of a * b for a constant a < 2^32 and b in [0, 2^32), without int64 overflow."""
    low_product = a * (b & 0xFFFF)  # < 2^48
    s = a * (b >> 16) + (low_product >> 16)  # a * b = s * 2^16 + (low_product & 0xFFFF)
    return ((s & 0xFFFF) << 16) | (low_product & 0xFFFF), s >> 16


# --------------------------------------------------------------------------- Triton: Philox4x32-10


def _philox(seed: int, c0: torch.Tensor, c1: torch.Tensor) -> list[torch.Tensor]:
    """The four 32-bit outputs of Philox4x32-10 for counters (c0, c1, 0, 0) and key (seed low, seed high)."""
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for _ in range(10):
        lo_b, hi_b = _mul32(0xCD9E8D57, c2)
        lo_a, hi_a = _mul32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return [c0, c1, c2, c3]


def triton_keep_mask(numel: int, seed: int | torch.Tensor, p: float, device=None) -> torch.Tensor:
    """The Triton kernels' keep mask of elements 0..numel-1 for a seed (int or the kernels' seed tensor).

    A program covers TRITON_BLOCK elements as 4 chunks of Q = TRITON_BLOCK / 4; element k of chunk
    j takes output j of Philox at counter (program * Q + k): one Philox call serves 4 elements.
    """
    seed = seed_value(seed)
    q = TRITON_BLOCK // 4
    index = torch.arange(numel, dtype=torch.int64, device=device)
    program, within = index // TRITON_BLOCK, index % TRITON_BLOCK
    chunk, k = within // q, within % q
    counter = program * q + k
    outputs = torch.stack(_philox(seed, counter & MASK32, counter >> 32))
    random = outputs.gather(0, chunk[None]).squeeze(0)
    return (random >> 8) >= keep_threshold(p)


# --------------------------------------------------------------------------- TileLang: keyed integer hash


HASH_M1, HASH_M2 = 0x7FEB352D, 0x846CA68B


KEY_MULTIPLIER = 0x9E3779B1


def tilelang_keys(seed: int | torch.Tensor) -> tuple[int, int]:
    """The two 31-bit hash keys the TileLang kernels derive (in the kernel, with int64 math) from a seed."""
    seed = seed_value(seed) & 0x7FFFFFFF
    return seed, (seed * KEY_MULTIPLIER >> 7) & 0x7FFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mix (xorshift-multiply, the "lowbias32" constants)."""
    h = _mul32(HASH_M1, h ^ (h >> 16))[0]
    h = _mul32(HASH_M2, h ^ (h >> 15))[0]
    return h ^ (h >> 16)


def tilelang_keep_mask(numel: int, seed: int | torch.Tensor, p: float, device=None) -> torch.Tensor:
    """The TileLang kernels' keep mask for a seed (int or the kernels' seed tensor): element i draws mix(mix(i ^ key0) ^ key1)."""
    k0, k1 = tilelang_keys(seed)
    index = torch.arange(numel, dtype=torch.int64, device=device)
    random = _mix(_mix(index ^ k0) ^ k1)
    return (random >> 8) >= keep_threshold(p)
