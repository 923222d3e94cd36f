"""The thread-safety contract: updates, saves and loads never interleave; lookups may run concurrently."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import embedcore as ec


def make():
    table = ec.TableConfig(50, 4, name="t", combiner="sum", initializer=ec.RowId())
    return ec.Embedding({"f": ec.FeatureConfig(table)}, ec.Adagrad(0.1))


def batch(seed):
    return {"f": np.random.default_rng(seed).integers(0, 50, (8, 3))}


def grads(acts, seed):
    return {"f": np.random.default_rng(100 + seed).standard_normal(acts["f"].shape).astype(np.float32)}


def test_a_second_updater_is_refused_without_changing_anything(tmp_path, monkeypatch):
    emb = make()
    acts_a, ctx_a = emb(batch(1))
    acts_b, ctx_b = emb(batch(2))
    inside, release = threading.Event(), threading.Event()
    real_apply = ec.Embedding._apply

    def slow_apply(self, gradients, ctx):
        if ctx is ctx_a:
            inside.set()
            assert release.wait(30)
        return real_apply(self, gradients, ctx)

    monkeypatch.setattr(ec.Embedding, "_apply", slow_apply)
    worker = threading.Thread(target=emb.apply_gradients, args=(grads(acts_a, 1), ctx_a))
    worker.start()
    assert inside.wait(30)
    before = emb.embedding_tables["t"].copy()
    for attempt in (lambda: emb.apply_gradients(grads(acts_b, 2), ctx_b), lambda: emb.save(tmp_path / "c"),
                    lambda: emb.load(tmp_path / "c")):
        with pytest.raises(RuntimeError, match="another thread is using this Embedding"):
            attempt()
    np.testing.assert_array_equal(emb.embedding_tables["t"], before)
    assert not (tmp_path / "c").exists()
    release.set()
    worker.join(30)
    assert emb.step == 1 and not ctx_b.consumed
    emb.apply_gradients(grads(acts_b, 2), ctx_b)  # the refused update can still be applied, afterwards

    serial = make()
    for seed in (1, 2):
        acts, ctx = serial(batch(seed))
        serial.apply_gradients(grads(acts, seed), ctx)
    np.testing.assert_array_equal(emb.embedding_tables["t"], serial.embedding_tables["t"])
    np.testing.assert_array_equal(emb.slot_variables["t"]["accumulators"], serial.slot_variables["t"]["accumulators"])


def test_concurrent_lookups_equal_serial_lookups():
    emb = make()
    acts, ctx = emb(batch(0))
    emb.apply_gradients(grads(acts, 0), ctx)
    expected = [emb(batch(s))[0]["f"] for s in range(32)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: emb(batch(s))[0]["f"], range(32)))
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(e, g)
