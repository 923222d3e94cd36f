"""A small op-level program of one per-row function, and the one emitter that writes it as NumPy-level Python.

Both translators (:mod:`.tensorflow_graph`, :mod:`.jaxpr`) build a :class:`Program` for one
:class:`~.contracts.Contract` (the optimizer's or ``EvictByScore``'s): the contract's arguments,
constants, and operations from the fixed vocabulary :data:`OPS`, each producing a :class:`Value` that is
either a *scalar* (rank 0: one number per table row, such as the learning rate, a hyperparameter, a
``slot_dims=1`` slot, a score's ``step`` or a reduction) or a *row* (rank 1: one number per element of the
row). Broadcasting is NumPy's: a scalar combined with a row acts on every element. A value with a single
element (TensorFlow's ``keepdims`` reductions, shape ``[1]``) is a scalar here, which broadcasts the same way.

:meth:`Program.to_function` emits one statement per operation, in program order, with NumPy functions
that Numba compiles (``np.sqrt``, ``np.where``, ``np.sum``, ...) and constants written as typed literals
(``np.float32(0.5)``: bit for bit the framework's float32 constant), ``exec``s it, and registers the text
with :mod:`linecache`, so that ``inspect.getsource`` reads it as it reads any function's source. The
result is an ordinary embedcore row function: the compiler proves it element-wise or splits its reductions
from that text, and :func:`embedcore.compile_cache.fingerprint` takes its bytecode and constants (the same
text gives the same fingerprint in every process; other constants or operations give another one).

The semantics are those of the emitted NumPy code, which for each operation is the framework's
definition:

========================  ================================================================================
``add sub mul div``       ``a + b``, ``a - b``, ``a * b``, ``a / b`` (IEEE float, same dtype)
``div_no_nan``            ``0`` where ``b == 0``, else ``a / b``
``floordiv mod fmod``     ``floor(a / b)`` (``np.floor_divide``); ``a - b floor(a / b)`` (``np.mod``);
                          C's ``fmod`` (``np.fmod``: the remainder with the sign of ``a``)
``pow maximum minimum``   ``np.power``, ``np.maximum``, ``np.minimum`` (NaN propagates)
``neg abs sign``          ``-a``, ``|a|``, ``sign(a)`` in {-1, 0, 1} (NaN stays NaN)
``sqrt rsqrt square``     ``sqrt(a)``, ``1 / sqrt(a)``, ``a * a``
``exp log reciprocal``    ``e^a``, ``ln a``, ``1 / a``
``less ... not_equal``    comparisons, giving booleans
``logical_and/or/xor/not``  on booleans
``select``                ``where(c, a, b)``: ``a`` where ``c`` holds, else ``b``
``cast``                  to ``dtype``; bool -> number is 0/1, number -> bool is ``!= 0``
``sum mean max min``      over the row, giving a scalar (of a scalar: the scalar itself)
``row_length``            the number of elements of a row (the contract's first row argument's ``.size``)
========================  ================================================================================

Integers are fixed-width and wrap, as in TensorFlow, JAX and NumPy; Numba computes integer arithmetic on
scalars in int64, so a result of a narrower integer dtype (JAX's int32 without ``jax_enable_x64``) is
written ``np.int32(...)``, which wraps it back. Integer ``div div_no_nan floordiv mod fmod pow mean`` and
the float functions (``sqrt rsqrt exp log reciprocal``) of integers are refused (``TranslationError``):
their frameworks' definitions (truncation or flooring, division by zero) differ; cast to a float first.
"""

from __future__ import annotations

import hashlib
import keyword
import linecache
import re
from dataclasses import dataclass, field

import numpy as np

from .contracts import Contract

__all__ = ["Program", "Value", "OPS", "TranslationError", "ensure_source"]


class TranslationError(Exception):
    """An operation, shape or dtype that the program cannot express; the translators turn it into a
    :class:`embedcore.compiler.RowFunctionError` naming the function."""


_DTYPES = {"float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64"}

# op -> (number of inputs, result dtype rule). Rules: "same" (the inputs' common dtype), "bool", "cast"
# (the ``dtype`` attribute), "select" (the common dtype of inputs 1 and 2), "length" (int64).
OPS = {
    **{name: (2, "same") for name in ("add", "sub", "mul", "div", "div_no_nan", "floordiv", "mod", "fmod",
                                        "pow", "maximum", "minimum")},
    **{name: (1, "same") for name in ("neg", "abs", "sign", "sqrt", "rsqrt", "square", "exp", "log",
                                        "reciprocal")},
    **{name: (2, "bool") for name in ("less", "less_equal", "greater", "greater_equal", "equal",
                                        "not_equal", "logical_and", "logical_or", "logical_xor")},
    "logical_not": (1, "bool"),
    "select": (3, "select"),
    "cast": (1, "cast"),
    **{name: (1, "same") for name in ("sum", "mean", "max", "min")},
    "row_length": (0, "length"),
}
_REDUCTIONS = ("sum", "mean", "max", "min")
_FLOAT_ONLY = ("div", "div_no_nan", "floordiv", "mod", "fmod", "pow", "mean", "sqrt", "rsqrt", "exp", "log",
               "reciprocal")
# integer results that Numba computes in int64 and the emitter wraps to a narrower dtype
_WRAPPED = ("add", "sub", "mul", "neg", "abs", "sign", "square", "maximum", "minimum", "sum", "max", "min")

_BINARY_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "less": "<", "less_equal": "<=",
                     "greater": ">", "greater_equal": ">=", "equal": "==", "not_equal": "!="}
_NUMPY_FUNCTIONS = {"floordiv": "floor_divide", "mod": "mod", "fmod": "fmod", "pow": "power",
                    "maximum": "maximum", "minimum": "minimum", "abs": "abs", "sign": "sign", "sqrt": "sqrt",
                    "square": "square", "exp": "exp", "log": "log", "reciprocal": "reciprocal",
                    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
                    "logical_not": "logical_not"}


@dataclass(frozen=True)
class Value:
    """One value of the program: ``rank`` 0 (a scalar) or 1 (a row), with a NumPy ``dtype`` name."""

    index: int
    rank: int
    dtype: str


@dataclass
class _Node:
    op: str                 # "argument", "constant" or a key of OPS
    inputs: tuple
    attrs: dict
    value: Value
    note: str = ""


@dataclass
class Program:
    """A function of a :class:`~.contracts.Contract` as operations over :class:`Value`\\ s, in program
    (topological) order.

    Args:
        name: the Python name of the emitted function (the user's function's ``__name__``).
        qualname, module: what ``__qualname__`` and ``__module__`` of the emitted function say.
        origin: a phrase for its docstring and errors, such as ``"TensorFlow function m.adagrad"``.
        contract: the arguments the function receives (their ranks and dtypes) and what it returns.
    """

    name: str
    qualname: str
    module: str
    origin: str
    contract: Contract
    nodes: list = field(default_factory=list)
    outputs: tuple = ()
    returns_tuple: bool = True
    _arguments: dict = field(default_factory=dict)
    _constants: dict = field(default_factory=dict)

    # -- building ---------------------------------------------------------------------------------------
    def _add(self, op, inputs, attrs, rank, dtype, note=""):
        if dtype not in _DTYPES:
            raise TranslationError(f"values of dtype {dtype} are not supported")
        value = Value(len(self.nodes), rank, dtype)
        self.nodes.append(_Node(op, tuple(inputs), dict(attrs), value, note))
        return value

    def argument(self, which: str, index: int | None = None) -> Value:
        """The contract's argument ``which`` (a parameter's name, or its entries' name, such as ``"slot"``,
        with ``index``), of the rank and dtype the contract gives it."""
        leaf = next((leaf for leaf in self.contract.leaves() if (leaf.which, leaf.index) == (which, index)), None)
        if leaf is None:
            raise ValueError(f"the contract {self.contract} has no argument {which!r}"
                             f"{'' if index is None else f' [{index}]'}")
        key = (which, index)
        if key not in self._arguments:
            self._arguments[key] = self._add("argument", (), {"source": leaf.source}, leaf.rank, leaf.dtype)
        return self._arguments[key]

    def arguments(self) -> list:
        """Every argument's value, in the contract's flattened order (the traced graph's inputs)."""
        return [self.argument(leaf.which, leaf.index) for leaf in self.contract.leaves()]

    def constant(self, value, dtype: str | None = None) -> Value:
        """A constant: a number, or an array of one element (a scalar) or of shape ``[k]`` (a row)."""
        array = np.asarray(value, dtype=dtype)
        if array.size == 1:
            array = array.reshape(())
        elif array.ndim != 1:
            raise TranslationError(f"a constant of shape {list(array.shape)} (only scalars and rows are)")
        dtype = array.dtype.name
        key = (dtype, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self._add("constant", (), {"array": array}, array.ndim, dtype)
        return self._constants[key]

    def apply(self, op: str, *inputs: Value, note: str = "", **attrs) -> Value:
        """The value of ``op`` (a key of :data:`OPS`) applied to ``inputs``."""
        if op not in OPS:
            raise TranslationError(f"operation {op!r} is not in the program's vocabulary")
        arity, rule = OPS[op]
        if len(inputs) != arity:
            raise TranslationError(f"{op} takes {arity} inputs, got {len(inputs)}")
        if op in _REDUCTIONS:
            rank = 0
        elif op == "row_length":
            rank = 0
        else:
            rank = max((v.rank for v in inputs), default=0)
        if rule == "bool":
            dtype = "bool"
        elif rule == "cast":
            dtype = np.dtype(attrs["dtype"]).name
            if dtype == inputs[0].dtype:
                return inputs[0]
        elif rule == "length":
            dtype = "int64"
        else:
            operands = inputs[1:] if rule == "select" else inputs
            dtype = np.result_type(*(np.dtype(v.dtype) for v in operands)).name
        if op in _REDUCTIONS and inputs[0].rank == 0:
            return inputs[0]  # a reduction of one value is that value
        if op in _FLOAT_ONLY and np.dtype(dtype).kind != "f":
            raise TranslationError(f"{op} of {dtype} values is not supported (its integer definitions differ "
                                   "between frameworks): cast to a float first")
        if op.startswith("logical_") and any(v.dtype != "bool" for v in inputs):
            raise TranslationError(f"{op} of non-boolean values")
        return self._add(op, inputs, attrs, rank, dtype, note)

    def set_outputs(self, values) -> None:
        """The function returns ``values``. Under the optimizer contract: the new row alone if there is one
        value (a framework function returning a 1-tuple for a table without slots returns its row), else a
        tuple (new row, new slots). Under a contract returning a scalar: one number."""
        self.outputs = tuple(values)
        if not self.outputs:
            raise TranslationError("it returns nothing")
        if self.contract.returns == "scalar":
            what = f"a {self.contract.kind} returns one number per table row"
            if len(self.outputs) != 1:
                raise TranslationError(f"it returns {len(self.outputs)} values; {what}")
            if self.outputs[0].rank != 0:
                raise TranslationError(f"it returns a row (one value per element, shape [n]); {what}: reduce "
                                       "the row (a sum, a norm, a maximum)")
            if self.outputs[0].dtype == "bool":
                raise TranslationError(f"it returns a boolean; {what}: cast it to a number")
        self.returns_tuple = len(self.outputs) != 1

    # -- emitting ---------------------------------------------------------------------------------------
    def to_source(self) -> tuple[str, dict]:
        """``(source, constants)``: the module text defining the function and the values of the global
        names it reads besides ``np`` (row constants)."""
        used = self._live()
        names: dict[int, str] = {}
        globals_: dict[str, np.ndarray] = {}
        preamble, body = [], []
        temporaries = 0
        for node in self.nodes:
            v = node.value
            if v.index not in used:
                continue
            if node.op == "argument":
                names[v.index] = node.attrs["source"]
                continue
            if node.op == "constant":
                array = node.attrs["array"]
                if array.ndim == 0:
                    names[v.index] = _literal(array)
                    continue
                const = f"const_{len(globals_)}"
                globals_[const] = array
                preamble.append(f"{const} = np.array([{', '.join(_literal(x, bare=True) for x in array)}], "
                                f"dtype=np.{array.dtype.name})")
                # read through np.asarray: a bare global array would look element-wise to the compiler
                names[v.index] = f"np.asarray({const})"
                continue
            expr = self._expression(node, [names[i.index] for i in node.inputs])
            name = f"t{temporaries}"
            temporaries += 1
            comment = f"  # {node.note}" if node.note else ""
            body.append(f"    {name} = {expr}{comment}")
            names[v.index] = name
        results = [names[v.index] for v in self.outputs]
        if self.returns_tuple:
            ret = f"return ({', '.join(results)})"
        else:
            ret = f"return {results[0]}"
        name = self.python_name
        doc = f"NumPy-level {self.contract.kind} translated from the {self.origin} ({len(body)} operations)."
        lines = [f"# Generated by embedcore.translate from the {self.origin}.", ""]
        lines += preamble + ([""] if preamble else [])
        lines.append(f"def {name}({self.contract.signature}):")
        lines.append(f"    \"\"\"{doc}\"\"\"")
        lines += body
        lines.append(f"    {ret}")
        return "\n".join(lines) + "\n", globals_

    @property
    def python_name(self) -> str:
        name = re.sub(r"\W", "_", self.name or "row_function")
        if not name or name[0].isdigit() or keyword.iskeyword(name):
            name = f"fn_{name}"
        return name

    def to_function(self):
        """The emitted function: a plain Python function whose source ``inspect.getsource`` reads."""
        source, constants = self.to_source()
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        filename = f"<embedcore.translate {self.python_name} {digest}>"
        _register_source(filename, source)
        namespace = {"np": np, "__name__": self.module or "embedcore.translate.generated", **constants}
        exec(compile(source, filename, "exec"), namespace)
        fn = namespace[self.python_name]
        fn.__qualname__ = self.qualname or self.python_name
        fn.__embedcore_source__ = (filename, source)
        return fn

    def _live(self) -> set:
        live, stack = set(), [v.index for v in self.outputs]
        while stack:
            index = stack.pop()
            if index in live:
                continue
            live.add(index)
            stack.extend(i.index for i in self.nodes[index].inputs)
        return live

    def _expression(self, node, args) -> str:
        expression = self._numpy_expression(node, args)
        dtype = np.dtype(node.value.dtype)
        if node.op in _WRAPPED and dtype.kind in "iu" and dtype.itemsize < 8:
            if node.value.rank == 0:
                return f"np.{dtype.name}({expression})"
            return f"({expression}).astype(np.{dtype.name})"
        return expression

    def _numpy_expression(self, node, args) -> str:
        op, v = node.op, node.value
        if op in _BINARY_OPERATORS:
            return f"{args[0]} {_BINARY_OPERATORS[op]} {args[1]}"
        if op in _NUMPY_FUNCTIONS:
            return f"np.{_NUMPY_FUNCTIONS[op]}({', '.join(args)})"
        if op == "neg":
            return f"-{args[0]}"
        if op == "rsqrt":
            return f"{_literal(np.ones((), v.dtype))} / np.sqrt({args[0]})"
        if op == "div_no_nan":
            zero = _literal(np.zeros((), v.dtype))
            if v.rank == 0:
                return f"({zero} if {args[1]} == {zero} else {args[0]} / {args[1]})"
            return f"np.where({args[1]} == {zero}, {zero}, {args[0]} / {args[1]})"
        if op == "select":
            if v.rank == 0:
                return f"({args[1]} if {args[0]} else {args[2]})"
            return f"np.where({args[0]}, {args[1]}, {args[2]})"
        if op == "cast":
            source = node.inputs[0]
            if v.dtype == "bool":
                return f"{args[0]} != {_literal(np.zeros((), source.dtype))}"
            one, zero = _literal(np.ones((), v.dtype)), _literal(np.zeros((), v.dtype))
            if source.dtype == "bool":
                if v.rank == 0:
                    return f"({one} if {args[0]} else {zero})"
                return f"np.where({args[0]}, {one}, {zero})"
            if v.rank == 0:
                return f"np.{v.dtype}({args[0]})"
            return f"{args[0]}.astype(np.{v.dtype})"
        if op in _REDUCTIONS:
            return f"np.{op}({args[0]})"
        if op == "row_length":
            row = next(leaf.source for leaf in self.contract.leaves() if leaf.rank == 1)
            return f"{row}.size"
        raise TranslationError(f"no NumPy form for {op}")  # unreachable: apply() checks the vocabulary


def _literal(value, bare=False) -> str:
    """Source of a numeric constant that evaluates to exactly ``value`` (typed, unless ``bare``)."""
    value = np.asarray(value).reshape(())[()]
    dtype = np.asarray(value).dtype
    if dtype == np.bool_:
        return repr(bool(value))
    if dtype.kind in "iu":
        return repr(int(value)) if bare else f"np.{dtype.name}({int(value)})"
    x = float(value)
    if np.isnan(x):
        text = "np.nan"
    elif np.isinf(x):
        text = "np.inf" if x > 0 else "-np.inf"
    else:
        # NumPy's shortest text of the value, if the code ``np.float32(<text>)`` (a float64 literal rounded
        # to float32) gives it back exactly, else the float64 text, exact for every float32
        text = str(value)
        if dtype.type(float(text)) != value:
            text = repr(x)
    return text if bare else f"np.{dtype.name}({text})"


def _register_source(filename: str, source: str) -> None:
    """Make ``source`` the text of ``filename`` for :mod:`linecache` (and so for ``inspect``); an entry
    without a modification time is never dropped by ``linecache.checkcache``."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)


def ensure_source(fn) -> None:
    """Register the source of a function made by :meth:`Program.to_function` again, in case someone
    cleared :mod:`linecache`."""
    entry = getattr(fn, "__embedcore_source__", None)
    if entry is not None and entry[0] not in linecache.cache:
        _register_source(*entry)
