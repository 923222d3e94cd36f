"""The 16-bit conversions of :mod:`embedcore.kernels.half` as LLVM IR, for one value or a vector of values.

Numba types every operation on a ``uint32`` as ``uint64``, so a conversion written as jitted Python computes
in 64-bit lanes, and a loop over a row of such conversions vectorises at half the width, with widenings and
narrowings around it. Built here on ``i32`` lanes, with every case computed and one of them selected (no
branch), one builder serves a single value (``half``'s jitted conversions, which LLVM then vectorises in the
loops that call them over a row) and a vector of a row's values (``row_vector``'s block sums). The math is
``half``'s module docstring; the cases:

* bfloat16 -> float32: the 16 bits are the float32's high half.
* float16 -> float32: the exponent rebiased from 15 to 127; infinity and NaN get float32's all-ones exponent;
  zero and subnormals are ``mantissa * 2**-24``, exact in float32.
* float32 -> bfloat16, to nearest, ties to even: add ``0x7FFF`` plus the lowest kept bit, keep the high half;
  NaN stays a (quiet) NaN. Stochastically: add the 16 random bits instead (infinity and NaN kept).
* float32 -> float16, to nearest: the rebiased value rounded as bfloat16's, 13 bits dropped; below 2**-14 (a
  subnormal) ``|x| * 2**24`` rounded to an integer: the bits of ``|x| + 0.5`` less those of 0.5, since 0.5's
  float32 step is 2**-24 and the hardware's addition rounds ties to even; 65520 and above round to infinity.
  Stochastically: a normal adds the low 13 random bits; a subnormal drops ``126 - e >= 14`` bits of its
  24-bit significand ``m`` (``e`` the float32 exponent): the first ``max(0, 126 - e - 16)`` bits are cut (all
  of ``m`` from 40 on, so a float32 subnormal gives zero), the last ``min(16, 126 - e)`` rounded with as many
  random bits; 2**16 and above as to nearest (infinity, or NaN).

The random bits come from :func:`rounding_bits`, ``half.rounding_bits``'s words hashed four to a vector.
"""

from __future__ import annotations

from llvmlite import ir

__all__ = ["Lanes", "decode", "encode", "encode_checked", "finite", "all_true", "rounding_bits", "random_lanes",
           "WORD_LANES", "FORMATS_16"]

FORMATS_16 = ("float16", "bfloat16")

_I1, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


class Lanes:
    """IR of one shape: a single value (``count`` None) or vectors of ``count`` values."""

    def __init__(self, builder: ir.IRBuilder, count: int | None = None):
        self.b, self.count = builder, count

    def of(self, element):
        """The IR type of ``element`` values in this shape."""
        return element if self.count is None else ir.VectorType(element, self.count)

    def i32(self, value: int):
        return ir.Constant(self.of(_I32), value if self.count is None else [value] * self.count)

    def f32(self, value: float):
        return ir.Constant(self.of(_F32), value if self.count is None else [value] * self.count)

    def select(self, condition, if_true, if_false):
        return self.b.select(condition, if_true, if_false)

    def unsigned_min(self, value, high: int):
        """``min(value, high)`` of ``i32`` lanes taken as unsigned."""
        return self.select(self.b.icmp_unsigned(">", value, self.i32(high)), self.i32(high), value)


def decode(lanes: Lanes, bits, stored: str):
    """``bits`` (``i16`` lanes) of format ``stored`` as the float32 values they are (exact)."""
    b, c = lanes.b, lanes.i32
    h = b.zext(bits, lanes.of(_I32))
    if stored == "bfloat16":
        return b.bitcast(b.shl(h, c(16)), lanes.of(_F32))
    sign = b.shl(b.and_(h, c(0x8000)), c(16))
    exponent = b.and_(h, c(0x7C00))
    magnitude = b.shl(b.and_(h, c(0x7FFF)), c(13))
    normal = b.add(magnitude, c(112 << 23))
    special = b.add(magnitude, c(224 << 23))
    subnormal = b.bitcast(b.fmul(b.uitofp(b.and_(h, c(0x3FF)), lanes.of(_F32)), lanes.f32(2.0 ** -24)), lanes.of(_I32))
    out = lanes.select(b.icmp_unsigned("==", exponent, c(0x7C00)), special, normal)
    out = lanes.select(b.icmp_unsigned("==", exponent, c(0)), subnormal, out)
    return b.bitcast(b.or_(out, sign), lanes.of(_F32))


def encode(lanes: Lanes, value, random, stored: str):
    """float32 ``value`` lanes rounded to format ``stored`` as ``i16`` lanes: to nearest (``random`` None), or
    stochastically with the 16 random bits ``random`` (``i16`` lanes)."""
    b, c = lanes.b, lanes.i32
    u = b.bitcast(value, lanes.of(_I32))
    a = b.and_(u, c(0x7FFFFFFF))
    r = None if random is None else b.zext(random, lanes.of(_I32))
    if stored == "bfloat16":
        nearest = b.lshr(b.add(b.add(u, c(0x7FFF)), b.and_(b.lshr(u, c(16)), c(1))), c(16))
        nearest = lanes.select(b.icmp_unsigned(">", a, c(0x7F800000)), b.or_(b.lshr(u, c(16)), c(0x40)), nearest)
        if r is None:
            return b.trunc(nearest, lanes.of(_I16))
        rounded = b.lshr(b.add(u, r), c(16))
        return b.trunc(lanes.select(b.icmp_unsigned(">=", a, c(0x7F800000)), nearest, rounded), lanes.of(_I16))
    sign = b.and_(b.lshr(u, c(16)), c(0x8000))
    rebiased = b.sub(a, c(112 << 23))
    normal = b.lshr(b.add(b.add(rebiased, c(0xFFF)), b.and_(b.lshr(rebiased, c(13)), c(1))), c(13))
    magnitude = b.bitcast(a, lanes.of(_F32))
    half_bits = 0x3F000000  # 0.5
    subnormal = b.sub(b.bitcast(b.fadd(magnitude, lanes.f32(0.5)), lanes.of(_I32)), c(half_bits))
    nearest = lanes.select(b.icmp_unsigned("<", a, c(0x38800000)), subnormal, normal)
    nearest = lanes.select(b.icmp_unsigned(">=", a, c(0x477FF000)), c(0x7C00), nearest)
    nearest = b.or_(sign, lanes.select(b.icmp_unsigned(">", a, c(0x7F800000)), c(0x7E00), nearest))
    if r is None:
        return b.trunc(nearest, lanes.of(_I16))
    normal = b.lshr(b.add(rebiased, b.and_(r, c(0x1FFF))), c(13))
    subnormal = _f16_subnormal_stochastic(lanes, a, r)
    out = b.or_(sign, lanes.select(b.icmp_unsigned(">=", a, c(0x38800000)), normal, subnormal))
    return b.trunc(lanes.select(b.icmp_unsigned(">=", a, c(0x47800000)), nearest, out), lanes.of(_I16))


def encode_checked(lanes: Lanes, value, random, stored: str):
    """``(bits, ok)``: ``ok`` (``i1`` lanes) whether each value rounds to a finite 16-bit value, and for those
    lanes ``bits`` = :func:`encode`'s. Cheaper than :func:`encode` then :func:`finite`: a value that cannot
    round to a finite one (infinity, NaN, or at least 2**16 for float16) is refused by comparing its
    magnitude, so the rounding needs no case for it."""
    b, c = lanes.b, lanes.i32
    u = b.bitcast(value, lanes.of(_I32))
    a = b.and_(u, c(0x7FFFFFFF))
    r = None if random is None else b.zext(random, lanes.of(_I32))
    if stored == "bfloat16":
        bits = b.add(u, r) if r is not None else b.add(b.add(u, c(0x7FFF)), b.and_(b.lshr(u, c(16)), c(1)))
        bits = b.trunc(b.lshr(bits, c(16)), lanes.of(_I16))
        limit = 0x7F800000
    else:
        sign = b.and_(b.lshr(u, c(16)), c(0x8000))
        rebiased = b.sub(a, c(112 << 23))
        if r is None:
            normal = b.lshr(b.add(b.add(rebiased, c(0xFFF)), b.and_(b.lshr(rebiased, c(13)), c(1))), c(13))
            subnormal = b.sub(b.bitcast(b.fadd(b.bitcast(a, lanes.of(_F32)), lanes.f32(0.5)), lanes.of(_I32)),
                              c(0x3F000000))
        else:
            normal = b.lshr(b.add(rebiased, b.and_(r, c(0x1FFF))), c(13))
            subnormal = _f16_subnormal_stochastic(lanes, a, r)
        bits = b.or_(sign, lanes.select(b.icmp_unsigned(">=", a, c(0x38800000)), normal, subnormal))
        bits = b.trunc(bits, lanes.of(_I16))
        limit = 0x47800000
    ok = b.and_(b.icmp_unsigned("<", a, c(limit)), finite(lanes, bits, stored))
    return bits, ok


def _f16_subnormal_stochastic(lanes: Lanes, a, r):
    """Stochastic rounding of magnitudes ``a`` (float32 bits) below 2**-14 to float16 subnormals (the module
    docstring), as ``i32`` lanes; other lanes get values to be discarded. A float32 subnormal (``e`` 0) is
    taken as ``e`` 0 with the implicit bit: it drops 126 bits, 40 or more, and rounds to zero either way."""
    b, c = lanes.b, lanes.i32
    m = b.or_(b.and_(a, c(0x7FFFFF)), c(0x800000))
    dropped = b.sub(c(126), b.lshr(a, c(23)))  # >= 14 below 2**-14; "negative" (huge, unsigned) above it
    over = b.sub(dropped, c(16))
    cut = lanes.select(b.icmp_unsigned(">", dropped, c(16)), lanes.unsigned_min(over, 24), c(0))
    rounded = lanes.unsigned_min(dropped, 16)
    mask = b.sub(b.shl(c(1), rounded), c(1))
    return b.lshr(b.add(b.lshr(m, cut), b.and_(r, mask)), rounded)


def finite(lanes: Lanes, bits, stored: str):
    """Whether each 16-bit value of format ``stored`` is finite (``i1`` lanes): its exponent is not all ones."""
    b = lanes.b
    ones = 0x7F80 if stored == "bfloat16" else 0x7C00
    exponent = b.and_(bits, ir.Constant(bits.type, ones if lanes.count is None else [ones] * lanes.count))
    return b.icmp_unsigned("!=", exponent, ir.Constant(bits.type, ones if lanes.count is None
                                                      else [ones] * lanes.count))


def all_true(lanes: Lanes, flags):
    """Whether every lane of the ``i1`` lanes ``flags`` is true (an ``i1``)."""
    if lanes.count is None:
        return flags
    b = lanes.b
    packed = b.bitcast(flags, ir.IntType(lanes.count))
    return b.icmp_unsigned("==", packed, ir.Constant(ir.IntType(lanes.count), (1 << lanes.count) - 1))


_GOLDEN, _MIX_1, _MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


WORD_LANES = 4  # words hashed per vector by rounding_bits


def rounding_bits(builder: ir.IRBuilder, key, counter, count: int) -> list:
    """``count`` words of ``half.rounding_bits`` (a multiple of ``WORD_LANES``), as ``<WORD_LANES x i64>``
    vectors: word ``i`` is the SplitMix64 finaliser of ``key + (counter + i + 1) * golden`` (``key`` and
    ``counter`` ``i64`` values). Hashed as vectors: a 64-bit vector multiply costs several micro-operations,
    but hashing a row's 16 words one by one took 2.3 times the instructions (a bfloat16 row's rounding and
    store: 357 against 152, ``llvm-mca``)."""
    vector = ir.VectorType(_I64, WORD_LANES)

    def constant(value):
        return ir.Constant(vector, [value - (1 << 64) if value >= 1 << 63 else value] * WORD_LANES)

    def splat(value):
        one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, _I32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, WORD_LANES), [0] * WORD_LANES))

    keys, counters, words = splat(key), splat(counter), []
    for first in range(0, count, WORD_LANES):
        place = builder.add(counters, ir.Constant(vector, [first + i + 1 for i in range(WORD_LANES)]))
        z = builder.add(keys, builder.mul(place, constant(_GOLDEN)))
        for shift, multiplier in ((30, _MIX_1), (27, _MIX_2)):
            z = builder.mul(builder.xor(z, builder.lshr(z, constant(shift))), constant(multiplier))
        words.append(builder.xor(z, builder.lshr(z, constant(31))))
    return words


def random_lanes(builder: ir.IRBuilder, words: list, first: int, count: int):
    """The 16 random bits of values ``first .. first + count - 1`` as ``<count x i16>``: value ``j`` takes bits
    ``16 * (j % 4)`` and up of word ``j // 4`` of ``words`` (:func:`rounding_bits`'s vectors; the values lie
    in one vector's words)."""
    per_vector = 4 * WORD_LANES
    if first % per_vector + count > per_vector:
        raise ValueError(f"values {first}..{first + count - 1} span two vectors of rounding words")
    bits = builder.bitcast(words[first // per_vector], ir.VectorType(_I16, per_vector))
    start = first % per_vector
    lanes = ir.Constant(ir.VectorType(_I32, count), list(range(start, start + count)))
    return builder.shuffle_vector(bits, bits, lanes)
