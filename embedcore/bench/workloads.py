"""Workloads of the step benchmark: shapes, id distributions, batches, optimizer math and the bytes model.

A :class:`Workload` is ``T`` tables of ``E`` rows x ``D`` float32, one pooled feature per table (sum
pooling, optionally weighted), batches of ``B`` bags of ``L`` ids, and one optimizer (:class:`OptimSpec`).
Every contender trains its own copy of the same initial tables on the same batches, in the same order.

``kind="train"``: a step is forward (pooled lookup) + backward + optimizer, the loss being
``sum over tables of <pooled output, G>`` with ``G`` a fixed random ``[B, D]`` array per table and step
(so ``d loss / d output = G``: every contender gets the same upstream gradient without a dense model).
``kind="update"``: only the backward + optimizer part is timed; the forward (or lookup) that a contender
needs to run its backward happens before the clock starts.
``kind="lookup"``: only the forward (pooled lookup, no gradient bookkeeping) is timed.

Id distributions (ranks ``0, 1, ...`` are spread over the rows by a fixed bijection
``row = (a * rank + b_t) mod E``, ``a`` coprime to ``E``, ``b_t`` per table, so hot rows are not adjacent):

* ``fbgemm``: FBGEMM's TBE benchmark generator (``fbgemm_gpu.tbe.utils.requests``), re-implemented: per bag,
  ``max(3 L, 20)`` draws of ``Generator.zipf(alpha) - 1`` mod ``E``, keeping the ``L`` smallest *distinct*
  values (a bag with fewer than ``L`` distinct values is drawn again). With alpha 1.15 this concentrates a
  step on ~1,000 distinct rows per table: the shape measures pooling and duplicate reduction more than
  memory traffic.
* ``zipf``: plain draws ``(Generator.zipf(alpha) - 1) mod E``; duplicates within a bag allowed.
* ``bounded``: BENCHMARKS.md's update shape: ranks by inverse-CDF sampling of ``p(k) ~ 1/k^alpha`` over
  ``k = 1..E``; with ``alpha=None`` alpha is calibrated so that the expected number of unique ids per step
  is ``unique_target``.
* ``uniform``: ids uniform over the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..kernels.aligned import aligned_empty

__all__ = ["OPTIMIZERS", "OptimSpec", "make_optim", "Workload", "Batch", "make_batches", "initial_tables",
           "on_a_cache_line", "step_bytes", "calibrate_alpha", "numpy_pool", "numpy_apply", "tbe_workload",
           "update_workload"]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
DISTRIBUTIONS = ("fbgemm", "zipf", "bounded", "uniform")


# ----------------------------------------------------------------------------------------------------------
# Optimizers: one matching definition for every contender

@dataclass(frozen=True)
class OptimSpec:
    """One optimizer, with the constants every contender is configured with.

    * ``sgd``: ``w -= lr g``.
    * ``adagrad``: ``a += g^2; w -= lr g / (sqrt(a) + eps)``, ``a`` starting at ``initial_accumulator``.
      Style ``tf`` (default): a0 = 0.1, eps = 0 (TensorFlow's / embedcore's ``Adagrad``); style ``fbgemm``:
      a0 = 0, eps = 1e-8 (FBGEMM's ``EXACT_ADAGRAD`` defaults).
    * ``rowwise_adagrad``: ``a += mean(g^2)`` (one value per row); ``w -= lr g / (sqrt(a) + eps)``, a0 = 0,
      eps = 1e-8 (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``; embedcore ``RowwiseAdagrad(0, epsilon=1e-8)``).
    * ``adam``: lazy Adam (touched rows only): ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
      w -= lr_t m / (sqrt(v) + eps)``, ``lr_t = lr sqrt(1 - b2^t) / (1 - b1^t)`` (torch ``SparseAdam``;
      embedcore ``Adam(lazy_adam=True, sum_inside_sqrt=False, bias_correction=True)``).
    """

    name: str
    lr: float
    initial_accumulator: float = 0.0
    eps: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    style: str = ""

    @property
    def label(self):
        return self.name + (f"[{self.style}]" if self.style else "")

    def slot_shapes(self, rows, dim):
        """Shapes of the slot arrays of one table, in the order every contender reports them."""
        return {"sgd": [], "adagrad": [(rows, dim)], "rowwise_adagrad": [(rows,)],
                "adam": [(rows, dim), (rows, dim)]}[self.name]

    def slot_initial_values(self):
        return {"sgd": [], "adagrad": [self.initial_accumulator], "rowwise_adagrad": [self.initial_accumulator],
                "adam": [0.0, 0.0]}[self.name]

    def slot_bytes_per_row(self, dim):
        """Bytes of optimizer state read + written per updated row."""
        return 2 * 4 * {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1, "adam": 2 * dim}[self.name]

    def adam_lr(self, step):
        """Adam's bias-corrected learning rate at ``step`` (from 1)."""
        return self.lr * math.sqrt(1.0 - self.beta2 ** step) / (1.0 - self.beta1 ** step)

    def describe(self):
        if self.name == "sgd":
            return f"SGD lr={self.lr}"
        if self.name == "adagrad":
            return (f"Adagrad ({self.style} style) lr={self.lr} initial_accumulator={self.initial_accumulator} "
                    f"eps={self.eps}")
        if self.name == "rowwise_adagrad":
            return f"rowwise Adagrad lr={self.lr} initial_accumulator={self.initial_accumulator} eps={self.eps}"
        return f"lazy Adam lr={self.lr} beta1={self.beta1} beta2={self.beta2} eps={self.eps} (eps outside sqrt)"


def make_optim(name, adagrad_style="tf", lr=None):
    if name == "sgd":
        return OptimSpec("sgd", 0.01 if lr is None else lr)
    if name == "adagrad":
        if adagrad_style == "tf":
            return OptimSpec("adagrad", 0.01 if lr is None else lr, 0.1, 0.0, style="tf")
        if adagrad_style == "fbgemm":
            return OptimSpec("adagrad", 0.01 if lr is None else lr, 0.0, 1e-8, style="fbgemm")
        raise ValueError(f"adagrad style must be 'tf' or 'fbgemm', got {adagrad_style!r}")
    if name == "rowwise_adagrad":
        return OptimSpec("rowwise_adagrad", 0.01 if lr is None else lr, 0.0, 1e-8)
    if name == "adam":
        return OptimSpec("adam", 0.001 if lr is None else lr, 0.0, 1e-8)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


# ----------------------------------------------------------------------------------------------------------
# Workloads and batches

@dataclass
class Workload:
    name: str                  # "tbe", "update", "sweep-rows", "sweep-ids"
    kind: str                  # "train", "update" or "lookup"
    T: int
    E: int
    D: int
    B: int
    L: int
    optim: OptimSpec
    dist: str = "fbgemm"
    alpha: float | None = 1.15
    weighted: bool = False
    n_batches: int = 4
    seed: int = 0
    init: str = "random"       # "random" (uniform +-1/sqrt(D)) or "zeros"
    unique_target: int = 150_000
    extra: dict = field(default_factory=dict)

    @property
    def n_ids(self):
        return self.T * self.B * self.L

    @property
    def label(self):
        w = "weighted" if self.weighted else "unweighted"
        alpha = "calibrated" if self.alpha is None else f"{self.alpha:.3g}"
        return (f"{self.name}: T={self.T} E={self.E:,} D={self.D} B={self.B:,} L={self.L} {self.dist}"
                f"(alpha={alpha}) {w} {self.optim.label} [{self.kind}]")

    def table_bytes(self):
        """Bytes of one contender's tables + slots."""
        slots = sum(int(np.prod(s)) for s in self.optim.slot_shapes(self.E, self.D))
        return 4 * self.T * (self.E * self.D + slots)

    def as_dict(self):
        return {"name": self.name, "kind": self.kind, "T": self.T, "E": self.E, "D": self.D, "B": self.B,
                "L": self.L, "optimizer": self.optim.label, "optimizer_detail": self.optim.describe(),
                "dist": self.dist, "alpha": self.alpha, "weighted": self.weighted, "n_batches": self.n_batches,
                "seed": self.seed, "init": self.init, "ids_per_step": self.n_ids, **self.extra}


def tbe_workload(T=8, E=250_000, D=64, B=2048, L=20, optim=None, weighted=False, alpha=1.15, dist="fbgemm",
                 n_batches=4, seed=0):
    return Workload("tbe", "train", T, E, D, B, L, optim or make_optim("adagrad"), dist, alpha, weighted,
                    n_batches, seed)


def update_workload(E=2_000_000, D=64, ids=262_144, optim=None, alpha=None, unique_target=150_000,
                    n_batches=4, seed=0, kind="update"):
    return Workload(kind, kind, 1, E, D, ids, 1, optim or make_optim("adagrad"), "bounded", alpha, False,
                    n_batches, seed, unique_target=unique_target)


@dataclass
class Batch:
    """One step's input: per table ``ids`` [T, n], ``offsets`` [T, B+1], optional ``weights`` [T, n], the upstream
    gradient ``grad`` [T, B, D] (d loss / d pooled output), and the number of distinct ids per table."""

    ids: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    grad: np.ndarray
    n_unique: list

    @property
    def segments(self):
        """[T, n] int64: the bag of every id."""
        seg = getattr(self, "_segments", None)
        if seg is None:
            T, B = self.offsets.shape[0], self.offsets.shape[1] - 1
            seg = np.stack([np.repeat(np.arange(B, dtype=np.int64), np.diff(self.offsets[t])) for t in range(T)])
            self._segments = seg
        return seg


def _scramble(ranks, E, t, seed):
    """A fixed bijection of ``0..E-1`` (per table): ``(a * rank + b) mod E`` with ``gcd(a, E) = 1``."""
    a = 2_654_435_761 % E if E > 1 else 1
    while math.gcd(a, E) != 1:
        a += 1
    b = (seed * 1_000_003 + t * 7_919_993) % E
    return (ranks.astype(np.int64) % E * a + b) % E


def _expected_unique(alpha, n, log_k):
    p = np.exp(-alpha * log_k)
    p /= p.sum()
    return float((-np.expm1(n * np.log1p(-p))).sum())


def calibrate_alpha(rows, n, target):
    """Alpha of the bounded Zipf over ``rows`` ranks whose expected unique count for ``n`` draws is ``target``."""
    log_k = np.log(np.arange(1, rows + 1, dtype=np.float64))
    lo, hi = 0.0, 3.0
    for _ in range(24):  # 3 / 2^24: far below the noise of the unique count
        mid = 0.5 * (lo + hi)
        if _expected_unique(mid, n, log_k) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _fbgemm_bags(rng, B, L, E, alpha, oversample=3):
    if L > E:
        raise ValueError(f"fbgemm distribution needs L <= E (L distinct ids per bag), got L={L}, E={E}")
    width = max(oversample * L, 20)
    out = np.empty((B, L), np.int64)
    todo = np.arange(B)
    for _ in range(1000):
        if not todo.size:
            break
        draws = (rng.zipf(alpha, (todo.size, width)) - 1) % E
        s = np.sort(draws, axis=1)
        distinct = np.ones(s.shape, bool)
        distinct[:, 1:] = s[:, 1:] != s[:, :-1]
        ok = distinct.sum(1) >= L
        keep = distinct & (np.cumsum(distinct, axis=1) <= L)
        out[todo[ok]] = s[ok][keep[ok]].reshape(-1, L)
        todo = todo[~ok]
    else:
        raise ValueError(f"alpha {alpha} too skewed for {L} distinct ids per bag out of {width} draws")
    return out.reshape(-1)


def make_batches(w: Workload):
    """The workload's ``n_batches`` batches (deterministic in ``w.seed``); resolves a calibrated alpha."""
    rng = np.random.default_rng(w.seed)
    n = w.B * w.L
    cdf = None
    if w.dist == "bounded":
        if w.alpha is None:
            w.alpha = calibrate_alpha(w.E, n, min(w.unique_target, n))
        cdf = np.cumsum(np.arange(1, w.E + 1, dtype=np.float64) ** -w.alpha)
        cdf /= cdf[-1]
    elif w.dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {w.dist!r}; choose from {DISTRIBUTIONS}")
    offsets = np.tile(np.arange(0, n + 1, w.L, dtype=np.int64), (w.T, 1))
    batches = []
    for _ in range(w.n_batches):
        ids = np.empty((w.T, n), np.int64)
        for t in range(w.T):
            if w.dist == "fbgemm":
                ranks = _fbgemm_bags(rng, w.B, w.L, w.E, w.alpha)
            elif w.dist == "zipf":
                ranks = (rng.zipf(w.alpha, n) - 1) % w.E
            elif w.dist == "bounded":
                ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), w.E - 1)
            else:
                ranks = rng.integers(0, w.E, n)
            ids[t] = _scramble(ranks, w.E, t, w.seed)
        weights = rng.random((w.T, n), dtype=np.float32) if w.weighted else None
        grad = rng.standard_normal((w.T, w.B, w.D), dtype=np.float32)
        n_unique = [int(np.unique(ids[t]).size) for t in range(w.T)]
        batches.append(Batch(*(None if a is None else on_a_cache_line(a) for a in (ids, offsets, weights, grad)),
                             n_unique))
    return batches


def on_a_cache_line(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` starting on a 64-byte line, as torch's and XLA's allocators place tensors (NumPy's
    malloc gives 16 bytes): every contender then reads its inputs' rows, the upstream gradient's above all,
    from the same alignment."""
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def initial_tables(w: Workload):
    """The tables every contender starts from: T arrays [E, D] float32, or None for ``init="zeros"`` (each
    contender then writes zeros itself, touching every page before the clock starts)."""
    if w.init == "zeros":
        return None
    rng = np.random.default_rng(w.seed + 12345)
    bound = 1.0 / math.sqrt(w.D)
    out = []
    for _ in range(w.T):
        table = np.empty((w.E, w.D), np.float32)
        for lo in range(0, w.E, 1 << 18):
            hi = min(lo + (1 << 18), w.E)
            table[lo:hi] = rng.uniform(-bound, bound, (hi - lo, w.D)).astype(np.float32)
        out.append(table)
    return out


def step_bytes(w: Workload, batch: Batch):
    """The bytes a step must move at least (float32), split into random-row and sequential traffic.

    Random rows: forward reads ``n`` rows of ``D`` floats (train and lookup); the update reads and writes each
    distinct row and its optimizer state: ``n_unique * (2 D 4 + slot bytes)`` (train and update). Sequential:
    the pooled output written (train and lookup) and the upstream gradient read (train and update),
    ``B D 4`` each per table. Ids, weights and any workspace are not counted.
    """
    rows = seq = 0
    per_row = 2 * w.D * 4 + w.optim.slot_bytes_per_row(w.D)
    for t in range(w.T):
        n = int(batch.offsets[t, -1])
        if w.kind in ("train", "lookup"):
            rows += n * w.D * 4
            seq += w.B * w.D * 4
        if w.kind in ("train", "update"):
            rows += batch.n_unique[t] * per_row
            seq += w.B * w.D * 4
    return {"random_row_bytes": rows, "sequential_bytes": seq, "total_bytes": rows + seq}


# ----------------------------------------------------------------------------------------------------------
# The NumPy reference math (shared by the NumPy contender and the checks)

def numpy_pool(table, ids, offsets, weights):
    """Sum pooling of ``table[ids]`` (times ``weights``) per bag: [B, D]."""
    rows = table[ids]
    if weights is not None:
        rows *= weights[:, None]
    B = offsets.shape[0] - 1
    out = np.zeros((B, table.shape[1]), np.float32)
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    if rows.shape[0]:
        sums = np.add.reduceat(rows, np.minimum(offsets[:-1], rows.shape[0] - 1), axis=0)
        out[nonempty] = sums[nonempty]
    return out


def numpy_apply(optim: OptimSpec, table, slots, ids, row_grads, step):
    """Sum ``row_grads`` per distinct id (``np.unique`` + ``np.add.at``), then update those rows in place."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    g = np.zeros((uniq.shape[0], table.shape[1]), np.float32)
    np.add.at(g, inverse, row_grads)
    lr = np.float32(optim.lr)
    w = table[uniq]
    if optim.name == "sgd":
        w -= lr * g
    elif optim.name == "adagrad":
        a = slots[0][uniq] + g * g
        w -= lr * g / (np.sqrt(a) + np.float32(optim.eps))
        slots[0][uniq] = a
    elif optim.name == "rowwise_adagrad":
        a = slots[0][uniq] + (g * g).mean(axis=1, dtype=np.float32)
        w -= (lr / (np.sqrt(a) + np.float32(optim.eps)))[:, None] * g
        slots[0][uniq] = a
    elif optim.name == "adam":
        b1, b2 = np.float32(optim.beta1), np.float32(optim.beta2)
        m = b1 * slots[0][uniq] + (np.float32(1) - b1) * g
        v = b2 * slots[1][uniq] + (np.float32(1) - b2) * g * g
        w -= np.float32(optim.adam_lr(step)) * m / (np.sqrt(v) + np.float32(optim.eps))
        slots[0][uniq] = m
        slots[1][uniq] = v
    else:
        raise ValueError(optim.name)
    table[uniq] = w
    return uniq.shape[0]


def with_optim(w: Workload, optim: OptimSpec) -> Workload:
    return replace(w, optim=optim)
