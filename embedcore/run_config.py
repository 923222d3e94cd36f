"""The configuration of a training run (``embedcore train --config FILE``), read from TOML or JSON.

Sections and keys (every key is optional; unknown keys are errors that list the known ones)::

    [data]                     # kind = "synthetic" | "movielens" | "csv"; other keys are the reader's arguments
    kind = "synthetic"         #   synthetic: n_train, n_eval, seed, vocabulary_sizes, n_dense, ... (SyntheticClickLog)
    n_train = 200000           #   movielens: path, threshold, eval_fraction, seed (MovieLens)
                               #   csv: path, categorical, dense, label, vocabulary_sizes, hash_buckets, ... (CsvClickLog)
    [embedding]
    dim = 16                   # width of every table (the DLRM interaction needs one width)
    optimizer = "adagrad"      # sgd | adagrad | adagrad_momentum | adam | ftrl | rowwise_adagrad,
                               # or "module:function", a custom computation (CustomOptimizer)
    learning_rate = 0.05       # other keys: the optimizer's own arguments (initial_accumulator_value, ...;
    initial_accumulator_value = 0.001  # for a custom computation slot_names, slot_initializers, hyperparameters,
                               # slot_dims). Naming another optimizer drops the default's arguments.
                               # Accumulators start at 1e-3, not TensorFlow's 0.1: a mean loss over a batch
                               # gives per-row gradients near 1e-3, which 0.1 would shrink a hundredfold.
    [embedding.tables.C3]      # per-table optimizer overrides, same keys as [embedding] (no dim)
    optimizer = "sgd"
    [model]                    # the NumPy DLRM head
    bottom = [64]
    top = [64, 32]
    dense_optimizer = "adam"   # sgd | adagrad | adam
    dense_learning_rate = 0.001
    [train]
    epochs = 1
    batch_size = 1024
    seed = 0                   # tables' and dense weights' initial values
    output = "runs/embedcore"  # metrics.json, learning_curve.png, checkpoint/
    checkpoint_every = 0       # also save every N steps (0: at the end of each epoch only)
    eval_every = 0             # also score the eval split every N steps and before the first (0: epoch ends)
    max_steps = 0              # stop each epoch after N steps (0: the whole epoch)
"""

from __future__ import annotations

import copy
import json
import os
import tomllib

from . import optimizers as _optimizers
from .checkpoint.config_codec import constructor_parameters, import_function
from .data import CsvClickLog, MovieLens, SyntheticClickLog
from .models import dense_optimizers as _dense

__all__ = ["ConfigError", "DEFAULTS", "load_config", "merge", "check", "build_dataset", "build_optimizer",
           "build_dense_optimizer", "EMBEDDING_OPTIMIZERS"]


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the key."""


DEFAULTS = {
    "data": {"kind": "synthetic"},
    "embedding": {"dim": 16, "optimizer": "adagrad", "learning_rate": 0.05, "initial_accumulator_value": 0.001,
                  "tables": {}},
    "model": {"bottom": [64], "top": [64, 32], "dense_optimizer": "adam", "dense_learning_rate": 0.001},
    "train": {"epochs": 1, "batch_size": 1024, "seed": 0, "output": "runs/embedcore", "checkpoint_every": 0,
              "eval_every": 0, "max_steps": 0},
}

DATASETS = {"synthetic": SyntheticClickLog, "movielens": MovieLens, "csv": CsvClickLog}
EMBEDDING_OPTIMIZERS = {"sgd": _optimizers.SGD, "adagrad": _optimizers.Adagrad,
                        "adagrad_momentum": _optimizers.AdagradMomentum, "adam": _optimizers.Adam,
                        "ftrl": _optimizers.FTRL, "rowwise_adagrad": _optimizers.RowwiseAdagrad}
DENSE_OPTIMIZERS = {"sgd": _dense.SGD, "adagrad": _dense.Adagrad, "adam": _dense.Adam}


def load_config(path) -> dict:
    """Read a TOML (``.toml``) or JSON file and merge it over :data:`DEFAULTS`, checked."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    try:
        user = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise ConfigError(f"{path}: not valid {kind}: {e}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{path}: the config must be a table/object of sections")
    config = merge(DEFAULTS, user)
    if path and config["data"].get("path"):  # a data path is relative to the config file
        config["data"]["path"] = os.path.join(os.path.dirname(os.path.abspath(path)), config["data"]["path"])
    check(config)
    return config


def merge(base: dict, override: dict, where: str = "") -> dict:
    """``base`` with ``override``'s keys replaced, section by section; unknown sections are errors."""
    out = copy.deepcopy(base)
    if "optimizer" in override and override.get("optimizer") != base.get("optimizer"):
        # Another optimizer: the default optimizer's own arguments no longer apply.
        out = {k: v for k, v in out.items() if k in ("dim", "tables")}
    for key, value in override.items():
        here = f"{where}.{key}" if where else key
        if not where and key not in base:
            raise ConfigError(f"unknown section [{key}]; the sections are {sorted(base)}")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "tables":
            out[key] = merge(out[key], value, here)
        elif key == "tables":
            out[key] = copy.deepcopy(value)
        else:
            out[key] = value
    return out


def _check_keys(section: dict, allowed, where: str):
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"[{where}]: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive_int(value, where, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigError(f"{where} must be an integer >= {0 if allow_zero else 1}, got {value!r}")


def check(config: dict) -> None:
    """Check every section's keys and simple values (the readers and optimizers check their own)."""
    data = config["data"]
    if data.get("kind") not in DATASETS:
        raise ConfigError(f"data.kind must be one of {sorted(DATASETS)}, got {data.get('kind')!r}")
    _check_keys(data, ["kind"] + constructor_parameters(DATASETS[data["kind"]]), f"data] (kind {data['kind']!r}")
    emb = config["embedding"]
    _positive_int(emb.get("dim"), "embedding.dim")
    _check_optimizer_keys(emb, "embedding", extra=("dim", "tables"))
    if not isinstance(emb.get("tables"), dict):
        raise ConfigError("embedding.tables must be a table of per-table overrides")
    for name, spec in emb["tables"].items():
        if not isinstance(spec, dict):
            raise ConfigError(f"embedding.tables.{name} must be a table of optimizer settings")
        _check_optimizer_keys(spec, f"embedding.tables.{name}")
    model = config["model"]
    _check_keys(model, DEFAULTS["model"], "model")
    for key in ("bottom", "top"):
        if not isinstance(model[key], list):
            raise ConfigError(f"model.{key} must be a list of layer sizes, got {model[key]!r}")
        for size in model[key]:
            _positive_int(size, f"each of model.{key}")
    if model["dense_optimizer"] not in DENSE_OPTIMIZERS:
        raise ConfigError(f"model.dense_optimizer must be one of {sorted(DENSE_OPTIMIZERS)}, got "
                          f"{model['dense_optimizer']!r}")
    train = config["train"]
    _check_keys(train, DEFAULTS["train"], "train")
    for key in ("epochs", "batch_size"):
        _positive_int(train[key], f"train.{key}")
    for key in ("seed", "checkpoint_every", "eval_every", "max_steps"):
        _positive_int(train[key], f"train.{key}", allow_zero=True)
    if not isinstance(train["output"], str) or not train["output"]:
        raise ConfigError(f"train.output must be a folder name, got {train['output']!r}")


def _optimizer_class(name, where):
    if not isinstance(name, str):
        raise ConfigError(f"{where}.optimizer must be a name or 'module:function', got {name!r}")
    if ":" in name:
        return _optimizers.CustomOptimizer
    if name not in EMBEDDING_OPTIMIZERS:
        raise ConfigError(f"{where}.optimizer {name!r} is not one of {sorted(EMBEDDING_OPTIMIZERS)} and not a "
                          f"'module:function' custom computation")
    return EMBEDDING_OPTIMIZERS[name]


def _check_optimizer_keys(spec, where, extra=()):
    if "optimizer" not in spec:
        raise ConfigError(f"[{where}] needs an optimizer")
    cls = _optimizer_class(spec["optimizer"], where)
    allowed = [a for a in constructor_parameters(cls) if a != "custom_computation"] + ["optimizer", *extra]
    _check_keys(spec, allowed, f"{where}] (optimizer {spec['optimizer']!r}")


def build_optimizer(spec: dict, where: str = "embedding") -> _optimizers.Optimizer:
    """An embedding optimizer from ``{"optimizer": name or "module:function", **arguments}``."""
    cls = _optimizer_class(spec["optimizer"], where)
    args = {k: v for k, v in spec.items() if k not in ("optimizer", "dim", "tables")}
    try:
        if cls is _optimizers.CustomOptimizer:
            try:
                fn = import_function(spec["optimizer"])
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"{where}.optimizer: cannot import the custom computation "
                                  f"{spec['optimizer']!r}: {e}") from None
            return cls(fn, **args)
        return cls(**args)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"[{where}] optimizer {spec['optimizer']!r}: {e}") from None


def build_dense_optimizer(model: dict):
    return DENSE_OPTIMIZERS[model["dense_optimizer"]](model["dense_learning_rate"])


def build_dataset(data: dict):
    cls = DATASETS[data["kind"]]
    args = {k: v for k, v in data.items() if k != "kind"}
    try:
        return cls(**args)
    except (TypeError, ValueError, OSError) as e:
        raise ConfigError(f"[data] kind {data['kind']!r}: {e}") from None
