"""Checkpoints against hostile files and concurrent saves: every refusal is a CheckpointError and changes nothing.

Each test names the class of defect it guards (issue 24): a manifest validated whole before the engine
changes (malformed fields, crafted steps, hash-matching garbage), NaN/Inf tables refused at load, a
checkpoint that can only make embedcore classes be called, directories whose files block, never end or are
not files, declared sizes beyond the files and the machine, and readers racing a save in another process.
"""

import hashlib
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot, read_extra
from embedcore.checkpoint.tensor_file import open_tensors, read_header, write_tensors
from embedcore.app.quickstart import custom_sgd

from .harness import assert_unchanged, rewrite_manifest, snapshot

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# CI runs the manifest mutator derandomized; EMBEDCORE_MANIFEST_EXAMPLES=2000 EMBEDCORE_MANIFEST_RANDOM=1 explores.
EXAMPLES = int(float(os.environ.get("EMBEDCORE_MANIFEST_EXAMPLES") or 30))
DERANDOMIZE = not os.environ.get("EMBEDCORE_MANIFEST_RANDOM")


# 16-bit storage for make_engine (issue 28): bfloat16 rows with float16 accumulators, float16 rows to nearest.
HALF = {"a": dict(weights_dtype="bfloat16", slot_dtype="float16"),
        "b": dict(weights_dtype="float16", stochastic_rounding=False)}
EXPORT_DTYPES = ("int8", "float16", "bfloat16", "float32")


def make_engine(seed=3, storage=None):
    """Two small tables: Adagrad (one slot) and a custom SGD named by import path (for allow_import);
    ``storage``: per table, TableConfig's dtype arguments (:data:`HALF`)."""
    storage = storage or {}
    a = ec.TableConfig(20, 4, name="a", combiner="sum", **storage.get("a", {}))
    b = ec.TableConfig(12, 4, name="b", optimizer=ec.CustomOptimizer(custom_sgd, 0.1), **storage.get("b", {}))
    features = {"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b, max_sequence_length=2)}
    return ec.Embedding(features, ec.Adagrad(0.1), seed=seed)






@pytest.fixture(scope="module")
def source():
    emb = make_engine(seed=3)
    emb.step = 5  # as if trained: the target's step (0) and tables (seed 4) differ from the checkpoint's
    return emb


@pytest.fixture(scope="module")
def target():
    """An engine of the same configuration but other tables (another seed) and step 0: a load that changed
    anything before failing would show."""
    return make_engine(seed=4)


@pytest.fixture()
def saved(tmp_path, source):
    path = tmp_path / "c"
    source.save(path, extra={"x": np.arange(3.0)}, metadata={"epoch": 1})
    return path


def edit_manifest(path, edit):
    """Replace the manifest by ``edit(manifest dict)`` (a dict, or text as is) and re-sign it in CURRENT."""
    def rewrite(text):
        out = edit(json.loads(text))
        return out if isinstance(out, str) else json.dumps(out)
    rewrite_manifest(path, rewrite)


def refused_everywhere(path, target, match, serving=True):
    """load (strict and not), restore and serving all raise CheckpointError matching ``match``; the target
    engine is unchanged."""
    before = snapshot(target)
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=match):
            target.load(path, strict=strict)
        assert_unchanged(target, before)
    with pytest.raises(CheckpointError, match=match):
        ec.Embedding.restore(path, allow_import=True)
    if serving:
        with pytest.raises(CheckpointError, match=match):
            ec.ServingEmbedding(path)


# -- items 3, 9: the step, and the whole manifest checked before anything changes --------------------------

@pytest.mark.parametrize("step", [None, "3", 1.5, 3.0, -1, 10 ** 30, 2 ** 63, True, math.inf, -math.inf, math.nan,
                                  [2], {"n": 2}])
def test_a_crafted_step_is_refused_before_anything_changes(saved, target, step):
    def edit(m):
        m["step"] = step
        return json.dumps(m)  # allow_nan: Infinity and NaN as Python writes them
    edit_manifest(saved, edit)
    refused_everywhere(saved, target, r"step must be a step count \(an integer from 0 to 9223372036854775807\)")


def test_a_valid_step_at_the_limit_loads(saved, target, source):
    edit_manifest(saved, lambda m: dict(m, step=2 ** 63 - 1))
    target.load(saved)
    assert target.step == 2 ** 63 - 1
    expected = snapshot(source)
    assert_unchanged(target, expected[:2] + (2 ** 63 - 1,))


# -- item 13: malformed manifests whose hash matches -------------------------------------------------------

def _drop(*keys):
    def edit(m):
        node = m
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]
        return m
    return edit


def _set(value, *keys):
    def edit(m):
        node = m
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        return json.dumps(m)
    return edit


MALFORMED = {
    "not JSON": (lambda m: "{not json", "is not JSON"),
    "a JSON list": (lambda m: [m], "not an embedcore checkpoint"),
    "nested 100,000 deep": (lambda m: "[" * 100_000 + "]" * 100_000, "is not JSON|not an embedcore"),
    "no tables": (_drop("tables"), "has no 'tables'"),
    "no config": (_drop("config"), "has no 'config'"),
    "no files": (_drop("files"), "has no 'files'"),
    "no seed": (_drop("config", "seed"), r"config must be an object with the keys"),
    "no shard rows": (_drop("tables", "a", "shards", 0, "rows"), "do not partition"),
    "no dim": (_drop("tables", "a", "dim"), r"table 'a'.dim must be"),
    "tables a list": (_set([], "tables"), "tables must be an object of tables"),
    "files a string": (_set("x", "files"), "files must be an object of files"),
    "unknown non_finite": (_set("maybe", "config", "non_finite"), r"config.non_finite must be one of"),
    "seed Infinity": (_set(math.inf, "config", "seed"), r"config.seed must be an integer"),
    "seed fractional": (_set(1.5, "config", "seed"), r"config.seed must be an integer"),
    "dim a string": (_set("4", "config", "tables", 0, "dim"), r"config table 'a'.dim must be an integer"),
    "vocabulary null": (_set(None, "tables", "b", "vocabulary_size"), r"table 'b'.vocabulary_size must be"),
    "stride zero": (_set(0, "tables", "a", "shards", 0, "stride"), "do not partition"),
    "slot names not a list": (_set("accumulators", "tables", "a", "slots"), r"table 'a'.slots must be"),
    "features garbage": (_set({"what": 1}, "config", "features"), r"config.features must be an object with one key"),
    "feature of no table": (_set("zzz", "config", "features", "dict", 0, 1, "feature", "table"),
                            r"must be one of the configured tables"),
    "optimizer args a list": (_set([], "config", "optimizer", "args"), r"config.optimizer.args must be a JSON object"),
    "sha256 not hex": (_set("zz", "files", "table-0000.safetensors", "weights", "sha256"), "must be 64 hex digits"),
    "shape negative": (_set([-1, 4], "files", "table-0000.safetensors", "weights", "shape"), "shape must be made of"),
    "dtype unknown": (_set("float128", "files", "table-0000.safetensors", "weights", "dtype"), "dtype must be one of"),
    "extra not listed": (_set("nope.safetensors", "extra"), "extra must be null or one of the files"),
    "version true": (_set(True, "version"), "format version True"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_with_a_matching_hash_is_a_checkpoint_error(saved, target, case):
    edit, match = MALFORMED[case]
    edit_manifest(saved, edit)
    refused_everywhere(saved, target, match)
    with pytest.raises(CheckpointError, match=match):
        read_extra(saved)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


_JSON = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, -1, 2, 2 ** 63, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.sampled_from(["Adagrad", "SGD", "sum", "raise", "skip", "weights", "float32", "table-0000.safetensors",
                     "os:system", "subprocess:Popen", "embedcore.app.quickstart:custom_adagrad"]),
    st.just([]), st.just({}), st.lists(st.integers(-3, 30), max_size=3),
    st.dictionaries(st.sampled_from(["tuple", "function", "optimizer", "args", "feature", "x"]),
                    st.integers(0, 3), max_size=2))


def _mutate(manifest, data):
    """One random drop, replacement or retyping somewhere in ``manifest`` (a dict), in place; returns it."""
    paths = sorted(_paths(manifest), key=lambda p: [str(k) for k in p])
    where = data.draw(st.sampled_from(paths), label="path")
    action = data.draw(st.sampled_from(["drop", "replace", "retype"]), label="action")
    if not where:
        return data.draw(_JSON, label="root")
    parent = manifest
    for k in where[:-1]:
        parent = parent[k]
    key, old = where[-1], parent[where[-1]]
    if action == "drop":
        del parent[key]
    elif action == "replace":
        parent[key] = data.draw(_JSON, label="value")
    else:
        parent[key] = data.draw(st.sampled_from([str(old), [old], {"x": old}, None if old is not None else 0]),
                                label="retyped")
    return manifest


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, source):
    path = tmp_path_factory.mktemp("pristine") / "c"
    source.save(path, extra={"x": np.arange(3.0)}, metadata={"epoch": 1})
    return path


@pytest.fixture(scope="module")
def half_source():
    emb = make_engine(seed=3, storage=HALF)
    emb.step = 5
    return emb


@pytest.fixture(scope="module")
def half_target():
    return make_engine(seed=4, storage=HALF)


@pytest.fixture(scope="module")
def half_pristine(tmp_path_factory, half_source):
    path = tmp_path_factory.mktemp("half_pristine") / "c"
    half_source.save(path, extra={"x": np.arange(3.0)}, metadata={"epoch": 1})
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory, pristine, half_pristine):
    """``{name: path}``: serving exports of the float32 checkpoint in every dtype, and of the 16-bit one."""
    root = tmp_path_factory.mktemp("exports")
    out = {dtype: root / dtype for dtype in EXPORT_DTYPES}
    for dtype, path in out.items():
        ec.export_for_serving(pristine, path, dtype=dtype)
    out["int8 of 16-bit"] = root / "int8-of-half"
    ec.export_for_serving(half_pristine, out["int8 of 16-bit"], dtype="int8")
    return out


def _mutated_copy(pristine, scratch, data):
    """A copy of ``pristine`` whose manifest had 1-3 random mutations, re-signed (read through CURRENT, so a
    serving export too); returns (path, the mutated manifest)."""
    path = os.path.join(scratch, "c")
    shutil.copytree(pristine, path)
    with open(os.path.join(path, "CURRENT")) as f:
        snapshot_dir = os.path.join(path, json.load(f)["snapshot"])
    manifest = os.path.join(snapshot_dir, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        m = _mutate(m, data) if isinstance(m, dict) else m
    text = json.dumps(m)
    with open(manifest, "w") as f:
        f.write(text)
    with open(os.path.join(path, "CURRENT"), "w") as f:
        f.write(json.dumps({"snapshot": os.path.basename(snapshot_dir),
                            "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}))
    return path, m


MUTATOR_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
                            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@MUTATOR_SETTINGS
@given(data=st.data())
def test_mutated_manifests_give_a_checkpoint_error_or_load_and_change_nothing_when_refused(pristine, target,
                                                                                              source, data):
    """Any mutation of a valid manifest, re-signed so that the hash chain holds, either loads or raises
    CheckpointError (never KeyError, TypeError, OverflowError, ...); a refused load changes nothing."""
    _check_mutated(pristine, target, source, data)


@MUTATOR_SETTINGS
@given(data=st.data())
def test_mutated_16_bit_manifests_give_a_checkpoint_error_or_load_and_change_nothing_when_refused(
        half_pristine, half_target, half_source, data):
    """The same for a checkpoint of bfloat16 and float16 tables with float16 slots (dtypes in the manifest,
    the files' BF16/F16 tensors, the stored configuration's weights_dtype, slot_dtype, stochastic_rounding)."""
    _check_mutated(half_pristine, half_target, half_source, data)


def _check_mutated(pristine, target, source, data):
    scratch = tempfile.mkdtemp(prefix="mutated-")
    try:
        path, mutated = _mutated_copy(pristine, scratch, data)
        holder = {"m": mutated}
        for strict in (True, False):
            before = snapshot(target)
            try:
                target.load(path, strict=strict)
            except CheckpointError:
                assert_unchanged(target, before)
            else:
                assert target.step == holder["m"]["step"]
                assert_unchanged(target, snapshot(source)[:2] + (target.step,))
        for attempt in (lambda: ec.Embedding.restore(path, allow_import=True), lambda: ec.ServingEmbedding(path),
                        lambda: read_extra(path), lambda: open_snapshot(path)):
            try:
                attempt()
            except CheckpointError:
                pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("kind", ["int8", "bfloat16", "int8 of 16-bit"])
@MUTATOR_SETTINGS
@given(data=st.data())
def test_mutated_serving_export_manifests_give_a_checkpoint_error_or_serve_the_same_tables(exports, target, kind,
                                                                                           data):
    """A serving export's manifest mutated and re-signed: ServingEmbedding serves the export's own tables bit
    for bit or raises CheckpointError; training readers raise CheckpointError (or, for a mutation that made
    it a training checkpoint they accept, load it), never another exception; a refused load changes nothing."""
    original = {n: np.array(t) for n, t in ec.ServingEmbedding(exports[kind]).embedding_tables.items()}
    scratch = tempfile.mkdtemp(prefix="mutated-export-")
    try:
        path, _ = _mutated_copy(exports[kind], scratch, data)
        try:
            server = ec.ServingEmbedding(path)
        except CheckpointError:
            pass
        else:
            for name, table in server.embedding_tables.items():
                assert np.asarray(table).tobytes() == original[name].tobytes(), name
        before = snapshot(target)
        for attempt in (lambda: target.load(path), lambda: target.load(path, strict=False, convert_dtypes=True)):
            try:
                attempt()
            except CheckpointError:
                assert_unchanged(target, before)
        for attempt in (lambda: ec.Embedding.restore(path, allow_import=True), lambda: read_extra(path),
                        lambda: open_snapshot(path), lambda: open_snapshot(path, serving=True)):
            try:
                attempt()
            except CheckpointError:
                pass
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _export_files(path):
    with open(os.path.join(path, "CURRENT")) as f:
        snap = os.path.join(path, json.load(f)["snapshot"])
    return [os.path.join(path, "CURRENT")] + sorted(os.path.join(snap, n) for n in os.listdir(snap))


@pytest.mark.parametrize("kind", EXPORT_DTYPES + ("int8 of 16-bit",))
def test_corrupt_and_truncated_serving_exports_are_refused_or_serve_the_same_tables(exports, target, tmp_path,
                                                                                    kind):
    """Every file of an export (CURRENT, manifest, each table's file) with one byte flipped at 12 places or cut
    at 6 lengths: ServingEmbedding raises CheckpointError (a flip in a tensor file's informational
    ``__metadata__`` may serve the same tables), training readers raise CheckpointError and change nothing."""
    original = {n: np.array(t) for n, t in ec.ServingEmbedding(exports[kind]).embedding_tables.items()}
    rng = np.random.default_rng(len(kind))
    before = snapshot(target)
    outcomes = {"refused": 0, "served the same": 0}
    for index, name in enumerate(_export_files(exports[kind])):
        size = os.path.getsize(name)
        damages = [("flip", int(at)) for at in rng.integers(0, size, 12)] + \
            [("cut", int(n)) for n in sorted({0, 1, size // 2, size - 1, *rng.integers(0, size, 2).tolist()})]
        for how, at in damages:
            path = tmp_path / f"e{index}-{how}-{at}"
            shutil.copytree(exports[kind], path)
            victim = str(path / os.path.relpath(name, exports[kind]))
            raw = bytearray(open(victim, "rb").read())
            if how == "flip":
                raw[at] ^= 0x5A
            else:
                raw = raw[:at]
            open(victim, "wb").write(raw)
            try:
                server = ec.ServingEmbedding(path)
            except CheckpointError:
                outcomes["refused"] += 1
            else:
                assert how == "flip" and victim.endswith(".safetensors"), (how, at, victim)
                for t, table in server.embedding_tables.items():
                    assert np.asarray(table).tobytes() == original[t].tobytes(), (how, at, victim)
                outcomes["served the same"] += 1
            for strict in (True, False):
                with pytest.raises(CheckpointError):
                    target.load(path, strict=strict)
            with pytest.raises(CheckpointError):
                ec.Embedding.restore(path)
            assert_unchanged(target, before)
            shutil.rmtree(path)
    assert outcomes["refused"] > 0
    print(f"\n{kind} export: {outcomes}")


@pytest.mark.parametrize("kind", EXPORT_DTYPES + ("int8 of 16-bit",))
def test_a_serving_export_is_refused_by_every_training_reader(exports, target, half_target, kind):
    for engine in (target, half_target):
        before = snapshot(engine)
        for strict in (True, False):
            for convert in (False, True):
                with pytest.raises(CheckpointError, match="serving export"):
                    engine.load(exports[kind], strict=strict, convert_dtypes=convert)
        assert_unchanged(engine, before)
    for call in (lambda: ec.Embedding.restore(exports[kind], allow_import=True), lambda: read_extra(exports[kind]),
                 lambda: open_snapshot(exports[kind])):
        with pytest.raises(CheckpointError, match="serving export"):
            call()


# -- item 4: NaN/Inf in a checkpoint's tables and slots ----------------------------------------------------

def rewrite_tensor(path, table, key, edit):
    """Edit one tensor of a checkpoint (``edit(array)`` in place) and re-sign file, manifest and CURRENT."""
    snap = open_snapshot(path)
    file_name = snap.manifest["tables"][table]["shards"][0]["file"]
    full = os.path.join(snap.dir, file_name)
    arrays = {k: np.array(v) for k, v in open_tensors(full).items()}
    _, metadata, _ = read_header(full)
    edit(arrays[key])
    digests = write_tensors(full, arrays, metadata)

    def resign(m):
        for k, digest in digests.items():
            m["files"][file_name][k]["sha256"] = digest
        return m
    edit_manifest(path, resign)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("table, key, shown", [("a", "weights", "weights"),
                                               ("a", "slot/accumulators", "slot 'accumulators'")])
def test_non_finite_tables_and_slots_are_refused_naming_table_and_slot(saved, target, value, table, key, shown):
    def poison(array):
        array[3, 1] = value
        array[17, 0] = value
    rewrite_tensor(saved, table, key, poison)
    match = rf"table '{table}' {shown} holds NaN or Inf in 2 row\(s\), e.g. rows \[3, 17\]"
    refused_everywhere(saved, target, match, serving=key == "weights")
    if key != "weights":
        ec.ServingEmbedding(saved)  # serving never reads slots


def test_finite_values_whose_sum_overflows_still_load(saved, target, source):
    """The fast check sums the values; a sum that overflows float32 from finite values is not refused."""
    rewrite_tensor(saved, "a", "weights", lambda array: array.__setitem__(slice(None), 3e38))
    target.load(saved)
    assert (target.embedding_tables["a"] == np.float32(3e38)).all()


# -- item 6: a checkpoint can only make embedcore classes be called --------------------------------------

def _hostile_entries(marker):
    command = f"touch {marker}"
    argv = ["touch", marker]
    as_class = lambda name, args: {"optimizer": name, "args": args}  # noqa: E731
    return {
        "os:system as optimizer class": ("b", as_class("os:system", {"command": command})),
        "builtins:eval as optimizer class": ("b", as_class("builtins:eval", {"source": f"open({marker!r}, 'w')"})),
        "subprocess:run as optimizer class": ("b", as_class("subprocess:run", {"args": argv})),
        "subprocess:Popen (not embedcore's) as optimizer class": ("b", as_class("subprocess:Popen", {"args": argv})),
        "subprocess:Popen as initializer class": ("init", {"initializer": "subprocess:Popen", "args": {"args": argv}}),
        "os:system as row function": ("fn", {"function": "os:system", "repr": "system"}),
        "builtins:eval as row function": ("fn", {"function": "builtins:eval", "repr": "eval"}),
        "subprocess:Popen as row function": ("fn", {"function": "subprocess:Popen", "repr": "Popen"}),
        "subprocess:run as row function": ("fn", {"function": "subprocess:run", "repr": "run"}),
        "subprocess:run as learning rate": ("lr", {"function": "subprocess:run", "repr": "run"}),
    }


@pytest.mark.parametrize("case", sorted(_hostile_entries("m")))
def test_restore_with_allow_import_calls_nothing_but_embedcore_classes(saved, tmp_path, case):
    marker = str(tmp_path / "marker")
    where, entry = _hostile_entries(marker)[case]

    def edit(m):
        tables = {t["name"]: t for t in m["config"]["tables"]}
        if where == "b":
            tables["b"]["optimizer"] = entry
        elif where == "init":
            tables["a"]["initializer"] = entry
        elif where == "fn":
            tables["b"]["optimizer"]["args"]["custom_computation"] = entry
        else:
            tables["b"]["optimizer"]["args"]["learning_rate"] = entry
        return m
    edit_manifest(saved, edit)
    if case == "subprocess:run as learning rate":
        # A plain function may be a learning-rate callable: imported, never called while restoring.
        emb = ec.Embedding.restore(saved, allow_import=True)
        assert emb.tables["b"].optimizer.learning_rate is subprocess.run
    elif case == "subprocess:run as row function":
        # A plain function may be a row function: imported, compiled (which fails here), never called.
        with pytest.raises(CheckpointError, match="subprocess.run could not be compiled"):
            ec.Embedding.restore(saved, allow_import=True)
    else:
        shown = "table 'b' optimizer" if where in ("b", "fn") else "table 'a' initializer"
        with pytest.raises(CheckpointError, match=rf"{shown}.*('os:system'|'builtins:eval'|'subprocess:\w+')"):
            ec.Embedding.restore(saved, allow_import=True)
    assert not os.path.exists(marker), "a checkpoint made code run"


def test_an_optimizer_subclass_of_the_users_own_is_still_restored(tmp_path):
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 4, name="t"))}, MyAdagrad(0.3))
    emb.save(tmp_path / "c")
    back = ec.Embedding.restore(tmp_path / "c", allow_import=True)
    assert type(back.optimizer) is MyAdagrad


class MyAdagrad(ec.Adagrad):
    """A user's optimizer class, stored by import path."""


# -- item 7: directories whose files block, never end, or are not files -----------------------------------

_HOSTILE_CHILD = textwrap.dedent("""
    import json, sys, time
    import embedcore as ec
    from embedcore.checkpoint import CheckpointError, open_snapshot
    good, cases = sys.argv[1], json.loads(sys.argv[2])
    target = ec.Embedding.restore(good, allow_import=True)
    for name, path in cases:
        print(json.dumps({"start": name}), flush=True)
        for what, call in (("open_snapshot", lambda: open_snapshot(path)), ("load", lambda: target.load(path)),
                           ("restore", lambda: ec.Embedding.restore(path, allow_import=True)),
                           ("serving", lambda: ec.ServingEmbedding(path))):
            t = time.perf_counter()
            try:
                call()
                outcome = "loaded"
            except CheckpointError as e:
                outcome = "CheckpointError: " + str(e)
            except BaseException as e:
                outcome = type(e).__name__ + ": " + str(e)
            print(json.dumps({"case": name, "call": what, "outcome": outcome[:300],
                              "ms": 1000 * (time.perf_counter() - t)}), flush=True)
    print(json.dumps({"done": True}), flush=True)
""")


def _limit_memory():
    limit = 3 * 2 ** 30  # a regression that reads /dev/zero without limit fails here instead of filling the machine
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def test_hostile_directories_never_block_nor_read_without_limit(tmp_path, source):
    good = tmp_path / "good"
    source.save(good)
    snap = open_snapshot(good)
    table_file = snap.manifest["tables"]["a"]["shards"][0]["file"]
    cases = []

    def case(name, replace):
        path = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, path)
        replace(str(path), os.path.join(str(path), snap.name))
        cases.append((name, str(path)))

    def swap(target_of, make):
        def replace(path, snapshot):
            victim = target_of(path, snapshot)
            if os.path.isdir(victim):
                shutil.rmtree(victim)
            else:
                os.remove(victim)
            make(victim)
        return replace

    current = lambda p, s: os.path.join(p, "CURRENT")  # noqa: E731
    manifest = lambda p, s: os.path.join(s, "manifest.json")  # noqa: E731
    tensor = lambda p, s: os.path.join(s, table_file)  # noqa: E731
    for label, where in (("CURRENT", current), ("manifest", manifest), ("tensor file", tensor)):
        case(f"{label} is a FIFO", swap(where, os.mkfifo))
        case(f"{label} links to /dev/zero", swap(where, lambda v: os.symlink("/dev/zero", v)))
        case(f"{label} is a directory", swap(where, os.mkdir))
    case("CURRENT is 10 GB", swap(current, lambda v: os.truncate(open(v, "wb").name, 10 ** 10)))
    case("manifest is 10 GB", swap(manifest, lambda v: os.truncate(open(v, "wb").name, 10 ** 10)))

    proc = subprocess.Popen([sys.executable, "-c", _HOSTILE_CHILD, str(good), json.dumps(cases)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_limit_memory)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        started = [json.loads(x)["start"] for x in out.splitlines() if '"start"' in x]
        pytest.fail(f"reading a hostile checkpoint hung: {started[-1] if started else 'before the first case'}")
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines and lines[-1] == {"done": True}, err[-3000:]
    results = [x for x in lines if "case" in x]
    assert len(results) == 4 * len(cases)
    slowest = max(results, key=lambda x: x["ms"])
    print(f"\nhostile directories: {len(results)} refusals, slowest {slowest['ms']:.1f} ms "
          f"({slowest['case']}, {slowest['call']})")
    for r in results:
        assert r["outcome"].startswith("CheckpointError: "), r
        assert r["ms"] < 10_000, r


def test_read_capped_refuses_what_grows_and_what_is_not_regular(tmp_path):
    from embedcore.checkpoint.tensor_file import TensorFileError, read_capped
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_capped(str(tmp_path / "f"), 100) == b"x" * 100
    with pytest.raises(TensorFileError, match="100 bytes; at most 99"):
        read_capped(str(tmp_path / "f"), 99)
    os.mkfifo(tmp_path / "fifo")
    t = time.perf_counter()
    with pytest.raises(TensorFileError, match="is a FIFO, not a regular file"):
        read_capped(str(tmp_path / "fifo"), 10)
    assert time.perf_counter() - t < 1
    os.symlink("/dev/zero", tmp_path / "zero")
    with pytest.raises(TensorFileError, match="is a symbolic link"):
        read_capped(str(tmp_path / "zero"), 10)


# -- item 8: declared sizes checked against the files and the machine before allocating -------------------

def _declare_rows(rows):
    """A manifest edit declaring table 'a' of ``rows`` rows everywhere it appears, consistently."""
    def edit(m):
        for t in m["config"]["tables"]:
            if t["name"] == "a":
                t["vocabulary_size"] = rows
        entry = m["tables"]["a"]
        entry["vocabulary_size"] = rows
        entry["shards"][0]["rows"] = rows
        for tensor in m["files"][entry["shards"][0]["file"]].values():
            tensor["shape"][0] = rows
        return m
    return edit


def test_a_manifest_declaring_more_rows_than_its_files_hold_is_refused_before_allocating(saved, target):
    edit_manifest(saved, _declare_rows(10 ** 12))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    refused_everywhere(saved, target, r"table-0000.safetensors is [0-9,]+ bytes; the manifest declares tensors "
                                      r"of 32,000,000,000,000 bytes")
    seconds = time.perf_counter() - t
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    print(f"\n10^12-row manifest refused by load x2, restore and serving in {seconds * 1000:.1f} ms, "
          f"peak RSS +{grown / 1024:.1f} MB")
    assert grown < 100 * 1024


def test_tables_beyond_the_machines_memory_are_refused_before_allocating(saved, target, monkeypatch):
    """Files as large as declared (sparse): the memory check refuses restore before a byte is allocated."""
    rows = 2 ** 26  # 1 GiB of weights and 1 GiB of accumulators, as sparse files
    snap = open_snapshot(saved)
    with open(os.path.join(snap.dir, snap.manifest["tables"]["a"]["shards"][0]["file"]), "r+b") as f:
        f.truncate(2 * rows * 4 * 4 + 4096)
    edit_manifest(saved, _declare_rows(rows))
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(2 ** 30))
    with pytest.raises(CheckpointError, match=r"restoring .* would take 2.0 GiB .* more than the 1.0 GiB"):
        ec.Embedding.restore(saved, allow_import=True)


# -- item 10: readers racing saves of another process ------------------------------------------------------

_SAVER = textwrap.dedent("""
    import sys
    import embedcore as ec
    path, first = sys.argv[1], int(sys.argv[2])
    tables = [ec.TableConfig(64, 8, name=f"t{i}") for i in range(4)]
    emb = ec.Embedding({f"f{i}": ec.FeatureConfig(t) for i, t in enumerate(tables)}, ec.SGD(0.1))
    k = first
    while True:
        for t in emb.embedding_tables.values():
            t[...] = k
        emb.step = k
        emb.save(path, metadata={"k": k})
        print(k, flush=True)
        k += 1
""")


def _saver_engine():
    tables = [ec.TableConfig(64, 8, name=f"t{i}") for i in range(4)]
    return ec.Embedding({f"f{i}": ec.FeatureConfig(t) for i, t in enumerate(tables)}, ec.SGD(0.1))


def test_readers_racing_another_process_saving_see_one_whole_checkpoint(tmp_path, monkeypatch):
    """A process saves in a loop (the tables all equal to the step); servers, loads, restores and read_extra
    opened meanwhile never report corruption and always hold one committed checkpoint, whole."""
    from embedcore.checkpoint import store
    path = str(tmp_path / "c")
    emb = _saver_engine()
    emb.save(path, metadata={"k": 0})
    retries = []
    moved_on = getattr(store, "_moved_on", None)
    if moved_on is not None:  # counts the reads that started again on a newer CURRENT (for the figure)
        monkeypatch.setattr(store, "_moved_on", lambda p, n: retries.append(moved_on(p, n)) or retries[-1])
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, path, "1"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    opened = {"serving": 0, "load": 0, "restore": 0, "read_extra": 0}
    try:
        assert saver.stdout.readline().strip() == "1"  # the saver is running
        deadline, n = time.monotonic() + 20, 0
        while n < 400 and time.monotonic() < deadline:
            kind = ("serving", "load", "serving", "restore", "read_extra")[n % 5]
            n += 1
            if kind == "serving":
                server = ec.ServingEmbedding(path)
                k, tables = server.step, server.embedding_tables
            elif kind == "load":
                emb.load(path)
                k, tables = emb.step, emb.embedding_tables
            elif kind == "restore":
                back = ec.Embedding.restore(path)
                k, tables = back.step, back.embedding_tables
            else:
                _, metadata = read_extra(path)
                k, tables = metadata["k"], {}
            for name, table in tables.items():
                assert (table == k).all(), f"{kind}: table {name} mixes data of another step than {k}"
            opened[kind] += 1
    finally:
        saver.kill()
        saver.wait()
    print(f"\nconcurrent saves: {sum(opened.values())} opens {opened} while another process saved; "
          f"{sum(retries)} restarted on a newer CURRENT, none reported as corrupt")
    assert sum(opened.values()) >= 50


@numba.njit
def njit_sgd(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
    """A row function compiled with numba.njit: a checkpoint may name it."""
    return embedding_table - learning_rate * gradient


def test_a_numba_compiled_row_function_is_still_restored(tmp_path):
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 4, name="t"))}, ec.CustomOptimizer(njit_sgd, 0.1))
    emb.save(tmp_path / "c")
    back = ec.Embedding.restore(tmp_path / "c", allow_import=True)
    assert back.optimizer.custom_computation is njit_sgd


@pytest.mark.parametrize("step", [-1, 2.5, 2 ** 63, True])
def test_a_step_that_could_not_be_read_back_is_not_saved(tmp_path, step):
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(10, 4, name="t"))}, ec.SGD(0.1))
    emb.step = step
    with pytest.raises(CheckpointError, match="cannot be stored: a checkpoint's step is an integer"):
        emb.save(tmp_path / "c")
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


# -- the distributed checkpoint reads through the same checks ----------------------------------------------

_SHARDED_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import embedcore as ec
    from embedcore.checkpoint import CheckpointError
    from embedcore.distributed import ShardedEmbedding
    sys.path.insert(0, sys.argv[1])
    from tests.test_reliability_checkpoint import make_engine
    target = ShardedEmbedding(make_engine()._feature_config, ec.Adagrad(0.1), seed=4, timeout=30)
    for path in json.loads(sys.argv[2]):
        before, step = {n: t.copy() for n, t in target.embedding_tables.items()}, target.step
        out = {}
        for what, call in (("load", lambda: target.load(path, strict=False)),
                           ("restore", lambda: ShardedEmbedding.restore(path, allow_import=True, timeout=30))):
            try:
                call()
                out[what] = "loaded"
            except CheckpointError as e:
                out[what] = "CheckpointError: " + str(e)
            except BaseException as e:  # every rank raises Refused, caused by the failing rank's own error
                out[what] = type(e).__name__ + "(" + type(e.__cause__).__name__ + "): " + str(e)
        out["unchanged"] = target.step == step and all(
            np.array_equal(t, before[n]) for n, t in target.embedding_tables.items())
        print(json.dumps(out), flush=True)
""")


def test_the_sharded_engine_refuses_the_same_checkpoints_and_changes_nothing(tmp_path, source):
    pytest.importorskip("mpi4py")
    marker = str(tmp_path / "marker")
    cases = {"step": (lambda p: edit_manifest(p, _set(-1, "step")), r"step must be a step count"),
             "seed": (lambda p: edit_manifest(p, _set(math.inf, "config", "seed")), r"config.seed must be an integer"),
             "popen": (lambda p: edit_manifest(p, lambda m: [t.update(optimizer={"optimizer": "subprocess:Popen",
                                                                                 "args": {"args": ["touch", marker]}})
                                                             for t in m["config"]["tables"] if t["name"] == "b"] and m),
                       "not a subclass of embedcore's Optimizer"),
             "nan": (lambda p: rewrite_tensor(p, "a", "slot/accumulators",
                                              lambda a: a.__setitem__((5, 0), np.nan)),
                     r"table 'a' slot 'accumulators' holds NaN or Inf in 1 row\(s\), e.g. rows \[5\]")}
    paths = []
    for name, (make, _) in cases.items():
        path = tmp_path / name
        source.save(path)
        make(path)
        paths.append(str(path))
    proc = subprocess.run([sys.executable, "-c", _SHARDED_CHILD, ROOT, json.dumps(paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    results = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(results) == len(cases), proc.stderr[-3000:]
    for (name, (_, match)), result in zip(cases.items(), results):
        if name == "popen":  # a non-strict load uses no optimizer from the checkpoint: it loads
            assert result["load"] == "loaded"
            assert re.search(match, result["restore"]), result
            continue
        assert result["unchanged"], (name, result)
        for what in ("load", "restore"):
            assert result[what].startswith(("CheckpointError: ", "Refused(CheckpointError): ")), (name, what, result)
            assert re.search(match, result[what]), (name, what, result[what])
    assert not os.path.exists(marker)
