"""The benchmark's GPU timing on the GPU machine: a call that cannot be captured in a CUDA graph is timed eagerly, and
leaves the device's random number generator usable for the calls after it."""

import torch

from runtime.benchmark import timing

CUDA = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def test_an_uncapturable_call_is_timed_eagerly_and_random_draws_still_work():
    x = torch.randn(1024, device=CUDA)
    times, captured = timing.gpu_time_ms(lambda: (x * 2).sum().item(), CUDA, replays=5)  # a host sync
    assert not captured and times["median"] > 0
    torch.manual_seed(3)
    first = torch.randn(8, device=CUDA)
    torch.manual_seed(3)
    assert torch.equal(first, torch.randn(8, device=CUDA))
    torch.nn.functional.dropout(x, 0.5)


def test_a_captured_call_replays_in_the_graph():
    x = torch.randn(1 << 20, device=CUDA)
    times, captured = timing.gpu_time_ms(lambda: x * 2, CUDA, replays=5)
    assert captured and 0 < times["median"] < 1
