"""Checks on the TMA copies of a generated (TileLang) CUDA source, for tests that compile kernels without a GPU.

A TMA tensor copy faults (CUDA_ERROR_ILLEGAL_INSTRUCTION on Hopper) when its innermost coordinate is not a multiple of
16 bytes; its outer coordinates are free. A bulk copy or reduction (no tensor map) needs its global address and size
in multiples of 16 bytes. A coordinate or address is a C expression of runtime values (block indices, loop counters,
offsets read from memory), so it is evaluated at random values of them: an expression that is aligned only for some
values (a packed sequence's first row, say) shows up at once.
"""

import random
import re

ELEMENT_BYTES = {"float": 4, "bfloat16_t": 2, "half_t": 2, "int": 4}
# tma_load(desc, barrier, shared, coordinates...), tma_store(desc, shared, coordinates...) and its reductions
COPY = re.compile(r"tl::(tma_load|tma_store|tma_store_add)\((\w+)_desc, ")
# the same calls with pointers: tma_load(shared, global, barrier, bytes), tma_store(global, shared, bytes),
# tma_store_add(shared, global, bytes); a global pointer is &(buffer[offset]), a shared one casts its buffer
BULK = re.compile(r"tl::(tma_load|tma_store|tma_store_add)\(\(&")
GLOBAL = re.compile(r"\(&\((\w+)\[(.*)\]\)\)", re.DOTALL)
CAST = re.compile(r"\((?:int|int64_t|uint32_t|int32_t)\)")


def _arguments(source: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose parenthesis opens just before `start`."""
    args, depth, current = [], 0, start
    for i in range(start, len(source)):
        c = source[i]
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                return [*args, source[current:i].strip()]
            depth -= 1
        elif c == "," and depth == 0:
            args.append(source[current:i].strip())
            current = i + 1
    raise ValueError("unbalanced call")


class _RandomValues(dict):
    """Names of a C expression: min/max as in C, any other a random positive int (the same within one draw)."""

    def __init__(self, rng: random.Random):
        super().__init__(min=min, max=max)
        self.rng = rng

    def __missing__(self, name):
        self[name] = self.rng.randrange(1, 1 << 12)
        return self[name]


def _evaluate(expression: str, values: _RandomValues) -> int:
    python = CAST.sub("", expression).replace("blockIdx.", "blockIdx_").replace("threadIdx.", "threadIdx_")
    return eval(python.replace("/", "//"), {"__builtins__": {}}, values)  # noqa: S307 (kernel source, not input)


def tma_copies(source: str) -> list[tuple[str, str, int]]:
    """(tensor, innermost coordinate, element bytes) of each TMA tensor copy in the source."""
    copies = []
    for match in COPY.finditer(source):
        kind, tensor = match[1], match[2]
        args = _arguments(source, match.start() + len(f"tl::{kind}("))
        shared, coordinate = (args[2], args[3]) if kind == "tma_load" else (args[1], args[2])
        element = re.search(r"\(\((\w+)\*\)", shared)
        copies.append((tensor, coordinate, ELEMENT_BYTES[element[1]]))
    return copies


def bulk_copies(source: str) -> list[tuple[str, str, int, str]]:
    """(tensor, element offset of the global address, element bytes, size in bytes) of each bulk copy or reduction."""
    copies = []
    for match in BULK.finditer(source):
        args = _arguments(source, match.end() - 2)
        size = args[-1]
        pointers = args[:2]
        global_pointer = next(GLOBAL.fullmatch(arg) for arg in pointers if GLOBAL.fullmatch(arg))
        shared = next(arg for arg in pointers if not GLOBAL.fullmatch(arg))
        element = re.search(r"\(\((\w+)\*\)", shared)
        copies.append((global_pointer[1], global_pointer[2], ELEMENT_BYTES[element[1]], size))
    return copies


def misaligned_tma_copies(source: str, draws: int = 32) -> list[str]:
    """The TMA tensor copies whose innermost coordinate, and the bulk copies whose global address or size, is not a
    multiple of 16 bytes at some draw of the runtime values: 'tensor: expression'."""
    rng = random.Random(0)
    misaligned = []
    for tensor, coordinate, element in tma_copies(source):
        if any(_evaluate(coordinate, _RandomValues(rng)) * element % 16 for _ in range(draws)):
            misaligned.append(f"{tensor}: {coordinate}")
    for tensor, offset, element, size in bulk_copies(source):
        for _ in range(draws):
            values = _RandomValues(rng)
            if _evaluate(offset, values) * element % 16 or _evaluate(size, values) % 16:
                misaligned.append(f"{tensor}: {offset}, {size} bytes")
                break
    return misaligned
