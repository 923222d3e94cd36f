"""Functions written in TensorFlow or JAX, as their users write them, become embedcore's NumPy-level functions.

``to_numpy_function(fn, contract)`` returns a plain Python function over NumPy values that computes what
``fn`` computes, for a :class:`~.contracts.Contract`: the arguments ``fn`` receives (rows and scalars, their
dtypes, how they nest) and what it returns. Two contracts are used:

* the optimizer's, :func:`~.contracts.optimizer_contract` ``(slot_dims, n_hyperparameters)``:
  ``f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)``, all float32, returning
  the new row or ``(new_row, new_slots...)`` (``to_numpy_row_function(fn, slot_dims, n_hyperparameters)``
  is this case; ``CustomOptimizer`` uses it);
* ``EvictByScore``'s, :data:`~.contracts.SCORE`: ``f(embedding_table, last_seen, count, step)``, the row
  float32 ``[dim]`` and three int64 scalars, returning one number per row (a row result is refused).

How:

* a TensorFlow function (:mod:`.tensorflow_graph`) is traced once with the contract's ``tf.TensorSpec``\\ s
  and its graph's ops are translated;
* a JAX function (:mod:`.jaxpr`) is traced once with ``jax.make_jaxpr`` on the contract's
  ``jax.ShapeDtypeStruct``\\ s and its equations are translated;
* both produce one small op-level :class:`~.numpy_source.Program` of the contract, and one emitter writes it
  as Python source over ``np.*`` with the contract's signature (:mod:`.numpy_source`), ``exec``\\ s it and
  makes its text readable by ``inspect``.

Dtypes follow the traced graph or jaxpr: TensorFlow refuses mixed dtypes without ``tf.cast``, JAX promotes
with explicit conversions (and, without ``jax_enable_x64``, traces int64 arguments as int32); integers
wrap at their width as in the framework.

The result is an ordinary NumPy-level function, so everything embedcore does with NumPy functions applies
to it unchanged: for an optimizer, the compiler proves it element-wise (inlined element by element) or
splits its reductions into loops, ``optimizer.explain(dim)`` says which, and the disk cache keys it by
:func:`embedcore.compile_cache.fingerprint` of the generated code (stable across processes for the same
function; another op or constant gives another fingerprint); a score is compiled with ``numba.njit`` as a
NumPy score function is. A NumPy function is returned unchanged.

Which framework a function is written in (``framework="auto"``), decided without importing either:

1. by type: a ``tf.function`` (``PolymorphicFunction``) or ``ConcreteFunction`` is TensorFlow; a
   ``jax.jit`` function (``PjitFunction``) is JAX;
2. a plain Python function is TensorFlow (or JAX) if a name its code reads -- a global, an attribute of
   a global module (``tf.math.sqrt``), a closure cell, also in nested functions and in the user's own
   Python functions it calls -- is a module or object of ``tensorflow`` (``tf``, ``math_ops``,
   ``def_function``) or of ``jax``/``jaxlib`` (``jnp``, ``lax``). Names from both raise
   :class:`~embedcore.compiler.RowFunctionError` (pass ``framework=``); names from neither: NumPy.

Why not "try NumPy first, and translate when that fails": TensorFlow and JAX ops accept NumPy arrays, so a
TF or JAX function *runs* on NumPy rows (eagerly, returning framework tensors) instead of failing, and
trying would import and run the framework for every NumPy function. The names a function reads are what
it is written in, and reading them costs nothing. ``framework="numpy"|"tensorflow"|"jax"`` overrides the
rule. TensorFlow and JAX are imported only when a function of theirs is translated.

Translations are remembered per ``(fn, contract)``: the same function gives the same translated function
object, so optimizers built from it compare equal and share one compilation.
"""

from __future__ import annotations

import types as pytypes

from ..compiler import RowFunctionError, describe
from . import jaxpr, tensorflow_graph
from .contracts import SCORE, Contract, Parameter, optimizer_contract
from .numpy_source import Program, TranslationError, ensure_source

__all__ = ["to_numpy_function", "to_numpy_row_function", "framework_of", "python_function", "FRAMEWORKS",
           "Contract", "Parameter", "optimizer_contract", "SCORE", "Program", "TranslationError"]

FRAMEWORKS = ("auto", "numpy", "tensorflow", "jax")
_TOP_LEVEL = {"tensorflow": "tensorflow", "tf_keras": "tensorflow", "jax": "jax", "jaxlib": "jax"}
_LIBRARIES = {"numpy", "numba", "math", "builtins", "embedcore", "scipy"}
_TRANSLATED: dict = {}


def framework_of(fn) -> str:
    """``"tensorflow"``, ``"jax"`` or ``"numpy"``: what ``fn`` is written in (see the module docstring)."""
    if tensorflow_graph.is_tf_function(fn):
        return "tensorflow"
    if jaxpr.is_jax_function(fn):
        return "jax"
    found = set()
    _frameworks_read(fn, found, set())
    if len(found) > 1:
        raise RowFunctionError(
            f"{describe(fn)} reads both TensorFlow and JAX names; say which it is written in "
            "with framework='tensorflow' or framework='jax'")
    return found.pop() if found else "numpy"


def python_function(fn):
    """The Python function behind a ``tf.function`` or ``jax.jit`` function (for its name), else ``fn``."""
    if tensorflow_graph.is_tf_function(fn):
        return tensorflow_graph.python_function(fn)
    if jaxpr.is_jax_function(fn):
        return jaxpr.python_function(fn)
    return fn


def _framework_of_value(value) -> str | None:
    if isinstance(value, pytypes.ModuleType):
        module = value.__name__
    else:
        module = getattr(value, "__module__", None) or type(value).__module__ or ""
        if not isinstance(module, str):
            return None
    return _TOP_LEVEL.get(module.split(".")[0])


def _frameworks_read(fn, found, seen):
    """Add to ``found`` the frameworks of the globals and closure values ``fn``'s code reads."""
    if not isinstance(fn, pytypes.FunctionType) or id(fn) in seen:
        return
    seen.add(id(fn))
    values = [cell.cell_contents for cell in fn.__closure__ or () if _cell_is_set(cell)]
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, pytypes.CodeType))
        values += [fn.__globals__[name] for name in code.co_names if name in fn.__globals__]
    for value in values:
        framework = _framework_of_value(value)
        if framework is not None:
            found.add(framework)
        elif isinstance(value, pytypes.FunctionType) and \
                (value.__module__ or "").split(".")[0] not in _LIBRARIES:
            _frameworks_read(value, found, seen)  # the user's own helper: what it reads counts too


def _cell_is_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def to_numpy_row_function(fn, slot_dims=(), n_hyperparameters=0, framework="auto"):
    """The NumPy-level row function of the optimizer function ``fn`` (``fn`` itself if it is written with
    NumPy): :func:`to_numpy_function` for :func:`~.contracts.optimizer_contract` ``(slot_dims,
    n_hyperparameters)``.

    Args:
        fn: ``f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)`` written with
            NumPy, TensorFlow (a ``tf.function`` or a plain function of TF ops, as in TensorFlow's
            ``CustomOptimizer`` documentation) or ``jax.numpy``.
        slot_dims: one entry per slot: 2 (the slot is a row) or 1 (one value per table row: a scalar).
        n_hyperparameters: how many hyperparameters the function receives (as a tuple of scalars).
        framework: ``"auto"`` (the rule of the module docstring), ``"numpy"``, ``"tensorflow"`` or ``"jax"``.
    """
    return to_numpy_function(fn, optimizer_contract(slot_dims, n_hyperparameters), framework)


def to_numpy_function(fn, contract: Contract, framework="auto"):
    """The NumPy-level function of ``fn`` under ``contract`` (``fn`` itself if it is written with NumPy).

    Args:
        fn: a function of ``contract``'s arguments written with NumPy, TensorFlow (a ``tf.function``, a
            ``ConcreteFunction`` or a plain function of TF ops) or ``jax.numpy`` (jitted or not).
        contract: a :class:`~.contracts.Contract`: :func:`~.contracts.optimizer_contract` or
            :data:`~.contracts.SCORE`.
        framework: ``"auto"`` (the rule of the module docstring), ``"numpy"``, ``"tensorflow"`` or ``"jax"``.

    Returns:
        A plain Python function with the contract's signature, whose source (``inspect.getsource``) is the
        translation, and whose ``__name__``, ``__qualname__`` and ``__module__`` are ``fn``'s.

    Raises:
        RowFunctionError: naming the contract's role (``custom computation``, ``EvictByScore: score
            function``), the function, and the op, primitive, result or tracing error it could not
            translate.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {list(FRAMEWORKS)}. Received: {framework!r}")
    if framework == "auto":
        framework = framework_of(fn)
    if framework == "numpy":
        return fn
    key = (fn, contract, framework)
    try:
        known = _TRANSLATED.get(key)
    except TypeError:  # an unhashable callable: translate each time
        key, known = None, None
    if known is not None:
        ensure_source(known)
        return known
    module = tensorflow_graph if framework == "tensorflow" else jaxpr
    original = python_function(fn)
    name = getattr(original, "__name__", None) or type(fn).__name__
    qualname = getattr(original, "__qualname__", None) or name
    module_name = getattr(original, "__module__", None) or "embedcore.translate.generated"
    label = "TensorFlow" if framework == "tensorflow" else "JAX"
    who = f"{contract.role} {describe(original)}"
    try:
        program = module.to_program(fn, contract, name, qualname, module_name)
    except TranslationError as exc:
        supported = ""
        if isinstance(exc, (tensorflow_graph.UnsupportedOp, jaxpr.UnsupportedPrimitive)):
            names = tensorflow_graph.SUPPORTED_OPS if framework == "tensorflow" else jaxpr.SUPPORTED_PRIMITIVES
            supported = f". Supported: {', '.join(names)}"
        raise RowFunctionError(f"{who} cannot be translated from {label}: {exc}{supported}") from None
    except RowFunctionError:
        raise
    except Exception as exc:  # the framework's own tracing errors, of many types
        cause = "\n".join(str(exc).strip().splitlines()[:12])
        raise RowFunctionError(f"{who} could not be traced by {label} for the contract {contract.describe()}: "
                               f"{type(exc).__name__}: {cause}") from None
    try:
        function = program.to_function()
    except TranslationError as exc:
        raise RowFunctionError(f"{who} cannot be translated from {label}: {exc}") from None
    function.__embedcore_translated_from__ = fn
    if key is not None:
        _TRANSLATED[key] = function
    return function
