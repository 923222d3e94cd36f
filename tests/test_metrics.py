"""Metrics against brute-force definitions: pairwise AUC with ties, the log-loss formula, streaming."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from embedcore.app.metrics import BinaryMetrics, auc, log_loss


def brute_auc(labels, scores):
    """P(score of a positive > score of a negative), ties 1/2, over all pairs."""
    pos = [s for y, s in zip(labels, scores) if y == 1]
    neg = [s for y, s in zip(labels, scores) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def direct_log_loss(labels, probs, eps=1e-7):
    total = 0.0
    for y, p in zip(labels, probs):
        p = min(max(p, eps), 1 - eps)
        total += -math.log(p) if y == 1 else -math.log(1 - p)
    return total / len(labels)


samples = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=60)


@settings(max_examples=60, deadline=None)
@given(samples)
def test_auc_matches_brute_force_with_ties(pairs):
    labels = [y for y, _ in pairs]
    scores = [s / 6.0 for _, s in pairs]          # few distinct values: many ties
    assume(0 < sum(labels) < len(labels))
    assert auc(labels, scores) == pytest.approx(brute_auc(labels, scores), abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(-1e6, 1e6)), min_size=2, max_size=50))
def test_auc_matches_brute_force_on_real_scores_and_is_rank_invariant(pairs):
    labels = np.array([y for y, _ in pairs])
    scores = np.array([s for _, s in pairs])
    assume(0 < labels.sum() < labels.size)
    value = auc(labels, scores)
    assert value == pytest.approx(brute_auc(labels.astype(int), scores), abs=1e-12)
    dense_ranks = np.unique(scores, return_inverse=True)[1].reshape(-1)
    assert auc(labels, dense_ranks * 3 + 1) == pytest.approx(value, abs=1e-12)   # only the order matters
    assert auc(labels, -scores) == pytest.approx(1.0 - value, abs=1e-12)


def test_auc_fixed_cases():
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert auc([0, 1, 1], [0.2, 0.2, 0.9]) == 0.75
    assert auc(np.array([False, True]), np.array([1, 2], np.int32)) == 1.0


def test_auc_is_exact_for_many_samples():
    rng = np.random.default_rng(0)
    n = 200_000
    labels = rng.random(n) < 0.3
    scores = rng.integers(0, 50, n) + labels * rng.integers(0, 3, n)
    pos, neg = scores[labels], scores[~labels]
    # Exact count through the score histogram: wins + ties / 2.
    h_neg = np.bincount(neg, minlength=60)
    below = np.concatenate(([0], np.cumsum(h_neg)))[:-1]
    expected = (below[pos].sum() + 0.5 * h_neg[pos].sum()) / (pos.size * neg.size)
    assert auc(labels, scores) == pytest.approx(expected, abs=1e-13)


@pytest.mark.parametrize("labels,scores,match", [
    ([1, 1, 1], [0.1, 0.2, 0.3], "only one class"),
    ([0, 0], [0.1, 0.2], "only one class"),
    ([], [], "only one class"),
    ([0, 1], [0.1, float("nan")], "finite"),
    ([0, 1, 1], [0.1, 0.2], "differ in length"),
    ([0, 2], [0.1, 0.2], "0 or 1"),
    (["a", "b"], [0.1, 0.2], "numbers"),
])
def test_auc_errors(labels, scores, match):
    with pytest.raises(ValueError, match=match):
        auc(labels, scores)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(0.0, 1.0)), min_size=1, max_size=40))
def test_log_loss_matches_the_formula(pairs):
    labels = [y for y, _ in pairs]
    probs = [p for _, p in pairs]
    assert log_loss(labels, probs) == pytest.approx(direct_log_loss(labels, probs), rel=1e-12, abs=1e-12)


def test_log_loss_clips_and_validates():
    assert log_loss([1, 0], [1.0, 0.0]) == pytest.approx(-math.log(1 - 1e-7))
    assert log_loss([1], [0.0], eps=1e-3) == pytest.approx(-math.log(1e-3))
    assert log_loss([1, 0], [0.5, 0.5]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss([1], [1.5])
    with pytest.raises(ValueError, match="empty"):
        log_loss([], [])
    with pytest.raises(ValueError, match="finite"):
        log_loss([1], [float("inf")])
    with pytest.raises(ValueError, match="differ in length"):
        log_loss([1, 0], [0.5])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 10)), min_size=2, max_size=80),
       st.lists(st.integers(1, 20), min_size=1, max_size=10))
def test_binary_metrics_streaming_equals_one_shot(pairs, cuts):
    labels = np.array([y for y, _ in pairs], np.float32)
    probs = np.array([s / 10 for _, s in pairs])
    assume(0 < labels.sum() < labels.size)
    m = BinaryMetrics()
    start = 0
    for size in itertools.cycle(cuts):
        if start >= labels.size:
            break
        m.update(labels[start:start + size], probs[start:start + size])
        start += size
    result = m.result()
    assert result["n"] == labels.size
    assert result["auc"] == pytest.approx(auc(labels, probs), abs=1e-12)
    assert result["log_loss"] == pytest.approx(log_loss(labels, probs), rel=1e-12)
    assert result["click_rate"] == pytest.approx(labels.mean())
    assert m.result() == result                     # result() can be asked again


def test_binary_metrics_errors_and_reset():
    m = BinaryMetrics()
    with pytest.raises(ValueError, match="before any update"):
        m.result()
    m.update([1, 1], [0.2, 0.3])
    with pytest.raises(ValueError, match="only one class"):
        m.result()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        m.update([1], [2.0])
    m.update([0], [0.1]).update([], [])
    assert m.result()["auc"] == 1.0 and m.n == 3
    m.reset()
    assert m.n == 0
