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
numeric globals; arithmetic, comparisons, the element-wise NumPy functions (:func:`is_elementwise_numpy`,
which the compiler's element-wise proof uses too); ``slot_variables[k]``, ``hyperparameters[k]``;
``np.sum``/``np.mean`` (or ``.sum()``/``.mean()``) of element-wise expressions; ``row.size`` and
``row.shape[0]``. Anything else (branches, loops, other calls, other reductions) leaves the function as it
is. The compiler also runs both forms on trial rows and keeps the rewrite only if they agree exactly.

**Float64 accumulation.** ``np.sum(x, dtype=np.float64)`` (or ``np.mean``) adds the element values in
float64, in a fixed order that does not depend on the machine: lane ``i`` (0-7) adds the values ``i, i + 8,
i + 16, ...`` of the row's whole groups of eight, the remaining ``n % 8`` values go to lane 0, and the lanes
are summed as ``((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))``. One float64 addition after the other
is a chain LLVM may not reassociate, so it stays scalar; eight lanes are independent. When ``x`` is the
square of a row argument, clipped or not (row-wise Adagrad's ``mean(clip(g)^2)``), the lanes are one
vector of eight doubles built in LLVM IR (:func:`sum_of_squares`): the same IEEE operations lane by lane, so
the same bits as the lanes written out, several times faster.
"""

from __future__ import annotations

import ast
import inspect
import numbers
import textwrap

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["split_reductions", "NotSplittable", "zero_like", "cast_like", "is_elementwise_numpy", "sum_of_squares",
           "LANES"]

ROW, SCALAR, SLOTS, HYPER, MODULE = "row", "scalar", "slots", "hyper", "module"

_REDUCTIONS = {"sum", "mean"}
_SCALAR_CASTS = {"float32", "float64"}
_PREFIX = "_ec_"
LANES = 8


def is_elementwise_numpy(function) -> bool:
    """Whether the NumPy callable ``function`` acts element by element on its operands: every ufunc, and
    ``np.where`` / ``np.clip``. The one definition both the compiler's proof on typed code and this rewrite
    use."""
    return isinstance(function, np.ufunc) or any(function is f for f in (np.where, np.clip))


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
        self.body = []          # ("scalar", name, expr) | ("reduce", var, op, expr, wide) in program order
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
            reduction = self._reduction(node)
            if node.keywords and reduction is None:
                raise NotSplittable(f"line {node.lineno}: keyword arguments")
            if reduction is not None:
                op, operand, _ = reduction
                if self.kind(operand) != ROW:
                    raise NotSplittable(f"line {node.lineno}: {op} of a scalar")
                return SCALAR
            name = self._numpy_attr(node.func)
            if name is not None and (name in _SCALAR_CASTS or is_elementwise_numpy(getattr(np, name, None))):
                kind = self._join(*node.args)
                if name in _SCALAR_CASTS and kind == ROW:
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
        """``(op, operand, wide)`` for ``np.sum(x)``, ``np.mean(x)``, ``x.sum()``, ``x.mean()``, ``wide`` when
        given ``dtype=np.float64`` (float64 lanes, see the module docstring); else None."""
        name = self._numpy_attr(node.func)
        if name in _REDUCTIONS and len(node.args) == 1:
            return name, node.args[0], self._wide(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr in _REDUCTIONS and not node.args \
                and self._numpy_attr(node.func) is None:
            return node.func.attr, node.func.value, self._wide(node)
        if name is not None and name in _REDUCTIONS:
            raise NotSplittable(f"line {node.lineno}: np.{name} with extra arguments")
        return None

    def _wide(self, call):
        """Whether a reduction accumulates in float64 (``dtype=np.float64``, its only keyword accepted)."""
        if not call.keywords:
            return False
        if len(call.keywords) == 1 and call.keywords[0].arg == "dtype" \
                and self._numpy_attr(call.keywords[0].value) == "float64":
            return True
        raise NotSplittable(f"line {call.lineno}: a reduction with keywords other than dtype=np.float64")

    def square_of_row(self, operand):
        """``(row argument, low, high)`` when ``operand`` is ``x * x`` or ``np.square(x)`` with ``x`` a row
        argument or a row local defined as its clip (``np.clip(row, low, high)`` or ``np.minimum(np.maximum(
        row, low), high)``); ``low``/``high`` None when unclipped. Else None."""
        if isinstance(operand, ast.BinOp) and isinstance(operand.op, ast.Mult) \
                and ast.dump(operand.left) == ast.dump(operand.right):
            x = operand.left
        elif isinstance(operand, ast.Call) and self._numpy_attr(operand.func) == "square" and len(operand.args) == 1:
            x = operand.args[0]
        else:
            return None
        if not isinstance(x, ast.Name):
            return None
        if x.id in (self.gradient, self.table):
            return x.id, None, None
        definition = self.row_defs.get(x.id)
        if not isinstance(definition, ast.Call) or definition.keywords:
            return None
        name = self._numpy_attr(definition.func)
        if name == "clip" and len(definition.args) == 3:
            row, low, high = definition.args
        elif name == "minimum" and len(definition.args) == 2 and isinstance(definition.args[0], ast.Call) \
                and self._numpy_attr(definition.args[0].func) == "maximum" and len(definition.args[0].args) == 2 \
                and not definition.args[0].keywords:
            (row, low), high = definition.args[0].args, definition.args[1]
        else:
            return None
        if not (isinstance(row, ast.Name) and row.id in (self.gradient, self.table)):
            return None
        if self.kind(low) != SCALAR or self.kind(high) != SCALAR:
            return None
        return row.id, low, high

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
                op, operand, wide = reduction
                operand = self.visit(operand)
                if analysis.kind(operand) != ROW:
                    raise NotSplittable(f"line {call.lineno}: {op} of a scalar")
                var = f"{_PREFIX}r{analysis.n_reductions}"
                analysis.n_reductions += 1
                analysis.body.append(("reduce", var, op, operand, wide))
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

    def wide_sum(var, operand):
        """``var`` = the float64 eight-lane sum of ``operand`` over the row (the module docstring's order)."""
        square = a.square_of_row(operand)
        if square is not None:
            row, low, high = square
            bounds = (f"{_PREFIX}np.float32(-{_PREFIX}np.inf), {_PREFIX}np.float32({_PREFIX}np.inf)" if low is None
                      else f"{scalar(low)}, {scalar(high)}")
            return [f"    {var} = sum_of_squares({row}, {bounds})"]
        lanes = [f"{var}_t{k}" for k in range(LANES)]
        out = [f"    {' = '.join(lanes)} = 0.0", f"    for {var}_i in range(0, {n} - {n} % {LANES}, {LANES}):"]
        for k, lane in enumerate(lanes):
            out.append(f"        {j} = {var}_i + {k}")
            out += row_locals([operand], 2)
            out.append(f"        {lane} += {element(operand)}")
        out.append(f"    for {j} in range({n} - {n} % {LANES}, {n}):")
        out += row_locals([operand], 2)
        out.append(f"        {lanes[0]} += {element(operand)}")
        out.append(f"    {var} = (({lanes[0]} + {lanes[1]}) + ({lanes[2]} + {lanes[3]})) + "
                   f"(({lanes[4]} + {lanes[5]}) + ({lanes[6]} + {lanes[7]}))")
        return out

    lines = [f"def {_PREFIX}split({a.gradient}, {a.table}, {a.slots}, {a.lr}, {a.hyper}):",
             f"    {n} = {a.gradient}.shape[0]"]
    lines += [f"    {v} = {a.slots}[{k}]" for k, v in enumerate(slot_vars)]
    for entry in a.body:
        if entry[0] == "scalar":
            lines.append(f"    {entry[1]} = {scalar(entry[2])}")
            continue
        _, var, op, operand, wide = entry
        if wide:
            lines += wide_sum(var, operand)
        else:
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
    namespace.update(zero_like=zero_like, cast_like=cast_like, sum_of_squares=sum_of_squares, **{f"{_PREFIX}np": np})
    exec(compile(source, f"<split form of {fn.__qualname__}>", "exec"), namespace)
    split = namespace[f"{_PREFIX}split"]
    split.__qualname__ = fn.__qualname__ + "[split]"
    split.source = source
    return split, f"{a.n_reductions} reduction(s) over the row, then element by element in place"

# ----------------------------------------------------------------------------------------------------------
# The float64 lanes of a row's (clipped) squares as one LLVM vector (see "Float64 accumulation" above).

def _vector_types(row, low, high):
    """Whether the vector path takes these Numba types: a C-contiguous float32 row, float32 bounds."""
    return (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32
            and low == types.float32 and high == types.float32)


@intrinsic
def _lanes_of_squares(typingctx, row, low, high):
    """The eight lane sums over the row's whole groups of eight (a C-contiguous float32 row)."""
    if not _vector_types(row, low, high):
        return None
    result_type = types.UniTuple(types.float64, LANES)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        low_v, high_v = args[1], args[2]
        f32, f64 = ir.FloatType(), ir.DoubleType()
        v32, v64 = ir.VectorType(f32, LANES), ir.VectorType(f64, LANES)
        intp = context.get_value_type(types.intp)
        n = builder.extract_value(array.shape, 0)
        whole = builder.and_(n, intp(~(LANES - 1)))

        def splat(value, vector_type):
            vector = ir.Constant(vector_type, ir.Undefined)
            for lane in range(LANES):
                vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), lane))
            return vector
        low_s, high_s = splat(low_v, v32), splat(high_v, v32)

        entry = builder.block
        check = builder.append_basic_block("squares.check")
        body = builder.append_basic_block("squares.body")
        done = builder.append_basic_block("squares.done")
        builder.branch(check)
        builder.position_at_end(check)
        i = builder.phi(intp)
        total = builder.phi(v64)
        i.add_incoming(intp(0), entry)
        total.add_incoming(ir.Constant(v64, [0.0] * LANES), entry)
        builder.cbranch(builder.icmp_signed("<", i, whole), body, done)
        builder.position_at_end(body)
        pointer = builder.bitcast(builder.gep(array.data, [i]), v32.as_pointer())
        values = builder.load(pointer, align=4)
        # min(max(v, low), high) as Numba computes it: max(v, low) = low if low > v else v, and
        # min(m, high) = high if high < m else m.
        values = builder.select(builder.fcmp_ordered(">", low_s, values), low_s, values)
        values = builder.select(builder.fcmp_ordered("<", high_s, values), high_s, values)
        squares = builder.fpext(builder.fmul(values, values), v64)
        next_total = builder.fadd(total, squares)
        i.add_incoming(builder.add(i, intp(LANES)), body)
        total.add_incoming(next_total, body)
        builder.branch(check)
        builder.position_at_end(done)
        out = cgutils.get_null_value(context.get_value_type(result_type))
        for lane in range(LANES):
            out = builder.insert_value(out, builder.extract_element(total, ir.Constant(ir.IntType(32), lane)), lane)
        return out

    return result_type(row, low, high), codegen


@njit(inline="always")
def _clipped_square(row, j, low, high):
    g = min(max(row[j], low), high)
    return g * g  # float32, widened to float64 by the sum it is added to


@njit(inline="always")
def _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high):
    n = row.shape[0]
    for j in range(n - n % LANES, n):
        t0 += _clipped_square(row, j, low, high)
    return ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))


@njit(inline="always")
def _sum_of_squares_loops(row, low, high):
    """The same sum in plain loops, in the same order."""
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = 0.0
    for j in range(0, row.shape[0] - row.shape[0] % LANES, LANES):
        t0, t1 = t0 + _clipped_square(row, j, low, high), t1 + _clipped_square(row, j + 1, low, high)
        t2, t3 = t2 + _clipped_square(row, j + 2, low, high), t3 + _clipped_square(row, j + 3, low, high)
        t4, t5 = t4 + _clipped_square(row, j + 4, low, high), t5 + _clipped_square(row, j + 5, low, high)
        t6, t7 = t6 + _clipped_square(row, j + 6, low, high), t7 + _clipped_square(row, j + 7, low, high)
    return _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high)


def sum_of_squares(row, low, high):
    """The float64 eight-lane sum (module docstring) of ``min(max(v, low), high) ** 2`` over the float32 values
    ``v`` of ``row``, each square in float32 (callable from jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(sum_of_squares, inline="always")
def _sum_of_squares_impl(row, low, high):
    if not (isinstance(row, types.Array) and row.ndim == 1):
        return None
    if _vector_types(row, low, high):
        def impl(row, low, high):
            t0, t1, t2, t3, t4, t5, t6, t7 = _lanes_of_squares(row, low, high)
            return _combine(t0, t1, t2, t3, t4, t5, t6, t7, row, low, high)
        return impl

    def impl_loops(row, low, high):
        return _sum_of_squares_loops(row, low, high)
    return impl_loops
