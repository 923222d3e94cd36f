"""Serving exports (export_for_serving): int8 row-wise quantization against a plain NumPy reference, int8
lookups within half a quantization step per occurrence of the float32 ones, 16-bit exports equal to 16-bit
tables' lookups, and the checkpoint promises for the new files (atomic, verified, refused when corrupt or
malformed, never mistaken for a training checkpoint)."""

import hashlib
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import CheckpointError, open_snapshot
from embedcore.checkpoint.tensor_file import read_header
from embedcore.export import dequantize_int8_rows, quantize_int8_rows
from embedcore.kernels.quantized import gather_fused8

from . import harness
from . import reference as ref

def rewrite_manifest(path, edit):
    harness.rewrite_manifest(path, edit, serving=True)


EPS32 = float(np.finfo(np.float32).eps)


# -- the quantization, against a plain NumPy reference ---------------------------------------------------

def reference_quantize(values):
    """Row by row, in Python floats: bias = min, scale = float32((max - min) / 255), code = round half to even
    of (x - min) / scale (0 for a constant row)."""
    values = np.asarray(values, np.float32)
    codes = np.zeros(values.shape, np.uint8)
    scales = np.zeros(values.shape[0], np.float32)
    biases = np.zeros(values.shape[0], np.float32)
    for i, row in enumerate(values):
        low, high = float(row.min()), float(row.max())
        scale = np.float32((high - low) / 255.0)
        scales[i], biases[i] = scale, low
        if scale > 0:
            for j, x in enumerate(row):
                codes[i, j] = min(255, max(0, round((float(x) - low) / float(scale))))  # round(): half to even
    return codes, scales, biases


def unpack(fused):
    """(codes, scales, biases) of fused rows, the scale and bias read as little-endian float32 bytes."""
    dim = fused.shape[1] - 8
    scales = np.array([struct.unpack("<f", bytes(row[dim:dim + 4]))[0] for row in fused], np.float32)
    biases = np.array([struct.unpack("<f", bytes(row[dim + 4:dim + 8]))[0] for row in fused], np.float32)
    return fused[:, :dim], scales, biases


def interesting_rows(rng, dim):
    rows = [rng.standard_normal((40, dim)) * 10.0 ** rng.integers(-6, 6, (40, 1)),
            rng.uniform(-1, 1, (20, dim)) + rng.uniform(-1e3, 1e3, (20, 1)),
            np.full((3, dim), 0.25), np.zeros((2, dim)), np.full((2, dim), -7.5e30),
            np.round(rng.uniform(0, 255, (5, dim))) / 255.0 * 3.0 - 1.0]  # values on and between the steps
    if dim > 2:  # min 0, max 255: a scale of exactly 1, and values half a step apart in between (ties)
        ties = np.zeros((1, dim))
        ties[0, -1] = 255.0
        ties[0, 1:-1] = 0.5 + np.arange(dim - 2) % 5
        rows.append(ties)
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("dim", [1, 2, 5, 16, 64])
def test_quantize_int8_rows_matches_the_reference_codes_scales_and_biases(dim):
    rng = np.random.default_rng(dim)
    values = interesting_rows(rng, dim)
    fused = quantize_int8_rows(values)
    assert fused.dtype == np.uint8 and fused.shape == (values.shape[0], dim + 8)
    codes, scales, biases = unpack(fused)
    want_codes, want_scales, want_biases = reference_quantize(values)
    np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    np.testing.assert_array_equal(biases.view(np.uint32), want_biases.view(np.uint32))
    np.testing.assert_array_equal(codes, want_codes)
    # Every value within half a step; constant rows exact.
    back = dequantize_int8_rows(fused).astype(np.float64)
    x = values.astype(np.float64)
    err = np.abs(back - x)
    bound = scales.astype(np.float64)[:, None] / 2 + 2 * EPS32 * (np.abs(x) + 255 * scales[:, None])
    assert (err <= bound).all()
    constant = values.min(axis=1) == values.max(axis=1)
    assert constant.sum() >= 7
    assert (scales[constant] == 0).all() and (codes[constant] == 0).all()
    np.testing.assert_array_equal(back[constant], x[constant])
    if dim > 2:  # the ties row: 0.5, 1.5, 2.5, ... round to even
        assert scales[-1] == 1.0
        np.testing.assert_array_equal(codes[-1, 1:-1], [[0, 2, 2, 4, 4][k % 5] for k in range(dim - 2)])


def test_quantize_int8_rows_takes_16_bit_rows_and_refuses_rows_float32_cannot_span():
    rng = np.random.default_rng(1)
    values = rng.standard_normal((50, 8)).astype(np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        stored = values.astype(dtype)
        got = quantize_int8_rows(stored)
        want = reference_quantize(stored.astype(np.float32))
        for a, b in zip(unpack(got), want):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="row 3 spans"):
        quantize_int8_rows(np.array([[0, 1]] * 3 + [[-3e38, 3e38]], np.float32))


def test_the_fbgemm_formula_gives_codes_at_most_one_apart():
    """FBGEMM rounds (x - min) * 255 / (range + 1e-8) in float32: the same rows, the same scale and bias, codes
    that may differ by one near half a step."""
    rng = np.random.default_rng(2)
    values = rng.standard_normal((500, 32)).astype(np.float32)
    codes, scales, biases = unpack(quantize_int8_rows(values))
    low, high = values.min(1), values.max(1)
    inverse = np.float32(255) / ((high - low) + np.float32(1e-8))
    fbgemm = np.rint((values - low[:, None]) * inverse[:, None])
    np.testing.assert_array_equal(biases, low)
    np.testing.assert_allclose(scales, (high - low) / np.float32(255), rtol=1e-6)
    assert np.abs(fbgemm - codes).max() <= 1


# -- the int8 gather kernel --------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [1, 5, 16, 64])
def test_gather_fused8_sums_dequantized_rows(dim):
    rng = np.random.default_rng(dim)
    values = rng.standard_normal((30, dim)).astype(np.float32)
    values[3] = 0.5
    fused = quantize_int8_rows(values)
    lengths = rng.integers(0, 11, 40)
    lengths[:3] = 0
    out_ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = rng.integers(0, 30, out_ptr[-1]).astype(np.int32)
    gains = rng.uniform(-2, 2, out_ptr[-1]).astype(np.float32)
    deq = dequantize_int8_rows(fused).astype(np.float64)
    for g in (gains, None):
        acts = []
        for prefetch in (True, False):
            act = np.full((40, dim), np.nan, np.float32)
            gather_fused8(fused, rows, g, out_ptr, act, prefetch)
            acts.append(act)
        np.testing.assert_array_equal(acts[0], acts[1])
        gg = np.ones(rows.shape[0]) if g is None else g.astype(np.float64)
        want = np.zeros((40, dim))
        scale_of = unpack(fused)[1]
        for a in range(40):
            k = slice(out_ptr[a], out_ptr[a + 1])
            want[a] = (gg[k, None] * deq[rows[k]]).sum(0)
            slack = 4 * (lengths[a] + 2) * EPS32 * (np.abs(gg[k]) * (np.abs(values[rows[k]]).max(1) +
                                                                     255 * scale_of[rows[k]])).sum()
            assert (np.abs(acts[0][a] - want[a]) <= slack + 1e-30).all(), a
        assert (acts[0][:3] == 0).all()
    with pytest.raises(ValueError, match="uint8 table"):
        gather_fused8(fused[:, :-1], rows, None, out_ptr, np.empty((40, dim), np.float32))


# -- int8 serving lookups within one quantization step of float32 ------------------------------------------

def make_engine(dtype="float32"):
    big = ec.TableConfig(300, 16, name="big", combiner="sum", weights_dtype=dtype)
    mid = ec.TableConfig(50, 5, name="mid", combiner="mean", weights_dtype=dtype)
    tiny = ec.TableConfig(1, 3, name="tiny", combiner="sqrtn", weights_dtype=dtype)
    pair = ec.TableConfig(2, 4, name="pair", combiner="mean", weights_dtype=dtype)
    features = {"sum": ec.FeatureConfig(big), "seq": ec.FeatureConfig(big, max_sequence_length=4),
                "mean": ec.FeatureConfig(mid), "sqrtn": ec.FeatureConfig(tiny), "pair": ec.FeatureConfig(pair)}
    return ec.Embedding(features, ec.Adagrad(0.1), seed=3), features


SPEC = {"sum": ("big", None, True), "seq": ("big", 4, True), "mean": ("mid", None, False),
        "sqrtn": ("tiny", None, False), "pair": ("pair", None, False)}


def fill_tables(emb, rng):
    tables = {}
    for name, t in emb.tables.items():
        values = rng.standard_normal((t.vocabulary_size, t.dim)) * 10.0 ** rng.integers(-3, 3, (t.vocabulary_size, 1))
        values += rng.uniform(-5, 5, (t.vocabulary_size, 1))
        constant = rng.random(t.vocabulary_size) < 0.1
        values[constant] = values[constant, :1]
        tables[name] = values.astype(np.float32)
    tables["pair"][:] = [[1.5] * 4, [-0.25] * 4]  # both rows constant
    emb.set_state(tables=tables)
    return tables


def random_batch(rng, emb, batch=24):
    features, weights, samples = {}, {}, {}
    for name, (table, seq_len, signed) in SPEC.items():
        vocab = emb.tables[table].vocabulary_size
        hot = rng.integers(0, vocab, 6)  # draws from few ids: many duplicates
        ids, w = [], []
        for b in range(batch):
            n = 0 if b == 0 else int(rng.integers(0, (seq_len or 9) + 1))  # empty samples too
            ids.append([int(i) for i in rng.choice(hot, n)])
            w.append([float(x) for x in (rng.uniform(-2, 2, n) if signed else rng.uniform(0.1, 2, n))])
        features[name], weights[name], samples[name] = ids, w, (ids, w)
    return features, weights, samples


def quantization_bounds(samples, scales, values, seq_len, combiner):
    """Per activation row: (sum over its occurrences of |gain| * scale / 2, float32 rounding slack)."""
    ids, weights = samples
    dim = values.shape[1]
    shape = (len(ids), seq_len) if seq_len else (len(ids),)
    bound, slack = np.zeros(shape), np.zeros(shape)
    for b, (row_ids, w) in enumerate(zip(ids, weights)):
        gains = np.asarray(w, np.float64) if seq_len else ref.combine_gains(w, combiner)
        mag = np.abs(values[row_ids]).max(1) + 255 * scales[row_ids] if row_ids else np.zeros(0)
        if seq_len:
            for p, (i, g) in enumerate(zip(row_ids, gains)):
                bound[b, p] = abs(g) * scales[i] / 2
                slack[b, p] = 8 * EPS32 * abs(g) * mag[p]
        else:
            bound[b] = (np.abs(gains) * scales[row_ids] / 2).sum()
            slack[b] = 4 * (len(row_ids) + 4) * EPS32 * (np.abs(gains) * mag).sum()
    return bound[..., None].repeat(dim, -1), slack[..., None].repeat(dim, -1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    rng = np.random.default_rng(7)
    emb, _ = make_engine()
    values = fill_tables(emb, rng)
    root = tmp_path_factory.mktemp("export")
    emb.save(root / "ckpt")
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        ec.export_for_serving(root / "ckpt", root / dtype, dtype=dtype)
    return emb, values, root


@pytest.mark.parametrize("seed", range(4))
def test_int8_lookups_are_within_half_a_step_per_occurrence_of_float32(exported, seed):
    emb, values, root = exported
    server8, server32 = ec.ServingEmbedding(root / "int8"), ec.ServingEmbedding(root / "float32")
    assert server8.dtype == "int8" and server32.dtype == "float32"
    rng = np.random.default_rng(100 + seed)
    features, weights, samples = random_batch(rng, emb)
    got8, got32 = server8.lookup(features, weights), server32.lookup(features, weights)
    errors = 0.0
    for name, (table, seq_len, _) in SPEC.items():
        fused = server8.embedding_tables[table]
        scales = unpack(fused)[1].astype(np.float64)
        bound, slack = quantization_bounds(samples[name], scales, values[table], seq_len, emb.tables[table].combiner)
        diff = np.abs(got8[name].astype(np.float64) - got32[name].astype(np.float64))
        assert got8[name].shape == got32[name].shape == bound.shape
        assert (diff <= bound + slack).all(), (name, float((diff - bound - slack).max()))
        # And what the kernel sums is the dequantized rows (to float32 rounding).
        deq = dequantize_int8_rows(fused).astype(np.float64)
        exact = ref.lookup(deq, *samples[name], emb.tables[table].combiner, seq_len)
        assert (np.abs(got8[name] - exact) <= slack + 1e-30).all(), name
        errors = max(errors, float((diff / np.maximum(bound, 1e-300)).max()))
    assert errors > 0.1  # the rows were quantized: some activations are a good part of a step away
    # Empty samples are zeros; constant rows are exact.
    empty = [b for b, ids in enumerate(features["pair"]) if not ids]
    assert empty and (got8["pair"][empty] == 0).all()
    np.testing.assert_array_equal(got8["pair"], got32["pair"])


def test_int8_serving_reads_the_fused_rows_where_they_lie(exported):
    _, values, root = exported
    server = ec.ServingEmbedding(root / "int8")
    fused = server.embedding_tables["big"]
    assert fused.dtype == np.uint8 and fused.shape == (300, 24) and not fused.flags.writeable
    assert isinstance(fused.base, np.memmap) or isinstance(getattr(fused.base, "base", None), np.memmap)
    (table,) = [t for t in server.physical_tables if t.table_names == ["big"]]
    assert type(table.storage).__name__ == "FusedInt8Storage" and table.dim == 16
    np.testing.assert_array_equal(fused, quantize_int8_rows(values["big"]))
    assert "int8" in repr(server)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_exports_serve_what_16_bit_tables_look_up(exported, dtype):
    emb, values, root = exported
    trained16, _ = make_engine(dtype)
    trained16.set_state(tables={name: v.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
                                for name, v in values.items()})
    server = ec.ServingEmbedding(root / dtype)
    assert server.dtype == dtype
    rng = np.random.default_rng(5)
    features, weights, _ = random_batch(rng, emb)
    expected, _ = trained16.lookup(features, weights)
    got = server.lookup(features, weights)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_float32_export_serves_the_checkpoints_lookups_bit_for_bit(exported):
    emb, _, root = exported
    features, weights, _ = random_batch(np.random.default_rng(6), emb)
    expected = ec.ServingEmbedding(root / "ckpt").lookup(features, weights)
    got = ec.ServingEmbedding(root / "float32").lookup(features, weights)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_16_bit_training_checkpoint_exports_to_int8(tmp_path):
    emb, _ = make_engine("bfloat16")
    emb.save(tmp_path / "c")
    ec.export_for_serving(tmp_path / "c", tmp_path / "e")
    server = ec.ServingEmbedding(tmp_path / "e")
    stored = emb.embedding_tables["big"].astype(np.float32)
    np.testing.assert_array_equal(server.embedding_tables["big"], quantize_int8_rows(stored))


def test_a_sharded_checkpoint_exports_whole(tmp_path):
    """Tables saved in shards (as a ShardedEmbedding's ranks write them) are assembled, in id order."""
    from embedcore.checkpoint import engine_config, manifest_of, write_table_shards
    from embedcore.checkpoint.store import SnapshotWriter
    emb, _ = make_engine()
    values = fill_tables(emb, np.random.default_rng(9))
    writer = SnapshotWriter(tmp_path / "c", 0)
    entries = {}
    for rank in range(2):
        shards = {n: (rank, 2, len(range(rank, t.vocabulary_size, 2))) for n, t in emb.tables.items()}
        part = write_table_shards(writer, emb.tables, {n: v[rank::2] for n, v in values.items()},
                                  {n: {s: a[rank::2] for s, a in slots.items()} for n, slots in
                                   emb.slot_variables.items()}, shards, suffix=f"-rank{rank}")
        for n, e in part.items():
            entries.setdefault(n, dict(e, shards=[]))["shards"] += e["shards"]
    writer.commit(manifest_of(0, engine_config(emb), entries, None, None))
    ec.export_for_serving(tmp_path / "c", tmp_path / "e", "float32")
    server = ec.ServingEmbedding(tmp_path / "e")
    for name, v in values.items():
        np.testing.assert_array_equal(server.embedding_tables[name], v)


# -- the files and their manifest; refusals -------------------------------------------------------------

def test_the_export_records_its_format_and_holds_no_slots(exported):
    _, _, root = exported
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        snap = open_snapshot(root / dtype, serving=True)
        m = snap.manifest
        assert m["format"] == "embedcore-serving" and m["serving"]["dtype"] == dtype and m["extra"] is None
        assert snap.serving_dtype == dtype and snap.step == 0
        for name, entry in m["tables"].items():
            assert entry["slots"] == [] and len(entry["shards"]) == 1
            (tensor,) = m["files"][entry["shards"][0]["file"]].items()
            width = entry["dim"] + 8 if dtype == "int8" else entry["dim"]
            assert tensor[0] == "weights" and tensor[1]["shape"] == [entry["vocabulary_size"], width]
            assert tensor[1]["dtype"] == ("uint8" if dtype == "int8" else dtype)
    assert open_snapshot(root / "ckpt", serving=True).serving_dtype is None


def test_training_readers_refuse_an_export(exported):
    emb, _, root = exported
    before = {n: t.copy() for n, t in emb.embedding_tables.items()}
    for dtype in ("float32", "int8"):
        with pytest.raises(CheckpointError, match="is a serving export .*not a training checkpoint"):
            ec.Embedding.restore(root / dtype)
        with pytest.raises(CheckpointError, match="serving export"):
            emb.load(root / dtype)
        with pytest.raises(CheckpointError, match="serving export"):
            emb.load(root / dtype, strict=False)
        with pytest.raises(CheckpointError, match="serving export"):
            open_snapshot(root / dtype)
    for name, t in emb.embedding_tables.items():
        np.testing.assert_array_equal(t, before[name])
    with pytest.raises(CheckpointError, match="serving export"):  # nor is an export exported again
        ec.export_for_serving(root / "int8", root / "again")


def test_export_refuses_bad_arguments_and_never_replaces_a_training_checkpoint(exported, tmp_path):
    emb, _, root = exported
    with pytest.raises(ValueError, match="dtype must be one of"):
        ec.export_for_serving(root / "ckpt", tmp_path / "x", dtype="int4")
    with pytest.raises(CheckpointError, match="cannot replace the checkpoint it is exported from"):
        ec.export_for_serving(root / "ckpt", root / "ckpt")
    emb.save(tmp_path / "other")
    with pytest.raises(CheckpointError, match="holds a training checkpoint"):
        ec.export_for_serving(root / "ckpt", tmp_path / "other")
    ec.Embedding.restore(tmp_path / "other")  # untouched
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        ec.export_for_serving(tmp_path / "missing", tmp_path / "y")
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y/CURRENT")


def test_exporting_again_replaces_the_export_atomically(tmp_path):
    emb, _ = make_engine()
    values = fill_tables(emb, np.random.default_rng(11))
    emb.save(tmp_path / "c")
    ec.export_for_serving(tmp_path / "c", tmp_path / "e", "int8")
    first = open_snapshot(tmp_path / "e", serving=True).name
    # A failed export (a value beyond float16 in the last table) leaves the previous export current and whole.
    values["pair"][0, 0] = 1e5
    emb.set_state(tables={"pair": values["pair"]})
    emb.save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="'pair' weights holds 100000 in row 0.*beyond the range of float16"):
        ec.export_for_serving(tmp_path / "c", tmp_path / "e", "float16")
    assert open_snapshot(tmp_path / "e", serving=True).name == first
    assert sorted(n for n in os.listdir(tmp_path / "e") if n.startswith("snapshot-")) == [first]
    ec.ServingEmbedding(tmp_path / "e")
    ec.export_for_serving(tmp_path / "c", tmp_path / "e", "bfloat16")
    server = ec.ServingEmbedding(tmp_path / "e")
    assert server.dtype == "bfloat16" and len([n for n in os.listdir(tmp_path / "e") if n.startswith("snap")]) == 1


def test_an_int8_row_float32_cannot_span_is_refused(tmp_path):
    emb, _ = make_engine()
    values = fill_tables(emb, np.random.default_rng(12))
    values["mid"][7, :2] = [-3e38, 3e38]
    emb.set_state(tables={"mid": values["mid"]})
    emb.save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="table 'mid' weights: row 7 spans"):
        ec.export_for_serving(tmp_path / "c", tmp_path / "e", "int8")
    assert not os.path.exists(tmp_path / "e/CURRENT")


def weights_file(path, table):
    snap = open_snapshot(path, serving=True)
    return snap, os.path.join(snap.dir, snap.manifest["tables"][table]["shards"][0]["file"])


def test_corrupt_and_truncated_exports_are_refused(exported, tmp_path):
    _, _, root = exported
    import shutil
    for dtype in ("int8", "float16"):
        path = tmp_path / dtype
        shutil.copytree(root / dtype, path)
        _, f = weights_file(path, "big")
        header, _, start = read_header(f)
        raw = bytearray(open(f, "rb").read())
        raw[start + header["weights"]["begin"] + 5] ^= 1
        open(f, "wb").write(raw)
        with pytest.raises(CheckpointError, match="'weights' does not match its SHA-256"):
            ec.ServingEmbedding(path)
        open(f, "wb").write(raw[:len(raw) - 100])
        with pytest.raises(CheckpointError, match="corrupt checkpoint"):
            ec.ServingEmbedding(path, verify=False)


def resign(path, f, table="big"):
    """Recompute the SHA-256 of file ``f``'s weights in the manifest (as someone controlling the directory could)."""
    header, _, start = read_header(f)
    raw = open(f, "rb").read()
    digest = hashlib.sha256(raw[start + header["weights"]["begin"]:start + header["weights"]["end"]]).hexdigest()

    def edit(text):
        m = json.loads(text)
        m["files"][os.path.basename(f)]["weights"]["sha256"] = digest
        return json.dumps(m)
    rewrite_manifest(path, edit)


@pytest.mark.parametrize("scale, bias, match", [
    (float("nan"), 0.0, "NaN, Inf or negative scale"), (0.1, float("inf"), "NaN, Inf or negative scale"),
    (-0.1, 0.0, "NaN, Inf or negative scale"), (3e38, 1e38, "NaN, Inf or negative scale"),
])
def test_scales_and_biases_must_be_finite(exported, tmp_path, scale, bias, match):
    _, _, root = exported
    import shutil
    path = tmp_path / "e"
    shutil.copytree(root / "int8", path)
    _, f = weights_file(path, "big")
    header, _, start = read_header(f)
    raw = bytearray(open(f, "rb").read())
    row = 17
    at = start + header["weights"]["begin"] + row * 24 + 16
    raw[at:at + 8] = struct.pack("<ff", scale, bias)
    open(f, "wb").write(raw)
    resign(path, f)
    with pytest.raises(CheckpointError, match=rf"table 'big' has a {match}.*rows \[17\]"):
        ec.ServingEmbedding(path)


def edit_manifest(path, edit):
    def rewrite(text):
        m = json.loads(text)
        edit(m)
        return json.dumps(m)
    rewrite_manifest(path, rewrite)


def _first(m, table="big"):
    return m["files"][m["tables"][table]["shards"][0]["file"]]["weights"]


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["serving"].update(dtype="int4"), r"serving.dtype must be one of"),
    (lambda m: m.pop("serving"), r"serving must be an object"),
    (lambda m: m["serving"].update(zero_point=3), r"serving must be an object of dtype and source_snapshot"),
    (lambda m: m["serving"].update(source_snapshot=5), r"source_snapshot must be a string"),
    (lambda m: m.update(extra="table-0000.safetensors"), r"extra must be null"),
    (lambda m: _first(m).update(dtype="float32"), r"is float32 of shape \(300, 24\); an export of dtype 'int8' "
                                                  r"stores uint8 of shape \(300, 24\)"),
    (lambda m: _first(m).update(shape=[300, 23]), r"stores uint8 of shape \(300, 24\)"),
    (lambda m: _first(m).update(shape=[300, 16]), r"stores uint8 of shape \(300, 24\)"),
    (lambda m: m["tables"]["big"].update(slots=["accumulator"]), r"lists slots \['accumulator'\]"),
    (lambda m: m["tables"]["big"]["shards"][0].update(rows=299), r"do not partition its rows"),
    (lambda m: m["tables"]["big"].update(vocabulary_size=10 ** 6), r"do not partition its rows"),
    (lambda m: m.update(format="embedcore-checkpoint"), r"tensor 'weights' in .* is uint8"),
    (lambda m: m.update(format="embedcore-serving2"), r"not an embedcore checkpoint"),
    (lambda m: m["tables"].pop("mid"), r"holds no table 'mid'"),
])
def test_malformed_export_manifests_are_refused_before_anything_is_read(exported, tmp_path, edit, match):
    _, _, root = exported
    import shutil
    path = tmp_path / "e"
    shutil.copytree(root / "int8", path)
    edit_manifest(path, edit)
    with pytest.raises(CheckpointError, match=match):
        ec.ServingEmbedding(path, verify=False)


def test_a_16_bit_export_of_another_dtype_than_declared_is_refused(exported, tmp_path):
    _, _, root = exported
    import shutil
    path = tmp_path / "e"
    shutil.copytree(root / "float16", path)
    edit_manifest(path, lambda m: m["serving"].update(dtype="bfloat16"))
    with pytest.raises(CheckpointError, match=r"is float16 of shape \(300, 16\); an export of dtype 'bfloat16'"):
        ec.ServingEmbedding(path, verify=False)


def test_export_sizes(exported):
    """int8 rows of 16 values take 24 bytes (37.5% of float32's 64), 16-bit rows half."""
    _, _, root = exported
    sizes = {}
    for dtype in ("float32", "float16", "int8"):
        _, f = weights_file(root / dtype, "big")
        sizes[dtype] = os.path.getsize(f)
    assert sizes["int8"] < 0.4 * sizes["float32"] + 1024 and sizes["float16"] < 0.5 * sizes["float32"] + 1024
    assert math.isclose(sizes["float32"], 300 * 64, abs_tol=1024)
