"""Tables and slots to and from ``tf.train.Checkpoint``\\ s of TensorFlow's TPU embedding engines.

A model trained with ``tf.tpu.experimental.embedding`` moves to embedcore with :func:`load_tf_checkpoint`,
and back with :func:`save_tf_checkpoint` (or :func:`as_trackable`, to save the tables beside a model).

What TensorFlow writes (tensorflow 2.21; read from ``tpu_embedding_base.py``, ``tpu_embedding_v2.py``,
``tpu_embedding_for_serving.py``, ``tpu_embedding_v3*.py`` and checked by this module's tests):

* ``TPUEmbedding`` (on CPU and on TPU) and ``TPUEmbeddingForServing`` track, under the object the user
  put in the checkpoint (``tf.train.Checkpoint(embedding=...)``), one ``[vocabulary_size, dim]`` float32
  variable per table, named by the table's name (``table_<i>`` for the i-th table, in order of first use
  by the flattened features, when unnamed), one per slot named ``<table>/<slot>`` (TensorFlow's slot
  names: ``accumulators``; ``momenta``, ``velocities``; ``accumulators``, ``linears``; ...), and a dict
  ``_variables``: table name -> {``"parameters"``: table, slot name: slot}. This module reads that dict
  from the checkpoint's object graph, so names holding ``/`` or ``.`` are never ambiguous.
* On TPU, ``TPUEmbedding`` shards each variable over the hosts into contiguous row blocks; the checkpoint
  stores the blocks as slices of one full-shape tensor, which TensorFlow's reader assembles.
* ``TPUEmbeddingV2`` (SparseCore) stores *stacked* tables: tables of one ``dim`` and optimizer in one
  variable whose rows are interleaved over the SparseCores, described by a
  ``SparseCoreTableLayouts`` proto under ``_sparse_core_table_layouts``: row ``r`` of a table lies in
  shard ``(r % num_sparse_cores + rotation) % num_sparse_cores`` at position ``row_offset +
  r // num_sparse_cores``, padded rows and columns beyond the table's shape. Tables and slots are read out
  of such a checkpoint by that rule (TensorFlow's own serving class reads only the tables).

Written checkpoints use the per-table layout, which ``TPUEmbedding`` and ``TPUEmbeddingForServing``
restore, and which TensorFlow's v3 checkpoint adapter describes as resharded onto SparseCore at restore
(not checked here: that needs a TPU).

Table names: the engine's table names are the checkpoint's unless ``feature_config`` (TensorFlow's, or
embedcore's, configuration the engine was built from) is given: then the engine's i-th table is
TensorFlow's i-th table (as TensorFlow orders and names them), checked to have the same shape.

Live, through ``tf.train.Checkpoint`` itself: :func:`engine_trackable` lays an engine's tables and slots
out as TensorFlow's engines track theirs (the drop-ins of :mod:`embedcore.tensorflow.engines` are such
trackables; :func:`as_trackable` gives one for a plain engine). Saving writes the rows as they are then;
restoring stages each value TensorFlow's reader hands over and sets them all through
:meth:`embedcore.Embedding.set_state` once every table and slot has arrived (or at ``flush()``), checked
together first. A value of another dtype than float32 is refused by TensorFlow's reader itself
(``InvalidArgumentError`` naming the checkpoint key).

Steps are not part of TensorFlow's embedding checkpoints: the engine's ``step`` is left as it is unless
``step`` is passed. Every refusal is a :class:`~embedcore.CheckpointError` naming the table and slot, and
leaves the engine as it was.
"""

from __future__ import annotations

import os

import numpy as np

from ..checkpoint import CheckpointError
from ..memory_budget import check_fits

__all__ = ["load_tf_checkpoint", "save_tf_checkpoint", "as_trackable", "engine_trackable", "tf_table_names",
           "PARAMETERS"]

PARAMETERS = "parameters"              # the table's key in TensorFlow's ``_variables`` dict
_VARIABLES = "_variables"
_LAYOUTS = "_sparse_core_table_layouts"
_VALUE = "VARIABLE_VALUE"
_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


# -- the engine and its names ----------------------------------------------------------------------------
def _engine_of(engine):
    """The embedcore training engine behind ``engine`` (itself, or the drop-in's ``engine`` attribute)."""
    inner = engine if hasattr(engine, "set_state") else getattr(engine, "engine", None)
    needed = ("set_state", "embedding_tables", "slot_variables", "tables")
    if inner is None or not all(hasattr(inner, a) for a in needed):
        raise TypeError(f"engine must be an embedcore.Embedding (or a drop-in exposing one as .engine), got "
                        f"{type(engine).__name__}")
    return inner


def tf_table_names(feature_config) -> list:
    """TensorFlow's names of the tables of ``feature_config``, in TensorFlow's order (see :func:`_tf_tables`)."""
    return [name for _, name in _tf_tables(feature_config)]


def _tf_tables(feature_config) -> list:
    """``[(table config, TensorFlow's name), ...]`` of the tables of ``feature_config``, in TensorFlow's order.

    Tables are ordered by their first use in ``tf.nest.flatten(feature_config)`` (by identity); a table
    without a name is called ``table_<i>``, ``i`` its position in that order (as ``TPUEmbedding`` names it).
    """
    import tensorflow as tf
    tables = []
    for feature in tf.nest.flatten(feature_config):
        if not any(feature.table is t for t in tables):
            tables.append(feature.table)
    return [(t, t.name if t.name is not None else f"table_{i}") for i, t in enumerate(tables)]


def _name_map(emb, feature_config) -> dict:
    """Engine table name -> the checkpoint's table name."""
    if feature_config is None:
        return {name: name for name in emb.tables}
    given = _tf_tables(feature_config)
    mine = list(emb.tables.values())
    if len(given) != len(mine):
        raise CheckpointError(f"feature_config has {len(given)} table(s) ({[n for _, n in given]}), the engine "
                              f"{len(mine)} ({[t.name for t in mine]})")
    names = {}
    for (table, tf_name), own in zip(given, mine):
        if (table.vocabulary_size, table.dim) != (own.vocabulary_size, own.dim):
            raise CheckpointError(f"feature_config's table '{tf_name}' is {table.vocabulary_size} x {table.dim}, "
                                  f"but the engine's table in its place, '{own.name}', is {own.vocabulary_size} x "
                                  f"{own.dim}: pass the feature_config the engine was built from")
        if tf_name in names.values():
            raise CheckpointError(f"feature_config names two tables '{tf_name}'")
        names[own.name] = tf_name
    return names


# -- reading TensorFlow's checkpoint -----------------------------------------------------------------------
class _Stored:
    """One table or slot in the checkpoint: its shape and dtype (from the index) and how to read it."""

    def __init__(self, shape, dtype, read, where):
        self.shape, self.dtype, self.read, self.where = tuple(shape), dtype, read, where


def _open(path):
    """``(reader, prefix)`` of the TensorFlow checkpoint at ``path`` (a prefix, or a directory with a
    ``checkpoint`` file naming one)."""
    import tensorflow as tf
    path = os.fspath(path)
    prefix = tf.train.latest_checkpoint(path) if os.path.isdir(path) else path
    if prefix is None:
        raise CheckpointError(f"no TensorFlow checkpoint in the directory {path!r} (no 'checkpoint' file naming "
                              f"one; pass the checkpoint's prefix, e.g. '{os.path.join(path, 'ckpt-1')}')")
    try:
        return tf.train.load_checkpoint(prefix), prefix
    except Exception as e:  # NotFoundError, DataLossError, ... : TensorFlow's reader says why
        raise CheckpointError(f"cannot read a TensorFlow checkpoint at {prefix!r}: {type(e).__name__}: "
                              f"{str(e).strip()[:300]}") from None


def _object_graph(reader, prefix):
    """The checkpoint's object graph: ``(nodes, paths)``, paths as ``a/b/c`` from the root (node 0)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2
    if not reader.has_tensor(_GRAPH_KEY):
        raise CheckpointError(f"{prefix!r} is a name-based (TF1) checkpoint without an object graph; "
                              f"TensorFlow's TPU embedding engines write object-based ones (tf.train.Checkpoint)")
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    try:
        graph.ParseFromString(reader.get_tensor(_GRAPH_KEY))
    except Exception as e:
        raise CheckpointError(f"{prefix!r}: its object graph cannot be read ({type(e).__name__}: {e})") from None
    paths, queue = {0: ""}, [0]
    while queue:
        node = queue.pop(0)
        for child in graph.nodes[node].children:
            if child.node_id not in paths and child.node_id < len(graph.nodes):
                paths[child.node_id] = f"{paths[node]}/{child.local_name}".lstrip("/")
                queue.append(child.node_id)
    return graph.nodes, paths


def _children(node) -> dict:
    return {c.local_name: c.node_id for c in node.children}


def _value_key(node):
    keys = [a.checkpoint_key for a in node.attributes if a.name == _VALUE]
    return keys[0] if keys else None


def _embedding_objects(nodes, paths) -> list:
    """Node ids of the objects that look like TensorFlow's TPU embedding engines: a ``_variables`` dict of
    dicts that each hold ``parameters``."""
    found = []
    for k, path in sorted(paths.items(), key=lambda kv: kv[1]):
        variables = _children(nodes[k]).get(_VARIABLES)
        if variables is None:
            continue
        tables = _children(nodes[variables])
        if tables and all(PARAMETERS in _children(nodes[t]) for t in tables.values()):
            found.append(k)
    return found


def _stored_variables(reader, nodes, obj, prefix, where) -> dict:
    """Table name -> {``parameters`` or slot name: :class:`_Stored`} of one embedding object, the tables of a
    SparseCore checkpoint taken out of their stacked variables."""
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()

    def stored(key, what):
        if key is None or key not in shapes:
            raise CheckpointError(f"{prefix!r}: {what} has no value in the checkpoint")
        return _Stored(shapes[key], dtypes[key].as_numpy_dtype, lambda: reader.get_tensor(key), key)

    variables = {}
    for name, t in _children(nodes[_children(nodes[obj])[_VARIABLES]]).items():
        variables[name] = {slot: stored(_value_key(nodes[v]), f"{where} table '{name}' {slot}")
                           for slot, v in _children(nodes[t]).items()}
    layouts = _children(nodes[obj]).get(_LAYOUTS)
    if layouts is None:
        return variables
    serialized = reader.get_tensor(_value_key(nodes[layouts])) if _value_key(nodes[layouts]) else b""
    return _unstacked(serialized, variables, prefix) if serialized else variables


def _unstacked(serialized, variables, prefix) -> dict:
    """``variables`` with the tables of their stacked SparseCore variables taken out, by the layouts proto
    (a table the object also holds on its own, as TensorFlow's serving class does after reading such a
    checkpoint, is read from its own variable)."""
    from tensorflow.core.tpu.kernels import sparse_core_layout_pb2
    layouts = sparse_core_layout_pb2.SparseCoreTableLayouts()
    layouts.ParseFromString(serialized)
    tables, cache, stacked_names = dict(variables), {}, set()
    for layout in layouts.tables:
        if layout.table_name in variables:
            continue
        if layout.stacked_table_name not in variables:
            raise CheckpointError(f"{prefix!r}: table '{layout.table_name}' lies in the stacked table "
                                  f"'{layout.stacked_table_name}', which the checkpoint does not hold")
        stacked_names.add(layout.stacked_table_name)
        tables[layout.table_name] = {
            slot: _Stored(tuple(layout.unsharded_shape), source.dtype,
                          _unshuffler(layout, source, cache, prefix, slot), f"{source.where} ({layout.table_name})")
            for slot, source in variables[layout.stacked_table_name].items()}
    for name in stacked_names - {layout.table_name for layout in layouts.tables}:
        del tables[name]
    return tables


def _unshuffler(layout, source, cache, prefix, slot):
    """A reader of one table's rows out of a stacked SparseCore variable (read once, shared by its tables)."""
    cores = int(layout.num_sparse_cores)
    rows, dim = (int(x) for x in layout.unsharded_shape)
    per_core = int(layout.unsharded_padded_shape[0]) // max(cores, 1)

    def read():
        if source.where not in cache:
            cache[source.where] = source.read()
        stacked = cache[source.where]
        if cores < 1 or stacked.ndim != 2 or stacked.shape[0] % cores or dim > stacked.shape[1] or \
                layout.sparse_core_shard_row_offset + -(-rows // cores) > stacked.shape[0] // cores:
            raise CheckpointError(f"{prefix!r}: the stacked table '{layout.stacked_table_name}' ({slot}) of shape "
                                  f"{stacked.shape} does not hold table '{layout.table_name}' as its layout says "
                                  f"({cores} SparseCores, {per_core} rows each from row "
                                  f"{layout.sparse_core_shard_row_offset})")
        shards = stacked.reshape(cores, stacked.shape[0] // cores, stacked.shape[1])
        ids = np.arange(rows)
        core = (ids % cores + int(layout.sparse_core_shard_rotation)) % cores
        return shards[core, int(layout.sparse_core_shard_row_offset) + ids // cores, :dim]
    return read


def _select(found, paths, prefix, object_path):
    if object_path is not None:
        chosen = [k for k in found if paths[k] == object_path.strip("/")]
        if not chosen:
            raise CheckpointError(f"{prefix!r} holds no TPU embedding object at '{object_path}' (it holds "
                                  f"{[paths[k] or '<root>' for k in found] or 'none'})")
        return chosen[0]
    if len(found) != 1:
        if not found:
            raise CheckpointError(f"{prefix!r} holds no tables of a TensorFlow TPU embedding engine (no object with "
                                  f"a '_variables' dict of tables; its objects: "
                                  f"{sorted(p for p in paths.values() if p)[:12]})")
        raise CheckpointError(f"{prefix!r} holds {len(found)} TPU embedding objects, "
                              f"{[paths[k] or '<root>' for k in found]}: pass object_path= to choose one")
    return found[0]


def load_tf_checkpoint(engine, path, feature_config=None, *, object_path=None, tables_only=False,
                       convert_dtypes=False, step=None) -> str:
    """Replace ``engine``'s tables and slots with those of a checkpoint of TensorFlow's TPU embedding.

    Args:
        engine: an :class:`embedcore.Embedding` (or a drop-in exposing one as ``.engine``).
        path: the checkpoint's prefix (``.../ckpt-3``), or a directory whose ``checkpoint`` file names one.
        feature_config: the configuration (TensorFlow's or embedcore's) the engine was built from, when the
            checkpoint's table names are TensorFlow's and differ from the engine's (unnamed tables).
        object_path: the path of the embedding object in the checkpoint (``"embedding"``,
            ``"model/layer/_tpu_embedding"``), needed only when the checkpoint holds several.
        tables_only: read the tables and leave the slots as they are (a serving checkpoint has none).
        convert_dtypes: round TensorFlow's float32 values to nearest for 16-bit tables or slots (refused
            otherwise).
        step: the engine's ``step`` afterwards (``None`` keeps it; TensorFlow's checkpoints do not store it).

    Everything is checked before anything changes: the checkpoint must hold every table of the engine and
    no other, each of the engine's shape, and (unless ``tables_only``) exactly the engine's slots of each
    table, of the table's shape; values must be finite. Every value is read before the engine changes, so
    a load needs as much free memory as the tables and slots it reads (refused up front otherwise). Returns
    the checkpoint prefix read.
    """
    emb = _engine_of(engine)
    names = _name_map(emb, feature_config)
    reader, prefix = _open(path)
    nodes, paths = _object_graph(reader, prefix)
    obj = _select(_embedding_objects(nodes, paths), paths, prefix, object_path)
    where = f"'{paths[obj] or '<root>'}'"
    stored = _stored_variables(reader, nodes, obj, prefix, where)

    problems, plan = [], []
    missing = sorted(n for n in names.values() if n not in stored)
    if missing:
        problems.append(f"no table {missing} (it holds {sorted(stored)})")
    extra = sorted(set(stored) - set(names.values()))
    if extra:
        problems.append(f"tables {extra} that the engine does not have (its tables are {sorted(names.values())})")
    tables, slots = emb.embedding_tables, emb.slot_variables
    for own, theirs in names.items():
        if theirs not in stored:
            continue
        label = f"table '{theirs}'" + (f" (the engine's '{own}')" if own != theirs else "")
        found = stored[theirs]
        targets = [(PARAMETERS, label, tables[own])]
        if not tables_only:
            wanted, present = set(slots[own]), set(found) - {PARAMETERS}
            for slot in sorted(wanted - present):
                problems.append(f"{label} has no slot '{slot}' (its slots are {sorted(present)}; tables_only=True "
                                f"reads the tables alone)")
            for slot in sorted(present - wanted):
                problems.append(f"{label} has a slot '{slot}' that the engine's optimizer does not have (its slots "
                                f"are {sorted(wanted)}); build the engine with the checkpoint's optimizer, or pass "
                                f"tables_only=True")
            targets += [(s, f"{label} slot '{s}'", slots[own][s]) for s in slots[own] if s in present]
        for key, what, target in targets:
            source = found[key]
            if source.shape != target.shape:
                problems.append(f"{what} has shape {list(source.shape)}, the engine's has {list(target.shape)}")
            elif np.dtype(source.dtype).kind != "f":
                problems.append(f"{what} holds {np.dtype(source.dtype)}, not floats")
            elif np.dtype(source.dtype) != target.dtype and not convert_dtypes:
                problems.append(f"{what} is stored as {np.dtype(source.dtype)}, the engine's is {target.dtype}; "
                                f"convert_dtypes=True rounds it to nearest")
            else:
                plan.append((own, key, what, source, target.dtype))
    if problems:
        raise CheckpointError(f"TensorFlow checkpoint {prefix!r} ({where}) does not match the engine: "
                              + "; ".join(problems) + " (nothing was changed)")

    # every value is read before the engine changes: as much memory again as the engine's tables and slots
    check_fits(sum(int(np.prod(source.shape)) * np.dtype(dtype).itemsize for *_, source, dtype in plan),
               f"the tables and slots read from {prefix!r}", CheckpointError)
    new_tables, new_slots = {}, {}
    for own, key, what, source, dtype in plan:
        try:
            value = np.ascontiguousarray(source.read(), dtype=dtype)
        except CheckpointError:
            raise
        except Exception as e:  # DataLossError (a checksum or a truncated file), ...
            raise CheckpointError(f"TensorFlow checkpoint {prefix!r}: {what} ({source.where}) cannot be read: "
                                  f"{type(e).__name__}: {str(e).strip()[:300]} (nothing was changed)") from None
        if key == PARAMETERS:
            new_tables[own] = value
        else:
            new_slots.setdefault(own, {})[key] = value
    try:
        emb.set_state(new_tables, new_slots, step)
    except ValueError as e:
        raise CheckpointError(f"TensorFlow checkpoint {prefix!r}: {e}") from None
    return prefix


# -- the live layout: TensorFlow's tracking of an engine's tables and slots ----------------------------------
_CLASSES = None


def _trackable_classes():
    """``(Node, Entry, EngineTrackable)``: made on first use, so that importing this module does not import
    TensorFlow's internals before they are needed."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import tensorflow as tf
    from tensorflow.python.trackable import base

    class Node(base.Trackable):
        """A trackable holding only named children (TensorFlow's ``_variables`` dict and its inner dicts)."""

        def __init__(self, children: dict):
            self._named = dict(children)

        def _trackable_children(self, save_type=base.SaveType.CHECKPOINT, **kwargs):
            return dict(self._named)

        def _lookup_dependency(self, name, cached_dependencies=None):
            return self._named.get(name)

    class Entry(base.Trackable):
        """One table or slot, checkpointed as TensorFlow checkpoints a variable (one ``VARIABLE_VALUE``, float32
        ``[rows, dim]``): saving writes the engine's current rows; restoring stages the value in its
        :class:`EngineTrackable`, which sets the engine's rows once every entry has arrived."""

        def __init__(self, owner, own, key):
            self._owner, self._own, self._key = owner, own, key

        def _serialize_to_tensors(self):
            rows = self._owner.rows(self._own, self._key)
            return {base.VARIABLE_VALUE_KEY: tf.constant(np.array(rows, dtype=np.float32))}

        def _restore_from_tensors(self, restored_tensors):
            self._owner.stage(self._own, self._key, restored_tensors[base.VARIABLE_VALUE_KEY])
            return tf.no_op()

    class EngineTrackable(base.Trackable):
        """TensorFlow's checkpoint layout of ``TPUEmbedding`` over an embedcore engine's live rows.

        The children are TensorFlow's: per table a variable named by the table (``<table>``), one per slot
        (``<table>/<slot>``), and ``_variables``: {table: {``"parameters"``: table, slot: slot}}. Saving writes
        the rows as they are then (float32). Restoring (``tf.train.Checkpoint(...).restore``/``read``) stages
        each value; when every table and slot of the layout has arrived, they are all checked together and
        set through :meth:`embedcore.Embedding.set_state` (wrong shape, NaN/Inf: a
        :class:`~embedcore.CheckpointError` naming the table and slot, and nothing changes). A checkpoint
        holding only some of them (TensorFlow's serving checkpoint has no slots) leaves the rest staged until
        :meth:`flush` (the drop-ins call it before their next use), which sets the ones that arrived. Values
        for 16-bit rows are rounded to nearest if ``convert_dtypes``, refused otherwise.
        """

        def __init__(self, engine_of, names: dict, slots: dict, where: str, convert_dtypes: bool):
            self._engine_of, self._where, self._staged = engine_of, where, {}
            self._convert = bool(convert_dtypes)
            renamed = {own: theirs for own, theirs in names.items() if own != theirs}
            self._renamed = f" (the checkpoint's names of the engine's tables: {renamed})" if renamed else ""
            children, variables = {}, {}
            for own, theirs in names.items():
                table = Entry(self, own, PARAMETERS)
                children[theirs] = table
                variables[theirs] = {PARAMETERS: table}
                for slot in slots.get(own, ()):
                    children[f"{theirs}/{slot}"] = variables[theirs][slot] = Entry(self, own, slot)
            self._expected = {(own, key) for own in names for key in [PARAMETERS, *slots.get(own, ())]}
            children[_VARIABLES] = Node({t: Node(d) for t, d in variables.items()})
            self._named = children

        def _trackable_children(self, save_type=base.SaveType.CHECKPOINT, **kwargs):
            return dict(self._named)

        def _lookup_dependency(self, name, cached_dependencies=None):
            return self._named.get(name)

        def rows(self, own, key) -> np.ndarray:
            emb = self._engine_of()
            return emb.embedding_tables[own] if key == PARAMETERS else emb.slot_variables[own][key]

        def stage(self, own, key, value) -> None:
            self._staged[(own, key)] = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            if set(self._staged) == self._expected:
                self.flush()

        def flush(self) -> None:
            """Set the staged values (all checked first; on a problem none is set, and they are dropped)."""
            if not self._staged:
                return
            staged, self._staged = self._staged, {}
            emb = self._engine_of()
            tables, slots, hint = {}, {}, ""
            for (own, key), value in staged.items():
                like = self.rows(own, key)
                if value.dtype != like.dtype and value.shape == like.shape:
                    if self._convert:
                        value = value.astype(like.dtype)  # TensorFlow's float32 rounded to nearest, 16-bit rows
                    else:
                        hint = " (convert_dtypes=True rounds TensorFlow's float32 to nearest for 16-bit rows)"
                if key == PARAMETERS:
                    tables[own] = value
                else:
                    slots.setdefault(own, {})[key] = value
            try:
                emb.set_state(tables, slots)
            except ValueError as e:
                raise CheckpointError(f"{self._where}: the TensorFlow checkpoint restored does not match the "
                                      f"engine{self._renamed}: {e}{hint}") from None

    _CLASSES = (Node, Entry, EngineTrackable)
    return _CLASSES


def _layout_problems(emb, names: dict, include_slots: bool = True) -> list:
    """Why ``emb``'s tables and slots, under the checkpoint ``names`` (engine name -> TensorFlow name), have
    no TensorFlow form: slots of another shape than their table (row-wise optimizers), a reserved name."""
    tables, slots = emb.embedding_tables, emb.slot_variables
    problems = []
    for own, theirs in names.items():
        if include_slots:
            for slot, rows in slots[own].items():
                if rows.shape != tables[own].shape:
                    problems.append(f"table '{own}' slot '{slot}' has shape {list(rows.shape)}, not the table's "
                                    f"{list(tables[own].shape)}: TensorFlow's TPU embedding slots are "
                                    f"[vocabulary_size, dim] (include_slots=False writes the tables alone)")
        if theirs == _VARIABLES:
            problems.append(f"table '{theirs}': the name {theirs!r} is reserved by TensorFlow's trackables")
    return problems


def engine_trackable(engine_of, names: dict, slots: dict, where: str, *, convert_dtypes: bool = False):
    """An ``EngineTrackable`` (see :func:`_trackable_classes`) over ``engine_of()``'s tables (engine name ->
    TensorFlow name in ``names``) and ``slots`` (engine table name -> slot names); ``where`` starts its
    error messages."""
    return _trackable_classes()[2](engine_of, names, slots, where, convert_dtypes)


def as_trackable(engine, feature_config=None, *, include_slots=True, convert_dtypes=False):
    """A trackable laid out as TensorFlow's ``TPUEmbedding`` tracks its tables and slots, over ``engine``'s
    live rows: put it in a ``tf.train.Checkpoint`` in the place of the TensorFlow engine
    (``tf.train.Checkpoint(model=model, embedding=as_trackable(emb))``), and TensorFlow's ``TPUEmbedding`` /
    ``TPUEmbeddingForServing`` restores what it saves; restoring a TensorFlow checkpoint through it sets the
    engine's rows (all checked first; see ``EngineTrackable``; ``.flush()`` sets a partial restore).

    The rows are written as they are when the checkpoint is saved (float32). ``feature_config`` (the
    configuration the TensorFlow engine is built from) gives the tables TensorFlow's names, as in
    :func:`load_tf_checkpoint`. Slots of one value per row (``slot_dims`` 1, the row-wise optimizers) have no
    TensorFlow counterpart and are refused; ``include_slots=False`` tracks the tables alone (what
    TensorFlow's serving needs). ``convert_dtypes``: as in :func:`load_tf_checkpoint`, for restores.
    """
    emb = _engine_of(engine)
    names = _name_map(emb, feature_config)
    problems = _layout_problems(emb, names, include_slots)
    if problems:
        raise CheckpointError("cannot write a TensorFlow checkpoint: " + "; ".join(problems))
    slots = {own: list(emb.slot_variables[own]) for own in names} if include_slots else {}
    return engine_trackable(lambda: emb, names, slots, "embedcore engine", convert_dtypes=convert_dtypes)


def save_tf_checkpoint(engine, path, feature_config=None, *, include_slots=True, attribute="embedding") -> str:
    """Write ``engine``'s tables and slots as the TensorFlow checkpoint ``path`` (a prefix), as
    ``tf.train.Checkpoint(**{attribute: tpu_embedding}).write(path)`` would; returns the prefix written.

    Restore it in TensorFlow with ``tf.train.Checkpoint(embedding=tpu_embedding).restore(path)``. See
    :func:`as_trackable` for ``feature_config`` and ``include_slots``; ``step`` is not written.
    """
    import tensorflow as tf
    if not isinstance(attribute, str) or not attribute:
        raise CheckpointError(f"attribute must be a non-empty string, got {attribute!r}")
    holder = as_trackable(engine, feature_config, include_slots=include_slots)
    return tf.train.Checkpoint(**{attribute: holder}).write(os.fspath(path))
