"""flash_attention's TileLang kernels, compile-only: lowered and compiled for sm_90a with the local nvcc.

One representative specialisation per kernel (forward, backward preprocess, backward); the GPU
tier checks the numbers. Also the pieces that need no GPU: the dropout hash the tests rebuild in
torch, and the tensor-layout helpers.
"""

import re
import subprocess

import pytest
import torch

from conftest import NVCC, SM90A, requires_nvcc
from tma_source import misaligned_tma_copies

fa = pytest.importorskip(
    "runtime.accelerators.flash_attention.tilelang", reason="tilelang 0.1.15 is not installed", exc_type=ImportError
)

_compiled = {}


def compile_entry(entry):
    import tilelang

    from runtime.accelerators.tilelang_common import device_info

    key, build = entry
    if key not in _compiled:
        _compiled[key] = tilelang.compile(build(device_info(None)), target=SM90A)
    return _compiled[key]


# each kernel once, at a head dim and flags that exercise its special paths: D=48 (K transposed in
# shared memory for dq, 96-byte rows), causal with key_lengths, dropout, fp16
KERNELS = {
    "forward-d48-bf16-causal-lengths-dropout": lambda: fa.forward_entry(48, torch.bfloat16, True, True, True),
    "preprocess-d48-bf16": lambda: fa.preprocess_entry(48, torch.bfloat16),
    "backward-d48-f16-causal-lengths-dropout": lambda: fa.backward_entry(48, torch.float16, True, True, True),
    # the plain loop without key lengths
    "forward-d64-f16": lambda: fa.forward_entry(64, torch.float16, False, False, False),
    # the D=128 default overlaps the softmax with the PV product
    "forward-d128-bf16-causal-lengths-dropout-overlap": lambda: fa.forward_entry(128, torch.bfloat16, True, True, True),
    # D >= 32 (two compute warpgroups) overlap the backward's products and add dq by bulk reductions; D=16 keeps
    # the plain loop with TMA reductions
    "backward-d128-bf16-causal-lengths-dropout": lambda: fa.backward_entry(128, torch.bfloat16, True, True, True),
    "backward-d16-bf16-lengths-dropout": lambda: fa.backward_entry(16, torch.bfloat16, False, True, True),
    # the overlapped backward without a transposed K copy (K and V by TMA)
    "backward-d64-f16": lambda: fa.backward_entry(64, torch.float16, False, False, False),
    # packed sequences (cu_seqlens): the preprocess over packed rows, and the backward per (key block, kv head,
    # sequence) with bulk dq reductions (D=32 causal, D=64 with dropout, D=128) and with TMA reductions (D=16);
    # GQA is the runtime `groups`, so every specialisation serves it
    "preprocess-varlen-d64-bf16": lambda: fa.preprocess_entry(64, torch.bfloat16, varlen=True),
    "backward-varlen-d32-bf16-causal": lambda: fa.backward_entry(32, torch.bfloat16, True, False, False, varlen=True),
    "backward-varlen-d64-f16-dropout": lambda: fa.backward_entry(64, torch.float16, False, False, True, varlen=True),
    "backward-varlen-d128-bf16": lambda: fa.backward_entry(128, torch.bfloat16, False, False, False, varlen=True),
    "backward-varlen-d16-f16-causal-dropout": lambda: fa.backward_entry(
        16, torch.float16, True, False, True, varlen=True
    ),
}


def ptxas_report(source: str, tmp_path) -> str:
    """ptxas's verbose report (and warnings) for a TileLang kernel source, compiled for sm_90a as TileLang does."""
    from tilelang import env

    path = tmp_path / "kernel.cu"
    path.write_text(source)
    command = [
        NVCC, "-cubin", "-arch=sm_90a", "-std=c++20", f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}",
        "--use_fast_math", "--ptxas-options=--verbose", str(path), "-o", str(tmp_path / "kernel.cubin"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


@requires_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_compiles_for_sm90a(name, tmp_path):
    entry = KERNELS[name]()
    cfg = entry[0][-1]  # the kernel's FwdConfig / BwdConfig (last in its key; the preprocess has none)
    kernel = compile_entry(entry)
    source = kernel.get_kernel_source()
    assert "__global__" in source
    # batch, heads and lengths are runtime arguments: one kernel serves every shape; packed, the number of sequences
    # and the grid's key blocks too (one kernel for every packing)
    if "varlen" not in name:
        dynamics = ("batch", "heads", "q_len")
    else:
        dynamics = ("heads", "q_len") if name.startswith("preprocess") else ("heads", "n_offsets", "k_blocks")
    for dynamic in dynamics:
        assert f"int {dynamic}" in source, f"{name}: {dynamic} should be a runtime argument"
    if name.startswith("preprocess"):  # delta and the log-sum-exp each stored to their own buffer
        assert "Delta[" in source and "LSE2[" in source, f"{name}: delta and lse2 should be distinct outputs"
    if name.startswith("preprocess") and "varlen" in name:  # into the backward's query blocks (packed_dq_rows)
        assert "Rows[" in source, f"{name}: delta and lse2 should be stored at the rows of the query blocks"
    if name.startswith("backward") and "varlen" in name:  # each program reads its sequence's offsets
        assert "CuQ[" in source and "CuK[" in source, f"{name}: the kernel should read cu_seqlens"
    if name.startswith(("forward", "backward")):
        assert "tma_load" in source, f"{name}: q/k/v tiles should be loaded with TMA"
        assert "wgmma" in source, f"{name}: the matmuls should use Hopper's wgmma"
        # whatever the offsets (a packed sequence starts at any row): else the copy faults with an illegal instruction
        misaligned = misaligned_tma_copies(source)
        assert not misaligned, f"{name}: TMA copies whose innermost coordinate may not be 16-byte aligned: {misaligned}"
    if name.startswith("backward"):
        consumer = source[source.find("warpgroup_reg_alloc") :]  # the compute warpgroups' code
        if cfg.dq == "bulk":  # a 1-D bulk reduction (no descriptor) waited for one step later
            bulk = re.search(r"tl::tma_store_add\(\(&\(\(\(float\*\)dq_s\)", consumer)
            assert bulk, f"{name}: dq should use bulk reductions"
            assert "tma_store_wait<1, true>" in consumer, f"{name}: the bulk reduction should be waited a step later"
        else:
            assert "tma_store_add(dQacc_desc" in source, "dq should be accumulated with TMA reductions"
    if name.startswith("backward") and cfg.overlap:
        # S and dP issued together, the exponentials run once S is done; the query loop's tiles handed back to the
        # loads only after the last wait (else a load could overwrite Q or dO while dK or dV still reads it)
        assert "wait_wgmma<1>" in consumer, f"{name}: the exponentials should overlap the dP product"
        released = consumer.rindex("wait_wgmma<0>") < consumer.index("].arrive()")
        assert released, f"{name}: Q/dO should be released after the products that read them are done"
        # a register written while a wgmma reads it makes ptxas serialise every wgmma
        assert "C7513" not in ptxas_report(source, tmp_path), f"{name}: ptxas serialised the wgmma"
    if name.startswith("forward") and cfg.overlap:
        # QK^T and PV issued together, the softmax run after waiting for QK^T alone
        assert "wait_wgmma<1>" in source, f"{name}: the softmax should overlap the PV product"
    if name.startswith(("forward", "backward")):
        # every product issued whole per 16-deep step: TileLang splits a warpgroup's share of columns that is not a
        # multiple of 16 into m64n8k16 pieces (as the backward's dq at head dim 48 once did)
        shapes = set(re.findall(r"wgmma_[rs]s<[^>]*kFloat32, (\d+), (\d+), (\d+),", source))
        assert shapes and all(int(n) % 16 == 0 for _, n, _ in shapes), f"{name}: wgmma shapes {sorted(shapes)}"
    # a tile loaded once before the pipelined loop by TMA is waited for only at its first use inside the loop, so
    # with no loop step the load was still in flight when the output tile sharing its memory was written: the
    # backward loads K and V by TMA only where its query loop surely takes a step (the overlapped loop always does),
    # and waits for them in the first step; its transposed K copy (head dims 16 and 48) reads K from global memory
    if name.startswith("backward"):
        k_tma = cfg.overlap
        for tile in ("K", "V"):
            load = re.search(rf"tma_load\({tile}_desc, mbarrier\[(\d+)\]", source)
            assert bool(load) == k_tma, f"{name}: {tile} should be loaded with TMA iff the loop takes a step"
            if load:
                first_step = rf"if \(it_1 == 0\) \{{[^}}]*mbarrier\[{load[1]}\]\.wait\(0\);"
                assert re.search(first_step, source), (
                    f"{name}: the compute warps should wait for {tile} in the first step"
                )
    if name.startswith("forward"):  # both loops take a step even with no key block (a key length of 0)
        q_tma = re.search(r"tma_load\(Q_desc, mbarrier\[(\d+)\]", source)
        assert q_tma, f"{name}: Q should be loaded with TMA"
        first_step = rf"if \(k_1 == 0\) \{{\s*mbarrier\[{q_tma[1]}\]\.wait\(0\);"
        assert re.search(first_step, source), f"{name}: the compute warps should wait for Q in the first step"


def test_gradient_layouts_follow_inputs():
    for x in (
        torch.randn(2, 37, 4, 16).transpose(1, 2),  # x.view(B, L, H, D).transpose(1, 2)
        torch.randn(2, 37, 1, 16).transpose(1, 2),  # a single kv head: a size-1 dimension
        torch.randn(2, 4, 37, 16),
    ):
        like = fa._empty_as(x, torch.float32)
        assert like.shape == x.shape and like.dtype == torch.float32
        assert like.stride() == torch.empty_like(x).stride()
    strided = torch.randn(2, 4, 37, 32)[..., ::2]  # not dense: contiguous result
    assert fa._empty_as(strided).is_contiguous()
    head_dim_outer = torch.randn(2, 4, 16, 37).transpose(-1, -2)  # dense, but D is not innermost
    assert fa._empty_as(head_dim_outer).is_contiguous()


def test_tma_ready_copies_only_when_needed():
    view = torch.randn(2, 37, 4, 16, dtype=torch.bfloat16).transpose(1, 2)
    assert fa._tma_ready(view) is view
    odd_rows = torch.randn(2, 4, 37, 20, dtype=torch.bfloat16)[..., :16]  # 40-byte rows: not 16-byte aligned
    ready = fa._tma_ready(odd_rows)
    assert ready is not odd_rows and ready.is_contiguous() and torch.equal(ready, odd_rows)
    broadcast = torch.randn(1, 1, 1, 16, dtype=torch.bfloat16).expand(2, 4, 37, 16)  # zero strides
    assert fa._tma_ready(broadcast).is_contiguous()


def test_blocked_dq_accumulator_unblocks():
    """BwdConfig.dq "bulk" adds block m's row i, column j at [m, ((i//8 * D/8 + j//8) * 8 + i%8) * 8 + j%8]."""
    sub = fa.DQ_SUBTILE
    for b, h, lq, d, block_m in ((2, 3, 70, 48, 64), (1, 2, 128, 128, 64), (1, 1, 5, 16, 64), (2, 1, 200, 64, 32)):
        dq = torch.randn(b, h, lq, d)
        blocks = -(-lq // block_m)
        rows = torch.cat([dq, torch.zeros(b, h, blocks * block_m - lq, d)], dim=2)
        i = torch.arange(block_m).view(-1, 1)
        j = torch.arange(d).view(1, -1)
        at = ((i // sub * (d // sub) + j // sub) * sub + i % sub) * sub + j % sub  # the kernel's index of (i, j)
        acc = torch.zeros(b, h, blocks, block_m * d)
        acc.view(-1, block_m * d)[:, at.flatten()] = rows.reshape(-1, block_m * d)
        out = torch.full((b, lq, h, d), float("nan")).transpose(1, 2)  # a strided gradient, as q's layout gives
        fa._unblock(acc, out)
        assert torch.equal(out, dq), (b, h, lq, d, block_m)


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# empty sequences first, between and last; single rows; a block exactly; one past a block
PACKED_LENGTHS = [0, 1, 64, 65, 0, 3, 130, 1, 0]


@pytest.mark.parametrize("block_m", [64, 128])
def test_packed_dq_rows_give_each_sequence_blocks_of_its_own(block_m):
    """The varlen backward's dq accumulator: sequence s's rows from block dq_first_block(cu[s], s) on, in order; no
    block holds rows of two sequences; ceil(total_q / block_m) + N blocks hold them all."""
    cu = offsets(PACKED_LENGTHS)
    total, n = int(cu[-1]), len(PACKED_LENGTHS)
    rows = fa.packed_dq_rows(cu, total, block_m)
    assert rows.dtype == torch.int64 and rows.shape == (total,)
    assert int(rows.max()) < (-(-total // block_m) + n) * block_m
    owner = {}
    for s, (start, end) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        first = fa.dq_first_block(start, s, block_m) * block_m
        assert rows[start:end].tolist() == list(range(first, first + end - start)), s
        for block in set((rows[start:end] // block_m).tolist()):
            assert owner.setdefault(block, s) == s, f"block {block} holds rows of sequences {owner[block]} and {s}"


@pytest.mark.parametrize("block_m, d", [(64, 32), (64, 48), (64, 128), (32, 16)])
def test_packed_blocked_dq_accumulator_unblocks(block_m, d):
    """Bulk dq: the kernel adds row i, column j of sequence s's query block m at [h, dq_first_block + m,
    ((i//8 * D/8 + j//8) * 8 + i%8) * 8 + j%8]; TMA dq: at row (dq_first_block + m) * block_m + i of [rows, H, D]."""
    sub, h = fa.DQ_SUBTILE, 3
    cu = offsets(PACKED_LENGTHS)
    total, n = int(cu[-1]), len(PACKED_LENGTHS)
    dq = torch.randn(total, h, d)
    rows = fa.packed_dq_rows(cu, total, block_m)
    blocks = -(-total // block_m) + n
    padded = torch.zeros(blocks * block_m, h, d)  # the TMA mode's accumulator
    padded[rows] = dq
    out = torch.full((h, total, d), float("nan")).transpose(0, 1)  # a strided gradient, as q's layout gives
    out.copy_(padded.index_select(0, rows))
    assert torch.equal(out, dq)
    i = torch.arange(block_m).view(-1, 1)
    j = torch.arange(d).view(1, -1)
    at = ((i // sub * (d // sub) + j // sub) * sub + i % sub) * sub + j % sub  # the kernel's index of (i, j)
    acc = torch.zeros(h, blocks, block_m * d)
    acc[:, :, at.flatten()] = padded.view(blocks, block_m, h, d).permute(2, 0, 1, 3).reshape(h, blocks, -1)
    out = torch.full((h, total, d), float("nan")).transpose(0, 1)
    fa._unblock_packed(acc, out, rows, block_m)
    assert torch.equal(out, dq)


def test_varlen_backward_without_queries_or_keys_is_zero():
    """No kernel runs where no query sees a key: zero gradients (no GPU needed)."""
    q, k = torch.randn(5, 2, 16, dtype=torch.bfloat16), torch.randn(0, 1, 16, dtype=torch.bfloat16)
    cu_q, cu_k = offsets([2, 3]), offsets([0, 0])
    o, lse = torch.zeros_like(q), torch.full((2, 5), float("-inf"))
    dq, dk, dv, *rest = fa.varlen_backward(
        torch.randn_like(q), q, k, k, cu_q, cu_k, 3, 0, True, 0.25, 0.0, None, o, lse
    )
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == dv.shape == k.shape
    assert rest == [None] * 8


@pytest.mark.parametrize("d", [16, 64])
def test_varlen_backward_lays_delta_and_lse_out_in_the_query_blocks(d):
    """The backward loads a query block's delta and log-sum-exp by TMA from row (dq_first_block + m) * block_m of
    [H, blocks * block_m]: whole blocks, whatever row a sequence starts at (a TMA copy whose innermost coordinate is not
    16-byte aligned faults). The preprocess gets those buffers, zeroed (the rows between sequences are read, masked),
    and the block row of each packed row."""
    calls = {}

    def launch(entry, device):
        return lambda *args: calls.setdefault(entry[0][0], args)

    lengths = [37, 0, 130, 1, 5]  # sequences from rows 37, 167 and 168: not multiples of 4
    cu = offsets(lengths)
    total, h = int(cu[-1]), 3
    q, k = torch.randn(total, h, d, dtype=torch.bfloat16), torch.randn(total, 1, d, dtype=torch.bfloat16)
    o, lse = torch.randn_like(q), torch.randn(h, total)
    fa.varlen_backward(torch.randn_like(q), q, k, k, cu, cu, 130, 130, True, 0.25, 0.0, None, o, lse, launch=launch)
    *_, delta, lse2, rows = calls["flash_attention_prep"]
    block_m = fa.BWD_CONFIGS[d].block_m
    blocks = -(-total // block_m) + len(lengths)
    assert delta.shape == lse2.shape == (h, blocks * block_m)
    assert not delta.any() and not lse2.any()
    assert torch.equal(rows, fa.packed_dq_rows(cu, total, block_m))
    assert all(int(rows[start]) % block_m == 0 for start, n in zip(cu.tolist(), lengths) if n)
    lse2_arg, delta_arg = calls["flash_attention_bwd"][4:6]
    assert lse2_arg is lse2 and delta_arg is delta


def test_varlen_entries_are_apart_from_the_padded_ones():
    for entry in (fa.preprocess_entry, lambda *a, **kw: fa.backward_entry(*a, True, False, True, **kw)):
        assert entry(64, torch.bfloat16, varlen=True)[0] != entry(64, torch.bfloat16)[0]
    assert isinstance(fa.backward_entry(64, torch.bfloat16, True, False, True, varlen=True)[0][-1], fa.BwdConfig)


def test_bwd_config_rejects_unknown_dq_mode():
    with pytest.raises(ValueError, match="dq"):
        fa.BwdConfig(128, 64, 2, 256, dq="smem")
