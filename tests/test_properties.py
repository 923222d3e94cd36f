"""Property tests: random vocabularies, widths, batches and id distributions against the oracle."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec

from . import reference as ref
from .harness import as_input

OPTIMIZERS = {
    "sgd": (lambda: ec.SGD(0.3), ref.sgd, {}, 0.3),
    "adagrad": (lambda: ec.Adagrad(0.2), ref.adagrad, {}, 0.2),
    "rowwise": (lambda: ec.RowwiseAdagrad(0.2), ref.rowwise_adagrad, {}, 0.2),
}


@st.composite
def batches(draw):
    vocab = draw(st.integers(1, 60))
    batch_size = draw(st.integers(0, 12))
    hot = draw(st.booleans())  # all ids from a tiny hot set: many duplicates
    id_strategy = st.integers(0, min(vocab - 1, 2)) if hot else st.integers(0, vocab - 1)
    samples = draw(st.lists(st.lists(id_strategy, max_size=6), min_size=batch_size, max_size=batch_size))
    weights = draw(st.one_of(st.none(), st.just([[draw(st.floats(0.1, 3.0)) for _ in s] for s in samples])))
    return vocab, samples, weights


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches(), dim=st.integers(1, 9), combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
       seq_len=st.sampled_from([0, 0, 1, 3]), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       form=st.sampled_from(["lists", "ragged", "sparse"]), stack=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_one_step_matches_oracle(data, dim, combiner, seq_len, optimizer, form, stack, seed):
    vocab, samples, weights = data
    make, update, params, lr = OPTIMIZERS[optimizer]
    table = ec.TableConfig(vocab, dim, combiner=combiner, name="t", initializer=ec.RandomUniform(-1, 1, seed=seed))
    other = ec.TableConfig(3, dim, name="other")
    emb = ec.Embedding({"f": ec.FeatureConfig(table, max_sequence_length=seq_len), "g": ec.FeatureConfig(other)},
                       make(), stack_tables=stack)
    w = weights if weights is not None else [[1.0] * len(s) for s in samples]
    ids, wts = as_input(samples, weights, form)
    before = emb.embedding_tables["t"].astype(np.float64)
    slots = [s.astype(np.float64) for s in emb.slot_variables["t"].values()]
    other_before = emb.embedding_tables["other"].copy()
    acts, ctx = emb({"f": ids, "g": np.zeros((0,), np.int64)}, None if weights is None else
                    {"f": wts, "g": np.zeros((0,), np.float32)})
    np.testing.assert_allclose(acts["f"], ref.lookup(before, samples, w, combiner, seq_len), rtol=1e-5, atol=1e-5)
    grad = np.random.default_rng(seed).normal(size=acts["f"].shape).astype(np.float32)
    emb.apply_gradients({"f": grad, "g": np.zeros((0, dim), np.float32)}, ctx)
    dense = ref.dense_gradient(vocab, dim, samples, w, combiner, seq_len, grad.astype(np.float64))
    touched = ref.touched_rows(vocab, samples, seq_len)
    expected, expected_slots = ref.apply(update, dense, before, slots, touched, lr, params, 1)
    np.testing.assert_allclose(emb.embedding_tables["t"], expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(emb.slot_variables["t"].values(), expected_slots):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(emb.embedding_tables["other"], other_before)
