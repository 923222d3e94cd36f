"""Dense models in plain NumPy with manual backpropagation, trained on top of embedcore's embeddings.

The engine gives embedding activations and takes ``d loss / d activations`` back; a model here turns the
activations (and dense features) into logits, and its ``backward`` gives those gradients::

    acts, ctx = emb(features)
    logits, cache = model.forward(dense, acts)
    loss, d_logits = bce_with_logits(logits, labels)
    emb.apply_gradients(model.backward(cache, d_logits), ctx)
    model.step()

:class:`BiasedMF` is biased matrix factorisation for explicit ratings (``mu + b_u + b_i + <p_u, q_i>``) over four
tables. The dense optimizers (:class:`SGD`, :class:`Adagrad`, :class:`Adam`) are NumPy ones for whole arrays; they
are distinct from the embedding optimizers ``embedcore.SGD`` etc.
"""

from .dense_optimizers import SGD, Adagrad, Adam, DenseOptimizer
from .dlrm import DLRM, ForwardCache, bce_with_logits, sigmoid
from .layers import MLP, Linear
from .mf import BiasedMF, mf_features, rmse, squared_error

__all__ = ["DLRM", "ForwardCache", "bce_with_logits", "sigmoid", "MLP", "Linear",
           "DenseOptimizer", "SGD", "Adagrad", "Adam", "BiasedMF", "mf_features", "squared_error", "rmse"]
