"""The engine's configuration as JSON: features, tables, optimizers, initializers, functions by name.

Nothing in a checkpoint is executable. Built-in optimizers and initializers are stored as their class name
and constructor arguments; a user function (a custom computation, a callable learning rate or initializer)
is stored as its import path ``module:qualified.name``. Decoding imports such a path only when the caller
allows it (``allow_import=True``) or hands the function over (``functions={"module:name": f}``); otherwise
it raises :class:`CheckpointError` saying how.

Importing is all a checkpoint can make happen. What an imported path names is checked before it is used:
a stored optimizer or initializer class must be a subclass of embedcore's :class:`~embedcore.Optimizer` or
:class:`~embedcore.initializers.Initializer` (only those are ever called, with the stored arguments, and
only with keyword arguments their constructor declares); a stored function must be a plain Python function
(``def``, possibly compiled with ``numba.njit``), which decoding never calls: it becomes a row function, a
learning-rate or initializer callable that the engine runs when training. Anything else (``os:system``,
``builtins:eval``, ``subprocess:Popen``, another library's class) is refused with :class:`CheckpointError`
naming the manifest entry.

:func:`check_config` is the configuration's schema: every field's type and range, checked before anything
is decoded, so a malformed configuration is always a :class:`CheckpointError`.

Configurations written by an earlier embedcore are read as what they meant then (:func:`check_config` brings
them up to date in place, so loading compares and decodes the same thing): an ``Adam`` stored without
``bias_correction`` was trained with the bias-corrected learning rate, ``lr * sqrt(1 - b2^t) / (1 - b1^t)``,
embedcore's only Adam until ``Adam(bias_correction=False)`` (TensorFlow's TPU Adam) became the default, so it
is read as ``bias_correction=True``.
"""

from __future__ import annotations

import importlib
import inspect
import types

from .. import initializers as _initializers
from .. import optimizers as _optimizers
from ..config import DTYPES, DynamicTableConfig, FeatureConfig, TableConfig
from ..engine import NON_FINITE_POLICIES
from ..translate import python_function as translate_python_function
from .errors import CheckpointError

__all__ = ["encode_engine_config", "decode_engine_config", "check_config", "function_path", "import_function",
           "FunctionResolver", "decode_initializer"]

_OPTIMIZERS = {name: getattr(_optimizers, name) for name in _optimizers.__all__ if name != "Optimizer"}
_INITIALIZERS = {name: getattr(_initializers, name) for name in
                 ("Constant", "Zeros", "TruncatedNormal", "RandomUniform", "RowId")}


def function_path(fn) -> str | None:
    """``module:qualname`` of a module-level function that imports back to the same object, else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        found = _resolve(module, qualname)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is fn else None


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# embedcore's application modules moved into ``embedcore.app``; checkpoints written before name them where
# they were (e.g. the demo's ``embedcore.quickstart:custom_adagrad``).
_MOVED_TO_APP = ("blas_threads", "cli", "data", "metrics", "models", "plot", "progress", "quickstart",
                 "run_config", "trainer")


def current_module(module: str) -> str:
    """Where ``module`` lives now: ``embedcore.X`` for a module moved into the application is ``embedcore.app.X``."""
    package, _, rest = module.partition(".")
    if package == "embedcore" and rest.split(".", 1)[0] in _MOVED_TO_APP:
        return f"embedcore.app.{rest}"
    return module


def import_function(path: str):
    """The object named ``module:qualified.name`` (imports the module, at its current place:
    :func:`current_module`); ImportError/AttributeError if absent."""
    module, sep, qualname = path.partition(":")
    if not sep or not module or not qualname:
        raise ImportError(f"'{path}' is not of the form module:name")
    return _resolve(current_module(module), qualname)


def constructor_parameters(cls) -> list:
    """Names of the keyword arguments of ``cls(...)``."""
    return [name for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def constructor_arguments(obj) -> dict:
    """The keyword arguments that rebuild ``obj`` (an optimizer or initializer) from its attributes."""
    args = {}
    for name in constructor_parameters(type(obj)):
        if name == "clipvalue":
            low, high = obj.clip_gradient_min, obj.clip_gradient_max
            args[name] = None if low is None and high is None else (low, high)
        elif name == "slot_variable_creation_fn":
            continue
        elif hasattr(obj, name):
            args[name] = getattr(obj, name)
    return args


# ----------------------------------------------------------------------------------------------------------
# Values

def _encode(value, where: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, _optimizers.Optimizer):
        return _encode_object(value, "optimizer", _OPTIMIZERS, where)
    if isinstance(value, _initializers.Initializer):
        return _encode_object(value, "initializer", _INITIALIZERS, where)
    if callable(value):
        return {"function": function_path(value),
                "repr": getattr(value, "__qualname__", None) or type(value).__qualname__}
    raise CheckpointError(f"{where}: cannot store {value!r} ({type(value).__name__}) in a checkpoint")


def _encode_object(obj, kind: str, registry: dict, where: str):
    name = type(obj).__name__
    if registry.get(name) is not type(obj):
        path = function_path(type(obj))
        if path is None:
            raise CheckpointError(f"{where}: the {kind} class {type(obj).__qualname__} cannot be named by an import "
                                  f"path; define it at module level")
        name = path
    args = constructor_arguments(obj)
    try:
        same = type(obj)(**args) == obj
    except (TypeError, ValueError):
        same = False
    if not same:
        raise CheckpointError(f"{where}: {obj!r} cannot be rebuilt from its constructor arguments, so a checkpoint "
                              f"cannot describe it")
    return {kind: name, "args": {k: _encode(v, f"{where}.{k}") for k, v in args.items()}}


class FunctionResolver:
    """Turns stored import paths back into functions and classes, importing only what the caller allowed.

    Calling a resolver gives a function (``base=None``) or a class (``base`` the class it must derive
    from); an imported object of any other kind is refused before anything uses it.
    """

    def __init__(self, functions=None, allow_import: bool = False):
        self.allow_import = bool(allow_import)
        if isinstance(functions, dict):
            self.functions = dict(functions)
        else:
            self.functions = {}
            for fn in functions or ():
                path = function_path(fn)
                if path is None:
                    raise CheckpointError(f"functions=[...]: {fn!r} has no import path to match a checkpoint's "
                                          f"entry by; pass functions={{'module:name': fn}} instead")
                self.functions[path] = fn

    def __call__(self, path: str | None, where: str, shown: str, base: type | None = None):
        if path is not None and path in self.functions:
            found = self.functions[path]
            if base is not None:
                _check_class(found, base, where, path, "functions=")
            return found
        if path is None:
            raise CheckpointError(f"{where} was {shown}, which has no import path (a lambda, a local function or "
                                  f"one from __main__), so the checkpoint cannot name it; rebuild the engine in your "
                                  f"code and use emb.load(path) instead")
        if not self.allow_import:
            raise CheckpointError(f"{where} is the function '{path}'; loading a checkpoint never imports code on its "
                                  f"own: pass functions={{'{path}': <the function>}} or allow_import=True")
        try:
            found = import_function(path)
        except (ImportError, AttributeError) as e:
            raise CheckpointError(f"{where}: cannot import '{path}': {e}") from None
        except Exception as e:  # importing runs the module's code, which may fail in any way
            raise CheckpointError(f"{where}: importing '{path}' failed: {type(e).__name__}: {e}") from None
        if base is not None:
            _check_class(found, base, where, path, "the checkpoint")
        elif not is_python_function(found):
            raise CheckpointError(f"{where}: '{path}' is {_describe(found)}, not a Python function; a checkpoint may "
                                  f"name only Python functions (row functions, learning-rate and initializer "
                                  f"callables) and embedcore Optimizer/Initializer classes, so it is not used")
        return found


def is_python_function(obj) -> bool:
    """A ``def``/``lambda`` function, or one wrapped by ``numba.njit``, ``tf.function`` or ``jax.jit`` (the
    custom computations embedcore compiles or translates): still a Python function inside."""
    if isinstance(obj, types.FunctionType):
        return True
    from ..translate import jaxpr, tensorflow_graph
    if tensorflow_graph.is_tf_function(obj) or jaxpr.is_jax_function(obj):
        return isinstance(translate_python_function(obj), types.FunctionType)
    import numba
    return isinstance(obj, numba.core.registry.CPUDispatcher) and isinstance(obj.py_func, types.FunctionType)


def _describe(obj) -> str:
    kind = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
    return f"{kind} ({obj!r:.80})"


def _check_class(found, base: type, where: str, path: str, source: str) -> None:
    if not (isinstance(found, type) and issubclass(found, base)):
        raise CheckpointError(f"{where}: '{path}' (from {source}) is {_describe(found)}, not a subclass of "
                              f"embedcore's {base.__name__}; a checkpoint only ever calls embedcore {base.__name__} "
                              f"classes, so it is not used")


# Arguments added to an optimizer class after checkpoints were written without them, and the value such a
# checkpoint meant (what the optimizer did before the argument existed).
_ARGUMENTS_BEFORE = {_optimizers.Adam: {"bias_correction": True}}


def _arguments_before(cls) -> dict:
    """The arguments a stored ``cls`` lacking them was written with (see ``_ARGUMENTS_BEFORE``)."""
    out = {}
    for base, arguments in _ARGUMENTS_BEFORE.items():
        if isinstance(cls, type) and issubclass(cls, base):
            out.update(arguments)
    return out


def _upgrade_stored_optimizer(value) -> None:
    """A stored built-in optimizer written before some of its arguments existed gets them, in place, with the
    values that reproduce what it did then (an old ``Adam``: ``bias_correction=True``)."""
    if isinstance(value, dict) and isinstance(value.get("optimizer"), str) and isinstance(value.get("args"), dict):
        for name, default in _arguments_before(_OPTIMIZERS.get(value["optimizer"])).items():
            value["args"].setdefault(name, default)


def _decode(value, where: str, resolve: FunctionResolver):
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", resolve) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(_decode(v, f"{where}[{i}]", resolve) for i, v in enumerate(value["tuple"]))
    if "function" in value:
        return resolve(value["function"], where, value.get("repr", "a function"))
    for kind, registry, base in (("optimizer", _OPTIMIZERS, _optimizers.Optimizer),
                                 ("initializer", _INITIALIZERS, _initializers.Initializer)):
        if kind in value:
            name = value[kind]
            cls = registry.get(name)
            if cls is None:
                if not isinstance(name, str) or ":" not in name:
                    raise CheckpointError(f"{where}: unknown {kind} class {name!r}; this embedcore knows "
                                          f"{sorted(registry)}")
                cls = resolve(name, f"{where} ({kind} class)", name, base=base)
            try:
                accepted = constructor_parameters(cls)
            except (TypeError, ValueError):
                accepted = []
            unknown = sorted(set(value["args"]) - set(accepted))
            if unknown:
                raise CheckpointError(f"{where}: the stored {kind} {name} has arguments {unknown} that its "
                                      f"constructor does not take (it takes {accepted})")
            args = {k: _decode(v, f"{where}.{k}", resolve) for k, v in value["args"].items()}
            for name_before, default in _arguments_before(cls).items():
                if name_before in accepted:
                    args.setdefault(name_before, default)
            try:
                return cls(**args)
            except CheckpointError:
                raise
            except Exception as e:  # a constructor refusing the stored values (NaN, out of range, ...)
                raise CheckpointError(f"{where}: the stored {kind} {name} does not rebuild: "
                                      f"{type(e).__name__}: {e}") from None
    raise CheckpointError(f"{where}: unrecognised stored value {value!r:.200}")


# ----------------------------------------------------------------------------------------------------------
# The engine's configuration

def encode_engine_config(feature_config, tables, optimizer, seed: int) -> dict:
    """JSON-ready description of an engine: feature structure, tables (in order), default optimizer, seed."""
    def structure(node, where):
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise CheckpointError(f"feature_config key {key!r} at '{where}' is not a str or int")
            return {"dict": [[k, structure(v, f"{where}/{k}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return {"list" if isinstance(node, list) else "tuple":
                    [structure(v, f"{where}/{i}") for i, v in enumerate(node)]}
        f = node
        return {"feature": {"table": f.table.name, "max_sequence_length": f.max_sequence_length,
                            "validate_weights_and_indices": f.validate_weights_and_indices,
                            "output_shape": None if f.output_shape is None else list(f.output_shape),
                            "name": f.name}}

    return {
        "features": structure(feature_config, "<root>"),
        "tables": [{"name": t.name, "vocabulary_size": t.vocabulary_size, "dim": t.dim, "combiner": t.combiner,
                    "initializer": _encode(t.initializer, f"table '{t.name}' initializer"),
                    "optimizer": _encode(t.optimizer, f"table '{t.name}' optimizer"), **_stored(t), **_dynamic(t)}
                   for t in tables],
        "optimizer": _encode(optimizer, "the engine's optimizer"),
        "seed": int(seed),
    }


_STORED_DEFAULTS = {"weights_dtype": "float32", "slot_dtype": "float32", "stochastic_rounding": True}


def _stored(table) -> dict:
    """A table's storage settings that differ from float32 (float32 tables are encoded as before them)."""
    if (table.weights_dtype, table.slot_dtype) == ("float32", "float32"):
        return {}
    return {key: getattr(table, key) for key in _STORED_DEFAULTS}


_EVICTIONS = ("LRU", "LFU", "TTL", "EvictByScore")


def _dynamic(table) -> dict:
    """A dynamic table's own settings, ``{"dynamic": {"capacity", "admission", "eviction"}}`` (``{}`` for a
    static table): admission as ``CountAdmission``'s arguments, eviction as ``{"policy": "LRU" | "LFU" | "TTL" |
    "EvictByScore"}`` with TTL's ``steps`` or EvictByScore's ``fn`` (a function, stored by import path as
    optimizers' functions are) and ``reserve`` (a configuration written before ``reserve`` existed is read with
    the default, :data:`~embedcore.tables.policies.DEFAULT_RESERVE`: see :func:`check_config`)."""
    if not isinstance(table, DynamicTableConfig):
        return {}
    admission = table.admission
    if admission is not None:
        admission = {"min_count": admission.min_count, "sketch_width": admission.sketch_width,
                     "sketch_depth": admission.sketch_depth}
    eviction = table.eviction
    if eviction is not None:
        policy = type(eviction).__name__
        if policy not in _EVICTIONS or type(eviction) is not getattr(_policies(), policy):
            raise CheckpointError(f"table '{table.name}': the eviction policy {eviction!r} is not one of embedcore's "
                                  f"{list(_EVICTIONS)}, so a checkpoint cannot describe it")
        eviction = {"policy": policy}
        if policy == "TTL":
            eviction["steps"] = table.eviction.steps
        elif policy == "EvictByScore":
            eviction["fn"] = _encode(table.eviction.fn, f"table '{table.name}' eviction")
            eviction["reserve"] = table.eviction.reserve
    return {"dynamic": {"capacity": table.capacity, "admission": admission, "eviction": eviction}}


def _policies():
    from ..tables import policies
    return policies


def _decode_dynamic(t: dict, where: str, resolve, with_functions: bool) -> dict:
    """The ``DynamicTableConfig`` arguments of a stored dynamic table (``with_functions=False``: an
    ``EvictByScore`` is left out, as serving needs no eviction and imports nothing)."""
    stored, policies = t["dynamic"], _policies()
    admission = None if stored["admission"] is None else policies.CountAdmission(**stored["admission"])
    eviction = stored["eviction"]
    if eviction is not None:
        policy = eviction["policy"]
        if policy == "TTL":
            eviction = policies.TTL(eviction["steps"])
        elif policy == "EvictByScore":
            eviction = policies.EvictByScore(_decode(eviction["fn"], f"{where} eviction", resolve),
                                             reserve=eviction.get("reserve", policies.DEFAULT_RESERVE)) \
                if with_functions else None
        else:
            eviction = getattr(policies, policy)()
    return {"admission": admission, "eviction": eviction}


def decode_initializer(config: dict, table: str, resolve: FunctionResolver | None = None):
    """The initializer of table ``table`` of a checked configuration (None when it stored none); built-in
    initializers need no import, others only what ``resolve`` allows (default: nothing)."""
    stored = next(t for t in config["tables"] if t["name"] == table)
    try:
        return _decode(stored["initializer"], f"table '{table}' initializer", resolve or FunctionResolver())
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"the checkpoint's configuration is malformed: {type(e).__name__}: {e}") from None


def decode_engine_config(config: dict, resolve: FunctionResolver | None = None, with_optimizers: bool = True):
    """``(feature_config, optimizer, seed)`` from :func:`encode_engine_config`'s output.

    ``with_optimizers=False`` leaves optimizers and initializers out (serving needs neither), so nothing is
    ever imported. ``config`` is checked with :func:`check_config` first; every failure is a
    :class:`CheckpointError`.
    """
    check_config(config)
    resolve = resolve or FunctionResolver()
    try:
        tables = {}
        for t in config["tables"]:
            where = f"table '{t['name']}'"
            common = dict(
                initializer=_decode(t["initializer"], f"{where} initializer", resolve) if with_optimizers else None,
                optimizer=_decode(t["optimizer"], f"{where} optimizer", resolve) if with_optimizers else None,
                combiner=t["combiner"], name=t["name"],
                **{key: t.get(key, default) for key, default in _STORED_DEFAULTS.items()})
            if "dynamic" in t:
                tables[t["name"]] = DynamicTableConfig(t["dim"], t["dynamic"]["capacity"], **common,
                                                       **_decode_dynamic(t, where, resolve, with_optimizers))
            else:
                tables[t["name"]] = TableConfig(t["vocabulary_size"], t["dim"], **common)

        def structure(node):
            if "dict" in node:
                return {k: structure(v) for k, v in node["dict"]}
            if "list" in node:
                return [structure(v) for v in node["list"]]
            if "tuple" in node:
                return tuple(structure(v) for v in node["tuple"])
            f = node["feature"]
            return FeatureConfig(tables[f["table"]], f["max_sequence_length"], f["validate_weights_and_indices"],
                                 f["output_shape"], f["name"])

        features = structure(config["features"])
        optimizer = _decode(config["optimizer"], "the engine's optimizer", resolve) if with_optimizers else None
        return features, optimizer, int(config["seed"])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"the checkpoint's configuration is malformed: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------------------------------------
# The configuration's schema

_MAX_NESTING = 32
_SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)
_MAX_ROWS = 2 ** 62
_MAX_DIM = 2 ** 31 - 1


def _fail(where: str, what: str, value) -> CheckpointError:
    return CheckpointError(f"the checkpoint's configuration is malformed: {where} must be {what}, "
                           f"got {value!r:.120}")


def _need_dict(value, where: str, keys=None, optional=()) -> dict:
    if not isinstance(value, dict):
        raise _fail(where, "a JSON object", value)
    if keys is not None:
        missing = [k for k in keys if k not in value]
        unknown = [k for k in value if k not in keys and k not in optional]
        if missing or unknown:
            raise _fail(where, f"an object with the keys {list(keys)}" +
                        (f" (optionally {list(optional)})" if optional else ""), sorted(value, key=str))
    return value


def _need_list(value, where: str) -> list:
    if not isinstance(value, list):
        raise _fail(where, "a JSON list", value)
    return value


def need_int(value, where: str, low: int, high: int, fail=_fail) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``, else the error ``fail(where, what, value)``."""
    if type(value) is not int or not low <= value <= high:
        raise fail(where, f"an integer from {low} to {high}", value)
    return value


def _need_str(value, where: str, allow_none: bool = False, non_empty: bool = True):
    if value is None and allow_none:
        return value
    if not isinstance(value, str) or (non_empty and not value):
        raise _fail(where, "a non-empty string" + (" or null" if allow_none else ""), value)
    return value


def _check_value(value, where: str, depth: int = 0) -> None:
    """A stored value (see :func:`_encode`): JSON scalars, lists, tuples, functions, optimizers, initializers."""
    if depth > _MAX_NESTING:
        raise _fail(where, f"nested at most {_MAX_NESTING} levels deep", "...")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return  # the constructor that receives it decides whether it may be non-finite
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_value(v, f"{where}[{i}]", depth + 1)
        return
    if not isinstance(value, dict):
        raise _fail(where, "a stored value", value)
    if "tuple" in value:
        _need_dict(value, where, ["tuple"])
        for i, v in enumerate(_need_list(value["tuple"], f"{where}.tuple")):
            _check_value(v, f"{where}[{i}]", depth + 1)
    elif "function" in value:
        _need_dict(value, where, ["function"], optional=["repr"])
        _need_str(value["function"], f"{where}.function", allow_none=True)
        if "repr" in value:
            _need_str(value["repr"], f"{where}.repr", allow_none=True, non_empty=False)
    elif "optimizer" in value or "initializer" in value:
        kind = "optimizer" if "optimizer" in value else "initializer"
        _need_dict(value, where, [kind, "args"])
        _need_str(value[kind], f"{where}.{kind}")
        for k, v in _need_dict(value["args"], f"{where}.args").items():
            _check_value(v, f"{where}.{k}", depth + 1)
    else:
        raise _fail(where, "a stored value (a number, string, list, tuple, function, optimizer or initializer)",
                    value)


def _check_stored_object(value, kind: str, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or kind not in value:
        raise _fail(where, f"null or a stored {kind}", value)
    _check_value(value, where)
    if kind == "optimizer":
        _upgrade_stored_optimizer(value)


def _check_features(node, where: str, tables: set, depth: int = 0) -> None:
    if depth > _MAX_NESTING:
        raise _fail(where, f"nested at most {_MAX_NESTING} levels deep", "...")
    if not isinstance(node, dict) or len(node) != 1:
        raise _fail(where, 'an object with one key: "dict", "list", "tuple" or "feature"', node)
    (kind, body), = node.items()
    if kind == "dict":
        keys = set()
        for i, item in enumerate(_need_list(body, f"{where}.dict")):
            if not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool) or \
                    not isinstance(item[0], (str, int)) or item[0] in keys:
                raise _fail(f"{where}.dict[{i}]", "a [key, node] pair with a new str or int key", item)
            keys.add(item[0])
            _check_features(item[1], f"{where}/{item[0]}", tables, depth + 1)
    elif kind in ("list", "tuple"):
        for i, item in enumerate(_need_list(body, f"{where}.{kind}")):
            _check_features(item, f"{where}/{i}", tables, depth + 1)
    elif kind == "feature":
        f = _need_dict(body, f"{where}.feature", ["table", "max_sequence_length", "validate_weights_and_indices",
                                                  "output_shape", "name"])
        if not isinstance(f["table"], str) or f["table"] not in tables:
            raise _fail(f"{where}.feature.table", f"one of the configured tables {sorted(tables)}", f["table"])
        need_int(f["max_sequence_length"], f"{where}.feature.max_sequence_length", 0, 2 ** 31 - 1)
        if not isinstance(f["validate_weights_and_indices"], bool):
            raise _fail(f"{where}.feature.validate_weights_and_indices", "true or false",
                        f["validate_weights_and_indices"])
        if f["output_shape"] is not None:
            for i, d in enumerate(_need_list(f["output_shape"], f"{where}.feature.output_shape")):
                need_int(d, f"{where}.feature.output_shape[{i}]", 1, 2 ** 48)
        _need_str(f["name"], f"{where}.feature.name", allow_none=True, non_empty=False)
    else:
        raise _fail(where, 'an object with one key: "dict", "list", "tuple" or "feature"', node)


def _check_dynamic(t: dict, where: str) -> None:
    """A dynamic table's ``dynamic`` entry (see :func:`_dynamic`): its capacity is its ``vocabulary_size``."""
    d = _need_dict(t["dynamic"], f"{where}.dynamic", ["capacity", "admission", "eviction"])
    need_int(d["capacity"], f"{where}.dynamic.capacity", 1, 2 ** 31 - 1)
    if d["capacity"] != t["vocabulary_size"]:
        raise _fail(f"{where}.dynamic.capacity", f"the table's vocabulary_size ({t['vocabulary_size']})",
                    d["capacity"])
    if d["admission"] is not None:
        a = _need_dict(d["admission"], f"{where}.dynamic.admission", ["min_count", "sketch_width", "sketch_depth"])
        need_int(a["min_count"], f"{where}.dynamic.admission.min_count", 1, 2 ** 32 - 1)
        need_int(a["sketch_width"], f"{where}.dynamic.admission.sketch_width", 1, 2 ** 32 - 1)
        need_int(a["sketch_depth"], f"{where}.dynamic.admission.sketch_depth", 1, 16)
    e = d["eviction"]
    if e is not None:
        policy = _need_dict(e, f"{where}.dynamic.eviction").get("policy")
        if policy not in _EVICTIONS:
            raise _fail(f"{where}.dynamic.eviction.policy", f"one of {list(_EVICTIONS)}", policy)
        extra = {"TTL": ["steps"], "EvictByScore": ["fn"]}.get(policy, [])
        _need_dict(e, f"{where}.dynamic.eviction", ["policy"] + extra,
                   optional=["reserve"] if policy == "EvictByScore" else ())
        if policy == "TTL":
            need_int(e["steps"], f"{where}.dynamic.eviction.steps", 1, 2 ** 31 - 1)
        elif policy == "EvictByScore":
            if not isinstance(e["fn"], dict) or "function" not in e["fn"]:
                raise _fail(f"{where}.dynamic.eviction.fn", "a stored function", e["fn"])
            _check_value(e["fn"], f"{where}.dynamic.eviction.fn")
            # written before EvictByScore had a reserve: read with today's default (so that an engine built
            # with EvictByScore(fn) loads it); the eviction rule is configuration, not what the rows hold
            reserve = e.setdefault("reserve", _policies().DEFAULT_RESERVE)
            if type(reserve) not in (int, float) or not 0 <= reserve < 1:
                raise _fail(f"{where}.dynamic.eviction.reserve", "a number in [0, 1)", reserve)


def check_config(config) -> dict:
    """``config`` (a checkpoint's ``"config"``) if it is what :func:`encode_engine_config` writes: every field
    present, of its type and in its range; else :class:`CheckpointError` naming the field and its value. A
    configuration written by an earlier embedcore is brought up to date in place (see the module docstring).

    Decoding may still refuse values that only a constructor can judge (a learning rate of NaN), also with
    :class:`CheckpointError`.
    """
    _need_dict(config, "config", ["features", "tables", "optimizer", "seed"], optional=["non_finite"])
    need_int(config["seed"], "config.seed", *_SEED_RANGE)
    if "non_finite" in config and config["non_finite"] not in NON_FINITE_POLICIES:
        raise _fail("config.non_finite", f"one of {list(NON_FINITE_POLICIES)}", config["non_finite"])
    names = set()
    for i, t in enumerate(_need_list(config["tables"], "config.tables")):
        where = f"config.tables[{i}]"
        _need_dict(t, where, ["name", "vocabulary_size", "dim", "combiner", "initializer", "optimizer"],
                   optional=list(_STORED_DEFAULTS) + ["dynamic"])
        name = _need_str(t["name"], f"{where}.name")
        if name in names:
            raise _fail(f"{where}.name", "a name no other table has", name)
        names.add(name)
        where = f"config table '{name}'"
        need_int(t["vocabulary_size"], f"{where}.vocabulary_size", 1, _MAX_ROWS)
        need_int(t["dim"], f"{where}.dim", 1, _MAX_DIM)
        _need_str(t["combiner"], f"{where}.combiner")
        for key in ("weights_dtype", "slot_dtype"):
            if key in t and t[key] not in DTYPES:
                raise _fail(f"{where}.{key}", f"one of {list(DTYPES)}", t[key])
        if "stochastic_rounding" in t and not isinstance(t["stochastic_rounding"], bool):
            raise _fail(f"{where}.stochastic_rounding", "true or false", t["stochastic_rounding"])
        _check_value(t["initializer"], f"{where}.initializer")
        _check_stored_object(t["optimizer"], "optimizer", f"{where}.optimizer")
        if "dynamic" in t:
            _check_dynamic(t, where)
    _check_features(config["features"], "config.features", names)
    _check_stored_object(config["optimizer"], "optimizer", "config.optimizer")
    return config
