"""End-to-end training: a dataset, embedcore tables with their fused optimizers, a NumPy DLRM head.

One step::

    acts, ctx = emb.lookup(batch.ids, batch.weights)        # embedding activations [B, dim] per feature
    logits, cache = model.forward(batch.dense, acts)
    loss, d_logits = bce_with_logits(logits, batch.labels)  # mean binary cross-entropy
    emb.apply_gradients(model.backward(cache, d_logits), ctx)
    model.step()                                            # the dense optimizer

After each epoch the eval split is scored (log loss and exact AUC, beside the teacher's optimum for the
synthetic data), a checkpoint of tables, slots, dense weights and data position is written atomically, and
``metrics.json`` is rewritten atomically; ``learning_curve.png`` is drawn at the end. ``resume=True``
continues from the checkpoint and gives bit-identical results to a run that never stopped.

Before anything is written, the configuration is checked (:func:`embedcore.app.run_config.check`), the data
read, and every large allocation sized by it (the tables with their slots, the dense layers, the eval
scores) checked against the machine's memory; a refusal raises :class:`~embedcore.app.run_config.ConfigError`
(or the reader's :class:`~embedcore.app.data.DataFormatError`) and leaves no output folder behind. A metric that
is undefined (AUC of an eval split with one class, any metric of an empty eval split) is ``null`` in
``metrics.json`` and "undefined" in the printed line; training goes on.

Dynamic tables (``[embedding.tables.NAME] dynamic = true``, see :mod:`embedcore.app.run_config`) train, are
evaluated and reported (``storage.tables.NAME``: capacity and keys held) as the others; their features' ids
are 64-bit keys (a CSV log's hashed columns through :func:`embedcore.hash_keys`). Eval lookups are read-only
(``emb.lookup(..., training=False)``): they change no table, so evaluating never feeds eval keys into training
(held keys read their rows, any other key its initial value). Dynamic tables are checkpointed (keys, rows,
slots and policy state) and resumed bit-identically as static ones.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import platform
import time

import numpy as np

from .. import __version__
from .blas_threads import blas_threads
from ..memory_budget import check_fits
from ..checkpoint import CheckpointError, read_current, read_extra
from ..config import DynamicTableConfig
from .data import feature_configs
from ..engine import Embedding
from .metrics import BinaryMetrics
from .models import DLRM, bce_with_logits, sigmoid
from .plot import learning_curve
from .progress import ProgressBar
from .run_config import (STORAGE_DEFAULTS, STORAGE_KEYS, ConfigError, build_dataset, build_dense_optimizer,
                         build_optimizer, check, table_dynamic, table_storage)
from ..tables import DenseStorage
from ..tables.dynamic import map_bytes

__all__ = ["run"]


def _build(config: dict):
    emb_cfg, model_cfg, train = config["embedding"], config["model"], config["train"]
    dynamic = [name for name in emb_cfg["tables"] if table_dynamic(emb_cfg, name) is not None]
    static_keys = [c for c in config["data"].get("key_columns", []) if c not in dynamic]
    if static_keys:
        raise ConfigError(f"data.key_columns names {static_keys}, whose tables are not dynamic: a static table has "
                          f"rows, not 64-bit keys; set [embedding.tables.{static_keys[0]}] dynamic = true and a "
                          f"capacity (a dynamic table's column is a key column without being named here)")
    dataset = build_dataset(config["data"], key_columns=dynamic)
    names = [f.name for f in dataset.features]
    unknown = sorted(set(emb_cfg["tables"]) - set(names))
    if unknown:
        raise ConfigError(f"embedding.tables names {unknown}, which the data does not have; its features are "
                          f"{names}")
    if dataset.n_samples("train") == 0:
        raise ConfigError(f"[data]: the training split of {dataset!r} is empty")
    check_fits(9 * dataset.n_samples("eval"), f"the scores of the eval split ({dataset.n_samples('eval'):,} "
                                              f"samples, 9 bytes each for the exact AUC)", error=ConfigError)
    try:
        features = feature_configs(dataset.features, emb_cfg["dim"], storage=lambda name: table_storage(emb_cfg, name),
                                   dynamic=lambda name: table_dynamic(emb_cfg, name))
    except ValueError as e:  # a table configuration refused (TableConfig checks its sizes)
        raise ConfigError(f"[embedding]: {e}") from None
    for name, spec in emb_cfg["tables"].items():
        if "optimizer" in spec:  # else the table only says how it is stored
            features[name].table.optimizer = build_optimizer(spec, f"embedding.tables.{name}")
    optimizer = build_optimizer(emb_cfg)
    _check_tables_fit(dataset.features, emb_cfg["dim"],
                      {f.name: features[f.name].table.optimizer or optimizer for f in dataset.features},
                      {f.name: features[f.name].table for f in dataset.features})
    try:
        emb = Embedding(features, optimizer, seed=train["seed"])
    except ValueError as e:  # a table the engine refuses (its size, its optimizer's row function, ...)
        raise ConfigError(f"[embedding]: {e}") from None
    try:
        model = DLRM(dataset.n_dense, names, emb_cfg["dim"], model_cfg["bottom"], model_cfg["top"],
                     seed=train["seed"], dense_optimizer=build_dense_optimizer(model_cfg))
    except ValueError as e:
        raise ConfigError(f"[model] (bottom = {model_cfg['bottom']}, top = {model_cfg['top']}): {e}") from None
    return dataset, emb, model


def _check_tables_fit(features, dim: int, optimizers: dict, tables: dict) -> None:
    """Refuse tables (rows and optimizer slots, in their stored dtypes) that together could not fit in memory,
    naming the largest and where its vocabulary size comes from, before the engine allocates any."""
    def rows(f):  # a dynamic table holds up to its capacity, whatever its key space
        table = tables[f.name]
        if isinstance(table, DynamicTableConfig):
            return table.capacity, f"embedding.tables.{f.name}.capacity"
        return f.vocabulary_size, f.source

    def table_bytes(f):  # rows and slots, and a dynamic table's key map and admission sketch
        table = tables[f.name]
        stored = DenseStorage.bytes_needed(rows(f)[0], dim, optimizers[f.name].slot_dims, table.stored_formats)
        return stored + (map_bytes(table) if isinstance(table, DynamicTableConfig) else 0)

    sizes = {f.name: table_bytes(f) for f in features}
    if not sizes:
        return
    largest = max(features, key=lambda f: sizes[f.name])
    n_rows, source = rows(largest)
    source = f" from {source}" if source else ""
    dtypes = sorted({tables[f.name].weights_dtype for f in features})
    check_fits(sum(sizes.values()), f"the embedding tables ({len(sizes)} tables of embedding.dim = {dim} "
                                    f"{'/'.join(dtypes)} values a row, with their optimizer slots; largest: table "
                                    f"'{largest.name}', {n_rows:,} rows{source}, "
                                    f"{sizes[largest.name]:,} bytes)", error=ConfigError)


def _train_batches(dataset, batch_size: int, epoch: int, skip: int):
    """The epoch's training batches from batch ``skip`` on (``start=`` when the reader has it)."""
    params = inspect.signature(dataset.batches).parameters
    kwargs = {"epoch": epoch} if "epoch" in params else {}
    if "start" in params:
        return dataset.batches(batch_size, "train", start=skip * batch_size, **kwargs)
    batches = dataset.batches(batch_size, "train", **kwargs)
    for _ in range(skip):
        next(batches, None)
    return batches


def evaluate(dataset, emb, model, batch_size: int) -> dict:
    """Log loss, AUC, sample count and click rate of the model on the eval split (read-only lookups: no table
    changes)."""
    metrics = BinaryMetrics()
    for batch in dataset.batches(batch_size, "eval"):
        acts, _ = emb.lookup(batch.ids, batch.weights, training=False)
        logits, _ = model.forward(batch.dense, acts)
        metrics.update(batch.labels, sigmoid(logits))
    return _defined(metrics.result(allow_undefined=True))


def _defined(obj):
    """``obj`` with every NaN or infinite float replaced by ``None`` (strict JSON's "undefined")."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _defined(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_defined(v) for v in obj]
    return obj


def _number(x, what: str = "") -> str:
    return "undefined" + (f" ({what})" if what else "") if x is None else f"{x:.4f}"


def _write_json(obj, path: str) -> None:
    """Write ``obj`` as strict JSON to ``path`` atomically: readers see the old file or the new one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_LOSSES = "trainer/losses"


def _resume_key(config: dict) -> dict:
    """What must not change between a run and its resumption: anything that decides the samples a step
    sees or the model it trains (epochs, output, checkpoint and eval frequency may change)."""
    train = config["train"]
    return {"data": config["data"], "embedding": _without_default_storage(config["embedding"]),
            "model": config["model"], "train": {k: train[k] for k in ("batch_size", "seed", "max_steps")}}


def _without_default_storage(embedding: dict) -> dict:
    """``[embedding]`` without storage keys that say what their absence says (float32, stochastic rounding):
    a run resumes whether it spells the defaults out or not, as checkpoints from before the keys did."""
    def strip(spec):
        return {k: v for k, v in spec.items() if not (k in STORAGE_KEYS and v == STORAGE_DEFAULTS[k])}
    out = strip(embedding)
    if isinstance(out.get("tables"), dict):
        out["tables"] = {name: strip(spec) if isinstance(spec, dict) else spec
                         for name, spec in out["tables"].items()}
    return out


def _save(emb, model, path, state, config):
    extra = model.state_dict()
    extra[_LOSSES] = np.asarray(state["losses"], np.float64)  # arrays grow cheaply; JSON would not
    trainer = {k: v for k, v in state.items() if k != "losses"}
    emb.save(path, extra=extra, metadata={"trainer": trainer, "run": _resume_key(config)})


def _resume(emb, model, path, config, state):
    """Load the engine, the dense model and the trainer's position from ``path``, refusing a changed run."""
    def read(snap):  # everything is read and checked before the engine changes (load is the last step)
        saved = snap.manifest.get("metadata") or {}
        if "trainer" not in saved or "run" not in saved:
            raise CheckpointError("it was not written by the trainer (no trainer metadata)")
        current = json.loads(json.dumps(_resume_key(config)))
        if saved["run"] != current:
            changed = sorted(f"{section}.{key}" for section in current for key in
                             set(current[section]) | set(saved["run"].get(section, {}))
                             if current[section].get(key) != saved["run"].get(section, {}).get(key))
            raise CheckpointError(f"the run was started with other settings ({', '.join(changed)} differ); only "
                                  f"train.epochs, output, checkpoint_every and eval_every may change on resume")
        arrays, _ = read_extra(snap)
        emb.load(snap)
        return saved, arrays

    try:
        saved, arrays = read_current(path, read)  # a save by another process meanwhile: read the new one
        losses = arrays.pop(_LOSSES)
        try:
            model.load_state_dict(arrays)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"its dense model does not fit this one: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume from {path}: {e}") from None
    state.update(saved["trainer"])
    state["losses"] = losses.tolist()


def run(config: dict, resume: bool = False, out=print, progress_stream=None, title: str | None = None) -> dict:
    """Train as ``config`` says (see :mod:`embedcore.app.run_config`); returns the metrics also written to disk.

    NumPy's BLAS runs on one thread meanwhile (see :mod:`embedcore.app.blas_threads`).
    """
    check(config)
    with blas_threads(1):
        return _run(config, resume, out, progress_stream, title)


def _run(config, resume, out, progress_stream, title):
    train = config["train"]
    output = train["output"]
    checkpoint = os.path.join(output, "checkpoint")
    started = time.perf_counter()
    dataset, emb, model = _build(config)
    build_seconds = time.perf_counter() - started
    os.makedirs(output, exist_ok=True)  # only once everything is built: a refused run writes nothing
    out(f"data: {dataset!r}")
    out(f"engine: {emb!r} (built in {build_seconds:.1f} s, Numba compilation included)")
    out(f"tables: {_storage_line(emb)}")
    optimum = _defined(dataset.optimum("eval")) if hasattr(dataset, "optimum") else None

    batch_size, epochs = train["batch_size"], train["epochs"]
    steps_per_epoch = math.ceil(dataset.n_samples("train") / batch_size)
    if train["max_steps"]:
        steps_per_epoch = min(steps_per_epoch, train["max_steps"])
    state = {"epoch": 0, "step_in_epoch": 0, "losses": [], "epochs": [], "evaluations": [],
             "first_step_seconds": None}
    if resume:
        _resume(emb, model, checkpoint, config, state)
        out(f"resumed from {checkpoint} at epoch {state['epoch'] + 1}, step {state['step_in_epoch']} of "
            f"{steps_per_epoch}")

    def evaluate_now():
        result = evaluate(dataset, emb, model, batch_size)
        if not state["evaluations"] or state["evaluations"][-1]["step"] != emb.step:
            state["evaluations"].append(dict(result, step=emb.step))
        return result

    eval_every = train["eval_every"]
    if eval_every and not state["evaluations"]:
        evaluate_now()  # the untrained model: where the curves start
    while state["epoch"] < epochs:
        epoch = state["epoch"]
        bar = ProgressBar(steps_per_epoch, f"epoch {epoch + 1}/{epochs}", stream=progress_stream)
        bar.done = state["step_in_epoch"]
        epoch_start = time.perf_counter()
        samples = 0
        for batch in _train_batches(dataset, batch_size, epoch, state["step_in_epoch"]):
            if state["step_in_epoch"] >= steps_per_epoch:
                break
            t0 = time.perf_counter()
            acts, ctx = emb.lookup(batch.ids, batch.weights)
            logits, cache = model.forward(batch.dense, acts)
            loss, d_logits = bce_with_logits(logits, batch.labels)
            emb.apply_gradients(model.backward(cache, d_logits), ctx)
            model.step()
            if state["first_step_seconds"] is None:  # compiles the kernels: not counted in the throughput
                state["first_step_seconds"] = time.perf_counter() - t0
                epoch_start += state["first_step_seconds"]
                samples -= len(batch)
            state["losses"].append(float(loss))
            state["step_in_epoch"] += 1
            samples += len(batch)
            bar.update(len(batch), float(loss))
            if eval_every and emb.step % eval_every == 0:
                eval_pause = time.perf_counter()
                evaluate_now()
                epoch_start += time.perf_counter() - eval_pause
            if train["checkpoint_every"] and emb.step % train["checkpoint_every"] == 0:
                _save(emb, model, checkpoint, state, config)
        bar.close()
        seconds = time.perf_counter() - epoch_start
        eval_start = time.perf_counter()
        result = evaluate_now()
        epoch_losses = state["losses"][-state["step_in_epoch"]:] if state["step_in_epoch"] else []
        record = {"epoch": epoch + 1, "step": emb.step, "train_log_loss": float(np.mean(epoch_losses)) if
                  epoch_losses else None, "eval": result, "train_seconds": seconds,
                  "train_samples_per_second": samples / max(seconds, 1e-9),
                  "eval_seconds": time.perf_counter() - eval_start}
        record = _defined(record)
        state["epochs"].append(record)
        state["epoch"], state["step_in_epoch"] = epoch + 1, 0
        _save(emb, model, checkpoint, state, config)
        metrics = _metrics(config, dataset, emb, state, optimum, build_seconds, time.perf_counter() - started, title)
        _write_json(metrics, os.path.join(output, "metrics.json"))
        beside = (f" (teacher optimum {_number(optimum['log_loss'])})" if optimum else "")
        auc_beside = (f" (teacher optimum {_number(optimum['auc'])})" if optimum else "")
        why = "empty eval split" if not result["n"] else f"the eval split's {result['n']:,} samples are of one class"
        out(f"epoch {epoch + 1}: train log loss {_number(record['train_log_loss'], 'no steps')} | eval log loss "
            f"{_number(result['log_loss'], why)}{beside} | AUC {_number(result['auc'], why)}{auc_beside} | "
            f"{record['train_samples_per_second']:,.0f} samples/s")

    metrics = _metrics(config, dataset, emb, state, optimum, build_seconds, time.perf_counter() - started, title)
    _write_json(metrics, os.path.join(output, "metrics.json"))
    drawn = learning_curve(metrics, os.path.join(output, "learning_curve.png"))
    out(f"wrote {os.path.join(output, 'metrics.json')}" +
        (f" and {os.path.join(output, 'learning_curve.png')}" if drawn else
         " (no learning_curve.png: pip install 'embedcore[plot]' for matplotlib)") +
        f"; checkpoint in {checkpoint}")
    return metrics


def _storage(emb) -> dict:
    """How the tables are stored, and the bytes of their rows and slots."""
    def described(name, table):
        info = {k: getattr(table, k) for k in STORAGE_KEYS}
        if isinstance(table, DynamicTableConfig):
            info.update(dynamic=True, capacity=table.capacity, keys=len(emb.embedding_tables[name]))
        return info
    return {"tables": {name: described(name, table) for name, table in emb.tables.items()},
            "table_bytes": sum(int(t.weights.nbytes) for t in emb.physical_tables),
            "slot_bytes": sum(int(s.nbytes) for t in emb.physical_tables for s in t.slots)}


def _storage_line(emb) -> str:
    """E.g. ``"26 tables, rows bfloat16, slots float32, rounding stochastic: 1.2 MB of rows, 2.4 MB of slots"``."""
    tables = list(emb.tables.values())
    kinds = []
    for what, key in (("rows", "weights_dtype"), ("slots", "slot_dtype")):
        kinds.append(f"{what} " + "/".join(sorted({getattr(t, key) for t in tables})))
    if any("16" in t.weights_dtype or "16" in t.slot_dtype for t in tables):
        rounding = sorted({"stochastic" if t.stochastic_rounding else "to nearest" for t in tables
                           if "16" in t.weights_dtype or "16" in t.slot_dtype})
        kinds.append(f"rounding {'/'.join(rounding)}")
    info = _storage(emb)
    return (f"{len(tables)} tables, {', '.join(kinds)}: {_size(info['table_bytes'])} of rows, "
            f"{_size(info['slot_bytes'])} of slots")


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _metrics(config, dataset, emb, state, optimum, build_seconds, total_seconds, title) -> dict:
    final = state["epochs"][-1]["eval"] if state["epochs"] else None
    return _defined({
        "title": title or f"embedcore {__version__}: DLRM on {dataset.name}",
        "config": config,
        "dataset": {"name": dataset.name, "train_samples": dataset.n_samples("train"),
                    "eval_samples": dataset.n_samples("eval"),
                    "features": [{"name": f.name, "vocabulary_size": f.vocabulary_size, "max_ids": f.max_ids,
                                  "weighted": f.weighted} for f in dataset.features], "n_dense": dataset.n_dense},
        "storage": _storage(emb),
        "optimum": optimum,
        "final": final,
        "gap_to_optimum": ({k: (None if final[k] is None or optimum[k] is None else
                                (final[k] - optimum[k]) * (1 if k == "log_loss" else -1))
                            for k in ("log_loss", "auc")} if final and optimum else None),
        "epochs": state["epochs"],
        "evaluations": state["evaluations"],
        "train_loss_per_step": state["losses"],
        "steps": emb.step,
        "timing": {"build_seconds": build_seconds, "first_step_seconds": state["first_step_seconds"],
                   "total_seconds": total_seconds},
        "environment": {"embedcore": __version__, "python": platform.python_version(), "numpy": np.__version__,
                        "numba_threads": _numba_threads(), "machine": platform.machine()},
    })


def _numba_threads() -> int:
    import numba
    return int(numba.get_num_threads())
