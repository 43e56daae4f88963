"""The built-in arithmetic task's reward: exact match of the last \\boxed{} answer."""

from megarl.rewards import RewardOutput, register_reward
from megarl.data.tasks import arithmetic


@register_reward("arithmetic")
def arithmetic_reward(response: str, row: dict) -> RewardOutput:
    boxed = arithmetic.extract_boxed(response)
    if boxed is None:
        return RewardOutput(0.0, "no box")
    score = arithmetic.score(response, row["answer"])
    return RewardOutput(score, "correct" if score else "wrong answer")
