"""The JAX adapter against a dense JAX reference: same model, same tables, gradients through jnp.take.

The reference holds every table as a dense jax array, looks features up with ``jnp.take`` and per-id gains
(combiner weights computed by the NumPy oracle), differentiates the same loss with ``jax.grad`` with respect
to the tables and the dense parameters, and applies SGD / TF-style Adagrad to the whole dense table (rows a
batch did not touch get a zero gradient, which leaves them unchanged under both rules, as the engine's lazy
update does).
"""

import sys
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="needs the jax extra: pip install 'embedcore[jax]' (.ci/run installs it)")
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", False)
import jax.numpy as jnp  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore import jax as ecj  # noqa: E402

from . import reference as ref  # noqa: E402
from .harness import assert_unchanged, snapshot  # noqa: E402

B = 6
DIM = 4
SEQ = 3
SGD_LR, ADAGRAD_LR, ACC0 = 0.2, 0.3, 0.1
# Shared optimizer instances: equal optimizers reuse the compiled kernels across Embeddings.
SGD = ec.SGD(SGD_LR)
ADAGRAD = ec.Adagrad(ADAGRAD_LR, initial_accumulator_value=ACC0)
RULES = {"user": "sgd", "item": "adagrad", "country": "sgd"}


def make_emb():
    """user: SGD, sum; country: SGD, sum, plain [B] ids (each the only feature of its physical table, so
    its gradient is read in place); item: Adagrad, mean, shared by a pooled and a sequence feature (their
    gradients are copied into the engine's workspace).

    Every table has the same ``dim`` and the tests keep to two kernel variants (SGD with read-only, Adagrad
    with writable gradients): each (optimizer, dim, variant) costs seconds of Numba compilation."""
    user = ec.TableConfig(12, DIM, name="user", combiner="sum", optimizer=SGD, initializer=ec.RandomUniform(-1, 1))
    item = ec.TableConfig(10, DIM, name="item", combiner="mean", initializer=ec.RandomUniform(-1, 1))
    country = ec.TableConfig(5, DIM, name="country", combiner="sum", optimizer=SGD,
                             initializer=ec.RandomUniform(-1, 1))
    features = {"user": ec.FeatureConfig(user), "items": ec.FeatureConfig(item),
                "history": ec.FeatureConfig(item, max_sequence_length=SEQ), "country": ec.FeatureConfig(country)}
    return ec.Embedding(features, ADAGRAD, seed=3, stack_tables=False)


FEATURE_TABLE = {"user": "user", "items": "item", "history": "item", "country": "country"}


def random_batch(rng, batch_size=B):
    """Engine inputs (lists, Ragged, dense [B]), weights, and the reference's padded (ids, gains) per feature."""
    def multi_hot(vocab, max_len):
        samples = [[int(x) for x in rng.integers(0, vocab, rng.integers(0, max_len + 1))] for _ in range(batch_size)]
        samples[0] = samples[0][:1] * 3 if samples[0] else [1, 1, 1]   # duplicates within a sample
        return samples, [[float(w) for w in rng.uniform(0.2, 2.0, len(s))] for s in samples]

    user, user_w = multi_hot(12, 4)
    items, items_w = multi_hot(10, 4)
    history, history_w = multi_hot(10, 5)                              # longer than SEQ: truncated
    country = rng.integers(0, 5, batch_size)
    ragged = ec.Ragged.from_lists(items, np.int64)
    ragged_w = ec.Ragged(np.array([w for s in items_w for w in s], np.float32), ragged.row_splits)
    features = {"user": user, "items": ragged, "history": history, "country": country}
    weights = {"user": user_w, "items": ragged_w, "history": history_w,
               "country": np.ones(batch_size, np.float32)}

    def padded(samples, weights, combiner, width):
        ids, gains = np.zeros((batch_size, width), np.int32), np.zeros((batch_size, width), np.float32)
        for b, (s, w) in enumerate(zip(samples, weights)):
            s, w = s[:width], w[:width]
            ids[b, :len(s)] = s
            gains[b, :len(s)] = ref.combine_gains(w, combiner) if combiner else w
        return ids, gains

    dense = {"user": padded(user, user_w, "sum", 4), "items": padded(items, items_w, "mean", 4),
             "history": padded(history, history_w, None, SEQ),
             "country": (country[:, None].astype(np.int32), np.ones((batch_size, 1), np.float32))}
    return features, weights, dense


def dense_lookup(tables, dense):
    acts = {}
    for name, (ids, gains) in dense.items():
        rows = jnp.take(tables[FEATURE_TABLE[name]], ids, axis=0)          # [B, K, dim]
        acts[name] = gains[..., None] * rows if name == "history" else jnp.einsum("bk,bkd->bd", gains, rows)
    return acts


def loss_fn(params, acts, batch):
    x = jnp.concatenate([acts["user"], acts["items"], acts["history"].reshape(acts["history"].shape[0], -1),
                         acts["country"]], axis=1)
    logits = x @ params["w"] + params["b"]
    return jnp.mean(jax.nn.softplus(logits) - batch["label"] * logits)


def initial_params(rng):
    return {"w": jnp.asarray(rng.normal(0, 0.5, DIM * (3 + SEQ)), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def reference_state(emb, params):
    """Dense tables, Adagrad accumulators, dense parameters and Adam moments, all as jax arrays."""
    tables = {n: jnp.array(t) for n, t in emb.embedding_tables.items()}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"tables": tables, "params": params, "m": zeros, "v": zeros, "t": jnp.zeros((), jnp.float32),
            "acc": {n: jnp.full(t.shape, ACC0, jnp.float32) for n, t in tables.items() if RULES[n] == "adagrad"}}


@partial(jax.jit, static_argnames="dense_rule")
def reference_step(state, dense, batch, dense_rule):
    """One dense training step: ``(activations, loss, new_state)``, the gradients by jax.grad through jnp.take."""
    def loss_of(tables, params):
        acts = dense_lookup(tables, dense)
        return loss_fn(params, acts, batch), acts

    (loss, acts), (g_tables, g_params) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
        state["tables"], state["params"])
    tables, acc = dict(state["tables"]), dict(state["acc"])
    for name, g in g_tables.items():
        if RULES[name] == "sgd":
            tables[name] = tables[name] - SGD_LR * g
        else:
            acc[name] = acc[name] + g * g
            tables[name] = tables[name] - ADAGRAD_LR * g / jnp.sqrt(acc[name])
    t = state["t"] + 1
    params, m, v = dict(state["params"]), dict(state["m"]), dict(state["v"])
    for k, g in g_params.items():
        if dense_rule == "sgd":
            params[k] = params[k] - 0.1 * g
        else:  # Adam, written out
            m[k] = 0.9 * m[k] + 0.1 * g
            v[k] = 0.999 * v[k] + 0.001 * g * g
            m_hat, v_hat = m[k] / (1 - 0.9 ** t), v[k] / (1 - 0.999 ** t)
            params[k] = params[k] - 0.05 * m_hat / (jnp.sqrt(v_hat) + 1e-8)
    return acts, loss, {"tables": tables, "acc": acc, "params": params, "m": m, "v": v, "t": t}


def assert_close(actual, expected, what):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=2e-5, atol=2e-6, err_msg=what)


def read_only(arrays):
    """NumPy gradients flagged read-only, like views of jax arrays (and so the same compiled kernels)."""
    for a in arrays.values():
        a.flags.writeable = False
    return arrays






@pytest.mark.parametrize("dense_rule", ["sgd", "adam"])
def test_training_matches_dense_jax_reference(dense_rule):
    rng = np.random.default_rng(7)
    emb = make_emb()
    params = initial_params(rng)
    state = reference_state(emb, params)
    # adam is passed as a plain (init, update) tuple: any optax-style pair works
    dense_opt = ecj.sgd(0.1) if dense_rule == "sgd" else tuple(ecj.adam(0.05))
    traces = []

    def counted_loss(params, acts, batch):
        traces.append(1)
        return loss_fn(params, acts, batch)

    train_step = ecj.make_train_step(counted_loss, dense_opt)
    opt_state = dense_opt[0](params)
    losses = []
    for step in range(5):
        features, weights, dense = random_batch(rng)
        batch = {"label": (rng.random(B) < 0.5).astype(np.float32)}
        acts, ctx = ecj.lookup(emb, features, weights)
        assert all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in acts.values())
        assert acts["history"].shape == (B, SEQ, DIM) and acts["user"].shape == (B, DIM)
        expected_acts, expected_loss, state = reference_step(state, dense, batch, dense_rule)
        for name, expected in expected_acts.items():
            assert_close(acts[name], expected, f"step {step}: activations of {name}")

        loss, params, opt_state, d_acts = train_step(params, opt_state, acts, batch)
        assert all(isinstance(g, jax.Array) for g in d_acts.values())
        ecj.apply_gradients(emb, d_acts, ctx)
        losses.append(float(loss))

        assert emb.step == step + 1
        assert_close(loss, expected_loss, f"step {step}: loss")
        for k in params:
            assert_close(params[k], state["params"][k], f"step {step}: dense param {k}")
        for name, table in emb.embedding_tables.items():
            assert_close(table, state["tables"][name], f"step {step}: table {name}")
            if name in state["acc"]:
                assert_close(emb.slot_variables[name]["accumulators"], state["acc"][name],
                             f"step {step}: accumulators of {name}")
    assert len(traces) == 1, "fixed batch shapes must trace the jitted step once"
    assert np.all(np.isfinite(losses))


def test_train_step_traces_once_per_batch_shape_and_frozen_dense_params():
    rng = np.random.default_rng(1)
    emb = make_emb()
    params = initial_params(rng)
    traces = []

    def counted_loss(params, acts, batch):
        traces.append(jax.tree_util.tree_map(lambda a: a.shape, acts)["user"])
        return loss_fn(params, acts, batch)

    train_step = ecj.make_train_step(counted_loss)          # no dense optimizer: dense params frozen
    for batch_size in (B, B, 4, B, 4, B):
        features, weights, _ = random_batch(rng, batch_size)
        acts, ctx = ecj.lookup(emb, features, weights)
        loss, new_params, state, d_acts = train_step(params, None, acts, {"label": np.ones(batch_size, np.float32)})
        assert state is None
        for k in params:
            np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(params[k]))
        ecj.apply_gradients(emb, d_acts, ctx)
    assert traces == [(B, DIM), (4, DIM)]
    assert emb.step == 6
    with pytest.raises(TypeError, match="init, update"):
        ecj.make_train_step(loss_fn, 0.1)


def test_gradients_are_read_in_place_and_never_written():
    rng = np.random.default_rng(2)
    emb = make_emb()
    features, weights, _ = random_batch(rng)
    acts, ctx = ecj.lookup(emb, features, weights)
    grads = {name: jnp.asarray(rng.normal(0, 1, a.shape), jnp.float32) for name, a in acts.items()}
    before = {name: np.array(g) for name, g in grads.items()}
    views = {name: np.asarray(g) for name, g in grads.items()}
    assert not any(v.flags.writeable for v in views.values())      # what the engine receives: read-only
    expected = make_emb()
    acts_np, ctx_np = expected.lookup(features, weights)
    expected.apply_gradients(read_only({name: g.copy() for name, g in before.items()}), ctx_np)

    ecj.apply_gradients(emb, grads, ctx)
    for name, g in grads.items():
        np.testing.assert_array_equal(np.asarray(g), before[name], err_msg=name)
    for name, table in emb.embedding_tables.items():
        np.testing.assert_array_equal(table, expected.embedding_tables[name], err_msg=name)
    with pytest.raises(ec.InputError, match="already applied"):
        ecj.apply_gradients(emb, grads, ctx)


def test_low_precision_gradients_give_their_float32_values_results():
    emb, expected = make_emb(), make_emb()
    features, weights, _ = random_batch(np.random.default_rng(3))
    acts, ctx = ecj.lookup(emb, features, weights)
    _, ctx_np = expected.lookup(features, weights)
    grads = {name: jnp.full(a.shape, 0.375, jnp.bfloat16) for name, a in acts.items()}   # exact in bfloat16
    ecj.apply_gradients(emb, grads, ctx)
    expected.apply_gradients(read_only({name: np.full(a.shape, 0.375, np.float32) for name, a in acts.items()}),
                             ctx_np)
    for name, table in emb.embedding_tables.items():
        np.testing.assert_array_equal(table, expected.embedding_tables[name], err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_activations_and_gradients_round_trip(dtype):
    """An engine with a 16-bit output_dtype gives jax arrays of that dtype; their 16-bit gradients update the
    tables exactly as the float32 copies of those gradients do on a float32-output engine."""
    emb = ec.Embedding(make_emb().feature_config, ADAGRAD, seed=3, stack_tables=False, output_dtype=dtype)
    expected = make_emb()
    features, weights, _ = random_batch(np.random.default_rng(4))
    acts, ctx = ecj.lookup(emb, features, weights)
    acts_np, ctx_np = expected.lookup(features, weights)
    for name, a in acts.items():
        assert a.dtype == jnp.dtype(dtype), name
        np.testing.assert_array_equal(np.asarray(a), acts_np[name].astype(a.dtype), err_msg=name)
    grads = jax.grad(lambda a: sum(jnp.sum(jnp.sin(x.astype(jnp.float32)) * 3) for x in a.values()))(acts)
    assert all(g.dtype == jnp.dtype(dtype) for g in grads.values())
    ecj.apply_gradients(emb, grads, ctx)
    expected.apply_gradients(read_only({name: np.asarray(g).astype(np.float32) for name, g in grads.items()}), ctx_np)
    for name, table in emb.embedding_tables.items():
        np.testing.assert_array_equal(table, expected.embedding_tables[name], err_msg=name)


def test_bad_gradients_raise_input_error_and_leave_tables_unchanged():
    rng = np.random.default_rng(4)
    emb = make_emb()
    features, weights, _ = random_batch(rng)
    acts, ctx = ecj.lookup(emb, features, weights)
    good = {name: jnp.asarray(rng.normal(0, 1, a.shape), jnp.float32) for name, a in acts.items()}
    snap = snapshot(emb)

    nan = dict(good, items=good["items"].at[2, 1].set(jnp.nan))
    with pytest.raises(ec.InputError, match="items.*NaN/Inf"):
        ecj.apply_gradients(emb, nan, ctx)
    assert_unchanged(emb, snap)
    inf = dict(good, history=good["history"].at[0, 0, 0].set(-jnp.inf))
    with pytest.raises(ec.InputError, match="history"):
        ecj.apply_gradients(emb, inf, ctx)
    assert_unchanged(emb, snap)
    wrong_shape = dict(good, user=jnp.zeros((B + 1, DIM), jnp.float32))
    with pytest.raises(ec.InputError, match="user.*shape"):
        ecj.apply_gradients(emb, wrong_shape, ctx)
    assert_unchanged(emb, snap)
    transposed = dict(good, country=good["country"].T)
    with pytest.raises(ec.InputError, match="country.*shape"):
        ecj.apply_gradients(emb, transposed, ctx)
    assert_unchanged(emb, snap)
    with pytest.raises(ec.InputError, match="keys"):
        ecj.apply_gradients(emb, {k: v for k, v in good.items() if k != "user"}, ctx)
    assert_unchanged(emb, snap)
    with pytest.raises(ec.InputError, match="tracer"):
        jax.jit(lambda g: ecj.apply_gradients(emb, g, ctx))(good)
    assert_unchanged(emb, snap)

    ecj.apply_gradients(emb, good, ctx)        # the context is still usable after refused gradients
    assert emb.step == 1


def test_nested_structures_are_mirrored():
    table = ec.TableConfig(6, DIM, name="t", combiner="sum", initializer=ec.RowId())
    emb = ec.Embedding({"a": [ec.FeatureConfig(table), (ec.FeatureConfig(table),)]}, ADAGRAD)
    acts, ctx = ecj.lookup(emb, {"a": [np.array([1, 2]), (np.array([[3, 3], [0, 5]]),)]})
    assert isinstance(acts["a"], list) and isinstance(acts["a"][1], tuple)
    t = emb.embedding_tables["t"]
    np.testing.assert_allclose(np.asarray(acts["a"][1][0]), np.stack([2 * t[3], t[0] + t[5]]), rtol=1e-6)
    grads = jax.grad(lambda a: sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(a)))(acts)
    ecj.apply_gradients(emb, grads, ctx)
    assert emb.step == 1


def test_missing_jax_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)              # makes "import jax" fail
    monkeypatch.delitem(sys.modules, "embedcore.jax")
    with pytest.raises(ImportError, match=r"pip install embedcore\[jax\]"):
        __import__("embedcore.jax")
