"""TensorFlow values <-> embedcore's inputs and outputs.

One feature's ids (or weights) travel as a :class:`Leaf`: its kind, its static shape, and the flat list of
dense ``tf.Tensor`` parts it is made of, which is what a ``tf.numpy_function`` can carry:

* ``tf.Tensor`` (or a NumPy array): one part, the tensor itself -> a NumPy array of the same shape;
* ``tf.RaggedTensor`` of rank 2 (one ragged dimension): ``values``, ``row_splits`` -> :class:`embedcore.Ragged`;
* ``tf.SparseTensor`` of rank >= 2: ``indices``, ``values``, ``dense_shape`` -> :class:`embedcore.Sparse`.

:func:`leaf` splits a value into parts; :func:`compose` builds the embedcore input from the parts as NumPy
arrays (eagerly ``np.asarray`` of an eager tensor, which reads TensorFlow's buffer without a copy; inside a
graph, what ``tf.numpy_function`` hands over). Ids keep their integer dtype (embedcore reads int32 and int64
alike); weights that are not float32 are cast to float32 by TensorFlow first, as TensorFlow's engines do.

Going back, :func:`to_tensor` makes a float32 NumPy array a ``tf.Tensor`` without a copy where DLPack allows
(C-contiguous, 64-byte aligned float32 or float16), else with one; :func:`gradient_to_numpy` reads a gradient
(``tf.Tensor``, ``tf.IndexedSlices``, NumPy or ``None``) as a NumPy array, densifying ``IndexedSlices`` (what
``tf.GradientTape`` gives for a ``tf.gather`` of activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ..inputs import Ragged, Sparse
from ..kernels.aligned import is_aligned

__all__ = ["Leaf", "leaf", "compose", "to_numpy", "to_tensor", "gradient_to_numpy", "dense_gradient", "DENSE", "RAGGED",
           "SPARSE"]

DENSE, RAGGED, SPARSE = "dense", "ragged", "sparse"


@dataclass(frozen=True)
class Leaf:
    """One feature's ids or weights as dense parts.

    Attributes:
        kind: ``"dense"``, ``"ragged"`` or ``"sparse"``.
        shape: the static shape, a tuple of ints or ``None`` (``tf.TensorShape.as_list()``; ``None`` entries
            where the graph does not know them, e.g. the ragged dimension).
        parts: the ``tf.Tensor`` parts, in the order :func:`compose` reads them.
    """

    kind: str
    shape: tuple
    parts: tuple

    @property
    def n_parts(self) -> int:
        return len(self.parts)


def leaf(value, path: str, what: str = "ids") -> Leaf:
    """``value`` (a ``tf.Tensor``, ``tf.RaggedTensor``, ``tf.SparseTensor`` or NumPy array) as a :class:`Leaf`.

    ``what`` is ``"ids"`` or ``"weights"``: weights are cast to float32 (TensorFlow's engines downcast them
    too). Raises ``ValueError`` naming the feature ``path`` for any other type, a ragged tensor that is not
    of rank 2 with one ragged dimension, or a sparse tensor of rank < 2.
    """
    weights = what == "weights"
    if isinstance(value, tf.RaggedTensor):
        if value.shape.rank != 2 or value.ragged_rank != 1:
            raise ValueError(f"Only rank 2 ragged tensor is supported, but got rank {value.shape.rank} (ragged rank "
                             f"{value.ragged_rank}) for the {what} of feature {path}")
        values = value.values
        if weights and values.dtype != tf.float32:
            values = tf.cast(values, tf.float32)
        return Leaf(RAGGED, tuple(value.shape.as_list()), (values, value.row_splits))
    if isinstance(value, tf.SparseTensor):
        rank = value.shape.rank
        if rank is not None and rank < 2:
            raise ValueError(f"Only rank 2 and above sparse tensor is supported, find rank {rank} sparse tensor for "
                             f"the {what} of feature {path}")
        values = value.values
        if weights and values.dtype != tf.float32:
            values = tf.cast(values, tf.float32)
        shape = tuple(value.shape.as_list()) if rank is not None else None
        return Leaf(SPARSE, shape, (value.indices, values, value.dense_shape))
    if isinstance(value, np.ndarray) or isinstance(value, (tf.Tensor, tf.Variable)):
        tensor = tf.convert_to_tensor(value)
        if weights and tensor.dtype != tf.float32:
            tensor = tf.cast(tensor, tf.float32)
        elif not weights and not tensor.dtype.is_integer:
            raise ValueError(f"Input {path} has dtype {tensor.dtype.name}; ids must be integers")
        shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else None
        return Leaf(DENSE, shape, (tensor,))
    raise ValueError(f"Input {path} is of unknown type {type(value)}. Please only pass Tensor, SparseTensor or "
                     f"RaggedTensor as input.")


def compose(kind: str, arrays):
    """The embedcore input of one leaf from its parts as NumPy arrays (see :func:`leaf`), without copies."""
    if kind == DENSE:
        (array,) = arrays
        return array
    if kind == RAGGED:
        values, row_splits = arrays
        return Ragged(values, row_splits)
    if kind == SPARSE:
        indices, values, dense_shape = arrays
        return Sparse(indices, values, tuple(int(d) for d in np.asarray(dense_shape).reshape(-1)))
    raise AssertionError(f"unknown leaf kind {kind!r}")


def to_numpy(tensor) -> np.ndarray:
    """An eager ``tf.Tensor`` as a NumPy array sharing its buffer (read-only); a NumPy array as itself."""
    if isinstance(tensor, np.ndarray):
        return tensor
    return np.asarray(tensor)


_DLPACK_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_TF_ALIGNMENT = 64  # TensorFlow's kernels (Eigen) abort on tensors whose data is not 64-byte aligned


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """``array`` as an eager ``tf.Tensor``: sharing its memory through DLPack when it is C-contiguous float32
    or float16 and 64-byte aligned (TensorFlow's kernels need that; the tensor keeps the array alive), else
    copied. The caller must not write ``array`` later."""
    if array.dtype in _DLPACK_DTYPES and array.flags.c_contiguous and is_aligned(array, _TF_ALIGNMENT):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except (tf.errors.InvalidArgumentError, TypeError, BufferError):
            pass
    return tf.convert_to_tensor(array)


def gradient_to_numpy(gradient, path: str):
    """One feature's activation gradient as NumPy: ``None`` stays ``None`` (no update for the feature),
    ``tf.IndexedSlices`` are densified, eager tensors are read without a copy. Anything else: ``ValueError``
    naming ``path``."""
    if gradient is None or isinstance(gradient, np.ndarray):
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.convert_to_tensor(gradient)
    if isinstance(gradient, tf.Tensor):
        return to_numpy(gradient)
    raise ValueError(f"found non-tensor type: {type(gradient)} at path {path}.")


def dense_gradient(gradient):
    """``gradient`` as a ``tf.Tensor`` (``tf.IndexedSlices`` densified, NumPy converted) or ``None``; for the
    graph, where the parts must be tensors."""
    if gradient is None or isinstance(gradient, tf.Tensor):
        return gradient
    return tf.convert_to_tensor(gradient)
