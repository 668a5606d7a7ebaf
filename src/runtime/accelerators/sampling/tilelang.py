"""top_k and sample in TileLang: the triton backend's algorithm (a radix select per row, no sort of the whole row),
written thread by thread (SIMT) with shared-memory histograms and explicit barriers.

Keys: each value as fp32, mapped to a uint32 that orders as the values do (-0.0 as +0.0, every NaN above +inf;
complemented for largest=False), paired with the complement of its index, so that (key, ~index) is unique and orders
as the contract does (value, then lower index first). A select block finds the k-th largest pair of its segment with
histogram passes over 8-bit digits (shared-memory atomics into one histogram per warp; each pass counts only the
entries that share the digits found so far): four over the key, and four over ~index only where the k-th key is tied
with entries that are not all taken. Every entry at or above that pair is taken, in any order (an atomic slot counter).

The select's fast path (filter=True): one pass keeps each thread's running maximum (key, ~index) over its strided
entries (4096 disjoint groups per block), whose k-th largest, found with the same histogram passes over those 4096
words, has at least k entries at or above it; a second pass moves the entries at or above that bound to a scratch of
CAPACITY per block (in any order), and the histogram passes and the take run over those alone (about k on a random
row, exactly k on an all-equal one). Where more than CAPACITY pass, the block selects over its whole segment; the
result is the same either way.

A sort block orders the k survivors by one 64-bit (key, ~index) word each with a bitonic sort in shared memory, and
reads their values back from the row. Rows are split into segments as in the triton backend, and the same select
runs in rounds over the candidates of the segments (select_plan.select_rounds, until one segment per row; index -1
pads a segment shorter than k; the candidates keep the row's indices).

sample: the top-k select and sort of the logits (the maximum top_k over the rows), then one block per row: softmax
over its first top_k[b] survivors at its temperature, the cumulative sum, the top-p prefix and the inverse CDF at its
uniform (reference.restricted_draw, step by step).

Rows, widths and k are dynamic: one compiled select per (dtype, largest, indexed candidates), one sort per
(dtype, largest) and one draw per dtype serve every shape and every k up to MAX_K.
"""

# no `from __future__ import annotations`: TileLang evaluates the kernels' annotations, which name closure variables
from collections.abc import Sequence

import torch

from .. import buffers
from ..launch_math import pow2_at_least
from ..tilelang_common import TL_DTYPE, Entry, launcher, placeholder  # first: checks the tilelang version

import tilelang  # noqa: E402  isort: skip
import tilelang.language as T  # noqa: E402  isort: skip
from ..kernel_backend import KernelBackend
from .select_plan import MAX_K, as_rows, select_rounds

RADIX = 256  # 8-bit digits
SELECT_THREADS = 1024
UNROLL = 4  # entries a select thread reads per step: 4096 per block and step, as the triton kernels
SORT_THREADS = 256
# entries passing the filter's bound that a select block keeps: for distinct keys of a long segment about
# G * -ln(1 - k / G) pass, G = UNROLL * SELECT_THREADS = 4096 groups (k for small k, 2839 at k = MAX_K), so every k
# fits with room for ties
CAPACITY = 4096
DRAW_THREADS = 256
DRAW_PER_THREAD = MAX_K // DRAW_THREADS  # consecutive survivors each draw thread holds
# every barrier is written out: the automatic ones could land inside branches that only some threads take
MANUAL_SYNC = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


# --------------------------------------------------------------------------- keys


def is_nan(x):
    """x is NaN, from its bits: TVM's simplifier folds a float `x != x` to false."""
    return (T.reinterpret("uint32", x) & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)


def zero_bits(x):
    """The bits of fp32 x, with -0.0 as +0.0 (stored in a variable, then passed to order_key)."""
    return T.reinterpret("uint32", T.if_then_else(x == T.float32(0), T.float32(0), x))


def order_key(bits, largest: bool):
    """The uint32 key of an fp32 value from bits = zero_bits(value): orders as the values do (NaN highest, -0.0 as
    +0.0), reversed when not largest."""
    flip = T.if_then_else(bits >= T.uint32(0x80000000), T.uint32(0xFFFFFFFF), T.uint32(0x80000000))
    # NaN from its bits (see is_nan)
    key = T.if_then_else((bits & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000), T.uint32(0xFFFFFFFF), bits ^ flip)
    return key if largest else ~key


def above(word, shift):
    """The digits of a uint32 above the one at shift (0 for the top digit, shift 24): a 64-bit shift, as shifting
    a uint32 by 32 is undefined."""
    return T.cast(word, "uint64") >> T.cast(shift + 8, "uint64")


def digit_at(word, shift):
    """The 8-bit digit of a uint32 at shift, as an int32 histogram bin."""
    return T.cast((word >> T.cast(shift, "uint32")) & T.uint32(0xFF), "int32")


def index_key(index):
    """~index as uint32: larger for lower indices, so ties go to the lower index."""
    return ~T.reinterpret("uint32", T.cast(index, "int32"))


def pair_word(key, index):
    """(key, ~index) as one uint64 that orders as the pair does; above 0 for every entry (~index >= 2^31)."""
    return (T.cast(key, "uint64") << T.uint64(32)) | T.cast(index_key(index), "uint64")


# --------------------------------------------------------------------------- block-wide steps (all threads call them)


@T.macro
def suffix_counts(hist, tx):
    """hist[0, d] <- sum of hist[0, d:RADIX] for d < RADIX (hist[0, RADIX] is 0); threads 0..RADIX-1 do the work."""
    carry = T.alloc_var("int32")
    for level in T.serial(8):
        if tx < RADIX:
            carry = hist[0, tx] + hist[0, T.min(tx + (1 << level), RADIX)]
        T.sync_threads()
        if tx < RADIX:
            hist[0, tx] = carry
        T.sync_threads()


@T.macro
def block_reduce(buf, tx, threads, combine):
    """buf[0] <- combine over buf[0:threads] (threads a power of two); buf[tx] written by each thread before."""
    for level in T.serial(threads.bit_length() - 1):
        T.sync_threads()
        if tx < (threads >> (level + 1)):
            buf[tx] = combine(buf[tx], buf[tx + (threads >> (level + 1))])
    T.sync_threads()


@T.macro
def block_inclusive_scan(buf, tx, threads):
    """buf[t] <- sum of buf[0:t+1] (Hillis-Steele); buf[tx] written by each thread before."""
    carry = T.alloc_var("float32")
    for level in T.serial(threads.bit_length() - 1):
        T.sync_threads()
        carry = buf[tx] + T.if_then_else(tx >= (1 << level), buf[T.max(tx - (1 << level), 0)], T.float32(0))
        T.sync_threads()
        buf[tx] = carry
    T.sync_threads()


def _add(a, b):
    return a + b


def _max(a, b):
    return T.max(a, b)


def _min(a, b):
    return T.min(a, b)


@T.macro
def entry_key(raw, largest, bits: T.Ref, key: T.Ref):
    """key <- the uint32 key of raw (a value in the input dtype); bits is scratch."""
    bits = zero_bits(T.cast(raw, "float32"))
    key = order_key(bits, largest)  # noqa: F841  a store through the reference


@T.macro
def clear_histograms(hist, tx, threads, warps):
    T.sync_threads()
    for step in T.serial(T.ceildiv(warps * (RADIX + 1), threads)):
        cell = step * threads + tx
        if cell < warps * (RADIX + 1):
            hist[cell // (RADIX + 1), cell % (RADIX + 1)] = 0
    T.sync_threads()


@T.macro
def count_entry(hist, tx, level, shift, key, nkey, key_prefix, index_prefix):
    """One entry (key, nkey = ~index) into this warp's histogram at pass `level`: passes 0-3 count the key's digit at
    shift among the keys sharing key_prefix's digits above it, passes 4-7 ~index's digit among the entries whose key
    is key_prefix and whose ~index shares index_prefix's digits above it."""
    if level < 4:
        if above(key, shift) == above(key_prefix, shift):
            T.atomic_add(hist[tx // 32, digit_at(key, shift)], 1)
    else:
        if key == key_prefix and above(nkey, shift) == above(index_prefix, shift):
            T.atomic_add(hist[tx // 32, digit_at(nkey, shift)], 1)


@T.macro
def choose_digit(
    hist, found, tx, warps, level, shift, key_prefix: T.Ref, index_prefix: T.Ref, remaining: T.Ref, tied: T.Ref
):
    """After a counting pass: the per-warp histograms summed, and the threshold's digit at shift (the largest d with
    at least `remaining` counted entries at or above it) set in key_prefix (passes 0-3) or index_prefix (4-7);
    remaining and tied (the counted entries with that digit) updated."""
    T.sync_threads()
    if tx < RADIX:  # thread d alone reads and writes column d
        for w in T.serial(1, warps):
            hist[0, tx] = hist[0, tx] + hist[w, tx]
    T.sync_threads()
    suffix_counts(hist, tx)
    if tx < RADIX:
        if hist[0, tx] >= remaining and hist[0, tx + 1] < remaining:
            found[0] = tx
    T.sync_threads()
    digit = found[0]
    tied = hist[0, digit] - hist[0, digit + 1]  # noqa: F841  a store through the reference
    remaining = remaining - hist[0, digit + 1]
    if level < 4:
        key_prefix = key_prefix | (T.cast(digit, "uint32") << T.cast(shift, "uint32"))
    else:
        index_prefix = index_prefix | (T.cast(digit, "uint32") << T.cast(shift, "uint32"))


# --------------------------------------------------------------------------- kernels


def select_kernel(dtype: str, largest: bool, indexed: bool, threads: int = SELECT_THREADS, unroll: int = UNROLL):
    """Block (row, segment): the min(k, n) best entries of X[row, segment * seg_len :][:n] to
    OutX / OutIdx[row, segment * k :][:k] in any order, index -1 after them. indexed: X holds candidates whose row
    indices are in Idx (-1: none); else an entry's index is its position in the row.

    use_filter (else the scratch is not touched): first a lower bound of the k-th (key, ~index) pair, then the
    entries at or above it to KeptX / KeptIdx[row * segments + segment, :capacity] (capacity: their width) and
    their count to KeptCount (all counted, also past capacity); the radix select then runs over those entries
    where they fit, over the segment otherwise."""
    R, W, RI, WI, C, P, KC = T.dynamic("R W RI WI C P KC")
    block = threads * unroll
    warps = threads // 32
    assert threads > RADIX and threads % 32 == 0 and block >= MAX_K

    @T.prim_func
    def sampling_select(
        X: T.Tensor((R, W), dtype),
        Idx: T.Tensor((RI, WI), "int32"),
        OutX: T.Tensor((R, C), dtype),
        OutIdx: T.Tensor((R, C), "int32"),
        KeptX: T.Tensor((P, KC), dtype),
        KeptIdx: T.Tensor((P, KC), "int32"),
        KeptCount: T.Tensor((P,), "int32"),
        seg_len: T.int32,
        k: T.int32,
        use_filter: T.int32,
    ):
        T.annotate_pass_configs(MANUAL_SYNC)
        with T.Kernel(R, T.ceildiv(W, seg_len), threads=threads) as (row, segment):
            tx = T.get_thread_binding()
            # one histogram per warp (fewer threads contend for a bin: the top digits of a row take few values),
            # summed into the first after each pass; a zero column after the last bin
            hist = T.alloc_shared((warps, RADIX + 1), "int32")
            found = T.alloc_shared((1,), "int32")
            slots = T.alloc_shared((1,), "int32")
            group_max = T.alloc_local((unroll,), "uint64")
            key_prefix = T.alloc_var("uint32")
            index_prefix = T.alloc_var("uint32")
            remaining = T.alloc_var("int32")
            tied = T.alloc_var("int32")
            bound = T.alloc_var("uint64")
            from_kept = T.alloc_var("int32")  # the radix select's entries: the scratch (1) or the segment (0)
            source_n = T.alloc_var("int32")
            # one entry, held in variables (names bound by plain assignment are substituted into every use)
            raw = T.alloc_var(dtype)
            bits = T.alloc_var("uint32")
            key = T.alloc_var("uint32")
            index = T.alloc_var("int32")
            program = T.alloc_var("int32")  # the block's row of the scratch
            program = row * T.ceildiv(W, seg_len) + segment
            start = segment * seg_len
            n = T.min(W - start, seg_len)
            wanted = T.min(k, n)
            out = segment * k
            from_kept = 0
            source_n = n
            if use_filter != 0:
                # The bound t: entry p of the segment falls in group p % block (thread tx at unrolled step u: group
                # u * threads + tx), so the block (>= MAX_K) groups are disjoint, and as pairs are unique the maxima
                # of the nonempty ones are distinct entries. t is the wanted-th largest of the maxima, an empty group
                # counting as 0 (below every entry's word: ~index >= 2^31). t > 0: wanted groups have maxima >= t,
                # so wanted distinct entries are at or above t, hence the segment's wanted-th pair is too and every
                # entry taken passes; t = 0: every entry passes. Ties need no care: the pairs are unique.
                for u in T.unroll(unroll):
                    group_max[u] = T.uint64(0)
                for step in T.serial(T.ceildiv(n, block)):
                    for u in T.unroll(unroll):
                        pos = (step * unroll + u) * threads + tx
                        if pos < n:
                            raw = X[row, start + pos]
                            index = Idx[row, start + pos] if indexed else start + pos
                            if index >= 0:
                                entry_key(raw, largest, bits, key)
                                group_max[u] = T.max(group_max[u], pair_word(key, index))
                key_prefix = T.uint32(0)
                index_prefix = T.uint32(0)
                remaining = wanted
                tied = 0
                for level in T.serial(8):
                    if level < 4 or tied > remaining:
                        shift = 24 - 8 * (level % 4)
                        clear_histograms(hist, tx, threads, warps)
                        for u in T.unroll(unroll):  # each thread counts its own group maxima
                            count_entry(
                                hist,
                                tx,
                                level,
                                shift,
                                T.cast(group_max[u] >> T.uint64(32), "uint32"),
                                T.cast(group_max[u] & T.uint64(0xFFFFFFFF), "uint32"),
                                key_prefix,
                                index_prefix,
                            )
                        choose_digit(hist, found, tx, warps, level, shift, key_prefix, index_prefix, remaining, tied)
                # index_prefix stays 0 where the key passes alone decide: a lower bound still
                bound = (T.cast(key_prefix, "uint64") << T.uint64(32)) | T.cast(index_prefix, "uint64")
                # the entries at or above the bound to the scratch, in any order (the sort orders them)
                T.sync_threads()
                if tx == 0:
                    slots[0] = 0
                T.sync_threads()
                for step in T.serial(T.ceildiv(n, block)):
                    for u in T.unroll(unroll):
                        pos = (step * unroll + u) * threads + tx
                        if pos < n:
                            raw = X[row, start + pos]
                            index = Idx[row, start + pos] if indexed else start + pos
                            if index >= 0:
                                entry_key(raw, largest, bits, key)
                                if pair_word(key, index) >= bound:
                                    slot = T.atomic_add(slots[0], 1, return_prev=True)
                                    if slot < KC:
                                        KeptX[program, slot] = raw
                                        KeptIdx[program, slot] = index
                T.sync_threads()  # the scratch and the count, written by every thread, before any reads them
                if tx == 0:
                    KeptCount[program] = slots[0]
                if slots[0] <= KC:
                    from_kept = 1
                    source_n = slots[0]
            # the radix select of the wanted-th largest (key, ~index) pair of the source: passes 0-3 over the
            # digits of the key; 4-7 over those of ~index among the entries tied with the k-th key, where those are
            # not all taken (the lower indices win)
            key_prefix = T.uint32(0)
            index_prefix = T.uint32(0)
            remaining = wanted
            tied = 0
            for level in T.serial(8):
                if level < 4 or tied > remaining:
                    shift = 24 - 8 * (level % 4)
                    clear_histograms(hist, tx, threads, warps)
                    for step in T.serial(T.ceildiv(source_n, block)):
                        for u in T.unroll(unroll):
                            pos = (step * unroll + u) * threads + tx
                            if pos < source_n:
                                if from_kept != 0:
                                    raw = KeptX[program, pos]
                                    index = KeptIdx[program, pos]
                                else:
                                    raw = X[row, start + pos]
                                    index = Idx[row, start + pos] if indexed else start + pos
                                if index >= 0:
                                    entry_key(raw, largest, bits, key)
                                    count_entry(hist, tx, level, shift, key, index_key(index), key_prefix, index_prefix)
                    choose_digit(hist, found, tx, warps, level, shift, key_prefix, index_prefix, remaining, tied)
            # taken: every entry at or above (key_prefix, index_prefix), exactly `wanted` of them, in any order
            T.sync_threads()
            if tx == 0:
                slots[0] = 0
            T.sync_threads()
            for step in T.serial(T.ceildiv(source_n, block)):
                for u in T.unroll(unroll):
                    pos = (step * unroll + u) * threads + tx
                    if pos < source_n:
                        if from_kept != 0:
                            raw = KeptX[program, pos]
                            index = KeptIdx[program, pos]
                        else:
                            raw = X[row, start + pos]
                            index = Idx[row, start + pos] if indexed else start + pos
                        if index >= 0:
                            entry_key(raw, largest, bits, key)
                            nkey = index_key(index)
                            if key > key_prefix or (key == key_prefix and nkey >= index_prefix):
                                slot = T.atomic_add(slots[0], 1, return_prev=True)
                                OutX[row, out + slot] = raw
                                OutIdx[row, out + slot] = index
            for step in T.serial(T.ceildiv(k, threads)):
                pad = step * threads + tx
                if pad >= wanted and pad < k:
                    OutIdx[row, out + pad] = -1

    return sampling_select


def sort_kernel(dtype: str, largest: bool, threads: int = SORT_THREADS):
    """Block row: its k candidates (CandX, CandIdx [R, k]) ordered by key descending, then index ascending, with a
    bitonic sort of k_pad (a power of two >= k) 64-bit words in shared memory; values read back from X."""
    R, K, W = T.dynamic("R K W")

    @T.prim_func
    def sampling_sort(
        CandX: T.Tensor((R, K), dtype),
        CandIdx: T.Tensor((R, K), "int32"),
        X: T.Tensor((R, W), dtype),
        Values: T.Tensor((R, K), dtype),
        Indices: T.Tensor((R, K), "int64"),
        k_pad: T.int32,
        log_k_pad: T.int32,
    ):
        T.annotate_pass_configs(MANUAL_SYNC)
        with T.Kernel(R, threads=threads) as row:
            tx = T.get_thread_binding()
            words = T.alloc_shared((MAX_K,), "uint64")
            a = T.alloc_var("uint64")
            b = T.alloc_var("uint64")
            value = T.alloc_var("float32")
            bits = T.alloc_var("uint32")
            for step in T.serial(T.ceildiv(k_pad, threads)):
                p = step * threads + tx
                if p < k_pad:
                    words[p] = T.uint64(0)  # below every real word: ~index > 0 for index < 2^31
                    if p < K:
                        value = T.cast(CandX[row, p], "float32")
                        bits = zero_bits(value)
                        key = order_key(bits, largest)
                        words[p] = (T.cast(key, "uint64") << T.uint64(32)) | T.cast(
                            index_key(CandIdx[row, p]), "uint64"
                        )
            for level in T.serial(log_k_pad):
                for sub in T.serial(level + 1):
                    stride = 1 << (level - sub)
                    T.sync_threads()
                    for step in T.serial(T.ceildiv(k_pad // 2, threads)):
                        q = step * threads + tx
                        if q < k_pad // 2:
                            i = 2 * q - (q & (stride - 1))
                            a = words[i]
                            b = words[i + stride]
                            # descending runs where bit `size` of i is clear: the last merge sorts all descending
                            if (a < b) == ((i & (2 << level)) == 0):
                                words[i] = b
                                words[i + stride] = a
            T.sync_threads()
            for step in T.serial(T.ceildiv(K, threads)):
                p = step * threads + tx
                if p < K:
                    index = T.reinterpret("int32", ~T.cast(words[p] & T.uint64(0xFFFFFFFF), "uint32"))
                    Indices[row, p] = T.cast(index, "int64")
                    Values[row, p] = X[row, index]

    return sampling_sort


def draw_kernel(dtype: str, threads: int = DRAW_THREADS, per_thread: int = DRAW_PER_THREAD):
    """Block row: its id from the first keep_k[row] sorted survivors (reference.restricted_draw step by step); thread
    t holds survivors t * per_thread ... (t + 1) * per_thread - 1."""
    R, K = T.dynamic("R K")
    none = threads * per_thread  # a position past every survivor

    @T.prim_func
    def sampling_draw(
        Values: T.Tensor((R, K), dtype),
        Indices: T.Tensor((R, K), "int64"),
        KeepK: T.Tensor((R,), "int32"),
        Temperature: T.Tensor((R,), "float32"),
        TopP: T.Tensor((R,), "float32"),
        Uniforms: T.Tensor((R,), "float32"),
        Ids: T.Tensor((R,), "int64"),
    ):
        T.annotate_pass_configs(MANUAL_SYNC)
        with T.Kernel(R, threads=threads) as row:
            tx = T.get_thread_binding()
            c = T.alloc_local((per_thread,), "float32")
            floats = T.alloc_shared((threads,), "float32")
            ints = T.alloc_shared((threads,), "int32")
            mass = T.alloc_shared((1,), "float32")
            local = T.alloc_var("float32")
            count = T.alloc_var("int32")
            value = T.alloc_var("float32")
            keep_k = KeepK[row]
            first_pos = tx * per_thread
            # z = values / temperature inside the first keep_k, -inf after; any NaN among them
            local = -T.infinity("float32")
            count = 0
            for j in T.unroll(per_thread):
                c[j] = -T.infinity("float32")
                if first_pos + j < keep_k:
                    value = T.cast(Values[row, first_pos + j], "float32")
                    count = count + T.if_then_else(is_nan(value), 1, 0)
                    c[j] = value / Temperature[row]
                local = T.max(local, c[j])
            floats[tx] = local
            ints[tx] = count
            block_reduce(floats, tx, threads, _max)
            block_reduce(ints, tx, threads, _add)
            undefined = T.alloc_var("bool")
            z_max = T.alloc_var("float32")
            z_max = floats[0]
            # the best survivor (sorted first) is -inf: all are, and softmax is 0 / 0
            undefined = ints[0] > 0 or T.cast(Values[row, 0], "float32") == -T.infinity("float32")
            # p = exp(z - max) / sum, then the cumulative sum
            local = T.float32(0)
            for j in T.unroll(per_thread):
                c[j] = T.exp(c[j] - z_max)
                local = local + c[j]
            T.sync_threads()
            floats[tx] = local
            block_reduce(floats, tx, threads, _add)
            total = T.alloc_var("float32")
            total = floats[0]
            local = T.float32(0)
            for j in T.unroll(per_thread):
                local = local + c[j] / total
                c[j] = local
            T.sync_threads()
            floats[tx] = local
            block_inclusive_scan(floats, tx, threads)
            before = T.alloc_var("float32")
            before = T.if_then_else(tx > 0, floats[T.max(tx - 1, 0)], T.float32(0))
            count = 0
            for j in T.unroll(per_thread):
                c[j] = before + c[j]
                count = count + T.if_then_else(first_pos + j < keep_k and c[j] < TopP[row], 1, 0)
            T.sync_threads()
            ints[tx] = count
            block_reduce(ints, tx, threads, _add)
            # the position that crosses top_p is kept
            last = T.alloc_var("int32")
            last = T.min(ints[0], keep_k - 1)
            for j in T.unroll(per_thread):
                if first_pos + j == last:
                    mass[0] = c[j]
            T.sync_threads()
            target = T.alloc_var("float32")
            target = Uniforms[row] * mass[0]
            count = none
            for j in T.unroll(per_thread):
                if first_pos + j < keep_k and c[j] > target:
                    count = T.min(count, first_pos + j)
            T.sync_threads()
            ints[tx] = count
            block_reduce(ints, tx, threads, _min)
            if tx == 0:
                pick = T.min(ints[0], last)  # past the last kept only when rounding puts the target at the mass
                Ids[row] = T.if_then_else(undefined, T.int64(-1), Indices[row, pick])

    return sampling_draw


# --------------------------------------------------------------------------- entries and launchers


def select_entry(dtype: torch.dtype, largest: bool, indexed: bool) -> Entry:
    name = TL_DTYPE[dtype]
    return ("sampling_select", name, largest, indexed), lambda info: select_kernel(name, largest, indexed)


def sort_entry(dtype: torch.dtype, largest: bool) -> Entry:
    name = TL_DTYPE[dtype]
    return ("sampling_sort", name, largest), lambda info: sort_kernel(name, largest)


def draw_entry(dtype: torch.dtype) -> Entry:
    name = TL_DTYPE[dtype]
    return ("sampling_draw", name), lambda info: draw_kernel(name)


def entries() -> list[Entry]:
    """Every specialisation the kernels have (for precompile and the compile tests)."""
    found = []
    for dtype in TL_DTYPE:
        for largest in (True, False):
            found += [
                select_entry(dtype, largest, False),
                select_entry(dtype, largest, True),
                sort_entry(dtype, largest),
            ]
        found.append(draw_entry(dtype))
    return found


def _select_launch(
    x: torch.Tensor,
    idx: torch.Tensor | None,
    seg_len: int,
    segments: int,
    k: int,
    largest: bool,
    filter: bool,
    capacity: int,
    launch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One select launch over the rows of x [R, n] (with idx: candidates and their indices, -1 for none) in
    segments of seg_len -> (values, int32 indices) [R, segments * k], any order within a segment, and with filter
    how many entries passed the bound per (row, segment) ([R, segments] int32; more than capacity: that block
    selected over its whole segment)."""
    rows, device, dtype = x.shape[0], x.device, x.dtype
    out_x = torch.empty((rows, segments * k), dtype=dtype, device=device)
    out_idx = torch.empty((rows, segments * k), dtype=torch.int32, device=device)
    if filter:
        kept_x = torch.empty((rows * segments, capacity), dtype=dtype, device=device)
        kept_idx = torch.empty((rows * segments, capacity), dtype=torch.int32, device=device)
        kept_count = torch.empty((rows * segments,), dtype=torch.int32, device=device)
    else:
        kept_x = placeholder(device, dtype).view(1, 1)
        kept_idx = placeholder(device, torch.int32).view(1, 1)
        kept_count = placeholder(device, torch.int32)
    indexed = idx is not None
    if not indexed:
        idx = placeholder(device, torch.int32).view(1, 1)
    launch(select_entry(dtype, largest, indexed), device)(
        x, idx, out_x, out_idx, kept_x, kept_idx, kept_count, seg_len, k, int(filter)
    )
    return out_x, out_idx, kept_count.view(rows, segments) if filter else None


def _select_sorted(
    scores: torch.Tensor,
    k: int,
    largest: bool,
    segments: int | Sequence[int] | None,
    launch,
    filter: bool,
    capacity: int,
):
    """scores [R, n], contiguous -> (values [R, k] in scores' dtype, int64 indices [R, k]). segments: as
    select_rounds takes it (None: the plan for this GPU)."""
    rows, n = scores.shape
    device, dtype = scores.device, scores.dtype
    cand_x, cand_idx = scores, None
    for s, seg_len in select_rounds(rows, n, k, device, segments):  # the row, then its candidates
        cand_x, cand_idx, _ = _select_launch(cand_x, cand_idx, seg_len, s, k, largest, filter, capacity, launch)
    values = buffers.empty((rows, k), dtype=dtype, device=device)
    indices = buffers.empty((rows, k), dtype=torch.int64, device=device)
    k_pad = pow2_at_least(k, 2)
    launch(sort_entry(dtype, largest), device)(cand_x, cand_idx, scores, values, indices, k_pad, k_pad.bit_length() - 1)
    return values, indices


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as a contiguous [rows, n] (the kernels index rows by the width)."""
    rows = as_rows(x)
    return rows if rows.is_contiguous() else rows.contiguous()


def top_k_forward(
    scores: torch.Tensor,
    k: int,
    largest: bool,
    segments: int | Sequence[int] | None = None,
    launch=launcher,
    filter: bool = True,
    capacity: int = CAPACITY,
):
    """scores [..., n] -> (values, int64 indices) [..., k]. launch(entry, device): the kernel's entry point
    (tools/tilelang_on_cpu.py passes one that runs the generated code on the CPU). filter: the select's
    threshold-filter fast path, with a scratch of `capacity` entries per block; the same result either way."""
    values, indices = _select_sorted(_kernel_rows(scores), k, largest, segments, launch, filter, capacity)
    shape = (*scores.shape[:-1], k)
    return values.view(shape), indices.view(shape)


def sample_forward(
    logits: torch.Tensor,
    keep_k: torch.Tensor,
    max_k: int,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    segments: int | Sequence[int] | None = None,
    launch=launcher,
    filter: bool = True,
    capacity: int = CAPACITY,
):
    """logits [B, V]; keep_k (int32), temperature, top_p, uniforms (fp32): [B] -> ids [B] (int64)."""
    values, indices = _select_sorted(_kernel_rows(logits), max_k, True, segments, launch, filter, capacity)
    ids = buffers.empty((values.shape[0],), dtype=torch.int64, device=logits.device)
    per_row = [t.contiguous() for t in (keep_k, temperature, top_p, uniforms)]
    launch(draw_entry(logits.dtype), logits.device)(values, indices, *per_row, ids)
    return ids


TOP_K_KERNELS = KernelBackend(forward=top_k_forward)
SAMPLE_KERNELS = KernelBackend(forward=sample_forward)
