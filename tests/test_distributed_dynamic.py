"""Dynamic tables in a ShardedEmbedding (mpiexec -n 1..3) against one process fed the concatenated batches:
equal tables and activations while nothing is evicted; under eviction, every rank within its capacity and
holding only its own keys; refusals (a full table, bad keys, a stale context) the same on every rank with
nothing changed; checkpoints that move between world sizes and one process."""

import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.distributed.dynamic import key_owners, rank_capacity

pytest.importorskip("mpi4py", reason="needs the mpi extra: pip install 'embedcore[mpi]' (.ci/run installs it)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import mpi_dynamic  # noqa: E402
from tests.test_distributed import mpirun  # noqa: E402

WORLDS = [1, 2, 3]


def test_placement_is_a_stable_hash_of_the_key():
    keys = np.array([0, 1, -1, 2 ** 62 + 7, -2 ** 63, 12345678901], np.int64)
    owners = key_owners(keys, 3)
    assert owners.dtype == np.int64 and ((owners >= 0) & (owners < 3)).all()
    np.testing.assert_array_equal(key_owners(keys.view(np.uint64), 3), owners)  # bits, not the dtype
    np.testing.assert_array_equal(key_owners(keys, 1), 0)
    # Keys spread over the ranks (a hash, not the low bits): consecutive keys land everywhere.
    counts = np.bincount(key_owners(np.arange(3000, dtype=np.int64), 3), minlength=3)
    assert counts.min() > 900
    assert [[rank_capacity(10, k, r) for r in range(k)] for k in (1, 2, 3, 4)] == [[10], [5, 5], [4, 3, 3],
                                                                                 [3, 3, 2, 2]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2 ** 63, 2 ** 64 - 1), max_size=40), st.integers(1, 5), st.integers(1, 3))
def test_requests_leave_for_their_owners_in_key_order(values, world, n_tables):
    """The flat key message (:meth:`DynamicShards.request`'s layout) against a plain Python model: peer-major,
    then table-major, keys increasing within a part; counts are occurrences."""
    from embedcore.distributed.dynamic import DynamicShards
    from embedcore.inputs import to_feature_batch
    from embedcore.tuning import DEFAULT_TUNING

    class Table:
        def __init__(self, dim):
            self.dim = dim
    keys = np.array([v % 2 ** 64 for v in values], np.uint64).view(np.int64)  # every bit pattern
    per_table = [keys[d::n_tables] for d in range(n_tables)]
    parts = [[(to_feature_batch(k, None, f"f{d}", 10, check_range=False), "sum", 0, 0, 0, 10)] for d, k in
             enumerate(per_table)]
    shards = DynamicShards([None] * n_tables, [Table(d + 1) for d in range(n_tables)], 0, world, 0, DEFAULT_TUNING)
    route, send = shards.request(parts)
    expected = []
    for peer in range(world):
        for d, k in enumerate(per_table):
            distinct = sorted(set(k.view(np.uint64).tolist()))
            expected += [(key, int((k.view(np.uint64) == key).sum())) for key in distinct
                         if key_owners(np.array([key], np.uint64), world)[0] == peer]
    assert [(int(key), int(count)) for key, count in zip(send[:, 0].view(np.uint64), send[:, 1])] == expected
    assert route.to.sum() == len(expected)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    runs = {}

    def run(mode, world):
        if (mode, world) not in runs:
            out = tmp_path_factory.mktemp(f"{mode}{world}") / "out.npz"
            proc = mpirun(world, "mpi_dynamic.py", mode, out, timeout=600)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
            assert proc.stdout.strip().splitlines()[-1] == "ok"
            runs[mode, world] = out
        return runs[mode, world]
    return run


def rank_positions(t, world):
    """Where each rank's samples of step ``t`` sit in the concatenated batch the reference was fed."""
    parts = mpi_dynamic.assignment(t, world)
    starts = np.cumsum([0] + [p.shape[0] for p in parts])
    return [np.arange(starts[k], starts[k + 1]) for k in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_without_eviction_k_ranks_equal_one_process(jobs, world):
    out = jobs("equal", world)
    emb, acts = mpi_dynamic.reference(world)
    exact = world == 1
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    ranks = [np.load(f"{out}.rank{k}.npz") for k in range(world)]
    for t in range(mpi_dynamic.STEPS):
        for k, positions in enumerate(rank_positions(t, world)):
            for name, whole in acts[t].items():
                np.testing.assert_allclose(ranks[k][f"s{t}/{name}"], whole[positions],
                                           err_msg=f"step {t} rank {k} {name}",
                                           **(tolerance if t else {"rtol": 0, "atol": 0}))
    tables = np.load(out)
    for name in ("users", "items"):
        view = emb.embedding_tables[name]
        keys = view.keys()
        assert len(keys) > 5  # the batches brought many keys (and admission held some back: below)
        np.testing.assert_array_equal(tables[f"{name}/keys"], keys, err_msg=name)
        np.testing.assert_allclose(tables[f"{name}/weights"], view[keys], err_msg=name, **tolerance)
        for slot, values in emb.slot_variables[name].items():
            np.testing.assert_allclose(tables[f"{name}/{slot}"], values[keys], err_msg=f"{name}/{slot}",
                                       **tolerance)
        owners = key_owners(keys, world)
        for k in range(world):  # each rank holds exactly the keys it owns, at most ceil(capacity / K)
            held = ranks[k][f"held/{name}"]
            np.testing.assert_array_equal(held, keys[owners == k], err_msg=f"{name} rank {k}")
            assert len(held) <= rank_capacity(emb.tables[name].capacity, world, k)
        # What LRU, LFU and TTL read is the same too: each key's last-seen step and count.
        policy = mpi_dynamic.policy_metadata(emb, name)
        merged = np.concatenate([ranks[k][f"policy/{name}"] for k in range(world)])
        np.testing.assert_array_equal(merged[np.argsort(merged[:, 0])], policy, err_msg=name)
    np.testing.assert_allclose(tables["tags/weights"], emb.embedding_tables["tags"], **tolerance)
    # Admission: each rank's sketch counts its own keys exactly as the one process's does (wide sketches).
    sketch = emb.dynamic_tables["users"].sketch
    for k in range(world):
        np.testing.assert_array_equal(ranks[k]["sketch/estimates"], sketch.estimate(ranks[k]["sketch/keys"]))
    users = emb.embedding_tables["users"]
    assert [key for key in np.unique(mpi_dynamic.global_batch(0)[0]["user"]) if key not in users]  # not admitted
    looked_up = {key for t in range(mpi_dynamic.STEPS) for name in ("items", "recent")
                 for bag in mpi_dynamic.global_batch(t)[0][name] for key in bag[:3 if name == "recent" else None]}
    assert len(emb.embedding_tables["items"]) < len(looked_up) <= emb.tables["items"].capacity  # TTL expired some


@pytest.mark.parametrize("world", WORLDS)
def test_under_eviction_every_rank_keeps_to_its_own_keys_and_capacity(jobs, world):
    out = jobs("evict", world)
    records = [json.load(open(f"{out}.rank{k}.json")) for k in range(world)]
    config, _ = mpi_dynamic.config("evict")
    evicted = 0
    for name in ("users", "items"):
        total = config["user" if name == "users" else "items"].table.capacity
        capacity = [rank_capacity(total, world, k) for k in range(world)]
        assert sum(capacity) == total
        for k, record in enumerate(records):
            assert record["capacity"][name] == capacity[k]
        for t in range(len(records[0]["steps"])):
            steps = [r["steps"][t] for r in records]
            assert len({s["refused"] for s in steps}) == 1
            used = {key for s in steps for key in s["used"][name]}
            held_now = [np.array(s["held"][name], np.int64) for s in steps]
            for k, held in enumerate(held_now):
                assert len(held) <= capacity[k]
                assert (key_owners(held, world) == k).all()
            if steps[0]["refused"] is None:  # the batch's keys all hold rows (no admission here)
                assert used <= {int(x) for h in held_now for x in h}
            if t:
                before = {int(x) for r in records for x in r["steps"][t - 1]["held"][name]}
                evicted += len(before - {int(x) for h in held_now for x in h})
    assert evicted > 0  # eviction did happen
    assert any(s["refused"] is None for s in records[0]["steps"])


@pytest.mark.parametrize("world", WORLDS)
def test_refusals_agree_on_every_rank_and_change_nothing(jobs, world):
    jobs("errors", world)  # the worker checks, on every rank, the messages and that nothing changed


def assert_same_engines(a, b, exact):
    """Two single-process engines hold the same tables: keys, rows, slots, policy metadata, sketch counters
    (rows and slots bit for bit, or to float32 summation order)."""
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for name in ("users", "items"):
        view, other = a.embedding_tables[name], b.embedding_tables[name]
        keys = view.keys()
        np.testing.assert_array_equal(other.keys(), keys, err_msg=name)
        np.testing.assert_allclose(other[keys], view[keys], err_msg=name, **tolerance)
        for slot, values in a.slot_variables[name].items():
            np.testing.assert_allclose(b.slot_variables[name][slot][keys], values[keys], err_msg=f"{name}/{slot}",
                                       **tolerance)
        np.testing.assert_array_equal(mpi_dynamic.policy_metadata(b, name), mpi_dynamic.policy_metadata(a, name))
    sketches = [e.dynamic_tables["users"].sketch.counters for e in (a, b)]
    np.testing.assert_array_equal(sketches[1], sketches[0])  # the ranks' counts add up to one process's
    np.testing.assert_allclose(b.embedding_tables["tags"], a.embedding_tables["tags"], **tolerance)
    assert a.step == b.step


def assert_same_npz(a, b):
    a, b = np.load(a), np.load(b)
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def reshard(world, out, stop, ckpt, resume=None):
    proc = mpirun(world, "mpi_dynamic.py", "reshard", out, stop, ckpt, *([resume] if resume else []), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_sharded_checkpoints_of_dynamic_tables_reshard_2_to_3_to_1(tmp_path):
    reshard(2, tmp_path / "a.npz", 2, tmp_path / "ckpt_a")
    reshard(3, tmp_path / "b.npz", 4, tmp_path / "ckpt_b", tmp_path / "ckpt_a")
    assert_same_npz(tmp_path / "a.npz", tmp_path / "b.npz.loaded.npz")  # 3 ranks loaded what 2 saved
    # Each checkpoint is one process's: restored in one, it holds what one process fed the same batches holds.
    for ckpt, worlds in (("ckpt_a", (2, 2)), ("ckpt_b", (2, 2, 3, 3))):
        reference, _ = mpi_dynamic.reference(worlds, stop=len(worlds))
        assert_same_engines(reference, ec.Embedding.restore(tmp_path / ckpt), exact=False)


def test_a_single_process_checkpoint_loads_on_two_ranks_and_back(tmp_path):
    reference, _ = mpi_dynamic.reference(1, stop=2)
    reference.save(tmp_path / "one")
    reshard(2, tmp_path / "two.npz", 2, tmp_path / "back", tmp_path / "one")
    loaded = np.load(tmp_path / "two.npz.loaded.npz")
    for name in ("users", "items"):
        keys = reference.embedding_tables[name].keys()
        np.testing.assert_array_equal(loaded[f"{name}/keys"], keys)
        np.testing.assert_array_equal(loaded[f"{name}/weights"], reference.embedding_tables[name][keys])
    assert_same_engines(reference, ec.Embedding.restore(tmp_path / "back"), exact=True)
