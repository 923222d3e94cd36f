"""The engine's configuration as JSON: features, tables, optimizers, initializers, functions by name.

Nothing in a checkpoint is executable. Built-in optimizers and initializers are stored as their class name
and constructor arguments; a user function (a custom computation, a callable learning rate or initializer)
is stored as its import path ``module:qualified.name``. Decoding imports such a path only when the caller
allows it (``allow_import=True``) or hands the function over (``functions={"module:name": f}``); otherwise
it raises :class:`CheckpointError` saying how.
"""

from __future__ import annotations

import importlib
import inspect

from .. import initializers as _initializers
from .. import optimizers as _optimizers
from ..config import FeatureConfig, TableConfig
from .errors import CheckpointError

__all__ = ["encode_engine_config", "decode_engine_config", "function_path", "import_function", "FunctionResolver"]

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


def import_function(path: str):
    """The object named ``module:qualified.name`` (imports the module); ImportError/AttributeError if absent."""
    module, sep, qualname = path.partition(":")
    if not sep or not module or not qualname:
        raise ImportError(f"'{path}' is not of the form module:name")
    return _resolve(module, qualname)


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
    """Turns stored import paths back into functions, importing only what the caller allowed."""

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

    def __call__(self, path: str | None, where: str, shown: str):
        if path is not None and path in self.functions:
            return self.functions[path]
        if path is None:
            raise CheckpointError(f"{where} was {shown}, which has no import path (a lambda, a local function or "
                                  f"one from __main__), so the checkpoint cannot name it; rebuild the engine in your "
                                  f"code and use emb.load(path) instead")
        if not self.allow_import:
            raise CheckpointError(f"{where} is the function '{path}'; loading a checkpoint never imports code on its "
                                  f"own: pass functions={{'{path}': <the function>}} or allow_import=True")
        try:
            return import_function(path)
        except (ImportError, AttributeError) as e:
            raise CheckpointError(f"{where}: cannot import '{path}': {e}") from None


def _decode(value, where: str, resolve: FunctionResolver):
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", resolve) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(_decode(v, f"{where}[{i}]", resolve) for i, v in enumerate(value["tuple"]))
    if "function" in value:
        return resolve(value["function"], where, value.get("repr", "a function"))
    for kind, registry in (("optimizer", _OPTIMIZERS), ("initializer", _INITIALIZERS)):
        if kind in value:
            name = value[kind]
            cls = registry.get(name)
            if cls is None:
                if not isinstance(name, str) or ":" not in name:
                    raise CheckpointError(f"{where}: unknown {kind} class {name!r}; this embedcore knows "
                                          f"{sorted(registry)}")
                cls = resolve(name, f"{where} ({kind} class)", name)
            args = {k: _decode(v, f"{where}.{k}", resolve) for k, v in value["args"].items()}
            try:
                return cls(**args)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{where}: the stored {kind} {name} does not rebuild: {e}") from None
    raise CheckpointError(f"{where}: unrecognised stored value {value!r}")


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
                    "optimizer": _encode(t.optimizer, f"table '{t.name}' optimizer")} for t in tables],
        "optimizer": _encode(optimizer, "the engine's optimizer"),
        "seed": int(seed),
    }


def decode_engine_config(config: dict, resolve: FunctionResolver | None = None, with_optimizers: bool = True):
    """``(feature_config, optimizer, seed)`` from :func:`encode_engine_config`'s output.

    ``with_optimizers=False`` leaves optimizers and initializers out (serving needs neither), so nothing is
    ever imported.
    """
    resolve = resolve or FunctionResolver()
    try:
        tables = {}
        for t in config["tables"]:
            where = f"table '{t['name']}'"
            tables[t["name"]] = TableConfig(
                t["vocabulary_size"], t["dim"],
                initializer=_decode(t["initializer"], f"{where} initializer", resolve) if with_optimizers else None,
                optimizer=_decode(t["optimizer"], f"{where} optimizer", resolve) if with_optimizers else None,
                combiner=t["combiner"], name=t["name"])

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
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's configuration is malformed: {type(e).__name__}: {e}") from None
