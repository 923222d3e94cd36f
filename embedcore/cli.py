"""Command line: ``embedcore demo`` (and ``python -m embedcore demo``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="embedcore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model on built-in data with TensorFlow's CustomOptimizer "
                                       "examples and print what it learned")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--batch-size", type=int, default=256)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.steps < 1 or args.batch_size < 1:
            parser.error("--steps and --batch-size must be >= 1")
        from .quickstart import run
        run(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
