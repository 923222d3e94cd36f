"""Shared by the MPI workers that misuse an engine: what it holds, and what a call did to it."""

import numpy as np


def state(emb):
    """Step, tables and slots of ``emb`` (this rank's rows), copied."""
    return [emb.step] + [a.copy() for a in emb.embedding_tables.values()] + \
        [v.copy() for slots in emb.slot_variables.values() for v in slots.values()]


def same(a, b):
    return a[0] == b[0] and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a[1:], b[1:]))


def attempt(emb, fn):
    """Run ``fn()``; the error it raised (message, type and its classes), and whether ``emb`` is unchanged."""
    before = state(emb)
    try:
        fn()
        outcome = {"error": None}
    except Exception as e:  # noqa: BLE001  (the test checks which)
        outcome = {"error": str(e), "type": type(e).__name__, "types": [c.__name__ for c in type(e).__mro__]}
    return dict(outcome, unchanged=same(before, state(emb)), step=emb.step)
