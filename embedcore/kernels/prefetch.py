"""Software prefetch for jitted loops that read rows at random.

An update or lookup reads rows whose addresses come from an index array, which the hardware prefetchers
cannot predict; each such row is a cache miss of main-memory latency (~100 ns) unless it is asked for early.
:func:`prefetch_row` asks the memory system for every cache line of ``array[row]`` (a 2-D row, or one
element of a 1-D array) without waiting for it, so a loop can request the rows it will need a few
iterations ahead and overlap those misses with the current iteration's work. A prefetch never faults and
never changes a value; it only changes timing.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["prefetch", "emit_prefetch", "prefetch_row", "prefetch_rows_ahead", "rows_stay_cached", "CACHE_LINE_FLOATS",
           "REUSE_MIN", "CACHED_BYTES_MAX"]

CACHE_LINE_FLOATS = 16  # 64-byte cache lines of float32


def emit_prefetch(builder, pointer):
    """Emit, in LLVM IR, a prefetch of the cache line holding ``pointer`` (for reading, into every level)."""
    byte_pointer = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    function_type = ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
    function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
    # (address, 0 = for reading, 3 = keep in all cache levels, 1 = data cache)
    builder.call(function, [builder.bitcast(pointer, byte_pointer), i32(0), i32(3), i32(1)])


@intrinsic
def prefetch(typingctx, array, row, col):
    """Prefetch the cache line holding ``array[row, col]`` (``array[row]`` for a 1-D array; ``col`` ignored)."""
    if not (isinstance(array, types.Array) and array.ndim in (1, 2) and isinstance(row, types.Integer)
            and isinstance(col, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        index = [context.cast(builder, args[1], signature.args[1], types.intp)]
        if array_type.ndim == 2:
            index.append(context.cast(builder, args[2], signature.args[2], types.intp))
        pointer = cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                            cgutils.unpack_tuple(builder, ary.strides), array_type.layout, index,
                                            wraparound=False, boundscheck=False)
        emit_prefetch(builder, pointer)
        return context.get_dummy_value()

    return types.void(array, row, col), codegen


def prefetch_row(array, row):
    """Prefetch every cache line of ``array[row]`` (one element when ``array`` is 1-D)."""
    raise NotImplementedError("only callable from jitted code")


@overload(prefetch_row, inline="always")
def _prefetch_row_impl(array, row):
    if not isinstance(array, types.Array):
        return None
    if array.ndim == 1:
        def impl_element(array, row):
            prefetch(array, row, 0)
        return impl_element
    per_line = max(1, 512 // array.dtype.bitwidth)  # values in a 64-byte line: 16 float32, 32 16-bit

    def impl(array, row):
        n = array.shape[1]
        for j in range(0, n, per_line):
            prefetch(array, row, j)
        if n:
            prefetch(array, row, n - 1)  # a row not starting on a line boundary spans one more line
    return impl


@njit(inline="always")
def prefetch_rows_ahead(src, index, k, n, ahead, count):
    """Prefetch ``src[index[k + ahead + i]]`` for ``i`` in ``range(count)`` that lie before ``n``: the rows
    of the ``count`` occurrences a loop over ``index`` will read ``ahead`` places on."""
    for i in range(count):
        if k + ahead + i < n:
            prefetch_row(src, index[k + ahead + i])


REUSE_MIN = 8                  # occurrences per distinct row, at least, for rows_stay_cached
CACHED_BYTES_MAX = 4 << 20     # the distinct rows' bytes, at most, for rows_stay_cached


def rows_stay_cached(n_occurrences: int, n_distinct: int, row_bytes: int) -> bool:
    """Whether a batch's rows are likely to be in cache when a lookup reads them, judged from a batch of the
    same table (the previous one): it read every distinct row at least ``REUSE_MIN`` times on average, and
    its distinct rows fit in ``CACHED_BYTES_MAX``. Such a batch draws from a small, hot set of rows (a
    Zipf-like id distribution); prefetching rows that are already cached only costs instructions (the
    TBE-shape gather, 8 tables of Zipf(1.15) ids, 45 reads per distinct row: 5-8% faster without).
    A batch that reads most rows once, or more rows than the cache keeps, needs the prefetch (the
    update shape's lookup, 1.75 reads per distinct row: 47% slower without)."""
    return n_distinct > 0 and n_occurrences >= REUSE_MIN * n_distinct and n_distinct * row_bytes <= CACHED_BYTES_MAX
