"""Fork server for the incremental crash test: trains and saves incrementally until it is SIGKILLed.

``python delta_loop.py CKPT`` builds an engine once (Numba compiles it), prints ``ready``, and then reads
commands from stdin, one per line:

* ``fork``: fork a child that restores ``CKPT`` (or, before the first commit, builds a fresh engine), prints
  ``started <pid>`` and then, forever, trains one step (:func:`train_one_step`, a function of the step
  only) and saves with ``incremental=True`` (so a full save after each restart, then deltas), printing
  ``saved <step>`` after each save returned. The server reaps it and prints ``reaped <pid> <wait status>``.
* ``quit``.
"""

import os
import sys

import numpy as np

import embedcore as ec

VOCAB = {"a": 4000, "b": 2500, "c": 1200}


def make_engine():
    a = ec.TableConfig(VOCAB["a"], 16, name="a", combiner="sum")
    b = ec.TableConfig(VOCAB["b"], 16, name="b")  # stacked with a
    c = ec.TableConfig(VOCAB["c"], 8, name="c")
    features = {"fa": ec.FeatureConfig(a), "fb": ec.FeatureConfig(b), "fc": ec.FeatureConfig(c)}
    return ec.Embedding(features, ec.Adagrad(0.1), seed=3)


def train_one_step(emb):
    """One step whose batch and gradients depend only on the engine's step (any two engines replay it)."""
    rng = np.random.default_rng([71, emb.step])
    ids = {"fa": rng.integers(0, VOCAB["a"], (64, 3)), "fb": rng.integers(0, VOCAB["b"], 64),
           "fc": rng.integers(0, VOCAB["c"], 32)}
    acts, ctx = emb(ids)
    emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in acts.items()}, ctx)


def say(text):
    os.write(1, (text + "\n").encode())


def child(path):
    try:
        emb = ec.Embedding.restore(path) if os.path.exists(os.path.join(path, "CURRENT")) else make_engine()
        say(f"started {os.getpid()}")
        while True:
            train_one_step(emb)
            emb.save(path, incremental=True, metadata={"step": emb.step})
            say(f"saved {emb.step}")
    finally:
        os._exit(1)


def main():
    path = sys.argv[1]
    train_one_step(make_engine())  # compile once, before any fork
    say("ready")
    for line in sys.stdin:
        command = line.split()
        if command[0] == "quit":
            return
        assert command[0] == "fork", command
        pid = os.fork()
        if pid == 0:
            child(path)
        _, status = os.waitpid(pid, 0)
        say(f"reaped {pid} {status}")


if __name__ == "__main__":
    main()
