"""Single-instruction approximations (MUFU) for Triton kernels whose epilogues are ALU-bound: the reciprocal, exp2 and
log each from one PTX instruction (rcp / ex2 / lg2 .approx.ftz: about 1-2 ulp, denormals flushed) instead of an IEEE
division's or libdevice's range checks and slow paths. PTX (a constexpr the launchers pass as
`not triton_interpret()`): off under the interpreter, which takes the plain expressions."""

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def mufu_reciprocal(x, PTX: tl.constexpr):
    if PTX:
        out = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        out = 1.0 / x
    return out


@triton.jit
def mufu_exp2(x, PTX: tl.constexpr):
    if PTX:
        out = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        out = tl.math.exp2(x)
    return out


@triton.jit
def mufu_log(x, PTX: tl.constexpr):
    """Natural log (libdevice's logf, inlined in a loop, takes registers enough to spill a kernel)."""
    if PTX:
        out = LN2 * tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        out = tl.log(x)
    return out
