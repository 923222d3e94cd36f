"""Covering sets of test cases: every pair of two axes' values in some case, not every tuple.

A kernel is compiled per combination of its variant axes (optimizer, row length, table format, gradient
format, ...), so a test parametrized over the full product of those axes compiles their product. Defects
that depend on one axis, or on how two axes meet, are found by any set of cases in which every pair of
values of every two axes occurs: :func:`pairs` builds such a set, a few times the largest two axes' sizes
instead of the product of all.
"""

from __future__ import annotations

import itertools


def pairs(*axes, must=()):
    """Cases (tuples, one value per axis) in which every pair of values of any two axes occurs, greedily
    built and deterministic. ``must``: cases to include as they are (checked to have a value per axis).

    >>> len(pairs([1, 2, 3], "ab", "xy")) < 3 * 2 * 2
    True
    """
    axes = [list(axis) for axis in axes]
    if any(not axis for axis in axes):
        raise ValueError("every axis needs a value")
    n = len(axes)
    if n < 2:
        return [tuple(c) for c in itertools.product(*axes)]
    missing = {(i, a, j, b) for i, j in itertools.combinations(range(n), 2)
               for a in range(len(axes[i])) for b in range(len(axes[j]))}
    cases = []

    def cover(choice):
        for i, j in itertools.combinations(range(n), 2):
            missing.discard((i, choice[i], j, choice[j]))
        cases.append(tuple(axes[k][choice[k]] for k in range(n)))

    for case in must:
        if len(case) != n:
            raise ValueError(f"case {case!r} has {len(case)} values for {n} axes")
        cover([axes[k].index(case[k]) for k in range(n)])
    while missing:
        # start from a pair still missing, then give each other axis the value that covers most new pairs
        i, a, j, b = min(missing)
        choice = [None] * n
        choice[i], choice[j] = a, b
        for k in range(n):
            if choice[k] is not None:
                continue

            def gain(v):
                return sum((min(k, m), v if k < m else choice[m], max(k, m), choice[m] if k < m else v) in missing
                           for m in range(n) if choice[m] is not None)
            choice[k] = max(range(len(axes[k])), key=lambda v: (gain(v), -v))
        cover(choice)
    return cases
