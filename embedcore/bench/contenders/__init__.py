"""The contenders of the step benchmark: one module each, all behind the :class:`Contender` interface.

Every contender trains its own copy of the workload's tables. Per step the harness calls
``prepare(batch)`` (not timed: converts the batch to the contender's native inputs, and for ``kind="update"``
workloads also runs the forward/lookup the backward needs) and then ``run(prepared)`` (timed). ``forward``,
``table`` and ``slots`` are only used by the agreement checks, never timed.

A contender whose package is missing or fails to import raises :class:`Skip` from ``load``; one that does
not support a workload (e.g. an optimizer it has no equivalent of) says why from ``unsupported``.
"""

from __future__ import annotations

import importlib

__all__ = ["Skip", "Contender", "REGISTRY", "DEFAULT", "load", "configure_torch"]


class Skip(Exception):
    """This contender cannot run here (package missing, failed to load); the message says why."""


class Contender:
    name = "?"          # key used on the command line and in the JSON
    label = "?"         # row label in the printed table
    measures = ""       # one line: what exactly one timed step does
    optimizers = ()     # OptimSpec names it supports
    kinds = ("train", "update", "lookup")
    memory_factor = 1.0  # peak memory as a multiple of the workload's table + slot bytes

    def __init__(self, threads: int):
        self.threads = threads
        self.info = {}   # facts for the report (versions, thread counts, compile times, notes)

    def unsupported(self, w) -> str | None:
        if w.optim.name not in self.optimizers:
            return f"no {w.optim.name} optimizer"
        if w.kind not in self.kinds:
            return f"no {w.kind}-only mode"
        return None

    # -- lifecycle -------------------------------------------------------------------------------------
    def load(self):
        """Import the framework and set its threads; raise :class:`Skip` if it cannot run here."""

    def setup(self, w, init):
        """Build tables (copies of ``init``, a list of [E, D] float32 arrays, or zeros written explicitly
        when ``init`` is None) and optimizer state."""
        raise NotImplementedError

    def prepare(self, batch):
        """Untimed: the batch in this contender's input format (and the forward, for update-only)."""
        raise NotImplementedError

    def run(self, prepared):
        """Timed: one step. May return {phase: seconds} for a breakdown."""
        raise NotImplementedError

    def forward(self, batch):
        """Check only: pooled outputs [T, B, D] of the current tables, without updating anything."""
        raise NotImplementedError

    def table(self, t):
        """Check only: table ``t`` as a NumPy [E, D] array (a view or a copy)."""
        raise NotImplementedError

    def slots(self, t):
        """Check only: table ``t``'s optimizer state, in ``OptimSpec.slot_shapes`` order."""
        raise NotImplementedError

    def close(self):
        pass


# name -> (module, class); the order is the order of the printed table.
REGISTRY = {
    "embedcore": ("embedcore_engine", "EmbedcoreContender"),
    "embedcore-custom": ("embedcore_custom", "EmbedcoreCustomContender"),
    "embedcore-skip": ("embedcore_engine", "EmbedcoreSkipContender"),
    "embedcore-torch": ("embedcore_torch", "EmbedcoreTorchContender"),
    "fbgemm": ("fbgemm_tbe", "FbgemmContender"),
    "torch": ("torch_bag", "TorchBagContender"),
    "jax": ("jax_xla", "JaxContender"),
    "tensorflow": ("tf_sparse", "TensorflowContender"),
    "numpy": ("numpy_ref", "NumpyContender"),
}
DEFAULT = ("embedcore", "embedcore-custom", "embedcore-skip", "fbgemm", "torch", "jax", "tensorflow", "numpy")


def load(name: str, threads: int) -> Contender:
    """An instance of contender ``name``; raises :class:`Skip` when its package is missing or broken."""
    if name not in REGISTRY:
        raise ValueError(f"unknown contender {name!r}; choose from {list(REGISTRY)}")
    module, cls = REGISTRY[name]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except Skip:
        raise
    except Exception as exc:  # ImportError, or a broken native extension
        raise Skip(f"{type(exc).__name__}: {exc}") from None
    contender = getattr(mod, cls)(threads)
    contender.load()
    return contender


def configure_torch(threads: int) -> dict:
    """Set torch's intra-op threads (FBGEMM's CPU kernels use the same pool) and report them."""
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran
        pass
    info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads()}
    try:
        lines = torch.__config__.parallel_info().splitlines()
        info["torch_parallel_backend"] = next((x.split(":", 1)[1].strip() for x in lines
                                               if x.startswith("ATen parallel backend")), None)
    except Exception:
        pass
    return info
