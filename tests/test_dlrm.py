"""The NumPy DLRM, its layers and dense optimizers: gradients against finite differences, the loss, training,
optimizer formulas and checkpoints."""

import math

import numpy as np
import pytest

from embedcore.app.models import DLRM, MLP, SGD, Adagrad, Adam, Linear, bce_with_logits, sigmoid

# (n_dense, number of features, dim, bottom, top, batch)
SHAPES = [
    (0, 3, 4, (5,), (6,), 5),
    (3, 2, 4, (5,), (7, 3), 6),
    (2, 1, 3, (), (), 4),
    (4, 4, 2, (3, 4), (5,), 3),
]


def names_for(n_features):
    return [f"f{i}" for i in range(n_features)]


def random_inputs(rng, n_dense, names, dim, batch, dtype=np.float64):
    dense = rng.standard_normal((batch, n_dense)).astype(dtype) if n_dense else None
    embeddings = {name: rng.standard_normal((batch, dim)).astype(dtype) for name in names}
    return dense, embeddings


def randomize_parameters(model, rng, scale=0.5):
    """Nonzero biases and weights of order one, so every path of the gradient is exercised."""
    for array in model.parameters().values():
        array[...] = rng.standard_normal(array.shape) * scale


def numerical_gradient(f, array, eps=1e-6):
    """Central differences of the scalar ``f()`` with respect to every entry of ``array`` (changed in place,
    then restored)."""
    grad = np.zeros_like(array)
    for idx in np.ndindex(array.shape):
        saved = array[idx]
        array[idx] = saved + eps
        plus = f()
        array[idx] = saved - eps
        minus = f()
        array[idx] = saved
        grad[idx] = (plus - minus) / (2 * eps)
    return grad


# ---------------------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("n_dense, n_features, dim, bottom, top, batch", SHAPES)
def test_gradients_match_finite_differences(n_dense, n_features, dim, bottom, top, batch):
    rng = np.random.default_rng(n_dense * 10 + n_features)
    names = names_for(n_features)
    model = DLRM(n_dense, names, dim, bottom=bottom, top=top, seed=1, dtype=np.float64)
    randomize_parameters(model, rng)
    dense, embeddings = random_inputs(rng, n_dense, names, dim, batch)
    weights = rng.standard_normal(batch)          # objective: sum_b weights_b * logit_b

    def objective():
        return float(weights @ model.forward(dense, embeddings)[0])

    _, cache = model.forward(dense, embeddings)
    d_embeddings = {k: v.copy() for k, v in model.backward(cache, weights).items()}
    gradients = {k: v.copy() for k, v in model.gradients().items()}
    assert list(d_embeddings) == names
    assert set(gradients) == set(model.parameters())
    for name, param in model.parameters().items():
        np.testing.assert_allclose(gradients[name], numerical_gradient(objective, param), rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    for name in names:
        np.testing.assert_allclose(d_embeddings[name], numerical_gradient(objective, embeddings[name]),
                                   rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("n_dense, n_features, dim, bottom, top, batch", SHAPES)
def test_float32_model_agrees_with_float64(n_dense, n_features, dim, bottom, top, batch):
    rng = np.random.default_rng(7)
    names = names_for(n_features)
    single = DLRM(n_dense, names, dim, bottom=bottom, top=top, seed=3)
    double = DLRM(n_dense, names, dim, bottom=bottom, top=top, seed=3, dtype=np.float64)
    randomize_parameters(single, rng)
    double.load_state_dict(single.state_dict())
    dense, embeddings = random_inputs(rng, n_dense, names, dim, batch, dtype=np.float32)
    d_logits = rng.standard_normal(batch)

    logits32, cache32 = single.forward(dense, embeddings)
    logits64, cache64 = double.forward(dense, embeddings)
    assert logits32.dtype == np.float32 and logits32.shape == (batch,)
    np.testing.assert_allclose(logits32, logits64, rtol=1e-4, atol=1e-5)
    d32, d64 = single.backward(cache32, d_logits), double.backward(cache64, d_logits)
    for name in names:
        assert d32[name].dtype == np.float32 and d32[name].shape == (batch, dim)
        assert d32[name].flags.c_contiguous
        np.testing.assert_allclose(d32[name], d64[name], rtol=1e-4, atol=1e-5)
    g32, g64 = single.gradients(), double.gradients()
    for name in g32:
        assert g32[name].dtype == np.float32
        np.testing.assert_allclose(g32[name], g64[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_mlp_input_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    for final in (None, "relu"):
        mlp = MLP((4, 6, 3), final_activation=final, rng=rng, dtype=np.float64)
        for array in mlp.parameters().values():
            array[...] = rng.standard_normal(array.shape)
        x = rng.standard_normal((5, 4))
        w = rng.standard_normal((5, 3))
        out, cache = mlp.forward(x)
        dx = mlp.backward(cache, w)
        np.testing.assert_allclose(dx, numerical_gradient(lambda: float(np.sum(w * mlp.forward(x)[0])), x),
                                   rtol=1e-6, atol=1e-8)
        if final == "relu":
            assert out.min() >= 0


def test_forward_matches_a_per_sample_reference():
    """Logits from an explicit loop over samples and pairs: the bottom output first, then the features in
    ``feature_names`` order; the pairs (i < j) in row-major order after the bottom output."""
    rng = np.random.default_rng(5)
    names = ["user", "item", "ad"]
    model = DLRM(3, names, 4, bottom=(5,), top=(6,), seed=2, dtype=np.float64)
    randomize_parameters(model, rng)
    dense, embeddings = random_inputs(rng, 3, names, 4, 4)
    params = model.parameters()

    def relu(v):
        return np.maximum(v, 0)

    expected = []
    for b in range(4):
        z = relu(relu(dense[b] @ params["bottom.0.weight"] + params["bottom.0.bias"])
                 @ params["bottom.1.weight"] + params["bottom.1.bias"])
        vectors = [z] + [embeddings[name][b] for name in names]
        pairs = [np.dot(vectors[i], vectors[j]) for i in range(4) for j in range(i + 1, 4)]
        h = relu(np.concatenate([z, pairs]) @ params["top.0.weight"] + params["top.0.bias"])
        expected.append((h @ params["top.1.weight"] + params["top.1.bias"])[0])
    np.testing.assert_allclose(model.forward(dense, embeddings)[0], expected, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# loss


def test_bce_matches_the_direct_formula():
    rng = np.random.default_rng(0)
    logits = rng.uniform(-6, 6, 50)
    for labels in (rng.integers(0, 2, 50).astype(np.float64), rng.uniform(0, 1, 50)):
        s = 1 / (1 + np.exp(-logits))
        loss, d = bce_with_logits(logits, labels)
        assert isinstance(loss, float)
        assert loss == pytest.approx(np.mean(-labels * np.log(s) - (1 - labels) * np.log(1 - s)), rel=1e-12)
        np.testing.assert_allclose(d, (s - labels) / 50, rtol=1e-12, atol=1e-15)
        x = logits.copy()
        np.testing.assert_allclose(d, numerical_gradient(lambda: bce_with_logits(x, labels)[0], x),
                                   rtol=1e-6, atol=1e-10)
    loss32, d32 = bce_with_logits(logits.astype(np.float32), labels)
    assert d32.dtype == np.float32 and loss32 == pytest.approx(bce_with_logits(logits, labels)[0], rel=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bce_is_stable_for_large_logits(dtype):
    logits = np.array([100, -100, 100, -100, 0, 1000, -1000], dtype)
    labels = np.array([1, 1, 0, 0, 1, 1, 1], dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss, d = bce_with_logits(logits, labels)
        probabilities = sigmoid(logits)
    per_sample = np.array([0, 100, 100, 0, math.log(2), 0, 1000])
    assert loss == pytest.approx(per_sample.mean(), rel=1e-6)
    np.testing.assert_allclose(d, np.array([0, -1, 1, 0, -0.5, 0, -1]) / 7, atol=1e-7)
    np.testing.assert_allclose(probabilities, [1, 0, 1, 0, 0.5, 1, 0], rtol=1e-7, atol=1e-30)
    assert probabilities[1] > 0 and probabilities.dtype == dtype
    assert np.isfinite(d).all() and d.dtype == dtype


def test_bce_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        bce_with_logits(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError):
        bce_with_logits(np.zeros((3, 1)), np.zeros((3, 1)))


# ---------------------------------------------------------------------------------------------------------
# training


def planted_problem(seed=0, batch=512, dim=8):
    """Fixed random embeddings; label = [e_user . e_item + dense_0 > 0]."""
    rng = np.random.default_rng(seed)
    tables = {name: rng.standard_normal((40, dim)).astype(np.float32) / math.sqrt(dim)
              for name in ("user", "item", "noise")}
    ids = {name: rng.integers(0, 40, batch) for name in tables}
    embeddings = {name: tables[name][ids[name]] for name in tables}
    dense = rng.standard_normal((batch, 4)).astype(np.float32)
    score = np.sum(embeddings["user"] * embeddings["item"], axis=1) + 0.5 * dense[:, 0]
    return dense, embeddings, (score > 0).astype(np.float32)


@pytest.mark.parametrize("optimizer", [Adam(0.01), Adagrad(0.05), SGD(0.5)], ids=["adam", "adagrad", "sgd"])
def test_training_lowers_the_loss(optimizer):
    dense, embeddings, labels = planted_problem()
    model = DLRM(4, ["user", "item", "noise"], 8, bottom=(16,), top=(16,), seed=0, dense_optimizer=optimizer)
    losses = []
    for _ in range(150):
        logits, cache = model.forward(dense, embeddings)
        loss, d_logits = bce_with_logits(logits, labels)
        model.backward(cache, d_logits)
        model.step()
        losses.append(loss)
    assert losses[-1] < 0.5 * losses[0]
    accuracy = np.mean((model.predict(dense, embeddings) > 0.5) == labels)
    assert accuracy > 0.85


def test_step_needs_a_backward():
    model = DLRM(2, ["a", "b"], 4, seed=0)
    with pytest.raises(RuntimeError):
        model.step()
    dense, embeddings = random_inputs(np.random.default_rng(0), 2, ["a", "b"], 4, 3)
    _, cache = model.forward(dense, embeddings)
    model.backward(cache, np.ones(3))
    model.step()
    with pytest.raises(RuntimeError):
        model.step()


# ---------------------------------------------------------------------------------------------------------
# dense optimizers


def run_optimizer(optimizer, w0, gradients):
    params = {"w": w0.copy()}
    for g in gradients:
        optimizer.step(params, {"w": g})
    return params["w"]


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-13), (np.float32, 2e-6)])
def test_sgd_adagrad_adam_formulas(dtype, rtol):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(6)
    grads = [rng.standard_normal(6) for _ in range(3)]
    cast = [g.astype(dtype) for g in grads]

    np.testing.assert_allclose(run_optimizer(SGD(0.3), w0.astype(dtype), cast),
                               w0 - 0.3 * sum(grads), rtol=rtol)

    w, acc = w0.copy(), np.full(6, 0.2)
    for g in grads:
        acc = acc + g ** 2
        w = w - 0.1 * g / (np.sqrt(acc) + 1e-6)
    np.testing.assert_allclose(run_optimizer(Adagrad(0.1, initial_accumulator_value=0.2, epsilon=1e-6),
                                             w0.astype(dtype), cast), w, rtol=rtol)

    lr, b1, b2, eps = 0.01, 0.8, 0.95, 1e-6
    w, m, v = w0.copy(), np.zeros(6), np.zeros(6)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps / math.sqrt(1 - b2 ** t))   # Keras' epsilon-hat form
    adam = Adam(lr, beta_1=b1, beta_2=b2, epsilon=eps)
    np.testing.assert_allclose(run_optimizer(adam, w0.astype(dtype), cast), w, rtol=rtol)
    assert adam.iterations == 3


def test_adam_first_step_is_learning_rate_times_sign():
    """With the bias correction, the first update is ``lr * g / (|g| + eps')``: about ``lr * sign(g)``."""
    g = np.array([3.0, -0.5, 1e-2, -40.0])
    w = run_optimizer(Adam(0.02), np.zeros(4), [g])
    np.testing.assert_allclose(w, -0.02 * np.sign(g), rtol=1e-3)


def test_optimizer_state_round_trip_and_checks():
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((3, 2))
    grads = [rng.standard_normal((3, 2)) for _ in range(3)]
    for make in (lambda: SGD(0.1), lambda: Adagrad(0.1), lambda: Adam(0.1)):
        a, params_a = make(), {"w": w0.copy()}
        for g in grads[:2]:
            a.step(params_a, {"w": g})
        state = a.state_dict()
        assert all(isinstance(v, np.ndarray) for v in state.values())
        assert state["step"].tolist() == [2]
        b, params_b = make(), {"w": params_a["w"].copy()}
        b.initialize(params_b)
        b.load_state_dict(state)
        a.step(params_a, {"w": grads[2]})
        b.step(params_b, {"w": grads[2]})
        np.testing.assert_array_equal(params_a["w"], params_b["w"])
        assert state["step"].tolist() == [2]          # a copy, not the live state
        with pytest.raises(ValueError):
            b.initialize({"other": np.zeros(3)})
        with pytest.raises(ValueError):
            b.load_state_dict({**state, "extra": np.zeros(1)})
    adam = Adam()
    adam.initialize({"w": np.zeros(3)})
    with pytest.raises(ValueError):
        adam.load_state_dict({"step": np.array([1]), "momenta.w": np.zeros(4), "velocities.w": np.zeros(3)})
    for bad in (lambda: Adam(-1.0), lambda: Adam(beta_1=1.0), lambda: Adagrad(epsilon=0), lambda: SGD(math.nan)):
        with pytest.raises(ValueError):
            bad()


# ---------------------------------------------------------------------------------------------------------
# checkpoints, determinism, validation


def train_steps(model, rng, n_dense, names, dim, steps, batch=8):
    for _ in range(steps):
        dense, embeddings = random_inputs(rng, n_dense, names, dim, batch, dtype=np.float32)
        labels = rng.integers(0, 2, batch)
        logits, cache = model.forward(dense, embeddings)
        d_embeddings = model.backward(cache, bce_with_logits(logits, labels)[1])
        model.step()
    return d_embeddings


@pytest.mark.parametrize("n_dense", [0, 5])
@pytest.mark.parametrize("make_optimizer", [lambda: Adam(0.01), lambda: Adagrad(0.1), lambda: SGD(0.1)],
                         ids=["adam", "adagrad", "sgd"])
def test_state_dict_round_trip(n_dense, make_optimizer):
    names, dim = ["a", "b", "c"], 4
    a = DLRM(n_dense, names, dim, bottom=(6,), top=(5,), seed=0, dense_optimizer=make_optimizer())
    train_steps(a, np.random.default_rng(0), n_dense, names, dim, steps=3)
    state = a.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert any(k.startswith("optimizer.") for k in state)

    b = DLRM(n_dense, names, dim, bottom=(6,), top=(5,), seed=99, dense_optimizer=make_optimizer())
    dense, embeddings = random_inputs(np.random.default_rng(1), n_dense, names, dim, 8, dtype=np.float32)
    assert not np.array_equal(a.predict(dense, embeddings), b.predict(dense, embeddings))
    b.load_state_dict(state)
    np.testing.assert_array_equal(a.predict(dense, embeddings), b.predict(dense, embeddings))

    d_a = train_steps(a, np.random.default_rng(2), n_dense, names, dim, steps=2)
    d_b = train_steps(b, np.random.default_rng(2), n_dense, names, dim, steps=2)
    for name in names:
        np.testing.assert_array_equal(d_a[name], d_b[name])
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)
    assert not np.array_equal(state["top.0.weight"], state_a["top.0.weight"])   # the checkpoint is a copy


def test_load_state_dict_rejects_mismatches_and_changes_nothing():
    names = ["a", "b"]
    adam_model = DLRM(3, names, 4, seed=0, dense_optimizer=Adam())
    adagrad_model = DLRM(3, names, 4, seed=1, dense_optimizer=Adagrad())
    before = adagrad_model.state_dict()
    with pytest.raises(ValueError):
        adagrad_model.load_state_dict(adam_model.state_dict())
    state = adagrad_model.state_dict()
    with pytest.raises(ValueError):
        adagrad_model.load_state_dict({k: v for k, v in state.items() if k != "top.0.bias"})
    with pytest.raises(ValueError):
        adagrad_model.load_state_dict({**state, "top.0.bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError):
        DLRM(3, names, 8, seed=0).load_state_dict(adam_model.state_dict())
    after = adagrad_model.state_dict()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


def test_deterministic_construction_and_feature_order():
    names = ["c", "a", "b"]
    m1, m2 = DLRM(2, names, 4, seed=5), DLRM(2, names, 4, seed=5)
    assert list(m1.parameters()) == ["bottom.0.weight", "bottom.0.bias", "bottom.1.weight", "bottom.1.bias",
                                     "top.0.weight", "top.0.bias", "top.1.weight", "top.1.bias",
                                     "top.2.weight", "top.2.bias"]
    for key, value in m1.parameters().items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, m2.parameters()[key])
    dense, embeddings = random_inputs(np.random.default_rng(0), 2, names, 4, 5, dtype=np.float32)
    reordered = {name: embeddings[name] for name in sorted(names)}
    logits, cache = m1.forward(dense, embeddings)
    np.testing.assert_array_equal(logits, m1.forward(dense, reordered)[0])
    assert list(m1.backward(cache, np.ones(5))) == names
    assert m1.config()["feature_names"] == names


def test_layer_initialisation():
    rng = np.random.default_rng(0)
    he = Linear(500, 400, rng=rng)
    assert he.weight.dtype == np.float32 and he.weight.shape == (500, 400)
    assert np.std(he.weight) == pytest.approx(math.sqrt(2 / 500), rel=0.02)
    np.testing.assert_array_equal(he.bias, 0)
    glorot = Linear(300, 200, rng=rng, init="glorot")
    limit = math.sqrt(6 / 500)
    assert np.abs(glorot.weight).max() <= limit
    assert np.std(glorot.weight) == pytest.approx(limit / math.sqrt(3), rel=0.02)
    np.testing.assert_array_equal(Linear(3, 2, rng=7).weight, Linear(3, 2, rng=np.random.default_rng(7)).weight)


def test_input_validation():
    with pytest.raises(ValueError):
        DLRM(0, ["only"], 4)                            # nothing to interact
    with pytest.raises(ValueError):
        DLRM(2, ["a", "a"], 4)
    with pytest.raises(ValueError):
        DLRM(2, ["a", "b"], 0)
    model = DLRM(2, ["a", "b"], 4)
    good = {"a": np.zeros((3, 4), np.float32), "b": np.zeros((3, 4), np.float32)}
    dense = np.zeros((3, 2), np.float32)
    for bad_dense, bad_embeddings in [
        (dense, {"a": good["a"]}),                                    # missing feature
        (dense, {**good, "c": good["a"]}),                            # unexpected feature
        (dense, {**good, "b": np.zeros((3, 5), np.float32)}),          # wrong dim
        (dense, {**good, "b": np.zeros((2, 4), np.float32)}),          # batch mismatch
        (None, good),                                                 # dense features missing
        (np.zeros((3, 3), np.float32), good),                         # wrong n_dense
    ]:
        with pytest.raises(ValueError):
            model.forward(bad_dense, bad_embeddings)
    _, cache = model.forward(dense, good)
    with pytest.raises(ValueError):
        model.backward(cache, np.zeros(4))
    no_dense = DLRM(0, ["a", "b"], 4)
    assert no_dense.bottom is None
    assert no_dense.forward(None, good)[0].shape == (3,)
    with pytest.raises(ValueError):
        no_dense.forward(dense, good)
