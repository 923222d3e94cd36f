"""End to end: `embedcore demo` and `embedcore train --config` on small data, exact resume, CLI errors."""

import json
import os

import numpy as np
import pytest

import embedcore as ec
from embedcore.checkpoint import read_extra
from embedcore.app.cli import main
from embedcore.app.run_config import DEFAULTS, ConfigError, load_config, merge
from embedcore.app.trainer import run

SMALL_DATA = {"kind": "synthetic", "n_train": 3000, "n_eval": 1000, "seed": 3,
              "vocabulary_sizes": [50, 200, 1000, 30], "n_dense": 4,
              "multi_hot": {"C2": [3, True]}}


def small_config(tmp_path, **train):
    config = merge(DEFAULTS, {"data": SMALL_DATA,
                              "embedding": {"dim": 4, "optimizer": "embedcore.app.quickstart:custom_adagrad",
                                            "learning_rate": 0.3, "slot_names": ["accumulators"],
                                            "slot_initializers": [0.1],
                                            "tables": {"C3": {"optimizer": "sgd", "learning_rate": 0.1}}},
                              "model": {"bottom": [8], "top": [8]},
                              "train": dict({"epochs": 2, "batch_size": 256, "output": str(tmp_path)}, **train)})
    return config


def write_toml(path, config):
    def value(v):
        return json.dumps(v) if not isinstance(v, dict) else None

    lines = []

    def section(name, body):
        lines.append(f"[{name}]")
        nested = []
        for k, v in body.items():
            if isinstance(v, dict):
                nested.append((f"{name}.{k}", v))
            else:
                lines.append(f"{k} = {value(v)}")
        for n, b in nested:
            section(n, b)

    for name, body in config.items():
        section(name, body)
    path.write_text("\n".join(lines) + "\n")


def test_train_writes_metrics_curve_and_checkpoint(tmp_path):
    config = small_config(tmp_path / "out")
    lines = []
    metrics = run(config, out=lines.append, progress_stream=open(os.devnull, "w"))
    out = tmp_path / "out"
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["final"] == metrics["final"]
    assert len(on_disk["epochs"]) == 2 and on_disk["steps"] == 2 * 12
    assert len(on_disk["train_loss_per_step"]) == 24
    assert all(np.isfinite(on_disk["train_loss_per_step"]))
    assert 0.0 < on_disk["optimum"]["log_loss"] < 0.7 and 0.5 < on_disk["optimum"]["auc"] <= 1.0
    assert on_disk["final"]["n"] == 1000
    assert (out / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("teacher optimum" in line for line in lines)
    emb = ec.Embedding.restore(out / "checkpoint", allow_import=True)
    assert emb.step == 24
    assert isinstance(emb.tables["C3"].optimizer, ec.SGD)
    arrays, metadata = read_extra(out / "checkpoint")
    assert "top.0.weight" in arrays and metadata["trainer"]["epoch"] == 2


def test_training_learns_on_planted_data(tmp_path):
    config = small_config(tmp_path, epochs=3)
    config["data"] = dict(SMALL_DATA, n_train=20000, n_eval=4000)
    metrics = run(config, out=lambda s: None, progress_stream=open(os.devnull, "w"))
    first, last = metrics["epochs"][0]["eval"], metrics["epochs"][-1]["eval"]
    assert last["auc"] > 0.6
    assert last["log_loss"] < first["log_loss"] or last["auc"] > first["auc"]
    assert metrics["optimum"]["auc"] > last["auc"] - 0.02


def test_resume_after_an_epoch_matches_an_uninterrupted_run(tmp_path):
    quiet = {"out": lambda s: None, "progress_stream": open(os.devnull, "w")}
    straight = run(small_config(tmp_path / "a"), **quiet)
    run(small_config(tmp_path / "b", epochs=1), **quiet)
    resumed = run(small_config(tmp_path / "b"), resume=True, **quiet)
    assert resumed["train_loss_per_step"] == straight["train_loss_per_step"]
    assert resumed["final"] == straight["final"]
    a = ec.Embedding.restore(tmp_path / "a" / "checkpoint", allow_import=True)
    b = ec.Embedding.restore(tmp_path / "b" / "checkpoint", allow_import=True)
    for name in a.embedding_tables:
        np.testing.assert_array_equal(a.embedding_tables[name], b.embedding_tables[name])
    xa, _ = read_extra(tmp_path / "a" / "checkpoint")
    xb, _ = read_extra(tmp_path / "b" / "checkpoint")
    for name in xa:
        np.testing.assert_array_equal(xa[name], xb[name])


def test_resume_mid_epoch_after_a_crash(tmp_path, monkeypatch):
    """A run that dies mid-epoch resumes from its last step checkpoint and ends bit-identical."""
    quiet = {"out": lambda s: None, "progress_stream": open(os.devnull, "w")}
    straight = run(small_config(tmp_path / "a"), **quiet)
    import embedcore.app.trainer as trainer
    real = trainer.bce_with_logits
    calls = {"n": 0}

    def dies_at_step_8(logits, labels):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt("simulated crash")
        return real(logits, labels)

    monkeypatch.setattr(trainer, "bce_with_logits", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        run(small_config(tmp_path / "b", checkpoint_every=3), **quiet)
    monkeypatch.setattr(trainer, "bce_with_logits", real)
    _, metadata = read_extra(tmp_path / "b" / "checkpoint")
    assert metadata["trainer"]["step_in_epoch"] == 6
    resumed = run(small_config(tmp_path / "b", checkpoint_every=3), resume=True, **quiet)
    assert resumed["train_loss_per_step"] == straight["train_loss_per_step"]
    assert resumed["final"] == straight["final"]


def test_train_cli_on_a_csv_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = ["label,I1,C1,C2"]
    for _ in range(3000):
        a, b = rng.integers(0, 20), rng.integers(0, 50, rng.integers(0, 4))
        label = int(rng.random() < (0.8 if a < 5 else 0.2))
        rows.append(f"{label},{rng.random():.3f},{a}," + "|".join(f"{x}:{rng.random() + 0.5:.2f}" for x in b))
    (tmp_path / "log.csv").write_text("\n".join(rows) + "\n")
    cfg = {"data": {"kind": "csv", "path": "log.csv", "eval_fraction": 0.2},
           "embedding": {"dim": 8, "optimizer": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.001},
           "model": {"bottom": [16], "top": [8], "dense_learning_rate": 0.01},
           "train": {"epochs": 2, "batch_size": 64, "output": "ignored"}}
    write_toml(tmp_path / "run.toml", cfg)
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--output", str(tmp_path / "out")]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["optimum"] is None and metrics["final"]["auc"] > 0.6
    assert "epoch 2:" in capsys.readouterr().out


def test_demo_command_on_a_tiny_run(tmp_path, capsys):
    code = main(["demo", "--train-samples", "2048", "--eval-samples", "1024", "--epochs", "1",
                 "--output", str(tmp_path)])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["dataset"]["features"]) == 26 and metrics["dataset"]["n_dense"] == 13
    assert metrics["config"]["embedding"]["optimizer"] == "embedcore.app.quickstart:custom_adagrad"
    assert (tmp_path / "learning_curve.png").exists()
    out = capsys.readouterr().out
    assert "teacher optimum" in out and "AUC" in out


@pytest.mark.parametrize("text, match", [
    ("[nope]\nx = 1\n", r"unknown section \[nope\]"),
    ("[train]\nepochz = 1\n", r"unknown key\(s\) \['epochz'\]"),
    ("[train]\nepochs = 0\n", "train.epochs must be an integer >= 1"),
    ("[embedding]\noptimizer = 'adamw'\n", "'adamw' is not one of"),
    ("[embedding]\noptimizer = 'sgd'\ninitial_accumulator_value = 0.1\n", r"unknown key\(s\) \['initial_accumulator"),
    ("[embedding]\noptimizer = 'no_such_mod:f'\n", "cannot import the custom computation 'no_such_mod:f'"),
    ("[embedding]\noptimizer = 'adagrad'\nlearning_rate = 'fast'\n", "learning_rate"),
    ("[data]\nkind = 'parquet'\n", "data.kind must be one of"),
    ("[data]\nkind = 'csv'\npath = 'missing.csv'\n", "missing.csv"),
    ("[model]\ntop = 'big'\n", "model.top must be a list"),
    ("[embedding.tables.C99]\noptimizer = 'sgd'\n", "C99"),
    ("this is = not [toml\n", "not valid TOML"),
])
def test_config_errors_are_clear(tmp_path, capsys, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text + f"[train]\noutput = '{tmp_path / 'o'}'\n" if "[train]" not in text else text)
    code = main(["train", "--config", str(path)])
    assert code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def test_cli_argument_errors(tmp_path, capsys):
    for argv, match in ((["demo", "--epochs", "0"], "must be >= 1"), (["train"], "--config"),
                        (["demo", "--batch-size", "x"], "expected an integer"),
                        (["demo", "--resume", "--output", str(tmp_path / "none")], "no checkpoint")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert match in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err


def test_load_config_json_and_defaults(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"train": {"epochs": 3}}))
    config = load_config(tmp_path / "c.json")
    assert config["train"]["epochs"] == 3 and config["embedding"]["optimizer"] == "adagrad"
    with pytest.raises(ConfigError, match="table/object"):
        (tmp_path / "d.json").write_text("[1]")
        load_config(tmp_path / "d.json")


def test_train_cli_on_movielens_ratings(tmp_path, capsys):
    """ratings.dat: users who like low movie ids; the model (no dense features) must find it."""
    rng = np.random.default_rng(1)
    lines = []
    for _ in range(4000):
        user, movie = rng.integers(1, 60), rng.integers(1, 40)
        likes = (movie < 20) == (user < 30)
        rating = rng.choice([4, 5]) if rng.random() < (0.85 if likes else 0.15) else rng.choice([1, 2, 3])
        lines.append(f"{user}::{movie}::{rating}::{978300000 + len(lines)}")
    (tmp_path / "ratings.dat").write_text("\n".join(lines) + "\n")
    cfg = {"data": {"kind": "movielens", "path": "ratings.dat"},
           "embedding": {"dim": 8, "optimizer": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.001},
           "model": {"top": [16], "dense_learning_rate": 0.02},
           "train": {"epochs": 5, "batch_size": 64, "output": str(tmp_path / "out")}}
    (tmp_path / "run.json").write_text(json.dumps(cfg))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["dataset"]["n_dense"] == 0
    assert [f["name"] for f in metrics["dataset"]["features"]] == ["user", "movie"]
    assert metrics["final"]["auc"] > 0.75


def test_resume_refuses_a_changed_run(tmp_path):
    quiet = {"out": lambda s: None, "progress_stream": open(os.devnull, "w")}
    run(small_config(tmp_path, epochs=1), **quiet)
    changed = small_config(tmp_path, batch_size=128)
    with pytest.raises(ec.CheckpointError, match=r"train.batch_size differ"):
        run(changed, resume=True, **quiet)
    changed = small_config(tmp_path)
    changed["model"]["top"] = [16]
    with pytest.raises(ec.CheckpointError, match=r"model.top differ"):
        run(changed, resume=True, **quiet)
    # More epochs, another eval frequency: allowed.
    metrics = run(small_config(tmp_path, epochs=2, eval_every=5), resume=True, **quiet)
    assert metrics["steps"] == 24


# ----------------------------------------------------------------------------------------------------------
# 16-bit tables (issue 28): [embedding] sets how every table is stored, [embedding.tables.NAME] one table

def sixteen_bit_config(tmp_path, **train):
    config = small_config(tmp_path, **train)
    config["embedding"]["weights_dtype"] = "bfloat16"
    config["embedding"]["tables"] = {
        "C2": {"weights_dtype": "float16", "slot_dtype": "bfloat16", "stochastic_rounding": False},
        "C3": {"optimizer": "sgd", "learning_rate": 0.1, "weights_dtype": "float32"}}
    return config


def test_16_bit_tables_train_checkpoint_and_resume_bit_identically(tmp_path):
    lines = []
    quiet = {"out": lines.append, "progress_stream": open(os.devnull, "w")}
    straight = run(sixteen_bit_config(tmp_path / "a"), **quiet)
    assert any(line.startswith("tables: 4 tables, rows bfloat16/float16/float32, slots bfloat16/float32, "
                               "rounding stochastic/to nearest") for line in lines), lines
    storage = straight["storage"]["tables"]
    assert storage["C1"] == {"weights_dtype": "bfloat16", "slot_dtype": "float32", "stochastic_rounding": True}
    assert storage["C2"] == {"weights_dtype": "float16", "slot_dtype": "bfloat16", "stochastic_rounding": False}
    assert storage["C3"]["weights_dtype"] == "float32"
    # C1 (50 rows), C2 (200), C3 (1000), C4 (30) of dim 4: 2, 2, 4, 2 bytes a value; slots: C3's SGD has none
    assert straight["storage"]["table_bytes"] == 4 * (2 * 50 + 2 * 200 + 4 * 1000 + 2 * 30)
    assert straight["storage"]["slot_bytes"] == 4 * (4 * 50 + 2 * 200 + 4 * 30)
    assert all(np.isfinite(straight["train_loss_per_step"])) and straight["final"]["auc"] > 0.5
    emb = ec.Embedding.restore(tmp_path / "a" / "checkpoint", allow_import=True)
    dtypes = {name: str(table.dtype) for name, table in emb.embedding_tables.items()}
    assert dtypes == {"C1": "bfloat16", "C2": "float16", "C3": "float32", "C4": "bfloat16"}
    assert str(emb.slot_variables["C2"]["accumulators"].dtype) == "bfloat16"
    assert not emb.tables["C2"].stochastic_rounding and isinstance(emb.tables["C3"].optimizer, ec.SGD)

    run(sixteen_bit_config(tmp_path / "b", epochs=1), **quiet)
    resumed = run(sixteen_bit_config(tmp_path / "b"), resume=True, **quiet)
    assert resumed["train_loss_per_step"] == straight["train_loss_per_step"]
    assert resumed["final"] == straight["final"]
    b = ec.Embedding.restore(tmp_path / "b" / "checkpoint", allow_import=True)
    for name, table in emb.embedding_tables.items():
        assert b.embedding_tables[name].dtype == table.dtype
        np.testing.assert_array_equal(b.embedding_tables[name].view(np.uint8), table.view(np.uint8))

    other = sixteen_bit_config(tmp_path / "b")
    other["embedding"]["weights_dtype"] = "float16"
    with pytest.raises(ec.CheckpointError, match=r"embedding.weights_dtype differ"):
        run(other, resume=True, **quiet)


def test_spelling_out_the_default_storage_resumes_a_run_that_did_not(tmp_path):
    quiet = {"out": lambda s: None, "progress_stream": open(os.devnull, "w")}
    run(small_config(tmp_path, epochs=1), **quiet)
    spelt = small_config(tmp_path)
    spelt["embedding"].update(weights_dtype="float32", slot_dtype="float32", stochastic_rounding=True)
    spelt["embedding"]["tables"]["C3"]["weights_dtype"] = "float32"
    assert run(spelt, resume=True, **quiet)["steps"] == 24


def test_storage_keys_survive_naming_another_optimizer_and_per_table_storage_keeps_the_optimizer(tmp_path):
    (tmp_path / "run.toml").write_text(
        '[embedding]\noptimizer = "sgd"\nweights_dtype = "bfloat16"\nslot_dtype = "float16"\n'
        '[embedding.tables.C1]\nstochastic_rounding = false\n')
    config = load_config(tmp_path / "run.toml")
    assert config["embedding"]["weights_dtype"] == "bfloat16" and "initial_accumulator_value" not in config["embedding"]
    from embedcore.app.run_config import table_storage
    assert table_storage(config["embedding"], "C1") == {"weights_dtype": "bfloat16", "slot_dtype": "float16",
                                                        "stochastic_rounding": False}
    assert table_storage(config["embedding"], "C2")["stochastic_rounding"] is True


def test_16_bit_tables_let_a_twice_larger_vocabulary_pass_the_memory_check(monkeypatch):
    """The trainer sizes tables in their stored dtype: under a memory cap that just holds float32 tables of V
    rows with their Adagrad slots, bfloat16 tables and slots of 2V rows pass, float32 ones of 2V do not."""
    from embedcore.app.data import FeatureSpec
    from embedcore.app.trainer import _check_tables_fit
    vocab, dim = 10 ** 7, 16  # 1.28 GB: the cap must lie below the machine's own memory
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(vocab * dim * (4 + 4)))
    adagrad = {"C1": ec.Adagrad(0.1)}

    def fit(rows, dtype):
        _check_tables_fit([FeatureSpec("C1", rows)], dim, adagrad,
                          {"C1": ec.TableConfig(rows, dim, name="C1", weights_dtype=dtype, slot_dtype=dtype)})

    fit(vocab, "float32")
    fit(2 * vocab, "bfloat16")
    fit(2 * vocab, "float16")
    with pytest.raises(ConfigError, match=r"dim = 16 float32 values a row.*20,000,000 rows, 2,560,000,000 bytes"):
        fit(2 * vocab, "float32")
    with pytest.raises(ConfigError, match=r"dim = 16 bfloat16 values a row.*20,000,001 rows, 1,280,000,064 bytes"):
        fit(2 * vocab + 1, "bfloat16")


def test_demo_with_bfloat16_tables(tmp_path, capsys):
    code = main(["demo", "--train-samples", "2048", "--eval-samples", "1024", "--epochs", "1",
                 "--output", str(tmp_path), "--weights-dtype", "bfloat16", "--rounding", "nearest"])
    assert code == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["embedding"]["weights_dtype"] == "bfloat16"
    assert metrics["title"].endswith(", bfloat16 tables")
    assert {t["weights_dtype"] for t in metrics["storage"]["tables"].values()} == {"bfloat16"}
    assert not any(t["stochastic_rounding"] for t in metrics["storage"]["tables"].values())
    assert 0 < metrics["final"]["log_loss"] < 1 and metrics["final"]["auc"] is not None  # two steps: no skill yet
    emb = ec.Embedding.restore(tmp_path / "checkpoint", allow_import=True)
    assert {str(t.dtype) for t in emb.embedding_tables.values()} == {"bfloat16"}
    out = capsys.readouterr().out
    assert "tables: 26 tables, rows bfloat16, slots float32, rounding to nearest" in out
    with pytest.raises(SystemExit):
        main(["demo", "--weights-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_biased_mf_gradients_match_finite_differences():
    from embedcore.app.models import BiasedMF, squared_error
    rng = np.random.default_rng(0)
    model = BiasedMF(3.5, 3, l2=0.1, l2_bias=0.02)
    acts = {"user": rng.normal(size=(4, 3)), "movie": rng.normal(size=(4, 3)),
            "user_bias": rng.normal(size=(4, 1)), "movie_bias": rng.normal(size=(4, 1))}
    target = rng.uniform(1, 5, 4)

    def loss(a):
        prediction, _ = model.forward({k: v.astype(np.float32) for k, v in a.items()})
        value, _ = squared_error(prediction, target)
        return value + 0.05 * (np.sum(a["user"] ** 2) + np.sum(a["movie"] ** 2)) + \
            0.01 * (np.sum(a["user_bias"] ** 2) + np.sum(a["movie_bias"] ** 2))

    prediction, cache = model.forward({k: v.astype(np.float32) for k, v in acts.items()})
    grads = model.backward(cache, squared_error(prediction, target)[1])
    assert model.ids({"user": np.arange(2), "movie": np.arange(2)})["movie_bias"].tolist() == [0, 1]
    for name, a in acts.items():
        numeric = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            up, down = {k: v.copy() for k, v in acts.items()}, {k: v.copy() for k, v in acts.items()}
            up[name][index] += 1e-2
            down[name][index] -= 1e-2
            numeric[index] = (loss(up) - loss(down)) / 2e-2
        np.testing.assert_allclose(grads[name], numeric, rtol=2e-2, atol=2e-3, err_msg=name)
