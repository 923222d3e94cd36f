"""embedcore: huge embedding tables trained with fused, sparse, user-programmable optimizers.

The configuration model mirrors ``tf.tpu.experimental.embedding``: :class:`TableConfig`,
:class:`FeatureConfig`, built-in optimizers and :class:`CustomOptimizer`, whose per-row function is
compiled with Numba and applied in place to exactly the rows each batch touched.
"""

from .checkpoint import CheckpointError
from .compiler import RowFunctionError
from .config import FeatureConfig, TableConfig
from .engine import Embedding, LookupContext, NonFiniteError, UpdateReport
from .initializers import Constant, Initializer, RandomUniform, RowId, TruncatedNormal, Zeros
from .inputs import InputError, Ragged, Sparse
from .optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, CustomOptimizer, Optimizer, RowwiseAdagrad
from .serving import ServingEmbedding

__version__ = "0.1.0"

__all__ = [
    "TableConfig", "FeatureConfig", "Embedding", "LookupContext", "UpdateReport", "NonFiniteError",
    "Optimizer", "CustomOptimizer", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FTRL", "RowwiseAdagrad",
    "Initializer", "Constant", "Zeros", "TruncatedNormal", "RandomUniform", "RowId",
    "Ragged", "Sparse", "InputError", "RowFunctionError", "CheckpointError", "ServingEmbedding",
]
