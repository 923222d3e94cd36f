"""Rewrite a per-row function that reduces over its row into loops that allocate nothing.

A function such as row-wise Adagrad::

    accumulator = slot_variables[0] + np.mean(gradient * gradient)
    return embedding_table - learning_rate * gradient / np.sqrt(accumulator), accumulator

is not element-wise (``np.mean`` reads the whole row), so it runs once per row on row arrays, and Numba
allocates a new array for every row-valued expression: two or three heap allocations per row, about as
costly as the row's whole update. Such a function is *element-wise around its reductions*: every row-valued
expression is element-wise, and the reductions (``np.sum``/``np.mean`` of element-wise expressions) give
scalars. :func:`split_reductions` rewrites it as

1. each reduction, in program order, as one loop over the row accumulating the element-wise expression
   element by element (Numba's own order and accumulator type: the same float32 sum, bit for bit);
2. one loop computing every output element from the inputs' elements and the reduction scalars, written
   into the row arguments in place (the update kernel passes scratch copies, see ``kernels/update.py``).

Row-valued locals are recomputed per element inside each loop, never stored. Accepted: assignments to
names (also unpacking ``hyperparameters``), one final ``return``; names of the arguments, constants and
numeric globals; arithmetic, comparisons, the element-wise NumPy functions listed in ``_ELEMENTWISE``;
``slot_variables[k]``, ``hyperparameters[k]``; ``np.sum``/``np.mean`` (or ``.sum()``/``.mean()``) of
element-wise expressions; ``row.size`` and ``row.shape[0]``. Anything else (branches, loops, other calls,
other reductions) leaves the function as it is. The compiler also runs both forms on trial rows and keeps
the rewrite only if they agree exactly.
"""

from __future__ import annotations

import ast
import inspect
import numbers
import textwrap

import numpy as np
from numba import types
from numba.extending import overload

__all__ = ["split_reductions", "NotSplittable", "zero_like", "cast_like"]

ROW, SCALAR, SLOTS, HYPER, MODULE = "row", "scalar", "slots", "hyper", "module"

_ELEMENTWISE = {
    "sqrt", "exp", "log", "log1p", "expm1", "abs", "absolute", "fabs", "sign", "negative", "square", "reciprocal",
    "tanh", "sinh", "cosh", "sin", "cos", "tan", "arctan", "floor", "ceil", "rint", "trunc", "minimum", "maximum",
    "fmin", "fmax", "power", "where", "clip", "exp2", "log2", "log10", "float32", "float64",
}
_REDUCTIONS = {"sum", "mean"}
_PREFIX = "_ec_"


class NotSplittable(Exception):
    """The function uses something the rewrite does not handle; the message says what."""


def zero_like(value):
    """A zero of ``value``'s numeric type (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(zero_like, inline="always")
def _zero_like_impl(value):
    if isinstance(value, types.Number):
        kind = np.dtype(str(value)).type

        def impl(value):
            return kind(0)
        return impl
    return None


def cast_like(reference, value):
    """``value`` converted to ``reference``'s numeric type (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(cast_like, inline="always")
def _cast_like_impl(reference, value):
    if isinstance(reference, types.Number):
        kind = np.dtype(str(reference)).type

        def impl(reference, value):
            return kind(value)
        return impl
    return None


class _Analysis:
    """Kinds of names and expressions, the statements in order, and the reductions to hoist."""

    def __init__(self, fn, fdef, slot_dims):
        args = [a.arg for a in fdef.args.args]
        if len(args) != 5 or fdef.args.vararg or fdef.args.kwarg or fdef.args.kwonlyargs:
            raise NotSplittable("needs exactly the five positional arguments of the contract")
        self.gradient, self.table, self.slots, self.lr, self.hyper = args
        self.fn = fn
        self.slot_dims = tuple(slot_dims)
        closure = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        self.outer = {**fn.__globals__, **closure}
        self.kinds = {self.gradient: ROW, self.table: ROW, self.slots: SLOTS, self.lr: SCALAR, self.hyper: HYPER}
        self.row_defs = {}      # row-valued local -> its expression (recomputed per element)
        self.body = []          # ("scalar", name, expr) | ("reduce", var, op, expr) in program order
        self.outputs = None
        self.n_reductions = 0

    # -- kinds -------------------------------------------------------------------------------------------
    def _numpy_attr(self, node):
        """``np.<name>`` for a global or closure variable bound to the numpy module, else None."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id not in self.kinds:
            if self.outer.get(node.value.id) is np:
                return node.attr
        return None

    def kind(self, node):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, numbers.Number) and not isinstance(node.value, (bool, complex)):
                return SCALAR
            raise NotSplittable(f"line {node.lineno}: constant {node.value!r}")
        if isinstance(node, ast.Name):
            if node.id in self.kinds:
                return self.kinds[node.id]
            value = self.outer.get(node.id)
            if value is np:
                return MODULE
            if isinstance(value, numbers.Number) and not isinstance(value, (bool, complex)):
                return SCALAR
            raise NotSplittable(f"line {node.lineno}: name {node.id!r}")
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.FloorDiv, ast.Mod)):
                raise NotSplittable(f"line {node.lineno}: operator {type(node.op).__name__}")
            return self._join(node.left, node.right)
        if isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise NotSplittable(f"line {node.lineno}: operator {type(node.op).__name__}")
            return self._join(node.operand)
        if isinstance(node, ast.Compare):
            return self._join(node.left, *node.comparators)
        if isinstance(node, ast.Subscript):
            if self._is_row_length(node):
                return SCALAR
            base = self.kind(node.value)
            index = node.slice
            if base in (SLOTS, HYPER):
                if not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
                    raise NotSplittable(f"line {node.lineno}: {base} indexed by a non-constant")
                if base == HYPER:
                    return SCALAR
                if not 0 <= index.value < len(self.slot_dims):
                    raise NotSplittable(f"line {node.lineno}: slot {index.value} does not exist")
                return ROW if self.slot_dims[index.value] == 2 else SCALAR
            raise NotSplittable(f"line {node.lineno}: indexing")
        if isinstance(node, ast.Attribute):
            if node.attr == "size" and self.kind(node.value) == ROW:
                return SCALAR
            raise NotSplittable(f"line {node.lineno}: attribute .{node.attr}")
        if isinstance(node, ast.Call):
            if node.keywords:
                raise NotSplittable(f"line {node.lineno}: keyword arguments")
            reduction = self._reduction(node)
            if reduction is not None:
                op, operand = reduction
                if self.kind(operand) != ROW:
                    raise NotSplittable(f"line {node.lineno}: {op} of a scalar")
                return SCALAR
            name = self._numpy_attr(node.func)
            if name in _ELEMENTWISE:
                kind = self._join(*node.args)
                if name in ("float32", "float64") and kind == ROW:
                    raise NotSplittable(f"line {node.lineno}: np.{name} of a row")
                return kind
            raise NotSplittable(f"line {node.lineno}: call of {ast.unparse(node.func)}")
        raise NotSplittable(f"line {getattr(node, 'lineno', '?')}: {type(node).__name__}")

    def _join(self, *nodes):
        kinds = [self.kind(n) for n in nodes]
        for k in kinds:
            if k not in (ROW, SCALAR):
                raise NotSplittable(f"a {k} used as a value")
        return ROW if ROW in kinds else SCALAR

    def _is_row_length(self, node):
        """``row.shape[0]``."""
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "shape" and isinstance(node.slice, ast.Constant) and node.slice.value == 0
                and isinstance(node.value.value, ast.Name) and self.kinds.get(node.value.value.id) == ROW)

    def _reduction(self, node):
        """``(op, operand)`` for ``np.sum(x)``, ``np.mean(x)``, ``x.sum()``, ``x.mean()``; else None."""
        name = self._numpy_attr(node.func)
        if name in _REDUCTIONS and len(node.args) == 1:
            return name, node.args[0]
        if isinstance(node.func, ast.Attribute) and node.func.attr in _REDUCTIONS and not node.args \
                and self._numpy_attr(node.func) is None:
            return node.func.attr, node.func.value
        if name is not None and name in _REDUCTIONS:
            raise NotSplittable(f"line {node.lineno}: np.{name} with extra arguments")
        return None

    # -- statements --------------------------------------------------------------------------------------
    def statement(self, stmt, last):
        docstring = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        if isinstance(stmt, (ast.Pass, ast.Delete)) or docstring:
            return
        if isinstance(stmt, ast.Return):
            if not last or stmt.value is None:
                raise NotSplittable(f"line {stmt.lineno}: return before the end")
            values = list(stmt.value.elts) if isinstance(stmt.value, ast.Tuple) else [stmt.value]
            expected = 1 + len(self.slot_dims)
            if len(values) != expected:
                raise NotSplittable(f"line {stmt.lineno}: returns {len(values)} values, the contract {expected}")
            self.outputs = [self.hoist(v) for v in values]
            for value, dims in zip(self.outputs[1:], self.slot_dims):
                if dims == 1 and self.kind(value) != SCALAR:
                    raise NotSplittable(f"line {stmt.lineno}: a slot_dims=1 slot returned as a row")
            return
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            raise NotSplittable(f"line {stmt.lineno}: {type(stmt).__name__} statement")
        target, value = stmt.targets[0], stmt.value
        if isinstance(target, ast.Tuple):
            if not (isinstance(value, ast.Name) and self.kinds.get(value.id) == HYPER):
                raise NotSplittable(f"line {stmt.lineno}: tuple assignment from anything but the hyperparameters")
            for k, element in enumerate(target.elts):
                if not isinstance(element, ast.Name) or element.id.startswith(_PREFIX):
                    raise NotSplittable(f"line {stmt.lineno}: unpacking into {ast.unparse(element)}")
                self._define(element.id, ast.Subscript(value=ast.Name(value.id, ast.Load()),
                                                       slice=ast.Constant(k), ctx=ast.Load()), SCALAR)
            return
        if not isinstance(target, ast.Name) or target.id.startswith(_PREFIX) or target.id in (
                self.gradient, self.table, self.slots, self.lr, self.hyper):
            raise NotSplittable(f"line {stmt.lineno}: assignment to {ast.unparse(target)}")
        kind = self.kind(value)
        if kind not in (ROW, SCALAR):
            raise NotSplittable(f"line {stmt.lineno}: a {kind} bound to a name")
        self._define(target.id, self.hoist(value), kind)

    def _define(self, name, expr, kind):
        if name in self.kinds:
            raise NotSplittable(f"{name!r} assigned twice")
        self.kinds[name] = kind
        if kind == ROW:
            self.row_defs[name] = expr
        else:
            self.body.append(("scalar", name, expr))

    def hoist(self, node):
        """``node`` with every reduction in it replaced by a scalar computed before (appended to the body)."""
        analysis = self

        class Hoist(ast.NodeTransformer):
            def visit_Call(self, call):
                reduction = analysis._reduction(call)
                if reduction is None:
                    return self.generic_visit(call)
                op, operand = reduction
                operand = self.visit(operand)
                if analysis.kind(operand) != ROW:
                    raise NotSplittable(f"line {call.lineno}: {op} of a scalar")
                var = f"{_PREFIX}r{analysis.n_reductions}"
                analysis.n_reductions += 1
                analysis.body.append(("reduce", var, op, operand))
                analysis.kinds[var] = SCALAR
                return ast.copy_location(ast.Name(var, ast.Load()), call)

        self.kind(node)  # refuse what the rewrite cannot express before changing anything
        return Hoist().visit(node)


def _source_tree(fn):
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise NotSplittable("its source is not available") from None
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef) or tree.body[0].name != fn.__name__:
        raise NotSplittable("not a plain def")
    return tree.body[0]


def split_reductions(fn, slot_dims):
    """``(split_fn, summary)``: ``fn`` rewritten as loops (see the module docstring); raises
    :class:`NotSplittable`. ``split_fn`` writes its row outputs into its row arguments."""
    fdef = _source_tree(fn)
    a = _Analysis(fn, fdef, slot_dims)
    body = fdef.body
    for k, stmt in enumerate(body):
        a.statement(stmt, last=k == len(body) - 1)
    if a.outputs is None:
        raise NotSplittable("no return at the end")
    if not a.n_reductions:
        raise NotSplittable("nothing to split: no reduction")
    n, j = f"{_PREFIX}n", f"{_PREFIX}j"
    slot_vars = [f"{_PREFIX}slot{k}" for k in range(len(a.slot_dims))]

    def element(node):
        """Source of ``node`` at element ``j`` (rows indexed, slot tuple entries named)."""
        class Index(ast.NodeTransformer):
            def visit_Subscript(self, sub):
                if isinstance(sub.value, ast.Name) and a.kinds.get(sub.value.id) == SLOTS:
                    name = ast.Name(slot_vars[sub.slice.value], ast.Load())
                    return ast.Subscript(name, ast.Name(j, ast.Load()), ast.Load()) \
                        if a.slot_dims[sub.slice.value] == 2 else name
                if a._is_row_length(sub):
                    return ast.Name(n, ast.Load())
                return self.generic_visit(sub)

            def visit_Attribute(self, attr):
                if attr.attr == "size" and isinstance(attr.value, ast.Name) and a.kinds.get(attr.value.id) == ROW:
                    return ast.Name(n, ast.Load())
                return self.generic_visit(attr)

            def visit_Call(self, call):
                self.generic_visit(call)
                if a._numpy_attr(call.func) == "clip" and len(call.args) == 3:
                    # Numba's np.clip takes arrays only; on one element it is NumPy's definition of clip
                    def numpy(attr, *args):
                        return ast.Call(ast.Attribute(ast.Name(f"{_PREFIX}np", ast.Load()), attr, ast.Load()),
                                        list(args), [])
                    return numpy("minimum", numpy("maximum", call.args[0], call.args[1]), call.args[2])
                return call

            def visit_Name(self, name):
                if name.id in (a.gradient, a.table):
                    return ast.Subscript(ast.Name(name.id, ast.Load()), ast.Name(j, ast.Load()), ast.Load())
                if name.id in a.row_defs:
                    return ast.Name(f"{_PREFIX}e_{name.id}", ast.Load())
                return name
        return ast.unparse(Index().visit(ast.parse(ast.unparse(node), mode="eval").body))

    def scalar(node):
        return element(node)  # scalars contain no rows, so this only renames slots and lengths

    def row_locals(nodes, depth):
        """Per-element values of the row locals ``nodes`` read, in definition order."""
        needed, stack = set(), list(nodes)
        while stack:
            for sub in ast.walk(stack.pop()):
                if isinstance(sub, ast.Name) and sub.id in a.row_defs and sub.id not in needed:
                    needed.add(sub.id)
                    stack.append(a.row_defs[sub.id])
        pad = "    " * depth
        return [f"{pad}{_PREFIX}e_{name} = {element(expr)}" for name, expr in a.row_defs.items() if name in needed]

    lines = [f"def {_PREFIX}split({a.gradient}, {a.table}, {a.slots}, {a.lr}, {a.hyper}):",
             f"    {n} = {a.gradient}.shape[0]"]
    lines += [f"    {v} = {a.slots}[{k}]" for k, v in enumerate(slot_vars)]
    for entry in a.body:
        if entry[0] == "scalar":
            lines.append(f"    {entry[1]} = {scalar(entry[2])}")
            continue
        _, var, op, operand = entry
        first = f"{var}_first"
        lines.append(f"    {j} = 0")
        lines += row_locals([operand], 1)
        lines.append(f"    {first} = {element(operand)}")
        lines.append(f"    {var} = zero_like({first}) + {first}")
        lines.append(f"    for {j} in range(1, {n}):")
        lines += row_locals([operand], 2)
        lines.append(f"        {var} += {element(operand)}")
        if op == "mean":
            lines.append(f"    {var} = cast_like({var}, {var} / {n})")
    row_outputs = [(k, out) for k, out in enumerate(a.outputs) if a.kind(out) == ROW or
                   (k == 0 or a.slot_dims[k - 1] == 2)]
    destinations = {0: a.table, **{k + 1: slot_vars[k] for k, d in enumerate(a.slot_dims) if d == 2}}
    lines.append(f"    for {j} in range({n}):")
    lines += row_locals([out for _, out in row_outputs], 2)
    for k, out in row_outputs:
        lines.append(f"        {_PREFIX}o{k} = {element(out)}")
    for k, _ in row_outputs:
        lines.append(f"        {destinations[k]}[{j}] = {_PREFIX}o{k}")
    results = [a.table] + [slot_vars[k] if d == 2 else scalar(a.outputs[k + 1]) for k, d in enumerate(a.slot_dims)]
    lines.append(f"    return {results[0]}" if len(results) == 1 else f"    return ({', '.join(results)})")
    source = "\n".join(lines) + "\n"
    namespace = dict(fn.__globals__)
    namespace.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    namespace.update(zero_like=zero_like, cast_like=cast_like, **{f"{_PREFIX}np": np})
    exec(compile(source, f"<split form of {fn.__qualname__}>", "exec"), namespace)
    split = namespace[f"{_PREFIX}split"]
    split.__qualname__ = fn.__qualname__ + "[split]"
    split.source = source
    return split, f"{a.n_reductions} reduction(s) over the row, then element by element in place"
