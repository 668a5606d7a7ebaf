"""The eager timing: median of several windows, so one slow window does not decide a row; the L2 flush's kernel."""

import time

import torch

from runtime.benchmark.timing import eager_time_ms


def test_eager_time_ignores_one_slow_window():
    calls = {"n": 0}

    def op():  # about 1 ms a call; the first timed call (after 3 warm-up calls) stalls for 300 ms
        calls["n"] += 1
        time.sleep(0.3 if calls["n"] == 4 else 0.001)

    ms = eager_time_ms(op, torch.device("cpu"), calls=10, min_seconds=0.05, windows=5)
    # the window with the stall (at most 10 calls: how many the warm-up's speed decides) averages over 30 ms a call
    assert 0.9 < ms < 5.0, ms
    assert calls["n"] >= 3 + 5  # five windows


def test_the_flush_reads_every_element_once():
    """The evict-last flush kernel (under the interpreter here): each block's sum, the partial last block too."""
    from runtime.benchmark.l2_flush import BLOCK, EvictLastReader

    buffer = torch.arange(2 * BLOCK + 100, dtype=torch.int32) % 7
    read = EvictLastReader(buffer)
    read()
    expected = [int(buffer[i : i + BLOCK].sum()) for i in range(0, buffer.numel(), BLOCK)]
    assert read.partials.tolist() == expected
