"""Run under ``mpiexec -n K``: read-only lookups (``training=False``) of dynamic tables in a ShardedEmbedding
(``tests/test_dynamic_eval_lookups.py`` checks what it writes against one process).

``python mpi_dynamic_read.py OUT``: :func:`mpi_dynamic.config` trained for :data:`TRAINED` steps, then a
read-only lookup of step :data:`TRAINED`'s batch (keys held, unadmitted, TTL-expired and new ones); on every
rank it checks that no table changed (keys, rows, slots, last_seen, counts, sketch, removal counters) and that
``apply_gradients`` refuses its context on every rank with nothing changed, then writes the rank's read
activations to ``OUT.rank<r>.npz``.
"""

import sys

import numpy as np

import mpi_dynamic
from embedcore.distributed import ShardedEmbedding
from embedcore.distributed.exchange import Refused

TRAINED = 3


def local_state(emb):
    """Everything a lookup could change on this rank, as copies."""
    out = {"step": emb.step}
    for t in emb.dynamic_tables.values():
        s = t.state()
        for k in ("keys", "weights", "last_seen", "counts", "rows", "free"):
            out[f"{t.name}/{k}"] = np.copy(getattr(s, k))
        out.update({f"{t.name}/slot/{k}": np.copy(v) for k, v in s.slots.items()})
        out[f"{t.name}/sketch"] = None if t.sketch is None else t.sketch.counters.copy()
        out[f"{t.name}/removals"] = t.removals
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


def main(out):
    emb = ShardedEmbedding(*mpi_dynamic.config(), seed=mpi_dynamic.SEED)
    world, rank = emb.world_size, emb.rank
    for t in range(TRAINED):
        mpi_dynamic.step(emb, t, mpi_dynamic.assignment(t, world)[rank])
    rows = mpi_dynamic.assignment(TRAINED, world)[rank]
    before = local_state(emb)
    acts, ctx = emb.lookup(*mpi_dynamic.take(mpi_dynamic.global_batch(TRAINED), rows), training=False)
    assert_same(before, local_state(emb))
    try:
        emb.apply_gradients(mpi_dynamic.gradients(acts, TRAINED, rows), ctx)
    except Refused as e:  # every rank refuses it (each its own context), nothing changed anywhere
        assert "training=False" in str(e), e
    else:
        raise AssertionError("the context of a read-only lookup was applied")
    assert_same(before, local_state(emb))
    np.savez(f"{out}.rank{rank}.npz", **{name: a for name, a in acts.items()})
    if rank == 0:
        print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
