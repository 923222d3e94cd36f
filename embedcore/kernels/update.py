"""The fused, in-place optimizer update over the rows a batch touched.

For each unique row ``r`` (in parallel), its gradient ``g`` is summed into a scratch row, then::

    row[r], slot_0[r], ... = f(g, row[r], (slot_0[r], ...), learning_rate, hyperparameters)

``f`` is the user's per-row function, compiled by :mod:`embedcore.compiler`. Two ways to call it:

* element-wise (when proven so): ``f`` runs on float32 scalars, once per column, inlined into the loop, so
  no temporary row is ever made;
* per row: ``f`` runs on scratch copies of the row and its slots; what it returns is copied back. A function
  may also update those copies in place and return them, which costs no allocation.

The gradient of unique row ``u`` is ``sum over k in ptr[u]:ptr[u + 1] of src_gain[k] * d_act[src_row[k]]``
(the occurrences in grouped order, see :func:`embedcore.kernels.dedup.group_rows`), summed by
:func:`embedcore.kernels.rows.sequential_sum` in a fixed order, so results do not depend on the thread count
(in a kernel compiled for the row length, the same sum in vector registers: ``rows.sequential_sum_fixed``).
The gradient rows may be float32 or the ``uint16`` bits of float16 or bfloat16 values (``gradient``, see
:func:`fused_update_kernel`): a 16-bit value is converted exactly to float32 as the sum reads it, so the
update is bit-identical to that of the gradient's float32 copy, at half the bytes read.
Batches grouped block by block arrive summed already (:func:`embedcore.kernels.dedup.sum_by_blocks`: the
same sums), one occurrence per unique row.
The rows are read at random, so the loop prefetches the table and slot rows ``ROWS_AHEAD`` unique rows
ahead and, when the gradients outgrow the caches, the gradient rows ``OCCURRENCES_AHEAD`` occurrences ahead
(:mod:`embedcore.kernels.prefetch`).

``lazy=False`` visits every row of the table, with a zero gradient for rows the batch did not touch
(non-lazy Adam).

A kernel has two compiled parts (:class:`UpdateKernel`): the loop over one chunk's rows, with the row function
inlined, generated per (function, slot layout, mode, row length when it fills whole cache lines: see
:func:`embedcore.kernels.rows.fixed_length`, stored formats, gradient format) as serial code, and one
parallel loop over the chunks, :func:`_run_chunks`, written once, which calls the chunk's code through a
function pointer: it compiles once per argument types whatever the optimizer, and Numba caches it with
embedcore's other kernels. A parallel loop costs seconds to compile, so a new optimizer costs only its own
rows' code.

No NaN or Inf is ever written: a row whose summed gradient is not finite (float32 overflow of large
gradients, or NaN/Inf let through on purpose) is not updated, and neither is a row for which ``f`` returns a
non-finite value. The new values are computed into per-chunk scratch rows, checked, then stored; each
skipped row gets a code in ``status`` (per unique row when lazy, per table row when not), and the kernel
returns how many rows it flagged:

    STATUS_GRADIENT (1)  the summed gradient holds NaN/Inf; the row, its slots untouched
    STATUS_OUTPUT (2)    f returned NaN/Inf; the row, its slots untouched
    STATUS_LENGTH (3)    f returned a row of the wrong length (a programming error, reported by the engine);
                         the row, its slots untouched
    STATUS_RAISED (4)    f raised an exception (a programming error, reported by the engine); the row, its
                         slots untouched

So every row of the batch is either updated exactly once or left untouched and flagged, whatever ``f`` does
on any row and however many threads run. An exception cannot cross a ``prange`` loop (Numba runs a loop
that may raise serially, or loses the exception with the rest of that thread's chunk), cannot be caught
around code that Numba inlined, and a ``try`` in the loop's body makes Numba run the loop serially too. So
each chunk's rows are updated by a generated function of its own, ``update_rows``, which records the row it
is at; ``guarded_rows`` calls it (not inlined) inside ``try``/``except`` and, should the row function raise,
flags that row and calls it again for the rest of the chunk. The parallel loop calls ``guarded_rows`` per
chunk, through its pointer, so no exception ever reaches it.
(Numba does not free what the row function allocated before it raised: a failing row may leak its
temporaries.)
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..compile_cache import jit_source
from .half import (FLOAT32, ROUNDING_LANES, StoredFormats, decoder, encoder, finite_16, is_16_bit, rounding_bits,
                   rounding_place, slot_key)
from .chunked import ChunkedKernel
from .half_rows import row_loader, row_storer
from .occurrences import holds_rows_alone, occurrence_views, pack_occurrences
from .prefetch import prefetch_row
from .row_vector import block_width
from .rows import copy_row, fixed_length, sequential_sum, sequential_sum_fixed, sequential_sum_fixed_16

__all__ = ["update_kernel", "fused_update_kernel", "compile_for", "all_finite", "balanced_chunks", "CHUNK_ROWS",
           "ROWS_AHEAD", "OCCURRENCES_AHEAD", "STATUS_GRADIENT", "STATUS_OUTPUT", "STATUS_LENGTH", "STATUS_RAISED"]

CHUNK_ROWS = 256
DENSE_CHUNKS = 256  # most chunks a dense (non-lazy) update's table rows are split into
ROWS_AHEAD = 4          # unique rows whose table and slot rows are prefetched ahead of the current one
OCCURRENCES_AHEAD = 8   # occurrences whose gradient rows are prefetched ahead of the current one, when
PREFETCH_MIN_BYTES = 16 << 20  # the gradients are at least this large (smaller ones stay in the last-level
                               # cache, where the prefetches cost more than they save)
STATUS_GRADIENT, STATUS_OUTPUT, STATUS_LENGTH, STATUS_RAISED = 1, 2, 3, 4


ROW_COST = 8  # a row's update costs about as much as summing this many occurrences into it


@njit(cache=True)
def balanced_chunks(ptr, chunk_rows):
    """Bounds ``[b_0 = 0, ..., b_m = U]`` splitting the ``U`` unique rows (occurrences ``ptr``) into ``m``
    chunks of about equal work, ``m`` = max(16, U / chunk_rows) (at most ``U``)."""
    n_unique = ptr.shape[0] - 1
    n_chunks = min(n_unique, max(16, (n_unique + chunk_rows - 1) // chunk_rows))
    bounds = np.empty(n_chunks + 1, np.int64)
    bounds[0] = 0
    total = (ptr[n_unique] - ptr[0]) + ROW_COST * n_unique
    u = 0
    for c in range(1, n_chunks):  # the first row whose work before it reaches the target: work grows with u
        target = total * c // n_chunks
        hi = n_unique
        while u < hi:  # binary search: a walk over every row would cost a pass over the batch
            mid = (u + hi) // 2
            if (ptr[mid] - ptr[0]) + ROW_COST * mid < target:
                u = mid + 1
            else:
                hi = mid
        bounds[c] = u
    bounds[n_chunks] = n_unique
    return bounds


def all_finite(value):
    """Whether every value of a row (or a scalar) is finite."""
    raise NotImplementedError("only callable from jitted code")


@overload(all_finite)
def _all_finite_impl(value):
    if isinstance(value, types.Array):
        def impl(value):
            ok = True
            for j in range(value.shape[0]):  # no early exit, so the loop vectorises
                ok = ok & np.isfinite(value[j])
            return ok
        return impl

    def impl_scalar(value):
        return np.isfinite(value)
    return impl_scalar


def into_row(dst, value):
    """``dst[:] = value`` (a row, or a scalar broadcast to the row), narrowed to ``dst``'s float32; 0 on a
    length mismatch (nothing written), else 1."""
    raise NotImplementedError("only callable from jitted code")


@overload(into_row, inline="always")
def _into_row_impl(dst, value):
    if isinstance(value, types.Array):
        def impl(dst, value):
            if value.shape[0] != dst.shape[0]:
                return 0
            copy_row(dst, value)
            return 1
        return impl

    def impl_scalar(dst, value):
        for j in range(dst.shape[0]):
            dst[j] = value
        return 1
    return impl_scalar


_TEMPLATE = '''
@row_jit
def update_rows(table, slots, uniq, ptr, src_row, src_gain, d_act, learning_rate, hyperparameters, status, lo, hi,
                ahead, progress, rounding):
{unpack}
{unpack_dim}
    n_unique = uniq.shape[0]
{scratch}
{loop}


def guarded_rows(table, slots, uniq, ptr, src_row, src_gain, d_act, learning_rate, hyperparameter_values, status, lo,
                 hi, ahead, rounding):
    hyperparameters = {hyperparameters}  # the tuple the row function takes, from the float32 array
    progress = np.zeros(2, np.int64)  # the row being updated, how many rows were flagged
    start = lo
    while start < hi:
        progress[0] = start  # so a failure before the first row (its scratch) flags that row, never an earlier one
        try:
            update_rows(table, slots, uniq, ptr, src_row, src_gain, d_act, learning_rate, hyperparameters, status,
                        start, hi, ahead, progress, rounding)
            start = hi
        except Exception:  # the row function raised on this row: it stays untouched, the next rows go on
            status[progress[0]] = STATUS_RAISED
            progress[1] += 1
            start = progress[0] + 1
    return progress[1]
'''

# Per call of update_rows: one scratch row for the gradient and one for each new row / slot row (none per
# table row).
_SCRATCH = '''    g_sum = np.empty((1, dim), np.float32)
    g_row = g_sum[0]
    w_new = np.empty(dim, np.float32)
{slot_scratch}'''

_LAZY_LOOP = '''    for u in range(lo, hi):
        progress[0] = u
        if u + ROWS_AHEAD < n_unique:
{prefetch}
        uu = _U(u)  # unsigned subscripts (kernels/rows.py says why)
        r = _U(uniq[uu])
        item = u
        {row_sum}(g_sum, 0, ptr[uu], ptr[uu + _U(1)], src_row, src_gain, d_act, ahead, {dim_args})
{body}'''

# Dense: every row of the table; rows the batch did not touch get a zero gradient.
_DENSE_LOOP = '''    u = np.searchsorted(uniq, lo)
    for r in range(lo, hi):
        progress[0] = r
        item = r
        if u < n_unique and uniq[u] == r:
            {row_sum}(g_sum, 0, ptr[u], ptr[u + 1], src_row, src_gain, d_act, ahead, {dim_args})
            u += 1
        else:
            g_row[:] = 0.0
{body}'''


def _indent(lines, depth):
    return "\n".join(" " * (4 * depth) + line for line in lines)


def _scratch_rows(slot_dims, elementwise):
    """The scratch rows ``update_rows`` computes into, besides ``w_new``."""
    rows = [f"n{k}" for k, d in enumerate(slot_dims) if d == 2]
    if not elementwise:  # the function's results, narrowed to float32, checked before they are stored
        rows += ["o0"] + [f"o{k + 1}" for k, d in enumerate(slot_dims) if d == 2]
    return rows


def _rows_16(slot_dims, formats):
    """The 16-bit row arrays the update stores, in order: ``(array, store function, rounding key)``."""
    rows = [("table", "store_w", "key")] if formats.weights_16 else []
    if formats.slots_16:
        rows += [(f"s{k}", "store_s", f"key_s{k}") for k, d in enumerate(slot_dims) if d == 2]
    return rows


def _scratch(slot_dims, elementwise, formats):
    lines = [f"    {name} = np.empty(dim, np.float32)" for name in _scratch_rows(slot_dims, elementwise)]
    if formats.any_16:  # for rows rounded value by value (kernels/half_rows.py): 16 random bits a value
        lines += ["    words = (dim + 3) // 4",
                  "    random_words = np.empty((words + LANES - 1) // LANES * LANES, np.uint64)",
                  "    encoded = np.empty(dim, np.uint16)"]
    # the bits of each 16-bit row but the last, restored should a later one not be stored
    lines += [f"    keep_{array} = np.empty(dim, np.uint16)" for array, _, _ in _rows_16(slot_dims, formats)[:-1]]
    return _SCRATCH.format(slot_scratch="\n".join(lines) + ("\n" if lines else ""))


def _prefetch(slot_dims):
    lines = ["next_row = uniq[u + ROWS_AHEAD]", "prefetch_row(table, next_row)"]
    lines += [f"prefetch_row(s{k}, next_row)" for k in range(len(slot_dims))]
    return _indent(lines, 3)


def _flag(code):
    return [f"    status[item] = {code}", "    progress[1] += 1", "    continue"]


def _load(dst, array, is_16, load, dim_arg):
    """``dst[:] = array[r]`` into a float32 scratch row, decoding 16-bit values."""
    if not is_16:
        return [f"copy_row({dst}, {array}[r])"]
    return [f"{load}({dst}, {array}, r, {dim_arg})"]


def _store(slot_dims, weights, slot_rows, slot_scalars, formats, dim_arg):
    """Store the checked float32 results (``weights``; per slot, a row in ``slot_rows`` or a scalar in
    ``slot_scalars``), rounding 16-bit ones: a value that rounds to infinity (too large for the format) flags
    the row and leaves it, and its slots, as they were. 16-bit rows are rounded and stored by
    ``kernels/half_rows.py``'s ``store_row``, which stores nothing if a value is not finite; when several rows
    are 16-bit, the bits of all but the last are kept first, and put back if a later one is not stored."""
    n = len(slot_dims)
    if not (formats.weights_16 or formats.slots_16):
        lines = [f"copy_row(table[r], {weights})"]
        for k, d in enumerate(slot_dims):
            lines.append(f"copy_row(s{k}[r], {slot_rows[k]})" if d == 2 else f"s{k}[r] = {slot_scalars[k]}")
        return lines
    stochastic = formats.stochastic
    lines = ["t_row, key = rounding_place(rounding, np.int64(r))",
             f"counter = {'np.uint64(t_row) * np.uint64(words)' if stochastic else 'np.uint64(0)'}"]
    if formats.slots_16:
        lines += [f"key_s{k} = slot_key(key, {k})" for k in range(n)]
        scalars = [k for k, d in enumerate(slot_dims) if d == 1]
        if scalars:
            lines.append("ok = True")
            for k in scalars:
                bits = (f"np.uint16(rounding_bits(key_s{k}, np.uint64(t_row)) & np.uint64(0xFFFF))" if stochastic
                        else "0")
                lines += [f"e_v{k} = enc_s({slot_scalars[k]}, {bits})", f"ok = ok & fin_s(e_v{k})"]
            lines += ["if not ok:"] + _flag("STATUS_OUTPUT")
    rows = _rows_16(slot_dims, formats)
    values = {"table": weights} | {f"s{k}": slot_rows[k] for k, d in enumerate(slot_dims) if d == 2}
    lines += [f"copy_row(keep_{array}, {array}[r])" for array, _, _ in rows[:-1]]
    for i, (array, store, key) in enumerate(rows):
        call = f"{store}({array}, r, {values[array]}, {key}, counter, random_words, encoded, {dim_arg})"
        lines += [f"rounded = {call}"] if i == 0 else ["if rounded:", f"    rounded = {call}"]
    if rows:
        lines += ["if not rounded:"] + [f"    copy_row({array}[r], keep_{array})" for array, _, _ in rows[:-1]]
        lines += _flag("STATUS_OUTPUT")
    if not formats.weights_16:
        lines.append(f"copy_row(table[r], {weights})")
    for k, d in enumerate(slot_dims):
        if d == 2 and not formats.slots_16:
            lines.append(f"copy_row(s{k}[r], {slot_rows[k]})")
        elif d == 1:
            lines.append(f"s{k}[r] = {f'e_v{k}' if formats.slots_16 else slot_scalars[k]}")
    return lines


def _body(slot_dims, elementwise, formats, dim_arg):
    """Compute the new row and slots into float32 scratch, check what will be stored (a float64 result that
    is finite may overflow float32; a float32 one, a 16-bit format), then store it all (or record a status
    and store nothing). ``dim_arg``: the row length as the source names it (a constant when compiled for
    one)."""
    n = len(slot_dims)
    w_at = "dec_w(table[r, j])" if formats.weights_16 else "table[r, j]"
    lines = ["finite = all_finite(g_row)", "if not finite:"] + _flag("STATUS_GRADIENT")
    if elementwise:
        slot_args = "".join((f"dec_s(s{k}[r, j]), " if formats.slots_16 else f"s{k}[r, j], ") for k in range(n))
        lines += ["ok = True", "for j in range(dim):"]
        call = f"fn(g_row[j], {w_at}, ({slot_args}), learning_rate, hyperparameters)"
        if n == 0:
            lines += [f"    w_new[j] = {call}", "    ok = ok & np.isfinite(w_new[j])"]
        else:
            lines += [f"    out = {call}", "    w_new[j] = out[0]", "    ok = ok & np.isfinite(w_new[j])"]
            for k in range(n):
                lines += [f"    n{k}[j] = out[{k + 1}]", f"    ok = ok & np.isfinite(n{k}[j])"]
        lines += ["if not ok:"] + _flag("STATUS_OUTPUT")
        return lines + _store(slot_dims, "w_new", [f"n{k}" for k in range(n)], [None] * n, formats, dim_arg)
    # Per row: the function gets scratch copies, so in-place edits reach the table only once checked.
    lines += _load("w_new", "table", formats.weights_16, "load_w", dim_arg)
    for k, d in enumerate(slot_dims):
        if d == 2:
            lines += _load(f"n{k}", f"s{k}", formats.slots_16, "load_s", dim_arg)
    slot_args = "".join(f"n{k}, " if d == 2 else (f"dec_s(s{k}[r]), " if formats.slots_16 else f"s{k}[r], ")
                        for k, d in enumerate(slot_dims))
    lines.append(f"out = fn(g_row, w_new, ({slot_args}), learning_rate, hyperparameters)")
    outputs = ["out"] if n == 0 else [f"out[{k}]" for k in range(n + 1)]
    lines.append(f"stored = into_row(o0, {outputs[0]})")
    lines += [f"stored = stored & into_row(o{k + 1}, out[{k + 1}])" for k, d in enumerate(slot_dims) if d == 2]
    lines += ["if stored == 0:"] + _flag("STATUS_LENGTH")
    lines.append("ok = all_finite(o0)")
    for k, d in enumerate(slot_dims):
        if d == 2:
            lines.append(f"ok = ok & all_finite(o{k + 1})")
        else:
            lines += [f"v{k} = np.float32(out[{k + 1}])", f"ok = ok & np.isfinite(v{k})"]
    lines += ["if not ok:"] + _flag("STATUS_OUTPUT")
    return lines + _store(slot_dims, "o0", [f"o{k + 1}" for k in range(n)], [f"v{k}" for k in range(n)], formats,
                          dim_arg)


_KERNELS: dict = {}


def kernel_source(row_function, lazy=True, dim=None, formats: StoredFormats = FLOAT32,
                  gradient: str = "float32") -> str:
    """The Python source of the chunk function ``guarded_rows`` generated for ``row_function`` (see
    :class:`UpdateKernel`); with ``dim``, compiled for rows of that length (see
    :func:`embedcore.kernels.rows.fixed_length`); for tables stored in ``formats`` (16-bit ones read the
    argument ``rounding``, see :func:`fused_update_kernel`) and gradient rows in the format ``gradient``."""
    slot_dims = row_function.slot_dims
    unpack = [f"s{k} = slots[{k}]" for k in range(len(slot_dims))] or ["pass"]
    # With a constant row length the gradient is summed in registers (kernels/row_vector.py); 16-bit gradient
    # values are converted to float32 (exactly) as they are read: sum_g and dec_g (kernel_namespace).
    if dim is None:
        row_sum, dim_args = "sequential_sum", ("dim" if gradient == "float32" else "dim, dec_g")
    else:
        row_sum, dim_args = ("sequential_sum_fixed" if gradient == "float32" else "sum_g"), f"dim, {block_width(dim)}"
    loop = (_LAZY_LOOP if lazy else _DENSE_LOOP).format(
        row_sum=row_sum, dim_args=dim_args, prefetch=_prefetch(slot_dims),
        body=_indent(_body(slot_dims, row_function.elementwise, formats, "dim" if dim is None else str(int(dim))), 2))
    rows_dim = _indent([f"dim = {int(dim)}" if dim is not None else "dim = table.shape[1]"], 1)
    n = row_function.n_hyperparameters
    hyperparameters = "(" + "".join(f"hyperparameter_values[{k}], " for k in range(n)) + ")"
    return _TEMPLATE.format(unpack=_indent(unpack, 1), loop=loop, unpack_dim=rows_dim, hyperparameters=hyperparameters,
                            scratch=_scratch(slot_dims, row_function.elementwise, formats))


def kernel_namespace(row_function, formats: StoredFormats = FLOAT32, gradient: str = "float32") -> dict:
    """The globals the generated source refers to."""
    namespace = {"rounding_place": rounding_place, "slot_key": slot_key, "rounding_bits": rounding_bits,
                 "LANES": ROUNDING_LANES}
    if is_16_bit(gradient):  # the gradient's decoder, and its row sum for rows of a constant length
        namespace.update({"dec_g": decoder(gradient), "sum_g": sequential_sum_fixed_16[gradient]})
    for prefix, name in (("w", formats.weights), ("s", formats.slots)):
        if is_16_bit(name):
            namespace.update({f"dec_{prefix}": decoder(name), f"enc_{prefix}": encoder(name, formats.stochastic),
                              f"fin_{prefix}": finite_16(name), f"load_{prefix}": row_loader(name),
                              f"store_{prefix}": row_storer(name, formats.stochastic)})
    return namespace | {"np": np, "fn": row_function.dispatcher, "into_row": into_row,
            "all_finite": all_finite, "copy_row": copy_row, "sequential_sum": sequential_sum,
            "sequential_sum_fixed": sequential_sum_fixed, "prefetch_row": prefetch_row, "_U": np.uint64,
            "row_jit": numba.njit(error_model="numpy", no_cpython_wrapper=True, no_cfunc_wrapper=True), "ROWS_AHEAD": ROWS_AHEAD,
            "STATUS_GRADIENT": STATUS_GRADIENT,
            "STATUS_OUTPUT": STATUS_OUTPUT, "STATUS_LENGTH": STATUS_LENGTH, "STATUS_RAISED": STATUS_RAISED}


@njit(cache=True, parallel=True)
def _run_chunks(chunk, table, slots, uniq, ptr, packed, d_act, learning_rate, hyperparameter_values, status, rounding,
                lazy, ahead):
    """The parallel loop of every update kernel: ``chunk`` (a compiled ``guarded_rows``, passed as a function
    pointer) over chunks of unique rows of equal work (``lazy``: occurrences + ``ROW_COST`` per row; hot rows
    hold thousands of occurrences, and chunks of equal row counts left one thread with most of the work), or
    over chunks of ``CHUNK_ROWS`` table rows (dense); returns the number of rows the chunks flagged. Given the
    row function's code as a pointer (:mod:`embedcore.kernels.chunked`), it is compiled once per argument types,
    not once per optimizer."""
    src_row, src_gain = occurrence_views(packed)  # activation rows and gains (None: all 1; kernels/occurrences.py)
    n_rows = table.shape[0]
    # Dense chunks are at most DENSE_CHUNKS equal row ranges, their bounds computed, not stored: nothing is
    # allocated in proportion to the table (every row costs the same there, so a few chunks a thread balance).
    bounds = balanced_chunks(ptr, CHUNK_ROWS) if lazy else np.empty(1, np.int64)
    n_chunks = bounds.shape[0] - 1 if lazy else min(DENSE_CHUNKS, (n_rows + CHUNK_ROWS - 1) // CHUNK_ROWS)
    flags = np.zeros(n_chunks, np.int64)
    for c in prange(n_chunks):
        lo, hi = (bounds[c], bounds[c + 1]) if lazy else (c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks)
        flags[c] = chunk(table, slots, uniq, ptr, src_row, src_gain, d_act, learning_rate, hyperparameter_values, status,
                         lo, hi, ahead, rounding)
    return flags.sum()


_NO_ROUNDING = np.zeros((0, 4), np.int64)


def _chunk_signature(arg_types):
    """``guarded_rows``' signature for :func:`_run_chunks`' argument types: the payload as its views
    (occurrence_views: int32 rows alone and no gains, or the strided halves of packed words), then the
    chunk's bounds and prefetch distance, and the rounding keys."""
    (table, slots, uniq, ptr, payload, d_act, learning_rate, hyperparameters, status, rounding, _lazy,
     _ahead) = arg_types
    views = ((payload, types.none) if holds_rows_alone(payload) else
             (types.Array(types.int32, 1, "A"), types.Array(types.float32, 1, "A")))
    return types.int64(table, slots, uniq, ptr, *views, d_act, learning_rate, hyperparameters, status, types.int64,
                       types.int64, types.int64, rounding)


class UpdateKernel(ChunkedKernel):
    """The update kernel of one row function and layout (:func:`fused_update_kernel`): ``guarded_rows``,
    generated for the row function (the loop over one chunk's rows with the function inlined), run by
    :func:`_run_chunks`, which is compiled once per argument types for every optimizer (see
    :mod:`embedcore.kernels.chunked`)."""

    def __init__(self, chunk, lazy: bool, dim, source: str):
        super().__init__(chunk, _run_chunks, _chunk_signature, source)
        self.lazy, self.dim = lazy, dim

    def __call__(self, table, slots, uniq, ptr, packed, d_act, learning_rate, hyperparameters, status,
                 rounding=_NO_ROUNDING):
        """Update ``table`` (see :func:`fused_update_kernel`); the number of rows flagged in ``status``."""
        if self.dim is not None and (table.shape[1] != self.dim or d_act.shape[1] != self.dim):
            raise ValueError(f"update kernel compiled for rows of {self.dim} values called with other rows")
        ahead = OCCURRENCES_AHEAD if d_act.size * d_act.itemsize >= PREFETCH_MIN_BYTES else 0
        # float32, as the contract has them; the hyperparameters as an array, so that the parallel loop's
        # argument types do not depend on how many an optimizer has
        return super().__call__(table, tuple(slots), uniq, ptr, packed, d_act, np.float32(learning_rate),
                                np.asarray(hyperparameters, np.float32).reshape(-1), status, rounding, self.lazy,
                                ahead)

    def compile(self, table, slots, payload_dtype, n_hyperparameters, rounding=_NO_ROUNDING):
        """Compile now for the arrays an engine will pass (``payload_dtype``: int32 activation rows or int64
        packed words; float32 gradient rows, a float32 learning rate and hyperparameters)."""
        empty = np.empty(0, np.int64)
        self.compile_for((table, tuple(slots), empty, empty, np.empty(0, payload_dtype),
                          np.empty((0, table.shape[1]), np.float32), np.float32(0),
                          np.zeros(n_hyperparameters, np.float32), np.empty(0, np.uint8), rounding, self.lazy, 0))


def fused_update_kernel(row_function, lazy=True, dim=None, formats: StoredFormats = FLOAT32,
                        gradient: str = "float32") -> UpdateKernel:
    """The update kernel for a :class:`~embedcore.compiler.CompiledRowFunction`, for rows of ``dim``
    values (compiled for that length when :func:`~embedcore.kernels.rows.fixed_length` says so; ``None``:
    any length).

    ``kernel(table, slots, uniq, ptr, packed, d_act, learning_rate, hyperparameters, status)`` updates
    ``table`` rows ``uniq`` (sorted, unique) and returns the number of rows it flagged in ``status`` (uint8,
    zeroed, one entry per unique row when lazy, per table row when not; see the module docstring).
    ``packed`` holds the occurrences' activation rows and gains in grouped order, as
    :func:`~embedcore.kernels.dedup.group_rows` returns them (packed int64 words, or int32 activation rows
    when every gain is 1: the generated part is compiled for each); the gradient of ``uniq[u]`` is summed
    from them on the fly and never written to memory.

    A table or slots stored in 16 bits (``formats``, see :mod:`embedcore.kernels.half`) are passed as their
    ``uint16`` views, and the kernel takes one more argument, ``rounding`` (int64 ``[tables, 4]``, see
    :func:`~embedcore.kernels.half.rounding_place`): the keys of the stochastic rounding of this step.

    ``gradient`` is the format of the gradient rows ``d_act``: ``"float32"`` (float32 ``[n_out, dim]``), or
    ``"float16"`` / ``"bfloat16"``, passed as their ``uint16`` bits (``[n_out, dim]``): each value is
    converted exactly to float32 as the sum reads it, so the sums, and the update, are bit-identical to those
    of the float32 copy of the gradient, while the kernel reads 2 bytes a gradient value instead of 4.
    """
    dim = dim if dim is not None and fixed_length(dim) else None
    key = (row_function.dispatcher, row_function.slot_dims, row_function.elementwise, row_function.split, lazy, dim,
           formats, gradient)
    kernel = _KERNELS.get(key)
    if kernel is None:
        source = kernel_source(row_function, lazy, dim, formats, gradient)
        key_parts = None if row_function.fingerprint is None else (
            "update kernel", row_function.fingerprint, row_function.slot_dims, row_function.elementwise,
            row_function.split, lazy) + ((tuple(formats),) if formats.any_16 else ()) + (
            (("gradient", gradient),) if is_16_bit(gradient) else ())
        chunk = jit_source(source, kernel_namespace(row_function, formats, gradient), "guarded_rows", key_parts,
                           f"embedcore update kernel for {row_function.python_function!r}", row_function="fn",
                           error_model="numpy")
        kernel = _KERNELS[key] = UpdateKernel(chunk, lazy, dim, source)
    return kernel


def compile_for(row_function, lazy, table, slots, n_hyperparameters, unit_gains=False,
                formats: StoredFormats = FLOAT32):
    """The kernel of :func:`fused_update_kernel`, compiled now for the argument types an engine passes
    (so a function whose kernel cannot compile is refused when the engine is built, not halfway through
    an update): occurrences' payloads as int32 activation rows when ``unit_gains`` (the batches without
    weights of tables that sum), else as packed int64 words. The other payload type compiles (or loads from
    the cache) when a batch first brings it, and so does the variant for 16-bit gradient rows (``gradient``
    of :func:`fused_update_kernel`) when a float16 or bfloat16 gradient first comes."""
    kernel = fused_update_kernel(row_function, lazy, table.shape[1], formats)
    kernel.compile(table, slots, np.int32 if unit_gains else np.int64, n_hyperparameters,
                   np.empty((1, 4), np.int64) if formats.any_16 else _NO_ROUNDING)
    return kernel


def update_kernel(row_function, lazy=True):
    """The update as ``kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate,
    hyperparameters, status)``, for occurrences grouped by :func:`~embedcore.kernels.dedup.unique_rows`
    (``order``) rather than laid out by :func:`~embedcore.kernels.dedup.group_rows`; returns the number of
    flagged rows. Runs the same compiled kernel as :func:`fused_update_kernel`."""
    fused = fused_update_kernel(row_function, lazy)

    def kernel(table, slots, uniq, ptr, order, out_row, gains, d_act, learning_rate, hyperparameters, status):
        order = np.ascontiguousarray(order, np.int64)
        packed = pack_occurrences(np.asarray(out_row)[order], np.asarray(gains)[order])
        return fused(table, slots, uniq, ptr, packed, d_act, learning_rate, hyperparameters, status)
    return kernel
