"""A small click-through ranking model trained with Keras's ``model.fit``: embedcore holds the embedding tables
(Adagrad, fused and sparse, applied in the layer's gradient), Keras the dense part (Adam), with Keras metrics.

Data: embedcore's built-in synthetic click log (``embedcore.app.data.SyntheticClickLog``), eight categorical
features, two of them bags (one weighted) fed as ``tf.RaggedTensor``, and four dense features; its planted
teacher gives the best AUC any model can reach, drawn in the plot. Run::

    python examples/keras_ranking.py keras_ranking.png

It prints the eval log loss and AUC after each round of training (a quarter of a pass over the data) and
writes the learning curve (train log loss per step, eval log loss and AUC per round, beside the teacher's) to
the path given. With the defaults (200,000 samples, two passes, about half a minute) the eval AUC climbs to
about 0.70, against the teacher's 0.78. Needs ``pip install embedcore[tensorflow,plot]``.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle Numba threads sleep instead of spinning on TF's cores

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import embedcore as ec  # noqa: E402
from embedcore.app.data import SyntheticClickLog, feature_configs  # noqa: E402
from embedcore.app.plot import learning_curve  # noqa: E402
from embedcore.tensorflow.keras import EmbeddingLayer  # noqa: E402

VOCABULARY_SIZES = {"C1": 1_000, "C2": 500, "C3": 2_000, "C4": 1_000, "C5": 300, "C6": 100, "C7": 2_000,
                    "C8": 50}
BAGS = {"C4": (5, True), "C7": (3, False)}  # (max ids per sample, weighted)
DIM, N_DENSE = 8, 4


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plot", nargs="?", default="keras_ranking.png", help="where to write the learning curve")
    parser.add_argument("--train", type=int, default=200_000, help="training samples")
    parser.add_argument("--eval", type=int, default=20_000, help="eval samples")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds-per-epoch", type=int, default=4, help="evaluations per pass over the data")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def as_keras(batch, data):
    """One :class:`~embedcore.app.data.Batch` as ``(x, labels)``: one-hot ids as ``[B]`` tensors, bags as
    ``tf.RaggedTensor`` (weights likewise, for the weighted bags only), dense features ``[B, N_DENSE]``."""
    def tensor(v):
        return tf.RaggedTensor.from_row_splits(v.values, v.row_splits) if isinstance(v, ec.Ragged) else tf.constant(v)

    ids = {f.name: tensor(batch.ids[f.name]) for f in data.features}
    weights = {f.name: tensor(batch.weights[f.name]) for f in data.features if f.weighted}
    return {"ids": ids, "weights": weights, "dense": tf.constant(batch.dense)}, tf.constant(batch.labels[:, None])


def signature(data):
    def spec(dtype, bag):
        return (tf.RaggedTensorSpec([None, None], dtype, ragged_rank=1, row_splits_dtype=tf.int64) if bag
                else tf.TensorSpec([None], dtype))

    return ({"ids": {f.name: spec(tf.int64, f.bag) for f in data.features},
             "weights": {f.name: spec(tf.float32, True) for f in data.features if f.weighted},
             "dense": tf.TensorSpec([None, N_DENSE], tf.float32)},
            tf.TensorSpec([None, 1], tf.float32))


def dataset(data, split, batch_size):
    """The split's batches, made once (a few MB) and replayed by ``tf.data`` for every epoch."""
    batches = [as_keras(b, data) for b in data.batches(batch_size, split)]
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=signature(data)), len(batches)


class Ranker(keras.Model):
    """Embeddings of every categorical feature and a projection of the dense features, concatenated, then a
    two-layer MLP to one click logit."""

    def __init__(self, data, seed):
        super().__init__()
        self.features = [f.name for f in data.features]
        # Accumulators start at 1e-3 (TensorFlow's default is 0.1): a row's gradient of a mean loss over ~1,000
        # samples is ~1e-3, and an accumulator of 0.1 would shrink the first steps a hundredfold.
        optimizer = ec.Adagrad(0.2, initial_accumulator_value=1e-3)
        self.embedding = EmbeddingLayer(feature_configs(data.features, DIM), optimizer, seed=seed)
        self.bottom = keras.layers.Dense(DIM, activation="relu")
        self.top = keras.Sequential([keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])

    def call(self, x, training=False):
        weights = {name: x["weights"].get(name) for name in self.features}  # None: an unweighted feature
        acts = self.embedding(x["ids"], weights, training=training)  # {name: [B, DIM]}
        return self.top(tf.concat([self.bottom(x["dense"])] + [acts[name] for name in self.features], axis=1))


class StepLosses(keras.callbacks.Callback):
    """Each training step's own loss. Keras reports the mean over the epoch so far, m_k after k steps, so step
    k's loss is k m_k - (k - 1) m_(k-1)."""

    def __init__(self):
        super().__init__()
        self.losses, self._mean, self._k = [], 0.0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._mean, self._k = 0.0, 0

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        self._k += 1
        self.losses.append(self._k * mean - (self._k - 1) * self._mean)
        self._mean = mean


def main():
    args = arguments()
    data = SyntheticClickLog(args.train, args.eval, seed=args.seed, vocabulary_sizes=VOCABULARY_SIZES,
                             n_dense=N_DENSE, multi_hot=BAGS)
    train, steps = dataset(data, "train", args.batch_size)
    evaluation, _ = dataset(data, "eval", args.batch_size)
    model = Ranker(data, args.seed)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                           keras.metrics.BinaryCrossentropy(from_logits=True, name="log_loss")])

    # Keras evaluates validation data at the end of each "epoch": rounds of steps_per_round steps make several
    # evaluations per pass over the data.
    rounds = args.epochs * args.rounds_per_epoch
    steps_per_round = max(1, steps // args.rounds_per_epoch)
    step_losses = StepLosses()
    history = model.fit(train.repeat(), epochs=rounds, steps_per_epoch=steps_per_round, validation_data=evaluation,
                        callbacks=[step_losses], verbose=0)
    optimum = data.optimum("eval")
    evaluations = [{"step": (r + 1) * steps_per_round, "log_loss": history.history["val_log_loss"][r],
                    "auc": history.history["val_auc"][r]} for r in range(rounds)]
    for e in evaluations:
        print(f"step {e['step']:5d}  eval log loss {e['log_loss']:.4f}  eval AUC {e['auc']:.4f}")
    final = model.evaluate(evaluation, verbose=0, return_dict=True)
    print(f"embedding updates {model.embedding.embedding.step} (one per training step, {rounds * steps_per_round})")
    print(f"eval AUC {final['auc']:.4f}  log loss {final['log_loss']:.4f}  (teacher optimum: AUC "
          f"{optimum['auc']:.4f}, log loss {optimum['log_loss']:.4f})")
    drawn = learning_curve({"train_loss_per_step": step_losses.losses, "evaluations": evaluations,
                            "epochs": [{"step": (k + 1) * steps} for k in range(args.epochs)
                                       if (k + 1) * steps <= rounds * steps_per_round],
                            "optimum": optimum, "title": "embedcore + Keras model.fit: ranking on the synthetic "
                                                         "click log"}, args.plot)
    print(f"learning curve written to {args.plot}" if drawn else "matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
