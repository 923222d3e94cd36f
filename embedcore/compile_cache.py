"""On-disk cache of the generated update kernels and of the compiler's verdicts, so a second process
(another run, another MPI rank) does not compile again.

Numba caches a jitted function next to its source file, keyed by the file's name and time stamp. A
generated kernel has no source file, and its behaviour depends on the user's row function, which Numba's
cache would not notice changing. So each kernel's source is written to a file of its own in the cache
folder, named by a digest of everything the compiled code depends on:

* the generated source and the Numba and Python versions;
* the sources of the embedcore modules the kernel is built from: those of the functions its source calls
  (its namespace), and every embedcore module those import, transitively (:func:`module_files`), so an
  edit elsewhere in embedcore leaves it cached; the row function is keyed by its fingerprint, and its
  compiled form by the modules that make it (:mod:`embedcore.compiler` and what that imports);
* a *fingerprint* of the row function: its bytecode and constants, the values of the closure cells and
  globals it reads (attributes of modules too: ``helpers.scale``, ``cfg.EPS``), and, recursively, the
  same of every Python or jitted function among them; NumPy, Numba and ``math`` by name and version.

A function whose fingerprint cannot be taken (it reads a global that is neither a number, string, array,
module nor function, such as an instance of a user class) is compiled in memory each time, as without a
cache. The folder is ``EMBEDCORE_CACHE_DIR`` if set (``off`` or an empty value disables caching), else
``$XDG_CACHE_HOME/embedcore`` or ``~/.cache/embedcore``; a folder that cannot be written, or that another
user owns or may write to, disables it too (its files are executed and unpickled).
"""

from __future__ import annotations

import dis
import hashlib
import json
import os
import sys
import tempfile
import types as pytypes

import numba
import numpy as np

__all__ = ["cache_dir", "fingerprint", "Uncacheable", "load_source", "jit_source", "read_verdict", "write_verdict",
           "module_files", "namespace_modules"]

_PACKAGE = __name__.rpartition(".")[0]  # "embedcore"
_ROW_FUNCTION_MAKERS = (f"{_PACKAGE}.compiler",)  # what turns a user's function into the code a kernel inlines


class Uncacheable(Exception):
    """The row function reads something whose value cannot be fingerprinted."""


def cache_dir() -> str | None:
    """The cache folder for this Python and Numba version, created if needed; None when caching is off."""
    configured = os.environ.get("EMBEDCORE_CACHE_DIR")
    if configured is not None and configured.strip().lower() in ("", "off", "0", "none"):
        return None
    base = configured or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                      "embedcore")
    folder = os.path.join(base, f"py{sys.version_info[0]}{sys.version_info[1]}-numba{numba.__version__}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.stat(folder)
    except OSError:
        return None
    # Its files are executed (generated sources) and unpickled (Numba's cache): only a folder that nobody
    # else can write to is used.
    if (hasattr(os, "getuid") and info.st_uid != os.getuid()) or info.st_mode & 0o022:
        return None
    return folder if os.access(folder, os.W_OK) else None


def _module_of(value) -> str | None:
    """The name of the module ``value`` (a module, function, Numba dispatcher, overload stub or intrinsic)
    was defined in, if it is one of embedcore's; else None."""
    if isinstance(value, pytypes.ModuleType):
        name = value.__name__
    else:
        target = getattr(value, "py_func", None) or getattr(value, "_defn", None) or value
        if not callable(target):
            return None
        name = getattr(target, "__module__", None)
    if not isinstance(name, str) or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
        return None
    return name


def namespace_modules(namespace: dict) -> set:
    """The embedcore modules the values of a generated kernel's ``namespace`` come from."""
    return {name for name in map(_module_of, namespace.values()) if name is not None}


_IMPORTS: dict = {}


def _imports(name: str) -> set:
    """The embedcore modules module ``name`` refers to (modules and the definitions it imported)."""
    if name not in _IMPORTS:
        module = sys.modules[name]
        # The package itself re-exports everything: its own file counts, not what it imports.
        values = () if name == _PACKAGE else list(vars(module).values())
        _IMPORTS[name] = {m for m in map(_module_of, values) if m is not None and m != name}
    return _IMPORTS[name]


def module_files(*modules) -> list:
    """The source files of the embedcore ``modules`` (names) and of every embedcore module they import,
    transitively: what code built from them depends on. Sorted, relative to the package folder."""
    seen, todo = set(), [m for m in modules if m in sys.modules]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name) - seen)
    root = os.path.dirname(os.path.abspath(sys.modules[_PACKAGE].__file__))
    files = {os.path.relpath(os.path.abspath(sys.modules[m].__file__), root) for m in seen
             if getattr(sys.modules[m], "__file__", None)}
    return sorted(files)


_DIGESTS: dict = {}


def _modules_digest(modules) -> str:
    """A digest of the files of :func:`module_files` (kept for the process: its sources do not change)."""
    key = frozenset(modules)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        root = os.path.dirname(os.path.abspath(sys.modules[_PACKAGE].__file__))
        for path in module_files(*key):
            h.update(path.encode() + b"\x00")
            with open(os.path.join(root, path), "rb") as f:
                h.update(f.read())
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def fingerprint(fn) -> str:
    """A digest of what the compiled code of ``fn`` depends on; raises :class:`Uncacheable`."""
    h = hashlib.sha256()
    _feed(h, fn, set())
    return h.hexdigest()


def _feed(h, value, seen):
    if isinstance(value, numba.core.registry.CPUDispatcher):
        h.update(b"dispatcher")
        h.update(repr(sorted((k, repr(v)) for k, v in value.targetoptions.items())).encode())
        value = value.py_func
    if isinstance(value, pytypes.FunctionType):
        if _from_library(value):
            h.update(f"library function {value.__module__}.{value.__qualname__} {_library_version(value)}".encode())
            return
        if id(value) in seen:
            h.update(b"recursion:" + value.__qualname__.encode())
            return
        seen.add(id(value))
        h.update(f"function {value.__module__}.{value.__qualname__}".encode())
        _feed_code(h, value.__code__, value, seen)
        if value.__defaults__:
            _feed(h, value.__defaults__, seen)
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            h.update(b"freevar " + name.encode())
            _feed(h, cell.cell_contents, seen)
        return
    if isinstance(value, pytypes.ModuleType):
        version = getattr(value, "__version__", "")
        h.update(f"module {value.__name__} {version}".encode())
        return
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r}".encode())
        return
    if isinstance(value, np.generic):
        h.update(f"{value.dtype.str}:{value!r}".encode())
        return
    if isinstance(value, np.ndarray):
        h.update(f"ndarray {value.dtype.str} {value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
        return
    if isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__} {len(value)}".encode())
        for item in value:
            _feed(h, item, seen)
        return
    if isinstance(value, (np.ufunc, pytypes.BuiltinFunctionType)):
        h.update(f"builtin {getattr(value, '__module__', '')}.{value.__name__}".encode())
        return
    if _from_library(value):  # np.float32, np.linalg.norm (a dispatcher object in NumPy 2) and the like
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)
        h.update(f"library {value.__module__}.{name} {_library_version(value)}".encode())
        return
    raise Uncacheable(f"cannot fingerprint {type(value).__name__} {value!r:.80}")


# Libraries identified by name and version instead of by their code (which the version pins): everything
# else a row function reaches (the user's modules and functions) is fingerprinted by its code and values.
_LIBRARIES = ("numpy", "math", "cmath", "numba", "builtins")


def _from_library(value) -> bool:
    return (getattr(value, "__module__", None) or "").split(".")[0] in _LIBRARIES


def _library_version(value) -> str:
    top = sys.modules.get((getattr(value, "__module__", None) or "").split(".")[0])
    return str(getattr(top, "__version__", ""))


def _feed_code(h, code, fn, seen):
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for const in code.co_consts:
        if isinstance(const, pytypes.CodeType):
            _feed_code(h, const, fn, seen)
        else:
            h.update(f"{type(const).__name__}:{const!r}".encode())
    for name in code.co_names:
        if name in fn.__globals__:
            h.update(b"global " + name.encode())
            _feed(h, fn.__globals__[name], seen)
    for chain, value in _module_attributes(code, fn.__globals__):  # helpers.scale, cfg.EPS: their values too
        h.update(b"attribute " + ".".join(chain).encode())
        _feed(h, value, seen)


def _module_attributes(code, namespace):
    """``(names, value)`` for each ``module.attr[.attr...]`` the code reads from a global module, resolved to
    the first value that is not itself a module (``None`` if an attribute is missing)."""
    found = []
    instructions = list(dis.get_instructions(code))
    for k, ins in enumerate(instructions):
        if ins.opname != "LOAD_GLOBAL":
            continue
        name = ins.argval if isinstance(ins.argval, str) else str(ins.argval)
        value = namespace.get(name)
        if not isinstance(value, pytypes.ModuleType):
            continue
        chain = [name]
        for nxt in instructions[k + 1:]:
            if nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD") or not isinstance(value, pytypes.ModuleType):
                break
            chain.append(nxt.argval)
            value = getattr(value, nxt.argval, None)
        if len(chain) > 1:
            found.append((chain, value))
    return found


def _key(modules, *parts) -> str:
    """The cache key of something built from ``parts`` and the embedcore ``modules`` (see :func:`module_files`)."""
    h = hashlib.sha256()
    h.update(f"{sys.version} numba {numba.__version__} embedcore {_modules_digest(modules)}".encode())
    for part in parts:
        h.update(b"\x00" + str(part).encode())
    return h.hexdigest()[:32]


def _write_atomically(path: str, text: str) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_source(source: str, namespace: dict, function: str, key_parts,
                row_function: str | None = None) -> pytypes.FunctionType | None:
    """``function`` defined by ``source`` in a module file of the cache folder, its globals ``namespace``,
    so that ``numba.njit(cache=True)`` can cache it; None when caching is off. Its key covers ``source``,
    ``key_parts`` and the embedcore modules the namespace's values come from; but for the namespace entry
    ``row_function``, a user's row function, which ``key_parts`` covers by its fingerprint: for it, the
    modules that compile row functions count instead."""
    folder = cache_dir()
    if folder is None:
        return None
    modules = namespace_modules({k: v for k, v in namespace.items() if k != row_function})
    key = _key(modules | (set(_ROW_FUNCTION_MAKERS) if row_function else set()), source, *key_parts)
    path = os.path.join(folder, f"kernel_{key}.py")
    try:
        if _read(path) != source:  # absent, or not what this process generated: (re)write it
            _write_atomically(path, source)
        name = f"embedcore_generated_{key}"
        module = sys.modules.get(name)
        if module is None:
            module = pytypes.ModuleType(name)
            module.__file__ = path
            module.__dict__.update(namespace)
            # The text this process generated is executed, not the file's (which only gives Numba's cache
            # its location and time stamp).
            exec(compile(source, path, "exec"), module.__dict__)
            # Registered, so that Numba finds the module of the function again when it loads the compiled
            # code from its cache (in this process or the next one, which also comes through here first).
            sys.modules[name] = module
    except OSError:
        return None
    return getattr(module, function)


def jit_source(source: str, namespace: dict, function: str, key_parts, label: str, row_function: str | None = None,
               **options):
    """``function`` of the generated ``source`` (globals ``namespace``), jitted with ``numba.njit(**options)``:
    from its file in the cache folder (:func:`load_source`), so Numba caches the compiled code, unless
    ``key_parts`` is None (the source depends on something that cannot be fingerprinted) or caching is off;
    else compiled in memory, ``label`` naming it in tracebacks. ``row_function``: see :func:`load_source`."""
    defined = None if key_parts is None else load_source(source, namespace, function, key_parts, row_function)
    cached = defined is not None
    if not cached:
        exec(compile(source, f"<{label}>", "exec"), namespace)
        defined = namespace[function]
    return numba.njit(cache=cached, **options)(defined)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _verdict_path(key_parts) -> str | None:
    folder = cache_dir()
    return None if folder is None else os.path.join(folder, f"verdict_{_key(_ROW_FUNCTION_MAKERS, *key_parts)}.json")


def read_verdict(key_parts) -> dict | None:
    """A verdict stored by :func:`write_verdict` under the same key, or None."""
    path = _verdict_path(key_parts)
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_verdict(key_parts, verdict: dict) -> None:
    path = _verdict_path(key_parts)
    if path is not None:
        try:
            _write_atomically(path, json.dumps(verdict))
        except OSError:
            pass
