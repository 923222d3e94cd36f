"""Random sequences of lookups and updates on engines mixing static and dynamic tables, checked step by step
against the dict model of ``tests/test_dynamic_tables.py`` (:class:`Model`, :class:`Run`) and the NumPy
optimizer oracle of ``tests/reference.py``.

Each example builds one engine: two dynamic tables (capacities 1 .. 8 and, for the one a single feature reads, 1 ..
3, so eviction and refusal happen all the time; admission ``min_count`` 1 .. 3; eviction None, LRU, LFU, TTL or
EvictByScore, with its default reserve or a reserve of 0.4 of the capacity) read by a pooled and a sequence feature
and a pooled one, and a static table, all under one optimizer the oracle knows (every lazy built-in of
``tests/test_optimizers.CASES`` and a CustomOptimizer). Every step renders each feature's samples in a random input
form (``tests/fuzz_strategies.make_leaf``: lists, flat lists, ragged, sparse in shuffled COO order, dense, in int64,
uint64 or a narrower dtype that holds the keys, any memory layout; Python lists may give a negative key as its
unsigned int) with or without weights, from a pool of extreme keys (0, -1, 2**63 - 1, -2**63, ...), duplicates and
empty samples and batches included. After each step: activations, every table's rows and slots (:meth:`Run.check`:
keys held, ``len <= capacity``), the view of every pool key (held: its row; else its initial value) and membership.
A refused lookup must name a refusing table and change nothing (:func:`engine_state` before and after); a context
looked up before a later lookup evicted or expired rows must be refused, changing nothing. Now and then the static
table refuses the batch (an id beyond its vocabulary), after the dynamic tables planned (and counted) theirs.

A second test runs every input form, dtype, layout and weight mode of ``tests/fuzz_strategies.leaf_st`` through
twin engines, one over a static table and one over a dynamic table that never evicts, which must agree bit for
bit.

``EMBEDCORE_FUZZ_EXAMPLES`` scales the number of examples (as for ``tests/test_fuzz.py``).
"""

import numpy as np
from hypothesis import event, given
from hypothesis import strategies as st

import embedcore as ec

from .fuzz_strategies import ARRAY_LAYOUTS, INT_DTYPES, FeatureSpec, gradient_st, leaf_st, make_leaf
from .test_dynamic_tables import (EXTREME, HIGH, LOW, OPTIMIZERS, SEED, Model, Run, engine_state,
                                  static_model, uniform_initial)
from .test_fuzz import fuzz

DIM = 3
STATIC_VOCAB = 6
POOL = EXTREME + [3, -3]          # signed keys; their unsigned forms are the same keys
M = (1 << 64) - 1


def score(row, last_seen, count, step):
    """EvictByScore's function: rows seen often, lately and with a large first value stay."""
    return float(count) + 0.5 * (last_seen - step) + row[0]


EVICTIONS = {"none": None, "lru": ec.LRU(), "lfu": ec.LFU(), "ttl1": ec.TTL(steps=1), "ttl2": ec.TTL(steps=2),
             "score": ec.EvictByScore(score), "score_reserve": ec.EvictByScore(score, reserve=0.4)}
COMBINERS = ("sum", "mean", "sqrtn")
POOLED_FORMS = ("lists", "flat_list", "ragged", "sparse", "dense", "dense1d")
SEQUENCE_FORMS = ("lists", "ragged", "sparse", "dense")  # 1-D ids of a sequence feature are pooled


@st.composite
def dynamic_table(draw, name, capacities):
    capacity = draw(st.sampled_from(capacities))
    min_count = draw(st.integers(1, 3))
    eviction = draw(st.sampled_from(sorted(EVICTIONS)))
    combiner = draw(st.sampled_from(COMBINERS))
    admission = ec.CountAdmission(min_count=min_count, sketch_width=4096) if min_count > 1 else None
    config = ec.DynamicTableConfig(DIM, capacity, name=name, initializer=ec.RandomUniform(LOW, HIGH),
                                   combiner=combiner, admission=admission, eviction=EVICTIONS[eviction])
    return config, min_count


def build(optimizer_name, u, v, static_combiner, seq_len):
    """The engine, its :class:`Run` and the features' ``(table, seq_len)``."""
    optimizer, update, params, lr, _ = OPTIMIZERS[optimizer_name]
    static = ec.TableConfig(STATIC_VOCAB, DIM, name="s", initializer=ec.RandomUniform(LOW, HIGH),
                            combiner=static_combiner)
    (u_config, u_count), (v_config, v_count) = u, v
    features = {"a": ec.FeatureConfig(u_config), "b": ec.FeatureConfig(u_config, max_sequence_length=seq_len),
                "c": ec.FeatureConfig(v_config), "d": ec.FeatureConfig(static)}
    emb = ec.Embedding(features, optimizer, seed=SEED)
    slot_values = [float(x) for x in optimizer.slot_initializers]
    models = {config.name: Model(config.capacity, uniform_initial(config.name, DIM), slot_values, min_count=count,
                                 eviction=config.eviction)
              for config, count in ((u_config, u_count), (v_config, v_count))}
    models["s"] = static_model(emb, "s")
    layout = {"a": ("u", 0), "b": ("u", seq_len), "c": ("v", 0), "d": ("s", 0)}
    updates = {table: (update, params, lr) for table in models}
    return emb, Run(emb, models, layout, updates), layout


def fitting_dtypes(samples):
    """The integer dtypes that give every key of ``samples`` its own bits: those holding every value, and
    uint64 (a negative key wraps to its unsigned form, the same key)."""
    flat = [k for s in samples for k in s]
    fits = [d for d in INT_DTYPES if all(np.iinfo(d).min <= k <= np.iinfo(d).max for k in flat)]
    return sorted(set(fits) | {np.uint64}, key=lambda d: np.dtype(d).str)


@st.composite
def feature_batch(draw, pool, forms, batch_size):
    """``(samples, rendering)``: signed keys per sample, and how :func:`render` gives them to the engine."""
    form = draw(st.sampled_from(forms))
    if form in ("flat_list", "dense1d"):
        lengths = [1] * batch_size
    elif form == "dense":
        lengths = [draw(st.integers(0, 3))] * batch_size
    else:
        lengths = draw(st.lists(st.integers(0, 3), min_size=batch_size, max_size=batch_size))
    samples = [draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)) for n in lengths]
    options = dict(id_dtype=draw(st.sampled_from(fitting_dtypes(samples))),
                   id_layout=draw(st.sampled_from(ARRAY_LAYOUTS)), w_layout=draw(st.sampled_from(ARRAY_LAYOUTS)),
                   inner=draw(st.sampled_from(["list", "tuple", "array"])), gaps=draw(st.booleans()),
                   extra_width=draw(st.integers(0, 2)), perm_seed=draw(st.integers(0, 2 ** 16)))
    unsigned = draw(st.booleans())  # Python lists: negative keys as their unsigned ints
    return samples, (form, options, unsigned)


def render(renderings, sequence_features):
    def to_engine(feature, samples, weights):
        form, options, unsigned = renderings[feature]
        options = dict(options, gaps=options["gaps"] and feature not in sequence_features)
        leaf = make_leaf(samples, weights, form, **options)
        ids = leaf.ids
        if form == "lists" and options["inner"] == "list" and unsigned:
            ids = [[k & M for k in sample] for sample in ids]
        return ids, leaf.weights
    return to_engine


def check_views(emb, run, tables=("u", "v")):
    """Every pool key reads its row when held, else its initial value; membership agrees."""
    keys = np.array(POOL, np.int64)
    for table in tables:
        model, view = run.models[table], emb.embedding_tables[table]
        held = set(model.held(emb.step))
        expected = np.stack([model.rows[k & M][0] if k in held else model.initial(k & M) for k in POOL])
        np.testing.assert_allclose(view[keys], expected, rtol=2e-5, atol=2e-5, err_msg=f"view of {table}")
        np.testing.assert_allclose(view[keys.view(np.uint64)], view[keys], rtol=0, atol=0)
        assert [k in view for k in POOL] == [k in held for k in POOL], f"membership in {table}"


@fuzz(40)
@given(optimizer=st.sampled_from(sorted(OPTIMIZERS)), u=dynamic_table("u", (1, 2, 3, 4, 8)),
       v=dynamic_table("v", (1, 2, 3)),
       static_combiner=st.sampled_from(COMBINERS), seq_len=st.integers(1, 3), data=st.data())
def test_random_sequences_on_mixed_engines_match_the_model(optimizer, u, v, static_combiner, seq_len, data):
    emb, run, layout = build(optimizer, u, v, static_combiner, seq_len)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16), label="rng seed"))
    pending = None  # (activations, context, removals then) of a lookup whose gradients were never applied
    for _ in range(data.draw(st.integers(4, 7), label="steps")):
        batch_size = data.draw(st.integers(0, 4), label="batch size")
        batch, renderings = {}, {}
        # each dynamic table's keys this step: a few of the pool, so a table of a few rows takes some batches
        # and evicts as the keys in use change
        pools = {t: data.draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=3, unique=True), label=t)
                 for t in ("u", "v")}
        pools["s"] = list(range(STATIC_VOCAB))
        for feature, (table, seq) in layout.items():
            pool = pools[table]
            batch[feature], renderings[feature] = data.draw(
                feature_batch(pool, SEQUENCE_FORMS if seq else POOLED_FORMS, batch_size), label=feature)
        if batch_size and data.draw(st.integers(0, 7), label="bad static id") == 0:
            # the static table refuses the batch after the dynamic tables planned theirs: they must undo them
            batch["d"][0] = batch["d"][0][:-1] + [STATIC_VOCAB] if batch["d"][0] else [STATIC_VOCAB]
            renderings["d"] = ("lists", dict(renderings["d"][1], inner="list"), False)
        run.render = render(renderings, {"b"})
        weighted = data.draw(st.booleans(), label="weighted")
        if data.draw(st.integers(0, 4), label="look up only") == 0:
            result = run.step(batch, rng, weighted=weighted, apply=False)
            # the removals its own lookup made (TTL) leave it current; a refused lookup may expire rows in some
            # tables only (those planned before the one refusing): staleness after it is not modelled
            pending = None if result is False else result + ({t: run.models[t].removals for t in ("u", "v")},)
            continue
        accepted = run.step(batch, rng, weighted=weighted)
        event("lookup refused" if not accepted else "lookup accepted")
        check_views(emb, run)
        if not accepted:
            pending = None  # as above
        elif pending is not None:
            acts, ctx, then = pending
            stale = [t for t in then if run.models[t].removals != then[t]]
            if stale:
                before = engine_state(emb)
                grads = {f: np.ones(a.shape, np.float32) for f, a in acts.items()}
                try:
                    emb.apply_gradients(grads, ctx)
                    raise AssertionError("a context older than an eviction was applied")
                except ec.InputError as error:
                    assert "evicted or expired rows" in str(error) and any(f"table '{t}'" in str(error)
                                                                           for t in stale)
                assert engine_state(emb) == before
                event("stale context refused")
            pending = None
    for table in run.models:
        run.check(table)
    for table in ("u", "v"):
        model = run.models[table]
        event(f"{table}: {'evicted or expired' if model.removals else 'nothing removed'}")
        event(f"{table}: {'filled' if model.filled else 'never full'}")


# -- a dynamic table that never evicts is a static table -----------------------------------------------------
VOCAB = 40
EQUIVALENT_FEATURES = {"pooled": 0, "sequence": 3}


def twin_engines(combiner, optimizer):
    """The same features over a static table of ``VOCAB`` rows and over a dynamic one of ``VOCAB`` keys that
    admits every key and never needs to evict; ``RowId`` gives both the same initial rows."""
    static = ec.TableConfig(VOCAB, DIM, name="t", initializer=ec.RowId(0.0), combiner=combiner)
    dynamic = ec.DynamicTableConfig(DIM, VOCAB, name="t", initializer=ec.RowId(0.0), combiner=combiner)
    return [ec.Embedding({f: ec.FeatureConfig(t, max_sequence_length=L) for f, L in EQUIVALENT_FEATURES.items()},
                         optimizer, seed=SEED) for t in (static, dynamic)]


def outcome(call):
    try:
        return call(), None
    except Exception as error:  # compared between the twins
        return None, (type(error), str(error))


@fuzz(30)
@given(combiner=st.sampled_from(COMBINERS), optimizer=st.sampled_from(["adagrad", "ftrl", "custom-adagrad"]),
       data=st.data())
def test_a_dynamic_table_that_never_evicts_gives_what_the_static_table_gives(combiner, optimizer, data):
    """Every input form, dtype, layout and weight mode of ``tests/fuzz_strategies.leaf_st`` (sparse positions
    with gaps, huge valencies and extreme weights included): bit-identical activations, rows, slots, errors."""
    static, dynamic = twin_engines(combiner, OPTIMIZERS[optimizer][0])
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        batch_size = data.draw(st.integers(0, 5), label="batch size")
        leaves = {f: data.draw(leaf_st(FeatureSpec(f, f, "t", VOCAB, DIM, combiner, L), batch_size), label=f)
                  for f, L in EQUIVALENT_FEATURES.items()}
        ids = {f: leaf.ids for f, leaf in leaves.items()}
        weights = {f: leaf.weights for f, leaf in leaves.items()}
        (acts, ctx), error = outcome(lambda: static(ids, weights))
        (d_acts, d_ctx), d_error = outcome(lambda: dynamic(ids, weights)) if error is None else ((None, None), None)
        assert d_error == error
        if error is not None:
            continue
        for f in acts:
            np.testing.assert_array_equal(d_acts[f], acts[f], err_msg=f"activations of {f}")
        grads = {f: data.draw(gradient_st(a.shape), label=f"gradient {f}")[0] for f, a in acts.items()}
        assert outcome(lambda: dynamic.apply_gradients(grads, d_ctx))[1] == outcome(
            lambda: static.apply_gradients(grads, ctx))[1]
        keys = np.arange(VOCAB)
        assert dynamic.embedding_tables["t"][keys].tobytes() == static.embedding_tables["t"].tobytes()
        for name, slot in static.slot_variables["t"].items():
            assert dynamic.slot_variables["t"][name][keys].tobytes() == slot.tobytes(), name
