"""embedcore.torch.EmbeddingBagCollection: torchrec's EBC as a drop-in, with FBGEMM's pooling (issue 40).

Oracles: plain torch autograd over a copy of the tables (FBGEMM's pooling rule written out), torchrec's own
EmbeddingBagCollection with the same in-backward optimizer (when torchrec is installed), FBGEMM's CPU TBE for
weighted MEAN pooling (when fbgemm-gpu-cpu is installed).
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

import embedcore as ec  # noqa: E402
from embedcore.torch import EmbeddingBagCollection  # noqa: E402

try:
    import torchrec
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
except ImportError:  # torchrec is optional: the stand-ins below are what embedcore reads
    torchrec = None


class KJT:
    """The parts of torchrec's KeyedJaggedTensor the collection reads."""

    def __init__(self, keys, values, lengths, weights=None):
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return len(self._lengths) // len(self._keys)


def config(name, dim, rows, features, pooling="SUM"):
    if torchrec is not None:
        return torchrec.EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features,
                                           pooling=getattr(torchrec.PoolingType, pooling))
    return SimpleNamespace(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features,
                           pooling=pooling, init_fn=None, weight_init_min=None, weight_init_max=None)


def make_kjt(weights=None, lengths=(2, 0, 3, 1, 1, 2), values=(1, 2, 3, 4, 5, 6, 7, 8, 9)):
    """Keys f1, f2; batch 3; f1's second bag empty."""
    values, lengths = torch.tensor(values), torch.tensor(lengths)
    if torchrec is not None:
        return torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=values, lengths=lengths, weights=weights)
    return KJT(["f1", "f2"], values, lengths, weights)


def as_dict(out):
    return out.to_dict() if hasattr(out, "to_dict") else out


def tables():
    return [config("t1", 4, 12, ["f1"], "MEAN"), config("t2", 8, 10, ["f1", "f2"])]


@pytest.fixture(scope="module")
def weighted():
    return EmbeddingBagCollection(tables(), is_weighted=True, optimizer=ec.SGD(0.5))


def reference(ebc, kjt, weights, grads):
    """FBGEMM's pooling written out with torch ops over copies of the tables; autograd gives the weights'
    and the tables' gradients."""
    rows = {name: p.detach().clone().requires_grad_() for name, p in
            ((n, b.weight) for n, b in ebc.embedding_bags.items())}
    w = weights.detach().clone().requires_grad_()
    offsets = kjt.offsets()
    outs = {}
    for key, feature, table, mean in (("f1@t1", 0, "t1", True), ("f1@t2", 0, "t2", False), ("f2", 1, "t2", False)):
        out = torch.zeros(3, rows[table].shape[1])
        for b in range(3):
            s, e = int(offsets[feature * 3 + b]), int(offsets[feature * 3 + b + 1])
            for i in range(s, e):
                out[b] = out[b] + w[i] * rows[table][kjt.values()[i]] / ((e - s) if mean else 1)
        outs[key] = out
    sum((outs[k] * grads[k]).sum() for k in outs).backward()
    return outs, w.grad, {n: r.grad for n, r in rows.items()}


def test_weighted_mean_divides_by_the_bag_length_and_weights_get_their_gradient(weighted):
    ebc = weighted
    w = torch.tensor([1.0, 2.0, 0.5, -0.5, 3.0, 2.0, 1.0, 1.5, -1.0], requires_grad=True)
    kjt = make_kjt(w)
    grads = {"f1@t1": torch.randn(3, 4), "f1@t2": torch.randn(3, 8), "f2": torch.randn(3, 8)}
    want, want_dw, want_rows_grad = reference(ebc, kjt, w, grads)
    before = {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}
    out = as_dict(ebc(kjt))
    assert list(out) == ["f1@t1", "f1@t2", "f2"]
    for key in want:
        torch.testing.assert_close(out[key], want[key].detach(), rtol=1e-6, atol=1e-6)
    assert torch.all(out["f1@t1"][1] == 0)  # the empty bag
    sum((out[k] * grads[k]).sum() for k in out).backward()
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-5, atol=1e-5)
    for name, bag in ebc.embedding_bags.items():  # SGD(0.5) applied in backward, with FBGEMM's row gradients
        torch.testing.assert_close(bag.weight.detach(), before[name] - 0.5 * want_rows_grad[name], rtol=1e-6,
                                   atol=1e-6)
        assert bag.weight.grad is None


def test_bad_lengths_are_refused_naming_the_feature_and_nothing_changes(weighted):
    ebc = weighted
    before = {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}
    step = ebc.embedding.step
    short = make_kjt(torch.ones(9), lengths=(2, 0, 3, 1, 1, 1))  # 8 of 9 values in bags
    with pytest.raises(ec.InputError, match=r"lengths sum to 8 \(per feature: \{'f1': 5, 'f2': 3\}\) but it holds "
                                            r"9 values"):
        ebc(short)
    with pytest.raises(ec.InputError, match="is_weighted=True"):
        ebc(make_kjt())
    assert ebc.embedding.step == step
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(bag.weight.detach(), before[name], rtol=0, atol=0)


def test_what_torchrec_asks_of_an_ebc(weighted):
    assert weighted.is_weighted() and [c.name for c in weighted.embedding_bag_configs()] == ["t1", "t2"]
    assert list(weighted.state_dict()) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert [n for n, _ in weighted.named_parameters()] == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]


def test_traced_by_torch_fx_as_one_node(weighted):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = weighted

        def forward(self, kjt):
            return as_dict(self.ebc(kjt))

    traced = torch.fx.symbolic_trace(Model())
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["ebc.lookup"]
    kjt = make_kjt(torch.ones(9))
    with torch.no_grad():
        got, want = traced(kjt), as_dict(weighted(kjt))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_unknown_optimizers_and_training_without_one_are_refused():
    ebc = EmbeddingBagCollection([config("t", 4, 5, ["f1", "f2"])])
    kjt = make_kjt(values=(0, 1, 2, 3, 4, 0, 1, 2, 3))
    with pytest.raises(RuntimeError, match="table 't' has no optimizer: call apply_optimizer_in_backward"):
        ebc(kjt)
    with torch.no_grad():
        as_dict(ebc(kjt))  # a lookup needs none
    ebc.embedding_bags["t"].weight._optimizer_classes = [torch.optim.Adam]
    ebc.embedding_bags["t"].weight._optimizer_kwargs = [{"lr": 0.1}]
    with pytest.raises(ValueError, match="table 't': optimizer class Adam has no fused embedcore equivalent"):
        ebc(kjt)
    ebc.embedding_bags["t"].weight._optimizer_classes = [torch.optim.SGD]
    ebc.embedding_bags["t"].weight._optimizer_kwargs = [{"lr": 0.1, "momentum": 0.9}]
    with pytest.raises(ValueError, match=r"SGD option\(s\) \{'momentum': 0.9\}"):
        ebc(kjt)


@pytest.mark.skipif(torchrec is None, reason="needs torchrec (pip install --no-deps torchrec; see .ci/run)")
@pytest.mark.parametrize("optimizer_class", ["SGD", "Adagrad", "RowWiseAdagrad"])
def test_trains_as_torchrecs_own_ebc_with_the_same_in_backward_optimizer(optimizer_class):
    cls = (torchrec.optim.RowWiseAdagrad if optimizer_class == "RowWiseAdagrad"
           else getattr(torch.optim, optimizer_class))
    configs = [config("t1", 4, 12, ["f1"]), config("t2", 8, 10, ["f1", "f2"])]
    ours, theirs = EmbeddingBagCollection(configs), torchrec.EmbeddingBagCollection(configs)
    theirs.load_state_dict(ours.state_dict())
    for module in (ours, theirs):
        apply_optimizer_in_backward(cls, module.parameters(), {"lr": 0.1})
    rng = np.random.default_rng(0)
    for _ in range(3):
        lengths = torch.tensor(rng.integers(0, 4, 6))
        kjt = make_kjt(values=tuple(rng.integers(0, 10, int(lengths.sum()))), lengths=tuple(lengths.tolist()))
        out, want = ours(kjt), theirs(kjt)
        assert out.keys() == want.keys() == ["f1@t1", "f1@t2", "f2"]
        torch.testing.assert_close(out.values(), want.values(), rtol=1e-5, atol=1e-6)
        grad = torch.randn_like(want.values())
        (out.values() * grad).sum().backward()
        (want.values() * grad).sum().backward()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert torchrec.fx.symbolic_trace(ours) is not None


def test_weighted_mean_forward_equals_fbgemms_cpu_tbe():
    tbe_module = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    ebc = EmbeddingBagCollection([config("t", 4, 10, ["f1"], "MEAN")], is_weighted=True, optimizer=ec.SGD(0.0))
    tbe = tbe_module.SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 4, EmbeddingLocation.HOST, tbe_module.ComputeDevice.CPU)], pooling_mode=PoolingMode.MEAN,
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.0)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(ebc.embedding_bags["t"].weight)
    values, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 5])
    w = torch.tensor([1.0, 2.0, 0.5, 0.5, 3.0])
    kjt = (torchrec.KeyedJaggedTensor(keys=["f1"], values=values, offsets=offsets, weights=w) if torchrec else
           KJT(["f1"], values, torch.diff(offsets), w))
    with torch.no_grad():
        torch.testing.assert_close(as_dict(ebc(kjt))["f1"], tbe(values, offsets, per_sample_weights=w), rtol=1e-6,
                                   atol=1e-6)


def test_torch_compile_runs_the_lookup_eagerly_and_still_updates():
    ebc = EmbeddingBagCollection([config("t", 4, 10, ["f1", "f2"])], optimizer=ec.SGD(0.1))
    head = torch.nn.Linear(8, 1)

    def step(kjt):
        values = ebc(kjt).values() if torchrec is not None else torch.cat(list(ebc(kjt).values()), 1)
        return head(values).sum()

    kjt = make_kjt(values=(0, 1, 2, 3, 4, 5, 6, 7, 8))
    before = ebc.embedding_bags["t"].weight.detach().clone()
    eager = step(kjt).item()
    ebc.embedding_bags["t"].weight.data.copy_(before)  # the eager forward made no update: no backward ran
    loss = torch.compile(step)(kjt)  # a graph break around the KJT lookup, not a Dynamo error
    assert abs(loss.item() - eager) < 1e-5
    loss.backward()
    assert not torch.equal(ebc.embedding_bags["t"].weight.detach(), before)
