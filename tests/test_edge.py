"""Edge-case sets: the named tail transforms really reach the low-density tail on digits; ARDIS 7s from
the real files. The `auto` ladder and the tail target: tests/test_tail_construction.py."""

from __future__ import annotations

import numpy as np
import pytest

from fedsim.data.digits import DigitsParams, load_digits
from fedsim.data.edge import ArdisEdge, TailEdge, build_ardis, build_tail, density_report


@pytest.fixture(scope="module")
def digits():
    return load_digits(None, DigitsParams())


@pytest.mark.parametrize("transform", ["rotate", "invert", "thicken"])
def test_tail_set_is_in_the_low_density_tail(digits, transform):
    edge = build_tail(digits, TailEdge(transform=transform), seed=0)
    assert len(edge.x_train) == (digits.y_train == 7).sum() and len(edge.x_test) == (digits.y_test == 7).sum()
    assert edge.target == 1 and edge.source == 7
    # most edge inputs are less likely than 95% of the clean training images
    assert edge.density["median_percentile"] < 5.0
    assert edge.density["share_below_train_p5"] > 0.5
    assert edge.density["transform"] == transform and edge.density["target_met"]  # the default target, reported


def test_untransformed_source_class_is_not_in_the_tail(digits):
    """The oracle for the check itself: ordinary held-out 7s sit in the bulk of the density."""
    report = density_report(digits.x_train, digits.x_test[digits.y_test == 7], TailEdge(), seed=0)
    assert report["median_percentile"] > 20.0


def test_rotation_angles_within_range(digits):
    spec = TailEdge(transform="rotate", angle_range=(30, 90))
    a = build_tail(digits, spec, seed=1)
    b = build_tail(digits, spec, seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)  # seeded
    assert not np.allclose(a.x_train, digits.x_train[digits.y_train == 7])  # actually transformed


def test_ardis_sevens(real_data_dir):
    from fedsim.registry import DATASETS

    ardis = DATASETS.get("ardis").obj(real_data_dir, DATASETS.get("ardis").params())
    edge = build_ardis(ardis, ArdisEdge(), seed=0)
    assert edge.x_train.shape == (660, 1, 28, 28) and edge.x_test.shape == (100, 1, 28, 28)
    assert edge.target == 1
