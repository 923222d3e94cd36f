"""Turn a user's per-row optimizer function into Numba code, and decide how it may run.

Built-in optimizers are *recipes* with named hyperparameters; :func:`bind_recipe` writes each as a function of
the contract, its names bound to constant indices of the ``hyperparameters`` tuple. Then three steps, each
explained where it happens:

1. :func:`strip_del` removes ``del name`` statements (TensorFlow's documented custom computations begin
   with ``del slot_variables, hyperparameters``, which Numba refuses to compile).
2. :func:`compile_row_function` compiles the function for row arguments (1-D float32 arrays; a slot of
   ``slot_dims`` entry 1 is a float32 scalar) and checks what it returns.
3. :func:`is_elementwise` reads the *typed* Numba IR of that compilation and proves, or fails to prove,
   that every output element depends only on the same element of the inputs. Only then may the kernel
   call the function once per element on scalars (no temporaries at all). "It also compiles on scalars" is
   not such a proof: ``np.mean(g * g)`` compiles on a scalar ``g`` but means something else there.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import linecache
import operator
import textwrap
import types as pytypes
from dataclasses import dataclass

import numba
import numpy as np
from numba import types
from numba.core import ir

from . import compile_cache
from .split_reductions import NotSplittable, is_elementwise_numpy, split_reductions

__all__ = ["RowFunctionError", "CompiledRowFunction", "compile_row_function", "compile_cached", "strip_del",
           "is_elementwise", "describe", "check_row_function", "bind_recipe", "Rewrite"]


class RowFunctionError(ValueError):
    """A per-row optimizer function cannot be compiled or breaks the optimizer contract."""


def describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


_CONTRACT = "(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)"


def check_row_function(fn) -> None:
    """Refuse, with :class:`RowFunctionError` naming ``fn`` and the cause, what Numba could never compile
    as a per-row function: a callable that is not a Python function (a builtin such as ``print``, a class, a
    ``functools.partial``, an object with ``__call__``) or one that cannot take the contract's five
    positional arguments ``(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)``."""
    check_python_function(fn, "custom computation", _CONTRACT, "five",
                          f": only those can be compiled as per-row functions {_CONTRACT}")


def check_python_function(fn, what: str, contract: str, count: str, purpose: str = "") -> None:
    """Refuse (:class:`RowFunctionError` naming ``what`` and ``fn``) a callable that is not a Python function
    (def, lambda or ``numba.njit`` of one), or one that cannot take ``contract``'s positional arguments."""
    target = fn.py_func if isinstance(fn, numba.core.registry.CPUDispatcher) else fn
    if not isinstance(target, pytypes.FunctionType):
        raise RowFunctionError(f"{what} {describe(fn)} is a {type(fn).__name__}, not a Python function (def or "
                               f"lambda, or one decorated with numba.njit){purpose}")
    try:
        inspect.signature(target).bind(*contract.strip("()").split(", "))
    except TypeError as exc:
        raise RowFunctionError(f"{what} {describe(fn)} cannot be called with the {count} arguments "
                               f"{contract}: {exc}") from None


@dataclass(frozen=True)
class Rewrite:
    """A NumPy expression of ``x`` (and of hyperparameter names) that replaces one value of a recipe:
    its ``gradient`` or ``embedding_table`` argument before the recipe runs, or its ``new_row`` result."""

    target: str        # "gradient", "embedding_table" or "new_row"
    expression: str    # e.g. "x - weight_decay * x"

    def apply(self, node):
        """The expression's AST with ``x`` replaced by ``node``."""
        tree = ast.parse(self.expression, mode="eval").body

        class Substitute(ast.NodeTransformer):
            def visit_Name(self, name):
                return copy.deepcopy(node) if name.id == "x" else name
        return Substitute().visit(tree)

    def names(self):
        return {n.id for n in ast.walk(ast.parse(self.expression, mode="eval")) if isinstance(n, ast.Name)} - {"x"}


def bind_recipe(recipe, names, rewrites=(), label=""):
    """The contract's function ``f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters)``
    that runs ``recipe(gradient, embedding_table, slot_variables, learning_rate, <named hyperparameters>)``
    with each named parameter bound to ``hyperparameters[names.index(name)]``, and ``rewrites`` applied.

    The binding happens in the generated source (``beta_1 = hyperparameters[6]``, then the recipe's own
    statements), so the compiled code indexes the tuple with constants, as a hand-written function would, and
    the compiler's analyses (element-wise proof, reduction split) see one straight-line function. The source
    is registered with :mod:`linecache`, so ``inspect.getsource`` and the disk cache's fingerprint read it
    like any other function's. ``label`` is appended to the qualified name (``explain`` shows it).
    """
    names = tuple(names)
    fdef = ast.parse(textwrap.dedent(inspect.getsource(recipe))).body[0]
    params = [a.arg for a in fdef.args.args]
    if len(params) < 4 or fdef.args.vararg or fdef.args.kwarg or fdef.args.kwonlyargs:
        raise RowFunctionError(f"recipe {describe(recipe)} must take (gradient, embedding_table, slot_variables, "
                               f"learning_rate, <hyperparameter names>)")
    gradient, table, slots, lr = params[:4]
    own = params[4:]
    unknown = [p for p in own if p not in names]
    if unknown:
        raise RowFunctionError(f"recipe {describe(recipe)}: no hyperparameter named {unknown[0]!r} (known: {names})")
    inputs = {"gradient": gradient, "embedding_table": table}
    given = {arg: f"{arg}_given" if any(r.target == role for r in rewrites) else arg for role, arg in inputs.items()}
    used = set(own).union(*(r.names() for r in rewrites))
    body = [ast.parse(f"{name} = hyperparameters[{names.index(name)}]").body[0] for name in names if name in used]
    for role, arg in inputs.items():
        value = ast.Name(given[arg], ast.Load())
        steps = [r for r in rewrites if r.target == role]
        for r in steps:
            value = r.apply(value)
        if steps:
            body.append(ast.Assign([ast.Name(arg, ast.Store())], value))
    finish = [r for r in rewrites if r.target == "new_row"]

    class FinishReturns(ast.NodeTransformer):
        def visit_Return(self, ret):
            def finished(value):
                for r in finish:
                    value = r.apply(value)
                return value
            if isinstance(ret.value, ast.Tuple):
                ret.value.elts[0] = finished(ret.value.elts[0])
            else:
                ret.value = finished(ret.value)
            return ret
    statements = [s for s in fdef.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    fdef.body = body + [FinishReturns().visit(s) for s in statements]
    fdef.args = ast.parse(f"def f({given[gradient]}, {given[table]}, {slots}, {lr}, hyperparameters): pass"
                          ).body[0].args
    fdef.decorator_list = []
    tree = ast.fix_missing_locations(ast.Module([fdef], []))
    source = ast.unparse(tree) + "\n"
    qualname = recipe.__qualname__ + (f"[{label}]" if label else "")
    filename = f"<embedcore recipe {recipe.__module__}.{qualname}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(recipe.__globals__)
    exec(compile(source, filename, "exec"), namespace)
    row = namespace[recipe.__name__]
    row.__qualname__, row.__module__, row.__doc__ = qualname, recipe.__module__, recipe.__doc__
    row.recipe = recipe
    return row


def strip_del(fn):
    """Return ``fn`` without its ``del name, ...`` statements (a plain Python function).

    Deleting a local only ends its life early, so removing the statement never changes the result of a
    function that runs at all. Functions whose source cannot be read are returned unchanged.
    """
    if isinstance(fn, numba.core.registry.CPUDispatcher):
        fn = fn.py_func
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return fn
    try:
        tree = ast.parse(source)
    except SyntaxError:  # the source of a lambda cut out of a larger expression
        return fn
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef,)) or fdef.name != fn.__name__:
        return fn  # a lambda or something exotic: compile it as it is

    class _DropDel(ast.NodeTransformer):
        found = False

        def visit_Delete(self, node):
            if all(isinstance(t, ast.Name) for t in node.targets):
                _DropDel.found = True
                return ast.Pass()
            return node

    fdef.decorator_list = []
    tree = _DropDel().visit(tree)
    if not _DropDel.found:
        return fn
    ast.fix_missing_locations(tree)
    namespace = dict(fn.__globals__)
    if fn.__closure__:
        namespace.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    filename = inspect.getsourcefile(fn) or "<custom computation>"
    code = compile(tree, filename, "exec")
    exec(code, namespace)
    rewritten = namespace[fn.__name__]
    rewritten.__defaults__ = fn.__defaults__
    rewritten.__doc__ = fn.__doc__
    rewritten.__qualname__ = fn.__qualname__
    rewritten.__module__ = fn.__module__
    return rewritten


_ROW = types.Array(types.float32, 1, "A")
_SCALAR = types.float32


def row_signature(slot_dims, n_hyperparameters, elementwise=False):
    """Numba argument types of the per-row call: (g, row, slots, learning_rate, hyperparameters)."""
    element = _SCALAR if elementwise else _ROW
    slots = types.Tuple(tuple(element if d == 2 else _SCALAR for d in slot_dims))
    hyper = types.Tuple((_SCALAR,) * n_hyperparameters)
    return (element, element, slots, _SCALAR, hyper)


@dataclass(frozen=True)
class CompiledRowFunction:
    """A compiled per-row function and how the update kernel may call it."""

    python_function: object
    dispatcher: object        # numba dispatcher of the (del-stripped) function
    slot_dims: tuple
    n_hyperparameters: int
    elementwise: bool
    reason: str               # why it is (not) element-wise, for users asking ``optimizer.explain()``
    fingerprint: str | None = None  # compile_cache.fingerprint of the function; None: not cacheable
    split: bool = False       # ``dispatcher`` runs the function's reductions-then-element-wise rewrite


def _check_outputs(fn, return_type, slot_dims):
    name = describe(fn)
    n_out = 1 + len(slot_dims)
    if slot_dims:
        if not isinstance(return_type, types.BaseTuple) or len(return_type) != n_out:
            raise RowFunctionError(
                f"custom computation {name} must return a tuple of {n_out} values (the new row, then "
                f"{len(slot_dims)} new slot value(s)); it returns {return_type}")
        outputs = list(return_type)
    else:
        outputs = [return_type]
    for k, (ty, dim) in enumerate(zip(outputs, (2,) + tuple(slot_dims))):
        what = "the new row" if k == 0 else f"slot {k - 1}"
        element = ty.dtype if isinstance(ty, types.Array) else ty
        if isinstance(element, types.Complex) or not isinstance(element, (types.Number, types.Boolean)):
            raise RowFunctionError(
                f"custom computation {name}: {what} must hold real numbers (stored as float32), got {ty}")
        if dim == 1 and not isinstance(ty, types.Number):
            raise RowFunctionError(
                f"custom computation {name}: {what} has slot_dims 1 (one value per row) and must be returned "
                f"as a scalar, got {ty}")
        if dim == 2 and not (isinstance(ty, types.Number) or (isinstance(ty, types.Array) and ty.ndim == 1)):
            raise RowFunctionError(
                f"custom computation {name}: {what} must be returned as a 1-D row or a scalar, got {ty}")


def compile_row_function(fn, slot_dims, n_hyperparameters, dim) -> CompiledRowFunction:
    """Compile ``fn`` for rows of width ``dim``, check its outputs on a trial row, decide element-wise."""
    if not callable(fn):
        raise RowFunctionError(f"custom computation must be callable, got {fn!r}")
    check_row_function(fn)
    slot_dims = tuple(slot_dims)
    digest = _fingerprint(fn)
    dispatcher = _dispatcher(fn, digest)
    judged = ("row function", digest, _source_digest(fn), slot_dims, n_hyperparameters)
    verdict_key = judged + (dim,)
    verdict = compile_cache.read_verdict(verdict_key) if digest is not None else None
    if verdict is None and digest is not None:
        # Judged for another row length: the verdict does not depend on it, the trial run's output lengths may.
        # The function itself (plain Python on trial rows) settles that without a compilation, which is a
        # second of a new row length's start; anything it cannot settle takes the full path below.
        verdict = compile_cache.read_verdict(judged)
        if verdict is not None and _interpreted_trial_passes(fn, slot_dims, n_hyperparameters, dim):
            compile_cache.write_verdict(verdict_key, verdict)
        else:
            verdict = None
    if verdict is not None:  # this function compiled, passed the checks and was judged before
        split = bool(verdict.get("split"))
        try:
            chosen = _split_dispatcher(fn, slot_dims) if split else dispatcher
        except NotSplittable:  # its source is gone (only bytecode shipped): judge it again
            verdict = None
        if verdict is not None:
            return CompiledRowFunction(fn, chosen, slot_dims, n_hyperparameters, verdict["elementwise"],
                                       verdict["reason"], digest, split)
    signature = row_signature(slot_dims, n_hyperparameters)
    try:
        dispatcher.compile(signature)
    except Exception as exc:  # numba raises many error types; each becomes one clear message
        cause = str(exc).strip().splitlines()
        cause = "\n".join(cause[:12])
        raise RowFunctionError(
            f"custom computation {describe(fn)} could not be compiled by Numba for rows of {dim} float32 "
            f"values and slot_dims {list(slot_dims)}:\n{cause}") from None
    result = dispatcher.overloads[signature]
    _check_outputs(fn, result.signature.return_type, slot_dims)
    # Run through the entry point of the row signature's compilation: calling the dispatcher with
    # C-contiguous trial rows would compile a variant for them (a quarter of a second per function).
    _trial_run(fn, result.entry_point, slot_dims, n_hyperparameters, dim)
    elementwise, reason = is_elementwise(result, slot_dims)
    if elementwise:
        try:
            dispatcher.compile(row_signature(slot_dims, n_hyperparameters, elementwise=True))
        except Exception as exc:
            elementwise, reason = False, f"element-wise in form, but does not compile on scalars: {exc}"
    split = False
    if not elementwise:
        split_dispatcher, why = _try_split(fn, dispatcher, signature, slot_dims, n_hyperparameters, dim)
        if split_dispatcher is not None:
            dispatcher, split = split_dispatcher, True
        reason = f"{reason}; {why}"
    if digest is not None:
        verdict = {"elementwise": elementwise, "reason": reason, "split": split}
        compile_cache.write_verdict(verdict_key, verdict)
        compile_cache.write_verdict(judged, verdict)
    return CompiledRowFunction(fn, dispatcher, slot_dims, n_hyperparameters, elementwise, reason, digest, split)


def _source_digest(fn) -> str:
    """A digest of ``fn``'s source text: the split rewrite is made from the text, the fingerprint from the
    bytecode, and a verdict must not outlive an edit of either."""
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return "no source"


def _split_dispatcher(fn, slot_dims):
    split_fn, _ = split_reductions(fn, slot_dims)
    return numba.njit(split_fn, inline="always", error_model="numpy")


def _try_split(fn, dispatcher, signature, slot_dims, n_hyperparameters, dim):
    """``(dispatcher of the split form, why)`` if ``fn`` splits (see :mod:`embedcore.split_reductions`) and
    the split form computes exactly what ``fn`` does on trial rows; else ``(None, why not)``."""
    try:
        split_fn, summary = split_reductions(fn, slot_dims)
    except NotSplittable as exc:
        return None, f"its temporaries are allocated per row (not split into loops: {exc})"
    split = numba.njit(split_fn, inline="always", error_model="numpy")
    try:
        split.compile(signature)
    except Exception as exc:
        return None, f"its temporaries are allocated per row (the split form does not compile: {exc})"
    original, split_entry = dispatcher.overloads[signature].entry_point, split.overloads[signature].entry_point
    rng = np.random.default_rng(0)
    for trial in range(3):
        g = rng.standard_normal(dim).astype(np.float32)
        row = rng.standard_normal(dim).astype(np.float32)
        slots = [np.abs(rng.standard_normal(dim)).astype(np.float32) + np.float32(0.1) if d == 2 else
                 np.float32(rng.uniform(0.1, 1.0)) for d in slot_dims]
        hyper = tuple(np.float32(rng.uniform(0.1, 0.9)) for _ in range(n_hyperparameters))
        lr = np.float32(rng.uniform(0.001, 0.1))
        expected = original(g.copy(), row.copy(), tuple(s.copy() if d == 2 else s for s, d in zip(slots, slot_dims)),
                              lr, hyper)
        got = split_entry(g.copy(), row.copy(), tuple(s.copy() if d == 2 else s for s, d in zip(slots, slot_dims)), lr,
                          hyper)
        expected, got = (expected, got) if slot_dims else ((expected,), (got,))
        for e, o in zip(expected, got):
            e, o = np.broadcast_to(np.asarray(e), (dim,)), np.broadcast_to(np.asarray(o), (dim,))
            if not np.array_equal(e.astype(np.float32), o.astype(np.float32), equal_nan=True):
                return None, "its temporaries are allocated per row (the split form disagreed on a trial row)"
    return split, f"split into loops that allocate nothing: {summary}"


# In-process caches, keyed like the disk cache: by the function *and* its fingerprint (compile_cache.fingerprint:
# its code and the values of the globals, closure cells and callees it reads). Numba freezes the globals a
# function reads when it compiles, so a function whose global changed needs a new dispatcher. Each holds the
# latest value per key, with the fingerprint it was made for; a function that cannot be fingerprinted
# (None) is compiled anew each time, since nothing tells whether what it reads changed.
_DISPATCHERS: dict = {}   # fn -> its latest dispatcher
_DISPATCHED: dict = {}    # fn -> the fingerprint that dispatcher was made for
_COMPILED: dict = {}      # (fn, slot_dims, n_hyperparameters, dim) -> (fingerprint, CompiledRowFunction)


def _fingerprint(fn) -> str | None:
    try:
        return compile_cache.fingerprint(fn)
    except compile_cache.Uncacheable:
        return None


def _dispatcher(fn, digest):
    """The Numba dispatcher of ``fn`` (del-stripped) for its current fingerprint ``digest``."""
    if digest is not None and fn in _DISPATCHERS and _DISPATCHED.get(fn) == digest:
        return _DISPATCHERS[fn]
    dispatcher = _DISPATCHERS[fn] = numba.njit(strip_del(fn), inline="always", error_model="numpy")
    _DISPATCHED[fn] = digest
    return dispatcher


def compile_cached(fn, slot_dims, n_hyperparameters, dim) -> CompiledRowFunction:
    """:func:`compile_row_function`, remembered for the process: one Numba compilation per function and
    fingerprint, so an engine built after a global the function reads has changed runs the new value."""
    key = (fn, tuple(slot_dims), n_hyperparameters, dim)
    digest = _fingerprint(fn)
    known = _COMPILED.get(key)
    if digest is not None and known is not None and known[0] == digest:
        return known[1]
    compiled = compile_row_function(fn, slot_dims, n_hyperparameters, dim)
    if digest is not None:
        _COMPILED[key] = (digest, compiled)
    return compiled


def _trial_arguments(slot_dims, n_hyperparameters, dim):
    """The scratch rows of a trial run: gradient, row, slots, learning rate, hyperparameters."""
    slots = tuple(np.full(dim, 1.0, np.float32) if d == 2 else np.float32(1.0) for d in slot_dims)
    return (np.full(dim, 0.5, np.float32), np.full(dim, 0.25, np.float32), slots, np.float32(0.01),
            tuple(np.float32(0.5) for _ in range(n_hyperparameters)))


def _interpreted_trial_passes(fn, slot_dims, n_hyperparameters, dim) -> bool:
    """Whether ``fn`` run by Python (not compiled) on trial rows returns rows of ``dim`` values. False also
    when Python cannot run it as Numba would (it raises, or returns something else): the compiled trial
    decides then."""
    try:
        out = strip_del(fn)(*_trial_arguments(slot_dims, n_hyperparameters, dim))
        outputs = out if slot_dims else (out,)
        return len(outputs) == len(slot_dims) + 1 and all(np.shape(v) in ((), (dim,)) for v in outputs)
    except Exception:  # noqa: BLE001 -- any failure sends the function down the compiled path
        return False


def _trial_run(fn, compiled, slot_dims, n_hyperparameters, dim):
    """Run once on scratch rows: every returned row must have ``dim`` values."""
    try:
        out = compiled(*_trial_arguments(slot_dims, n_hyperparameters, dim))
    except Exception as exc:  # it compiled, yet raises on a plain row (an index beyond it, say)
        raise RowFunctionError(f"custom computation {describe(fn)} raised {type(exc).__name__} on a trial row of "
                               f"{dim} values: {str(exc)[:500]}") from None
    outputs = out if slot_dims else (out,)
    for k, value in enumerate(outputs):
        shape = np.shape(value)
        if shape not in ((), (dim,)):
            what = "the new row" if k == 0 else f"slot {k - 1}"
            raise RowFunctionError(
                f"custom computation {describe(fn)} returned {what} with shape {shape}; rows have {dim} values")


# ----------------------------------------------------------------------------------------------------------
# Element-wise proof on the typed IR.

_ELEMENTWISE_BINOPS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.neg, operator.pos, operator.lt, operator.le, operator.gt, operator.ge,
    operator.eq, operator.ne, operator.and_, operator.or_, operator.xor, operator.not_, operator.invert,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
    operator.imod,
}
_SCALAR_ONLY_BUILTINS = {abs, min, max, float, int, bool}


def _is_scalar(ty) -> bool:
    return isinstance(ty, (types.Number, types.Boolean, types.NoneType, types.Omitted, types.Literal))


def is_elementwise(compile_result, slot_dims=()) -> tuple[bool, str]:
    """Prove from typed IR that the row function acts element by element; return (verdict, reason).

    Accepted: arguments, constants, globals, tuple indexing with constant indices, NumPy ufuncs and
    ``np.where``/``np.clip`` on any operands, arithmetic and comparisons, fused array expressions, math on
    scalars, branches on scalars, and calls of other jitted functions that are themselves element-wise.
    Everything else (indexing or iterating an array, reductions, array attributes, array constructors,
    stores into arrays, loops) makes the function run once per row instead.
    """
    if any(d != 2 for d in slot_dims):
        return False, "a slot with slot_dims 1 is one value per row, so the function runs once per row"
    annotation = compile_result.type_annotation
    return _typed_ir_is_elementwise(annotation.blocks, annotation.typemap, annotation.calltypes, depth=0)


def _typed_ir_is_elementwise(blocks, typemap, calltypes, depth):
    if depth > 8:
        return False, "calls nest too deeply to analyse"
    for block in blocks.values():
        for stmt in block.body:
            if isinstance(stmt, (ir.SetItem, ir.StaticSetItem, ir.SetAttr)):
                return False, f"line {stmt.loc.line}: stores into an array"
            if isinstance(stmt, ir.Branch):
                if not _is_scalar(typemap[stmt.cond.name]):
                    return False, f"line {stmt.loc.line}: branches on an array"
                continue
            if not isinstance(stmt, ir.Assign):
                continue
            ok, why = _value_is_elementwise(stmt.value, typemap, calltypes, depth)
            if not ok:
                return False, f"line {stmt.loc.line}: {why}"
            ty = typemap[stmt.target.name]
            if isinstance(ty, types.Array) and ty.ndim != 1:
                return False, f"line {stmt.loc.line}: makes a {ty.ndim}-D array"
    return True, "every operation is element-wise"


def _value_is_elementwise(value, typemap, calltypes, depth):
    if isinstance(value, (ir.Arg, ir.Const, ir.Global, ir.FreeVar, ir.Var)):
        return True, ""
    if not isinstance(value, ir.Expr):
        return False, f"unsupported statement {value}"
    op = value.op
    if op in ("arrayexpr", "build_tuple", "cast", "phi"):
        return True, ""
    if op == "exhaust_iter":  # unpacking a tuple: a, b = f(...)
        if isinstance(typemap[value.value.name], types.BaseTuple):
            return True, ""
        return False, "unpacks an array"
    if op in ("static_getitem", "typed_getitem", "getitem"):
        container = typemap[value.value.name]
        if isinstance(container, types.BaseTuple) and op == "static_getitem":
            return True, ""
        return False, f"indexes {container}"
    if op == "getattr":
        owner = typemap[value.value.name]
        if isinstance(owner, (types.Module, types.NumberClass)):
            return True, ""
        return False, f"reads attribute .{value.attr} of {owner}"
    if op in ("binop", "inplace_binop", "unary"):
        fn = value.fn
        operands = [value.lhs, value.rhs] if op != "unary" else [value.value]
        if all(_is_scalar(typemap[v.name]) for v in operands):
            return True, ""
        if fn in _ELEMENTWISE_BINOPS:
            return True, ""
        return False, f"applies {getattr(fn, '__name__', fn)} to arrays"
    if op == "call":
        return _call_is_elementwise(value, typemap, calltypes, depth)
    return False, f"uses '{op}' (loops, containers and the like run per row)"


def _call_is_elementwise(expr, typemap, calltypes, depth):
    callee = typemap[expr.func.name]
    args = [typemap[a.name] for a in expr.args] + [typemap[v.name] for _, v in expr.kws]
    scalar_args = all(_is_scalar(a) for a in args)
    if isinstance(callee, types.Function):
        key = callee.typing_key
        if is_elementwise_numpy(key):
            return True, ""
        if scalar_args and (key in _SCALAR_ONLY_BUILTINS or getattr(key, "__module__", None) == "math"):
            return True, ""
        return False, f"calls {getattr(key, '__name__', key)}, which is not element-wise on rows"
    if isinstance(callee, types.NumberClass) and scalar_args:
        return True, ""  # np.float32(x) on a scalar
    if isinstance(callee, types.Dispatcher):
        dispatcher = callee.dispatcher
        sig = calltypes[expr]
        result = dispatcher.overloads.get(tuple(sig.args))
        if result is None:
            return False, f"calls {dispatcher.py_func.__name__}, whose compiled form is not available"
        ann = result.type_annotation
        ok, why = _typed_ir_is_elementwise(ann.blocks, ann.typemap, ann.calltypes, depth + 1)
        return ok, ("" if ok else f"in {dispatcher.py_func.__name__}: {why}")
    return False, f"calls {callee}"
