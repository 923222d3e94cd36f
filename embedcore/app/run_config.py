"""The configuration of a training run (``embedcore train --config FILE``), read from TOML or JSON.

Sections and keys (every key is optional; unknown keys are errors that list the known ones)::

    [data]                     # kind = "synthetic" | "movielens" | "csv"; other keys are the reader's arguments
    kind = "synthetic"         #   synthetic: n_train, n_eval, seed, vocabulary_sizes, n_dense, ... (SyntheticClickLog)
    n_train = 200000           #   movielens: path, threshold, eval_fraction, seed (MovieLens)
                               #   csv: path, categorical, dense, label, vocabulary_sizes, hash_buckets, ... (CsvClickLog;
                               #   key_columns need not be given: a dynamic table's column is one)
    [embedding]
    dim = 16                   # width of every table (the DLRM interaction needs one width)
    optimizer = "adagrad"      # sgd | adagrad | adagrad_momentum | adam | ftrl | rowwise_adagrad,
                               # or "module:function", a custom computation (CustomOptimizer)
    learning_rate = 0.05       # other keys: the optimizer's own arguments (initial_accumulator_value, ...;
    initial_accumulator_value = 0.001  # for a custom computation slot_names, slot_initializers, hyperparameters,
                               # slot_dims). Naming another optimizer drops the default's arguments.
                               # Accumulators start at 1e-3, not TensorFlow's 0.1: a mean loss over a batch
                               # gives per-row gradients near 1e-3, which 0.1 would shrink a hundredfold.
    weights_dtype = "float32"  # how every table's rows are stored: float32 | bfloat16 | float16 (2 bytes a value)
    slot_dtype = "float32"     # how the optimizer's slots are stored: the same choices
    stochastic_rounding = true # round 16-bit values stochastically (unbiased), else to nearest
    [embedding.tables.C3]      # per-table overrides: the optimizer, same keys as [embedding] (no dim), and/or
    optimizer = "sgd"          # weights_dtype, slot_dtype, stochastic_rounding (a table naming no optimizer
                               # keeps [embedding]'s; one that names one takes none of [embedding]'s arguments)
    [embedding.tables.C7]      # a dynamic table (DynamicTableConfig): its ids are 64-bit keys, not rows
    dynamic = true             # csv data: a hashed column's ids (hash_buckets) are embedcore.hash_keys(string),
                               # no buckets; other columns' are 64-bit integers as they are; synthetic and
                               # movielens ids are the keys
    capacity = 100000          # the most keys (rows) it holds; required with dynamic = true
    admission = {min_count = 3}  # optional, CountAdmission's min_count, sketch_width, sketch_depth (default: admit
                               # every key at once)
    eviction = "lru"           # optional: "lru" | "lfu" | {ttl = steps} (default none: a full table refuses new keys)
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

Every key is checked by one schema (:data:`SCHEMA`, :data:`DATA_SCHEMA` per ``data.kind``,
:data:`OPTIMIZER_SCHEMA`, :data:`STORAGE_SCHEMA`) before anything runs: its type, its range, and for numbers
finiteness within float32's range (``nan``, ``inf`` and ``1e39`` are refused). A ``module:function`` optimizer
must name a Python function (importing the module is the only code run to find out). ``train.output`` must be a
folder or creatable as one. A refusal is a :class:`ConfigError` naming the key, what it must be and the value.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import stat
import tomllib

import numpy as np

from .. import optimizers as _optimizers
from ..config import DTYPES
from ..kernels.hash_map import MAX_CAPACITY
from ..tables.policies import LFU, LRU, TTL, CountAdmission
from ..checkpoint.config_codec import constructor_parameters, import_function, is_python_function
from .data import CsvClickLog, MovieLens, SyntheticClickLog
from .data.batch import EXCERPT_CHARS
from .models import dense_optimizers as _dense

__all__ = ["ConfigError", "DEFAULTS", "load_config", "merge", "check", "build_dataset", "build_optimizer",
           "build_dense_optimizer", "table_storage", "table_dynamic", "EMBEDDING_OPTIMIZERS", "STORAGE_KEYS",
           "STORAGE_DEFAULTS", "DYNAMIC_KEYS", "DYNAMIC_SCHEMA"]


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

#: How a table is stored (``TableConfig``'s arguments of the same names): set in ``[embedding]`` for every
#: table, in ``[embedding.tables.NAME]`` for one. Not in :data:`DEFAULTS`, so that the configuration of a run
#: that sets none of them (and its checkpoint's resume key) reads as before they existed.
STORAGE_DEFAULTS = {"weights_dtype": "float32", "slot_dtype": "float32", "stochastic_rounding": True}
STORAGE_KEYS = tuple(STORAGE_DEFAULTS)

DATASETS = {"synthetic": SyntheticClickLog, "movielens": MovieLens, "csv": CsvClickLog}
EMBEDDING_OPTIMIZERS = {"sgd": _optimizers.SGD, "adagrad": _optimizers.Adagrad,
                        "adagrad_momentum": _optimizers.AdagradMomentum, "adam": _optimizers.Adam,
                        "ftrl": _optimizers.FTRL, "rowwise_adagrad": _optimizers.RowwiseAdagrad}
DENSE_OPTIMIZERS = {"sgd": _dense.SGD, "adagrad": _dense.Adagrad, "adam": _dense.Adam}


_MAX_CONFIG_BYTES = 1 << 20


def load_config(path) -> dict:
    """Read a TOML (``.toml``) or JSON file and merge it over :data:`DEFAULTS`, checked (:func:`check`).

    Only a regular file of at most 1 MiB is read (a FIFO or ``/dev/zero`` is refused, not waited on or read
    without end)."""
    path = os.fspath(path)
    raw = _read_config_file(path)
    try:
        user = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        kind = "JSON" if path.endswith(".json") else "TOML"
        raise ConfigError(f"{path}: not valid {kind}: {_clip(str(e), 200)}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{path}: the config must be a table/object of sections")
    config = merge(DEFAULTS, user)
    check(config)
    if path and config["data"].get("path"):  # a data path is relative to the config file
        config["data"]["path"] = os.path.join(os.path.dirname(os.path.abspath(path)), config["data"]["path"])
    return config


def _read_config_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: cannot read the config file (not a regular file)")
        try:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: the config file is larger than {_MAX_CONFIG_BYTES >> 20} MiB")
    return raw


def merge(base: dict, override: dict, where: str = "") -> dict:
    """``base`` with ``override``'s keys replaced, section by section; unknown sections, and a section that
    is not a table, are errors."""
    out = copy.deepcopy(base)
    if "optimizer" in override and override.get("optimizer") != base.get("optimizer"):
        # Another optimizer: the default optimizer's own arguments no longer apply (how tables are stored does).
        out = {k: v for k, v in out.items() if k in ("dim", "tables", *STORAGE_KEYS)}
    for key, value in override.items():
        here = f"{where}.{key}" if where else key
        if not where and key not in base:
            raise ConfigError(f"unknown section [{_clip(str(key))}]; the sections are {sorted(base)}")
        if isinstance(out.get(key), dict) and not isinstance(value, dict):
            raise ConfigError(f"[{here}] must be a table of keys, got {_shown(value)}")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "tables":
            out[key] = merge(out[key], value, here)
        elif key == "tables":
            out[key] = copy.deepcopy(value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------------------------
# The schema: one rule per key. A rule is called with (value, "section.key") and raises ConfigError naming
# the key, what it must be and the value it got.

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SEED_LIMIT = 2 ** 63


def _clip(text: str, limit: int = EXCERPT_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _shown(value) -> str:
    """``repr(value)`` for a message, at most about 80 characters."""
    return _clip(repr(value))


class _Rule:
    """A check of one value: ``ok(value)`` decides, ``text`` says what is expected."""

    def __init__(self, text, ok):
        self.text, self.ok = text, ok

    def __call__(self, value, where):
        if not self.ok(value):
            raise ConfigError(f"{where} must be {self.text}, got {_shown(value)}")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(lo, hi=None):
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return _Rule(text, lambda v: _is_int(v) and v >= lo and (hi is None or v <= hi))


def _number(lo=None, hi=None, lo_open=False, hi_open=False):
    """A finite number within float32's range (every number ends up a float32 or float64), in the bounds."""
    if lo is not None and hi is not None:
        bounds = f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        bounds = f" {'>' if lo_open else '>='} {lo}"
    else:
        bounds = ""

    def ok(v):
        if not _is_number(v) or not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or (v < hi if hi_open else v <= hi)

    return _Rule(f"a finite number{bounds}", ok)


def _string(choices=None, length=None):
    if choices is not None:
        return _Rule(f"one of {sorted(choices)}", lambda v: isinstance(v, str) and v in choices)
    if length is not None:
        return _Rule(f"a string of {length} character(s)", lambda v: isinstance(v, str) and len(v) == length)
    return _Rule("a non-empty string", lambda v: isinstance(v, str) and v != "")


_BOOLEAN = _Rule("true or false", lambda v: isinstance(v, bool))


def _list(item, text, length=None):
    def ok(v):
        return isinstance(v, list) and (length is None or len(v) == length)

    def check_list(value, where):
        if not ok(value):
            raise ConfigError(f"{where} must be {text}, got {_shown(value)}")
        for k, x in enumerate(value):
            item(x, f"{where}[{k}]")
    return check_list


def _mapping(item, text):
    def check_mapping(value, where):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be {text}, got {_shown(value)}")
        for k, x in value.items():
            item(x, f"{where}.{k}")
    return check_mapping


def _either(text, *rules):
    """The first rule whose shape matches decides (``shape(value)``), else the value is refused."""
    def check_either(value, where):
        for shape, rule in rules:
            if shape(value):
                return rule(value, where)
        raise ConfigError(f"{where} must be {text}, got {_shown(value)}")
    return check_either


def _optional(rule):
    def check_optional(value, where):
        if value is not None:
            rule(value, where)
    return check_optional


def _plain_value(value, where):
    """An optimizer argument the optimizer itself checks further: a string, a boolean, a finite number
    within float32's range, or a list of those."""
    if isinstance(value, list):
        for k, x in enumerate(value):
            _plain_value(x, f"{where}[{k}]")
    elif value is not None and not isinstance(value, (str, bool)):
        _number()(value, where)


_VOCABULARY = _integer(1, 2 ** 31 - 1)
_FRACTION = _number(0, 1)
_SEED = _integer(0, _SEED_LIMIT - 1)
_NAMES = _list(_string(), "a list of column names")
_PATH = _string()

#: Every key of every section (the data section: per ``data.kind``), with its rule.
SCHEMA = {
    "embedding": {"dim": _integer(1, 2 ** 31 - 1)},
    "model": {"bottom": _list(_integer(1), "a list of layer sizes"), "top": _list(_integer(1), "a list of layer sizes"),
              "dense_optimizer": _string(("sgd", "adagrad", "adam")), "dense_learning_rate": _number(0, lo_open=True)},
    "train": {"epochs": _integer(1), "batch_size": _integer(1, 2 ** 31 - 1), "seed": _SEED,
              "output": _string(), "checkpoint_every": _integer(0), "eval_every": _integer(0),
              "max_steps": _integer(0)},
}
DATA_SCHEMA = {
    "synthetic": {
        "n_train": _integer(1), "n_eval": _integer(1), "seed": _SEED,
        "vocabulary_sizes": _either("a list of vocabulary sizes or a table name -> size",
                                    (lambda v: isinstance(v, list), _list(_VOCABULARY, "")),
                                    (lambda v: isinstance(v, dict), _mapping(_VOCABULARY, ""))),
        "n_dense": _integer(0), "multi_hot": _mapping(
            _either("max_ids or [max_ids, weighted]", (_is_int, _integer(1)),
                    (lambda v: isinstance(v, list) and len(v) == 2,
                     lambda v, where: (_integer(1)(v[0], f"{where}[0]"), _BOOLEAN(v[1], f"{where}[1]")))),
            "a table feature -> max_ids or [max_ids, weighted]"),
        "zipf_exponent": _either("a number > 1 or a range [lo, hi]", (_is_number, _number(1, lo_open=True)),
                                 (lambda v: isinstance(v, list), _list(_number(1, lo_open=True), "[lo, hi]", 2))),
        "n_interactions": _integer(0), "interaction_dim": _integer(1, 2 ** 16), "logit_std": _number(0),
        "click_rate": _number(0, 1, lo_open=True, hi_open=True),
        "variance_shares": _list(_number(0), "a list of 3 numbers >= 0", 3),
        "scatter_ids": _BOOLEAN, "name": _string()},
    "movielens": {"path": _PATH, "threshold": _number(), "eval_fraction": _FRACTION, "seed": _SEED,
                  "split": _string(("hash", "time")), "name": _string()},
    "csv": {"path": _PATH, "categorical": _optional(_NAMES), "dense": _optional(_NAMES), "label": _string(),
            "vocabulary_sizes": _mapping(_integer(1, 10 ** 18), "a table column -> vocabulary size"),
            "hash_buckets": _either("a bucket count or a table column -> bucket count",
                                    (_is_int, _integer(1, 2 ** 32)),
                                    (lambda v: isinstance(v, dict), _mapping(_integer(1, 2 ** 32), ""))),
            "eval_fraction": _FRACTION, "delimiter": _string(length=1),
            "combiner": _string(("sum", "mean", "sqrtn")), "seed": _SEED, "chunk_bytes": _integer(1, 1 << 30),
            "name": _string(), "key_columns": _NAMES},
}
#: How tables are stored, in ``[embedding]`` and ``[embedding.tables.NAME]``.
STORAGE_SCHEMA = {"weights_dtype": _string(DTYPES), "slot_dtype": _string(DTYPES), "stochastic_rounding": _BOOLEAN}
#: A dynamic table, in ``[embedding.tables.NAME]``: ``dynamic = true`` and ``DynamicTableConfig``'s arguments.
DYNAMIC_KEYS = ("dynamic", "capacity", "admission", "eviction")
EVICTIONS = {"lru": LRU, "lfu": LFU}
_COUNT = _integer(1, 2 ** 32 - 1)
ADMISSION_SCHEMA = {"min_count": _COUNT, "sketch_width": _COUNT, "sketch_depth": _integer(1, 16)}


def _admission(value, where):
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table such as {{min_count = 3}} (CountAdmission's min_count, "
                          f"sketch_width, sketch_depth), got {_shown(value)}")
    _check_keys(value, ADMISSION_SCHEMA, where)
    _check_section(value, ADMISSION_SCHEMA, where)


def _eviction(value, where):
    if isinstance(value, str) and value in EVICTIONS:
        return
    if isinstance(value, dict) and list(value) == ["ttl"]:
        return _integer(1, 2 ** 31 - 1)(value["ttl"], f"{where}.ttl")
    raise ConfigError(f"{where} must be \"lru\", \"lfu\" or {{ttl = steps}}, got {_shown(value)}")


DYNAMIC_SCHEMA = {"dynamic": _BOOLEAN, "capacity": _integer(1, MAX_CAPACITY), "admission": _admission,
                  "eviction": _eviction}
#: Rules of the optimizer arguments every optimizer shares; the others must be plain values
#: (:func:`_plain_value`) and are checked by the optimizer's constructor.
OPTIMIZER_SCHEMA = {"learning_rate": _number(0, lo_open=True)}


def _check_keys(section: dict, allowed, where: str):
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(f"[{where}]: unknown key(s) {[_clip(str(k)) for k in unknown[:20]]}; allowed: "
                          f"{sorted(allowed)}")


def _check_section(section: dict, rules: dict, where: str):
    for key, value in section.items():
        rules[key](value, f"{where}.{key}")


def check(config: dict) -> None:
    """Check every key of every section against :data:`SCHEMA` (type, range, finiteness), the optimizer
    paths (a ``module:function`` must name a Python function) and the output folder, before anything runs;
    raise :class:`ConfigError` naming the first bad key. Idempotent."""
    for name in DEFAULTS:
        if not isinstance(config.get(name), dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {_shown(config.get(name))}")
    data = config["data"]
    if data.get("kind") not in DATASETS:
        raise ConfigError(f"data.kind must be one of {sorted(DATASETS)}, got {_shown(data.get('kind'))}")
    kind = data["kind"]
    _check_keys(data, ["kind"] + list(DATA_SCHEMA[kind]), f"data] (kind {kind!r}")
    needed = [name for name, p in inspect.signature(DATASETS[kind]).parameters.items()
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in needed if name not in data]
    if missing:
        raise ConfigError(f"[data] kind {kind!r} needs the key(s) {missing}")
    _check_section({k: v for k, v in data.items() if k != "kind"}, DATA_SCHEMA[kind], "data")
    emb = config["embedding"]
    SCHEMA["embedding"]["dim"](emb.get("dim"), "embedding.dim")
    _check_storage(emb, "embedding")
    _check_optimizer(emb, "embedding", extra=("dim", "tables", *STORAGE_KEYS))
    if not isinstance(emb.get("tables"), dict):
        raise ConfigError(f"embedding.tables must be a table of per-table overrides, got {_shown(emb.get('tables'))}")
    for name, spec in emb["tables"].items():
        where = f"embedding.tables.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where} must be a table of optimizer and storage settings, got {_shown(spec)}")
        _check_storage(spec, where)
        _check_dynamic(spec, where)
        if "optimizer" in spec or set(spec) - set(STORAGE_KEYS) - set(DYNAMIC_KEYS):
            _check_optimizer(spec, where, extra=STORAGE_KEYS + DYNAMIC_KEYS)
    for section in ("model", "train"):
        _check_keys(config[section], DEFAULTS[section], section)
        missing = sorted(set(DEFAULTS[section]) - set(config[section]))
        if missing:
            raise ConfigError(f"[{section}] lacks the key(s) {missing}")
        _check_section(config[section], SCHEMA[section], section)
    _check_output(config["train"]["output"])


def _check_output(output: str) -> None:
    """``train.output`` must be a folder or creatable as one: no file where a folder is needed."""
    path = os.path.abspath(output)
    while True:
        if os.path.lexists(path):
            if not os.path.isdir(path):
                what = "is" if path == os.path.abspath(output) else f"lies under {path!r}, which is"
                raise ConfigError(f"train.output {output!r} {what} a file, not a folder")
            return
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _optimizer_class(name, where):
    if not isinstance(name, str):
        raise ConfigError(f"{where}.optimizer must be a name or 'module:function', got {_shown(name)}")
    if ":" in name:
        return _optimizers.CustomOptimizer
    if name not in EMBEDDING_OPTIMIZERS:
        raise ConfigError(f"{where}.optimizer {_shown(name)} is not one of {sorted(EMBEDDING_OPTIMIZERS)} and not a "
                          f"'module:function' custom computation")
    return EMBEDDING_OPTIMIZERS[name]


def _custom_computation(path: str, where: str):
    """The Python function ``module:function`` names. Importing runs the module, as naming it asks; nothing
    else is called, and anything but a ``def`` function (also one wrapped by ``tf.function``, ``jax.jit`` or
    ``numba.njit``) is refused: a builtin, a class, a callable object."""
    try:
        fn = import_function(path)
    except Exception as e:  # the user's module may fail to import in any way
        raise ConfigError(f"{where}.optimizer: cannot import the custom computation {_shown(path)}: "
                          f"{type(e).__name__}: {_clip(str(e), 200)}") from None
    if not is_python_function(fn):
        raise ConfigError(f"{where}.optimizer {_shown(path)} names a {type(fn).__name__}, not a Python function "
                          f"(a custom computation is a 'def f(gradient, embedding_table, slot_variables, "
                          f"learning_rate, hyperparameters)')")
    return fn


def _check_storage(spec: dict, where: str) -> None:
    for key in STORAGE_KEYS:
        if key in spec:
            STORAGE_SCHEMA[key](spec[key], f"{where}.{key}")


def _check_dynamic(spec: dict, where: str) -> None:
    """A table's dynamic keys: ``dynamic`` a boolean; with ``dynamic = true`` a ``capacity`` (required),
    ``admission`` and ``eviction`` (optional); without it, none of them."""
    if "dynamic" in spec:
        DYNAMIC_SCHEMA["dynamic"](spec["dynamic"], f"{where}.dynamic")
    given = [k for k in DYNAMIC_KEYS[1:] if k in spec]
    if not spec.get("dynamic"):
        if given:
            raise ConfigError(f"{where}.{given[0]} (= {_shown(spec[given[0]])}) is for dynamic tables: set "
                              f"{where}.dynamic = true, or drop it")
        return
    if "capacity" not in spec:
        raise ConfigError(f"{where}.dynamic = true needs {where}.capacity: the most keys (rows) the table holds, "
                          f"an integer in [1, {MAX_CAPACITY}]")
    for key in given:
        DYNAMIC_SCHEMA[key](spec[key], f"{where}.{key}")


def table_dynamic(embedding: dict, name: str) -> dict | None:
    """``DynamicTableConfig``'s ``capacity``, ``admission`` and ``eviction`` for table ``name`` when its
    ``[embedding.tables.NAME]`` says ``dynamic = true``, else None."""
    spec = embedding.get("tables", {}).get(name, {})
    if not spec.get("dynamic"):
        return None
    admission = spec.get("admission")
    eviction = spec.get("eviction")
    if isinstance(eviction, dict):
        eviction = TTL(eviction["ttl"])
    elif eviction is not None:
        eviction = EVICTIONS[eviction]()
    return {"capacity": spec["capacity"], "admission": None if admission is None else CountAdmission(**admission),
            "eviction": eviction}


def table_storage(embedding: dict, name: str) -> dict:
    """``TableConfig``'s storage arguments for table ``name``: its ``[embedding.tables.NAME]`` keys over
    ``[embedding]``'s over :data:`STORAGE_DEFAULTS`."""
    spec = embedding.get("tables", {}).get(name, {})
    return {k: spec.get(k, embedding.get(k, default)) for k, default in STORAGE_DEFAULTS.items()}


def _check_optimizer(spec, where, extra=()):
    if "optimizer" not in spec:
        others = sorted(set(spec) - set(extra))
        raise ConfigError(f"[{where}] needs an optimizer" + (
            f" to take {[_clip(str(k)) for k in others[:20]]} (without one, only {list(extra)})" if others else ""))
    cls = _optimizer_class(spec["optimizer"], where)
    allowed = [a for a in constructor_parameters(cls) if a != "custom_computation"] + ["optimizer", *extra]
    _check_keys(spec, allowed, f"{where}] (optimizer {spec['optimizer']!r}")
    for key, value in spec.items():
        if key in ("optimizer", *extra):
            continue
        OPTIMIZER_SCHEMA.get(key, _plain_value)(value, f"{where}.{key}")
    if cls is _optimizers.CustomOptimizer:
        _custom_computation(spec["optimizer"], where)


def build_optimizer(spec: dict, where: str = "embedding") -> _optimizers.Optimizer:
    """An embedding optimizer from ``{"optimizer": name or "module:function", **arguments}``."""
    cls = _optimizer_class(spec["optimizer"], where)
    args = {k: v for k, v in spec.items() if k not in ("optimizer", "dim", "tables", *STORAGE_KEYS, *DYNAMIC_KEYS)}
    try:
        if cls is _optimizers.CustomOptimizer:
            return cls(_custom_computation(spec["optimizer"], where), **args)
        return cls(**args)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"[{where}] optimizer {spec['optimizer']!r}: {_clip(str(e), 400)}") from None


def build_dense_optimizer(model: dict):
    return DENSE_OPTIMIZERS[model["dense_optimizer"]](model["dense_learning_rate"])


def build_dataset(data: dict, key_columns=()):
    """The dataset ``[data]`` describes. ``key_columns``: the features of dynamic tables, whose ids are 64-bit
    keys: a CSV log reads their cells as keys (:class:`~embedcore.app.data.CsvClickLog`); the other readers'
    ids are integers, keys as they are."""
    cls = DATASETS[data["kind"]]
    args = {k: v for k, v in data.items() if k != "kind"}
    if key_columns and cls is CsvClickLog:
        given = list(args.get("key_columns", []))
        args["key_columns"] = given + [c for c in key_columns if c not in given]
    try:
        return cls(**args)
    except (ValueError, OSError) as e:
        raise ConfigError(f"[data] kind {data['kind']!r}: {e}") from None
