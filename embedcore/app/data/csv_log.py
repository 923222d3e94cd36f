"""A click log in a plain delimited text file with a header row, read in streaming chunks.

Format (``delimiter`` a single ASCII character, ``,`` by default; no quoting: a field cannot contain the
delimiter; UTF-8, an optional byte-order mark is ignored; blank lines are skipped)::

    label,I1,I2,C1,C2
    1,0.5,3,17,4|9:0.5|9
    0,,1,3,

* ``label``: 0 or 1 (any number equal to 0 or 1, e.g. ``1.0``).
* dense columns: decimal numbers (``-1.5``, ``2e3``); an empty cell reads as 0; NaN/Inf, and numbers
  beyond float32's range (magnitude above 3.4028235e38, e.g. ``1e39``), are refused. Values are stored as
  float32.
* categorical columns: a cell lists the ids of one sample separated by ``|``, each optionally ``id:weight``
  (a decimal number within float32's range, default 1); an empty cell is an empty bag. An id is a non-negative decimal integer
  (below 10^18), or, when the column is hashed (``hash_buckets``), any string: its id is
  ``zlib.crc32(utf8(string)) mod buckets``. Spaces and tabs around fields, ids and weights are ignored;
  ``|`` and ``:`` are reserved.
* key columns (``key_columns``: the columns of dynamic tables, whose ids are 64-bit keys, not rows): a hashed
  column's id is ``embedcore.hash_keys(string)`` (BLAKE2b: all 64 bits, no buckets and no collisions beyond
  the hash's own; the bucket count is not used), any other key column's id is a decimal integer anywhere in
  ``-2**63 .. 2**64 - 1`` taken as its 64-bit pattern (``-1`` and ``18446744073709551615`` are one key).
  Their features' ``vocabulary_size`` is ``2**64`` (the key space; the table's capacity bounds its rows).

Column roles, unless given: ``label`` is the label; ``I<k>`` and ``dense_*`` columns are dense; ``C<k>`` and
``cat_*`` columns are categorical; any other column is an error. When only one of ``categorical`` /
``dense`` is given, the other is every remaining column but the label; when both are given, unlisted columns
are ignored.

Features: a categorical column is one-hot (``Batch.ids[name]`` an int64 ``[B]`` array) when every cell holds
exactly one id without a weight, else a bag (``Ragged``; ``max_ids`` its longest cell; weighted when any
cell gives a weight, the others weighing 1). Vocabulary: ``vocabulary_sizes[name]`` when given (ids must be
below it), the bucket count of a hashed column, else the largest id + 1; a largest id whose vocabulary
could not fit in memory even at 4 bytes a row (e.g. one id of 10^17) is refused, naming its line and column
(see :func:`embedcore.memory_budget.check_fits`).

Reading: the constructor makes one pass over the file (validating every line, finding the features'
shapes, vocabularies and split sizes); each ``batches`` call makes another. Only a chunk of the file
(``chunk_bytes``) is in memory at a time; a Numba kernel parses the bytes. Split: data row ``i`` (0-based,
blank lines skipped) is in eval when ``hash_uniform(i, seed) < eval_fraction``; batches follow the file
order. Errors raise :class:`DataFormatError` naming the file, the line (the header is line 1) and the
column, and quote at most :data:`~embedcore.app.data.batch.EXCERPT_CHARS` characters of a bad cell or line.
A file without data rows, a path that is not a regular file (a FIFO, a device) and a line longer than
64 MiB are refused the same way; nothing is read without bound.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass

import numpy as np
from numba import njit

from ...inputs import Ragged
from ...keys import hash_keys
from ...memory_budget import check_fits
from .batch import (Batch, DataFormatError, FeatureSpec, check_batch_size, check_fraction, check_split, eval_mask,
                    EXCERPT_CHARS, excerpt, rebatch)

__all__ = ["CsvClickLog", "crc32"]

_DENSE_NAME = re.compile(r"I\d+|dense_.+")
_CATEGORICAL_NAME = re.compile(r"C\d+|cat_.+")
_INT = re.compile(r"\+?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_MAX_ID_DIGITS = 18
_MAX_KEY_DIGITS = 20  # 2**64 - 1 = 18446744073709551615
_KEY = re.compile(r"[+-]?[0-9]+")
# How _parse_ids makes an id from a token: a row below the vocabulary, crc32 mod buckets, a 64-bit integer
# key, or a hashed key (the token's span is recorded and hashed with hash_keys after the kernel).
_ROW_ID, _BUCKET_ID, _INTEGER_KEY, _HASHED_KEY = 0, 1, 2, 3
KEY_SPACE = 2 ** 64
_FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_LINE_BYTES = 1 << 26
_SPACE, _TAB, _LF, _CR, _BAR, _COLON, _DOT, _PLUS, _MINUS = 32, 9, 10, 13, 124, 58, 46, 43, 45


# ----------------------------------------------------------------------------------------------------------
# Byte-level kernels. A field is buf[start:end]; every kernel reports the first bad row (-1: none).

@njit(cache=True)
def _split_rows(buf, delimiter, n_columns, starts, ends, lines):
    """Cut ``buf`` into lines and fields; skip blank lines. Returns ``(rows, bad_line, fields_of_bad_line)``
    with ``bad_line`` -1 when every non-blank line has ``n_columns`` fields; ``lines[r]`` is the 0-based
    line of row ``r`` within ``buf``."""
    n = buf.shape[0]
    row, line, pos = 0, 0, 0
    while pos < n:
        end = pos
        while end < n and buf[end] != _LF:
            end += 1
        stop = end - 1 if end > pos and buf[end - 1] == _CR else end
        blank = True
        for i in range(pos, stop):
            if buf[i] != _SPACE and buf[i] != _TAB:
                blank = False
                break
        if not blank:
            column, field_start = 0, pos
            for i in range(pos, stop + 1):
                if i == stop or buf[i] == delimiter:
                    if column < n_columns:
                        starts[row, column] = field_start
                        ends[row, column] = i
                    column += 1
                    field_start = i + 1
            if column != n_columns:
                return row, line, column
            lines[row] = line
            row += 1
        line += 1
        pos = end + 1
    return row, -1, 0


@njit(cache=True)
def _trim(buf, s, e):
    while s < e and (buf[s] == _SPACE or buf[s] == _TAB):
        s += 1
    while e > s and (buf[e - 1] == _SPACE or buf[e - 1] == _TAB):
        e -= 1
    return s, e


@njit(cache=True)
def _parse_float(buf, s, e):
    """``(status, value)`` of the decimal number in ``buf[s:e]`` (trimmed): status 0 ok, 1 malformed or not
    finite in float32 (magnitude above ``_FLOAT32_MAX``), 2 empty. Exact (one rounding) for up to 18
    significant digits and exponents within +-22."""
    s, e = _trim(buf, s, e)
    if s == e:
        return 2, 0.0
    negative = False
    if buf[s] == _PLUS or buf[s] == _MINUS:
        negative = buf[s] == _MINUS
        s += 1
    mantissa, digits, exponent, seen = 0, 0, 0, False
    while s < e and 48 <= buf[s] <= 57:
        if digits < _MAX_ID_DIGITS:
            mantissa = mantissa * 10 + (buf[s] - 48)
            if mantissa:
                digits += 1
        else:
            exponent += 1
        seen = True
        s += 1
    if s < e and buf[s] == _DOT:
        s += 1
        while s < e and 48 <= buf[s] <= 57:
            if digits < _MAX_ID_DIGITS:
                mantissa = mantissa * 10 + (buf[s] - 48)
                if mantissa:
                    digits += 1
                exponent -= 1
            seen = True
            s += 1
    if not seen:
        return 1, 0.0
    if s < e and (buf[s] == 101 or buf[s] == 69):
        s += 1
        negative_exponent = False
        if s < e and (buf[s] == _PLUS or buf[s] == _MINUS):
            negative_exponent = buf[s] == _MINUS
            s += 1
        if s == e:
            return 1, 0.0
        value = 0
        while s < e and 48 <= buf[s] <= 57:
            if value < 100000:
                value = value * 10 + (buf[s] - 48)
            s += 1
        exponent += -value if negative_exponent else value
    if s != e:
        return 1, 0.0
    x = float(mantissa)
    if exponent > 0:
        x = x * 10.0 ** exponent
    elif exponent < 0:
        x = x / 10.0 ** (-exponent) if exponent >= -300 else (x / 1e300) / 10.0 ** (-exponent - 300)
    if not math.isfinite(x) or x > _FLOAT32_MAX:
        return 1, 0.0
    return 0, -x if negative else x


@njit(cache=True)
def _parse_floats(buf, starts, ends, column, empty_value, out):
    """``out[r] = number in field (r, column)``; an empty field gives ``empty_value`` (NaN: an error)."""
    for r in range(out.shape[0]):
        status, x = _parse_float(buf, starts[r, column], ends[r, column])
        if status == 2 and not math.isnan(empty_value):
            x = empty_value
        elif status != 0:
            return r
        out[r] = x
    return -1


def _crc32_table():
    """The table of the reflected CRC-32 polynomial 0xEDB88320 (zlib's)."""
    table = np.empty(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[i] = c
    return table


_CRC_TABLE = _crc32_table()


@njit(cache=True)
def _crc32(buf, s, e, table):
    c = np.uint32(0xFFFFFFFF)
    for i in range(s, e):
        c = table[(c ^ np.uint32(buf[i])) & np.uint32(0xFF)] ^ (c >> np.uint32(8))
    return c ^ np.uint32(0xFFFFFFFF)


def crc32(data: bytes) -> int:
    """The CRC-32 the hashed columns use (equal to ``zlib.crc32``), computed by the reader's kernel."""
    return int(_crc32(np.frombuffer(data, np.uint8), 0, len(data), _CRC_TABLE))


@njit(cache=True)
def _count_ids(buf, starts, ends, column, lengths):
    """``lengths[r]`` = number of ``|``-separated ids in field (r, column) (0 when blank)."""
    for r in range(lengths.shape[0]):
        s, e = _trim(buf, starts[r, column], ends[r, column])
        count = 0
        if s < e:
            count = 1
            for i in range(s, e):
                if buf[i] == _BAR:
                    count += 1
        lengths[r] = count


@njit(cache=True)
def _integer_key(buf, a, b):
    """``(ok, key)``: the decimal integer ``buf[a:b]`` (optional sign) as a 64-bit pattern (uint64), when it
    lies in ``-2**63 .. 2**64 - 1``."""
    negative = False
    if buf[a] == _PLUS or buf[a] == _MINUS:
        negative = buf[a] == _MINUS
        a += 1
    if a == b or b - a > _MAX_KEY_DIGITS:
        return False, np.uint64(0)
    value = np.uint64(0)
    top = np.uint64(0xFFFFFFFFFFFFFFFF)
    for j in range(a, b):
        d = np.uint64(buf[j] - 48) if 48 <= buf[j] <= 57 else np.uint64(10)
        if d > np.uint64(9) or value > (top - d) // np.uint64(10):
            return False, np.uint64(0)
        value = value * np.uint64(10) + d
    if negative:
        if value > np.uint64(1) << np.uint64(63):
            return False, np.uint64(0)
        value = (~value) + np.uint64(1)
    return True, value


@njit(cache=True)
def _parse_ids(buf, starts, ends, column, splits, mode, buckets, vocabulary, table, ids, weights, spans):
    """Fill ``ids``/``weights`` of every ``id[:weight]`` token, by ``mode``: ``_ROW_ID`` a decimal integer
    below ``vocabulary`` (when > 0); ``_BUCKET_ID`` crc32(token) mod ``buckets``; ``_INTEGER_KEY`` a decimal
    integer of 64 bits (:func:`_integer_key`, stored as its bit pattern); ``_HASHED_KEY`` no id: the token's
    ``[start, end)`` goes to ``spans``. Returns ``(bad_row, any_weight)``."""
    keys = ids.view(np.uint64)
    any_weight = False
    for r in range(splits.shape[0] - 1):
        s, e = _trim(buf, starts[r, column], ends[r, column])
        if s == e:
            continue
        k = splits[r]
        token = s
        for i in range(s, e + 1):
            if i < e and buf[i] != _BAR:
                continue
            colon = -1
            for j in range(i - 1, token - 1, -1):
                if buf[j] == _COLON:
                    colon = j
                    break
            w = 1.0
            key_end = i
            if colon >= 0:
                status, w = _parse_float(buf, colon + 1, i)
                if status != 0:
                    return r, any_weight
                any_weight = True
                key_end = colon
            a, b = _trim(buf, token, key_end)
            if a == b:
                return r, any_weight
            if mode == _INTEGER_KEY:
                ok, key = _integer_key(buf, a, b)
                if not ok:
                    return r, any_weight
                keys[k] = key
            elif mode == _HASHED_KEY:
                spans[k, 0], spans[k, 1] = a, b
            elif mode == _BUCKET_ID:
                ids[k] = np.int64(_crc32(buf, a, b, table) % np.uint32(buckets)) if buckets < 2 ** 32 \
                    else np.int64(_crc32(buf, a, b, table))
            else:
                if buf[a] == _PLUS:
                    a += 1
                if a == b or b - a > _MAX_ID_DIGITS:
                    return r, any_weight
                value = 0
                for j in range(a, b):
                    d = buf[j] - 48
                    if d < 0 or d > 9:
                        return r, any_weight
                    value = value * 10 + d
                if vocabulary > 0 and value >= vocabulary:
                    return r, any_weight
                ids[k] = value
            weights[k] = w
            k += 1
            token = i + 1
    return -1, any_weight


def _hashed_spans(buf, spans) -> np.ndarray:
    """``hash_keys`` of the tokens ``buf[start:end]`` (int64): packed into a fixed-width ``S`` array (one
    vectorised pass) when the tokens are short and none ends with a NUL byte (which an ``S`` array would
    drop), else as a list of ``bytes``."""
    if spans.shape[0] == 0:
        return np.zeros(0, np.int64)
    lengths = spans[:, 1] - spans[:, 0]
    width = int(lengths.max())
    if width <= 64 and not np.any(buf[spans[:, 1] - 1] == 0):
        columns = np.arange(width)
        inside = columns[None, :] < lengths[:, None]
        at = np.where(inside, spans[:, :1] + columns[None, :], 0)
        packed = np.where(inside, buf[at], 0).astype(np.uint8)
        return hash_keys(np.ascontiguousarray(packed).view(f"S{width}").reshape(-1))
    return hash_keys([buf[a:b].tobytes() for a, b in spans.tolist()])


# ----------------------------------------------------------------------------------------------------------
# Messages for the first bad cell a kernel found (the same grammar, in Python).

def _float_problem(text):
    t = text.strip(" \t")
    if not _FLOAT.fullmatch(t):
        return f"expected a decimal number, got {excerpt(text)}"
    if not math.isfinite(float(t)):
        return f"expected a finite number, got {excerpt(text)}"
    if abs(float(t)) > _FLOAT32_MAX:
        return f"expected a number within float32's range (magnitude at most {_FLOAT32_MAX:.8g}), got {excerpt(text)}"
    return None


def _plain(text):
    """``text`` unquoted when short, else its bounded excerpt."""
    return text if len(text) <= EXCERPT_CHARS else excerpt(text)


def _names(names):
    """A list of column names for a message: all of them when short, else a bounded excerpt and the count."""
    text = repr(list(names))
    if len(text) <= 4 * EXCERPT_CHARS:
        return text
    return f"{text[:4 * EXCERPT_CHARS]}... ({len(names):,} columns)"


def _cell_problem(cell, col):
    cell = cell.strip(" \t")
    shown = excerpt(cell)
    for token in cell.split("|"):
        key, colon, weight = token.rpartition(":")
        if not colon:
            key = token
        elif _float_problem(weight):
            return f"bad weight in cell {shown}: {_float_problem(weight)}"
        key = key.strip(" \t")
        if not key:
            return f"empty id in cell {shown}"
        if col.buckets is not None:
            continue
        if col.keys:
            if not _KEY.fullmatch(key) or not -2 ** 63 <= int(key) < KEY_SPACE:
                return (f"id {excerpt(key)} in cell {shown} is not an integer in [-2**63, 2**64 - 1] (a dynamic "
                        f"table's 64-bit key; pass hash_buckets to hash strings into keys)")
            continue
        if not _INT.fullmatch(key):
            if key.startswith("-") and _INT.fullmatch(key[1:]):
                return f"negative id {_plain(key)} in cell {shown}"
            return (f"id {excerpt(key)} in cell {shown} is not a non-negative integer (pass hash_buckets to hash "
                    f"strings)")
        if len(key.lstrip("+")) > _MAX_ID_DIGITS:
            return f"id {_plain(key)} in cell {shown} has more than {_MAX_ID_DIGITS} digits"
        if col.vocabulary is not None and int(key) >= col.vocabulary:
            return f"id {int(key)} in cell {shown} is not below the vocabulary size {col.vocabulary}"
    return f"cannot parse cell {shown}"


@dataclass
class _Column:
    """A categorical column: where it is, how its ids are made, and what the scan found."""

    name: str
    index: int
    buckets: int | None        # hashed into this many rows (a key column: hashed into 64-bit keys)
    vocabulary: int | None     # given vocabulary size (ids must be below it)
    keys: bool = False         # ids are a dynamic table's 64-bit keys
    one_hot: bool = True
    weighted: bool = False
    max_ids: int = 0
    max_id: int = -1
    max_id_line: int = 0       # the file line of the largest id


@dataclass
class _Parsed:
    """One categorical column of one chunk in CSR form."""

    values: np.ndarray
    splits: np.ndarray
    weights: np.ndarray | None   # None: no cell of the chunk gave a weight


class CsvClickLog:
    """A CSV click log (see the module docstring for the format and the rules).

    Args:
        path: the file.
        categorical, dense: column names; inferred from the header when ``None``.
        label: the label column.
        vocabulary_sizes: ``{column: size}`` for some integer-id columns (others: largest id + 1).
        hash_buckets: an int (every categorical column is hashed) or ``{column: buckets}`` (at most 2**32).
        key_columns: categorical columns whose ids are 64-bit keys (of dynamic tables): hashed ones with
            :func:`embedcore.hash_keys`, the others as 64-bit integers (see the module docstring).
        eval_fraction: share of rows in the eval split (by a hash of the row index).
        delimiter: the field separator, one ASCII character.
        combiner: the combiner of the bag features.
        seed: seeds the split hash.
        chunk_bytes: bytes read at a time (a chunk always ends at a line end).
    """

    def __init__(self, path, categorical=None, dense=None, label="label", vocabulary_sizes=None, hash_buckets=None,
                 eval_fraction=0.1, delimiter=",", *, combiner="mean", seed=0, chunk_bytes=1 << 20, name=None,
                 key_columns=()):
        self.path = os.fspath(path)
        if not isinstance(delimiter, str) or len(delimiter) != 1 or ord(delimiter) > 127 or \
                delimiter in "|:\r\n.+-" or delimiter.isalnum():
            raise ValueError(f"delimiter must be one ASCII character other than a letter, a digit or one of "
                             f"'|:.+-' and newlines; got {delimiter!r}")
        self.delimiter, self.seed, self.combiner = delimiter, int(seed), combiner
        self.eval_fraction = check_fraction(eval_fraction)
        self.chunk_bytes = max(int(chunk_bytes), 1)
        self.name = name or os.path.basename(self.path)
        self._columns = self._read_header()
        self._label = self._column_index(label, "label")
        categorical, dense = self._roles(categorical, dense, label)
        self.dense_names = list(dense)
        self._dense = [self._column_index(c, "dense") for c in dense]
        self._cats = self._categorical_columns(categorical, vocabulary_sizes, hash_buckets, key_columns)
        self._scan()

    # -- configuration -------------------------------------------------------------------------------------
    def _open(self):
        """The file, opened without blocking (a FIFO would block ``open``) and only if it is a regular file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise DataFormatError(self.path, None, f"cannot open the file ({e.strerror})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DataFormatError(self.path, None, "not a regular file (a FIFO, device or directory cannot be "
                                                       "read twice)")
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _line_too_long(path, line):
        return DataFormatError(path, line, f"the line is longer than {MAX_LINE_BYTES >> 20} MiB")

    def _read_header(self):
        with self._open() as f:
            raw = f.readline(MAX_LINE_BYTES + 1)
        if len(raw) > MAX_LINE_BYTES:
            raise self._line_too_long(self.path, 1)
        try:
            header = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise DataFormatError(self.path, 1, f"the header is not UTF-8: {e}") from None
        if not header.strip():
            raise DataFormatError(self.path, 1, "expected a header row naming the columns, got an empty line")
        names = [h.strip(" \t") for h in header.rstrip("\r\n").split(self.delimiter)]
        seen = set()
        for n in names:
            if not n:
                raise DataFormatError(self.path, 1, f"the header has an empty column name: {excerpt(header.rstrip())}")
            if n in seen:
                raise DataFormatError(self.path, 1, f"the header names column {excerpt(n)} twice")
            seen.add(n)
        return names

    def _column_index(self, name, role):
        if name not in self._columns:
            raise DataFormatError(self.path, 1, f"{role} column {excerpt(str(name))} is not in the header "
                                                f"{_names(self._columns)}")
        return self._columns.index(name)

    def _roles(self, categorical, dense, label):
        others = [c for c in self._columns if c != label]
        if categorical is None and dense is None:
            dense = [c for c in others if _DENSE_NAME.fullmatch(c)]
            categorical = [c for c in others if _CATEGORICAL_NAME.fullmatch(c)]
            unknown = [c for c in others if c not in dense and c not in categorical]
            if unknown:
                raise DataFormatError(self.path, 1, f"cannot tell the role of columns {_names(unknown)}: name dense "
                                                    f"columns I<k> or dense_*, categorical ones C<k> or cat_*, or pass "
                                                    f"categorical= and dense=")
        elif categorical is None:
            categorical = [c for c in others if c not in dense]
        elif dense is None:
            dense = [c for c in others if c not in categorical]
        categorical, dense = list(categorical), list(dense)
        for group, role in ((categorical, "categorical"), (dense, "dense")):
            if len(set(group)) != len(group):
                raise ValueError(f"the {role} columns {_names(group)} list a column twice")
            if label in group:
                raise ValueError(f"the label column '{label}' cannot also be {role}")
        both = sorted(set(categorical) & set(dense))
        if both:
            raise ValueError(f"columns {_names(both)} are listed as both categorical and dense")
        return categorical, dense

    def _categorical_columns(self, categorical, vocabulary_sizes, hash_buckets, key_columns):
        vocabulary_sizes = dict(vocabulary_sizes or {})
        key_columns = list(key_columns or ())
        unknown = sorted(set(key_columns) - set(categorical))
        if unknown:
            raise ValueError(f"key_columns (the columns of dynamic tables) names columns that are not categorical: "
                             f"{_names(unknown)}")
        sized = sorted(set(key_columns) & set(vocabulary_sizes))
        if sized:
            raise ValueError(f"vocabulary_sizes names columns {_names(sized)} whose ids are 64-bit keys (of dynamic "
                             f"tables), which have no vocabulary: drop them from vocabulary_sizes")
        if hash_buckets is None:
            hash_buckets = {}
        elif not isinstance(hash_buckets, dict):
            hash_buckets = {c: hash_buckets for c in categorical}
        for what, mapping in (("vocabulary_sizes", vocabulary_sizes), ("hash_buckets", hash_buckets)):
            unknown = sorted(set(mapping) - set(categorical))
            if unknown:
                raise ValueError(f"{what} names columns that are not categorical: {_names(unknown)}")
            limit = 2 ** 32 if what == "hash_buckets" else 10 ** _MAX_ID_DIGITS
            for c, v in mapping.items():
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= limit:
                    raise ValueError(f"{what}['{c}'] must be an int in [1, {limit}], got {v!r}")
        both = sorted(set(vocabulary_sizes) & set(hash_buckets))
        if both:
            raise ValueError(f"columns {_names(both)} have both a vocabulary size and hash buckets")
        return [_Column(c, self._column_index(c, "categorical"), hash_buckets.get(c), vocabulary_sizes.get(c),
                        keys=c in key_columns) for c in categorical]

    # -- reading -------------------------------------------------------------------------------------------
    def _chunks(self):
        """``(buf, starts, ends, line_numbers, first_row_index)`` per chunk of whole lines."""
        n_columns = len(self._columns)
        delimiter = ord(self.delimiter)
        with self._open() as f:
            f.readline(MAX_LINE_BYTES + 1)
            line, row_index = 2, 0
            pieces, pending = [], 0                 # the start of an unfinished line, and its length
            while True:
                data = f.read(self.chunk_bytes)
                cut = data.rfind(b"\n") + 1
                if data and cut == 0:               # a line longer than a chunk: read on, within bounds
                    pieces.append(data)
                    pending += len(data)
                    if pending > MAX_LINE_BYTES:
                        raise self._line_too_long(self.path, line)
                    continue
                chunk = b"".join(pieces + [data[:cut] if data else b""])
                pieces, pending = ([data[cut:]], len(data) - cut) if data else ([], 0)
                if chunk:
                    arr = np.frombuffer(chunk, np.uint8)
                    n_lines = chunk.count(b"\n") + 1
                    starts = np.empty((n_lines, n_columns), np.int64)
                    ends = np.empty((n_lines, n_columns), np.int64)
                    lines = np.empty(n_lines, np.int64)
                    rows, bad_line, fields = _split_rows(arr, delimiter, n_columns, starts, ends, lines)
                    if bad_line >= 0:
                        raise DataFormatError(self.path, line + int(bad_line), f"expected {n_columns} fields "
                                                                               f"separated by {self.delimiter!r}, "
                                                                               f"got {fields}")
                    if rows:
                        yield arr, starts[:rows], ends[:rows], line + lines[:rows], row_index
                    row_index += rows
                    line += chunk.count(b"\n")
                if not data:
                    return

    def _error(self, arr, starts, ends, numbers, row, column, message):
        text = arr[starts[row, column]:ends[row, column]].tobytes().decode("utf-8", errors="replace")
        return DataFormatError(self.path, int(numbers[row]), message(text) or f"cannot parse {excerpt(text)}",
                               column=self._columns[column])

    def _parse(self, arr, starts, ends, numbers):
        n = starts.shape[0]
        y = np.empty(n)
        bad = _parse_floats(arr, starts, ends, self._label, math.nan, y)
        if bad < 0 and not np.all((y == 0) | (y == 1)):
            bad = int(np.flatnonzero((y != 0) & (y != 1))[0])
        if bad >= 0:
            raise self._error(arr, starts, ends, numbers, bad, self._label,
                              lambda t: f"the label must be 0 or 1, got {excerpt(t)}")
        dense = np.empty((n, len(self._dense)), np.float32)
        x = np.empty(n)
        for j, column in enumerate(self._dense):
            bad = _parse_floats(arr, starts, ends, column, 0.0, x)
            if bad >= 0:
                raise self._error(arr, starts, ends, numbers, bad, column, _float_problem)
            dense[:, j] = x
        cats = {}
        for col in self._cats:
            lengths = np.empty(n, np.int64)
            _count_ids(arr, starts, ends, col.index, lengths)
            splits = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=splits[1:])
            ids = np.empty(splits[-1], np.int64)
            weights = np.empty(splits[-1], np.float32)
            mode = ((_HASHED_KEY if col.buckets else _INTEGER_KEY) if col.keys else
                    _BUCKET_ID if col.buckets else _ROW_ID)
            spans = np.empty((splits[-1] if mode == _HASHED_KEY else 0, 2), np.int64)
            bad, weighted = _parse_ids(arr, starts, ends, col.index, splits, mode, col.buckets or 0,
                                       col.vocabulary or 0, _CRC_TABLE, ids, weights, spans)
            if bad >= 0:
                raise self._error(arr, starts, ends, numbers, bad, col.index, lambda t: _cell_problem(t, col))
            if mode == _HASHED_KEY:
                ids = _hashed_spans(arr, spans)
            cats[col.name] = _Parsed(ids, splits, weights if weighted else None)
        return y.astype(np.float32), dense, cats

    # -- the first pass ------------------------------------------------------------------------------------
    def _scan(self):
        n = {"train": 0, "eval": 0}
        positives = {"train": 0.0, "eval": 0.0}
        for arr, starts, ends, numbers, first in self._chunks():
            labels, _, cats = self._parse(arr, starts, ends, numbers)
            is_eval = eval_mask(np.arange(first, first + labels.shape[0]), self.seed, self.eval_fraction)
            n["eval"] += int(is_eval.sum())
            n["train"] += int((~is_eval).sum())
            positives["eval"] += float(labels[is_eval].sum())
            positives["train"] += float(labels[~is_eval].sum())
            for col in self._cats:
                p = cats[col.name]
                lengths = np.diff(p.splits)
                col.max_ids = max(col.max_ids, int(lengths.max()))
                col.one_hot = col.one_hot and p.weights is None and bool(np.all(lengths == 1))
                col.weighted = col.weighted or p.weights is not None
                if p.values.shape[0] and not col.keys:
                    k = int(np.argmax(p.values))
                    if int(p.values[k]) > col.max_id:
                        col.max_id = int(p.values[k])
                        col.max_id_line = int(numbers[np.searchsorted(p.splits, k, side="right") - 1])
        if n["train"] + n["eval"] == 0:
            raise DataFormatError(self.path, None, "no data rows after the header")
        self._n, self._positives = n, positives
        self.features = []
        for col in self._cats:
            if col.keys:
                size = KEY_SPACE
                source = (f"column '{col.name}' holds 64-bit keys ("
                          f"{'strings hashed with hash_keys' if col.buckets else 'integers'})")
            elif col.vocabulary:
                size, source = col.vocabulary, f"vocabulary_sizes['{col.name}']"
            elif col.buckets:
                size, source = col.buckets, f"hash_buckets of column '{col.name}'"
            else:
                size = max(col.max_id + 1, 1)
                source = f"its largest id {col.max_id} at {self.path}:{col.max_id_line}, column '{col.name}'"
                check_fits(4 * size, f"its largest id {col.max_id} makes a vocabulary of "
                                     f"{size:,} rows, whose table (at least 4 bytes a row)",
                           error=lambda m, col=col: DataFormatError(self.path, col.max_id_line, m, column=col.name))
            self.features.append(FeatureSpec(col.name, size, 1 if col.one_hot else col.max_ids, col.weighted,
                                             "sum" if col.one_hot else self.combiner, bag=not col.one_hot,
                                             source=source))

    @property
    def n_dense(self) -> int:
        return len(self._dense)

    def n_samples(self, split="train") -> int:
        check_split(split)
        return self._n[split]

    def click_rate(self, split="train") -> float:
        check_split(split)
        return self._positives[split] / self._n[split] if self._n[split] else float("nan")

    # -- batches -------------------------------------------------------------------------------------------
    def _to_batch(self, labels, dense, cats, line):
        ids, weights = {}, {}
        for col, spec in zip(self._cats, self.features):
            p = cats[col.name]
            if not spec.bag:
                if p.weights is not None or p.values.shape[0] != labels.shape[0] or \
                        np.any(np.diff(p.splits) != 1):
                    raise DataFormatError(self.path, line, f"column '{col.name}' held one id per row when the "
                                                           f"file was scanned, but no longer: the file changed")
                ids[col.name], weights[col.name] = p.values, None
                continue
            ids[col.name] = Ragged(p.values, p.splits)
            weights[col.name] = None if not spec.weighted else Ragged(
                np.ones(p.values.shape[0], np.float32) if p.weights is None else p.weights, p.splits)
        return Batch(dense, ids, weights, labels)

    def _blocks(self, split):
        for arr, starts, ends, numbers, first in self._chunks():
            labels, dense, cats = self._parse(arr, starts, ends, numbers)
            batch = self._to_batch(labels, dense, cats, int(numbers[0]))
            is_eval = eval_mask(np.arange(first, first + labels.shape[0]), self.seed, self.eval_fraction)
            yield batch.take(is_eval if split == "eval" else ~is_eval)

    def batches(self, batch_size, split="train"):
        """Batches of the split's rows in file order (one pass over the file; the last batch may be smaller)."""
        check_batch_size(batch_size)
        check_split(split)
        return rebatch(self._blocks(split), batch_size)

    def __repr__(self):
        return (f"CsvClickLog({self.path!r}: {self._n['train']} train / {self._n['eval']} eval rows, "
                f"{len(self.features)} categorical, {self.n_dense} dense)")
