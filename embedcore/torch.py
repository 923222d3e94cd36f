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

Inputs (see :class:`EmbeddingModule`): what :meth:`Embedding.lookup` takes, with CPU tensors for arrays; per
feature ``(values, offsets)`` as ``nn.EmbeddingBag`` reads it; or a torchrec ``KeyedJaggedTensor`` (found by
its methods: torchrec is never imported), which gives a dict of activations, or torchrec's ``KeyedTensor`` for
a real one, as ``EmbeddingBagCollection`` does. Ids are not copied (int32 ones the engine widens); weights of
any float dtype, with ``requires_grad`` or not, are read as float32 constants.

State, the torch way:

* ``state_dict()`` holds, under the module's prefix, ``tables.<table>.weights``, ``tables.<table>.slot.<slot>``
  (one per optimizer slot) and ``step`` (an int64 scalar). The table and slot tensors share memory with the
  engine (zero-copy, as parameters in a ``state_dict`` do): they change as the model trains, so snapshot them
  with ``copy.deepcopy(model.state_dict())``. Their dtype is the table's (``torch.float16`` for a float16
  table, ``torch.bfloat16`` for a bfloat16 one).
* ``load_state_dict`` copies the values into the engine's arrays after checking every entry (a tensor of
  the table's exact dtype and shape, finite; ``step`` one integer >= 0): a bad entry is reported the torch
  way (``RuntimeError``) and none of the module's tables, slots or ``step`` change. Missing and unexpected
  keys are reported as torch does: ``strict=True`` raises (a state dict saved before the tables were in
  ``state_dict`` is refused), ``strict=False`` returns them and loads the entries present. Lookups made
  before the load are refused by their backward. ``assign=True`` makes no difference: values are copied.
* ``torch.distributed.checkpoint``: ``dcp.save(model.state_dict(), ...)``; then ``sd = model.state_dict()``,
  ``dcp.load(sd, ...)``, ``model.load_state_dict(sd)``. ``dcp.load`` writes into the tensors it is given,
  here the tables themselves, before ``load_state_dict`` checks them; give it copies
  (``{k: v.clone() for k, v in sd.items()}``) to keep the all-or-nothing check.
* ``torch.save(model)`` / pickle and ``copy.deepcopy(model)`` work (:class:`Embedding` pickles its
  configuration as a checkpoint describes it, its functions by import path: a lambda, a local function or
  one from ``__main__`` cannot be pickled, and the error names it; ``copy.deepcopy`` has no such limit). A
  copy is independent: it holds its own tables, slots, ``step``, optimizers and seed.
* ``emb.save(path)`` / ``Embedding.restore(path)`` checkpoints are unchanged.

Dynamic tables (:class:`embedcore.DynamicTableConfig`) work unchanged in forward and backward: their ids are
64-bit keys, any int64 tensor value (negative ones too: the bit pattern is the key) or uint64 one, in every
input form above (a ``KeyedJaggedTensor`` included). What differs:

* ``state_dict()`` of a module holding a dynamic table raises ``RuntimeError`` naming the tables: a dynamic
  table is keys, rows, slots and its policies' counters (and admission sketch), not a fixed-shape tensor that
  ``load_state_dict`` could copy into, so its state lives in embedcore checkpoints: ``module.save(path)`` /
  ``EmbeddingModule.restore(path)`` (or ``module.load(path)``). ``load_state_dict`` refuses entries for it the
  same way, ``embedding_tables[name]`` is a :class:`~embedcore.tables.dynamic.DynamicTableView` (rows by key),
  and ``torch.save(model)`` / ``copy.deepcopy`` raise as the engine's pickling and copying do for them.
* In ``eval()`` mode a forward is a read-only lookup (``Embedding.lookup(..., training=False)``): no table
  changes; a dynamic table's held keys read their rows, any other key (absent, not admitted yet, expired by
  TTL) its initial value. ``eval()`` is the signal, not ``no_grad``: in ``train()`` mode a forward under
  ``torch.no_grad()`` updates nothing but is still a training lookup of a dynamic table (keys are counted
  for admission, admitted keys get rows at their initial values, rows are marked seen and may be evicted),
  as a warm-up pass may want. Static tables read alike in either mode.
* ``process_group``: the tables are built by :class:`~embedcore.distributed.ShardedEmbedding`, which shards
  dynamic tables by key (every rank must be in the same mode, ``train()`` or ``eval()``, as each lookup is
  collective).

``torch.compile(model, fullgraph=True)`` compiles a model holding the module into one graph: under the
compiler, forward is the registered custom op ``embedcore::lookup`` (a fake implementation gives the
activations' shapes from the feature config) and its registered backward calls ``embedcore::apply_gradients``,
so the update still happens during ``loss.backward()``, as in eager mode (same tables, same losses). The
compiled path takes a flat dict feature config and, per feature, a tensor of ids (``[B]`` or ``[B, k]``) or
``(values, offsets)``, with an optional weights tensor; it returns ``{feature: activations}`` (copies). Up to
64 compiled training forwards may wait for their backward; older ones are dropped (their backward raises).

Sharded over ``torch.distributed`` (launch with ``torchrun --nproc-per-node K train.py``)::

    dist.init_process_group("gloo")
    emb = EmbeddingModule(feature_config, optimizer, process_group=dist.group.WORLD)  # tables sharded
    model = DistributedDataParallel(Model(emb))  # DDP for the dense part; the tables are not parameters

* The tables are split by rows over the group's ranks with the rule, routing and guarantees of
  :class:`embedcore.distributed.ShardedEmbedding` (it is one, on the torch transport; all-to-all-v through
  gloo): each rank feeds its own local batch and gets its own activations; K ranks train the tables as one
  process fed the concatenated batch would (up to float32 summation order); bad input on one rank is
  refused on every rank with nothing changed; a peer that stops answering makes the others raise
  ``DistributedError`` after ``timeout`` seconds (a keyword argument, 120 by default), not hang.
* forward and backward are collectives: every rank must run them for every step (a rank with no samples
  too), and agree on training or eval mode.
* ``module.save(path)`` is collective (each rank writes its rows, committed once all have) and
  ``EmbeddingModule.restore(path, process_group=...)`` reads it on any world size, or in one process
  (``process_group=None``). ``state_dict()`` holds this rank's rows only; ``load_state_dict`` refuses it.
* An unsharded module training inside the forward of a ``DistributedDataParallel`` of more than one rank is
  refused (``RuntimeError``): every rank would update its own copy and the copies would drift apart.
"""

from __future__ import annotations

import itertools
import math
import sys
import weakref

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("embedcore.torch needs PyTorch, an optional extra of embedcore: install it with "
                      "`pip install embedcore[torch]` (or `pip install torch==2.13.0`)") from exc

from . import inputs
from .config import DynamicTableConfig, FeatureConfig
from .engine import Embedding
from .inputs import InputError, Ragged

__all__ = ["EmbeddingModule", "EmbeddingLearningRates", "EmbeddingBagCollection"]


def __getattr__(name):
    if name == "EmbeddingBagCollection":  # torchrec's drop-in (embedcore/torch_ebc.py), which builds on this module
        from .torch_ebc import EmbeddingBagCollection
        return EmbeddingBagCollection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _ids_to_numpy(value, name, what):
    """A 1-D integer array (a tensor's memory when it is one) for ``what`` of feature ``name``."""
    array = _tensor_to_numpy(value) if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise InputError(f"{what} of feature '{name}' must be a 1-D integer tensor or array, got "
                         f"{array.dtype} of shape {array.shape}")
    return array


def _bags(pair, weights, name, include_last_offset):
    """``(values, offsets)`` as :class:`Ragged` ids (``values`` not copied), as ``nn.EmbeddingBag`` reads them:
    ``offsets`` are the bags' starts, with the end of the last bag too when ``include_last_offset``;
    ``weights`` (per-value, like ``per_sample_weights``) follows the same bags."""
    if len(pair) != 2:
        raise InputError(f"feature '{name}': a tuple of ids must be (values, offsets), got {len(pair)} entries")
    values = _ids_to_numpy(pair[0], name, "values")
    offsets = _ids_to_numpy(pair[1], name, "offsets")
    if include_last_offset:
        if offsets.shape[0] < 1:
            raise InputError(f"offsets of feature '{name}' must hold at least one entry with include_last_offset")
        splits = offsets
    else:  # the bags' starts: the end of the last bag is the number of values (a new array of B + 1 ints)
        splits = np.empty(offsets.shape[0] + 1, np.int64)
        splits[:-1] = offsets
        splits[-1] = values.shape[0]
    if weights is not None and not isinstance(weights, Ragged):
        weights = Ragged(_leaf_to_numpy(weights), splits)
    return Ragged(values, splits), weights


def _is_keyed_jagged(value) -> bool:
    """Whether ``value`` looks like torchrec's ``KeyedJaggedTensor`` (duck typing: torchrec is optional)."""
    return (all(callable(getattr(value, m, None)) for m in ("keys", "values", "weights_or_none"))
            and any(callable(getattr(value, m, None)) for m in ("offsets", "lengths")))


def _keyed_tensor_class(kjt):
    """torchrec's ``KeyedTensor`` when ``kjt`` is a real torchrec ``KeyedJaggedTensor``, else None."""
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    if module is not None and isinstance(kjt, getattr(module, "KeyedJaggedTensor", ())):
        return module.KeyedTensor
    return None


def _call(obj, *names):
    """The result of the first of ``obj``'s methods ``names`` that exists and returns something else than None."""
    for name in names:
        method = getattr(obj, name, None)
        if callable(method):
            result = method()
            if result is not None:
                return result
    return None


def _jagged_offsets(kjt, keys, n_values):
    """The KJT's offsets (``n_keys * B + 1`` int64, key-major) and its batch size ``B``, checked: they start at
    0, never decrease and end at ``n_values`` (lengths that sum to less would leave values no feature owns)."""
    n_keys = len(keys)
    offsets = _call(kjt, "offsets_or_none")
    lengths = None if offsets is not None else _call(kjt, "lengths_or_none", "lengths")
    if offsets is None and lengths is None:
        offsets = _call(kjt, "offsets")
    if offsets is not None:
        offsets = _ids_to_numpy(offsets, "<KeyedJaggedTensor>", "offsets").astype(np.int64, copy=False)
        n = offsets.shape[0] - 1
    else:
        lengths = _ids_to_numpy(lengths, "<KeyedJaggedTensor>", "lengths")
        n = lengths.shape[0]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
    if n < 0 or (n_keys and n % n_keys) or (not n_keys and n):
        raise InputError(f"a KeyedJaggedTensor of {n_keys} keys has {n} lengths, not a multiple of {n_keys}")
    if offsets[0] != 0 or (n and np.any(offsets[1:] < offsets[:-1])):
        raise InputError(f"the KeyedJaggedTensor's offsets must start at 0 and not decrease; got "
                         f"{offsets[:16].tolist()}")
    batch = n // n_keys if n_keys else 0
    if offsets[-1] != n_values:
        per_key = {key: int(offsets[(k + 1) * batch] - offsets[k * batch]) for k, key in enumerate(keys)}
        raise InputError(f"the KeyedJaggedTensor's lengths sum to {int(offsets[-1])} (per feature: {per_key}) but it "
                         f"holds {n_values} values: every value must belong to one feature's bag")
    return offsets, batch


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

    def __init__(self, engine, lookup_ctx, structure, shapes, module=None):
        self.engine, self.lookup_ctx, self.structure, self.shapes = engine, lookup_ctx, structure, shapes
        self.module = weakref.ref(module) if module is not None else None
        self.applied = False

    def apply(self, arrays):
        """The update: the scheduled learning rates first, then the engine's ``apply_gradients``."""
        module = self.module() if self.module is not None else None
        if module is not None:
            module._before_update()
        self.engine.apply_gradients(inputs.unflatten(self.structure, arrays), self.lookup_ctx)
        self.applied = True
        if module is not None:
            module._after_update()


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
        pending.apply(arrays)
        return (None, None) + (None,) * len(grads)


# -- torch.compile: the module as two registered custom ops ----------------------------------------------
# Under torch.compile, forward calls ``embedcore::lookup`` (ids in, activations and a token out) and its
# registered backward calls ``embedcore::apply_gradients`` (the token and activation gradients in; the
# trigger's empty gradient out, which keeps it in the backward graph). Both are opaque to the compiler: the
# fake implementation gives the activations' shapes from the feature config, the real ones call the engine.
_MODULES = weakref.WeakValueDictionary()  # handle -> EmbeddingModule
_HANDLES = itertools.count()
_MAX_PENDING = 64  # compiled forwards whose backward has not run yet, kept per module (older ones dropped)


def _module_of(handle: int) -> "EmbeddingModule":
    module = _MODULES.get(handle)
    if module is None:
        raise RuntimeError(f"embedcore: no EmbeddingModule with handle {handle} (it was deleted)")
    return module


def _compiled_shapes(module, layout: str, tensors):
    """The activations' shapes of a compiled lookup, from the feature config and the inputs' shapes."""
    shapes, it = [], iter(tensors)
    for code, (path, feature) in zip(layout.split(","), inputs.flatten(module.embedding.feature_config)):
        if code[0] == "b":
            next(it)
            batch = next(it).shape[0] - (1 if module.include_last_offset else 0)
        else:
            batch = next(it).shape[0]
        if "w" in code:
            next(it)
        dim = feature.table.dim
        if feature.output_shape:  # () counts as unset, as in TensorFlow
            shapes.append(tuple(feature.output_shape) + (dim,))
        elif feature.max_sequence_length:
            shapes.append((batch, feature.max_sequence_length, dim))
        else:
            shapes.append((batch, dim))
    return shapes


def _lookup_impl(handle, layout, train, trigger, tensors):
    module = _module_of(handle)
    features, weights, it = {}, {}, iter(tensors)
    for code, path in zip(layout.split(","), module._flat_paths):
        features[path] = (next(it), next(it)) if code[0] == "b" else next(it)
        weights[path] = next(it) if "w" in code else None
    features, weights = module._from_torch(features, weights)
    acts, lookup_ctx = module.embedding.lookup(features, weights, training=module.training)
    leaves = [a for _, a in inputs.flatten(acts)]
    token = -1
    if train:
        token = next(_HANDLES)
        pending = module._compiled_pending
        pending[token] = _Pending(module.embedding, lookup_ctx, inputs.unflatten(acts, [None] * len(leaves)),
                                  [a.shape for a in leaves], module)
        while len(pending) > _MAX_PENDING:
            pending.pop(next(iter(pending)))
    # copies: activations of features of one id space are views of one array, and outputs must not alias
    return [torch.from_numpy(np.array(a, np.float32)) for a in leaves] + [torch.tensor(token, dtype=torch.int64)]


def _lookup_fake(handle, layout, train, trigger, tensors):
    module = _module_of(handle)
    return ([torch.empty(shape, dtype=torch.float32) for shape in _compiled_shapes(module, layout, tensors)] +
            [torch.empty((), dtype=torch.int64)])


def _apply_impl(handle, token, grads):
    token = int(token)
    if token >= 0:
        pending = _module_of(handle)._compiled_pending.pop(token, None)
        if pending is None:
            raise RuntimeError("embedcore: the embedding update of this compiled forward was already applied (or "
                               f"more than {_MAX_PENDING} later forwards came before its backward): run forward again")
        pending.apply([_grad_to_numpy(g, shape) for g, shape in zip(grads, pending.shapes)])
    return torch.zeros(0)


def _apply_fake(handle, token, grads):
    return torch.empty(0)


def _lookup_setup(ctx, inputs, output):  # noqa: F811 - torch passes the arguments by these names
    ctx.handle, ctx.n_tensors = inputs[0], len(inputs[4])
    ctx.save_for_backward(output[-1])


def _lookup_backward(ctx, grads):
    token, = ctx.saved_tensors
    trigger_grad = torch.ops.embedcore.apply_gradients(ctx.handle, token, list(grads[:-1]))
    return None, None, None, trigger_grad, [None] * ctx.n_tensors


if not hasattr(torch.ops.embedcore, "lookup"):  # defined once per process (a re-import keeps the first)
    _lookup_op = torch.library.custom_op(
        "embedcore::lookup", _lookup_impl, mutates_args=(),
        schema="(int handle, str layout, bool train, Tensor trigger, Tensor[] tensors) -> Tensor[]")
    _lookup_op.register_fake(_lookup_fake)
    _lookup_op.register_autograd(_lookup_backward, setup_context=_lookup_setup)
    _apply_op = torch.library.custom_op(
        "embedcore::apply_gradients", _apply_impl, mutates_args=(),
        schema="(int handle, Tensor token, Tensor[] grads) -> Tensor")
    _apply_op.register_fake(_apply_fake)


class EmbeddingLearningRates(torch.optim.Optimizer):
    """The tables' learning rates as a ``torch.optim.Optimizer`` that ``torch.optim.lr_scheduler`` can drive.

    One param group per distinct embedcore optimizer of the module (``group["tables"]`` names its tables),
    ``group["lr"]`` its learning rate. Get it from :meth:`EmbeddingModule.learning_rates`; build any scheduler
    on it and call ``scheduler.step()`` as usual. The module copies each group's ``lr`` into its optimizer
    right before every update (so a checkpoint records the last update's rate) and calls :meth:`step` after it,
    which does nothing else (the tables are updated in backward) but lets schedulers see the steps.
    """

    def __init__(self, optimizers):
        self._optimizers = list(optimizers)
        groups = [{"params": [torch.zeros(0)], "lr": float(opt.learning_rate), "tables": names}
                  for opt, names in self._optimizers]
        super().__init__(groups, {"lr": 0.0})

    def step(self, closure=None):  # noqa: D102 - the tables were updated in backward
        return None

    def sync(self) -> None:
        """Copy each group's ``lr`` into its embedcore optimizer (checked finite and > 0 first, all or none)."""
        values = []
        for group, (opt, names) in zip(self.param_groups, self._optimizers):
            lr = group["lr"]
            lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(f"embedcore: the learning rate of tables {names} set by the scheduler is {lr}, "
                                 f"not a finite float >= 0; nothing was changed")
            values.append(lr)
        for (opt, _), lr in zip(self._optimizers, values):
            opt.learning_rate = lr


def _process_group(group):
    """The ``ProcessGroup`` to shard over: ``group`` itself, or the default group for ``"default"``."""
    import torch.distributed as dist
    if isinstance(group, str) and group == "default":
        if not dist.is_initialized():
            raise RuntimeError("EmbeddingModule(process_group='default'): torch.distributed is not initialized; "
                               "call torch.distributed.init_process_group('gloo') first (under torchrun)")
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD or one "
                        f"from dist.new_group) or 'default', got {type(group).__name__}")
    return group


def _refuse_replicated_under_ddp():
    """Raise when this training forward runs inside the forward of a ``DistributedDataParallel`` of more than
    one rank: every rank would update its own copy of the tables and they would drift apart silently."""
    ddp = torch.nn.parallel.DistributedDataParallel
    active = getattr(ddp, "_active_ddp_module", None)
    if active is None:
        return
    group = getattr(active, "process_group", None)
    try:
        world = torch.distributed.get_world_size(group)
    except Exception:  # pragma: no cover - a group torch cannot size: assume it is shared
        world = 2
    if world > 1:
        raise RuntimeError(
            f"embedcore: an EmbeddingModule without process_group is training inside DistributedDataParallel "
            f"over {world} ranks: each rank would update its own copy of the tables and they would drift apart "
            f"(DDP synchronizes parameters, and the tables are not parameters). Build it with "
            f"EmbeddingModule(config, optimizer, process_group=dist.group.WORLD) to shard the tables over the "
            f"ranks (DDP then handles the dense part), or run it outside DDP's forward")


def _declared_order(config) -> list:
    """Feature paths in the order the config declares them: a flat dict's own order, else ``inputs.flatten``'s."""
    if isinstance(config, dict) and all(isinstance(v, FeatureConfig) for v in config.values()):
        return [str(key) for key in config]
    return [path for path, _ in inputs.flatten(config)]


def _torch_dtype(dtype: np.dtype):
    """The torch dtype of a table's NumPy dtype (``ml_dtypes.bfloat16`` is ``torch.bfloat16``)."""
    if dtype.name == "bfloat16":
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A table or slot as a tensor over the same memory (bfloat16 through a 16-bit integer view)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _as_array(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """A CPU copy-free view of ``tensor`` (already of the torch twin of ``dtype``) as a NumPy array of ``dtype``."""
    tensor = tensor.detach().cpu()
    if dtype.name == "bfloat16":
        return tensor.view(torch.uint16).numpy().view(dtype)
    return tensor.resolve_neg().numpy()


class EmbeddingModule(torch.nn.Module):
    """A ``torch.nn.Module`` around an :class:`embedcore.Embedding`, updating the tables during backward.

    Args:
        embedding: an :class:`embedcore.Embedding`, or a feature config (then ``optimizer`` and ``kwargs``
            such as ``seed`` and ``stack_tables`` build the engine).
        optimizer: the tables' default embedcore optimizer when building from a feature config.
        include_last_offset: how a feature given as ``(values, offsets)`` reads its offsets, as in
            ``torch.nn.EmbeddingBag``: False (the default), one start per bag; True, one more entry at the end
            (the number of values), as in CSR and torchrec.
        process_group: a ``torch.distributed`` ``ProcessGroup`` (or ``"default"``) to shard the tables
            over (see the module docstring); ``kwargs`` then go to :class:`~embedcore.distributed.
            ShardedEmbedding` (``seed``, ``timeout``, ``non_finite``, ``tuning``).

    ``forward(features, weights=None)`` takes

    * what :meth:`Embedding.lookup` takes, with CPU torch tensors allowed wherever an array is (ids and
      weights; converted to NumPy without a copy when the dtype allows; weights of any float dtype, with
      ``requires_grad`` or not, are constants: no gradient flows to them);
    * per feature, a tuple ``(values, offsets)`` of 1-D integer tensors (``nn.EmbeddingBag``'s input; see
      ``include_last_offset``), its weights a 1-D tensor like ``per_sample_weights``;
    * or a torchrec ``KeyedJaggedTensor`` (anything with ``keys()``, ``values()``, ``lengths()`` or
      ``offsets()`` and ``weights_or_none()``; variable batch sizes per key are refused): its keys name the
      features (a feature's key in the feature config dict, its path in a nested config, or its
      ``FeatureConfig.name``); keys naming no feature are ignored; its weights, if any, are the features'.

    The ids are never copied on the way (int64 ids reach the engine as they are; int32 ones the engine
    widens). It returns the activations, mirroring ``features``, as float32 tensors sharing memory with the
    engine's NumPy activations; for a ``KeyedJaggedTensor`` a dict ``{key: activations}`` in the feature
    config's order (a dict's own order) or, for a real torchrec one, a ``KeyedTensor`` as torchrec's
    ``EmbeddingBagCollection`` returns (the features' activations concatenated along dim 1, a sequence
    feature's ``[B, L, dim]`` as ``L * dim`` columns). See the module docstring for when and how the tables
    are updated (during ``loss.backward()``, before the dense ``optimizer.step()``).

    The module registers no parameters: ``torch.optim.X(model.parameters())`` sees only the dense model's.
    ``requires_grad_(False)`` freezes the tables (forward becomes lookup-only), ``requires_grad_(True)``
    unfreezes them. ``state_dict()`` holds the tables, slots and ``step`` (see the module docstring); the
    module pickles (``torch.save``) and deep-copies.
    """

    def __init__(self, embedding, optimizer=None, *, include_last_offset: bool = False, process_group=None,
                 **kwargs):
        super().__init__()
        from .distributed import ShardedEmbedding
        if isinstance(embedding, (Embedding, ShardedEmbedding)):
            if optimizer is not None or kwargs:
                raise ValueError("EmbeddingModule(embedding): optimizer and keyword arguments are only for "
                                 "building an Embedding from a feature config")
            if process_group is not None and (not isinstance(embedding, ShardedEmbedding) or
                                              embedding.comm is not process_group):
                raise ValueError("EmbeddingModule(embedding, process_group=...): give the feature config (the "
                                 "module then shards the tables over the group), or a ShardedEmbedding built "
                                 "with comm=process_group")
        elif process_group is not None:
            group = _process_group(process_group)
            embedding = ShardedEmbedding(embedding, optimizer, comm=group, **kwargs)
        else:
            embedding = Embedding(embedding, optimizer, **kwargs)
        if getattr(embedding, "output_dtype", "float32") != "float32":
            raise ValueError(f"EmbeddingModule: the engine would return {embedding.output_dtype} activations "
                             f"(output_dtype), and the module hands torch float32 ones; use output_dtype='float32' "
                             f"(cast the activations in the model to compute in 16 bits)")
        self.embedding = embedding
        self.sharded = isinstance(embedding, ShardedEmbedding)
        self.include_last_offset = bool(include_last_offset)
        # The autograd node's input: zero-size, never given a gradient, not an nn.Parameter.
        self._trigger = torch.zeros(0, requires_grad=True)
        self._register()

    def _register(self):
        """A handle for the compiled path's custom ops, and no compiled forward pending."""
        config = self.embedding.feature_config
        flat = isinstance(config, dict) and all(isinstance(v, FeatureConfig) for v in config.values())
        self._flat_paths = [path for path, _ in inputs.flatten(config)] if flat else None
        self._compiled_pending = {}
        self._learning_rates = getattr(self, "_learning_rates", None)
        self._handle = next(_HANDLES)
        _MODULES[self._handle] = self

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_compiled_pending", "_handle", "_flat_paths", "_learning_rates"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._register()

    @property
    def embedding_tables(self) -> dict:
        """Table name -> ``[vocabulary_size, dim]`` NumPy array (the engine's storage, live); for a dynamic
        table a :class:`~embedcore.tables.dynamic.DynamicTableView` (its rows by key, live)."""
        return self.embedding.embedding_tables

    @property
    def slot_variables(self) -> dict:
        """Table name -> {slot name: NumPy array} (the engine's storage, live)."""
        return self.embedding.slot_variables

    def save(self, path, extra=None, metadata=None) -> str:
        """An embedcore checkpoint of the tables (:meth:`Embedding.save`); with ``process_group`` a collective
        (call it on every rank): each rank writes its rows and the snapshot commits only when all have, and it
        restores on any number of ranks, or in one process (``EmbeddingModule.restore``)."""
        return self.embedding.save(path, extra, metadata)

    def load(self, path, strict: bool = True) -> None:
        """Load an embedcore checkpoint written by any number of ranks (a collective with ``process_group``)."""
        self.embedding.load(path, strict)

    @classmethod
    def restore(cls, path, *, process_group=None, include_last_offset: bool = False, **kwargs):
        """A module over the checkpoint's tables: in this process, or sharded over ``process_group`` (any
        world size, whatever the number of ranks that wrote it). ``kwargs``: as ``Embedding.restore`` /
        ``ShardedEmbedding.restore`` (``functions``, ``allow_import``, ``timeout``)."""
        if process_group is None:
            return cls(Embedding.restore(path, **kwargs), include_last_offset=include_last_offset)
        from .distributed import ShardedEmbedding
        group = _process_group(process_group)
        engine = ShardedEmbedding.restore(path, comm=group, **kwargs)
        return cls(engine, include_last_offset=include_last_offset, process_group=group)

    def learning_rates(self) -> EmbeddingLearningRates:
        """The tables' learning rates as a torch optimizer for ``torch.optim.lr_scheduler`` (one param group
        per distinct embedcore optimizer; see :class:`EmbeddingLearningRates`). The same object every call.
        The optimizers' learning rates must be numbers (a callable learning rate schedules itself)."""
        if self._learning_rates is None:
            optimizers = {}
            for table in self.embedding.physical_tables:
                opt = table.optimizer
                if opt is None:
                    raise RuntimeError(f"embedcore: tables {list(table.table_names)} have no optimizer (a lookup-only "
                                       f"engine): there is no learning rate to schedule")
                if callable(opt.learning_rate):
                    raise ValueError(f"embedcore: tables {list(table.table_names)} have a callable learning rate "
                                     f"({opt.learning_rate!r}); a torch lr_scheduler drives numbers only")
                optimizers.setdefault(id(opt), (opt, []))[1].extend(table.table_names)
            self._learning_rates = EmbeddingLearningRates(optimizers.values())
        return self._learning_rates

    def _before_update(self):
        if self._learning_rates is not None:
            self._learning_rates.sync()

    def _after_update(self):
        if self._learning_rates is not None:
            self._learning_rates.step()

    def requires_grad_(self, requires_grad: bool = True):
        """Also freezes (False) or unfreezes (True) the embedding tables."""
        self._trigger.requires_grad_(requires_grad)
        return super().requires_grad_(requires_grad)

    @property
    def updates_enabled(self) -> bool:
        """Whether a forward called now would update the tables in its backward."""
        return torch.is_grad_enabled() and self.training and self._trigger.requires_grad

    def forward(self, features, weights=None):
        if torch.compiler.is_compiling():
            return self._compiled_forward(features, weights)
        if not self.sharded and self.updates_enabled:
            _refuse_replicated_under_ddp()
        keyed = None
        if _is_keyed_jagged(features):
            if weights is not None:
                raise InputError("a KeyedJaggedTensor carries its own weights (weights_or_none()); pass weights=None")
            keyed = features
            features, weights, keys, batch = self._from_keyed_jagged(features)
        features, weights = self._from_torch(features, weights)
        acts, lookup_ctx = self.embedding.lookup(features, weights, training=self.training)
        leaves = [a for _, a in inputs.flatten(acts)]
        if not self.updates_enabled:
            tensors = [torch.from_numpy(a) for a in leaves]
        else:
            skeleton = inputs.unflatten(acts, [None] * len(leaves))  # the structure, without holding the arrays
            pending = _Pending(self.embedding, lookup_ctx, skeleton, [a.shape for a in leaves], self)
            tensors = list(_ApplyInBackward.apply(self._trigger, pending, *leaves))
        if keyed is None:
            return inputs.unflatten(acts, tensors)
        position = {path: k for k, path in enumerate(_declared_order(self.embedding.feature_config))}
        pairs = sorted(zip(keys, tensors), key=lambda pair: position[pair[0][0]])
        keys, tensors = [key for (_, key), _ in pairs], [t for _, t in pairs]
        keyed_tensor = _keyed_tensor_class(keyed)
        if keyed_tensor is None:
            return dict(zip(keys, tensors))
        columns = [t.reshape(batch, math.prod(t.shape) // batch if batch else math.prod(t.shape[1:]))
                   for t in tensors]  # [B, dim]; a sequence feature's [B, L, dim] as L * dim columns
        return keyed_tensor(keys=list(keys), length_per_key=[t.shape[1] for t in columns],
                            values=torch.cat(columns, 1))

    def _compiled_forward(self, features, weights):
        """forward under ``torch.compile``: one ``embedcore::lookup`` op (its backward applies the update)."""
        if self._flat_paths is None or not isinstance(features, dict):
            raise InputError("under torch.compile, EmbeddingModule takes a flat dict feature config and a dict "
                             "of tensors per feature (ids [B] or [B, k], or (values, offsets)); call it outside "
                             "the compiled region (torch.compiler.disable) for other inputs")
        tensors, layout = [], []
        for path in self._flat_paths:
            ids = features[path]
            w = None if weights is None else weights.get(path)
            if isinstance(ids, tuple):
                tensors.extend(ids)
                code = "b"
            else:
                tensors.append(ids)
                code = "d"
            if w is not None:
                tensors.append(w)
                code += "w"
            layout.append(code)
        train = self.updates_enabled
        trigger = self._trigger if train else self._trigger.detach()
        outs = torch.ops.embedcore.lookup(self._handle, ",".join(layout), train, trigger, tensors)
        return dict(zip(self._flat_paths, outs[:-1]))

    def _from_torch(self, features, weights):
        """``features`` and ``weights`` (mirroring the feature config) with their torch tensors turned into NumPy
        arrays and ``(values, offsets)`` pairs into :class:`Ragged`."""
        config = self.embedding.feature_config
        id_leaves = inputs.flatten_like(config, features, "features")
        weight_leaves = [None] * len(id_leaves) if weights is None else inputs.flatten_like(config, weights, "weights")
        ids_out, weights_out = [], []
        for (path, feature), ids, w in zip(inputs.flatten(config), id_leaves, weight_leaves):
            if isinstance(ids, tuple):
                ids, w = _bags(ids, w, feature.name or path, self.include_last_offset)
            ids_out.append(_leaf_to_numpy(ids))
            weights_out.append(_leaf_to_numpy(w))
        return (inputs.unflatten(config, ids_out),
                None if weights is None and all(w is None for w in weights_out) else
                inputs.unflatten(config, weights_out))

    def _from_keyed_jagged(self, kjt):
        """Features and weights (mirroring the feature config) from a ``KeyedJaggedTensor``, ids not copied;
        ``(path, key)`` of each feature, in ``inputs.flatten`` order; the batch size."""
        kjt_keys = list(kjt.keys())
        if len(set(kjt_keys)) != len(kjt_keys):
            raise InputError(f"the KeyedJaggedTensor's keys repeat: {kjt_keys}")
        if callable(getattr(kjt, "variable_stride_per_key", None)) and kjt.variable_stride_per_key():
            raise InputError("a KeyedJaggedTensor with a batch size per key (variable stride) is not supported: "
                             "give every key the same batch size")
        values = _ids_to_numpy(kjt.values(), "<KeyedJaggedTensor>", "values")
        w = kjt.weights_or_none()
        w = None if w is None else _leaf_to_numpy(w)
        if w is not None and w.shape != values.shape:
            raise InputError(f"the KeyedJaggedTensor's weights have shape {tuple(w.shape)}, its values "
                             f"{tuple(values.shape)}")
        offsets, batch = _jagged_offsets(kjt, kjt_keys, values.shape[0])
        if callable(getattr(kjt, "stride", None)) and kjt_keys and int(kjt.stride()) != batch:
            raise InputError(f"the KeyedJaggedTensor's stride() is {kjt.stride()}, its lengths give {batch} "
                             f"samples per key")
        index = {key: k for k, key in enumerate(kjt_keys)}
        ids_out, weights_out, keys, missing = [], [], [], []
        for path, feature in inputs.flatten(self.embedding.feature_config):
            key = next((c for c in (path, feature.name) if c is not None and c in index), None)
            if key is None:
                missing.append(path if feature.name in (None, path) else f"{path} (named {feature.name})")
                continue
            k = index[key]
            segment = offsets[k * batch:(k + 1) * batch + 1]
            start, end = int(segment[0]), int(segment[-1])
            splits = segment - start
            ids_out.append(Ragged(values[start:end], splits))
            weights_out.append(None if w is None else Ragged(w[start:end], splits))
            keys.append((path, key))
        if missing:
            raise InputError(f"the KeyedJaggedTensor has no key for the features {missing} (its keys are "
                             f"{kjt_keys})")
        config = self.embedding.feature_config
        return (inputs.unflatten(config, ids_out), None if w is None else inputs.unflatten(config, weights_out),
                keys, batch)

    # -- state: state_dict, load_state_dict ------------------------------------------------------------
    def _dynamic_tables(self) -> list:
        """The names of the module's dynamic tables, sorted."""
        return sorted(name for name, table in self.embedding.tables.items() if isinstance(table, DynamicTableConfig))

    def _dynamic_state_refusal(self, prefix) -> str:
        return (f"embedcore tables at '{prefix or '<root>'}': tables {self._dynamic_tables()} are dynamic: their "
                f"state (keys, rows, slots, the policies' counters) is no fixed-shape tensor a state_dict holds; "
                f"checkpoint the module with module.save(path) and EmbeddingModule.restore(path) / "
                f"module.load(path) instead")

    def _state_entries(self, prefix):
        """``{key: (table, slot or None)}`` of the tables and slots in ``state_dict``; ``step`` apart."""
        entries = {}
        slots = self.embedding.slot_variables
        for name in self.embedding.tables:  # the configuration's order, whatever the stacking
            entries[f"{prefix}tables.{name}.weights"] = (name, None)
            for slot in slots[name]:
                entries[f"{prefix}tables.{name}.slot.{slot}"] = (name, slot)
        return entries

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self._dynamic_tables():
            raise RuntimeError(self._dynamic_state_refusal(prefix))
        super()._save_to_state_dict(destination, prefix, keep_vars)
        tables, slots = self.embedding.embedding_tables, self.embedding.slot_variables
        for key, (name, slot) in self._state_entries(prefix).items():
            destination[key] = _as_tensor(tables[name] if slot is None else slots[name][slot])
        destination[prefix + "step"] = torch.tensor(self.embedding.step, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        entries = self._state_entries(prefix)
        step_key = prefix + "step"
        ours = set(entries) | {step_key}
        super()._load_from_state_dict({k: v for k, v in state_dict.items() if k not in ours}, prefix,
                                      local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if self._dynamic_tables():
            error_msgs.append(self._dynamic_state_refusal(prefix) + " (nothing was changed)")
            return
        current, current_slots = self.embedding.embedding_tables, self.embedding.slot_variables
        tables, slots, step, problems = {}, {}, None, []
        for key, (name, slot) in entries.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            target = current[name] if slot is None else current_slots[name][slot]
            dtype = _torch_dtype(target.dtype)
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != target.shape \
                    or value.device.type == "meta":
                got = (f"{value.dtype} of shape {tuple(value.shape)} on '{value.device}'"
                       if isinstance(value, torch.Tensor) else type(value).__name__)
                problems.append(f'"{key}" must be a {dtype} tensor of shape {target.shape} with data, as the table '
                                f'is; the state dict holds {got} (convert it with .to({dtype}) if that is meant)')
                continue
            array = _as_array(value, target.dtype)
            if slot is None:
                tables[name] = array
            else:
                slots.setdefault(name, {})[slot] = array
        if step_key not in state_dict:
            missing_keys.append(step_key)
        else:
            value = state_dict[step_key]
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
                    and not value.is_complex() and value.dtype != torch.bool and value.device.type != "meta":
                step = int(value.item())
            elif isinstance(value, int) and not isinstance(value, bool):
                step = value
            else:
                problems.append(f'"{step_key}" must be one integer (a tensor or an int), got {value!r:.80}')
        if not problems and self.sharded:
            problems.append("a module sharded over a process group holds only this rank's rows in its state "
                            "dict; load a checkpoint with module.load(path) (any world size) instead")
        if not problems:
            try:
                self.embedding.set_state(tables, slots, step)
            except ValueError as e:
                error_msgs.append(f"embedcore tables at '{prefix or '<root>'}': {e}")
        else:
            error_msgs.append(f"embedcore tables at '{prefix or '<root>'}': " + "; ".join(problems)
                              + " (nothing was changed)")

    def extra_repr(self) -> str:
        return repr(self.embedding)
