"""Command line: ``embedcore demo``, ``embedcore train --config FILE``, ``embedcore bench``, ``embedcore quickstart``."""

from __future__ import annotations

import argparse
import math
import os
import sys

# The demo: TensorFlow's documented custom Adagrad for every table. Its accumulators start at 1e-3, not
# the 0.1 of TensorFlow's example: gradients of a mean loss over 1,024 samples are ~1e-3 per row, and an
# accumulator of 0.1 would shrink the first steps a hundredfold.
DEMO_OVERRIDES = {
    "data": {"kind": "synthetic", "n_train": 300_000, "n_eval": 50_000, "seed": 0},
    "embedding": {"dim": 16, "optimizer": "embedcore.app.quickstart:custom_adagrad", "learning_rate": 0.05,
                  "slot_names": ["accumulators"], "slot_initializers": [0.001]},
    "train": {"epochs": 3, "batch_size": 1024, "output": "runs/demo", "eval_every": 50},
}
DEMO_VOCABULARY_SCALE = 0.01  # Criteo-like vocabularies / 100: 10 .. 10^4 rows, learnable in a minute


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embedcore", description="Train embedding tables with fused, sparse, "
                                     "user-programmable optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a DLRM on the built-in Criteo-like click log with TensorFlow's "
                                       "CustomOptimizer Adagrad; print log loss and AUC beside the optimum; "
                                       "write metrics.json and learning_curve.png")
    demo.add_argument("--output", default=None, help="output folder (default runs/demo)")
    demo.add_argument("--epochs", type=_positive, default=None)
    demo.add_argument("--train-samples", type=_positive, default=None)
    demo.add_argument("--eval-samples", type=_positive, default=None)
    demo.add_argument("--batch-size", type=_positive, default=None)
    demo.add_argument("--vocabulary-scale", type=float, default=DEMO_VOCABULARY_SCALE,
                      help=f"scale the Criteo-like vocabularies (100 .. 10^6 rows) by this factor (default "
                           f"{DEMO_VOCABULARY_SCALE}; 1 needs far more samples to learn)")
    _storage_arguments(demo)
    demo.add_argument("--dynamic", type=float, default=None, metavar="FRACTION",
                      help="make dynamic every table whose capacity, FRACTION of its vocabulary, holds a batch's "
                           "ids (admission at 2 sightings, LRU eviction)")
    demo.add_argument("--resume", action="store_true", help="continue from the output folder's checkpoint")
    train = sub.add_parser("train", help="train on your data with your choices, from a TOML or JSON config "
                                         "(see embedcore.app.run_config)")
    train.add_argument("--config", required=True, help="a .toml or .json run configuration")
    train.add_argument("--output", default=None, help="output folder (overrides train.output)")
    train.add_argument("--resume", action="store_true", help="continue from the output folder's checkpoint")
    sub.add_parser("bench", add_help=False, help="benchmark a training step against FBGEMM, PyTorch, JAX and "
                                                 "NumPy (those installed); `embedcore bench --help` for options")
    quick = sub.add_parser("quickstart", help="TensorFlow's two CustomOptimizer examples on a tiny regression")
    quick.add_argument("--steps", type=_positive, default=300)
    quick.add_argument("--batch-size", type=_positive, default=256)
    quick.add_argument("--seed", type=int, default=0)
    _storage_arguments(quick)
    return parser


def _storage_arguments(parser) -> None:
    """``--weights-dtype``, ``--slot-dtype``, ``--rounding``: how every table is stored (TableConfig's
    ``weights_dtype``, ``slot_dtype``, ``stochastic_rounding``; the run config's keys of those names)."""
    from ..config import DTYPES
    parser.add_argument("--weights-dtype", choices=DTYPES, default=None,
                        help="how the tables' rows are stored (default float32; 16-bit dtypes take half)")
    parser.add_argument("--slot-dtype", choices=DTYPES, default=None,
                        help="how the optimizer's slots are stored (default float32)")
    parser.add_argument("--rounding", choices=("stochastic", "nearest"), default=None,
                        help="how updates are rounded to a 16-bit dtype (default stochastic)")


def _storage(args) -> dict:
    """The storage keys the command line set."""
    out = {"weights_dtype": args.weights_dtype, "slot_dtype": args.slot_dtype,
           "stochastic_rounding": None if args.rounding is None else args.rounding == "stochastic"}
    return {k: v for k, v in out.items() if v is not None}


def demo_config(output=None, epochs=None, train_samples=None, eval_samples=None, batch_size=None,
                vocabulary_scale=DEMO_VOCABULARY_SCALE, storage=None, dynamic=None) -> dict:
    """The demo's run configuration; ``storage``: ``[embedding]``'s ``weights_dtype``, ``slot_dtype``,
    ``stochastic_rounding`` for every table (default float32); ``dynamic``: see :func:`demo_dynamic_tables`."""
    from .data.synthetic import DEFAULT_VOCABULARY_SIZES
    from .run_config import DEFAULTS, ConfigError, check, merge
    if not 0 < vocabulary_scale <= 1:
        raise ConfigError(f"--vocabulary-scale must lie in (0, 1], got {vocabulary_scale}")
    config = merge(DEFAULTS, DEMO_OVERRIDES)
    config["data"]["vocabulary_sizes"] = [max(10, round(v * vocabulary_scale)) for v in DEFAULT_VOCABULARY_SIZES]
    for section, key, value in (("train", "output", output), ("train", "epochs", epochs),
                                ("data", "n_train", train_samples), ("data", "n_eval", eval_samples),
                                ("train", "batch_size", batch_size)):
        if value is not None:
            config[section][key] = value
    config["embedding"].update(storage or {})
    if dynamic is not None:
        config["embedding"]["tables"] = demo_dynamic_tables(config["data"]["vocabulary_sizes"],
                                                            config["train"]["batch_size"], dynamic)
    check(config)
    return config


def demo_dynamic_tables(vocabulary_sizes, batch_size: int, fraction: float) -> dict:
    """``[embedding.tables]`` making table ``C<k>`` dynamic, with room for ``ceil(fraction * vocabulary)``
    keys, ``admission = {min_count = 2}`` and ``eviction = "lru"``, wherever that capacity holds the most
    ids a batch can bring (``batch_size`` times the feature's longest bag); the other tables stay static."""
    from .data.synthetic import DEFAULT_MULTI_HOT
    from .run_config import ConfigError
    if not 0 < fraction <= 1:
        raise ConfigError(f"--dynamic must lie in (0, 1], got {fraction}")
    tables = {}
    for k, vocabulary in enumerate(vocabulary_sizes):
        name = f"C{k + 1}"
        capacity = math.ceil(fraction * vocabulary)
        if capacity >= batch_size * DEFAULT_MULTI_HOT.get(name, (1,))[0]:
            tables[name] = {"dynamic": True, "capacity": capacity, "admission": {"min_count": 2}, "eviction": "lru"}
    if not tables:
        raise ConfigError(f"--dynamic {fraction}: no table's capacity ({fraction} of its vocabulary, at most "
                          f"{math.ceil(fraction * max(vocabulary_sizes)):,}) holds a batch's ids (batch size "
                          f"{batch_size} times its longest bag); raise --dynamic or --vocabulary-scale, or lower "
                          f"--batch-size")
    return tables


def user_errors() -> tuple:
    """The exceptions that mean "the input is wrong" rather than "embedcore has a bug": embedcore's own
    error classes (bad configuration, data file, batch, checkpoint, row function, non-finite update) and
    the operating system's (a folder that cannot be written). ``main`` reports them as one ``error:`` line
    and exit status 2; anything else is a bug and keeps its traceback."""
    from ..checkpoint import CheckpointError
    from ..checkpoint.tensor_file import TensorFileError
    from ..compiler import RowFunctionError
    from .data import DataFormatError
    from ..engine import NonFiniteError
    from ..inputs import InputError
    from .run_config import ConfigError
    return (ConfigError, DataFormatError, InputError, CheckpointError, TensorFileError, RowFunctionError,
            NonFiniteError, OSError)


MAX_MESSAGE_CHARS = 2000


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (its lines joined by " / ") of at most ``MAX_MESSAGE_CHARS``."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    else:
        text = str(error) or type(error).__name__
    text = " / ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + f"... ({len(text):,} characters)"


def main(argv=None) -> int:
    """Run one command; returns the exit status (2 with one ``error:`` line on stderr for a user error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from ..bench.harness import main as bench
        return bench(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _command(parser, args)
    except user_errors() as e:
        print(f"embedcore {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"embedcore {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


def _command(parser, args) -> None:
    if args.command == "quickstart":
        from .quickstart import run
        run(steps=args.steps, batch_size=args.batch_size, seed=args.seed, **_storage(args))
        return
    from .run_config import check, load_config
    from .trainer import run
    if args.command == "demo":
        config = demo_config(args.output, args.epochs, args.train_samples, args.eval_samples, args.batch_size,
                             args.vocabulary_scale, _storage(args), args.dynamic)
    else:
        config = load_config(args.config)
        if args.output:
            config["train"]["output"] = args.output
            check(config)
    if args.resume and not os.path.isdir(os.path.join(config["train"]["output"], "checkpoint")):
        parser.error(f"--resume: no checkpoint in {config['train']['output']}")
    title = None
    if args.command == "demo":
        stored = config["embedding"].get("weights_dtype", "float32")
        title = ("embedcore demo: DLRM on the synthetic click log, TensorFlow's custom Adagrad" +
                 ("" if stored == "float32" else f", {stored} tables") +
                 ("" if args.dynamic is None else f", dynamic tables at {args.dynamic:g} of their vocabularies"))
    run(config, resume=args.resume, title=title)


if __name__ == "__main__":
    sys.exit(main())
