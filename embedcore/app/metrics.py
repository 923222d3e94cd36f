"""Binary classification metrics: log loss and exact ROC AUC, one-shot and streaming.

* ``log_loss(y, p) = -mean(y log p + (1 - y) log(1 - p))`` with ``p`` clipped to ``[eps, 1 - eps]``,
  computed in float64.
* ``auc(y, s)`` is the probability that a random positive scores above a random negative, a tie counting
  1/2: ``(R+ - n+ (n+ + 1) / 2) / (n+ n-)`` where ``R+`` is the sum over positives of their rank among all
  scores, tied scores sharing the mean of their ranks (Mann-Whitney U). One sort, O(n log n); the rank sum
  is accumulated exactly in integers (twice the mean rank is an integer).
"""

from __future__ import annotations

import numpy as np

__all__ = ["log_loss", "auc", "BinaryMetrics"]


def _labels(labels, n=None) -> np.ndarray:
    y = np.asarray(labels).reshape(-1)
    if n is not None and y.shape[0] != n:
        raise ValueError(f"labels and predictions differ in length: {y.shape[0]} and {n}")
    if y.dtype == np.bool_:
        return y
    if y.dtype.kind not in "iuf":
        raise ValueError(f"labels must be numbers 0/1 or booleans, got dtype {y.dtype}")
    is_one = y == 1
    valid = is_one | (y == 0)
    if not np.all(valid):
        raise ValueError(f"labels must be 0 or 1, got {y[~valid][0]!r}")
    return is_one


def _scores(scores, what) -> np.ndarray:
    s = np.asarray(scores)
    if s.dtype.kind not in "iufb":
        raise ValueError(f"{what} must be numbers, got dtype {s.dtype}")
    s = s.reshape(-1).astype(np.float64, copy=False)
    if s.shape[0] and not np.all(np.isfinite(s)):
        bad = s[~np.isfinite(s)][0]
        raise ValueError(f"{what} must be finite, got {bad}")
    return s


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of ``probs`` (in ``[0, 1]``, clipped to ``[eps, 1 - eps]``) for 0/1 labels."""
    p = _scores(probs, "probabilities")
    y = _labels(labels, p.shape[0])
    if p.shape[0] == 0:
        raise ValueError("log_loss of an empty set of samples")
    if p.min() < 0.0 or p.max() > 1.0:
        raise ValueError(f"probabilities must lie in [0, 1], got values in [{p.min()}, {p.max()}]")
    return float(np.mean(_losses(y, p, eps)))


def _losses(y: np.ndarray, p: np.ndarray, eps: float) -> np.ndarray:
    p = np.clip(p, eps, 1.0 - eps)
    return -np.where(y, np.log(p), np.log1p(-p))


def auc(labels, scores) -> float:
    """Exact ROC AUC (ties count 1/2). Raises ``ValueError`` unless both classes are present."""
    s = _scores(scores, "scores")
    y = _labels(labels, s.shape[0])
    n = s.shape[0]
    n_pos = int(np.count_nonzero(y))
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC is undefined with only one class present ({n_pos} positives, {n_neg} negatives "
                         f"among {n} samples)")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # Tie groups [first, last] in 1-based rank; twice the mean rank of a group is first + last.
    new_group = np.concatenate(([True], sorted_s[1:] != sorted_s[:-1]))
    starts = np.flatnonzero(new_group)
    ends = np.concatenate((starts[1:], [n])) - 1
    group = np.cumsum(new_group) - 1
    twice_rank = (starts + ends + 2)[group]               # int64, per sorted position
    r2_pos = int(twice_rank[y[order]].sum())
    u2 = r2_pos - n_pos * (n_pos + 1)                     # twice the Mann-Whitney U of the positives
    return u2 / (2.0 * n_pos * n_neg)


class BinaryMetrics:
    """Streaming, exact log loss and AUC over many batches.

    ``update(labels, probs)`` adds a batch; ``result()`` returns ``{"log_loss", "auc", "n", "click_rate"}``
    over everything added. ``result()`` raises ``ValueError`` before any sample and while only one class has
    been seen (AUC is undefined); ``result(allow_undefined=True)`` instead reports what is undefined as NaN:
    the AUC with one class, every metric but ``n == 0`` with no samples. The metrics are
    exact and do not depend on how the samples were split into batches: the scores are kept, 9 bytes per
    sample (a float64 score and a bool label), e.g. 90 MB for 10M samples.
    """

    def __init__(self, eps: float = 1e-7):
        self.eps = eps
        self.reset()

    def reset(self):
        self._labels, self._scores = [], []
        self._n = 0
        self._n_pos = 0

    def update(self, labels, probs):
        p = _scores(probs, "probabilities")
        y = _labels(labels, p.shape[0])
        if p.shape[0] == 0:
            return self
        if p.min() < 0.0 or p.max() > 1.0:
            raise ValueError(f"probabilities must lie in [0, 1], got values in [{p.min()}, {p.max()}]")
        self._labels.append(np.array(y, np.bool_))
        self._scores.append(np.array(p, np.float64))
        self._n += p.shape[0]
        self._n_pos += int(np.count_nonzero(y))
        return self

    @property
    def n(self) -> int:
        return self._n

    def result(self, allow_undefined: bool = False) -> dict:
        nan = float("nan")
        if self._n == 0:
            if allow_undefined:
                return {"log_loss": nan, "auc": nan, "n": 0, "click_rate": nan}
            raise ValueError("BinaryMetrics.result() before any update")
        y, s = np.concatenate(self._labels), np.concatenate(self._scores)
        self._labels, self._scores = [y], [s]
        one_class = self._n_pos in (0, self._n)
        return {"log_loss": float(np.mean(_losses(y, s, self.eps))),
                "auc": nan if one_class and allow_undefined else auc(y, s), "n": self._n,
                "click_rate": self._n_pos / self._n}
