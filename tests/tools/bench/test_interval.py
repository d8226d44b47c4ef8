"""ratio_interval: the bootstrap interval compare-vllm reports beside its ratio."""

import statistics

import pytest

from kvpager_tools.bench.interval import ratio_interval


def test_identical_rounds_give_a_point_interval():
    rounds = [700.0, 760.0, 820.0, 690.0, 905.0]
    iv = ratio_interval(rounds, rounds, paired=True)
    assert (iv["low"], iv["high"]) == (1.0, 1.0)  # every resampled pair has the same median on both sides


def test_interval_contains_the_ratio_of_medians_and_is_seeded():
    ours = [622.0, 700.8, 562.9, 636.3, 725.6, 755.1, 690.0]
    theirs = [749.5, 768.0, 745.4, 703.6, 767.0, 698.0, 720.0]
    point = statistics.median(ours) / statistics.median(theirs)
    iv = ratio_interval(ours, theirs, paired=True)
    assert iv["low"] <= round(point, 3) <= iv["high"]
    assert iv["low"] < iv["high"]
    assert iv == ratio_interval(ours, theirs, paired=True)  # the same rounds, the same interval
    assert iv["level"] == 0.9 and "pairs" in iv["method"]


def test_paired_resampling_cancels_drift_that_moves_both_engines():
    # Both engines slow down together round by round (the machine drifts); ours is 5 % ahead in every pair.
    drift = [1.0, 0.8, 1.15, 0.9, 1.05, 0.85, 1.1]
    theirs = [1000.0 * d for d in drift]
    ours = [1050.0 * d for d in drift]
    paired = ratio_interval(ours, theirs, paired=True)
    unpaired = ratio_interval(ours, theirs, paired=False)
    assert paired["low"] > 1.0  # the pairs agree: ahead
    assert unpaired["low"] < 1.0 < unpaired["high"]  # resampled apart, the drift swamps 5 %
    assert unpaired["high"] - unpaired["low"] > paired["high"] - paired["low"]


def test_a_clear_gap_excludes_one():
    ours = [600.0, 610.0, 590.0, 605.0, 598.0]
    theirs = [800.0, 790.0, 810.0, 805.0, 795.0]
    iv = ratio_interval(ours, theirs, paired=False)
    assert iv["high"] < 0.8


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="equal counts"):
        ratio_interval([1.0, 2.0], [1.0], paired=True)
    with pytest.raises(ValueError, match="at least one round"):
        ratio_interval([], [1.0], paired=False)
    with pytest.raises(ValueError, match="level"):
        ratio_interval([1.0], [1.0], paired=True, level=1.5)
    with pytest.raises(ValueError, match="positive"):
        ratio_interval([1.0], [0.0], paired=True)
