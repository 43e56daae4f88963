"""tests/helpers.py's rule for two training runs (assert_runs_agree), on series of the kinds the e2e tests compare."""

from __future__ import annotations

import pytest

from helpers import assert_runs_agree


def test_a_metric_is_judged_on_its_own_magnitude():
    assert_runs_agree({0: 0.437, 1: 0.512}, {0: 0.43702, 1: 0.5121}, "grad_norm")
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_runs_agree({0: 0.437, 1: 0.512}, {0: 0.437, 1: 0.52}, "grad_norm")


def test_a_policy_loss_cancelled_to_rounding_is_judged_on_its_terms_not_on_itself():
    # on-policy, every response equally long: the GRPO surrogate is 0 up to rounding in both runs
    assert_runs_agree({0: 3.1e-9, 1: -2.2e-9}, {0: -1.4e-9, 1: 0.0}, "packed actor loss")
    # a run that computes another loss differs by a fraction of an advantage, however small the series
    with pytest.raises(AssertionError, match="loss"):
        assert_runs_agree({0: 3.1e-9, 1: -2.2e-9}, {0: 0.004, 1: 0.0}, "loss")
    # a loss of its own magnitude keeps it: 1e-3 of 0.8
    with pytest.raises(AssertionError, match="loss"):
        assert_runs_agree({0: 0.8}, {0: 0.8012}, "loss")


def test_rounding_level_metrics_are_judged_on_one():
    assert_runs_agree({0: 3e-7}, {0: 9e-7}, "mismatch")
    with pytest.raises(AssertionError, match="mismatch"):
        assert_runs_agree({0: 3e-7}, {0: 2e-3}, "mismatch")
