"""Where the TensorFlow floor's time goes: the engine's own lookup and update timed inside the ``tf-floor``
contender's ``tf.numpy_function`` ops (run on TensorFlow's executor thread), beside the NumPy API's whole step
on the main thread, alternating, on the TBE shape of ``bench_tensorflow.py``::

    PYTHONPATH=. python benchmarks/profile_tensorflow_floor.py
"""
import os, time, statistics, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"]="3"; os.environ.setdefault("GOMP_SPINCOUNT","100000")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tensorflow as bt
import numpy as np, numba
tf = bt._tf()
tf.config.threading.set_intra_op_parallelism_threads(2); tf.config.threading.set_inter_op_parallelism_threads(1)
numba.set_num_threads(2)
w = bt.tbe_workload(T=8, E=250000, D=64, B=2048, L=20, alpha=1.15, optim=bt.make_optim("adagrad","tf"), n_batches=3)
batches = bt.make_batches(w); init = bt.initial_tables(w)
np_c = bt.NumpyAPI(2); np_c.load(); np_c.setup(w, init)
fl = bt.NumpyFunctionFloor(2); fl.load(); fl.setup(w, init)
eng = fl.engine; acc = {"L": [], "A": []}
L0, A0 = type(eng).lookup, type(eng).apply_gradients
def wl(self, *a, **k):
    t0 = time.perf_counter(); r = L0(self, *a, **k)
    if self is eng: acc["L"].append(time.perf_counter() - t0)
    return r
def wa(self, *a, **k):
    t0 = time.perf_counter(); r = A0(self, *a, **k)
    if self is eng: acc["A"].append(time.perf_counter() - t0)
    return r
type(eng).lookup, type(eng).apply_gradients = wl, wa
res = {"numpy": [], "floor": []}
for r in range(40):
    for name, c in (("numpy", np_c), ("floor", fl)):
        p = c.prepare(batches[r % 3]); t0 = time.perf_counter(); c.run(p); res[name].append(time.perf_counter() - t0)
m = lambda v: round(statistics.median(v[5:]) * 1e3, 2)
print("numpy step", m(res["numpy"]), "floor step", m(res["floor"]), "floor's engine lookup", m(acc["L"]), "apply", m(acc["A"]))
