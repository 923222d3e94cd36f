"""JAX custom computations -> :class:`~.numpy_source.Program`, through their jaxpr.

The function (over ``jax.numpy`` / ``jax.lax``, jitted or not) is traced once with ``jax.make_jaxpr`` on
one ``jax.ShapeDtypeStruct`` per value of its :class:`~.contracts.Contract`, nested as the contract's
parameters nest, each row of a *symbolic* length (``jax.export``'s shape polymorphism, so one translation
serves every ``dim``: ``jnp.mean`` divides by the row's length, not by a number fixed at tracing): for the
optimizer, float32 gradient and row, each slot a row (``slot_dims`` 2) or ``()`` (``slot_dims`` 1), the
learning rate ``()`` and the hyperparameters a tuple of ``()``; for ``EvictByScore``'s score, the row
float32 and ``last_seen``, ``count`` and ``step`` int64 ``()``. JAX traces in the process's own
configuration: without ``jax_enable_x64`` an int64 argument is an int32 in the jaxpr, and the translation
converts it on entry as JAX converts such an argument (wrapping), then follows the jaxpr's int32
arithmetic. JAX promotes mixed dtypes with explicit ``convert_element_type`` equations, so each equation
is of one dtype, as the program's operations are. Its equations are translated in order:

* ``add sub mul div neg max min pow rem`` (``rem`` is C's ``fmod``), ``abs sign sqrt rsqrt square exp
  log``, ``integer_pow`` (as XLA computes it: repeated squaring, ``x**2 = x * x``, a negative power
  ``1 / x**|y|``), ``clamp(lo, x, hi) = min(max(x, lo), hi)``;
* comparisons ``lt le gt ge eq ne``; ``and or xor not`` of booleans; ``select_n(p, a, b)`` (``b`` where
  ``p``: ``jnp.where``); ``convert_element_type``;
* ``reduce_sum reduce_max reduce_min`` over the row, ``dim_as_value`` (the row's length);
* structure: literals and closed-over constants (scalars and rows), ``broadcast_in_dim``,
  ``squeeze``, ``reshape`` and ``expand_dims`` that keep a scalar a scalar (or a row a row), ``copy``, and
  the bodies of ``pjit``/``jit``, ``closed_call``, ``core_call``, ``remat``, ``custom_jvp_call`` and
  ``custom_vjp_call`` inlined (their derivative rules are irrelevant to an update).

Any other primitive raises :class:`embedcore.compiler.RowFunctionError` naming it and the function.
"""

from __future__ import annotations

import numpy as np

from .numpy_source import Program, TranslationError

_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "maximum", "min": "minimum",
           "pow": "pow", "rem": "fmod", "lt": "less", "le": "less_equal", "gt": "greater",
           "ge": "greater_equal", "eq": "equal", "ne": "not_equal"}
_LOGICAL = {"and": "logical_and", "or": "logical_or", "xor": "logical_xor"}
_UNARY = {"neg": "neg", "abs": "abs", "sign": "sign", "sqrt": "sqrt", "rsqrt": "rsqrt", "square": "square",
          "exp": "exp", "log": "log"}
_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr"}
_RESHAPES = {"squeeze", "reshape", "expand_dims", "broadcast_in_dim"}
SUPPORTED_PRIMITIVES = tuple(sorted({*_BINARY, *_LOGICAL, *_UNARY, *_REDUCTIONS, *_CALLS, *_RESHAPES, "not",
                                     "integer_pow", "clamp", "select_n", "convert_element_type", "dim_as_value",
                                     "copy", "copy_p"}))


class UnsupportedPrimitive(TranslationError):
    def __init__(self, eqn, why=""):
        self.primitive = eqn.primitive.name
        super().__init__(f"JAX primitive {eqn.primitive.name} {why or 'is not supported'}")


def is_jax_function(fn) -> bool:
    """A ``jax.jit``-wrapped function, judged by type, without importing JAX."""
    return (type(fn).__module__ or "").split(".")[0] in ("jax", "jaxlib")


def python_function(fn):
    return getattr(fn, "__wrapped__", None) or fn


def _symbolic_length():
    try:
        from jax import export
    except ImportError:  # JAX before 0.4.30
        from jax.experimental import export
    (n,) = export.symbolic_shape("row_length")
    return n


def trace(fn, contract):
    """``jax.make_jaxpr`` of ``fn`` for ``contract`` (each row of symbolic length)."""
    import jax
    import jax.numpy as jnp

    length = _symbolic_length()

    def spec(rank, dtype):
        return jax.ShapeDtypeStruct((length,) if rank == 1 else (), jnp.dtype(dtype))

    specs = [spec(p.rank, p.dtype) if p.items is None else tuple(spec(r, p.dtype) for r in p.items)
             for p in contract.parameters]
    return jax.make_jaxpr(fn)(*specs)


def to_program(fn, contract, name, qualname, module) -> Program:
    """Trace ``fn`` for ``contract`` and translate its jaxpr (raises :class:`TranslationError`; other
    exceptions come from tracing)."""
    closed = trace(fn, contract)
    program = Program(name, qualname, module, f"JAX function {module}.{qualname}", contract)
    jaxpr = closed.jaxpr
    leaves = contract.leaves()
    if len(jaxpr.invars) != len(leaves):
        raise TranslationError(f"its jaxpr takes {len(jaxpr.invars)} inputs for the {len(leaves)} values of "
                               f"{contract.describe()}")
    env = {}
    for var, leaf, value in zip(jaxpr.invars, leaves, program.arguments()):
        traced = np.dtype(var.aval.dtype).name
        if traced != leaf.dtype:  # JAX's int32 for an int64 argument without jax_enable_x64
            value = program.apply("cast", value, dtype=traced, note=f"JAX takes {leaf.dtype} {leaf.source} as {traced}")
        env[var] = value
    outputs = _run(program, jaxpr, closed.consts, env)
    program.set_outputs(outputs)
    return program


def _rank_of(aval, what):
    shape = getattr(aval, "shape", ())
    if len(shape) > 1:
        raise TranslationError(f"{what} makes a value of shape {shape}; a row function has scalars and rows only")
    return len(shape)


def _run(program, jaxpr, consts, env):
    """Translate the equations of ``jaxpr`` (inputs already in ``env``); the values of its outputs."""
    env = dict(env)
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = program.constant(np.asarray(value))

    def read(atom):
        if type(atom).__name__ == "Literal":
            return program.constant(np.asarray(atom.val, dtype=atom.aval.dtype))
        return env[atom]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for v in eqn.outvars:
            _rank_of(v.aval, f"JAX primitive {name}")
        ins = [read(a) for a in eqn.invars]
        note = name
        if name in _CALLS:
            outs = _inline(program, eqn, ins)
        elif name in _BINARY:
            outs = [program.apply(_BINARY[name], *ins, note=note)]
        elif name in _LOGICAL or name == "not":
            if any(v.dtype != "bool" for v in ins):
                raise UnsupportedPrimitive(eqn, "of integers (bitwise) is not supported; only of booleans")
            op = "logical_not" if name == "not" else _LOGICAL[name]
            outs = [program.apply(op, *ins, note=note)]
        elif name in _UNARY:
            outs = [program.apply(_UNARY[name], *ins, note=note)]
        elif name == "integer_pow":
            outs = [_integer_pow(program, ins[0], int(eqn.params["y"]), note)]
        elif name == "clamp":
            low, x, high = ins
            outs = [program.apply("minimum", program.apply("maximum", x, low, note=note), high, note=note)]
        elif name == "select_n":
            if len(ins) != 3 or ins[0].dtype != "bool":
                raise UnsupportedPrimitive(eqn, "with more than two cases or an integer predicate")
            outs = [program.apply("select", ins[0], ins[2], ins[1], note=note)]
        elif name == "convert_element_type":
            outs = [program.apply("cast", ins[0], dtype=np.dtype(eqn.params["new_dtype"]).name, note=note)]
        elif name in _REDUCTIONS:
            axes = tuple(eqn.params["axes"])
            x = ins[0]
            if axes not in ((), (0,)) or (x.rank == 0 and axes):
                raise UnsupportedPrimitive(eqn, f"over axes {axes}")
            outs = [program.apply(_REDUCTIONS[name], x, note=note) if axes else x]
        elif name == "dim_as_value":
            outs = [program.apply("row_length", note=note)]
        elif name in _RESHAPES:
            x = ins[0]
            rank = len(eqn.outvars[0].aval.shape)
            size_one = all(isinstance(d, int) and d == 1 for d in eqn.outvars[0].aval.shape)
            if not (x.rank == 0 and (rank == 0 or size_one) or x.rank == 0 and name == "broadcast_in_dim"
                    or x.rank == 1 and rank == 1):
                raise UnsupportedPrimitive(eqn, f"from a rank-{x.rank} value to shape {eqn.outvars[0].aval.shape}")
            outs = [x]  # a scalar broadcasts as NumPy does; a row stays the row
        elif name in ("copy", "copy_p"):
            outs = [ins[0]]
        else:
            raise UnsupportedPrimitive(eqn)
        for var, value in zip(eqn.outvars, outs):
            if type(var).__name__ != "DropVar":
                env[var] = value
    return [read(a) for a in jaxpr.outvars]


def _inline(program, eqn, ins):
    """The outputs of a call primitive's body, translated in place."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if body is not None:
            break
    else:
        raise UnsupportedPrimitive(eqn, "has no body to inline")
    if hasattr(body, "eqns"):  # an open Jaxpr (remat)
        inner, consts = body, ()
    else:  # a ClosedJaxpr
        inner, consts = body.jaxpr, body.consts
    if len(inner.invars) != len(ins):
        raise UnsupportedPrimitive(eqn, f"passes {len(ins)} values to a body of {len(inner.invars)} inputs")
    return _run(program, inner, consts, dict(zip(inner.invars, ins)))


def _integer_pow(program, x, y, note):
    """``x ** y`` for an integer ``y`` as XLA's expansion computes it: binary powering by multiplication
    (``x**2 = x * x``, ``x**3 = x * (x * x)``...), ``1 / x**|y|`` for a negative ``y``, ``1`` for 0."""
    if y == 0:
        return program.constant(np.ones((), x.dtype))
    power, acc = abs(y), None
    while power > 0:
        if power & 1:
            acc = x if acc is None else program.apply("mul", acc, x, note=note)
        power >>= 1
        if power > 0:
            x = program.apply("mul", x, x, note=note)
    if y < 0:
        acc = program.apply("div", program.constant(np.ones((), acc.dtype)), acc, note=note)
    return acc
