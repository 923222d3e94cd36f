"""A torch.optim.lr_scheduler drives the tables' learning rates through EmbeddingModule.learning_rates()."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

import embedcore as ec  # noqa: E402
from embedcore.optimizers import ExactRowwiseAdagrad  # noqa: E402
from embedcore.torch import EmbeddingModule  # noqa: E402


def _config(items_optimizer):
    return {"user": ec.FeatureConfig(ec.TableConfig(11, 4, name="users")),
            "item": ec.FeatureConfig(ec.TableConfig(13, 4, name="items", optimizer=items_optimizer))}


def _steps(module, steps):
    rng = np.random.default_rng(3)
    for _ in range(steps):
        acts = module({"user": torch.tensor(rng.integers(0, 11, 8)), "item": torch.tensor(rng.integers(0, 13, 8))})
        (acts["user"].sum() + (acts["item"] ** 2).sum()).backward()
        yield


def test_a_step_scheduler_drives_each_optimizers_learning_rate():
    module = EmbeddingModule(_config(ExactRowwiseAdagrad(0.2)), ec.SGD(0.1), seed=1)
    rates = module.learning_rates()
    assert rates is module.learning_rates()
    assert sorted(sorted(g["tables"]) for g in rates.param_groups) == [["items"], ["users"]]
    scheduler = torch.optim.lr_scheduler.StepLR(rates, step_size=1, gamma=0.5)
    # The reference: the same engine with the rates as callables of the step, applied by hand.
    schedule = {"sgd": [0.1, 0.05, 0.025], "rowwise": [0.2, 0.1, 0.05]}
    step = [0]
    reference = EmbeddingModule(_config(ExactRowwiseAdagrad(lambda: schedule["rowwise"][step[0]])),
                                ec.SGD(lambda: schedule["sgd"][step[0]]), seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        for _ in _steps(module, 3):
            scheduler.step()
    for _ in _steps(reference, 3):
        step[0] += 1
    for name, table in reference.embedding_tables.items():
        np.testing.assert_array_equal(module.embedding_tables[name], table, err_msg=name)
    assert module.embedding.optimizer.learning_rate == 0.025  # the last update's rate (what a checkpoint records)


def test_a_callable_learning_rate_is_refused_and_a_bad_scheduled_rate_changes_nothing():
    with pytest.raises(ValueError, match="callable learning rate"):
        EmbeddingModule(_config(None), ec.SGD(lambda: 0.1)).learning_rates()
    module = EmbeddingModule(_config(None), ec.SGD(0.1), seed=1)
    rates = module.learning_rates()
    rates.param_groups[0]["lr"] = float("nan")
    before = module.embedding_tables["users"].copy()
    with pytest.raises(ValueError, match="not a finite float"):
        next(_steps(module, 1))
    np.testing.assert_array_equal(module.embedding_tables["users"], before)
    assert module.embedding.step == 0
