"""Fits and checks the rational function behind ``TruncatedNormal`` (``embedcore.kernels.random._truncated_z``).

Run from the repository root::

    python benchmarks/fit_truncated_normal.py [--degree 5] [--iterations 200]

The truncated standard normal's inverse distribution function, as a function of ``s = 2u - 1`` in ``[-1, 1]``,
is ``z(s) = sqrt(2) * erfinv(erf(sqrt(2)) * s)``. It is odd, so ``z(s) = s * g(s^2)``, and this script fits
``g(t) ~ P(t) / Q(t)`` (both of degree ``--degree``, ``Q(0) = 1``) on ``t`` in ``[0, 1]``:

* reference values: ``erfinv`` by Newton's method on ``math.erf`` (from 0, where it converges monotonically;
  float64-exact), at 2,000 Chebyshev points of ``[0, 1]``;
* fit: linearised weighted least squares of ``s * (P - g * Q)`` (the error in ``z``), the weights multiplied
  each round by the round's relative error (Lawson's iteration toward the least maximum error); the round with
  the least maximum error on the check grid is kept.

It prints the coefficients (as ``random.py`` holds them), the maximum absolute error of ``z`` on 200,001
points of ``[-1, 1]``, the least ``Q`` on ``[0, 1]``, and ``max |z|`` over the 2**24 largest and smallest
uniforms ``u = m / 2**53``; then the same checks for the coefficients ``random.py`` holds now.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

_W = math.erf(math.sqrt(2.0))
_erf = np.vectorize(math.erf, otypes=[np.float64])


def z_reference(s):
    """``sqrt(2) * erfinv(erf(sqrt(2)) * s)`` to float64 precision (Newton from 0, 40 steps)."""
    s = np.asarray(s, np.float64)
    y, target = np.zeros_like(s), _W * s
    for _ in range(40):
        y = y - (_erf(y) - target) / (2.0 / math.sqrt(math.pi) * np.exp(-y * y))
    return math.sqrt(2.0) * y


def evaluate(p, q, s):
    """``s * P(s^2) / Q(s^2)``, Horner's scheme in float64 as the kernel computes it."""
    t = s * s
    num = np.zeros_like(s) + p[-1]
    for c in p[-2::-1]:
        num = num * t + c
    den = np.zeros_like(s) + q[-1]
    for c in q[-2::-1]:
        den = den * t + c
    return s * num / den


def fit(degree, iterations, check_s, check_z):
    n = 2000
    t = (1.0 - np.cos(np.pi * (np.arange(n) + 0.5) / n)) / 2.0
    s = np.sqrt(t)
    g = z_reference(s) / s
    weights, q_values, best = np.ones(n), np.ones(n), None
    powers = t[:, None] ** np.arange(degree + 1)
    for _ in range(iterations):
        # unknowns: p_0..p_m, q_1..q_m;  P(t) - g(t) * (Q(t) - 1) = g(t)
        a = np.hstack([powers, -(g * t)[:, None] * powers[:, :degree]])
        w = s / q_values * weights
        coef, *_ = np.linalg.lstsq(a * w[:, None], g * w, rcond=None)
        p, q = coef[:degree + 1], np.concatenate([[1.0], coef[degree + 1:]])
        q_values = powers @ q
        error = np.abs(s * (powers @ p / q_values - g))
        worst = np.abs(evaluate(p, q, check_s) - check_z).max()
        if best is None or worst < best[0]:
            best = (worst, p, q)
        weights = weights * error / error.mean()
        weights /= weights.mean()
    return best[1], best[2]


def report(name, p, q, check_s, check_z):
    print(f"{name}:")
    print(f"  P = ({', '.join(repr(float(c)) for c in p)})")
    print(f"  Q = ({', '.join(repr(float(c)) for c in q)})")
    worst = np.abs(evaluate(p, q, check_s) - check_z).max()
    print(f"  max |z - reference| on {check_s.size:,} points of [-1, 1]: {worst:.3g}")
    print(f"  min Q on [0, 1]: {(np.linspace(0, 1, 100_001)[:, None] ** np.arange(q.size) @ q).min():.4g}")
    m = np.arange(1 << 24, dtype=np.float64)
    ends = np.concatenate([m * 2.0 ** -53, 1.0 - (m + 1) * 2.0 ** -53])  # the extreme uniforms u
    largest = float(np.abs(evaluate(p, q, 2.0 * ends - 1.0)).max())
    print(f"  max |z| over the 2**24 extreme uniforms at each end: {largest!r} (2 - {2.0 - largest:.3g})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--degree", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args(argv)
    check_s = np.linspace(-1.0, 1.0, 200_001)
    check_z = z_reference(check_s)
    p, q = fit(args.degree, args.iterations, check_s, check_z)
    report(f"fitted, degree {args.degree}", p, q, check_s, check_z)
    from embedcore.kernels import random as r
    report("embedcore.kernels.random now", np.array([r._P0, r._P1, r._P2, r._P3, r._P4, r._P5]),
           np.array([1.0, r._Q1, r._Q2, r._Q3, r._Q4, r._Q5]), check_s, check_z)


if __name__ == "__main__":
    main()
