"""verl's rule rewards, routed by each row's `data_source` as verl's default_compute_score routes them, so
that data prepared by verl's example preprocessors (examples/data_preprocess/gsm8k.py, math_dataset.py)
score as they do in verl:

    gsm8k                the last `#### <number>` of the response's last 300 characters (commas and `$`
                         dropped) equals the ground truth: 1.0, else 0.0 (verl's "strict" method; the
                         preprocessor put the instruction to answer after "####" in the prompt)
    verl_data_source     per row: openai/gsm8k -> gsm8k; the MATH sets (lighteval/MATH,
                         DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500) -> boxed; any other
                         data_source scores 0 with the reason naming it

Neither adds a system prompt: verl's prepared prompts carry their own instructions.
"""

from __future__ import annotations

import re

from megarl.rewards import RewardOutput, as_output, get_reward, register_reward

GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
CLIP_CHARS = 300  # verl scores the end of the response only: long responses may quote "####" earlier
GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_answer(response: str) -> str | None:
    found = GSM8K_ANSWER.findall(response[-CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k_flexible_answer(response: str) -> str | None:
    """verl's "flexible" method (its GSM8K tool's): the last number of the response's end, as written
    (commas kept), skipping a lone "." match."""
    found = [number for number in NUMBER.findall(response[-CLIP_CHARS:]) if number not in ("", ".")]
    return found[-1] if found else None


@register_reward("gsm8k", system_prompt="")
def gsm8k_reward(response: str, row: dict) -> RewardOutput:
    answer = gsm8k_answer(response)
    if answer is None:
        return RewardOutput(0.0, "no #### answer")
    correct = answer == str(row.get("gt_answer")).replace(",", "").strip()
    return RewardOutput(1.0 if correct else 0.0, "correct" if correct else "wrong answer")


@register_reward("verl_data_source", system_prompt="")
def verl_data_source_reward(response: str, row: dict) -> RewardOutput:
    source = row.get("data_source")
    if source in GSM8K_SOURCES:
        return gsm8k_reward(response, row)
    if source in MATH_SOURCES:
        return as_output(get_reward("boxed").fn(response, row))
    return RewardOutput(0.0, f"no rule reward for data_source {source!r} (verl_data_source knows "
                             f"{', '.join(GSM8K_SOURCES + MATH_SOURCES)})")
