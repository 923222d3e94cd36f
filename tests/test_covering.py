"""The covering sets that stand for full products of kernel variants in the tests."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.covering import pairs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_every_pair_of_values_of_every_two_axes_is_covered(sizes):
    axes = [[f"a{k}v{v}" for v in range(size)] for k, size in enumerate(sizes)]
    cases = pairs(*axes)
    assert all(len(case) == len(axes) for case in cases)
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(c[i], c[j]) for c in cases} == set(itertools.product(axes[i], axes[j]))
    if len(sizes) >= 2:
        largest = sorted(sizes)[-2:]
        assert len(cases) <= max(1, largest[0] * largest[1]) * 2  # far below the product for many axes
    assert cases == pairs(*axes)  # deterministic


def test_required_cases_come_first_and_the_set_is_smaller_than_the_product():
    cases = pairs(["float16", "bfloat16"], ["float32", "bfloat16"], [5, 16, 24, 64], ["sgd", "adagrad"],
                  must=[("bfloat16", "bfloat16", 64, "adagrad")])
    assert cases[0] == ("bfloat16", "bfloat16", 64, "adagrad")
    assert len(cases) <= 10 < 2 * 2 * 4 * 2
