"""GPU tier: every kernel backend against float64 references on a CUDA device."""

import os

import pytest
import torch

from runtime.accelerators.backends import clear_decisions
from runtime.accelerators.buffers import poison_outputs

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise RuntimeError("tests/gpu must run without TRITON_INTERPRET=1 (it would run the Triton kernels on the CPU)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device: the GPU tier runs on the GPU machine")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _own_autotune_cache(tmp_path_factory):
    """The decisions "auto" measures on CUDA go to $TAAC_CACHE/autotune.json: a run starts with none of an earlier
    run's (nor the user's ~/.cache)."""
    previous = os.environ.get("TAAC_CACHE")
    os.environ["TAAC_CACHE"] = str(tmp_path_factory.mktemp("taac-cache"))
    yield
    if previous is None:
        del os.environ["TAAC_CACHE"]
    else:
        os.environ["TAAC_CACHE"] = previous


@pytest.fixture(autouse=True)
def _poisoned_fresh_dispatch(request):
    """Every kernel output starts as NaN (except in tests marked `unpoisoned`, which count kernel launches: the NaN
    fills are kernels too); decisions and warnings start fresh; inputs are seeded."""
    clear_decisions()
    torch.manual_seed(0)
    if request.node.get_closest_marker("unpoisoned"):
        yield
    else:
        with poison_outputs():
            yield
    clear_decisions()


def capture_graph(fn, warmup: int = 3):
    """(graph, fn's result in the graph): `warmup` eager calls on a side stream first (kernel compilation, autograd
    and allocator warm-up), as PyTorch's CUDA graph docs do, then fn captured once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
