"""Weighted row sums: the arithmetic of the lookup and of the gradient reduction.

A batch for one physical table is a list of occurrences: occurrence ``o`` reads physical row
``rows[o]`` with gain ``gains[o]`` into activation row ``out_row[o]``; occurrences are sorted by activation
row, so ``out_ptr`` (CSR) lists the occurrences of each activation row.

* lookup:    ``act[a] = sum over o in a of gains[o] * table[rows[o]]``
* gradient:  ``grad[u] = sum over occurrences o of uniq[u] (in order) of gains[o] * d_act[out_row[o]]``

A batch whose gains are all 1 passes ``None`` for them: no gains are read and no products made (the same
sums, as ``1 * x == x`` exactly).

The lookup sums with :func:`weighted_sum`, which adds four occurrences per pass over the destination row (a
pass per occurrence made every occurrence wait for the previous one's store: 1.6x slower). The gradient is
summed with :func:`sequential_sum`, one occurrence after the other, the order in which the update can also
add each occurrence's gradient into its row's sum as it walks the batch (``dedup.sum_by_blocks``: every
gradient row read once, in order, instead of once per occurrence, at random). Either order is fixed by the
occurrences' order alone, so results do not depend on the number of threads, and the fused update and the
sharded engine's reductions compute the same sums.

Rows that fill whole 64-byte lines (:func:`fixed_length`) get kernels compiled for their length, the lookup's
here (:func:`gather_kernel`) and the update's in :mod:`embedcore.kernels.update`. They sum with
:func:`weighted_sum_fixed` and :func:`sequential_sum_fixed`, which keep the running sum in vector registers
(:mod:`embedcore.kernels.row_vector`) instead of passing over the destination row in memory; the sums are
the same, bit for bit.
In such kernels a plain copy loop over a row compiles to scalar code; :func:`copy_row` is the row copy
that vectorises, which the update kernels use.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..compile_cache import jit_source
from .aligned import is_aligned
from .chunked import ChunkedKernel
from .half import bits_of, decoder, encoder, format_of
from .half_arrays import EXPONENT_MASK, tagged, value_at
from .prefetch import CACHE_LINE_FLOATS, prefetch_rows_ahead
from .row_vector import (STREAM_ALIGN, block_width, lookup_sum_registers, no_gains, sequential_sum_registers,
                         sequential_sum_registers_16, store_fence, sums_in_registers, weighted_sum_registers)

__all__ = ["weighted_sum", "weighted_sum_fixed", "sequential_sum", "sequential_sum_fixed", "sequential_sum_fixed_16",
           "copy_row", "gather_combine",
           "gather_kernel", "gather_16_kernel", "converting_gather_kernel", "streaming_gather_kernel", "can_stream",
           "fixed_length",
           "sum_gradients", "count_non_finite", "copy_counting_non_finite", "ROWS_AHEAD", "STREAM_CHUNK"]

ROWS_AHEAD = 16  # occurrences whose source rows are prefetched ahead of the current one (a shorter distance
                 # leaves rows from DRAM late; a longer one was slower on them too)
_U = np.uint64


def gain_at(gain, k):
    """``gain[k]``, or float32 1 when ``gain`` is None (every gain 1: a product by it LLVM leaves out)."""
    raise NotImplementedError("only callable from jitted code")


@overload(gain_at, inline="always")
def _gain_at_impl(gain, k):
    if no_gains(gain):
        return lambda gain, k: np.float32(1.0)
    return lambda gain, k: gain[k]


def value_of(decode, value):
    """``value`` as float32: ``decode(value)`` for the bits of a 16-bit table, the value itself when ``decode``
    is None (a float32 table: no code at all; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(value_of, inline="always")
def _value_of_impl(decode, value):
    if isinstance(decode, (types.NoneType, types.Omitted)):
        return lambda decode, value: value
    return lambda decode, value: decode(value)


@njit(cache=True, inline="always")
def _add_one_by_one(dst, du, lo, hi, index, gain, src, ahead, dim, decode=None):
    """``dst[du] += gain[k] * src[index[k]]`` for k = lo, ..., hi - 1 in turn."""
    n = index.shape[0]
    for k in range(lo, hi):
        if ahead:
            prefetch_rows_ahead(src, index, k, n, ahead, 1)
        ku = _U(k)
        w = gain_at(gain, ku)
        r = _U(index[ku])
        for j in range(dim):
            ju = _U(j)
            dst[du, ju] += w * value_of(decode, src[r, ju])


@njit(cache=True, inline="always")
def sequential_sum(dst, d, lo, hi, index, gain, src, ahead, dim, decode=None):
    """``dst[d] = sum over k in [lo, hi) of gain[k] * src[index[k]]`` one occurrence after the other,
    ``((t_lo + t_lo+1) + t_lo+2) + ...`` with ``t_k = gain[k] * src[index[k]]`` in float32, starting from the
    first (the same sums as starting from -0.0; zeros when there is none); ``gain`` None: every gain 1, no
    product. Source rows ``ahead`` occurrences on are prefetched (0: none). ``decode`` converts 16-bit
    source values to float32 (see :func:`value_of`)."""
    n = index.shape[0]
    du = _U(d)
    if hi <= lo:
        for j in range(dim):
            dst[du, _U(j)] = 0.0
        return
    if ahead:
        prefetch_rows_ahead(src, index, lo, n, ahead, 1)
    w = gain_at(gain, _U(lo))
    r = _U(index[_U(lo)])
    for j in range(dim):
        dst[du, _U(j)] = w * value_of(decode, src[r, _U(j)])
    _add_one_by_one(dst, du, lo + 1, hi, index, gain, src, ahead, dim, decode)


@njit(cache=True, inline="always")
def weighted_sum(dst, d, lo, hi, index, gain, src, ahead, dim, decode=None):
    """``dst[d] = sum over k in [lo, hi) of gain[k] * src[index[k]]`` (``gain`` None: every gain 1, the same
    sums as gains of 1, without their products): each group of four occurrences added
    as ``(t0 + t1) + (t2 + t3)``, the last ``(hi - lo) % 4`` one by one, starting from the first group
    (the same sums as starting from zero, but for the sign of a zero); no occurrence gives zeros. The source
    rows of the occurrences ``ahead`` places on are prefetched (``ahead`` 0: none). ``dim`` is the rows'
    length, ``dst.shape[1]``; a caller compiled for one length passes it as a constant (see
    :func:`gather_kernel`). ``decode`` converts 16-bit source values (:func:`value_of`).

    Every subscript is unsigned (``_U``): Numba wraps a negative signed subscript around, which costs a
    compare and an add per subscript and, here, registers spilled to the stack; the indices are never
    negative, so nothing is lost."""
    if hi - lo < 4:  # no group: one by one from the first, which is sequential_sum
        sequential_sum(dst, d, lo, hi, index, gain, src, ahead, dim, decode)
        return
    n = index.shape[0]
    du = _U(d)
    k = lo
    if ahead:  # the first group initialises the row: no separate zeroing pass
        prefetch_rows_ahead(src, index, k, n, ahead, 4)
    ku = _U(k)
    w0, w1 = gain_at(gain, ku), gain_at(gain, ku + _U(1))
    w2, w3 = gain_at(gain, ku + _U(2)), gain_at(gain, ku + _U(3))
    r0, r1, r2, r3 = _U(index[ku]), _U(index[ku + _U(1)]), _U(index[ku + _U(2)]), _U(index[ku + _U(3)])
    for j in range(dim):
        ju = _U(j)
        dst[du, ju] = (w0 * value_of(decode, src[r0, ju]) + w1 * value_of(decode, src[r1, ju])) + \
            (w2 * value_of(decode, src[r2, ju]) + w3 * value_of(decode, src[r3, ju]))
    k += 4
    while k + 3 < hi:
        if ahead:
            prefetch_rows_ahead(src, index, k, n, ahead, 4)
        ku = _U(k)
        w0, w1 = gain_at(gain, ku), gain_at(gain, ku + _U(1))
        w2, w3 = gain_at(gain, ku + _U(2)), gain_at(gain, ku + _U(3))
        r0, r1, r2, r3 = _U(index[ku]), _U(index[ku + _U(1)]), _U(index[ku + _U(2)]), _U(index[ku + _U(3)])
        for j in range(dim):
            ju = _U(j)
            dst[du, ju] += (w0 * value_of(decode, src[r0, ju]) + w1 * value_of(decode, src[r1, ju])) + \
                (w2 * value_of(decode, src[r2, ju]) + w3 * value_of(decode, src[r3, ju]))
        k += 4
    _add_one_by_one(dst, du, k, hi, index, gain, src, ahead, dim, decode)


def weighted_sum_fixed(dst, d, lo, hi, index, gain, src, ahead, dim, width):
    """:func:`weighted_sum` in a kernel compiled for rows of ``dim`` values (``width`` from
    :func:`~embedcore.kernels.row_vector.block_width`, both constants): the running sum is kept in
    registers (:func:`~embedcore.kernels.row_vector.weighted_sum_registers`, bit-identical) when ``dst`` and
    ``src`` are C-contiguous float32 rows and the gains float32, else :func:`weighted_sum` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def _overload_fixed(fixed, in_registers, in_memory):
    """Give ``fixed`` (jitted code only) the sum ``in_registers`` for arguments it takes, else ``in_memory``."""
    @overload(fixed, inline="always")
    def impl(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        if sums_in_registers(dst, index, gain, src):
            def impl_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width):
                in_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width)
            return impl_registers

        def impl_memory(dst, d, lo, hi, index, gain, src, ahead, dim, width):
            in_memory(dst, d, lo, hi, index, gain, src, ahead, dim)
        return impl_memory


_overload_fixed(weighted_sum_fixed, weighted_sum_registers, weighted_sum)


def sequential_sum_fixed(dst, d, lo, hi, index, gain, src, ahead, dim, width):
    """:func:`sequential_sum` in a kernel compiled for rows of ``dim`` values, in registers when it can
    (as :func:`weighted_sum_fixed`; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


_overload_fixed(sequential_sum_fixed, sequential_sum_registers, sequential_sum)


def _sequential_sum_fixed_16(stored):
    """:func:`sequential_sum_fixed` of source rows given as the ``uint16`` bits of ``stored`` values, each
    converted exactly to float32 as it is read: the same sums, bit for bit, as of a float32 copy of them."""
    def fixed(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        raise NotImplementedError("only callable from jitted code")

    decode = decoder(stored)
    in_registers = sequential_sum_registers_16[stored]

    @overload(fixed, inline="always")
    def impl(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        if sums_in_registers(dst, index, gain, src, stored):
            def impl_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width):
                in_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width)
            return impl_registers

        def impl_memory(dst, d, lo, hi, index, gain, src, ahead, dim, width):
            sequential_sum(dst, d, lo, hi, index, gain, src, ahead, dim, decode)
        return impl_memory

    fixed.__name__ = fixed.__qualname__ = f"sequential_sum_fixed_{stored}"
    fixed.__doc__ = _sequential_sum_fixed_16.__doc__.replace("``stored``", stored)
    return fixed


sequential_sum_fixed_16 = {stored: _sequential_sum_fixed_16(stored) for stored in ("float16", "bfloat16")}


# copy_row: dst[j] = src[j] for every j (converted to dst's dtype), one 64-byte line of float32 at a time,
# the line's sixteen values all loaded before any is stored. A plain loop over a row of constant length (the
# kernels compiled for one row length) becomes scalar code: LLVM unrolls it fully before it vectorises, and
# it may not reorder the unrolled loads and stores of arrays that might overlap. Loaded first, each line is
# one vector load and one vector store, about four times quicker per row.
_LINE = CACHE_LINE_FLOATS
_COPY_ROW_SOURCE = "\n".join(
    ["def copy_row(dst, src):",
     "    n = dst.shape[0]",
     f"    lines_end = n - n % {_LINE}",
     f"    for start in range(0, lines_end, {_LINE}):",
     "        b = _U(start)"]
    + [f"        v{i} = src[b + _U({i})]" for i in range(_LINE)]
    + [f"        dst[b + _U({i})] = v{i}" for i in range(_LINE)]
    + ["    for j in range(lines_end, n):",
       "        dst[_U(j)] = src[_U(j)]"])
_namespace = {"_U": _U}
exec(compile(_COPY_ROW_SOURCE, "<embedcore.kernels.rows.copy_row>", "exec"), _namespace)
copy_row = njit(inline="always")(_namespace["copy_row"])
copy_row.__doc__ = """``dst[:] = src`` for 1-D rows of equal length (the caller checks), vectorised (see above)."""


@njit(cache=True, parallel=True)
def _gather_any_dim(table, rows, gains, out_ptr, act, ahead):
    dim = act.shape[1]
    for a in prange(act.shape[0]):
        weighted_sum(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, dim)


# The gathers generated per row length and format are chunks (kernels/chunked.py): serial code for activation
# rows lo:hi, run by one parallel loop, _gather_chunks, compiled once per argument types. ``ahead`` (the
# prefetch distance, 0 for none) is an argument, so prefetching and not share one chunk.
@njit(cache=True, parallel=True)
def _gather_chunks(chunk, table, rows, gains, out_ptr, act, ahead, chunk_rows):
    """``chunk`` (a generated gather of activation rows ``lo:hi``, by pointer) over ``act`` in chunks of
    ``chunk_rows`` rows, in parallel."""
    n = act.shape[0]
    for c in prange((n + chunk_rows - 1) // chunk_rows):
        chunk(table, rows, gains, out_ptr, act, c * chunk_rows, min(n, (c + 1) * chunk_rows), ahead)


def _gather_signature(arg_types):
    """A gather chunk's signature for :func:`_gather_chunks`' argument types."""
    table, rows, gains, out_ptr, act, _ahead, _chunk_rows = arg_types
    return types.int64(table, rows, gains, out_ptr, act, types.int64, types.int64, types.int64)


GATHER_CHUNK = 256  # activation rows per chunk


class GatherKernel(ChunkedKernel):
    """A generated gather: ``kernel(table, rows, gains, out_ptr, act, ahead)``; a kernel compiled for one row
    length (``dim``) refuses other rows."""

    def __init__(self, chunk, source, dim=None, chunk_rows=GATHER_CHUNK):
        super().__init__(chunk, _gather_chunks, _gather_signature, source)
        self.dim, self.chunk_rows = dim, chunk_rows

    def __call__(self, table, rows, gains, out_ptr, act, ahead):
        if self.dim is not None and (table.shape[1] != self.dim or act.shape[1] != self.dim):
            raise ValueError(f"gather kernel compiled for rows of {self.dim} values called with other rows")
        return super().__call__(table, rows, gains, out_ptr, act, ahead, self.chunk_rows)


def _gather(key, generate, label, dim=None, chunk_rows=GATHER_CHUNK) -> GatherKernel:
    """The :class:`GatherKernel` of a generated chunk ``gather_rows``, ``generate()`` giving its source and
    namespace the first time ``key`` is asked for (kept for the process, cached on disk)."""
    kernel = _GATHERS.get(key)
    if kernel is None:
        source, namespace = generate()
        chunk = jit_source(source, namespace, "gather_rows", ("gather",) + key, label)
        kernel = _GATHERS[key] = GatherKernel(chunk, source, dim, chunk_rows)
    return kernel


_GATHERS: dict = {}

# The float32 gather compiled for one row length: with ``dim`` a constant, LLVM drops the row loops'
# trip-count checks and remainders, which matters most for rows already in cache.
_GATHER_SOURCE = '''
def gather_rows(table, rows, gains, out_ptr, act, lo, hi, ahead):
    for a in range(lo, hi):
        weighted_sum_fixed(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, {dim}, {width})
    return 0
'''


def fixed_length(dim: int) -> bool:
    """Whether kernels for rows of ``dim`` values are compiled for that length: rows filling whole 64-byte
    cache lines (the widths that matter for speed; other lengths share one kernel, compiled once)."""
    return dim > 0 and dim % CACHE_LINE_FLOATS == 0


def gather_kernel(dim: int, prefetch: bool = True):
    """The gather compiled for rows of ``dim`` values, a :func:`fixed_length` (cached on disk like the update
    kernels), ``gather(table, rows, gains, out_ptr, act)``, prefetching source rows ``ROWS_AHEAD`` occurrences
    ahead or (``prefetch`` False) not at all (one compiled chunk serves both). Rows of other lengths share
    ``_gather_any_dim``, which takes the distance as its last argument; :func:`gather_combine` calls whichever
    fits."""
    if not fixed_length(dim):
        raise ValueError(f"no gather is compiled for rows of {dim} values; gather_combine takes any length")
    ahead = ROWS_AHEAD if prefetch else 0
    bound = _GATHERS.get((dim, ahead))
    if bound is None:
        kernel = _gather(("float32", dim), lambda: (_GATHER_SOURCE.format(dim=dim, width=block_width(dim)),
                                                    {"weighted_sum_fixed": weighted_sum_fixed}),
                         f"embedcore gather kernel, dim {dim}", dim)

        def bound(table, rows, gains, out_ptr, act):
            return kernel(table, rows, gains, out_ptr, act, ahead)
        _GATHERS[dim, ahead] = bound
    return bound


# The gather that converts: rows stored in 16 bits (``decode``, one of kernels/half.py's, None for float32 rows)
# or activations of a 16-bit format (each float32 sum rounded once to nearest by ``encode``, kernels/half.py's),
# the same float32 sums as the float32 gather. For rows of whole cache lines (``dim`` a constant) the sum, its
# conversions included, is one register block sum (row_vector.lookup_sum_registers); for other rows the sums go
# to memory: straight into float32 activations, or through a float32 row of scratch per chunk, rounded into
# 16-bit activations once the row is summed.
_GATHER_ANY_SOURCE = '''
def gather_rows(table, rows, gains, out_ptr, act, lo, hi, ahead):
    dim = act.shape[1]
    for a in range(lo, hi):
        weighted_sum(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, dim, decode)
    return 0
'''

_GATHER_ANY_ROUNDED_SOURCE = '''
def gather_rows(table, rows, gains, out_ptr, act, lo, hi, ahead):
    dim = act.shape[1]
    sums = np.empty((1, dim), np.float32)
    for a in range(lo, hi):
        weighted_sum(sums, 0, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, dim, decode)
        for j in range(dim):
            act[a, j] = encode(sums[0, j], 0)
    return 0
'''

_GATHER_FIXED_SOURCE = '''
def gather_rows(table, rows, gains, out_ptr, act, lo, hi, ahead):
    for a in range(lo, hi):
        in_registers(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, {dim}, {width})
    return 0
'''


def converting_gather_kernel(stored: str, output: str = "float32", dim: int | None = None):
    """The gather of a table stored as ``stored`` (its ``uint16`` view for a 16-bit format) into
    activations of format ``output`` (``"float32"``; or ``"float16"`` / ``"bfloat16"``, passed as their
    ``uint16`` view, every value the float32 sum rounded once to nearest, ties to even): rows of ``dim``
    values when :func:`fixed_length` (sums in registers; C-contiguous arrays), any length otherwise;
    ``gather(table, rows, gains, out_ptr, act, ahead)``. The sums are :func:`weighted_sum`'s, so
    ``output`` X gives exactly the float32 gather's activations cast to X."""
    fixed = dim is not None and fixed_length(dim)  # (the caller passes C-contiguous rows then)
    label = f"embedcore gather kernel, {stored} rows, {output} activations"
    if fixed:
        return _gather(("converting", stored, output, dim),
                       lambda: (_GATHER_FIXED_SOURCE.format(dim=dim, width=block_width(dim)),
                                {"in_registers": lookup_sum_registers(stored, output)}), label, dim)

    def generate():
        namespace = {"np": np, "weighted_sum": weighted_sum,
                     "decode": decoder(stored) if stored != "float32" else None}
        if output == "float32":
            return _GATHER_ANY_SOURCE, namespace
        return _GATHER_ANY_ROUNDED_SOURCE, namespace | {"encode": encoder(output, stochastic=False)}
    return _gather(("converting", stored, output, None), generate, label)


def gather_16_kernel(stored: str, dim: int | None = None):
    """The gather of a table stored as ``stored`` (``"float16"`` or ``"bfloat16"``), its ``uint16``
    view passed as ``table``, into float32 activations: :func:`converting_gather_kernel` ``(stored,
    "float32", dim)``."""
    return converting_gather_kernel(stored, "float32", dim)


# The gather that writes its activations past the caches (row_vector.lookup_sum_registers streaming), for rows
# of whole cache lines: chunks of STREAM_CHUNK activation rows, each chunk's stores fenced at its end.
_GATHER_STREAMING_SOURCE = '''
def gather_rows(table, rows, gains, out_ptr, act, lo, hi, ahead):
    for a in range(lo, hi):
        streaming_sum(act, a, out_ptr[a], out_ptr[a + 1], rows, gains, table, ahead, {dim}, {width})
    store_fence()
    return 0
'''
STREAM_CHUNK = 1024  # activation rows per fence


def streaming_gather_kernel(stored: str, dim: int, output: str = "float32"):
    """The gather of rows of ``dim`` values (a :func:`fixed_length`) of a table ``stored`` as ``"float32"`` (its
    rows) or a 16-bit format (its ``uint16`` bits) into activations of format ``output`` (float32, or the
    ``uint16`` bits of a 16-bit format, rounded as :func:`converting_gather_kernel` rounds) that stores the
    activations past the caches; ``gather(table, rows, gains, out_ptr, act, ahead)`` with ``act``
    C-contiguous and starting on a ``STREAM_ALIGN``-byte boundary (see :func:`gather_combine`). The same
    sums as the other gathers."""
    return _gather(("streaming", stored, output, dim),
                   lambda: (_GATHER_STREAMING_SOURCE.format(dim=dim, width=block_width(dim)),
                            {"streaming_sum": lookup_sum_registers(stored, output, streaming=True),
                             "store_fence": store_fence}),
                   f"embedcore streaming gather kernel, {stored} rows, {output} activations, dim {dim}", dim,
                   STREAM_CHUNK)


def can_stream(table, act) -> bool:
    """Whether :func:`streaming_gather_kernel` takes these arrays: rows of whole cache lines, C-contiguous,
    ``act`` starting on a ``STREAM_ALIGN``-byte boundary."""
    return (fixed_length(act.shape[1]) and table.flags.c_contiguous and act.flags.c_contiguous
            and is_aligned(act, STREAM_ALIGN))


def gather_combine(table, rows, gains, out_ptr, act, prefetch: bool = True, stored: str = "float32",
                   stream: bool = False, output: str = "float32"):
    """``act[a] = sum over o in out_ptr[a]:out_ptr[a + 1] of gains[o] * table[rows[o]]`` (:func:`weighted_sum`,
    by the kernel for ``act``'s row length; ``gains`` None: every gain 1, none read). ``prefetch`` False skips
    the source rows' prefetch, for rows that are in cache anyway (see
    :func:`embedcore.kernels.prefetch.rows_stay_cached`); the sums are the same. A table ``stored`` in 16 bits
    comes as its ``uint16`` view; its values are summed as float32, as a float32 copy of it would be.
    Activations of a 16-bit ``output`` format come as their ``uint16`` view; each is the float32 sum rounded
    once to nearest, ties to even (exactly the float32 activations cast to ``output``).
    ``stream`` writes ``act`` past the caches when :func:`can_stream` allows (for activations much larger than
    the caches, see ``Tuning.stream_activations_min_bytes``); the sums are the same."""
    dim = act.shape[1]
    ahead = ROWS_AHEAD if prefetch else 0
    if stream and can_stream(table, act):
        streaming_gather_kernel(stored, dim, output)(table, rows, gains, out_ptr, act, ahead)
    elif stored != "float32" or output != "float32":
        contiguous = table.flags.c_contiguous and act.flags.c_contiguous
        converting_gather_kernel(stored, output, dim if contiguous else None)(table, rows, gains, out_ptr, act,
                                                                             ahead)
    elif fixed_length(dim):
        gather_kernel(dim, prefetch)(table, rows, gains, out_ptr, act)
    else:
        _gather_any_dim(table, rows, gains, out_ptr, act, ahead)


def _is_non_finite(value, mask):
    """Whether one value is NaN or Inf: a float's own test, or, for the ``uint16`` bits of a 16-bit value,
    its exponent field ``mask`` all ones (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(_is_non_finite, inline="always")
def _is_non_finite_impl(value, mask):
    if isinstance(value, types.Float):
        return lambda value, mask: not np.isfinite(value)
    return lambda value, mask: (value & mask) == mask


def _copy_value(src, dst, i, j, mask):
    """``dst[i, j] = src[i, j]`` and whether the value is NaN or Inf, for a float ``src`` (converted to
    float32) or a tagged 16-bit one (decoded into float32 ``dst``, or its bits copied into ``uint16`` ``dst``;
    jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(_copy_value, inline="always")
def _copy_value_impl(src, dst, i, j, mask):
    if isinstance(src, types.Array):
        def converted(src, dst, i, j, mask):
            v = np.float32(src[i, j])
            dst[i, j] = v
            return not np.isfinite(v)
        return converted
    if dst.dtype == types.float32:
        def decoded(src, dst, i, j, mask):
            dst[i, j] = value_at(src, i, j)
            return (src.bits[i, j] & mask) == mask
        return decoded

    def bits(src, dst, i, j, mask):
        dst[i, j] = src.bits[i, j]
        return (src.bits[i, j] & mask) == mask
    return bits


@njit(cache=True, inline="always")
def _copy_row_counting(src, dst, i, mask):
    bad = 0
    for j in range(dst.shape[1]):
        bad += _copy_value(src, dst, i, j, mask)
    return bad


# One counting pass and one counting copy, each run by a serial and a parallel loop: below PARALLEL_MIN values,
# waking the worker threads costs more than the pass.
@njit(cache=True)
def _count_non_finite_serial(values, mask):
    bad = 0
    for i in range(values.shape[0]):
        bad += _is_non_finite(values[i], mask)
    return bad


@njit(cache=True, parallel=True)
def _count_non_finite_parallel(values, mask):
    bad = 0
    for i in prange(values.shape[0]):
        bad += _is_non_finite(values[i], mask)
    return bad


@njit(cache=True)
def _copy_counting_serial(src, dst, mask):
    bad = 0
    for i in range(dst.shape[0]):
        bad += _copy_row_counting(src, dst, i, mask)
    return bad


@njit(cache=True, parallel=True)
def _copy_counting_parallel(src, dst, mask):
    bad = 0
    for i in prange(dst.shape[0]):
        bad += _copy_row_counting(src, dst, i, mask)
    return bad


PARALLEL_MIN = 1 << 20  # below this, waking the worker threads costs more than the scan
_NO_MASK = np.uint16(0)  # the exponent mask argument of float arrays, which is not read


def count_non_finite(values) -> int:
    """Number of NaN/Inf entries of a flat float16, bfloat16, float32 or float64 array (no temporary array,
    unlike ``np.isfinite``). A 16-bit array is read as its bits, a NaN/Inf being a value whose exponent
    field is all ones: a pass over 2 bytes a value, no conversion."""
    kernel = _count_non_finite_parallel if values.shape[0] >= PARALLEL_MIN else _count_non_finite_serial
    if values.dtype.itemsize == 2:
        return int(kernel(bits_of(values), EXPONENT_MASK[format_of(values.dtype)]))
    return int(kernel(values, _NO_MASK))


def copy_counting_non_finite(src, dst) -> int:
    """Copy the ``[rows, dim]`` float16, bfloat16, float32 or float64 array ``src`` (any strides) into the
    array ``dst`` of its shape, float32 or (for a 16-bit ``src``) of ``src``'s own dtype, and return how many
    of the copied values are NaN/Inf: one pass where a copy then :func:`count_non_finite` read the values
    twice. 16-bit values become float32 exactly, or keep their bits; float64 values must lie within float32
    range or be non-finite (the callers refuse a finite one beyond it first: it would become an Inf here)."""
    kernel = _copy_counting_parallel if src.size >= PARALLEL_MIN else _copy_counting_serial
    if src.dtype.itemsize == 2:
        if dst.dtype not in (np.float32, src.dtype):
            raise ValueError(f"a {src.dtype} gradient is copied into float32 or {src.dtype} rows, not {dst.dtype}")
        return int(kernel(tagged(src), bits_of(dst), EXPONENT_MASK[format_of(src.dtype)]))
    return int(kernel(src, dst, _NO_MASK))


@njit(cache=True, parallel=True)
def _sum_gradients(out, ptr, src_row, src_gain, d_act):
    dim = out.shape[1]
    for u in prange(out.shape[0]):
        sequential_sum(out, u, ptr[u], ptr[u + 1], src_row, src_gain, d_act, ROWS_AHEAD, dim)


def sum_gradients(out, ptr, order, out_row, gains, d_act):
    """``out[u] = sum over k in ptr[u]:ptr[u + 1] of gains[order[k]] * d_act[out_row[order[k]]]``: the
    per-row gradients a process sends to the rows' owners when tables are sharded, summed exactly as the
    fused update sums them (:func:`sequential_sum`, occurrences in grouped order; ``gains`` None: all 1)."""
    order = np.ascontiguousarray(order, np.int64)
    src_row = np.ascontiguousarray(out_row, np.int64)[order]
    src_gain = None if gains is None else np.ascontiguousarray(gains, np.float32)[order]
    _sum_gradients(out, ptr, src_row, src_gain, d_act)
