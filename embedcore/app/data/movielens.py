"""MovieLens ratings as a binary "liked it" task: features ``user`` and ``movie``, label ``rating >= threshold``.

Accepted files (``path`` is the file, or a directory holding ``ratings.csv``, ``ratings.dat`` or ``u.data``,
looked for in that order):

* ``ratings.dat`` (ML-1M, ML-10M): ``UserID::MovieID::Rating::Timestamp`` per line, no header;
* ``ratings.csv`` (ML-latest, ML-20M/25M/32M): header ``userId,movieId,rating,timestamp``, then one rating
  per line;
* ``u.data`` (ML-100K): ``user id<TAB>item id<TAB>rating<TAB>timestamp`` per line, no header.

The format is taken from the first line (``::`` present: ``.dat``; else a tab: ``u.data``; else the CSV
header), whatever the file's name. Blank lines
are skipped; anything else malformed raises :class:`DataFormatError` with the file and line number.

Ids: users and movies are renumbered ``0..n-1`` in increasing order of their original id
(``user_ids[k]`` / ``movie_ids[k]`` give the original id of row ``k``); vocabularies cover both splits.

Split (deterministic): ``split="hash"`` puts rating ``i`` (0-based data row of the file) in eval when
``hash_uniform(i, seed) < eval_fraction``; ``split="time"`` puts the latest ``round(eval_fraction * n)``
ratings (by timestamp, then row) in eval. Train batches are shuffled per epoch (``seed``, ``epoch``); eval
batches follow the file order.

The whole file is held in memory (about 33 bytes per rating, more while parsing): a file that could not fit
(four times its size, see :func:`embedcore.memory_budget.check_fits`) or that is not a regular file (a
FIFO, a device) is refused before it is read. Error messages quote at most
:data:`~embedcore.app.data.batch.EXCERPT_CHARS` characters of a bad line. Parsing is vectorised
per chunk of lines (``np.loadtxt``); a chunk that does not parse cleanly is re-read line by line to report
the first bad line.
"""

from __future__ import annotations

import io
import math
import os
import stat

import numpy as np

from ...memory_budget import check_fits
from .batch import (Batch, DataFormatError, FeatureSpec, check_batch_size, check_fraction, check_split, eval_mask,
                    excerpt)

__all__ = ["MovieLens"]

_CSV_HEADER = ["userId", "movieId", "rating", "timestamp"]
_FILE_NAMES = ("ratings.csv", "ratings.dat", "u.data")
_FORMATS = ("the header 'userId,movieId,rating,timestamp' (ratings.csv), a 'user::movie::rating::timestamp' line "
            "(ratings.dat) or a tab-separated 'user, item, rating, timestamp' line (u.data)")
_CHUNK_LINES = 1 << 18
_COLUMNS = ("user id", "movie id", "rating", "timestamp")


def _find_file(path):
    if os.path.isdir(path):
        for name in _FILE_NAMES:
            candidate = os.path.join(path, name)
            if os.path.exists(candidate):
                return candidate
        raise FileNotFoundError(f"{path}: no ratings.csv, ratings.dat or u.data in this directory")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    return path


def _open_regular(path):
    """``path`` opened as UTF-8 text without blocking (a FIFO would block ``open``), if it is a regular file
    whose contents fit in memory."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DataFormatError(path, None, f"cannot open the file ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DataFormatError(path, None, "not a regular file (a FIFO, device or directory)")
        check_fits(4 * info.st_size, f"the ratings of {info.st_size:,} bytes, held in memory",
                   error=lambda m: DataFormatError(path, None, m))
        return os.fdopen(fd, encoding="utf-8", newline="")
    except BaseException:
        os.close(fd)
        raise


def _parse_line(text, delimiter, path, line):
    """``(user, movie, rating, timestamp)`` of one line, or :class:`DataFormatError`."""
    fields = text.rstrip("\r\n").split(delimiter)
    if len(fields) != 4:
        raise DataFormatError(path, line, f"expected 4 fields separated by {delimiter!r} (user, movie, rating, "
                                          f"timestamp), got {len(fields)}: {excerpt(text.rstrip())}")
    values = []
    for k, (field, column) in enumerate(zip(fields, _COLUMNS)):
        field = field.strip()
        try:
            value = float(field)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            kind = "a finite number" if k == 2 else "an integer"
            raise DataFormatError(path, line, f"{column} must be {kind}, got {excerpt(field)}")
        if k != 2:
            try:
                value = int(field)
            except ValueError:
                if value != math.floor(value):
                    raise DataFormatError(path, line, f"{column} must be an integer, got {excerpt(field)}") from None
                value = int(value)
        if k in (0, 1) and value < 0:
            raise DataFormatError(path, line, f"{column} must be >= 0, got {value}")
        if k != 2 and not -2 ** 63 <= value < 2 ** 63:
            raise DataFormatError(path, line, f"{column} {value} does not fit in 64 bits")
        values.append(value)
    return values


def _parse_chunk(lines, delimiter, path, first_line):
    """Parse ``lines`` (file line numbers from ``first_line``) into int64 users, movies, timestamps and
    float64 ratings. Fast path: ``np.loadtxt``; on any doubt, the exact line-by-line parser."""
    text = "".join(lines)
    # In a '::' or tab-separated file a ',' would read as a separator: such a chunk takes the line-by-line path.
    ok = delimiter == "," or "," not in text
    if ok:
        try:
            table = np.loadtxt(io.StringIO(text.replace(delimiter, ",")), delimiter=",", dtype=np.float64,
                               comments=None, ndmin=2, quotechar=None)
        except ValueError:
            ok = False
    if ok and table.shape[0]:
        ints = table[:, [0, 1, 3]] if table.shape[1] == 4 else table
        ok = bool(table.shape[1] == 4 and np.all(np.isfinite(table)) and np.all(ints == np.floor(ints))
                  and np.all(np.abs(ints) < 2 ** 53) and np.all(table[:, :2] >= 0))
    if ok and table.shape[0]:
        return table[:, 0].astype(np.int64), table[:, 1].astype(np.int64), table[:, 2], table[:, 3].astype(np.int64)
    rows = [_parse_line(line, delimiter, path, first_line + k) for k, line in enumerate(lines) if line.strip()]
    if not rows:
        return (np.zeros(0, np.int64),) * 2 + (np.zeros(0),) + (np.zeros(0, np.int64),)
    users, movies, ratings, times = zip(*rows)
    return (np.array(users, np.int64), np.array(movies, np.int64), np.array(ratings, np.float64),
            np.array(times, np.int64))


def read_ratings(path):
    """``(users, movies, ratings, timestamps, file)`` of a MovieLens ratings file or directory, original ids."""
    path = _find_file(os.fspath(path))
    parts = []
    with _open_regular(path) as f:
        first = f.readline(1 << 20)
        if not first.strip():
            raise DataFormatError(path, 1, f"the first line is empty: expected {_FORMATS}")
        if "::" in first:
            delimiter, pending, line_no = "::", [first], 1
        elif "\t" in first:
            delimiter, pending, line_no = "\t", [first], 1
        else:
            header = [h.strip() for h in first.rstrip("\r\n").split(",")]
            if header != _CSV_HEADER:
                raise DataFormatError(path, 1, f"expected {_FORMATS}, got {excerpt(first.rstrip())}")
            delimiter, pending, line_no = ",", [], 2
        while True:
            lines = pending + f.readlines(_CHUNK_LINES * 24)
            pending = []
            if not lines:
                break
            parts.append(_parse_chunk(lines, delimiter, path, line_no))
            line_no += len(lines)
    if not parts:
        return (np.zeros(0, np.int64),) * 2 + (np.zeros(0),) + (np.zeros(0, np.int64), path)
    return tuple(np.concatenate(column) for column in zip(*parts)) + (path,)


class MovieLens:
    """MovieLens ratings as click-like samples (see the module docstring).

    Args:
        path: a ``ratings.dat`` / ``ratings.csv`` / ``u.data`` file or a directory holding one.
        threshold: label = ``rating >= threshold``.
        eval_fraction: share of ratings in the eval split.
        seed: seeds the split hash and the shuffling of train batches.
        split: ``"hash"`` (by the row's index) or ``"time"`` (latest ratings in eval).
    """

    n_dense = 0

    def __init__(self, path, threshold=4.0, eval_fraction=0.1, seed=0, split="hash", name="movielens"):
        if split not in ("hash", "time"):
            raise ValueError(f"split must be 'hash' or 'time', got {split!r}")
        eval_fraction = check_fraction(eval_fraction)
        users, movies, ratings, times, self.path = read_ratings(path)
        if users.shape[0] == 0:
            raise DataFormatError(self.path, None, "no ratings in the file")
        self.name, self.seed, self.threshold = name, int(seed), float(threshold)
        self.user_ids, users = np.unique(users, return_inverse=True)
        self.movie_ids, movies = np.unique(movies, return_inverse=True)
        self.users, self.movies = users.astype(np.int32).reshape(-1), movies.astype(np.int32).reshape(-1)
        self.ratings, self.timestamps = ratings.astype(np.float32), times
        self.labels = (ratings >= self.threshold).astype(np.float32)
        n = users.shape[0]
        if split == "hash":
            self.is_eval = eval_mask(np.arange(n), self.seed, eval_fraction)
        else:
            n_eval = int(round(eval_fraction * n))
            order = np.lexsort((np.arange(n), times))
            self.is_eval = np.zeros(n, np.bool_)
            self.is_eval[order[n - n_eval:]] = True
        self._rows = {"train": np.flatnonzero(~self.is_eval), "eval": np.flatnonzero(self.is_eval)}
        self.features = [FeatureSpec("user", self.user_ids.shape[0]), FeatureSpec("movie", self.movie_ids.shape[0])]

    def n_samples(self, split="train") -> int:
        check_split(split)
        return int(self._rows[split].shape[0])

    def click_rate(self, split="train") -> float:
        check_split(split)
        rows = self._rows[split]
        return float(self.labels[rows].mean()) if rows.shape[0] else float("nan")

    def batches(self, batch_size, split="train", shuffle=None, epoch=0, ratings=False):
        """Batches of the split; ``shuffle`` (default: train only) permutes with ``(seed, epoch)``.
        ``ratings=True``: ``Batch.labels`` holds the ratings themselves (float32), for rating regression such
        as :class:`~embedcore.app.models.BiasedMF`, instead of ``rating >= threshold``."""
        check_batch_size(batch_size)
        check_split(split)
        rows = self._rows[split]
        if split == "train" if shuffle is None else shuffle:
            rows = rows[np.random.default_rng([self.seed, int(epoch)]).permutation(rows.shape[0])]
        return self._iterate(rows, batch_size, self.ratings if ratings else self.labels)

    def mean_rating(self, split="train") -> float:
        """The mean rating of the split (NaN when it is empty): a rating model's global offset."""
        check_split(split)
        rows = self._rows[split]
        return float(np.mean(self.ratings[rows], dtype=np.float64)) if rows.shape[0] else float("nan")

    def _iterate(self, rows, batch_size, targets):
        for start in range(0, rows.shape[0], batch_size):
            r = rows[start:start + batch_size]
            yield Batch(np.zeros((r.shape[0], 0), np.float32), {"user": self.users[r].astype(np.int64),
                                                                 "movie": self.movies[r].astype(np.int64)},
                        {"user": None, "movie": None}, targets[r])

    def __repr__(self):
        return (f"MovieLens({self.path!r}: {self.users.shape[0]} ratings, {self.features[0].vocabulary_size} users, "
                f"{self.features[1].vocabulary_size} movies, threshold={self.threshold})")
