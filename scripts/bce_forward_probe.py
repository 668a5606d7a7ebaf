"""Where the BCE mean forward at 2^24 fp32 loses bandwidth: the product's launch against prototypes of its main
kernel, in rounds, beside torch's own read-only passes.

    bash .device/gpu python scripts/bce_forward_probe.py [--rounds 3]

The product (`runtime.accelerators.bce.triton`, FORWARD) gives each of its k x SM programs whole blocks of 4096
elements: 4096 blocks over 396 programs leaves 136 programs with 11 blocks and 260 with 10, so the launch lasts
about 6% longer than an even split would. The prototypes split the elements, not the blocks: program p reads one
contiguous chunk of ceil(n / programs) elements (rounded up to 16, so every chunk starts 64-byte aligned and loads
stay vectorised), as whole blocks and then one masked block. Rows:

- product: binary_cross_entropy_with_logits as an eager call runs it (main kernel + partials kernel);
- product main only: the product's main kernel without the partials kernel (what that second launch costs);
- chunk ...: the prototype with the partials kernel after it; `last` instead: the program that arrives last adds
  the partials (one launch, an arrival counter); `ef`: loads with the evict_first hint; `sum`: x + y summed
  instead of the loss (the math left out: the read ceiling of this kernel shape);
- chunk ... pdl: the partials kernel launched as a programmatic dependent of the main one (it is scheduled while
  the main grid runs and waits for its end in the kernel): its launch gap hidden;
- tma ...: the main kernel reading [rows, 32] boxes through TMA (host-built descriptors), with pipeline stages;
- torch sum / compile: torch's fp32 sum of one 2^25-element tensor (the same 128 MiB), torch.compile's BCE;
- floor: one or two launches of a kernel that stores one value, timed the same way (what no launch goes below).

Every row is checked against a float64 reference before it is timed and is timed like the benchmark (CUDA-graph
replays after an L2 flush); the figure is the median over rounds of each row's median.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runtime.accelerators.bce import binary_cross_entropy_with_logits
from runtime.accelerators.bce import triton as kernels
from runtime.accelerators.launch_math import cdiv
from runtime.benchmark.timing import L2Flusher, copy_bandwidth_tbs, gpu_time_ms

N = 2**24


@triton.jit
def _chunk_loss(x_ptr, y_ptr, offs, mask, LOSS: tl.constexpr, EVICT: tl.constexpr):
    if mask is None:
        x = tl.load(x_ptr + offs, eviction_policy=EVICT).to(tl.float32)
        y = tl.load(y_ptr + offs, eviction_policy=EVICT).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if LOSS:
        value = kernels._loss(x, y, 1.0, False)
    else:
        value = x + y
    if mask is not None:
        value = tl.where(mask, value, 0.0)
    return value


@triton.jit
def _chunked_kernel(
    x_ptr, y_ptr, part_ptr, out_ptr, counter_ptr, n, chunk, divisor,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr, LOSS: tl.constexpr, LAST_ADDS: tl.constexpr,
    SUM_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if PDL:  # the partials kernel may be scheduled now; it waits (gdc_wait) for this grid's end
        tl.extra.cuda.gdc_launch_dependents()
    start = pid * chunk
    end = tl.minimum(start + chunk, n)
    n_full = tl.maximum(end - start, 0) // BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, n_full, num_stages=STAGES):
        acc += _chunk_loss(x_ptr, y_ptr, start + i * BLOCK + tl.arange(0, BLOCK), None, LOSS, EVICT)
    offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
    acc += _chunk_loss(x_ptr, y_ptr, offs, offs < end, LOSS, EVICT)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))
    if LAST_ADDS:
        programs = tl.num_programs(0)
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == programs - 1:
            tl.store(counter_ptr, 0)
            total = tl.zeros([SUM_BLOCK], dtype=tl.float32)
            for s in range(0, programs, SUM_BLOCK):
                p = s + tl.arange(0, SUM_BLOCK)
                total += tl.load(part_ptr + p, mask=p < programs, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr, tl.sum(total, axis=0) / divisor)


@triton.jit
def _sum_after_kernel(part_ptr, out_ptr, n_parts, divisor, BLOCK: tl.constexpr):
    """The product's partials kernel, launched as a programmatic dependent: it waits for the main grid here."""
    tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0) / divisor)


@triton.jit
def _tma_kernel(
    x_desc, y_desc, part_ptr, n_rows, rows_per_program,
    R: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr, LOSS: tl.constexpr,
):  # fmt: skip
    """x and y as [n_rows, W] row-major, read in [R, W] boxes through TMA (zeros past the end, masked out)."""
    pid = tl.program_id(0)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    acc = tl.zeros([R, W], dtype=tl.float32)
    for r in tl.range(start, end, R, num_stages=STAGES):
        x = x_desc.load([r, 0]).to(tl.float32)
        y = y_desc.load([r, 0]).to(tl.float32)
        if LOSS:
            value = kernels._loss(x, y, 1.0, False)
        else:
            value = x + y
        rows = r + tl.arange(0, R)
        acc += tl.where((rows < end)[:, None], value, 0.0)
    tl.store(part_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def tma(programs_per_sm, rows=128, width=32, warps=8, stages=3, loss=True):
    from triton.tools.tensor_descriptor import TensorDescriptor

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = programs_per_sm * sms
    n_rows = N // width
    rows_per_program = cdiv(cdiv(n_rows, programs), rows) * rows
    part = torch.empty(programs, dtype=torch.float32, device="cuda")

    def run(x, y):
        out = torch.empty((), dtype=torch.float32, device="cuda")
        x_desc = TensorDescriptor.from_tensor(x.view(n_rows, width), [rows, width])
        y_desc = TensorDescriptor.from_tensor(y.view(n_rows, width), [rows, width])
        _tma_kernel[(programs,)](
            x_desc, y_desc, part, n_rows, rows_per_program, R=rows, W=width, STAGES=stages, LOSS=loss, num_warps=warps
        )
        kernels._sum_partials_kernel[(1,)](part, out, programs, float(N), BLOCK=kernels.SUM_BLOCK, num_warps=4)
        return out

    return run


def chunked(programs_per_sm, block=4096, warps=8, stages=2, evict="", loss=True, last=False, pdl=False):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = programs_per_sm * sms
    chunk = cdiv(cdiv(N, programs), 16) * 16
    part = torch.empty(programs, dtype=torch.float32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run(x, y):
        out = torch.empty((), dtype=torch.float32, device="cuda")
        _chunked_kernel[(programs,)](
            x, y, part, out, counter, N, chunk, float(N),
            BLOCK=block, STAGES=stages, EVICT=evict, LOSS=loss, LAST_ADDS=last, SUM_BLOCK=512, PDL=pdl, num_warps=warps,
        )  # fmt: skip
        if pdl:
            _sum_after_kernel[(1,)](part, out, programs, float(N), BLOCK=kernels.SUM_BLOCK, num_warps=4, launch_pdl=True)
        elif not last:
            kernels._sum_partials_kernel[(1,)](part, out, programs, float(N), BLOCK=kernels.SUM_BLOCK, num_warps=4)
        return out

    return run


@triton.jit
def _one_store_kernel(out_ptr):
    tl.store(out_ptr, 0.0)


def launch_floor(launches):
    """`launches` kernels of one store each: what the timing itself and a launch cost, whatever the kernel reads."""
    out = torch.empty((), dtype=torch.float32, device="cuda")

    def run(x, y):
        for _ in range(launches):
            _one_store_kernel[(1,)](out)
        return out

    return run


def product_main_only(x, y):
    """The product's main kernel alone (its partials left unsummed): the forward less its second launch."""
    launch, programs = kernels._plan(N, kernels.FORWARD, x)
    part = torch.empty(programs, dtype=torch.float32, device=x.device)
    kernels._forward_kernel[(programs,)](
        x, y, None, None, part, None, N, None, None, None, None, float(N),
        W_MODE=0, PW_MODE=0, REDUCE=True, UNIT_GRAD=False, ONE_PROGRAM=False,
        REVERSE=launch.reverse, NUM_STAGES=launch.stages, BLOCK=launch.block, num_warps=launch.num_warps,
    )  # fmt: skip
    return part


def variants() -> dict:
    rows = {
        "product": lambda x, y: binary_cross_entropy_with_logits(x, y, backend="triton"),
        "product main only": product_main_only,
        "compile": torch.compile(lambda x, y: F.binary_cross_entropy_with_logits(x, y), dynamic=False),
    }
    for k in (3, 4):
        rows[f"chunk 4096/8w {k}xSM 2st"] = chunked(k)
    # session 28, first run: 1 or 3 stages, 2048/4w and 8192/8w blocks and evict_first loads were all slower
    rows["chunk 4096/8w 4xSM 2st last"] = chunked(4, last=True)
    rows["chunk 4096/8w 3xSM 2st sum"] = chunked(3, loss=False)
    rows["chunk 4096/8w 4xSM 2st pdl"] = chunked(4, pdl=True)
    rows["chunk 4096/8w 3xSM 2st pdl"] = chunked(3, pdl=True)
    rows["tma 128x32 8w 1xSM 4st"] = tma(1, stages=4)
    rows["tma 128x32 8w 2xSM 3st"] = tma(2)
    rows["tma 128x32 4w 2xSM 3st"] = tma(2, warps=4)
    rows["tma 256x32 8w 1xSM 3st"] = tma(1, rows=256)
    rows["tma 128x32 8w 2xSM 3st sum"] = tma(2, loss=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    x = 3 * torch.randn(N, device=device)
    y = torch.rand(N, device=device)
    reference = F.binary_cross_entropy_with_logits(x.double(), y.double())
    plain_sum = (x.double() + y.double()).sum() / N
    both = torch.cat([x, y])
    rows = variants()
    rows["torch sum 2^25 fp32"] = None
    rows["floor: 1 empty launch"] = launch_floor(1)
    rows["floor: 2 empty launches"] = launch_floor(2)
    for name, fn in list(rows.items()):
        if fn is None:
            continue
        want = plain_sum if name.endswith(" sum") else reference
        try:
            got = fn(x, y)
        except Exception as error:  # a prototype that does not compile here: reported, left out
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}")
            del rows[name]
            continue
        if name == "product main only" or name.startswith("floor"):
            continue  # partials or nothing, not the loss
        error = abs(got.double() - want).item() / abs(want).item()
        if error > 1e-5 or not torch.equal(got, fn(x, y)):
            print(f"{name}: WRONG or not deterministic (relative error {error:.1e})")
            del rows[name]
    flush = L2Flusher(device)
    copy = copy_bandwidth_tbs(device)
    print(f"{torch.cuda.get_device_name(device)}, copy {copy:.2f} TB/s (256 MiB), N = 2^24 fp32, {args.rounds} rounds")
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            call = (lambda: both.sum()) if fn is None else (lambda fn=fn: fn(x, y))
            timing, _ = gpu_time_ms(call, device, flush=flush)
            times[name].append(timing["median"] * 1e3)
    read = 2 * N * 4
    print(f"{'row':<32}{'us':>8}{'rounds':>16}{'TB/s':>7}{'of copy':>8}")
    for name, samples in times.items():
        us = statistics.median(samples)
        tbs = read / (us * 1e-6) / 1e12
        spread = f"{min(samples):.1f}-{max(samples):.1f}"
        print(f"{name:<32}{us:8.1f}{spread:>16}{tbs:7.2f}{tbs / copy:8.0%}")


if __name__ == "__main__":
    main()
