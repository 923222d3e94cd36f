"""embedcore: huge embedding tables trained with fused, sparse, user-programmable optimizers.

The configuration model mirrors ``tf.tpu.experimental.embedding``: :class:`TableConfig`,
:class:`FeatureConfig`, built-in optimizers and :class:`CustomOptimizer`, whose per-row function is
compiled with Numba and applied in place to exactly the rows each batch touched. :class:`DynamicTableConfig`
declares a hash-keyed table instead: any 64-bit key (strings through :func:`hash_keys`), up to a capacity,
with :class:`CountAdmission` and an eviction policy (:class:`LRU`, :class:`LFU`, :class:`TTL`,
:class:`EvictByScore`).

Layout. The core never imports the application, the bench or a framework front; ``optimizers`` hands
TensorFlow or JAX custom computations to ``translate``:

* core: ``config``, ``initializers`` (with ``value_object``), ``optimizers`` (with ``common_options``, ``compiler``,
  ``split_reductions``, ``compile_cache``), ``inputs``, ``tuning``, ``memory_budget``, ``kernels/``,
  ``tables/`` (``PhysicalTable``: a stacked table's storage, scratch, grouping and kernels, made by one
  factory for every engine), ``lookup`` and ``engine`` (:class:`Embedding`), ``checkpoint/``, ``serving``,
  ``distributed/``; this package exports its API.
* adapters, at top level beside the core they wrap: ``torch`` and ``jax`` (the framework fronts) and
  ``translate/`` (TensorFlow and JAX custom computations to NumPy row functions).
* ``app/``: an application built on the core: the trainer and its run configuration, the NumPy DLRM
  ``models/``, the ``data/`` readers, ``metrics``, ``plot``, ``progress``, ``quickstart`` and the ``cli``
  (``embedcore`` / ``python -m embedcore``).
* ``bench/``: ``embedcore bench``, the head-to-head measurements.
"""

from . import compile_progress
from .checkpoint import CheckpointError
from .compiler import RowFunctionError
from .config import DynamicTableConfig, FeatureConfig, TableConfig
from .engine import Embedding, LookupContext, NonFiniteError, UpdateReport
from .export import export_for_serving
from .initializers import Constant, Initializer, RandomUniform, RowId, TruncatedNormal, Zeros
from .inputs import InputError, InputTypeError, Ragged, Sparse
from .keys import hash_keys
from .optimizers import (FTRL, SGD, Adagrad, AdagradMomentum, Adam, CustomOptimizer, ExactAdagrad, ExactRowwiseAdagrad,
                         Optimizer, RowwiseAdagrad)
from .serving import ServingEmbedding
from .tables.policies import LFU, LRU, TTL, CountAdmission, EvictByScore, EvictionPolicy
from .tuning import Tuning

__version__ = "0.1.0"

__all__ = [
    "TableConfig", "FeatureConfig", "Embedding", "LookupContext", "UpdateReport", "NonFiniteError",
    "Optimizer", "CustomOptimizer", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL", "RowwiseAdagrad",
    "ExactAdagrad", "ExactRowwiseAdagrad",
    "Initializer", "Constant", "Zeros", "TruncatedNormal", "RandomUniform", "RowId",
    "Ragged", "Sparse", "InputError", "InputTypeError", "RowFunctionError", "CheckpointError", "ServingEmbedding",
    "Tuning", "export_for_serving",
    "DynamicTableConfig", "CountAdmission", "EvictionPolicy", "LRU", "LFU", "TTL", "EvictByScore", "hash_keys",
]

compile_progress.watch()  # kernels compiling say so on stderr (EMBEDCORE_PROGRESS=0 silences it)
