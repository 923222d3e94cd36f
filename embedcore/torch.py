"""PyTorch adapter: an :class:`embedcore.Embedding` as a ``torch.nn.Module`` with the optimizer in backward.

Install with ``pip install embedcore[torch]`` (or ``pip install torch==2.13.0``). CPU tensors only.

Semantics, step by step (as FBGEMM's table-batched embeddings do it, "optimizer in backward"):

* ``acts = module(features, weights)`` looks the features up with :meth:`Embedding.lookup` and returns the
  activations, mirroring ``features``, as float32 tensors that share memory with the engine's NumPy output.
* In training (grad mode on, ``module.training`` true and the module not frozen with
  ``requires_grad_(False)``) the activations require grad: they are the outputs of one autograd node whose
  only input is a zero-size trigger tensor (not a parameter of the module).
* ``loss.backward()`` reaches that node and, right there, calls :meth:`Embedding.apply_gradients` with the
  activation gradients: the touched rows (and slots) are updated in place by the tables' fused optimizers,
  and ``embedding.step`` advances by one. This happens *during* ``loss.backward()``, so *before*
  ``optimizer.step()`` of the dense parameters; the embeddings need no torch optimizer, no ``zero_grad``
  and never hold a ``.grad``. An output the loss does not use counts as a zero gradient (which still
  updates the rows it touched with optimizers that act on zero gradients, e.g. Adam, weight decay).
* Each forward is applied at most once: a second backward through the same graph (``retain_graph=True``)
  raises ``RuntimeError``; several forwards before one backward are applied one after the other, each
  against the tables as they are then (the lookups themselves saw the tables of their forward call).
* Backward runs only when autograd reaches the node: ``torch.autograd.grad(loss, dense_params)`` or
  ``loss.backward(inputs=...)`` without the trigger skip the update.
* Under ``torch.no_grad()`` / ``torch.inference_mode()``, in ``eval()`` mode, or after
  ``requires_grad_(False)``, forward is a lookup only: the activations do not require grad and nothing is
  ever updated.
* Bad ids or weights raise :class:`embedcore.InputError` from forward; bad (NaN/Inf) gradients raise it
  from ``loss.backward()``, and so does the backward of a forward made before ``embedding.load()`` (its
  activations came from the replaced tables); in all these cases tables, slots and ``step`` are unchanged.
"""

from __future__ import annotations

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("embedcore.torch needs PyTorch, an optional extra of embedcore: install it with "
                      "`pip install embedcore[torch]` (or `pip install torch==2.13.0`)") from exc

from . import inputs
from .engine import Embedding
from .inputs import InputError

__all__ = ["EmbeddingModule"]


def _tensor_to_numpy(value):
    """A CPU tensor as a NumPy array: shares memory unless the dtype has no NumPy twin (bfloat16)."""
    if value.device.type != "cpu":
        raise InputError(f"embedcore runs on the CPU: got a tensor on '{value.device}'; move ids and weights "
                         f"with .cpu() first")
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.to(torch.float32)
    return value.resolve_conj().resolve_neg().numpy()


def _leaf_to_numpy(leaf):
    """One feature's ids or weights: a tensor, or a list of per-sample tensors, becomes NumPy; anything else
    (NumPy arrays, lists of lists, Ragged and Sparse, whose fields are already NumPy) is left as it is."""
    if isinstance(leaf, torch.Tensor):
        return _tensor_to_numpy(leaf)
    if isinstance(leaf, list):
        return [_tensor_to_numpy(x) if isinstance(x, torch.Tensor) else x for x in leaf]
    return leaf


def _grad_to_numpy(grad, shape):
    """One activation gradient as a float32 NumPy array of ``shape``; None (unused output) means zeros."""
    if grad is None:
        return np.zeros(shape, np.float32)
    grad = grad.detach()
    if grad.device.type != "cpu":
        raise InputError(f"activation gradient is on '{grad.device}'; embedcore runs on the CPU")
    if grad.dtype != torch.float32 or not grad.is_contiguous():
        grad = grad.to(torch.float32).contiguous()  # a copy; float32 contiguous grads are shared as they are
    return grad.numpy()


class _Pending:
    """What backward needs from one training forward: the engine, its lookup context, the activations'
    structure and shapes, and whether the update was already applied."""

    def __init__(self, engine, lookup_ctx, structure, shapes):
        self.engine, self.lookup_ctx, self.structure, self.shapes = engine, lookup_ctx, structure, shapes
        self.applied = False


class _ApplyInBackward(torch.autograd.Function):
    """Outputs: the activations as tensors (from NumPy, zero-copy); backward: the fused sparse update."""

    @staticmethod
    def forward(ctx, trigger, pending, *arrays):
        ctx.pending = pending
        ctx.set_materialize_grads(False)  # unused outputs arrive as None; zeros are made in NumPy
        return tuple(torch.from_numpy(a) for a in arrays)

    @staticmethod
    def backward(ctx, *grads):
        pending = ctx.pending
        if pending.applied or pending.lookup_ctx.consumed:
            raise RuntimeError("embedcore: the embedding update of this forward was already applied; a graph's "
                               "backward may run once for the embeddings (no retain_graph re-use): run forward "
                               "again")
        arrays = [_grad_to_numpy(g, shape) for g, shape in zip(grads, pending.shapes)]
        pending.engine.apply_gradients(inputs.unflatten(pending.structure, arrays), pending.lookup_ctx)
        pending.applied = True
        return (None, None) + (None,) * len(grads)


class EmbeddingModule(torch.nn.Module):
    """A ``torch.nn.Module`` around an :class:`embedcore.Embedding`, updating the tables during backward.

    Args:
        embedding: an :class:`embedcore.Embedding`, or a feature config (then ``optimizer`` and ``kwargs``
            such as ``seed`` and ``stack_tables`` build the engine).
        optimizer: the tables' default embedcore optimizer when building from a feature config.

    ``forward(features, weights=None)`` takes what :meth:`Embedding.lookup` takes, with CPU torch tensors
    allowed wherever an array is (ids and weights; converted to NumPy without a copy when the dtype allows;
    weights are constants, no gradient flows to them) and returns the activations, mirroring ``features``, as
    float32 tensors sharing memory with the engine's NumPy activations. See the module docstring for when
    and how the tables are updated (during ``loss.backward()``, before the dense ``optimizer.step()``).

    The module registers no parameters: ``torch.optim.X(model.parameters())`` sees only the dense model's.
    ``requires_grad_(False)`` freezes the tables (forward becomes lookup-only), ``requires_grad_(True)``
    unfreezes them. ``state_dict()`` does not hold the tables: checkpoint ``.embedding`` with embedcore.
    """

    def __init__(self, embedding, optimizer=None, **kwargs):
        super().__init__()
        if isinstance(embedding, Embedding):
            if optimizer is not None or kwargs:
                raise ValueError("EmbeddingModule(embedding): optimizer and keyword arguments are only for "
                                 "building an Embedding from a feature config")
        else:
            embedding = Embedding(embedding, optimizer, **kwargs)
        self.embedding = embedding
        # The autograd node's input: zero-size, never given a gradient, not an nn.Parameter.
        self._trigger = torch.zeros(0, requires_grad=True)

    @property
    def embedding_tables(self) -> dict:
        """Table name -> ``[vocabulary_size, dim]`` float32 NumPy array (the engine's storage, live)."""
        return self.embedding.embedding_tables

    @property
    def slot_variables(self) -> dict:
        """Table name -> {slot name: float32 NumPy array} (the engine's storage, live)."""
        return self.embedding.slot_variables

    def requires_grad_(self, requires_grad: bool = True):
        """Also freezes (False) or unfreezes (True) the embedding tables."""
        self._trigger.requires_grad_(requires_grad)
        return super().requires_grad_(requires_grad)

    @property
    def updates_enabled(self) -> bool:
        """Whether a forward called now would update the tables in its backward."""
        return torch.is_grad_enabled() and self.training and self._trigger.requires_grad

    def forward(self, features, weights=None):
        features = self._from_torch(features, "features")
        weights = None if weights is None else self._from_torch(weights, "weights")
        acts, lookup_ctx = self.embedding.lookup(features, weights)
        leaves = [a for _, a in inputs.flatten(acts)]
        if not self.updates_enabled:
            return inputs.unflatten(acts, [torch.from_numpy(a) for a in leaves])
        skeleton = inputs.unflatten(acts, [None] * len(leaves))  # the structure, without holding the arrays
        pending = _Pending(self.embedding, lookup_ctx, skeleton, [a.shape for a in leaves])
        tensors = _ApplyInBackward.apply(self._trigger, pending, *leaves)
        return inputs.unflatten(acts, list(tensors))

    def _from_torch(self, nest, what):
        """``nest`` (mirroring the feature config) with its torch tensors turned into NumPy arrays."""
        config = self.embedding.feature_config
        return inputs.unflatten(config, [_leaf_to_numpy(x) for x in inputs.flatten_like(config, nest, what)])

    def extra_repr(self) -> str:
        return repr(self.embedding)
