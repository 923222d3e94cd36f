"""Parallel loops written once, calling generated serial code through a function pointer.

Numba compiles every parallel (``prange``) loop into a thread-team function of its own: seconds each, far more
than the same loop's serial code. A kernel generated per optimizer, row length or format would pay that per
variant. So each such kernel is split in two:

* a **chunk**: the generated code, serial, for a range ``lo:hi`` of the work (rows of the update, activation
  rows of a lookup), compiled for the argument types it is called with;
* a **driver**: the parallel loop over the chunks, a plain ``njit(cache=True, parallel=True)`` function of
  embedcore's, which takes the chunk as its first argument, a *function pointer* typed by the chunk's
  signature alone (Numba's wrapper address protocol, :class:`ChunkPointer`). Its compiled code depends on the
  argument types, not on which chunk it calls, so it compiles once per machine and argument types and Numba
  caches it with the package's other kernels.

:class:`ChunkedKernel` joins the two: on the first call with new argument types it compiles the chunk for them
(``chunk_signature`` maps the driver's argument types to the chunk's signature) and the driver for the chunk's
pointer type, then calls the driver's compiled entry point directly, looking the types up by a key read in well
under a microsecond (``numba.typeof`` costs several per argument). An exception must not cross the pointer:
chunks catch their own (see :mod:`embedcore.kernels.update`) or raise none.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

__all__ = ["ChunkPointer", "ChunkedKernel", "argument_key"]


class ChunkPointer(types.WrapperAddressProtocol):
    """A compiled chunk as a driver takes it: its address, typed by its signature alone."""

    def __init__(self, address: int, signature):
        self._address, self._signature = address, signature

    def __wrapper_address__(self):
        return self._address

    def signature(self):
        return self._signature


def argument_key(value):
    """What decides ``value``'s Numba type (arrays: dtype, dimensions, layout, writability, alignment; tuples,
    named ones by their class: their items'; anything else: its Python type)."""
    if isinstance(value, np.ndarray):
        flags = value.flags
        return (value.dtype, value.ndim, flags.c_contiguous, flags.f_contiguous, flags.writeable, flags.aligned)
    if isinstance(value, tuple):
        return (type(value),) + tuple(argument_key(v) for v in value)
    return type(value)


class ChunkedKernel:
    """``kernel(*args)`` runs ``driver(pointer to chunk, *args)``: the module docstring's split.

    ``chunk`` is the Numba dispatcher of the generated serial code; ``driver`` a parallel dispatcher whose first
    parameter is the chunk; ``chunk_signature(arg_types)`` gives the chunk's Numba signature for the driver's
    other argument types."""

    def __init__(self, chunk, driver, chunk_signature, source: str = ""):
        self.chunk, self.driver, self.source = chunk, driver, source
        self._chunk_signature = chunk_signature
        self._compiled: dict = {}

    @property
    def stats(self):
        """Numba's cache statistics of the generated chunk (hits: loaded from disk, misses: compiled)."""
        return self.chunk.stats

    @property
    def signatures(self):
        """The argument types the chunk is compiled for."""
        return self.chunk.signatures

    def __call__(self, *args):
        run = self._compiled.get(argument_key(args))
        if run is None:
            run = self.compile_for(args)
        return run[0](run[1], *args)

    def compile_for(self, args):
        """Compile the chunk and the driver for the types of ``args`` (loading both from the caches when
        there); returns ``(driver entry point, chunk pointer)``."""
        arg_types = tuple(numba.typeof(a) for a in args)
        signature = self._chunk_signature(arg_types)
        self.chunk.compile(signature)
        result = self.chunk.overloads[signature.args]
        pointer = ChunkPointer(result.library.get_pointer_to_function(result.fndesc.llvm_cfunc_wrapper_name),
                               signature)
        driver_types = (types.FunctionType(signature),) + arg_types
        self.driver.compile(driver_types)
        run = (self.driver.overloads[driver_types].entry_point, pointer)
        self._compiled[argument_key(args)] = run
        return run
