"""The on-disk cache of generated kernels: a second process compiles nothing, and never runs stale code."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from embedcore import compile_cache

WORKER = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import my_optimizer
    import embedcore as ec
    from embedcore.kernels.update import fused_update_kernel

    t0 = time.perf_counter()
    opt = ec.CustomOptimizer(my_optimizer.scaled_adagrad, learning_rate=0.5, slot_names=["a"],
                             slot_initializers=[0.1], hyperparameters=[2.0])
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(20, 8, name="t", initializer=ec.Zeros()))}, opt)
    built = time.perf_counter() - t0
    acts, ctx = emb({"f": np.array([1, 3, 3, 7])})
    t1 = time.perf_counter()
    emb.apply_gradients({"f": np.ones_like(acts["f"])}, ctx)
    applied = time.perf_counter() - t1
    group = emb.physical_tables[0]
    kernel = fused_update_kernel(group.row_function, dim=group.dim)
    print(json.dumps({"table": emb.embedding_tables["t"].tolist(),
                      "kernel_hits": sum(kernel.stats.cache_hits.values()),
                      "kernel_misses": sum(kernel.stats.cache_misses.values()),
                      "row_function_compiled": len(group.row_function.dispatcher.overloads),
                      "cached": group.row_function.fingerprint is not None,
                      "build_s": built, "first_apply_s": applied}))
''')

OPTIMIZER = textwrap.dedent('''
    import numpy as np
    SCALE = {scale}

    def scaled_adagrad(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        accumulator = slot_variables[0] + gradient * gradient
        step = SCALE * hyperparameters[0] * learning_rate * gradient / np.sqrt(accumulator)
        return embedding_table - step, accumulator
''')


def _run(tmp_path, scale):
    (tmp_path / "my_optimizer.py").write_text(OPTIMIZER.format(scale=scale))
    (tmp_path / "worker.py").write_text(WORKER)
    env = dict(os.environ, EMBEDCORE_CACHE_DIR=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(scale):
    counts = np.zeros(20)
    np.add.at(counts, [1, 3, 3, 7], 1.0)
    table = np.zeros((20, 8), np.float32)
    g = counts[:, None].astype(np.float32) * np.ones(8, np.float32)
    touched = counts > 0
    accumulator = np.float32(0.1) + g * g
    table[touched] -= (np.float32(scale) * np.float32(2.0) * np.float32(0.5) * g / np.sqrt(accumulator))[touched]
    return table


def test_a_second_process_loads_the_kernel_and_verdict_from_disk(tmp_path):
    first = _run(tmp_path, 1.0)
    second = _run(tmp_path, 1.0)
    assert first["cached"] and second["cached"]
    assert first["kernel_misses"] == 1 and first["kernel_hits"] == 0
    assert second["kernel_hits"] == 1 and second["kernel_misses"] == 0
    assert first["row_function_compiled"] >= 1 and second["row_function_compiled"] == 0
    assert first["table"] == second["table"]
    np.testing.assert_allclose(np.array(second["table"]), _expected(1.0), rtol=1e-6)
    print(f"\nfirst process: build {first['build_s']:.2f} s, first apply {first['first_apply_s']:.2f} s; second: "
          f"build {second['build_s']:.2f} s, first apply {second['first_apply_s']:.2f} s")


def test_a_changed_global_is_never_served_a_stale_kernel(tmp_path):
    before = _run(tmp_path, 1.0)
    after = _run(tmp_path, 3.0)  # same function source, a global it reads changed
    assert after["kernel_misses"] == 1 and after["row_function_compiled"] >= 1
    np.testing.assert_allclose(np.array(before["table"]), _expected(1.0), rtol=1e-6)
    np.testing.assert_allclose(np.array(after["table"]), _expected(3.0), rtol=1e-6)


def test_fingerprints_follow_code_closures_globals_and_callees():
    def make(c):
        def f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
            return embedding_table - c * learning_rate * gradient
        return f

    assert compile_cache.fingerprint(make(1.0)) == compile_cache.fingerprint(make(1.0))
    assert compile_cache.fingerprint(make(1.0)) != compile_cache.fingerprint(make(2.0))

    def helper_a(x):
        return x * 2

    def helper_b(x):
        return x * 3

    def uses(helper):
        def f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
            return embedding_table - learning_rate * helper(gradient)
        return f

    assert compile_cache.fingerprint(uses(helper_a)) != compile_cache.fingerprint(uses(helper_b))
    weights = np.arange(4.0)
    assert compile_cache.fingerprint(uses(weights)) != compile_cache.fingerprint(uses(weights + 1))

    class Opaque:
        pass

    with pytest.raises(compile_cache.Uncacheable):
        compile_cache.fingerprint(uses(Opaque()))


def test_caching_can_be_switched_off(monkeypatch):
    for value in ("off", "", "0"):
        monkeypatch.setenv("EMBEDCORE_CACHE_DIR", value)
        assert compile_cache.cache_dir() is None


def test_built_in_optimizers_are_cacheable():
    import embedcore as ec
    for opt in (ec.SGD(0.1), ec.Adagrad(0.1, clipvalue=1.0), ec.Adam(0.1, weight_decay_factor=0.1),
                ec.FTRL(0.1), ec.RowwiseAdagrad(0.1), ec.AdagradMomentum(0.1, momentum=0.9)):
        assert compile_cache.fingerprint(opt.row_function())


def test_fingerprints_follow_attributes_of_modules():
    """``helpers.scale(g)`` and ``cfg.EPS`` reach values through a module: a changed attribute must change
    the fingerprint (the module's name alone does not)."""
    import types
    helpers = types.ModuleType("helpers_for_fingerprints")
    helpers.scale = lambda x: x * 1.0
    helpers.EPS = 1e-8
    namespace = {"helpers": helpers, "np": np}
    exec("def f(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):\n"
         "    return embedding_table - learning_rate * helpers.scale(gradient) + helpers.EPS\n", namespace)
    f = namespace["f"]
    before = compile_cache.fingerprint(f)
    helpers.scale = lambda x: x * 100.0
    after_function = compile_cache.fingerprint(f)
    helpers.EPS = 1e-6
    after_constant = compile_cache.fingerprint(f)
    assert len({before, after_function, after_constant}) == 3


def test_library_functions_are_identified_by_name_not_walked():
    def uses_numpy(gradient, embedding_table, slot_variables, learning_rate, hyperparameters):
        return embedding_table - learning_rate * gradient / np.linalg.norm(gradient) * np.float32(2)
    assert compile_cache.fingerprint(uses_numpy) == compile_cache.fingerprint(uses_numpy)


def test_a_cache_folder_others_may_write_to_is_not_used(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    monkeypatch.setenv("EMBEDCORE_CACHE_DIR", str(shared))
    folder = compile_cache.cache_dir()
    assert folder is not None and (os.stat(folder).st_mode & 0o777) == 0o700
    os.chmod(folder, 0o777)
    assert compile_cache.cache_dir() is None


def test_a_tampered_kernel_file_is_rewritten_before_use(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDCORE_CACHE_DIR", str(tmp_path / "cache"))
    source = "def kernel():\n    return 1\n"
    assert compile_cache.load_source(source, {}, "kernel", ("test", 1))() == 1
    path = next(p for p in (tmp_path / "cache").rglob("kernel_*.py"))
    path.write_text("def kernel():\n    return 666\n")
    import sys
    for name in [n for n, m in sys.modules.items() if getattr(m, "__file__", None) == str(path)]:
        del sys.modules[name]  # as in a new process
    assert compile_cache.load_source(source, {}, "kernel", ("test", 1))() == 1
    assert path.read_text() == source


def test_a_kernel_is_keyed_by_the_modules_it_is_built_from_not_the_whole_package():
    """An edit to a module no kernel code comes from (the engine, the dynamic tables' key map) leaves the
    update and gather kernels cached; an edit to one whose code they inline (the row sums) does not."""
    import embedcore as ec
    from embedcore.kernels.update import kernel_namespace
    namespace = kernel_namespace(ec.Adagrad(0.1).compiled(64))
    without_row_function = {k: v for k, v in namespace.items() if k != "fn"}
    files = compile_cache.module_files(*compile_cache.namespace_modules(without_row_function), "embedcore.compiler")
    for built_from in ("kernels/update.py", "kernels/rows.py", "kernels/row_vector.py", "kernels/half.py",
                       "compiler.py", "split_reductions.py"):
        assert built_from in files
    for elsewhere in ("engine.py", "optimizers.py", "kernels/hash_map.py", "kernels/dedup.py", "tables/physical.py",
                      "torch.py", "checkpoint/store.py"):
        assert elsewhere not in files
    assert "embedcore.optimizers" in compile_cache.namespace_modules(namespace)  # the built-in recipe's module:
    # left out of the key because the row function's fingerprint covers its code


def test_the_key_changes_with_a_module_the_kernel_is_built_from(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDCORE_CACHE_DIR", str(tmp_path / "cache"))
    from embedcore.kernels import rows
    source = "def kernel():\n    return 1\n"
    modules = {"embedcore.kernels.rows"}
    before = compile_cache._key(modules, source)
    assert compile_cache._key({"embedcore.kernels.dedup"}, source) != before
    monkeypatch.setattr(compile_cache, "_DIGESTS", {})
    real_open = open

    def edited(path, *args, **kwargs):  # the same files, one of them edited
        f = real_open(path, *args, **kwargs)
        if str(path).endswith(os.path.join("kernels", "half.py")):
            import io
            return io.BytesIO(f.read() + b"\n# edited\n")
        return f
    monkeypatch.setattr("builtins.open", edited)
    assert compile_cache._key(modules, source) != before  # rows.py imports half.py: its edit counts
    assert rows.__name__ in modules
