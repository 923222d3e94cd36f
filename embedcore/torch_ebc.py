"""A drop-in for torchrec's ``EmbeddingBagCollection``, trained by embedcore's fused sparse optimizers.

``EmbeddingBagCollection(tables, is_weighted=False)`` takes torchrec's ``EmbeddingBagConfig`` objects as they
are (anything with their fields: ``name``, ``num_embeddings``, ``embedding_dim``, ``feature_names``,
``pooling``, ``init_fn``, ``weight_init_min``/``weight_init_max``), answers ``embedding_bag_configs()`` and
``is_weighted()``, takes a ``KeyedJaggedTensor`` and returns torchrec's ``KeyedTensor`` (a dict
``{key: [B, dim]}`` when torchrec is not installed). torchrec is never required: configs and KJTs are read by
their attributes.

Pooling follows FBGEMM/TorchRec, not TensorFlow. For bag ``b`` of a feature with ids ``i`` and per-sample
weights ``w_i`` (1 without weights), of length ``L_b`` (an empty bag pools to zeros)::

    SUM:  out_b = sum_i w_i row_i
    MEAN: out_b = (1 / L_b) sum_i w_i row_i      (the bag length, not sum_i w_i as TensorFlow's "mean")

The engine computes a SUM (every table's combiner is ``sum``); MEAN is the per-value weight ``w_i / L_b``
given to it. The rows' gradient is therefore ``sum over occurrences of w_i / L_b * grad_b`` (``w_i * grad_b``
for SUM), FBGEMM's. Weights with ``requires_grad`` get ``d loss / d w_i = s_b row_i . grad_b`` with
``s_b = 1`` (SUM) or ``1 / L_b`` (MEAN), ``row_i`` the row as the forward read it (a copy of the looked-up
rows is kept for that, only when the weights require grad). FBGEMM's CPU TBE 1.8.0 returns ``row_i . grad_b``
for MEAN too (without ``1 / L_b``), which is not the derivative of its own forward; this module returns the
derivative.

Output keys are torchrec's: a feature read by one table is its own key, a feature read by several tables is
``feature@table`` for each; keys are ordered table by table, features in each table's order.

Parameters: ``embedding_bags.<table>.weight`` (as torchrec's), tensors over the engine's rows, so
``state_dict``/``load_state_dict`` use torchrec's keys and values. They never receive a ``.grad``: the update is
fused into ``loss.backward()``. The optimizer is given as torchrec users give it,
``apply_optimizer_in_backward(optimizer_class, ebc.parameters(), kwargs)`` (torchrec's or torch's function), or
with ``optimizer=`` (an embedcore optimizer); the first training forward builds the fused update from it:
``torch.optim.SGD`` -> :class:`~embedcore.SGD`, ``torch.optim.Adagrad`` -> :class:`~embedcore.ExactAdagrad`,
torchrec's ``RowWiseAdagrad`` -> :class:`~embedcore.ExactRowwiseAdagrad`; other classes or options are refused
naming them. The in-backward optimizers torchrec creates for these parameters are never stepped (their state,
e.g. ``torch.optim.Adagrad``'s sums, is allocated by torch at ``apply_optimizer_in_backward``).

Under ``torch.fx`` tracing (``torch.fx.symbolic_trace``, ``torchrec.fx.symbolic_trace``, torchrec's train
pipelines) the module's lookup is a leaf: one ``call_module`` node (its parameter-free submodule ``lookup``). Under ``torch.compile`` its forward runs eagerly
(a graph break), as KJT parsing cannot be compiled.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from . import optimizers as _opt
from .config import FeatureConfig, TableConfig
from .engine import Embedding
from .inputs import InputError
from .torch import EmbeddingModule, _ids_to_numpy, _jagged_offsets

__all__ = ["EmbeddingBagCollection", "embedcore_optimizer"]


def _pooling_name(config) -> str:
    pooling = getattr(config, "pooling", None)
    name = "SUM" if pooling is None else str(getattr(pooling, "value", getattr(pooling, "name", pooling))).upper()
    if name not in ("SUM", "MEAN"):
        raise ValueError(f"EmbeddingBagConfig '{config.name}': pooling {pooling!r} is not supported (SUM or MEAN)")
    return name


def embedcore_optimizer(optimizer_class, kwargs: dict, where: str):
    """The embedcore optimizer that applies ``optimizer_class(**kwargs)`` row by row, lazily (only touched rows);
    ``ValueError`` naming ``where`` for a class or option without an equivalent."""
    kwargs = dict(kwargs or {})
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    lr = kwargs.pop("lr", 0.01)

    def only(allowed):
        extra = {k: v for k, v in kwargs.items() if k not in allowed and v not in (0, 0.0, False, None)}
        if extra:
            raise ValueError(f"{where}: {name} option(s) {extra} have no fused equivalent in embedcore (supported: "
                             f"lr, {', '.join(sorted(allowed))})")

    if name == "SGD":
        only({"foreach", "differentiable", "fused"})
        return _opt.SGD(lr)
    if name == "Adagrad" and "torchrec" not in getattr(optimizer_class, "__module__", ""):
        only({"eps", "foreach", "differentiable", "fused"})
        return _opt.ExactAdagrad(lr, eps=kwargs.get("eps", 1e-10))
    if name in ("RowWiseAdagrad", "RowwiseAdagrad"):
        only({"eps"})
        return _opt.ExactRowwiseAdagrad(lr, eps=kwargs.get("eps", 1e-10))
    raise ValueError(f"{where}: optimizer class {name} has no fused embedcore equivalent; use torch.optim.SGD, "
                     f"torch.optim.Adagrad or torchrec.optim.RowWiseAdagrad, or pass optimizer= an embedcore "
                     f"optimizer (CustomOptimizer for your own)")


class _Lookup(torch.nn.Module):
    """The collection's lookup as its own parameter-free submodule (``lookup``), so that a tracer records it as
    one ``call_module`` node even when the collection itself is the traced root."""

    def __init__(self, owner):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: no cycle in named_modules()

    def forward(self, features):
        if isinstance(features, torch.fx.Proxy):
            tracer = features.tracer
            return tracer.create_proxy("call_module", tracer.path_of_module(self), (features,), {})
        return self._owner._eager_forward(features)


class _Bag(torch.nn.Module):
    """Holds one table's ``weight`` parameter (the name torchrec's ``nn.EmbeddingBag`` gives it)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def _keyed_tensor():
    module = sys.modules.get("torchrec.sparse.jagged_tensor")
    if module is None:
        try:
            import torchrec.sparse.jagged_tensor as module
        except ImportError:
            return None
    return module.KeyedTensor


class EmbeddingBagCollection(torch.nn.Module):
    """torchrec's ``EmbeddingBagCollection``, trained by embedcore (see the module docstring)."""

    def __init__(self, tables, is_weighted: bool = False, device=None, *, optimizer=None, seed: int = 0):
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"embedcore's EmbeddingBagCollection runs on the CPU; got device={device!r}")
        tables = list(tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"EmbeddingBagConfig names repeat: {names}")
        self._configs, self._is_weighted, self._seed = tables, bool(is_weighted), int(seed)
        self._pooling = {t.name: _pooling_name(t) for t in tables}
        readers = {}
        for t in tables:
            if not t.feature_names:
                raise ValueError(f"EmbeddingBagConfig '{t.name}' has no feature_names")
            for f in t.feature_names:
                readers.setdefault(f, []).append(t.name)
        self._outputs = [(f"{f}@{t.name}" if len(readers[f]) > 1 else f, f, t.name)
                         for t in tables for f in t.feature_names]
        self.embedding_bags = torch.nn.ModuleDict()
        initial = {}
        for t in tables:
            weight = torch.empty(int(t.num_embeddings), int(t.embedding_dim), dtype=torch.float32)
            init_fn = getattr(t, "init_fn", None)
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(weight)
                else:
                    bound = math.sqrt(1.0 / t.num_embeddings)
                    low = getattr(t, "weight_init_min", None)
                    high = getattr(t, "weight_init_max", None)
                    weight.uniform_(-bound if low is None else low, bound if high is None else high)
            initial[t.name] = weight.numpy()
            self.embedding_bags[t.name] = _Bag(torch.nn.Parameter(weight))
        self._engine_module = None
        self.lookup = _Lookup(self)
        self._build(optimizer, initial)

    # -- what torchrec asks of an EmbeddingBagCollection -------------------------------------------------
    def embedding_bag_configs(self):
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def embedding(self) -> Embedding:
        """The embedcore engine holding the tables (and, once the optimizer is known, the slots)."""
        return self._engine_module.embedding

    # -- the engine -----------------------------------------------------------------------------------
    def _build(self, optimizers, initial: dict):
        """(Re)build the engine: ``optimizers`` None (lookup only), one embedcore optimizer, or one per table;
        the tables start at ``initial``; the parameters are pointed at the engine's rows."""
        per_table = optimizers if isinstance(optimizers, dict) else {t.name: optimizers for t in self._configs}
        configs = {t.name: TableConfig(int(t.num_embeddings), int(t.embedding_dim), optimizer=per_table[t.name],
                                       combiner="sum", name=t.name) for t in self._configs}
        features = {key: FeatureConfig(configs[table], name=feature) for key, feature, table in self._outputs}
        # fill: the slots start at their initializers' values; the rows are then replaced by set_state
        engine = Embedding(features, None, seed=self._seed)  # the optimizers are the tables' own
        engine.set_state(tables=initial)
        module = EmbeddingModule(engine, include_last_offset=True)
        object.__setattr__(self, "_engine_module", module)  # not a submodule: state_dict holds torchrec's keys only
        rows = engine.embedding_tables
        for name, bag in self.embedding_bags.items():
            bag.weight.data = torch.from_numpy(rows[name])

    def _optimizers_from_parameters(self):
        """Per table, the embedcore optimizer for what ``apply_optimizer_in_backward`` put on its parameter."""
        found = {}
        for name, bag in self.embedding_bags.items():
            classes = getattr(bag.weight, "_optimizer_classes", None)
            if not classes:
                raise RuntimeError(f"embedcore EmbeddingBagCollection: table '{name}' has no optimizer: call "
                                   f"apply_optimizer_in_backward(optimizer_class, ebc.parameters(), kwargs) (torchrec) "
                                   f"or pass optimizer= (an embedcore optimizer) before training")
            if len(classes) > 1:
                raise ValueError(f"table '{name}' was given {len(classes)} in-backward optimizers; give one")
            found[name] = embedcore_optimizer(classes[0], bag.weight._optimizer_kwargs[0], f"table '{name}'")
        return found

    def _ensure_optimizer(self):
        if not self.embedding.lookup_only:
            return
        optimizers = self._optimizers_from_parameters()
        current = {name: table.copy() for name, table in self.embedding.embedding_tables.items()}
        self._build(optimizers, current)

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, features):
        return self.lookup(features)  # a tracer records self.lookup as one node (see _Lookup)

    @torch.compiler.disable
    def _eager_forward(self, kjt):
        module = self._engine_module
        module.train(self.training)
        trains = torch.is_grad_enabled() and self.training and any(p.requires_grad for p in self.parameters())
        module.requires_grad_(trains)
        if trains:
            self._ensure_optimizer()
            module = self._engine_module
            module.train(True)
        keys = list(kjt.keys())
        if len(set(keys)) != len(keys):
            raise InputError(f"the KeyedJaggedTensor's keys repeat: {keys}")
        values_t = kjt.values()
        values = _ids_to_numpy(values_t, "<KeyedJaggedTensor>", "values")
        weights_t = kjt.weights_or_none() if self._is_weighted else None
        if self._is_weighted and weights_t is None:
            raise InputError("this EmbeddingBagCollection is weighted (is_weighted=True): its KeyedJaggedTensor "
                             "needs weights")
        if weights_t is not None and tuple(weights_t.shape) != tuple(values_t.shape):
            raise InputError(f"the KeyedJaggedTensor's weights have shape {tuple(weights_t.shape)}, its values "
                             f"{tuple(values_t.shape)}")
        offsets, batch = _jagged_offsets(kjt, keys, values.shape[0])
        index = {k: n for n, k in enumerate(keys)}
        missing = sorted({f for _, f, _ in self._outputs if f not in index})
        if missing:
            raise InputError(f"the KeyedJaggedTensor has no key for the features {missing} (its keys are {keys})")
        ids, weights, extras = {}, {}, []
        need_rows = weights_t is not None and weights_t.requires_grad and torch.is_grad_enabled()
        rows = self.embedding.embedding_tables if need_rows else None
        for key, feature, table in self._outputs:
            k = index[feature]
            segment = offsets[k * batch:(k + 1) * batch + 1]
            start, end = int(segment[0]), int(segment[-1])
            splits = segment - start
            lengths = np.diff(splits)
            scale = None
            if self._pooling[table] == "MEAN":
                scale = np.repeat((1.0 / np.maximum(lengths, 1)).astype(np.float32), lengths)
            w = None
            if weights_t is not None:
                w = weights_t.detach()[start:end].to(torch.float32)
                if scale is not None:
                    w = w * torch.from_numpy(scale)
            elif scale is not None:
                w = torch.from_numpy(scale)
            ids[key] = (values_t[start:end], torch.from_numpy(splits))
            weights[key] = w
            if need_rows:
                extras.append((key, table, start, end, lengths, scale))
        out = module(ids, weights)
        if need_rows:  # zero-valued terms whose gradient in w_i is s_b row_i . grad_b
            for key, table, start, end, lengths, scale in extras:
                looked = torch.from_numpy(rows[table][values[start:end]])
                w = weights_t[start:end].to(torch.float32)
                delta = w - w.detach()
                if scale is not None:
                    delta = delta * torch.from_numpy(scale)
                bag_of = torch.repeat_interleave(torch.arange(batch), torch.from_numpy(lengths))
                out[key] = out[key] + torch.zeros_like(out[key]).index_add(0, bag_of, delta[:, None] * looked)
        order = [key for key, _, _ in self._outputs]
        keyed = _keyed_tensor()
        if keyed is None:
            return {key: out[key] for key in order}
        return keyed(keys=order, length_per_key=[out[key].shape[1] for key in order],
                     values=torch.cat([out[key] for key in order], 1))
