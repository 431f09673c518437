"""backend/analytic/scalar_or_array.py: one layout (Python scalars) or many (arrays) through the same call."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from backend.analytic.scalar_or_array import logical_and, logical_or

VALUES = [True, False, 1, 0, np.array([True, False, True]), np.array([1, 1, 0]), np.array([0, 0, 0])]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_logical_and_or_are_numpys_with_scalars_kept_scalar(n):
    for values in itertools.product(VALUES, repeat=n):
        arrays = any(isinstance(v, np.ndarray) for v in values)
        for ours, theirs in ((logical_and, np.logical_and), (logical_or, np.logical_or)):
            got, want = ours(*values), theirs.reduce(np.broadcast_arrays(*(np.asarray(v, bool) for v in values)))
            np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
            if not arrays:
                assert got is bool(want)  # a scalar layout stays a Python bool
    assert logical_and(np.array([1, 0]), False) is False and logical_or(np.array([1, 0]), True) is True
    assert logical_and() is True and logical_or() is False
