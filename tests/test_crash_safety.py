"""Crash safety: a process SIGKILLed at random moments while saving never leaves a broken or mixed checkpoint.

A fork server (``tests/workers/save_loop.py``) builds two states of an ``Embedding`` once, A and B (different
seeds, data and steps, so every table and slot differs), and for each kill forks a child that saves them
alternately to one checkpoint directory, as fast as it can, numbering each save ``n`` in its metadata (state
``n % 2``). The test kills the child after a random delay and then checks what it left:

* ``Embedding.restore`` and ``emb.load`` succeed (``CURRENT``, the manifest and every tensor's SHA-256 are
  verified) and hold bit for bit the state of checkpoint ``n`` (rebuilt in this process), where ``n`` is
  the last save the child reported or the one it was writing: never an older one, never a mix of two;
* a ``ServingEmbedding`` opens it and looks up the same activations as the state;
* leftovers of the killed save (an uncommitted snapshot directory, a ``CURRENT.*.tmp``, an old snapshot not
  yet pruned) are deleted by the next save that completes.

A kill "lands mid-write" when it leaves such leftovers. ``EMBEDCORE_CRASH_KILLS`` (default 40) sets the
number of kills, ``EMBEDCORE_CRASH_SEED`` the random delays' seed (printed, for replaying a failure).

SIGKILL stops the process, not the machine: this proves atomicity against process crashes. Durability
against power loss (the fsyncs) cannot be tested this way.
"""

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np

import embedcore as ec
from embedcore.checkpoint import open_snapshot, read_extra

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "save_loop.py")
KILLS = int(os.environ.get("EMBEDCORE_CRASH_KILLS", "40"))

_spec = importlib.util.spec_from_file_location("embedcore_test_save_loop", WORKER)
save_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(save_loop)


class Lines:
    """Lines of a pipe, read with a deadline (a hung worker fails the test instead of hanging it)."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        self.buffer = b""

    def next(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"the save worker said nothing for {timeout} s")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise AssertionError(f"the save worker exited (left unread: {self.buffer!r})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def assert_holds(emb, state, what, seed=True):
    assert emb.step == state.step, what
    if seed:  # restore takes the checkpoint's seed; load replaces only tables, slots and step
        assert emb.seed == state.seed, what
    for name, table in state.embedding_tables.items():
        assert np.array_equal(emb.embedding_tables[name], table), f"{what}: table {name}"
        for slot, value in state.slot_variables[name].items():
            assert np.array_equal(emb.slot_variables[name][slot], value), f"{what}: {name}/{slot}"


def assert_serves(path, state, probe):
    server = ec.ServingEmbedding(path)
    assert server.step == state.step
    served = server.lookup(probe)
    expected, _ = state.lookup(probe)
    for name in expected:
        assert np.array_equal(served[name], expected[name]), f"serving: activations of {name}"


def test_sigkill_at_random_moments_of_save(tmp_path):
    path = str(tmp_path / "ckpt")
    seed = int(os.environ.get("EMBEDCORE_CRASH_SEED", int.from_bytes(os.urandom(4), "little")))
    rng = np.random.default_rng(seed)
    proc = subprocess.Popen([sys.executable, WORKER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lines = Lines(proc.stdout)
    child = None
    kinds = {"uncommitted snapshot left": 0, "old snapshot left (killed after commit)": 0,
             "CURRENT.*.tmp left": 0, "nothing left": 0}
    stats = {"kills": 0, "mid_write": 0, "new_state": 0, "cleanup_checked": 0, "saves_done": 0}
    try:
        # Rebuild both states here while the worker builds its own copies.
        states = (save_loop.make_state(0), save_loop.make_state(1))
        target = save_loop.make_engine(12345)  # for emb.load: same configuration, other values
        probe = save_loop.batch(999, 0)
        word, save_seconds = lines.next(timeout=300).split()
        assert word == "ready"
        save_seconds = float(save_seconds)
        n_next, previous_leftovers = 1, set()
        for kill in range(KILLS):
            proc.stdin.write(f"fork {n_next}\n".encode())
            proc.stdin.flush()
            word, pid = lines.next().split()
            assert word == "started"
            child = int(pid)
            delay = rng.uniform(0.0, 2.5 * save_seconds)  # drawn once the child is running
            time.sleep(delay)
            os.kill(child, signal.SIGKILL)
            saved = []
            while True:
                parts = lines.next().split()
                if parts[0] == "reaped":
                    break
                assert parts[0] == "saved", parts
                saved.append(int(parts[1]))
            assert int(parts[1]) == child
            status = int(parts[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            child = None
            stats["kills"] += 1
            stats["saves_done"] += len(saved)
            assert saved == list(range(n_next, n_next + len(saved)))
            last = saved[-1] if saved else n_next - 1

            # Whole, verified, and exactly the last reported checkpoint or the one being written.
            snap = open_snapshot(path)
            _, metadata = read_extra(path)
            n = metadata["n"]
            what = f"kill {kill} after {delay * 1000:.1f} ms (seed {seed}): checkpoint n={n}, last reported {last}"
            assert n in (last, last + 1), what
            state = states[n % 2]
            assert_holds(ec.Embedding.restore(path), state, what)
            target.load(path)
            assert_holds(target, state, what + " (load)", seed=False)
            assert_serves(path, state, probe)

            # What the kill left behind; all of it must be gone once a later save completes.
            leftovers = set(os.listdir(path)) - {"CURRENT", snap.name}
            if saved:  # the child completed a save after the previous kill: it pruned that kill's leftovers
                stats["cleanup_checked"] += bool(previous_leftovers)
                assert not (previous_leftovers & leftovers), f"{what}: not cleaned: {previous_leftovers & leftovers}"
            stale = {x for x in leftovers if x.startswith("snapshot-")}
            tmp = {x for x in leftovers if x.startswith("CURRENT.") and x.endswith(".tmp")}
            assert leftovers == stale | tmp, f"{what}: unexpected files {leftovers - stale - tmp}"
            stats["new_state"] += n == last + 1
            stats["mid_write"] += bool(leftovers)
            if stale and n == last:
                kinds["uncommitted snapshot left"] += 1
            if stale and n == last + 1:
                kinds["old snapshot left (killed after commit)"] += 1
            if tmp:
                kinds["CURRENT.*.tmp left"] += 1
            if not leftovers:
                kinds["nothing left"] += 1
            previous_leftovers = leftovers
            n_next = n + 1
        proc.stdin.write(b"quit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # A save from another process cleans whatever the last kill left, and a CURRENT.*.tmp (a kill between
    # writing the new pointer and renaming it; that window is too short for random kills to hit often).
    open(os.path.join(path, "CURRENT.0badf00d.tmp"), "w").write('{"snapshot": "snapshot-0000')
    back = ec.Embedding.restore(path)
    back.save(path)
    assert sorted(os.listdir(path)) == ["CURRENT", open_snapshot(path).name]
    print(f"\ncrash safety: {stats['kills']} kills (seed {seed}), one save {save_seconds * 1000:.0f} ms; "
          f"{stats['mid_write']} landed mid-write (left leftovers), {stats['new_state']} after the new CURRENT "
          f"was in place but before the save returned; {stats['saves_done']} saves completed between kills; "
          f"leftovers of a kill seen cleaned by the next save {stats['cleanup_checked']} times; {kinds}")
    assert stats["kills"] == KILLS
    if KILLS >= 30:  # the delays cover a few saves: most kills must interrupt one mid-write
        assert stats["mid_write"] >= KILLS // 3, stats
