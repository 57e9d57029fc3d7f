"""Bit-exact rounding helpers shared by the Triton kernels.

Triton's CPU interpreter truncates fp32->bf16 casts and mishandles fp32->fp8e4nv casts, so the
kernels round with integer bit operations and compares. Those give the same answer on a GPU, where
they cost a few integer instructions in memory-bound kernels.
"""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)


# Launch options of every kernel checked bit for bit against solrl_engine.quant: a GPU build contracts
# a * b + c into one FMA (one rounding) by default, where the reference rounds twice. The interpreter
# ignores the option; bench/compile_kernels.py reads each kernel's PTX for fma.rn.f32.
EXACT = {"enable_fp_fusion": False}


@triton.jit
def is_finite(x):
    """True where x is neither NaN nor +-Inf."""
    return tl.abs(x) <= FP32_MAX


@triton.jit
def e4m3_round_magnitude(v):
    """Round finite v in [0, 448] to E4M3, nearest-even. Returns (code int32, value fp32)."""
    # Subnormals (v < 2^-6) sit on a 2^-9 grid: round v*512 to an integer (exact RNE by the
    # 2^23 magic add; code q*2^-9 == q continues seamlessly into the first normal binade).
    q = (v * 512.0 + 8388608.0) - 8388608.0
    sub_code = q.to(tl.int32)
    # Normals: keep 3 mantissa bits of the fp32 pattern, ties to even.
    bits = v.to(tl.int32, bitcast=True)
    rb = bits + 0x7FFFF + ((bits >> 20) & 1)
    norm_code = (rb >> 20) - (120 << 3)
    norm_val = ((rb >> 20) << 20).to(tl.float32, bitcast=True)
    sub = v < 0.015625
    code = tl.where(sub, sub_code, norm_code)
    val = tl.where(sub, q * 0.001953125, norm_val)
    return code, val


@triton.jit
def fp8_row_factors(amax):
    """(encode factor 448/amax, decode scale 1/encode) of rows with finite amax `amax`: 1.0 for amax == 0, the
    encode factor capped at the FP32 max (quant.fp8's current scaling)."""
    enc = tl.minimum(tl.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax), FP32_MAX)
    enc = tl.where(amax == 0.0, 1.0, enc)
    return enc, tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), enc)


@triton.jit
def fp8_encode(x, enc):
    """E4M3 bytes (int32) of x [rows, cols] at per-row encode factors `enc` [rows]; non-finite x -> 0x7F (NaN)."""
    v = x * enc[:, None]
    code, _ = e4m3_round_magnitude(tl.minimum(tl.abs(v), 448.0))
    code = code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 7)
    return tl.where(is_finite(x), code, 0x7F)


# the smallest fp32 subnormal, the least scale of a non-zero INT8 row (a Triton global must be a constexpr)
TINY = tl.constexpr(1.401298464324817e-45)


@triton.jit
def int8_row_scale(amax, bad):
    """The decode scale of rows with finite amax `amax`: amax/127 (at least the smallest subnormal), 1.0 for an
    all-zero row, NaN where `bad` (the row holds a non-finite value) (quant.int8's contract)."""
    s = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), tl.full(amax.shape, TINY, tl.float32))
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where(bad, float("nan"), s)


@triton.jit
def int8_encode(x, s):
    """int8 codes of x [rows, cols] at per-row scales `s` [rows]: round half to even of clamp(x / s, -127, 127);
    a NaN-scale row encodes as 0."""
    d = tl.div_rn(x, s[:, None])
    v = tl.minimum(tl.maximum(d, -127.0), 127.0)
    r = (v + 12582912.0) - 12582912.0  # round half to even: exact for |v| < 2^22 (1.5 * 2^23 magic)
    r = tl.where(d == d, r, 0.0)  # tested before: min/max may drop a NaN
    return r.to(tl.int32).to(tl.int8)


@triton.jit
def e4m3_decode(b):
    """FP32 value of E4M3 bytes given as int32 (0x7F / 0xFF decode to NaN)."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_encode(v):
    """Round fp32 values clamped to [-6, 6] to 4-bit E2M1 codes (int32), ties to even; NaN -> 0."""
    a = tl.abs(v)
    mag = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return mag | ((v < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_decode(c):
    """FP32 values of 4-bit E2M1 codes given as int32."""
    m = c & 7
    e = m >> 1
    # m = 2e + f: value (1 + f/2) * 2^(e-1) for e >= 1, f/2 for e == 0.
    f = (m & 1).to(tl.float32)
    normal = (1.0 + 0.5 * f) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, 0.5 * f, normal)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def global_encode_scale(amax):
    """S_enc = 448*6/amax in fp32; 1.0 for amax == 0; capped at the fp32 max."""
    s = tl.minimum(tl.div_rn(2688.0, amax), FP32_MAX)
    return tl.where(amax == 0.0, 1.0, s)


@triton.jit
def fp32_to_bf16_bits(v):
    """Round fp32 to bf16 (nearest even, NaN kept) and return the 16-bit pattern as int16."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def round_bf16(v):
    """fp32 values rounded to the nearest bf16 (ties to even, NaN kept), as fp32: a BF16 op's result."""
    b = fp32_to_bf16_bits(v).to(tl.int32) & 0xFFFF
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_f32(ptr, mask, IN_BF16: tl.constexpr):
    """Load as fp32. bf16 arrives as its int16 bits and is widened by a shift (exact, subnormals
    included; the interpreter's own bf16 widening is wrong for subnormals)."""
    if IN_BF16:
        b = tl.load(ptr, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_out(ptr, v, mask, OUT_KIND: tl.constexpr):
    """Store fp32 values as OUT_KIND: 0 fp32, 1 bf16 (through its int16 bit pattern), 2 fp16."""
    if OUT_KIND == 1:
        tl.store(ptr, fp32_to_bf16_bits(v), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)
