"""Weighted reward combinations and their command-line form."""

import pytest

from megarl.rewards import RewardOutput, RewardSpec, get_reward
from megarl.rewards.combine import (
    combine_rewards,
    combined_reward_spec,
    parse_reward_weights,
)

ROW = {"gt_answer": "4"}
TAGGED_BOXED = "<think>2 + 2</think><answer>\\boxed{4}</answer>"


def length_penalty(response, row):
    return -0.01 * len(response)


FAKE_RM = RewardSpec("rm", lambda response, row: RewardOutput(0.37, ""))


@pytest.mark.parametrize("text,expected", [
    ("boxed:1.0,rm:0.5", [("boxed", 1.0), ("rm", 0.5)]),
    ("boxed", [("boxed", 1.0)]),
    (" boxed : 2 , think_answer_tags:-0.25 ", [("boxed", 2.0), ("think_answer_tags", -0.25)]),
    ("boxed:1e-1", [("boxed", 0.1)]),
])
def test_parse_reward_weights(text, expected):
    assert parse_reward_weights(text) == expected


@pytest.mark.parametrize("text,match", [
    ("", "empty reward name"),
    ("boxed:1,", "empty reward name"),
    (":1", "empty reward name"),
    ("boxed:heavy", "not a number"),
    ("boxed:1,boxed:2", "named twice"),
])
def test_parse_reward_weights_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        parse_reward_weights(text)


def test_weighted_sum_and_reasons():
    fn = combine_rewards([("boxed", 1.0), ("think_answer_tags", 0.5), (length_penalty, 2.0), (FAKE_RM, -1.0)])
    out = fn(TAGGED_BOXED, ROW)
    assert out.score == pytest.approx(1.0 + 0.5 * 1.0 + 2.0 * (-0.01 * len(TAGGED_BOXED)) - 0.37)
    assert len(TAGGED_BOXED) == 46  # a part's reason shows its own score, unweighted
    assert out.reason == "boxed=correct, think_answer_tags=correct, length_penalty=-0.46, rm=0.37"


def test_parts_are_all_scored():
    fn = combine_rewards([("boxed", 1.0), ("think_answer_tags", 1.0)])
    assert fn("\\boxed{5}", ROW) == RewardOutput(0.0, "boxed=wrong answer, think_answer_tags=no answer tags")
    assert fn("<think></think><answer>4</answer>", ROW) == RewardOutput(1.0, "boxed=no box, think_answer_tags=correct")


def test_combined_spec_takes_extra_names_and_the_first_system_prompt():
    spec = combined_reward_spec("rm:0.5,boxed:1.0", extra={"rm": FAKE_RM})
    assert spec.name == "rm:0.5,boxed:1.0"
    assert spec.system_prompt == get_reward("boxed").system_prompt
    assert spec.fn("\\boxed{4}", ROW) == RewardOutput(pytest.approx(0.5 * 0.37 + 1.0), "rm=0.37, boxed=correct")
    assert combined_reward_spec("rm", extra={"rm": FAKE_RM}).system_prompt is None


def test_unknown_name_and_empty_combination():
    with pytest.raises(ValueError, match="not registered"):
        combine_rewards([("no_such_reward", 1.0)])
    with pytest.raises(ValueError, match="at least one"):
        combine_rewards([])
