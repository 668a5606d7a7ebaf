"""The eager timing: median of several windows, so one slow window does not decide a row; the L2 flush's kernel."""

import time

import torch

from runtime.benchmark.timing import eager_time_ms


def test_eager_time_ignores_one_slow_window():
    calls = {"n": 0}

    def op():  # about 1 ms a call; one call, in the timed windows, stalls for 300 ms
        calls["n"] += 1
        time.sleep(0.3 if calls["n"] == 40 else 0.001)

    ms = eager_time_ms(op, torch.device("cpu"), calls=10, min_seconds=0.05, windows=5)
    # one window of 10 calls with the stall would average over 30 ms a call
    assert 0.9 < ms < 5.0, ms
    assert calls["n"] >= 3 + 5 * 10


def test_the_flush_reads_every_element_once():
    """The evict-last flush kernel (under the interpreter here): each block's sum, the partial last block too."""
    from runtime.benchmark.l2_flush import BLOCK, EvictLastReader

    buffer = torch.arange(2 * BLOCK + 100, dtype=torch.int32) % 7
    read = EvictLastReader(buffer)
    read()
    expected = [int(buffer[i : i + BLOCK].sum()) for i in range(0, buffer.numel(), BLOCK)]
    assert read.partials.tolist() == expected
