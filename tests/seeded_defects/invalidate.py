"""Delete the Numba on-disk caches (``__pycache__/*.nbi|*.nbc``) that may hold code compiled from a file a
defect patch touches.

Numba keys a ``cache=True`` function's cache by its own source file's time stamp only; a function that inlines
code from another embedcore module (an intrinsic of kernels/half_ir.py, say) would load its cached machine code
compiled before that module was patched, and the defect would silently not be in effect. So, for each patched
file, the caches of that module and of every embedcore module importing it (transitively) are removed: before
a defect run (so the run compiles the defect in) and after the revert (so later runs never load defective
code). The generated kernels in EMBEDCORE_CACHE_DIR are keyed by a digest of the sources of every module they
are built from (embedcore/compile_cache.py), so they need nothing.

usage: python invalidate.py TREE PATCH_FILE...   (prints the modules whose caches were removed)
"""

import ast
import glob
import os
import re
import sys


def modules(tree):
    root = os.path.join(tree, "embedcore")
    out = {}
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, tree)[:-3].replace(os.sep, ".")
        name = rel[:-9] if rel.endswith(".__init__") else rel
        out[name] = path
    return out


def imports(name, path):
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    try:
        tree = ast.parse(open(path).read())
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            for alias in node.names:
                found.add(f"{mod}.{alias.name}")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("embedcore")}


def patched_files(patch):
    files = set()
    for line in open(patch):
        m = re.match(r"^\+\+\+ b/(\S+)", line)
        if m:
            files.add(m.group(1))
    return files


def main():
    tree, patches = sys.argv[1], sys.argv[2:]
    mods = modules(tree)
    graph = {name: imports(name, path) & set(mods) for name, path in mods.items()}
    targets = set()
    for patch in patches:
        for f in patched_files(patch):
            if f.startswith("embedcore/") and f.endswith(".py"):
                name = f[:-3].replace("/", ".")
                targets.add(name[:-9] if name.endswith(".__init__") else name)
    affected = set(targets)
    changed = True
    while changed:
        changed = False
        for name, deps in graph.items():
            if name not in affected and deps & affected:
                affected.add(name)
                changed = True
    removed = 0
    for name in sorted(affected):
        path = mods[name]
        stem = "__init__" if path.endswith("__init__.py") else os.path.basename(path)[:-3]
        for cached in glob.glob(os.path.join(os.path.dirname(path), "__pycache__", f"{stem}.*.nb[ic]")):
            os.remove(cached)
            removed += 1
    print(f"invalidated {removed} Numba cache files of {len(affected)} modules: {' '.join(sorted(affected))}")


if __name__ == "__main__":
    main()
