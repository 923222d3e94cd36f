"""Weighted row sums whose running sum stays in vector registers, for rows of a length known when compiled.

:func:`embedcore.kernels.rows.weighted_sum` adds four occurrences per pass over the destination row in
memory, so every pass loads and stores the whole row again, and each pass waits for the previous one's
stores. :func:`weighted_sum_registers` keeps the running sum of a block of ``width`` values (16, 32 or 64
float32: at most eight AVX2 registers) as one LLVM vector that is stored once, when the block is done, and
walks the occurrences once per block of the row.

The arithmetic is the same IEEE float32 operations in the same order, lane by lane: a group of four
occurrences is ``(w0 * s0 + w1 * s1) + (w2 * s2 + w3 * s3)``, added to the running sum, the remaining
``(hi - lo) % 4`` occurrences one by one; the first group (or occurrence) starts the sum, and no occurrence
gives zeros. Every sum is bit-identical to ``weighted_sum``'s, whatever the machine's vector width (LLVM
splits the vector into the registers it has). :func:`sequential_sum_registers` is the same with no groups,
every occurrence added on its own, bit-identical to :func:`embedcore.kernels.rows.sequential_sum`. The
``_16`` variants read rows stored as the ``uint16`` bits of float16 or bfloat16 values, converting each
exactly to float32 as it is loaded, so their sums are those of a float32 copy of the rows.

The lookup's block sums (:func:`lookup_sum_registers`) also convert: rows stored in a 16-bit format are
loaded as their ``uint16`` bits and converted to float32 lane by lane (exact), and a block of 16-bit
activations is the finished float32 sum rounded once to nearest, ties to even, as it is stored (so it equals
the float32 activation cast to that format, bit for bit).

The block sum is one intrinsic (LLVM IR built here) rather than jitted Python: Numba inlines jitted
helpers by copying their IR into the caller and typing it again, which for the loops below tripled the
compile time of each kernel that uses them, and a helper left as a call costs atomic reference counts on
every array it is passed, per row.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import half_ir
from .prefetch import CACHE_LINE_FLOATS, emit_prefetch

__all__ = ["weighted_sum_registers", "sequential_sum_registers", "sequential_sum_registers_16", "sums_in_registers",
           "lookup_sum_registers", "store_fence", "block_width", "no_gains", "STREAM_ALIGN"]

_I32 = ir.IntType(32)
STREAM_ALIGN = 64  # bytes: the alignment of the rows a streaming sum writes


def block_width(dim: int) -> int:
    """The widest block of 64, 32 or 16 values that tiles a row of ``dim`` values (a multiple of 16)."""
    for width in (64, 32, 16):
        if dim % width == 0:
            return width
    raise ValueError(f"rows of {dim} values are not whole cache lines")


def _float32_rows(array):
    return isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C" and array.dtype == types.float32


def _bits_rows(array):
    return isinstance(array, types.Array) and array.ndim == 2 and array.layout == "C" and array.dtype == types.uint16


def _rows_of(array, stored: str) -> bool:
    """Whether ``array`` (a Numba type) is C-contiguous rows of format ``stored``: float32, or the ``uint16``
    bits of a 16-bit format."""
    return _float32_rows(array) if stored == "float32" else _bits_rows(array)


def sums_in_registers(dst, index, gain, src, stored: str = "float32", output: str = "float32") -> bool:
    """Whether :func:`weighted_sum_registers` takes arguments of these Numba types: C-contiguous float32
    rows ``dst`` and ``src`` (its vector loads and stores assume contiguous rows; ``src`` C-contiguous
    ``uint16`` bits for a ``stored`` 16-bit format, ``dst`` for an ``output`` 16-bit format), 1-D integer
    ``index`` and float32 ``gain`` of any layout, or ``None`` (every gain 1)."""
    return (_rows_of(dst, output) and _rows_of(src, stored)
            and isinstance(index, types.Array) and index.ndim == 1 and isinstance(index.dtype, types.Integer)
            and (no_gains(gain) or isinstance(gain, types.Array) and gain.ndim == 1
                 and gain.dtype == types.float32))


def no_gains(gain) -> bool:
    """Whether a gains argument's Numba type is None: every gain 1, none read."""
    return isinstance(gain, types.NoneType)


class _Arrays:
    """Element and row addresses of the intrinsic's array arguments."""

    def __init__(self, context, builder, signature, args):
        self.context, self.builder = context, builder
        self.arrays = {}
        for position, name in ((0, "dst"), (4, "index"), (5, "gain"), (6, "src")):
            array_type = signature.args[position]
            if not isinstance(array_type, types.Array):  # no gains: every gain is 1
                continue
            value = context.make_array(array_type)(context, builder, args[position])
            self.arrays[name] = (array_type, value)

    def pointer(self, name, *indices):
        array_type, value = self.arrays[name]
        return cgutils.get_item_pointer2(self.context, self.builder, value.data,
                                         cgutils.unpack_tuple(self.builder, value.shape),
                                         cgutils.unpack_tuple(self.builder, value.strides), array_type.layout,
                                         list(indices), wraparound=False, boundscheck=False)

    def length(self, name):
        return self.builder.extract_value(self.arrays[name][1].shape, 0)


def _block_sum_intrinsic(group_size, stored="float32", streaming=False, output="float32"):
    """The block sum adding occurrences in groups of ``group_size`` (4: ``(t0 + t1) + (t2 + t3)`` then the
    rest one by one, the lookup's order; 1: one by one, the update's order), of rows ``stored`` as float32 or
    as the bits of a 16-bit format (converted to float32 as they are loaded), into rows of format ``output``
    (float32, or a 16-bit format: the float32 sum rounded once to nearest, ties to even, as it is stored);
    ``streaming``: the sum is stored past the caches (see :func:`lookup_sum_registers`)."""

    @intrinsic
    def block_sum(typingctx, dst, d, lo, hi, index, gain, src, ahead, col, width):
        return _block_sum_signature(group_size, stored, streaming, output, dst, d, lo, hi, index, gain, src, ahead,
                                    col, width)
    return block_sum


def _block_sum_signature(group_size, stored, streaming, output, dst, d, lo, hi, index, gain, src, ahead, col,
                         width):
    """``dst[d, col:col + width] = round(sum over k in [lo, hi) of gain[k] * src[index[k], col:col + width])``
    (the module docstring's order for ``group_size``; ``gain`` None: every gain 1, no product, the same sums
    since ``1 * x == x``; ``round`` the identity for a float32 ``output``, else to nearest of that 16-bit
    format, :func:`embedcore.kernels.half_ir.encode`); for ``ahead`` > 0 the block's lines of the rows
    ``ahead`` occurrences on are prefetched."""
    if not (isinstance(width, types.IntegerLiteral) and width.literal_value % CACHE_LINE_FLOATS == 0
            and sums_in_registers(dst, index, gain, src, stored, output)
            and all(isinstance(t, types.Integer) for t in (d, lo, hi, ahead, col))):
        return None
    w = width.literal_value
    unit = no_gains(gain)
    per_line = CACHE_LINE_FLOATS if stored == "float32" else 2 * CACHE_LINE_FLOATS

    def codegen(context, builder, signature, args):
        arrays = _Arrays(context, builder, signature, args)
        intp = context.get_value_type(types.intp)
        as_intp = [context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2, 3, 7, 8)]
        row_d, lo_v, hi_v, ahead_v, col_v = as_intp
        vector = ir.VectorType(ir.FloatType(), w)
        n = arrays.length("index")
        lines = list(range(0, w, per_line)) + [w - 1]  # + the last value: a row off a line boundary
        prefetching = builder.icmp_signed(">", ahead_v, intp(0))

        def source_row(k):
            index_type = signature.args[4].dtype
            row = builder.load(arrays.pointer("index", k))
            return context.cast(builder, row, index_type, types.intp)

        def prefetch(k, count):
            """Prefetch the block of the rows of occurrences k + ahead ... (count of them), those before n."""
            with builder.if_then(prefetching, likely=True):
                for i in range(count):
                    at = builder.add(builder.add(k, ahead_v), intp(i))
                    with builder.if_then(builder.icmp_signed("<", at, n)):
                        row = source_row(at)
                        for j in lines:
                            emit_prefetch(builder, arrays.pointer("src", row, builder.add(col_v, intp(j))))

        def term(k):
            """gain[k] * src[index[k], col:col + w], in float32."""
            if stored == "float32":
                values = builder.load(builder.bitcast(arrays.pointer("src", source_row(k), col_v),
                                                      vector.as_pointer()), align=4)
            else:
                raw = builder.load(builder.bitcast(arrays.pointer("src", source_row(k), col_v),
                                                   ir.VectorType(ir.IntType(16), w).as_pointer()), align=2)
                values = half_ir.decode(half_ir.Lanes(builder, w), raw, stored)
            if unit:
                return values
            scale = builder.load(arrays.pointer("gain", k))
            splat = builder.insert_element(ir.Constant(vector, ir.Undefined), scale, _I32(0))
            splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(_I32, w), [0] * w))
            return builder.fmul(splat, values)

        def group(k):
            t = [term(builder.add(k, intp(i))) for i in range(4)]
            return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))

        first_group = builder.append_basic_block("sum.first_group")
        not_group = builder.append_basic_block("sum.not_group")
        first_one = builder.append_basic_block("sum.first_one")
        groups_check = builder.append_basic_block("sum.groups_check")
        groups_body = builder.append_basic_block("sum.groups_body")
        ones_check = builder.append_basic_block("sum.ones_check")
        ones_body = builder.append_basic_block("sum.ones_body")
        done = builder.append_basic_block("sum.done")

        if group_size == 4:
            builder.cbranch(builder.icmp_signed(">=", builder.sub(hi_v, lo_v), intp(4)), first_group, not_group)
        else:  # no groups: the blocks for them are left unreachable
            builder.branch(not_group)

        builder.position_at_end(not_group)
        builder.cbranch(builder.icmp_signed(">", hi_v, lo_v), first_one, done)

        def first(block, count, summand, target):
            """In ``block``: the first ``count`` occurrences' sum starts the running sum; on to ``target``."""
            builder.position_at_end(block)
            prefetch(lo_v, count)
            value = summand(lo_v)
            after = builder.add(lo_v, intp(count))
            builder.branch(target)
            return after, value, builder.block

        def loop(check, body, entries, count, summand, exit_block):
            """At ``check`` (entered with the ``(k, sum, from block)`` of ``entries``): while occurrences
            k ... k + count - 1 exist, ``body`` adds their ``summand``; then on to ``exit_block``."""
            builder.position_at_end(check)
            k, acc = builder.phi(intp), builder.phi(vector)
            for k_in, acc_in, block in entries:
                k.add_incoming(k_in, block)
                acc.add_incoming(acc_in, block)
            builder.cbranch(builder.icmp_signed("<", builder.add(k, intp(count - 1)), hi_v), body, exit_block)
            builder.position_at_end(body)
            prefetch(k, count)
            next_acc = builder.fadd(acc, summand(k))
            next_k = builder.add(k, intp(count))
            k.add_incoming(next_k, builder.block)
            acc.add_incoming(next_acc, builder.block)
            builder.branch(check)
            return k, acc

        one_start = first(first_one, 1, term, ones_check)
        if group_size == 4:
            group_start = first(first_group, 4, group, groups_check)
            k4, acc4 = loop(groups_check, groups_body, [group_start], 4, group, ones_check)
            k1, acc1 = loop(ones_check, ones_body, [(k4, acc4, groups_check), one_start], 1, term, done)
        else:
            for block in (first_group, groups_check, groups_body):
                builder.position_at_end(block)
                builder.unreachable()
            k1, acc1 = loop(ones_check, ones_body, [one_start], 1, term, done)

        builder.position_at_end(done)
        total = builder.phi(vector)
        total.add_incoming(ir.Constant(vector, [0.0] * w), not_group)
        total.add_incoming(acc1, ones_check)
        value_bytes = 4
        if output != "float32":  # rounded once, to nearest, as a cast of the float32 sum would
            total = half_ir.encode(half_ir.Lanes(builder, w), total, None, output)
            value_bytes = 2
        target = builder.bitcast(arrays.pointer("dst", row_d, col_v), total.type.as_pointer())
        if streaming:  # whole aligned blocks (the caller's promise: rows of whole blocks from an aligned start),
            #            written around the caches; a block of 16-bit values may be half a line
            store = builder.store(total, target, align=min(STREAM_ALIGN, value_bytes * w))
            store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        else:
            builder.store(total, target, align=value_bytes)
        return context.get_dummy_value()

    return types.void(dst, d, lo, hi, index, gain, src, ahead, col, width), codegen


_grouped_block_sum = _block_sum_intrinsic(4)
_sequential_block_sum = _block_sum_intrinsic(1)
_sequential_block_sum_16 = {stored: _block_sum_intrinsic(1, stored) for stored in half_ir.FORMATS_16}


@njit(inline="always")
def weighted_sum_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width):
    """``dst[d] = sum over k in [lo, hi) of gain[k] * src[index[k]]`` exactly as
    :func:`~embedcore.kernels.rows.weighted_sum` sums it, ``width`` values at a time in registers (C-contiguous
    float32 rows; ``dim`` and ``width``, from :func:`block_width`, constants of the calling kernel)."""
    for col in range(0, dim, width):
        _grouped_block_sum(dst, d, lo, hi, index, gain, src, ahead, col, width)


@njit(inline="always")
def sequential_sum_registers(dst, d, lo, hi, index, gain, src, ahead, dim, width):
    """:func:`weighted_sum_registers` in :func:`~embedcore.kernels.rows.sequential_sum`'s order: one
    occurrence at a time."""
    for col in range(0, dim, width):
        _sequential_block_sum(dst, d, lo, hi, index, gain, src, ahead, col, width)


def _over_blocks(block_sum, doc):
    """A row sum that runs ``block_sum`` over the row's column blocks of ``width`` values."""
    @njit(inline="always")
    def row_sum(dst, d, lo, hi, index, gain, src, ahead, dim, width):
        for col in range(0, dim, width):
            block_sum(dst, d, lo, hi, index, gain, src, ahead, col, width)
    row_sum.__doc__ = doc
    return row_sum


sequential_sum_registers_16 = {
    stored: _over_blocks(_sequential_block_sum_16[stored], f":func:`sequential_sum_registers` of the ``uint16`` bits "
                                                           f"of {stored} rows (each value converted exactly to "
                                                           f"float32 as it is loaded: the same sums as of a "
                                                           f"float32 copy)")
    for stored in half_ir.FORMATS_16}


_LOOKUP_SUMS: dict = {}
_FORMATS = ("float32",) + half_ir.FORMATS_16  # what rows and activations may be


def lookup_sum_registers(stored: str = "float32", output: str = "float32", streaming: bool = False):
    """The lookup's row sum in registers, ``row_sum(dst, d, lo, hi, index, gain, src, ahead, dim, width)``:
    ``dst[d] = round(sum over k in [lo, hi) of gain[k] * src[index[k]])``, the sum exactly as
    :func:`weighted_sum_registers` makes it, of rows ``stored`` as float32 or the ``uint16`` bits of a 16-bit
    format (their float32 values summed), written to rows of format ``output``: float32 as it is, or rounded
    once to the nearest ``output`` value, ties to even (the bits ``np.float32(sum).astype(output)`` has;
    beyond float16's range, infinity). One jitted function per ``(stored, output, streaming)``.

    ``streaming``: the result is written with non-temporal stores, straight to memory through
    write-combining buffers, without first reading the destination's lines into the cache (a normal store
    reads each line it writes, for ownership). For an activation array far larger than the caches, that read
    is a third of the lookup's memory traffic, and the array would leave the caches anyway before the model
    reads it. ``dst`` rows must start on ``STREAM_ALIGN``-byte boundaries (the caller checks; a block of 16
    16-bit values is half a line, stored aligned to 32 bytes), and the caller fences the stores
    (:func:`store_fence`) before its results are read by another thread."""
    key = (stored, output, bool(streaming))
    if stored not in _FORMATS or output not in _FORMATS:
        raise ValueError(f"rows are stored as {_FORMATS}, not {stored!r} / {output!r}")
    row_sum = _LOOKUP_SUMS.get(key)
    if row_sum is None:
        rounded = "" if output == "float32" else f", rounded to nearest {output}"
        past = ", each block stored past the caches" if streaming else ""
        row_sum = _LOOKUP_SUMS[key] = _over_blocks(
            _block_sum_intrinsic(4, stored, streaming, output),
            f":func:`weighted_sum_registers` of {stored} rows into {output} rows{rounded}{past}")
    return row_sum


@intrinsic
def store_fence(typingctx):
    """A full memory fence (``mfence`` on x86): this thread's non-temporal stores are visible to every
    thread before any of its later loads and stores (they are not ordered by the x86 memory model)."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen
