"""The sum of a float32 row's clipped squares in float64, in eight lanes: row-wise Adagrad's reduction.

``sum_of_squares(row, low, high)`` clips every value to ``[low, high]`` (``min(max(v, low), high)``),
squares it in float32 and adds the squares in float64, in a fixed order: lane ``i`` (0-7) adds the squares
of values ``i, i + 8, i + 16, ...`` of the row's whole groups of eight, one after the other from 0; the
remaining ``n % 8`` values' squares are added to lane 0; then the lanes are summed as
``((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))``.

Added one after the other, the 64 squares of a row form a chain of 64 dependent float64 additions, and
LLVM does not vectorise a float64 sum it may not reassociate (it kept eight lanes written in Python as
eight scalar chains too). For a contiguous row the lanes are one vector of eight doubles here, built in
LLVM IR: the same IEEE operations lane by lane, so the result does not depend on the machine's vector
width, and it is what the same order written in Python gives (:func:`_sum_of_squares_loops`, used for
other layouts and as the tests' reference).
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["sum_of_squares", "LANES"]

LANES = 8


def _vector_types(row, low, high):
    """Whether the vector path takes these Numba types: a C-contiguous float32 row, float32 bounds."""
    return (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32
            and low == types.float32 and high == types.float32)


@intrinsic
def _lanes_of_squares(typingctx, row, low, high):
    """The eight lane sums over the row's whole groups of eight (a C-contiguous float32 row)."""
    if not _vector_types(row, low, high):
        return None
    result_type = types.UniTuple(types.float64, LANES)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        low_v, high_v = args[1], args[2]
        f32, f64 = ir.FloatType(), ir.DoubleType()
        v32, v64 = ir.VectorType(f32, LANES), ir.VectorType(f64, LANES)
        intp = context.get_value_type(types.intp)
        n = builder.extract_value(array.shape, 0)
        whole = builder.and_(n, intp(~(LANES - 1)))

        def splat(value, vector_type):
            vector = ir.Constant(vector_type, ir.Undefined)
            for lane in range(LANES):
                vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), lane))
            return vector
        low_s, high_s = splat(low_v, v32), splat(high_v, v32)

        entry = builder.block
        check = builder.append_basic_block("squares.check")
        body = builder.append_basic_block("squares.body")
        done = builder.append_basic_block("squares.done")
        builder.branch(check)
        builder.position_at_end(check)
        i = builder.phi(intp)
        total = builder.phi(v64)
        i.add_incoming(intp(0), entry)
        total.add_incoming(ir.Constant(v64, [0.0] * LANES), entry)
        builder.cbranch(builder.icmp_signed("<", i, whole), body, done)
        builder.position_at_end(body)
        pointer = builder.bitcast(builder.gep(array.data, [i]), v32.as_pointer())
        values = builder.load(pointer, align=4)
        # min(max(v, low), high) as Numba computes it: max(v, low) = low if low > v else v, and
        # min(m, high) = high if high < m else m.
        values = builder.select(builder.fcmp_ordered(">", low_s, values), low_s, values)
        values = builder.select(builder.fcmp_ordered("<", high_s, values), high_s, values)
        squares = builder.fpext(builder.fmul(values, values), v64)
        next_total = builder.fadd(total, squares)
        i.add_incoming(builder.add(i, intp(LANES)), body)
        total.add_incoming(next_total, body)
        builder.branch(check)
        builder.position_at_end(done)
        out = cgutils.get_null_value(context.get_value_type(result_type))
        for lane in range(LANES):
            out = builder.insert_value(out, builder.extract_element(total, ir.Constant(ir.IntType(32), lane)), lane)
        return out

    return result_type(row, low, high), codegen


@njit(inline="always")
def _clipped_square(row, j, low, high):
    g = min(max(row[j], low), high)
    return g * g  # float32, widened to float64 by the sum it is added to


@njit(inline="always")
def _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high):
    n = row.shape[0]
    for j in range(n - n % LANES, n):
        t0 += _clipped_square(row, j, low, high)
    return ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))


@njit(inline="always")
def _sum_of_squares_loops(row, low, high):
    """The same sum in plain loops, in the same order."""
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = 0.0
    for j in range(0, row.shape[0] - row.shape[0] % LANES, LANES):
        t0, t1 = t0 + _clipped_square(row, j, low, high), t1 + _clipped_square(row, j + 1, low, high)
        t2, t3 = t2 + _clipped_square(row, j + 2, low, high), t3 + _clipped_square(row, j + 3, low, high)
        t4, t5 = t4 + _clipped_square(row, j + 4, low, high), t5 + _clipped_square(row, j + 5, low, high)
        t6, t7 = t6 + _clipped_square(row, j + 6, low, high), t7 + _clipped_square(row, j + 7, low, high)
    return _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high)


def sum_of_squares(row, low, high):
    """See the module docstring (callable from jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(sum_of_squares, inline="always")
def _sum_of_squares_impl(row, low, high):
    if not (isinstance(row, types.Array) and row.ndim == 1):
        return None
    if _vector_types(row, low, high):
        def impl(row, low, high):
            t0, t1, t2, t3, t4, t5, t6, t7 = _lanes_of_squares(row, low, high)
            return _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high)
        return impl

    def impl_loops(row, low, high):
        return _sum_of_squares_loops(row, low, high)
    return impl_loops
