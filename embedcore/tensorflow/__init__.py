"""TensorFlow front end: run a ``tf.tpu.experimental.embedding`` program on embedcore by swapping one class.

Importing this package imports TensorFlow (the ``[tensorflow]`` extra); the core never does. Modules:

* ``convert``: TensorFlow's config objects (``TableConfig``, ``FeatureConfig``, optimizers, initializers,
  callable learning rates) to embedcore's, faithfully; embedcore's own configs pass through.
* ``tensors``: ``tf.Tensor`` / ``tf.RaggedTensor`` / ``tf.SparseTensor`` features to embedcore inputs, and
  activations back to ``tf.Tensor``.
* ``graph``: the bridge that runs an engine's lookup and update eagerly and inside ``tf.function``.
* ``engines``: drop-ins for TensorFlow's classes: ``TPUEmbeddingV2``, ``TPUEmbedding`` (the v2 API, with
  ``enqueue``/``dequeue``) and ``TPUEmbeddingForServing``.
* ``keras``: a Keras layer whose sparse update runs in its gradient, so ``model.fit`` trains the tables.
* ``checkpoint``: tables and slots to and from a ``tf.train.Checkpoint`` written by TensorFlow's engines.
"""

from .checkpoint import as_trackable, load_tf_checkpoint, save_tf_checkpoint
from .engines import TPUEmbedding, TPUEmbeddingForServing, TPUEmbeddingV2

__all__ = ["TPUEmbeddingV2", "TPUEmbedding", "TPUEmbeddingForServing", "EmbeddingLayer", "DistributedEmbedding",
           "load_tf_checkpoint", "save_tf_checkpoint", "as_trackable"]


def __getattr__(name):
    """The Keras layer is imported on first use (importing Keras takes seconds)."""
    if name in ("EmbeddingLayer", "DistributedEmbedding"):
        from . import keras
        return getattr(keras, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
