"""A deterministic, streaming synthetic click log shaped like Criteo, with a planted teacher.

Features (default configuration): 26 categorical features ``C1..C26`` over vocabularies of 100 to 10^6
rows, four of them bags (``C4``, ``C16``, ``C24`` weighted, ``C11`` unweighted; 1 to ``max_ids`` ids per
sample), and 13 dense features ``log1p(count)`` of log-normal counts (some zeroed).

Ids: feature ``f`` draws a popularity rank ``r`` in ``[0, V)`` from a discretised power law with exponent
``s_f`` (drawn in ``zipf_exponent``, 1.05..1.2 by default): with ``u ~ U[0, 1)`` and ``W = (V + 1)^(1 - s)``,
``r = floor((1 + u (W - 1))^(1 / (1 - s)) - 1)``, so ``P(r) = ((r + 1)^(1-s) - (r + 2)^(1-s)) / (1 - W)``,
roughly ``(r + 1.5)^-s``. The id is ``(a_f r + c_f) mod V`` with ``a_f`` coprime to ``V``, so hot ids are
scattered over the table (``scatter_ids=False`` keeps ``id = r``: hot ids at 0, 1, 2, ...).

Teacher: ``logit = bias + sum_f m_f e_f[id_f] + sum_(f,g) <U_f[id_f], U_g[id_g]> + w . dense`` where
``e_f[id] ~ N(0, 1)`` per id, ``m_f`` a per-feature importance, ``U_f[id] ~ N(0, I_d / d)`` (``d =
interaction_dim``) for the features of ``n_interactions`` planted pairs, and for a bag ``e_f`` and ``U_f``
are the weighted means over its ids (the ``"mean"`` combiner with the weights). The three terms are scaled so
that their variances over a calibration sample are ``variance_shares`` of ``logit_std^2`` and the bias is
solved so that the mean click probability is ``click_rate``. Labels are Bernoulli(sigmoid(logit)).

Streaming: sample ``i`` of a split lies in block ``i // 4096``, generated whole from a generator seeded by
``(seed, split, block)``; so any sample depends only on ``(seed, split, i)`` and the configuration, batches
do not depend on the batch size, a run can start anywhere, and ``n_train``/``n_eval`` only truncate.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numba import njit

from ...inputs import Ragged
from ...memory_budget import check_fits
from ..metrics import BinaryMetrics
from .batch import Batch, FeatureSpec, check_batch_size, check_split, rebatch

__all__ = ["SyntheticClickLog", "DEFAULT_VOCABULARY_SIZES", "DEFAULT_MULTI_HOT", "BLOCK"]

BLOCK = 4096
DEFAULT_VOCABULARY_SIZES = (1_000, 500, 1_000_000, 200_000, 300, 120, 10_000, 600, 100, 50_000, 5_000, 800_000,
                            3_000, 180, 10_000, 500_000, 250, 4_000, 2_000, 150, 600_000, 110, 400, 100_000,
                            130, 50_000)
DEFAULT_MULTI_HOT = {"C4": (5, True), "C11": (3, False), "C16": (5, True), "C24": (4, True)}

_SPLIT_CODE = {"train": 0, "eval": 1}
_CALIBRATION_CODE, _CALIBRATION_BLOCKS = 2, 16
_WEIGHT_RANGE = (0.25, 2.0)            # bag weights ~ U[0.25, 2)
# Stream tags mixed into the seeds so that no two generators share a seed.
_TAG_FEATURE, _TAG_PAIRS, _TAG_FACTORS, _TAG_DENSE, _TAG_BLOCK = 0x7EAC, 0x1A7E, 0x1A7F, 0xDE45, 0xB10C


def _sigmoid(z):
    return np.exp(-np.logaddexp(0.0, -z))


def _solve_bias(z, rate):
    """The ``b`` with ``mean(sigmoid(b + z)) = rate`` (Newton's method from the logit of ``rate``; the mean is
    increasing and the iteration is kept inside a shrinking bracket)."""
    lo, hi = -60.0, 60.0
    b = math.log(rate / (1.0 - rate)) - float(np.mean(z))
    for _ in range(100):
        p = _sigmoid(b + z)
        f = float(np.mean(p)) - rate
        if abs(f) < 1e-13:
            break
        lo, hi = (b, hi) if f < 0 else (lo, b)
        slope = float(np.mean(p * (1.0 - p)))
        b = b - f / slope if slope > 0 else 0.5 * (lo + hi)
        if not lo < b < hi:
            b = 0.5 * (lo + hi)
    return b


@njit(cache=True)
def _zipf_ids(u, v, s, a, c, out):
    """``out[j] = (a r + c) mod v`` with rank ``r = floor((1 + u[j] (W - 1))^(1 / (1 - s)) - 1)``,
    ``W = (v + 1)^(1 - s)``, clipped to ``[0, v)``."""
    k = 1.0 / (1.0 - s)
    m = (v + 1.0) ** (1.0 - s) - 1.0
    for j in range(u.shape[0]):
        x = math.floor(math.exp(k * math.log1p(u[j] * m)) - 1.0)
        r = np.int64(min(max(x, 0.0), v - 1.0))
        out[j] = (a * r + c) % v


@njit(cache=True)
def _bag_mean_scalar(ids, splits, weights, weighted, table, out):
    """``out[b] = sum_j w_j table[ids_j] / sum_j w_j`` over the ids of sample ``b`` (0 for an empty sum)."""
    for b in range(splits.shape[0] - 1):
        acc = 0.0
        total = 0.0
        for j in range(splits[b], splits[b + 1]):
            w = np.float64(weights[j]) if weighted else 1.0
            total += w
            acc += w * table[ids[j]]
        out[b] = acc / total if total != 0.0 else 0.0


@njit(cache=True)
def _bag_mean(ids, splits, weights, weighted, table, out):
    """``out[b] = sum_j w_j table[ids_j] / sum_j w_j`` over the ids of sample ``b`` (0 for an empty sum)."""
    dim = table.shape[1]
    for b in range(splits.shape[0] - 1):
        for k in range(dim):
            out[b, k] = 0.0
        total = 0.0
        for j in range(splits[b], splits[b + 1]):
            w = np.float64(weights[j]) if weighted else 1.0
            total += w
            for k in range(dim):
                out[b, k] += w * table[ids[j], k]
        if total != 0.0:
            for k in range(dim):
                out[b, k] /= total
        else:
            for k in range(dim):
                out[b, k] = 0.0


class SyntheticClickLog:
    """Synthetic Criteo-like click log with a known optimum (see the module docstring for the model).

    Args:
        n_train, n_eval: number of samples of each split.
        seed: selects the teacher and the samples (a non-negative int).
        vocabulary_sizes: one int per categorical feature (named ``C1, C2, ...``) or a dict name -> int;
            default ``DEFAULT_VOCABULARY_SIZES`` (26 features, 100 .. 10^6 rows).
        n_dense: number of dense features.
        multi_hot: name -> ``(max_ids, weighted)`` for the bag features; default ``DEFAULT_MULTI_HOT``
            restricted to the features that exist; ``{}`` makes every feature one-hot.
        zipf_exponent: a float ``s > 1`` or a range ``(lo, hi)`` from which each feature draws its ``s``.
        n_interactions: number of planted feature pairs; ``interaction_dim``: their rank.
        logit_std: standard deviation of the teacher logit (1.25 gives an AUC near 0.78).
        click_rate: mean click probability.
        variance_shares: shares of the logit variance of (per-id effects, interactions, dense term).
        scatter_ids: map popularity ranks to ids by a random affine permutation (else id = rank).
    """

    block_size = BLOCK

    def __init__(self, n_train=1_000_000, n_eval=100_000, seed=0, vocabulary_sizes=None, n_dense=13, *,
                 multi_hot=None, zipf_exponent=(1.05, 1.2), n_interactions=4, interaction_dim=4,
                 logit_std=1.25, click_rate=0.25, variance_shares=(0.7, 0.2, 0.1), scatter_ids=True,
                 name="synthetic"):
        for arg, value in (("n_train", n_train), ("n_eval", n_eval), ("seed", seed), ("n_dense", n_dense),
                           ("n_interactions", n_interactions)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{arg} must be a non-negative int, got {value!r}")
        if isinstance(interaction_dim, bool) or not isinstance(interaction_dim, (int, np.integer)) or \
                interaction_dim < 1:
            raise ValueError(f"interaction_dim must be a positive int, got {interaction_dim!r}")
        if not 0.0 < click_rate < 1.0:
            raise ValueError(f"click_rate must lie in (0, 1), got {click_rate!r}")
        if not logit_std >= 0.0:
            raise ValueError(f"logit_std must be >= 0, got {logit_std!r}")
        shares = tuple(float(x) for x in variance_shares)
        if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
            raise ValueError(f"variance_shares must be 3 non-negative numbers, not all 0; got {variance_shares!r}")
        self.name = name
        self.seed, self.n_dense = int(seed), int(n_dense)
        self._n = {"train": int(n_train), "eval": int(n_eval)}
        self.features = self._make_specs(vocabulary_sizes, multi_hot)
        # The dense features of the calibration sample (float32) and a block's temporaries.
        check_fits((_CALIBRATION_BLOCKS * 4 + 16) * BLOCK * self.n_dense,
                   f"n_dense={self.n_dense}: the dense features of the synthetic data's calibration sample")
        self._make_teacher(zipf_exponent, int(n_interactions), int(interaction_dim), scatter_ids)
        self._calibrate(float(logit_std), float(click_rate), shares)
        self._stats = {}

    # -- configuration -------------------------------------------------------------------------------------
    @staticmethod
    def _make_specs(vocabulary_sizes, multi_hot):
        if vocabulary_sizes is None:
            vocabulary_sizes = DEFAULT_VOCABULARY_SIZES
        if isinstance(vocabulary_sizes, dict):
            items = list(vocabulary_sizes.items())
        else:
            items = [(f"C{i + 1}", v) for i, v in enumerate(vocabulary_sizes)]
        for name, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v < 2 ** 31:
                raise ValueError(f"vocabulary size of feature '{name}' must be an int in [1, 2**31), got {v!r}")
        names = {name for name, _ in items}
        if multi_hot is None:
            multi_hot = {k: v for k, v in DEFAULT_MULTI_HOT.items() if k in names}
        unknown = sorted(set(multi_hot) - names)
        if unknown:
            raise ValueError(f"multi_hot names unknown features {unknown}")
        specs = []
        for name, v in items:
            if name in multi_hot:
                entry = multi_hot[name]
                max_ids, weighted = (entry, False) if isinstance(entry, (int, np.integer)) else entry
                if isinstance(max_ids, bool) or not isinstance(max_ids, (int, np.integer)) or max_ids < 1:
                    raise ValueError(f"multi_hot['{name}']: max_ids must be a positive int, got {max_ids!r}")
                specs.append(FeatureSpec(name, int(v), int(max_ids), bool(weighted), "mean", bag=True,
                                         source="vocabulary_sizes"))
            else:
                specs.append(FeatureSpec(name, int(v), 1, False, "sum", source="vocabulary_sizes"))
        return specs

    def _make_teacher(self, zipf_exponent, n_interactions, dim, scatter_ids):
        if np.ndim(zipf_exponent) == 0:
            lo = hi = float(zipf_exponent)
        else:
            lo, hi = (float(x) for x in zipf_exponent)
        if not 1.0 < lo <= hi:
            raise ValueError(f"zipf_exponent must be > 1 (or a range 1 < lo <= hi), got {zipf_exponent!r}")
        rng = np.random.default_rng([self.seed, _TAG_PAIRS])
        pairs = list(itertools.combinations(range(len(self.features)), 2))
        chosen = rng.choice(len(pairs), size=min(n_interactions, len(pairs)), replace=False) if pairs else []
        self._pairs = sorted(pairs[k] for k in chosen)
        factored = sorted({i for pair in self._pairs for i in pair})
        if self.features:
            largest = max(self.features, key=lambda f: f.vocabulary_size)
            ids = sum(f.vocabulary_size for f in self.features)
            check_fits(4 * ids + 4 * dim * sum(self.features[i].vocabulary_size for i in factored),
                       f"the synthetic teacher's per-id values ({len(self.features)} features, {ids:,} ids; largest: "
                       f"feature '{largest.name}' with vocabulary size {largest.vocabulary_size:,})")
        self._exponent, self._affine, self._effects, importance = [], [], [], []
        for i, spec in enumerate(self.features):
            rng = np.random.default_rng([self.seed, _TAG_FEATURE, i])
            v = spec.vocabulary_size
            self._exponent.append(float(rng.uniform(lo, hi)))
            importance.append(math.exp(0.75 * rng.standard_normal()))
            a, c = 1, 0
            if scatter_ids and v > 1:
                a = int(rng.integers(1, v))
                while math.gcd(a, v) != 1:
                    a = int(rng.integers(1, v))
                c = int(rng.integers(0, v))
            self._affine.append((a, c))
            self._effects.append(rng.standard_normal(v, dtype=np.float32))
        importance = np.array(importance)
        self._main_scale = np.sqrt(importance / importance.sum()) if len(importance) else importance

        self._factors = {}
        for i in factored:
            rng = np.random.default_rng([self.seed, _TAG_FACTORS, i])
            self._factors[i] = rng.standard_normal((self.features[i].vocabulary_size, dim), dtype=np.float32) \
                / np.float32(math.sqrt(dim))
        self._inter_scale = 1.0

        rng = np.random.default_rng([self.seed, _TAG_DENSE])
        d = self.n_dense
        self._dense_mu = rng.uniform(0.0, 4.0, d).astype(np.float32)
        self._dense_sigma = rng.uniform(0.5, 1.5, d).astype(np.float32)
        self._dense_zero = rng.uniform(0.0, 0.3, d).astype(np.float32)
        self._dense_w = rng.standard_normal(d)
        self.bias = 0.0

    def _calibrate(self, logit_std, click_rate, shares):
        batch = Batch.concat([self._features_block(_CALIBRATION_CODE, b)[0] for b in range(_CALIBRATION_BLOCKS)])
        parts = self._components(batch)
        stds = [float(np.std(p)) for p in parts]
        active = [k for k in range(3) if stds[k] > 0 and shares[k] > 0]
        total = sum(shares[k] for k in active)
        scale = [logit_std * math.sqrt(shares[k] / total) / stds[k] if k in active else 0.0 for k in range(3)]
        self._main_scale = self._main_scale * scale[0]
        self._inter_scale *= scale[1]
        self._dense_w = self._dense_w * scale[2]
        z = sum(p * s for p, s in zip(parts, scale))
        self.bias = _solve_bias(z, click_rate)

    # -- public description ------------------------------------------------------------------------------
    @property
    def zipf_exponents(self) -> dict:
        return {f.name: s for f, s in zip(self.features, self._exponent)}

    @property
    def interactions(self) -> list:
        """The planted pairs, as feature names."""
        return [(self.features[i].name, self.features[j].name) for i, j in self._pairs]

    def n_samples(self, split="train") -> int:
        check_split(split)
        return self._n[split]

    def ids_by_rank(self, name, ranks) -> np.ndarray:
        """The ids of popularity ranks ``ranks`` (rank 0 = most frequent) of feature ``name``."""
        i = self._index(name)
        a, c = self._affine[i]
        return (a * np.asarray(ranks, np.int64) + c) % self.features[i].vocabulary_size

    def id_probability(self, name, ids) -> np.ndarray:
        """Probability that one draw of feature ``name`` (a one-hot id, or one id of a bag) is each of ``ids``."""
        i = self._index(name)
        v, s = self.features[i].vocabulary_size, self._exponent[i]
        a, c = self._affine[i]
        r = (pow(a, -1, v) * ((np.asarray(ids, np.int64) - c) % v)) % v
        w = (v + 1.0) ** (1.0 - s)
        return ((r + 1.0) ** (1.0 - s) - (r + 2.0) ** (1.0 - s)) / (1.0 - w)

    def _index(self, name):
        for i, f in enumerate(self.features):
            if f.name == name:
                return i
        raise KeyError(f"no feature named {name!r}")

    def __repr__(self):
        return (f"SyntheticClickLog(n_train={self._n['train']}, n_eval={self._n['eval']}, seed={self.seed}, "
                f"{len(self.features)} categorical features, n_dense={self.n_dense})")

    # -- generation --------------------------------------------------------------------------------------
    def _draw_ids(self, i, u):
        a, c = self._affine[i]
        out = np.empty(u.shape[0], np.int64)
        _zipf_ids(u, self.features[i].vocabulary_size, self._exponent[i], a, c, out)
        return out

    def _features_block(self, code, block):
        """Block ``block`` of stream ``code`` (``BLOCK`` samples) without labels, and the label uniforms."""
        rng = np.random.default_rng([self.seed, _TAG_BLOCK, code, block])
        n, d = BLOCK, self.n_dense
        if d:
            z = rng.standard_normal((n, d), dtype=np.float32)
            keep = rng.random((n, d), dtype=np.float32) >= self._dense_zero
            dense = np.log1p(np.floor(np.exp(self._dense_mu + self._dense_sigma * z)) * keep)
        else:
            dense = np.zeros((n, 0), np.float32)
        ids, weights = {}, {}
        for i, spec in enumerate(self.features):
            if spec.bag:
                lengths = rng.integers(1, spec.max_ids + 1, n)
                splits = np.zeros(n + 1, np.int64)
                np.cumsum(lengths, out=splits[1:])
                ids[spec.name] = Ragged(self._draw_ids(i, rng.random(splits[-1])), splits)
                weights[spec.name] = Ragged(rng.uniform(*_WEIGHT_RANGE, splits[-1]).astype(np.float32), splits) \
                    if spec.weighted else None
            else:
                ids[spec.name] = self._draw_ids(i, rng.random(n))
                weights[spec.name] = None
        label_u = rng.random(n)
        return Batch(dense, ids, weights, np.zeros(n, np.float32)), label_u

    def _block(self, code, block) -> Batch:
        batch, label_u = self._features_block(code, block)
        p = _sigmoid(self.teacher_logits(batch))
        batch.labels = (label_u < p).astype(np.float32)
        batch.teacher_prob = p
        return batch

    def _blocks(self, split, start, stop):
        code = _SPLIT_CODE[split]
        block = start // BLOCK
        while block * BLOCK < stop:
            lo, hi = max(start - block * BLOCK, 0), min(stop - block * BLOCK, BLOCK)
            batch = self._block(code, block)
            yield batch if (lo, hi) == (0, BLOCK) else batch.slice(lo, hi)
            block += 1

    def batches(self, batch_size, split="train", start=0):
        """Batches of samples ``start, start + 1, ..., n_samples(split) - 1`` in order."""
        check_batch_size(batch_size)
        check_split(split)
        n = self._n[split]
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= n:
            raise ValueError(f"start must be an int in [0, {n}] for split '{split}', got {start!r}")
        return rebatch(self._blocks(split, int(start), n), batch_size)

    def samples(self, start, stop, split="train") -> Batch:
        """Samples ``start:stop`` of a split as one :class:`Batch` (``stop`` may exceed ``n_samples``: the
        stream is unbounded)."""
        check_split(split)
        if not 0 <= start <= stop:
            raise ValueError(f"need 0 <= start <= stop, got {start}, {stop}")
        if start == stop:
            return self._block(_SPLIT_CODE[split], 0).slice(0, 0)
        return Batch.concat(list(self._blocks(split, int(start), int(stop))))

    # -- the teacher ---------------------------------------------------------------------------------------
    @staticmethod
    def _pool(batch, spec, table):
        """Per sample: ``table[id]`` (one-hot) or the weighted mean of ``table[ids]`` over the bag (0 if empty)."""
        ids = batch.ids[spec.name]
        if not isinstance(ids, Ragged):
            return table[ids].astype(np.float64)
        w = batch.weights.get(spec.name)
        values = np.asarray(ids.values, np.int64)
        weights = np.ones(1, np.float32) if w is None else np.asarray(w.values, np.float32)
        splits = np.asarray(ids.row_splits, np.int64)
        out = np.empty((splits.shape[0] - 1,) + table.shape[1:], np.float64)
        (_bag_mean_scalar if table.ndim == 1 else _bag_mean)(values, splits, weights, w is not None, table, out)
        return out

    def _components(self, batch):
        n = len(batch)
        main = np.zeros(n)
        for i, spec in enumerate(self.features):
            main += self._main_scale[i] * self._pool(batch, spec, self._effects[i])
        pooled = {i: self._pool(batch, self.features[i], f) for i, f in self._factors.items()}
        inter = np.zeros(n)
        for i, j in self._pairs:
            inter += np.einsum("nd,nd->n", pooled[i], pooled[j])
        dense = batch.dense.astype(np.float64) @ self._dense_w if self.n_dense else np.zeros(n)
        return main, inter * self._inter_scale, dense

    def teacher_logits(self, batch) -> np.ndarray:
        """The teacher's logit (float64 ``[B]``) of any batch with this dataset's features."""
        main, inter, dense = self._components(batch)
        return self.bias + main + inter + dense

    def teacher_probabilities(self, batch) -> np.ndarray:
        return _sigmoid(self.teacher_logits(batch))

    # -- the optimum ---------------------------------------------------------------------------------------
    def _split_stats(self, split):
        check_split(split)
        if split not in self._stats:
            metrics = BinaryMetrics()
            for batch in self._blocks(split, 0, self._n[split]):
                metrics.update(batch.labels, batch.teacher_prob)
            self._stats[split] = metrics.result(allow_undefined=True) if metrics.n else {"n": 0}
        return self._stats[split]

    def optimum(self, split="eval") -> dict:
        """Metrics of the teacher's own probabilities on exactly this split's samples:
        ``{"log_loss", "auc", "n", "click_rate"}`` (one streaming pass, cached; exact AUC keeps 9 bytes per
        sample; ``auc`` is NaN when the split holds one class only)."""
        stats = self._split_stats(split)
        if stats["n"] == 0:
            raise ValueError(f"split '{split}' is empty")
        return dict(stats)

    def click_rate(self, split="train") -> float:
        """The fraction of positive labels in the split."""
        return self.optimum(split)["click_rate"]
