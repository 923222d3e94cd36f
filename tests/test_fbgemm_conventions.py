"""FBGEMM's conventions (TorchRec users' defaults): ExactAdagrad (EXACT_ADAGRAD) and ExactRowwiseAdagrad
(EXACT_ROWWISE_ADAGRAD, weight-decay modes none / L2 / decoupled), accumulators from 0 and ``eps``, against a
NumPy reference of FBGEMM's math written from its definition (float64), rows the batch misses masked."""

import numpy as np
import pytest

import embedcore as ec
from embedcore.optimizers import ExactAdagrad, ExactRowwiseAdagrad

V, D, B, STEPS = 23, 8, 40, 4


def fbgemm_adagrad(w, acc, g, lr, eps):
    """EXACT_ADAGRAD per touched row: m += g^2; w -= lr * g / (sqrt(m) + eps)."""
    acc = acc + g * g
    return w - lr * g / (np.sqrt(acc) + eps), acc


def fbgemm_rowwise_adagrad(w, acc, g, lr, eps, wd, mode):
    """EXACT_ROWWISE_ADAGRAD per touched row (acc of shape [rows, 1]): the L2 mode adds wd * w to the gradient
    inside the mean square, and both weight-decay modes act through a correction factor on w."""
    g_decayed = g + wd * w if mode == "l2" else g
    acc = acc + np.mean(g_decayed * g_decayed, axis=1, keepdims=True)
    multiplier = lr / (np.sqrt(acc) + eps)
    correction = {"none": 1.0, "l2": 1.0 - multiplier * wd, "decoupled": 1.0 - lr * wd}[mode]
    return correction * w - multiplier * g, acc


def train(optimizer, reference, rng):
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(V, D, name="t", combiner="sum"))}, optimizer, seed=2)
    w = emb.embedding_tables["t"].astype(np.float64)
    slot = emb.slot_variables["t"]["accumulators"]
    assert not slot.any()  # FBGEMM's accumulators start at 0
    acc = np.zeros(slot.shape, np.float64).reshape(V, -1)
    for _ in range(STEPS):
        ids = rng.integers(0, V // 2, B)  # duplicates, and rows never touched
        grads = rng.standard_normal((B, D)).astype(np.float32)
        _, ctx = emb.lookup({"f": ids})
        emb.apply_gradients({"f": grads}, ctx)
        g = np.zeros((V, D))
        np.add.at(g, ids, grads.astype(np.float64))  # duplicates summed first, as FBGEMM does
        touched = np.unique(ids)
        w_new, acc_new = reference(w[touched], acc[touched], g[touched])
        w[touched], acc[touched] = w_new, acc_new
    np.testing.assert_allclose(emb.embedding_tables["t"], w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(emb.slot_variables["t"]["accumulators"].reshape(V, -1), acc, rtol=2e-5, atol=1e-7)
    untouched = np.arange(V // 2, V)
    assert not emb.slot_variables["t"]["accumulators"].reshape(V, -1)[untouched].any()
    return emb


def test_exact_adagrad_is_fbgemm_exact_adagrad():
    lr, eps = 0.05, 1e-3
    train(ExactAdagrad(lr, eps=eps), lambda w, a, g: fbgemm_adagrad(w, a, g, lr, eps), np.random.default_rng(0))


@pytest.mark.parametrize("mode", ["none", "l2", "decoupled"])
def test_exact_rowwise_adagrad_is_fbgemm_exact_rowwise_adagrad(mode):
    lr, eps, wd = 0.05, 1e-3, 0.1 if mode != "none" else 0.0
    train(ExactRowwiseAdagrad(lr, eps=eps, weight_decay=wd, weight_decay_mode=mode),
          lambda w, a, g: fbgemm_rowwise_adagrad(w, a, g, lr, eps, wd, mode), np.random.default_rng(1))


def test_defaults_are_fbgemm_tbe_defaults():
    a, r = ExactAdagrad(), ExactRowwiseAdagrad()
    assert (a.learning_rate, a.eps) == (0.01, 1e-8)
    assert (r.learning_rate, r.eps, r.weight_decay, r.weight_decay_mode) == (0.01, 1e-8, 0.0, "none")
    assert a.slot_initializers == r.slot_initializers == (0.0,)
    # The row-wise recipe runs split (one reduction, then in place): no allocation per row.
    assert "allocate nothing" in ExactRowwiseAdagrad(weight_decay=0.1, weight_decay_mode="l2").explain(8)
    assert "inlined" in ExactAdagrad().explain(8)


@pytest.mark.parametrize("make, match", [
    (lambda: ExactAdagrad(eps=0.0), "eps must be a positive float"),
    (lambda: ExactRowwiseAdagrad(eps=-1.0), "eps must be a positive float"),
    (lambda: ExactRowwiseAdagrad(weight_decay=-0.1), "weight_decay must be a float >= 0"),
    (lambda: ExactRowwiseAdagrad(weight_decay_mode="L2"), "weight_decay_mode must be one of"),
])
def test_bad_options_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_checkpoints_store_the_fbgemm_optimizers(tmp_path):
    emb = train(ExactRowwiseAdagrad(0.05, eps=1e-3, weight_decay=0.1, weight_decay_mode="decoupled"),
                lambda w, a, g: fbgemm_rowwise_adagrad(w, a, g, 0.05, 1e-3, 0.1, "decoupled"),
                np.random.default_rng(2))
    emb.save(tmp_path / "ckpt")
    again = ec.Embedding.restore(tmp_path / "ckpt")
    assert isinstance(again.optimizer, ExactRowwiseAdagrad) and again.optimizer == emb.optimizer
    np.testing.assert_array_equal(again.embedding_tables["t"], emb.embedding_tables["t"])
