"""The launchers' integer helpers agree with Triton's constexpr functions they replace on the host."""

import triton

from runtime.accelerators.launch_math import cdiv, next_power_of_2, pow2_at_least


def test_cdiv_matches_triton():
    for a in range(0, 600):
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(2**40 + 1, 2**20) == triton.cdiv(2**40 + 1, 2**20)


def test_next_power_of_2_matches_triton():
    for n in list(range(0, 5000)) + [2**31 - 1, 2**31, 2**31 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_pow2_at_least_is_the_next_power_of_2_with_a_floor():
    assert [pow2_at_least(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert [pow2_at_least(n, 16) for n in (1, 16, 17, 24)] == [16, 16, 32, 32]
