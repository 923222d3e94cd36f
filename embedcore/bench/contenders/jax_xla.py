"""JAX / XLA on the CPU: one jitted step over all tables with the tables and optimizer state donated.

Train step (``jax.jit(step, donate_argnums=(0, 1))``): per table ``jnp.take(table, ids)`` (times the
weights) and ``jax.ops.segment_sum`` over bags, the loss ``sum <out, G>``, ``jax.grad`` w.r.t. the tables
(a dense ``[E, D]`` gradient per table: XLA scatter-adds the id gradients into zeros), and the optimizer
applied to the *whole* table (untouched rows get a zero gradient, which leaves them unchanged for SGD and
both Adagrads; lazy Adam masks the untouched rows with a scatter of the ids). Update-only: the same
without the forward: the id gradients ``G[bag] * weight`` scatter-added into a dense gradient. Timed: the
call plus ``block_until_ready``. Inputs are put on the device before the clock starts. Whether XLA could
donate (update in place) is checked after the first call and reported.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from . import Contender, Skip

try:
    import jax
    import jax.numpy as jnp
except Exception as exc:
    raise Skip(f"jax not importable: {type(exc).__name__}: {exc}") from None


def _update(o, tables, slots, grads, ids, lr_t):
    new_t, new_s = [], []
    for t, (w, g) in enumerate(zip(tables, grads)):
        s = slots[t]
        if o.name == "sgd":
            new_t.append(w - o.lr * g)
            new_s.append(())
        elif o.name == "adagrad":
            a = s[0] + g * g
            new_t.append(w - o.lr * g / (jnp.sqrt(a) + o.eps))
            new_s.append((a,))
        elif o.name == "rowwise_adagrad":
            a = s[0] + jnp.mean(g * g, axis=1)
            new_t.append(w - (o.lr / (jnp.sqrt(a) + o.eps))[:, None] * g)
            new_s.append((a,))
        elif o.name == "adam":
            touched = jnp.zeros(w.shape[0], bool).at[ids[t]].set(True)[:, None]
            m = jnp.where(touched, o.beta1 * s[0] + (1.0 - o.beta1) * g, s[0])
            v = jnp.where(touched, o.beta2 * s[1] + (1.0 - o.beta2) * g * g, s[1])
            new_t.append(jnp.where(touched, w - lr_t * m / (jnp.sqrt(v) + o.eps), w))
            new_s.append((m, v))
        else:
            raise ValueError(o.name)
    return tuple(new_t), tuple(new_s)


def _pool(tables, ids, segs, weights, B):
    outs = []
    for t, table in enumerate(tables):
        rows = jnp.take(table, ids[t], axis=0)
        if weights is not None:
            rows = rows * weights[t][:, None]
        outs.append(jax.ops.segment_sum(rows, segs[t], num_segments=B, indices_are_sorted=True))
    return outs


class JaxContender(Contender):
    name = "jax"
    kinds = ("train", "update")
    label = "JAX/XLA (jit, donated)"
    measures = ("one jitted step: take + segment_sum pooling, jax.grad (dense [E, D] table gradients), "
                "optimizer on the whole tables, tables/state donated; + block_until_ready "
                "(update-only: scatter-add of the id gradients + whole-table optimizer)")
    optimizers = ("sgd", "adagrad", "rowwise_adagrad", "adam")
    memory_factor = 2.2  # + a dense gradient per table and XLA temporaries

    def load(self):
        self.info["jax"] = jax.__version__
        self.info["jax_backend"] = jax.default_backend()
        self.info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
        self.info["xla_threads"] = (f"XLA's CPU intra-op pool is sized by the machine ({os.cpu_count()} CPUs); "
                                    f"jax {jax.__version__} has no per-process thread-count setting")

    def setup(self, w, init):
        self.w = w
        o = w.optim
        B = w.B

        def train(tables, slots, ids, segs, weights, grads, lr_t):
            def loss(tabs):
                return sum(jnp.vdot(out, g) for out, g in zip(_pool(tabs, ids, segs, weights, B), grads))
            return _update(o, tables, slots, jax.grad(loss)(tables), ids, lr_t)

        def update(tables, slots, ids, segs, weights, grads, lr_t):
            dense = []
            for t, table in enumerate(tables):
                g = grads[t][segs[t]]
                if weights is not None:
                    g = g * weights[t][:, None]
                dense.append(jnp.zeros_like(table).at[ids[t]].add(g))
            return _update(o, tables, slots, dense, ids, lr_t)

        self._step = jax.jit(train if w.kind == "train" else update, donate_argnums=(0, 1))
        self._pool = jax.jit(lambda tables, ids, segs, weights: jnp.stack(_pool(tables, ids, segs, weights, B)))
        if init is not None:
            self.tables = tuple(jnp.array(x, copy=True) for x in init)  # own buffers: init is shared
        else:
            self.tables = tuple(jnp.zeros((w.E, w.D), jnp.float32) for _ in range(w.T))
        self.state = tuple(tuple(jnp.full(shape, value, jnp.float32)
                                 for shape, value in zip(o.slot_shapes(w.E, w.D), o.slot_initial_values()))
                           for _ in range(w.T))
        jax.block_until_ready((self.tables, self.state))
        self.step = 0
        self._checked_donation = False

    def _inputs(self, batch):
        ids = tuple(jax.device_put(batch.ids[t].astype(np.int32)) for t in range(self.w.T))
        segs = tuple(jax.device_put(batch.segments[t].astype(np.int32)) for t in range(self.w.T))
        weights = None if batch.weights is None else tuple(jax.device_put(batch.weights[t])
                                                            for t in range(self.w.T))
        return ids, segs, weights

    def prepare(self, batch):
        ids, segs, weights = self._inputs(batch)
        grads = tuple(jax.device_put(batch.grad[t]) for t in range(self.w.T))
        lr_t = np.float32(self.w.optim.adam_lr(self.step + 1) if self.w.optim.name == "adam" else 0.0)
        return jax.block_until_ready((ids, segs, weights, grads)) + (lr_t,)

    def run(self, prepared):
        ids, segs, weights, grads, lr_t = prepared
        old = jax.tree_util.tree_leaves((self.tables, self.state))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.tables, self.state = self._step(self.tables, self.state, ids, segs, weights, grads, lr_t)
            jax.block_until_ready((self.tables, self.state))
        self.step += 1
        if not self._checked_donation:
            self._checked_donation = True
            donated = all(x.is_deleted() for x in old)
            notes = [str(c.message).splitlines()[0] for c in caught if "donat" in str(c.message).lower()]
            self.info["donation"] = ("honoured: tables and state updated in place" if donated and not notes
                                     else "NOT honoured (XLA copied the tables): " + ("; ".join(notes) or
                                                                                      "inputs not deleted"))
        return None

    def forward(self, batch):
        return np.asarray(self._pool(self.tables, *self._inputs(batch)))

    def table(self, t):
        return np.array(self.tables[t])  # a copy: a view would keep the buffer from being donated

    def slots(self, t):
        return [np.array(s) for s in self.state[t]]

    def close(self):
        self.tables = self.state = None
        self._step = self._pool = None
