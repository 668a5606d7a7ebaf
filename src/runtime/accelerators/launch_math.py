"""Integer arithmetic for kernel launchers (grids and block sizes), run on every eager call.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: from Python each call
costs about 2 us (Triton 3.6 and 3.9), against a few tens of nanoseconds for the plain arithmetic here.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """The ceiling of a / b for a >= 0, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2 gives for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def pow2_at_least(n: int, least: int = 1) -> int:
    """next_power_of_2(n), but at least `least` (a block size that tiles must not go below)."""
    return max(least, next_power_of_2(n))
