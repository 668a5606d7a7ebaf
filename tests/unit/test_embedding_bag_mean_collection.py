"""embedding_bag_collection on the CPU tier: the torch loop and the Triton kernels (interpreter) against a float64
per-table loop, the KeyedJaggedTensor input, EmbeddingBagCollection, dispatch and the error messages."""

import warnings

import pytest
import torch

import runtime.accelerators as acc
from runtime.accelerators import embedding_bag_collection
from runtime.accelerators.buffers import poison_outputs
from runtime.accelerators.testing import RTOL, assert_close, gradient_tolerance
from runtime.nn import EmbeddingBagCollection

f32, bf16 = torch.float32, torch.bfloat16
DIMS = (8, 16, 24)
ROWS = (11, 7, 13)
BATCH = 5


def jagged(rows=ROWS, batch=BATCH, padding_idx=None, seed=0, max_len=4):
    """values and offsets (key-major) with bag lengths 0..max_len, padding entries sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(rows) * batch,), generator=gen)
    lengths[0], lengths[-1] = 0, max_len  # an empty bag and a full one, whatever the seed
    values = []
    for t, n in enumerate(rows):
        for b in range(batch):
            ids = torch.randint(0, n, (int(lengths[t * batch + b]),), generator=gen)
            if padding_idx is not None and ids.numel() > 1:
                ids[0] = padding_idx % n
            values.append(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.cat(values), offsets


def tables(dtype=f32, rows=ROWS, dims=DIMS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for n, d in zip(rows, dims)
    ]


def mean64(weights, values, offsets, padding_idx=None):
    """Textbook float64: per table, each bag's mean over its non-padding rows (zeros when none)."""
    batch = (offsets.numel() - 1) // len(weights)
    bounds = offsets.tolist()
    columns = []
    for t, w in enumerate(weights):
        w = w.double()
        pad = None if padding_idx is None else padding_idx % w.shape[0]
        rows = []
        for b in range(batch):
            kept = [i for i in values[bounds[t * batch + b] : bounds[t * batch + b + 1]].tolist() if i != pad]
            rows.append(torch.stack([w[i] for i in kept]).mean(0) if kept else w.new_zeros(w.shape[1]))
        columns.append(torch.stack(rows) if rows else w.new_zeros(0, w.shape[1]))
    return torch.cat(columns, dim=1)


def check(backend, dtype, padding_idx=None, index_dtype=torch.int64, batch=BATCH, max_len=4):
    weights = tables(dtype)
    values, offsets = jagged(batch=batch, padding_idx=padding_idx, max_len=max_len)
    values, offsets = values.to(index_dtype), offsets.to(index_dtype)
    with poison_outputs():
        out = embedding_bag_collection(weights, values, offsets, padding_idx=padding_idx, backend=backend)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, weights, grad_out)
    weights64 = [w.detach().double().requires_grad_() for w in weights]
    out64 = mean64(weights64, values, offsets, padding_idx)
    grads64 = torch.autograd.grad(out64, weights64, grad_out.double(), allow_unused=True, materialize_grads=True)
    assert out.shape == (batch, sum(DIMS)) and out.dtype == dtype
    rtol = 1e-12 if dtype == torch.float64 else RTOL[dtype]  # float64: the same math in another order
    assert_close(f"{backend} out", out, out64, rtol)
    for t, (g, g64) in enumerate(zip(grads, grads64)):
        assert g.shape == weights[t].shape and g.dtype == dtype
        assert_close(f"{backend} grad[{t}]", g, g64, gradient_tolerance(dtype, rtol))


@pytest.mark.parametrize("padding_idx", [None, 0, -1], ids=["no-pad", "pad0", "pad-last"])
def test_torch_matches_float64(padding_idx):
    check("torch", torch.float64, padding_idx)


@pytest.mark.parametrize(
    "dtype,padding_idx,index_dtype",
    [(f32, None, torch.int64), (f32, 0, torch.int32), (bf16, -1, torch.int64)],
    ids=["f32", "f32-pad-int32", "bf16-pad-last"],
)
@pytest.mark.slow
def test_triton_matches_float64(dtype, padding_idx, index_dtype):
    check("triton", dtype, padding_idx, index_dtype)


def test_triton_segments_across_chunks():
    """Many entries of few rows: segments run over several of the gradient's chunks (the combine pass)."""
    weights = tables(rows=(3, 2, 4))
    values, offsets = jagged(rows=(3, 2, 4), batch=9, max_len=12, seed=3)
    with poison_outputs():
        out = embedding_bag_collection(weights, values, offsets, padding_idx=1, backend="triton")
        grads = torch.autograd.grad(out, weights, torch.ones_like(out))
    weights64 = [w.detach().double().requires_grad_() for w in weights]
    grads64 = torch.autograd.grad(mean64(weights64, values, offsets, 1), weights64, torch.ones_like(out).double())
    for g, g64 in zip(grads, grads64):
        assert_close("grad", g, g64, gradient_tolerance(f32))


def test_triton_batch_one_and_no_values():
    check("triton", f32, batch=1)
    weights = tables()
    values, offsets = torch.zeros(0, dtype=torch.long), torch.zeros(3 * 4 + 1, dtype=torch.long)
    out = embedding_bag_collection(weights, values, offsets, backend="triton")
    assert out.shape == (4, sum(DIMS)) and not out.any()
    grads = torch.autograd.grad(out, weights, torch.ones_like(out))
    assert all(not g.any() for g in grads)


class StandIn:
    """The KeyedJaggedTensor methods the op reads (torchrec is not installed here)."""

    def __init__(self, keys, values, offsets):
        self._keys, self._values, self._offsets = keys, values, offsets

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def offsets(self):
        return self._offsets


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_keyed_jagged_input(backend):
    weights = tables()
    values, offsets = jagged()
    direct = embedding_bag_collection(weights, values, offsets, backend=backend)
    keyed = embedding_bag_collection(weights, StandIn(["a", "b", "c"], values, offsets), backend=backend)
    assert torch.equal(direct, keyed)
    with pytest.raises(ValueError, match="offsets: must be None"):
        embedding_bag_collection(weights, StandIn(["a", "b", "c"], values, offsets), offsets, backend=backend)
    with pytest.raises(ValueError, match="has 2 keys"):
        embedding_bag_collection(weights, StandIn(["a", "b"], values, offsets), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_errors(backend):
    weights = tables()
    values, offsets = jagged()
    with pytest.raises(ValueError, match=r"offsets: expected T\*B \+ 1 entries for T=3"):
        embedding_bag_collection(weights, values, offsets[:-1], backend=backend)
    with pytest.raises(TypeError, match="values: expected an int32 or int64 tensor, got torch.float32"):
        embedding_bag_collection(weights, values.float(), offsets, backend=backend)
    with pytest.raises(TypeError, match=r"weights\[1\]: expected torch.float32 like weights\[0\]"):
        embedding_bag_collection([weights[0], weights[1].double()], values, offsets[: 2 * BATCH + 1], backend=backend)
    with pytest.raises(TypeError, match="weights: expected a non-empty list"):
        embedding_bag_collection(weights[0], values, offsets, backend=backend)
    with pytest.raises(
        ValueError, match=r"padding_idx: expected None or an int in \[-\d+, \d+\) \(num_embeddings of table \d\)"
    ):
        embedding_bag_collection(weights, values, offsets, padding_idx=7, backend=backend)
    # a string is a Sequence: it was read as one entry per character ("expected one entry per table")
    with pytest.raises(TypeError, match=r"padding_idx: expected None or an int in .* of table 0\), got str '0'"):
        embedding_bag_collection(weights, values, offsets, padding_idx="0", backend=backend)
    with pytest.raises(ValueError, match="offsets: required"):
        embedding_bag_collection(weights, values, backend=backend)
    bad = values.clone()
    bad[-1] = ROWS[-1]  # the last table's entry one past its rows (valid in a larger table)
    with pytest.raises(IndexError, match="values"):
        embedding_bag_collection(weights, bad, offsets, backend=backend)
    with pytest.raises(IndexError, match="offsets"):
        embedding_bag_collection(weights, values, offsets.flip(0), backend=backend)
    if backend == "triton":  # unchecked: unspecified values, no out-of-bounds access (torch's own op raises)
        embedding_bag_collection(weights, bad, offsets, check_indices=False, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "values, offset",
    [(torch.tensor([1, 2, 3]), 3), (torch.tensor([1]), 0), (torch.tensor([], dtype=torch.int64), 2)],
    ids=["values after the one offset", "values with offset 0", "no values, offset 2"],
)
def test_one_offset_is_no_bag_and_still_checked(backend, values, offset):
    """offsets of one entry (B = 0): the kernels launch nothing, yet offsets must be [0] and values empty, as on
    the torch backend."""
    with pytest.raises(IndexError, match=r"offsets: expected to rise from 0 to len\(values\)"):
        embedding_bag_collection(tables(), values, torch.tensor([offset]), backend=backend)


def test_tilelang_falls_back_with_its_reason():
    weights = tables()
    values, offsets = jagged()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = embedding_bag_collection(weights, values, offsets, backend="tilelang")
    assert any(issubclass(w.category, acc.BackendFallbackWarning) for w in caught)
    assert torch.equal(out, embedding_bag_collection(weights, values, offsets, backend="torch"))
    with acc.use_accelerators(fallback="error"), pytest.raises(acc.BackendUnavailableError, match="tilelang"):
        embedding_bag_collection(weights, values, offsets, backend="tilelang")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_module(backend):
    module = EmbeddingBagCollection(
        {"user": (11, 8), "region": (7, 16), "tags": (13, 24)}, padding_idx=0, backend=backend
    )
    assert sorted(module.state_dict()) == ["tables.region.weight", "tables.tags.weight", "tables.user.weight"]
    assert all(not w[0].any() for w in module.weights())
    values, offsets = jagged(padding_idx=0)
    out = module(values, offsets)
    reference = mean64(module.weights(), values, offsets, 0)
    assert_close("module", out, reference, RTOL[f32])
    keyed = module(StandIn(["user", "region", "tags"], values, offsets))
    assert torch.equal(out, keyed)
    with pytest.raises(ValueError, match="keys"):
        module(StandIn(["region", "user", "tags"], values, offsets))


@pytest.mark.parametrize("padding_idx", [7, -8])
def test_module_rejects_a_padding_row_outside_a_table(padding_idx):
    """padding_idx must be a row of every table: an error naming it and the table, not an IndexError from zeroing
    the row."""
    with pytest.raises(
        ValueError, match=r"padding_idx: expected None or an int in \[-7, 7\) \(num_embeddings of table 'region'\)"
    ):
        EmbeddingBagCollection({"user": (11, 8), "region": (7, 16)}, padding_idx=padding_idx)
