"""EmbeddingModule's torch-native inputs: KeyedJaggedTensor, (values, offsets), weights of any float dtype
(issue 29, item 3)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]' (.ci/run installs it)")

import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402

from . import reference as ref  # noqa: E402

DIM, SEQ = 4, 3
VOCAB = {"items": 11, "users": 9, "pages": 7}
TABLE_OF = {"watched": "items", "liked": "items", "user": "users", "history": "pages"}


class StandInKJT:
    """What embedcore reads of torchrec's KeyedJaggedTensor: keys, values (key-major), lengths and/or offsets
    (``len(keys) * B`` lengths), weights; ``stride`` and the ``*_or_none`` accessors only when asked for."""

    def __init__(self, keys, values, lengths=None, offsets=None, weights=None, stride=True):
        self._keys, self._values, self._lengths, self._offsets, self._weights = keys, values, lengths, offsets, weights
        if stride:
            n = len(lengths) if lengths is not None else len(offsets) - 1
            self.stride = lambda: n // len(keys)
        self.asked = []

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def weights_or_none(self):
        return self._weights

    def lengths(self):
        self.asked.append("lengths")
        if self._lengths is None:
            return torch.diff(self._offsets)
        return self._lengths

    def offsets(self):
        self.asked.append("offsets")
        if self._offsets is None:
            return torch.cat([torch.zeros(1, dtype=self._lengths.dtype), torch.cumsum(self._lengths, 0)])
        return self._offsets


class WithOrNone(StandInKJT):
    def lengths_or_none(self):
        return self._lengths

    def offsets_or_none(self):
        return self._offsets


def _config():
    items = ec.TableConfig(VOCAB["items"], DIM, combiner="sum", name="items")
    users = ec.TableConfig(VOCAB["users"], DIM, combiner="mean", name="users")
    pages = ec.TableConfig(VOCAB["pages"], DIM, combiner="sqrtn", name="pages")
    return {"watched": ec.FeatureConfig(items), "liked": ec.FeatureConfig(items), "user": ec.FeatureConfig(users),
            "history": ec.FeatureConfig(pages, max_sequence_length=SEQ)}


def _module(**kwargs):
    return EmbeddingModule(_config(), ec.Adagrad(0.2, initial_accumulator_value=0.1), seed=4, **kwargs)


def _samples(rng, batch_size=5):
    out = {}
    for name, longest in (("watched", 4), ("liked", 3), ("user", 2), ("history", 5)):
        vocab = VOCAB[TABLE_OF[name]]
        out[name] = [[int(i) for i in rng.integers(0, vocab, rng.integers(0, longest + 1))] for _ in range(batch_size)]
        out[name][1] = []  # an empty bag in every feature
    weights = {name: [[float(x) for x in rng.uniform(0.25, 2.0, len(b))] for b in bags] for name, bags in out.items()}
    return out, weights


ORDER = ["user", "extra", "history", "watched", "liked"]  # not the config's order; "extra" names no feature


def _kjt(samples, weights=None, kind=StandInKJT, form="lengths", ids=torch.int64, weight_dtype=torch.float32,
         requires_grad=False):
    batch = len(samples["watched"])
    bags = {**samples, "extra": [[1]] * batch}
    values = torch.tensor([i for k in ORDER for b in bags[k] for i in b], dtype=ids)
    lengths = torch.tensor([len(b) for k in ORDER for b in bags[k]], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    w = None
    if weights is not None:
        wb = {**weights, "extra": [[1.0]] * batch}
        w = torch.tensor([x for k in ORDER for b in wb[k] for x in b], dtype=weight_dtype)
        w.requires_grad_(requires_grad)
    return kind(ORDER, values, lengths=lengths if form in ("lengths", "both") else None,
                offsets=offsets if form in ("offsets", "both") else None, weights=w)


def _expected(module, samples, weights=None):
    """The engine's own lookup of the same ids (lists in, arrays out), checked against the NumPy reference."""
    acts = module.embedding.lookup(samples, weights)[0]
    for name, a in acts.items():
        table = module.embedding_tables[TABLE_OF[name]].astype(np.float64)
        unit = weights[name] if weights is not None else [[1.0] * len(b) for b in samples[name]]
        seq = SEQ if name == "history" else 0
        np.testing.assert_allclose(a, ref.lookup(table, samples[name], unit, module.embedding.tables[TABLE_OF[name]]
                                                 .combiner, seq), rtol=1e-5, atol=1e-6)
    return acts


def _assert_equal(out, expected):
    assert list(out) == list(expected) == ["watched", "liked", "user", "history"]  # the config dict's order
    for name, a in expected.items():
        assert out[name].dtype == torch.float32 and tuple(out[name].shape) == a.shape
        np.testing.assert_array_equal(out[name].detach().numpy(), a)


@pytest.mark.parametrize("kind", [StandInKJT, WithOrNone])
@pytest.mark.parametrize("form", ["lengths", "offsets", "both"])
def test_kjt_equals_the_dict_of_lists(kind, form):
    module = _module()
    module.eval()
    samples, _ = _samples(np.random.default_rng(3))
    kjt = _kjt(samples, kind=kind, form=form)
    out = module(kjt)
    assert isinstance(out, dict)
    _assert_equal(out, _expected(module, samples))
    if kind is WithOrNone and form != "lengths":
        assert kjt.asked == []  # the offsets as given: no lengths computed, nothing derived


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_kjt_weights_of_any_float_dtype(dtype, requires_grad):
    module = _module()
    module.eval()
    samples, weights = _samples(np.random.default_rng(5))
    weights = {k: [[float(torch.tensor(x, dtype=dtype)) for x in b] for b in bags] for k, bags in weights.items()}
    out = module(_kjt(samples, weights, form="offsets", weight_dtype=dtype, requires_grad=requires_grad))
    _assert_equal(out, _expected(module, samples, weights))


def test_kjt_ids_are_not_copied():
    module = _module()
    module.eval()
    seen = []
    lookup = module.embedding.lookup

    def capture(features, weights=None, **kwargs):
        seen.append(features)
        return lookup(features, weights, **kwargs)

    module.embedding.lookup = capture
    samples, weights = _samples(np.random.default_rng(6))
    for ids in (torch.int64, torch.int32):
        kjt = _kjt(samples, weights, ids=ids)
        out = module(kjt)
        start = 0
        base = kjt.values().data_ptr()
        for key in ORDER:
            n = sum(len(b) for b in ({**samples, "extra": [[1]] * 5})[key])
            if key in seen[-1]:
                ragged = seen[-1][key]
                assert isinstance(ragged, ec.Ragged) and ragged.values.dtype == np.dtype(str(ids).split(".")[1])
                if n:
                    assert ragged.values.__array_interface__["data"][0] == base + start * kjt.values().element_size()
            start += n
        _assert_equal(out, _expected(module, samples, weights))


def test_kjt_training_equals_driving_the_engine():
    module = _module()
    plain = ec.Embedding(_config(), ec.Adagrad(0.2, initial_accumulator_value=0.1), seed=4)
    rng = np.random.default_rng(8)
    for _ in range(3):
        samples, weights = _samples(rng)
        out = module(_kjt(samples, weights, weight_dtype=torch.bfloat16, requires_grad=True))
        weights = {k: [[float(torch.tensor(x, dtype=torch.bfloat16)) for x in b] for b in bags]
                   for k, bags in weights.items()}
        acts, ctx = plain(samples, weights)
        grads = {n: rng.normal(size=a.shape).astype(np.float32) for n, a in acts.items()}
        _assert_equal(out, acts)
        torch.autograd.backward([out[n] for n in grads], [torch.from_numpy(g) for g in grads.values()])
        plain.apply_gradients(grads, ctx)
        assert module.embedding.step == plain.step
        for name in VOCAB:
            np.testing.assert_array_equal(module.embedding_tables[name], plain.embedding_tables[name])
            np.testing.assert_array_equal(module.slot_variables[name]["accumulators"],
                                          plain.slot_variables[name]["accumulators"])


def test_kjt_keys_may_be_feature_names():
    table = ec.TableConfig(6, DIM, combiner="sum", name="t")
    module = EmbeddingModule([ec.FeatureConfig(table, name="clicks"), ec.FeatureConfig(table)], ec.SGD(0.1))
    module.eval()
    kjt = StandInKJT(["1", "clicks"], torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 0, 1, 2]))
    out = module(kjt)
    assert list(out) == ["clicks", "1"]
    expected = module.embedding.lookup([[[3], [4, 5]], [[1, 2], []]])[0]
    np.testing.assert_array_equal(out["clicks"].numpy(), expected[0])
    np.testing.assert_array_equal(out["1"].numpy(), expected[1])


def test_bad_kjts_are_refused():
    module = _module()
    samples, weights = _samples(np.random.default_rng(2))
    before = {n: t.copy() for n, t in module.embedding_tables.items()}
    kjt = _kjt(samples)
    partial = StandInKJT(["watched", "liked"], kjt.values()[:int(kjt.lengths()[:10].sum())],
                         lengths=kjt.lengths()[:10])
    with pytest.raises(ec.InputError, match=r"no key for the features \['history', 'user'\]"):
        module(partial)
    with pytest.raises(ec.InputError, match="carries its own weights"):
        module(kjt, {"watched": None})
    with pytest.raises(ec.InputError, match="not a multiple of 5"):
        module(StandInKJT(ORDER, kjt.values(), lengths=kjt.lengths()[:-1], stride=False))
    bad_offsets = kjt.offsets().clone()
    bad_offsets[3] = bad_offsets[4] + 1
    with pytest.raises(ec.InputError, match="must start at 0 and not decrease"):
        module(StandInKJT(ORDER, kjt.values(), offsets=bad_offsets))
    short = kjt.lengths().clone()
    k = int(torch.nonzero(short > 0)[0])
    short[k] -= 1  # one value no bag owns (issue 40): refused, naming the features and their counts
    with pytest.raises(ec.InputError, match=rf"lengths sum to {int(short.sum())} \(per feature: .*'{ORDER[k // 5]}': "
                                            rf".*\) but it holds {len(kjt.values())} values"):
        module(StandInKJT(ORDER, kjt.values(), lengths=short))
    with pytest.raises(ec.InputError, match="weights have shape"):
        module(StandInKJT(ORDER, kjt.values(), lengths=kjt.lengths(), weights=torch.ones(3)))
    with pytest.raises(ec.InputError, match="outside the table's vocabulary"):
        module(StandInKJT(ORDER, kjt.values() + 100, lengths=kjt.lengths()))
    vbe = _kjt(samples)
    vbe.variable_stride_per_key = lambda: True
    with pytest.raises(ec.InputError, match="variable stride"):
        module(vbe)
    assert module.embedding.step == 0
    for name, table in before.items():
        np.testing.assert_array_equal(module.embedding_tables[name], table)


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_values_and_offsets_equal_the_dict_of_lists(include_last_offset):
    module = _module(include_last_offset=include_last_offset)
    module.eval()
    samples, weights = _samples(np.random.default_rng(9))
    features, feature_weights = {}, {}
    forms = {"watched": (torch.int64, torch.bfloat16, True), "liked": (torch.int32, torch.float64, True),
             "user": (torch.int64, torch.float16, False), "history": (torch.int32, torch.float32, False)}
    for name, bags in samples.items():
        ids, wdtype, grad = forms[name]
        offsets = np.cumsum([0] + [len(b) for b in bags])
        features[name] = (torch.tensor([i for b in bags for i in b], dtype=ids),
                          torch.from_numpy(offsets if include_last_offset else offsets[:-1]))
        feature_weights[name] = torch.tensor([x for b in weights[name] for x in b], dtype=wdtype).requires_grad_(grad)
        weights[name] = [[float(torch.tensor(x, dtype=wdtype)) for x in b] for b in weights[name]]
    out = module(features, feature_weights)
    _assert_equal(out, _expected(module, samples, weights))
    unweighted = module(features)
    _assert_equal(unweighted, _expected(module, samples))


def test_values_and_offsets_with_an_empty_last_bag_and_errors():
    table = ec.TableConfig(6, DIM, combiner="sum", name="t")
    without = EmbeddingModule({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
    with_last = EmbeddingModule(without.embedding, include_last_offset=True)
    values, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 3])
    # the same tensors: two bags, the last empty (EmbeddingBag's default), or one bag of three
    np.testing.assert_array_equal(without({"f": (values, offsets)})["f"].detach().numpy(),
                                  without.embedding.lookup({"f": [[1, 2, 3], []]})[0]["f"])
    np.testing.assert_array_equal(with_last({"f": (values, offsets)})["f"].detach().numpy(),
                                  without.embedding.lookup({"f": [[1, 2, 3]]})[0]["f"])
    with pytest.raises(ec.InputError, match=r"must be \(values, offsets\)"):
        without({"f": (values,)})
    with pytest.raises(ec.InputError, match="offsets of feature 'f' must be a 1-D integer"):
        without({"f": (values, offsets.float())})
    with pytest.raises(ec.InputError, match="row_splits of feature 'f'"):
        with_last({"f": (values, torch.tensor([0, 2]))})  # does not end at the number of values
    with pytest.raises(ec.InputError, match="row_splits of feature 'f'"):
        without({"f": (values, torch.tensor([0, 5]))})


def test_torch_weights_of_any_float_dtype_in_every_form():
    table = ec.TableConfig(6, DIM, combiner="mean", name="t")
    module = EmbeddingModule({"f": ec.FeatureConfig(table)}, ec.SGD(0.1))
    ids = np.array([[1, 2, 2], [0, 5, 3]])
    w = np.array([[0.5, 1.0, 2.0], [1.0, 0.25, 0.75]])
    expected = module.embedding.lookup({"f": ids}, {"f": w.astype(np.float32)})[0]["f"]
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        for grad in (False, True):
            tensor = torch.tensor(w, dtype=dtype).requires_grad_(grad)
            for weights in (tensor, list(tensor)):
                out = module({"f": torch.from_numpy(ids)}, {"f": weights})
                np.testing.assert_array_equal(out["f"].detach().numpy(), expected)


@pytest.mark.parametrize("form", ["lengths", "offsets"])
def test_real_torchrec_gives_a_keyed_tensor(form):
    """As torchrec's EmbeddingBagCollection: a KeyedTensor, the features' activations concatenated along dim 1."""
    jagged = pytest.importorskip("torchrec.sparse.jagged_tensor", reason="torchrec is optional and .ci/run does not install it; "
                                 "the stand-in KJT tests above cover the same interface")
    module = _module()
    samples, weights = _samples(np.random.default_rng(4))
    stand_in = _kjt(samples, weights)
    jagged_form = {"lengths": stand_in.lengths()} if form == "lengths" else {"offsets": stand_in.offsets()}
    kjt = jagged.KeyedJaggedTensor(keys=ORDER, values=stand_in.values(), weights=stand_in.weights_or_none(),
                                   **jagged_form)
    out = module(kjt)
    assert isinstance(out, jagged.KeyedTensor)
    assert out.keys() == ["watched", "liked", "user", "history"] and out.length_per_key() == [DIM, DIM, DIM, SEQ * DIM]
    expected = _expected(module, samples, weights)
    for name, tensor in out.to_dict().items():
        np.testing.assert_array_equal(tensor.detach().numpy(), expected[name].reshape(len(samples["watched"]), -1))
    out.values().sum().backward()
    assert module.embedding.step == 1
