"""Fork server for the crash-safety test: saves two known states, alternately, until it is SIGKILLed.

``python save_loop.py CKPT`` builds the two states once (engines take seconds to build, a fork takes
milliseconds), commits state 0 to ``CKPT`` and prints ``ready <seconds one save took>``. It then reads
commands from stdin, one per line:

* ``fork N``: fork a child that prints ``started <pid>`` and then saves forever: checkpoint number N, N + 1,
  ... with ``metadata={"n": n}``, the tensors of ``state(n % 2)``, printing ``saved n`` after each save
  returned. The test SIGKILLs the child at a random moment; the server reaps it and prints
  ``reaped <pid> <wait status>``.
* ``quit``.

Every line is written with one ``os.write`` (atomic on a pipe), so lines of parent and child never mix.
The test imports this file to rebuild both states bit for bit (:func:`make_state`).
"""

import os
import sys
import time

import numpy as np

import embedcore as ec

SEEDS = (11, 22)  # state 0 (A) and state 1 (B): different initial values in every table ...
STEPS = (1, 2)    # ... and a different step


def make_engine(seed):
    """About 12 MB of tensors in 3 files: a save takes tens of milliseconds (hash, write, fsync).

    One optimizer (Adagrad, in two physical tables: dims 16 and 8), as each optimizer costs seconds of
    Numba compilation in every process."""
    big = ec.TableConfig(60_000, 16, name="big", combiner="sum")
    side = ec.TableConfig(20_000, 16, name="side")  # stacked with "big": same optimizer and dim
    narrow = ec.TableConfig(30_000, 8, name="narrow")
    features = {"big": ec.FeatureConfig(big), "side": ec.FeatureConfig(side),
                "narrow": ec.FeatureConfig(narrow, max_sequence_length=3)}
    return ec.Embedding(features, ec.Adagrad(0.1), seed=seed)


def batch(seed, t):
    rng = np.random.default_rng([seed, t])
    return {"big": rng.integers(0, 60_000, (512, 4)), "side": rng.integers(0, 20_000, 512),
            "narrow": rng.integers(0, 30_000, (512, 5))}


def train_step(emb, t):
    acts, ctx = emb.lookup(batch(emb.seed, t))
    rng = np.random.default_rng([emb.seed, t, 1])
    emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}, ctx)


def make_state(which):
    """State 0 (A) or 1 (B): every table and slot differs between the two (seeds, data and steps differ)."""
    emb = make_engine(SEEDS[which])
    for t in range(STEPS[which]):
        train_step(emb, t)
    return emb


def say(text):
    os.write(1, (text + "\n").encode())


def child(path, states, n):
    try:
        say(f"started {os.getpid()}")
        while True:
            states[n % 2].save(path, metadata={"n": n})
            say(f"saved {n}")
            n += 1
    finally:
        os._exit(1)


def main():
    path = sys.argv[1]
    states = (make_state(0), make_state(1))
    start = time.perf_counter()
    states[0].save(path, metadata={"n": 0})
    say(f"ready {time.perf_counter() - start:.4f}")
    for line in sys.stdin:
        command = line.split()
        if command[0] == "quit":
            return
        assert command[0] == "fork", command
        pid = os.fork()
        if pid == 0:
            child(path, states, int(command[1]))
        _, status = os.waitpid(pid, 0)
        say(f"reaped {pid} {status}")


if __name__ == "__main__":
    main()
