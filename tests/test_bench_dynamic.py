"""Smoke tests of benchmarks/bench_dynamic.py and benchmarks/quality_dynamic.py at tiny sizes: they run, agree
with what they compare against, and report every figure (the figures themselves are not checked)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

import embedcore as ec

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_dynamic_tiny(tmp_path, capsys):
    bench = _script("bench_dynamic")
    out = tmp_path / "dyn.json"
    assert bench.main(["--tiny", "--threads", "1", "--json", str(out), "--evict-capacity", "40",
                       "--evict-vocab-factor", "20", "--ttl-steps", "1,1000"]) == 0
    result = json.loads(out.read_text())
    step = result["step"]
    assert step["agreement_max_abs_diff"] == 0.0
    assert step["ratio"] > 0 and set(step["median_ms"]) == {"static", "dynamic"}
    assert result["find"]["keys"] == 2 * 64 * 4 and result["find"]["median_ms"] > 0  # T x B x L of --tiny
    assert set(result["lookups"]) == {"1000", "5000"}
    assert all(rate > 0 for figures in result["lookups"].values() for rate in figures.values())
    eviction = result["eviction"]
    scored = ["EvictByScore(bench_dynamic.decayed_count, reserve=0.0)", "EvictByScore(bench_dynamic.decayed_count)"]
    assert set(eviction) == {"LRU()", "LFU()", "TTL(steps=1)", "TTL(steps=1000)", *scored}
    for policy in ("LRU()", "LFU()", "TTL(steps=1000)", *scored):  # at capacity, every timed step evicts
        assert eviction[policy]["keys_held_before"] == [40, 40] and eviction[policy]["evicted_per_step"] > 0
        assert eviction[policy]["expired_per_step"] == 0 and eviction[policy]["pick_victims_calls"] > 0
        assert eviction[policy]["slowest_step_ms"] >= eviction[policy]["step_ms"]
    assert eviction["TTL(steps=1)"]["expired_per_step"] > 0
    assert "ratio dynamic / static" in capsys.readouterr().out


def test_random_keys_distinct():
    bench = _script("bench_dynamic")
    keys = bench.random_keys(np.random.default_rng(0), 5000)
    assert keys.dtype == np.uint64 and np.unique(keys).shape[0] == 5000


def test_quality_dynamic_tiny(tmp_path):
    quality = _script("quality_dynamic")
    out = tmp_path / "q.json"
    assert quality.main(["--tiny", "--n-train", "1024", "--n-eval", "1024", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"hashed", "dynamic-lru", "dynamic-lfu"}
    assert 0.5 < result["optimum"]["auc"] <= 1.0
    hashed = sum(result["models"]["hashed"]["budgeted_bytes"])
    whole_row = quality.row_bytes(result["args"]["dim"]) * len(result["budgeted"])
    for kind, entry in result["models"].items():
        assert 0.0 <= entry["eval_auc"] <= 1.0 and entry["steps"] == 16
        rows, extra = entry["budgeted_bytes"]
        assert (extra > 0) == kind.startswith("dynamic")
        # --same-memory (the default): the hashed tables take the dynamic tables' bytes, less than a row a table
        assert hashed <= rows + extra < hashed + whole_row
    for entry in (result["models"]["dynamic-lru"], result["models"]["dynamic-lfu"]):
        assert all(held <= result["budgeted"][name][1] for name, held in entry["keys_held"].items())


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_quality_pooling_matches_the_engine(combiner):
    """The evaluation's pooling (rows read by id, without a lookup) equals the engine's lookup."""
    quality = _script("quality_dynamic")
    rng = np.random.default_rng(1)
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(50, 3, combiner=combiner, name="t"))}, ec.SGD(0.1))
    splits = np.array([0, 2, 2, 5, 9], np.int64)
    ids = ec.Ragged(rng.integers(0, 50, 9), splits)
    weights = ec.Ragged(rng.uniform(0.25, 2.0, 9).astype(np.float32), splits)
    acts, _ = emb.lookup({"f": ids}, {"f": weights})
    pooled = quality.pooled(emb.embedding_tables["t"], ids, weights, combiner)
    np.testing.assert_allclose(pooled, acts["f"], rtol=1e-5, atol=1e-6)


def test_hashed_ids_in_range_and_spread():
    quality = _script("quality_dynamic")
    buckets = quality.hashed_ids(np.arange(10_000), 100)
    assert buckets.min() >= 0 and buckets.max() < 100
    assert np.bincount(buckets, minlength=100).min() > 50  # a hash, not a pile-up


@pytest.mark.parametrize("ahead", [[], ["--no-ahead"]])
def test_first_eviction_tiny(capsys, ahead):
    bench = _script("first_eviction")
    assert bench.main(["--capacity", "2000", "--victims", "7", "--steps", "3", "--rounds", "1"] + ahead) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["LRU()", "LFU()"]
    assert all(line.count(",") == 2 for line in lines)  # three steps' choosing times each
