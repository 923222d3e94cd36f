"""TensorFlow custom computations -> :class:`~.numpy_source.Program`.

The function (a ``tf.function``, or a plain Python function using TF ops, which is wrapped in
``tf.function`` as TensorFlow's TPU embedding does) is traced once with one ``tf.TensorSpec`` per value
of its :class:`~.contracts.Contract`, nested as the contract's parameters nest: for the optimizer, float32
gradient and row ``[None]``, each slot ``[None]`` (``slot_dims`` 2) or ``[]`` (``slot_dims`` 1), the
learning rate ``[]`` and the hyperparameters as a tuple of ``[]``; for ``EvictByScore``'s score, the row
float32 ``[None]`` and ``last_seen``, ``count`` and ``step`` int64 ``[]``. TensorFlow refuses to mix dtypes
without ``tf.cast``, so the graph's ops are each of one dtype, as the program's are. The ops the outputs
depend on (data inputs only: control dependencies, such as assertions, are not part of a row update) are
translated in graph order:

* element-wise math: ``AddV2 Add Sub Mul RealDiv Div DivNoNan FloorDiv FloorMod TruncateMod Pow Maximum
  Minimum Neg Abs Sign Sqrt Rsqrt Square Exp Log Reciprocal Inv AddN``, ``ClipByValue(x, lo, hi) =
  max(min(x, hi), lo)`` (TensorFlow's kernel order);
* ``Less LessEqual Greater GreaterEqual Equal NotEqual LogicalAnd LogicalOr LogicalNot``,
  ``Select SelectV2`` (``tf.where``), ``Cast``;
* row reductions ``Sum Mean Max Min`` over axis 0 / -1 (``keepdims`` too), ``EuclideanNorm`` as
  ``sqrt(sum(x * x))`` (``tf.norm`` traces as ``Sqrt(Sum(Mul))`` and needs nothing special), ``Size``;
* ``Const`` (scalars and rows), ``Placeholder`` (the arguments), captured eager constants;
* structure: ``Identity IdentityN StopGradient Snapshot PreventGradient EnsureShape``, ``Squeeze Reshape
  ExpandDims`` of a scalar, and slot or hyperparameter lists packed into one tensor and taken apart again
  (``Pack``, then ``Unpack``, ``StridedSlice`` or ``GatherV2`` with constant indices);
* calls of other ``tf.function`` s (``PartitionedCall``, ``StatefulPartitionedCall``): the called graph is
  translated in place, by the same rules.

Anything else (a ``tf.Variable`` read, ``tf.cond`` or loops, indexing into the row, other ops) raises
:class:`embedcore.compiler.RowFunctionError` naming the op and the function.
"""

from __future__ import annotations

import numpy as np

from .numpy_source import Program, TranslationError

_BINARY = {"AddV2": "add", "Add": "add", "Sub": "sub", "Mul": "mul", "RealDiv": "div", "DivNoNan": "div_no_nan",
           "FloorDiv": "floordiv", "FloorMod": "mod", "TruncateMod": "fmod", "Pow": "pow", "Maximum": "maximum",
           "Minimum": "minimum", "Less": "less", "LessEqual": "less_equal", "Greater": "greater",
           "GreaterEqual": "greater_equal", "Equal": "equal", "NotEqual": "not_equal",
           "LogicalAnd": "logical_and", "LogicalOr": "logical_or"}
_UNARY = {"Neg": "neg", "Abs": "abs", "Sign": "sign", "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Square": "square",
          "Exp": "exp", "Log": "log", "Reciprocal": "reciprocal", "Inv": "reciprocal", "LogicalNot": "logical_not"}
_REDUCTIONS = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min"}
_ALIASES = {"Identity", "StopGradient", "Snapshot", "PreventGradient", "EnsureShape"}
_RESHAPES = {"Squeeze", "Reshape", "ExpandDims"}
_CALLS = {"PartitionedCall", "StatefulPartitionedCall"}  # a tf.function calling another: inlined
SUPPORTED_OPS = tuple(sorted({*_BINARY, *_UNARY, *_REDUCTIONS, *_ALIASES, *_RESHAPES, *_CALLS, "Const", "Placeholder",
                              "IdentityN", "ClipByValue", "Select", "SelectV2", "Cast", "EuclideanNorm", "Size",
                              "AddN", "Pack", "Unpack", "StridedSlice", "GatherV2", "Div"}))


class _Packed(tuple):
    """Values stacked along a new first axis (``tf.stack(slot_variables)``): never emitted, only taken
    apart again."""


class UnsupportedOp(TranslationError):
    def __init__(self, op, why=""):
        self.op_type, self.op_name = op.type, op.name
        super().__init__(f"TensorFlow op {op.type} ('{op.name}') {why or 'is not supported'}")


def is_tf_function(fn) -> bool:
    """A ``tf.function`` (``PolymorphicFunction``) or a ``ConcreteFunction``, judged by type, without
    importing TensorFlow."""
    return (type(fn).__module__ or "").startswith("tensorflow") and hasattr(fn, "get_concrete_function") \
        or _is_concrete(fn)


def _is_concrete(fn) -> bool:
    return (type(fn).__module__ or "").startswith("tensorflow") and hasattr(fn, "graph") \
        and hasattr(fn, "structured_outputs")


def python_function(fn):
    """The Python function behind a ``tf.function`` (for its name and module), else ``fn``."""
    return getattr(fn, "python_function", None) or getattr(fn, "_python_function", None) or fn


def trace(fn, contract):
    """The ``ConcreteFunction`` of ``fn`` for the ``TensorSpec``\\ s of ``contract``."""
    import tensorflow as tf

    if _is_concrete(fn):
        return fn
    function = fn if is_tf_function(fn) else tf.function(fn)
    if getattr(function, "input_signature", None) is not None:
        return function.get_concrete_function()

    def spec(rank, dtype):
        return tf.TensorSpec([None] if rank == 1 else [], tf.as_dtype(dtype))

    specs = [spec(p.rank, p.dtype) if p.items is None else tuple(spec(r, p.dtype) for r in p.items)
             for p in contract.parameters]
    return function.get_concrete_function(*specs)


def to_program(fn, contract, name, qualname, module) -> Program:
    """Trace ``fn`` for ``contract`` and translate its graph (raises :class:`TranslationError`; other
    exceptions come from tracing)."""
    import tensorflow as tf

    concrete = trace(fn, contract)
    graph = concrete.graph
    program = Program(name, qualname, module, f"TensorFlow function {module}.{qualname}", contract)
    env = {}
    leaves = contract.leaves()
    inputs = list(graph.inputs)
    if len(inputs) < len(leaves):
        raise TranslationError(f"its graph has {len(inputs)} inputs for the {len(leaves)} values of "
                               f"{contract.describe()}")
    for tensor, leaf, value in zip(inputs, leaves, program.arguments()):
        if tensor.dtype.name != leaf.dtype:
            raise TranslationError(f"its input {tensor.name} is {tensor.dtype.name} (an input_signature?), where "
                                   f"{contract.describe()} passes {leaf.source} as {leaf.dtype}")
        env[tensor.name] = value
    captured = list(getattr(concrete, "captured_inputs", ()))
    for tensor, value in zip(inputs[len(leaves):], captured):
        if value.dtype == tf.resource:
            raise TranslationError(
                f"it reads a tf.Variable ({tensor.name}); a per-row function sees only its arguments: pass "
                "the variable's value as a hyperparameter (a callable returning it)")
        env[tensor.name] = np.asarray(value.numpy())

    outputs = tf.nest.flatten(concrete.structured_outputs)
    if any(t is None for t in outputs):
        raise TranslationError("it returns None")
    needed = _needed_ops([t.op for t in outputs])
    for op in graph.get_operations():
        if op.name in needed:
            _translate_op(program, op, env, tf)
    program.set_outputs([_value(program, env, t) for t in outputs])
    return program


def _needed_ops(ops):
    needed, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op.name in needed:
            continue
        needed.add(op.name)
        stack.extend(t.op for t in op.inputs)
    return needed


def _value(program, env, tensor):
    entry = env[tensor.name]
    if isinstance(entry, np.ndarray):
        return program.constant(entry)
    if isinstance(entry, _Packed):
        raise TranslationError(f"{tensor.name} stacks several values into a {len(entry)}-row tensor, which "
                               "is only taken apart again (unstack, [k]) in a row function")
    return entry


def _const_ints(env, tensor, op):
    entry = env[tensor.name]
    if not isinstance(entry, np.ndarray):
        raise UnsupportedOp(op, f"has a non-constant {tensor.name} where a constant index or axis is needed")
    return [int(x) for x in np.atleast_1d(entry)]


def _check_rank(op):
    for t in op.outputs:
        rank = t.shape.rank
        if rank is None or rank > 1:
            if op.type in ("Pack",):
                continue
            shape = "of unknown rank" if rank is None else f"of shape {t.shape}"
            raise UnsupportedOp(op, f"makes a tensor {shape}; a row function has scalars and rows only")


def _translate_op(program, op, env, tf):
    kind = op.type
    out = op.outputs[0].name if op.outputs else None
    note = f"{kind} '{op.name}'"

    def value(k):
        return _value(program, env, op.inputs[k])

    if kind == "Placeholder":
        if out not in env:
            raise UnsupportedOp(op, "is an input that is not one of the contract's arguments")
        return
    _check_rank(op)
    if kind == "Const":
        env[out] = np.asarray(tf.make_ndarray(op.get_attr("value")))
        if env[out].ndim > 1:
            raise UnsupportedOp(op, f"is a constant of shape {list(env[out].shape)}")
    elif kind in _ALIASES:
        env[out] = env[op.inputs[0].name]
    elif kind == "IdentityN":
        for t_in, t_out in zip(op.inputs, op.outputs):
            env[t_out.name] = env[t_in.name]
    elif kind in _BINARY:
        env[out] = program.apply(_BINARY[kind], value(0), value(1), note=note)
    elif kind == "Div":
        if not op.inputs[0].dtype.is_floating:
            raise UnsupportedOp(op, "divides integers (use tf.math.floordiv or truediv)")
        env[out] = program.apply("div", value(0), value(1), note=note)
    elif kind in _UNARY:
        env[out] = program.apply(_UNARY[kind], value(0), note=note)
    elif kind == "AddN":
        total = value(0)
        for k in range(1, len(op.inputs)):
            total = program.apply("add", total, value(k), note=note)
        env[out] = total
    elif kind == "ClipByValue":
        low = program.apply("minimum", value(0), value(2), note=note)
        env[out] = program.apply("maximum", low, value(1), note=note)
    elif kind in ("Select", "SelectV2"):
        env[out] = program.apply("select", value(0), value(1), value(2), note=note)
    elif kind == "Cast":
        env[out] = program.apply("cast", value(0), dtype=op.get_attr("DstT").as_numpy_dtype, note=note)
    elif kind in _REDUCTIONS or kind == "EuclideanNorm":
        x = value(0)
        axes = _const_ints(env, op.inputs[1], op)
        if x.rank == 1 and not axes:
            env[out] = x
            return
        if x.rank == 1 and axes not in ([0], [-1]) or x.rank == 0 and axes:
            raise UnsupportedOp(op, f"reduces over axes {axes} of a rank-{x.rank} value")
        if kind == "EuclideanNorm":
            env[out] = program.apply("sqrt", program.apply("sum", program.apply("mul", x, x, note=note),
                                                           note=note), note=note)
        else:
            env[out] = program.apply(_REDUCTIONS[kind], x, note=note)
    elif kind == "Size":
        x = value(0)
        # the count as Numba's int64 (TensorFlow's int32 holds the same number)
        env[out] = program.constant(np.int64(1)) if x.rank == 0 else program.apply("row_length", note=note)
    elif kind in _RESHAPES:
        x = value(0)
        shape = op.outputs[0].shape
        if x.rank == 0 and shape.is_fully_defined() and shape.num_elements() == 1:
            env[out] = x
        elif x.rank == 1 and shape.rank == 1:
            env[out] = x
        else:
            raise UnsupportedOp(op, f"reshapes a rank-{x.rank} value to {shape}")
    elif kind == "Pack":
        if op.get_attr("axis") != 0:
            raise UnsupportedOp(op, "stacks along an axis other than 0")
        env[out] = _Packed(value(k) for k in range(len(op.inputs)))
    elif kind == "Unpack":
        packed = env[op.inputs[0].name]
        if not isinstance(packed, _Packed) or op.get_attr("axis") != 0:
            raise UnsupportedOp(op, "takes apart a tensor that is not a stack of slots or hyperparameters")
        for t_out, item in zip(op.outputs, packed):
            env[t_out.name] = item
    elif kind in ("StridedSlice", "GatherV2"):
        env[out] = _take(program, op, env)
    elif kind in _CALLS:
        _inline_call(program, op, env, tf)
    else:
        raise UnsupportedOp(op)


def _inline_call(program, op, env, tf):
    """A call of another ``tf.function`` (one decorated function calling another): the called graph's ops
    translated in place, its inputs the call's values, the call's outputs its outputs."""
    try:
        called = op.graph._get_function(op.get_attr("f").name).graph
    except Exception:  # a TensorFlow without the function library lookup
        raise UnsupportedOp(op, "calls a function whose graph TensorFlow does not expose") from None
    if len(called.inputs) != len(op.inputs) or len(called.outputs) != len(op.outputs):
        raise UnsupportedOp(op, "calls a function whose inputs or outputs do not match the call's")
    inner = {t.name: env[s.name] for t, s in zip(called.inputs, op.inputs)}
    needed = _needed_ops([t.op for t in called.outputs])
    for called_op in called.get_operations():
        if called_op.name in needed:
            _translate_op(program, called_op, inner, tf)
    for t_out, t_called in zip(op.outputs, called.outputs):
        env[t_out.name] = inner[t_called.name]


def _take(program, op, env):
    """``stacked[k]`` of a packed list (``StridedSlice`` with constant begin and shrink, or ``GatherV2``),
    or a slice that keeps a scalar as it is."""
    packed = env[op.inputs[0].name]
    if op.type == "GatherV2":
        index = _const_ints(env, op.inputs[1], op)
        axis = _const_ints(env, op.inputs[2], op)
        if not isinstance(packed, _Packed) or len(index) != 1 or axis != [0] or op.outputs[0].shape.rank is None:
            raise UnsupportedOp(op, "gathers from something that is not a stack of slots or hyperparameters")
        return packed[index[0]]
    begin, end, strides = (_const_ints(env, op.inputs[k], op) for k in (1, 2, 3))
    shrink = op.get_attr("shrink_axis_mask")
    if isinstance(packed, _Packed):
        if len(begin) == 1 and strides == [1] and shrink & 1 and -len(packed) <= begin[0] < len(packed):
            return packed[begin[0]]
        raise UnsupportedOp(op, f"slices a stack of {len(packed)} values other than by one constant index")
    x = _value(program, env, op.inputs[0])
    if x.rank == 0:
        return x
    raise UnsupportedOp(op, "indexes or slices a row (a per-row function works on whole rows)")
