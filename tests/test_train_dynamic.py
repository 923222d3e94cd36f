"""`embedcore train` with dynamic tables: the `[embedding.tables.X] dynamic = true` keys (validated, naming the
key and the value), the readers' 64-bit keys (a CSV log's hashed columns through `ec.hash_keys`, integer
columns as their 64-bit patterns), a run with admission and eviction that trains, evaluates, reports and
checkpoints, and its resumption, bit-identical to a run that never stopped."""

import json
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.app.cli import main
from embedcore.app.data import CsvClickLog, DataFormatError
from embedcore.app.run_config import DEFAULTS, ConfigError, build_dataset, check, merge
from embedcore.app.trainer import _build, run
from embedcore.checkpoint import read_extra

from .test_train import SMALL_DATA, write_toml

# SMALL_DATA's vocabularies: C1 50, C2 200 (bags of up to 3), C3 1000, C4 30 (static). Every capacity is at
# least a batch's distinct keys (a batch that needs more rows than the table has is refused); C3's is a third
# of its ids, so LRU evicts; C2's rows expire 4 steps unseen.
DYNAMIC = {"C3": {"dynamic": True, "capacity": 300, "admission": {"min_count": 2}, "eviction": "lru"},
           "C2": {"dynamic": True, "capacity": 200, "eviction": {"ttl": 4}, "optimizer": "sgd", "learning_rate": 0.1},
           "C1": {"dynamic": True, "capacity": 64, "eviction": "lfu"}}


def dynamic_config(tmp_path, tables=None, **train):
    return merge(DEFAULTS, {"data": SMALL_DATA,
                            "embedding": {"dim": 4, "optimizer": "adagrad", "learning_rate": 0.3,
                                          "tables": DYNAMIC if tables is None else tables},
                            "model": {"bottom": [8], "top": [8]},
                            "train": dict({"epochs": 2, "batch_size": 256, "output": str(tmp_path)}, **train)})


@pytest.mark.parametrize("spec, match", [
    ({"dynamic": "yes"}, r"embedding\.tables\.C3\.dynamic must be true or false, got 'yes'"),
    ({"dynamic": True}, r"embedding\.tables\.C3\.dynamic = true needs embedding\.tables\.C3\.capacity"),
    ({"dynamic": True, "capacity": 0}, r"embedding\.tables\.C3\.capacity must be an integer in \[1, 2147483647\], "
                                       r"got 0"),
    ({"dynamic": True, "capacity": 2 ** 31}, r"capacity must be an integer in \[1, 2147483647\], got 2147483648"),
    ({"capacity": 10}, r"embedding\.tables\.C3\.capacity \(= 10\) is for dynamic tables: set "
                       r"embedding\.tables\.C3\.dynamic = true"),
    ({"dynamic": False, "eviction": "lru"}, r"embedding\.tables\.C3\.eviction \(= 'lru'\) is for dynamic tables"),
    ({"dynamic": True, "capacity": 5, "admission": 3}, r"embedding\.tables\.C3\.admission must be a table such as "
                                                       r"\{min_count = 3\}.*got 3"),
    ({"dynamic": True, "capacity": 5, "admission": {"min_count": 0}},
     r"embedding\.tables\.C3\.admission\.min_count must be an integer in \[1, 4294967295\], got 0"),
    ({"dynamic": True, "capacity": 5, "admission": {"mincount": 2}}, r"unknown key\(s\) \['mincount'\]"),
    ({"dynamic": True, "capacity": 5, "eviction": "fifo"},
     r"embedding\.tables\.C3\.eviction must be \"lru\", \"lfu\" or \{ttl = steps\}, got 'fifo'"),
    ({"dynamic": True, "capacity": 5, "eviction": {"ttl": 0}},
     r"embedding\.tables\.C3\.eviction\.ttl must be an integer in \[1, 2147483647\], got 0"),
    ({"dynamic": True, "capacity": 5, "eviction": {"ttl": 3, "lru": 1}}, r"eviction must be .*got \{'ttl': 3"),
    ({"dynamic": True, "capacity": 5, "learning_rate": 0.1}, r"\[embedding\.tables\.C3\] needs an optimizer to take "
                                                            r"\['learning_rate'\].*'dynamic', 'capacity'"),
])
def test_dynamic_keys_are_validated_naming_the_key_and_value(tmp_path, spec, match):
    with pytest.raises(ConfigError, match=match):
        check(dynamic_config(tmp_path / "out", {"C3": spec}))
    assert not (tmp_path / "out").exists()


def test_the_keys_make_dynamic_tables_with_their_policies(tmp_path):
    dataset, emb, _ = _build(dynamic_config(tmp_path / "out"))
    c3, c2, c1 = (emb.tables[n] for n in ("C3", "C2", "C1"))
    assert isinstance(c3, ec.DynamicTableConfig) and c3.capacity == 300
    assert c3.admission == ec.CountAdmission(min_count=2) and c3.eviction == ec.LRU()
    assert c2.eviction == ec.TTL(4) and c2.admission is None and isinstance(c2.optimizer, ec.SGD)
    assert c1.eviction == ec.LFU() and c3.optimizer is None  # the engine's Adagrad
    assert type(emb.tables["C4"]) is ec.TableConfig
    assert not (tmp_path / "out").exists()


def test_a_run_with_dynamic_tables_trains_evaluates_reports_and_writes_a_checkpoint(tmp_path):
    lines = []
    metrics = run(dynamic_config(tmp_path / "out"), out=lines.append, progress_stream=open(os.devnull, "w"))
    on_disk = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert on_disk["final"] == metrics["final"] and metrics["steps"] == 2 * 12
    # 24 steps under admission and eviction learn little (the teacher's optimum is 0.78); what is checked is
    # that they learn at all: above chance by more than one standard error of a 1,000-row AUC (~0.02).
    assert metrics["final"]["auc"] > 0.52
    losses = metrics["train_loss_per_step"]
    assert np.mean(losses[-6:]) < np.mean(losses[:6])
    tables = metrics["storage"]["tables"]
    for name, spec in DYNAMIC.items():
        assert tables[name]["dynamic"] and tables[name]["capacity"] == spec["capacity"]
        assert 0 < tables[name]["keys"] <= spec["capacity"]
    assert tables["C3"]["keys"] == 300  # 1000 ids for 300 rows: full, LRU made room
    assert "checkpoint" not in metrics
    restored = ec.Embedding.restore(tmp_path / "out" / "checkpoint", allow_import=True)
    assert restored.step == 24
    for name, spec in DYNAMIC.items():
        assert len(restored.embedding_tables[name]) == tables[name]["keys"]
    assert any(line.endswith(f"; checkpoint in {tmp_path / 'out' / 'checkpoint'}") for line in lines)


def test_evaluation_changes_no_dynamic_table(tmp_path):
    """The trainer's eval lookups are read-only: after training steps, evaluating leaves every table's whole
    state as it was (and a fresh engine's dynamic tables empty), and gives what a second evaluation gives."""
    from embedcore.app.trainer import evaluate
    from .test_dynamic_eval_lookups import assert_same_state, whole_state
    dataset, emb, model = _build(dynamic_config(tmp_path / "out"))
    before = whole_state(emb)
    evaluate(dataset, emb, model, 256)
    assert_same_state(before, whole_state(emb))
    assert all(len(emb.embedding_tables[name]) == 0 for name in DYNAMIC)
    for batch in list(dataset.batches(256, "train"))[:3]:
        acts, ctx = emb.lookup(batch.ids, batch.weights)
        emb.apply_gradients({k: np.ones_like(a) for k, a in acts.items()}, ctx)
    before = whole_state(emb)
    first = evaluate(dataset, emb, model, 256)
    assert_same_state(before, whole_state(emb))
    assert evaluate(dataset, emb, model, 256) == first
    assert not (tmp_path / "out").exists()


def dynamic_state(emb):
    """Every dynamic table's whole state (keys, rows, slots, policy metadata, row slots, sketch) as arrays."""
    out = {}
    for t in emb.dynamic_tables.values():
        s = t.state()
        out.update({f"{t.name}/{k}": getattr(s, k) for k in ("keys", "weights", "last_seen", "counts", "rows",
                                                              "free", "sketch")})
        out.update({f"{t.name}/slot/{k}": v for k, v in s.slots.items()})
    return out


def test_resume_with_dynamic_tables_after_a_crash_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    """A run that dies in its second epoch resumes from its last step checkpoint (``checkpoint_every``) and
    ends bit-identical to one that never stopped: losses, metrics, every table's keys, rows, slots and policy
    state, and the dense model."""
    quiet = {"out": lambda s: None, "progress_stream": open(os.devnull, "w")}
    straight = run(dynamic_config(tmp_path / "a"), **quiet)
    import embedcore.app.trainer as trainer
    real = trainer.bce_with_logits
    calls = {"n": 0}

    def dies_at_step_18(logits, labels):
        calls["n"] += 1
        if calls["n"] == 18:
            raise KeyboardInterrupt("simulated crash")
        return real(logits, labels)

    monkeypatch.setattr(trainer, "bce_with_logits", dies_at_step_18)
    with pytest.raises(KeyboardInterrupt):
        run(dynamic_config(tmp_path / "b", checkpoint_every=5), **quiet)
    monkeypatch.setattr(trainer, "bce_with_logits", real)
    _, metadata = read_extra(tmp_path / "b" / "checkpoint")
    assert metadata["trainer"]["epoch"] == 1 and metadata["trainer"]["step_in_epoch"] == 3  # step 15
    resumed = run(dynamic_config(tmp_path / "b", checkpoint_every=5), resume=True, **quiet)
    assert resumed["train_loss_per_step"] == straight["train_loss_per_step"]
    assert resumed["final"] == straight["final"] and resumed["evaluations"] == straight["evaluations"]
    a = ec.Embedding.restore(tmp_path / "a" / "checkpoint", allow_import=True)
    b = ec.Embedding.restore(tmp_path / "b" / "checkpoint", allow_import=True)
    sa, sb = dynamic_state(a), dynamic_state(b)
    assert sa.keys() == sb.keys() and len(sa) > 3 * 7
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
    np.testing.assert_array_equal(a.embedding_tables["C4"], b.embedding_tables["C4"])
    xa, _ = read_extra(tmp_path / "a" / "checkpoint")
    xb, _ = read_extra(tmp_path / "b" / "checkpoint")
    assert xa.keys() == xb.keys()
    for name in xa:
        np.testing.assert_array_equal(xa[name], xb[name], err_msg=name)


# -- CSV logs: 64-bit keys -----------------------------------------------------------------------------------

LONG = "x" * 70  # longer than the packed path's width: hashed from a list of bytes


def test_csv_key_columns_hash_strings_with_hash_keys_and_read_integers_as_64_bit_patterns(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("label,I1,C1,C2,C3\n"
                    "1,0.5,alice| bob :0.5,-1,3\n"
                    f"0,1,,18446744073709551615|9223372036854775807,4\n"
                    f"1,2,  carol ,-9223372036854775808|+17,5\n"
                    f"0,3,{LONG}|alice,0,2\n")
    log = CsvClickLog(path, hash_buckets={"C1": 10}, key_columns=["C1", "C2"], eval_fraction=0.0)
    specs = {f.name: f for f in log.features}
    assert specs["C1"].vocabulary_size == specs["C2"].vocabulary_size == 2 ** 64
    assert specs["C3"].vocabulary_size == 6  # not a key column: rows as before
    batch = next(log.batches(10))
    c1, c2 = batch.ids["C1"], batch.ids["C2"]
    np.testing.assert_array_equal(c1.values, ec.hash_keys(["alice", "bob", "carol", LONG, "alice"]))
    np.testing.assert_array_equal(c1.row_splits, [0, 2, 2, 3, 5])
    np.testing.assert_array_equal(batch.weights["C1"].values, [1, 0.5, 1, 1, 1])
    np.testing.assert_array_equal(c2.values, np.array([-1, -1, 2 ** 63 - 1, -2 ** 63, 17, 0], np.int64))
    np.testing.assert_array_equal(batch.ids["C3"], [3, 4, 5, 2])


@pytest.mark.parametrize("cell", ["18446744073709551616", "-9223372036854775809", "alice", "1.5", "--3",
                                  "123456789012345678901"])
def test_csv_integer_keys_outside_64_bits_are_refused_naming_line_and_column(tmp_path, cell):
    path = tmp_path / "log.csv"
    path.write_text(f"label,C2\n1,5\n0,{cell}\n")
    with pytest.raises(DataFormatError, match=rf"log\.csv:3: column 'C2': id '{cell}' in cell '{cell}' is not an "
                                              rf"integer in \[-2\*\*63, 2\*\*64 - 1\]"):
        CsvClickLog(path, key_columns=["C2"])


def test_csv_key_columns_have_no_vocabulary(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("label,C1,C2\n1,5,6\n")
    with pytest.raises(ValueError, match=r"vocabulary_sizes names columns \['C1'\] whose ids are 64-bit keys"):
        CsvClickLog(path, vocabulary_sizes={"C1": 10}, key_columns=["C1"])
    with pytest.raises(ValueError, match=r"key_columns .* names columns that are not categorical: \['label'\]"):
        CsvClickLog(path, key_columns=["label"])


def test_train_cli_on_a_csv_file_with_string_and_64_bit_ids(tmp_path, capsys):
    """A dynamic table of user names (hashed) and one of 64-bit item ids far beyond any vocabulary: the users
    carry the signal; the tables hold at most their capacities."""
    rng = np.random.default_rng(0)
    rows = ["label,I1,C1,C2"]
    items = rng.integers(-2 ** 63, 2 ** 63 - 1, 40, dtype=np.int64)
    for _ in range(2000):
        user = int(rng.integers(0, 30))
        label = int(rng.random() < (0.85 if user < 10 else 0.15))
        rows.append(f"{label},{rng.random():.3f},user-{user},{items[rng.integers(0, 40)]}")
    (tmp_path / "log.csv").write_text("\n".join(rows) + "\n")
    cfg = {"data": {"kind": "csv", "path": "log.csv", "eval_fraction": 0.2, "hash_buckets": {"C1": 1000}},
           "embedding": {"dim": 8, "optimizer": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.001,
                         "tables": {"C1": {"dynamic": True, "capacity": 40, "eviction": "lfu"},
                                    "C2": {"dynamic": True, "capacity": 100, "admission": {"min_count": 2}}}},
           "model": {"bottom": [16], "top": [8], "dense_learning_rate": 0.01},
           "train": {"epochs": 2, "batch_size": 64, "output": "ignored"}}
    write_toml(tmp_path / "run.toml", cfg)
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--output", str(tmp_path / "out")]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["final"]["auc"] > 0.6
    tables = metrics["storage"]["tables"]
    assert tables["C1"]["keys"] == 30 and 0 < tables["C2"]["keys"] <= 40
    assert [f["vocabulary_size"] for f in metrics["dataset"]["features"]] == [2 ** 64, 2 ** 64]
    out = capsys.readouterr()
    assert "epoch 2:" in out.out, out.err
    dataset = build_dataset({"kind": "csv", "path": str(tmp_path / "log.csv"), "eval_fraction": 0.2,
                             "hash_buckets": {"C1": 1000}}, key_columns=["C1", "C2"])
    first = next(dataset.batches(4))
    assert set(first.ids["C1"].tolist()) <= set(ec.hash_keys([f"user-{u}" for u in range(30)]).tolist())
    assert set(first.ids["C2"].tolist()) <= set(items.tolist())


def test_the_memory_check_sizes_a_dynamic_table_by_its_capacity_and_key_map(monkeypatch):
    """A key column's key space is 2**64; its table takes capacity rows, slots, the key map and the admission
    sketch (``tables.dynamic.map_bytes``), and a refusal names the capacity key."""
    from embedcore.app.data import FeatureSpec
    from embedcore.app.trainer import _check_tables_fit
    from embedcore.tables.dynamic import map_bytes
    capacity, dim = 10 ** 6, 16
    table = ec.DynamicTableConfig(dim, capacity, name="C1", admission=ec.CountAdmission(min_count=2))
    need = capacity * dim * (4 + 4) + map_bytes(table)
    adagrad = {"C1": ec.Adagrad(0.1)}
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(need))
    _check_tables_fit([FeatureSpec("C1", 2 ** 64)], dim, adagrad, {"C1": table})
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(need - 1))
    with pytest.raises(ConfigError, match=rf"table 'C1', 1,000,000 rows from embedding\.tables\.C1\.capacity, "
                                          rf"{need:,} bytes"):
        _check_tables_fit([FeatureSpec("C1", 2 ** 64)], dim, adagrad, {"C1": table})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(integers=st.lists(st.integers(-2 ** 63, 2 ** 64 - 1), min_size=1, max_size=12),
       strings=st.lists(st.text(st.characters(blacklist_characters="|:,\r\n", blacklist_categories=("Cs",)),
                                min_size=1, max_size=90).filter(lambda t: t.strip(" \t")), min_size=1, max_size=12))
def test_csv_keys_are_the_integers_bit_patterns_and_the_strings_hash_keys(tmp_path, integers, strings):
    """Any 64-bit integer (either signedness, as written) reads as its bit pattern; any string (trimmed of spaces
    and tabs, as every field is) as ``hash_keys`` of it, whatever its length (both packing paths)."""
    n = max(len(integers), len(strings))
    cells = [(integers[k % len(integers)], strings[k % len(strings)]) for k in range(n)]
    path = tmp_path / "keys.csv"
    with open(path, "w", encoding="utf-8") as f:
        f.write("label,C1,C2\n" + "".join(f"{k % 2},{i},{s}\n" for k, (i, s) in enumerate(cells)))
    log = CsvClickLog(path, hash_buckets={"C2": 7}, key_columns=["C1", "C2"], eval_fraction=0.0)
    batch = next(log.batches(n))
    want = np.array([i - 2 ** 64 if i >= 2 ** 63 else i for i, _ in cells], np.int64)
    np.testing.assert_array_equal(batch.ids["C1"], want)
    np.testing.assert_array_equal(batch.ids["C2"], ec.hash_keys([s.strip(" \t") for _, s in cells]))


def test_demo_dynamic_variant_makes_the_tables_that_can_hold_a_batch_dynamic(tmp_path, capsys):
    from embedcore.app.cli import DEMO_VOCABULARY_SCALE
    from embedcore.app.data.synthetic import DEFAULT_MULTI_HOT, DEFAULT_VOCABULARY_SIZES
    assert main(["demo", "--train-samples", "2048", "--eval-samples", "512", "--epochs", "1", "--batch-size", "64",
                 "--dynamic", "0.5", "--output", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    scaled = [max(10, round(v * DEMO_VOCABULARY_SCALE)) for v in DEFAULT_VOCABULARY_SIZES]
    want = {f"C{k + 1}": -(-v // 2) for k, v in enumerate(scaled)
            if -(-v // 2) >= 64 * DEFAULT_MULTI_HOT.get(f"C{k + 1}", (1,))[0]}
    got = {name: t["capacity"] for name, t in metrics["storage"]["tables"].items() if t.get("dynamic")}
    assert got == want and len(want) > 3
    assert metrics["final"]["auc"] is not None and "dynamic tables at 0.5" in metrics["title"]
    assert "checkpoint in" in capsys.readouterr().out


@pytest.mark.parametrize("fraction, match", [("0", r"--dynamic must lie in \(0, 1\], got 0"),
                                             ("0.001", r"--dynamic 0\.001: no table's capacity")])
def test_demo_dynamic_variant_refuses_a_fraction_that_fits_nothing(tmp_path, capsys, fraction, match):
    assert main(["demo", "--dynamic", fraction, "--output", str(tmp_path / "out")]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_data_key_columns_may_name_only_dynamic_tables(tmp_path):
    (tmp_path / "log.csv").write_text("label,C1,C2\n1,5,6\n0,-7,8\n")
    data = {"kind": "csv", "path": str(tmp_path / "log.csv"), "eval_fraction": 0.0}
    tables = {"C1": {"dynamic": True, "capacity": 4}}
    config = merge(DEFAULTS, {"data": dict(data, key_columns=["C1", "C2"]), "embedding": {"tables": tables},
                              "train": {"output": str(tmp_path / "out")}})
    with pytest.raises(ConfigError, match=r"data\.key_columns names \['C2'\], whose tables are not dynamic"):
        _build(config)
    for given in (["C1"], None):  # naming a dynamic table's column, or not: the same key column
        spec = dict(data, key_columns=given) if given else data
        dataset, emb, _ = _build(merge(DEFAULTS, {"data": spec, "embedding": {"tables": tables},
                                                  "train": {"output": str(tmp_path / "out")}}))
        assert [f.vocabulary_size for f in dataset.features] == [2 ** 64, 9]
        np.testing.assert_array_equal(next(dataset.batches(2)).ids["C1"], [5, -7])
