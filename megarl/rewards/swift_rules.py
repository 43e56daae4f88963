"""ms-swift's built-in shaping rewards (its `reward_funcs` names), as megarl rewards under the same names.

Each follows ms-swift's definition (swift/rewards/orm.py; its parameters in
swift/megatron/arguments/megatron_args.py, with the same defaults as megarl's flags):

``format``        1 when the response is ``<think>...</think>``, optional whitespace, then
                  ``<answer>...</answer>`` and nothing after it (nothing before it either); else 0.
``react_format``  1 when the response starts ``<think>...</think>``, whitespace, then ``Action:`` ...
                  ``Action Input:`` (ending at a line end); else 0.
``cosine``        Yeo et al. 2025 (arXiv 2502.03373): with L the response's token count and
                  Lmax = --cosine-max-len (default --max-new-tokens),
                      r = hi - (hi - lo) (1 - cos(pi L / Lmax)) / 2,
                  hi/lo = --cosine-min-len-value-correct / --cosine-max-len-value-correct when the
                  answer is correct, --cosine-min-len-value-wrong / --cosine-max-len-value-wrong when
                  not: r = hi at L = 0 and lo at L = Lmax (past Lmax the cosine turns back, as in
                  ms-swift). Correct means the `boxed` reward (megarl's counterpart of ms-swift's
                  `accuracy`) scores >= 1. The token count is the row's "response_tokens" (the
                  rollout puts it there: megarl.rewards.scoring.reward_row).
``repetition``    Yeo et al. 2025: the response's lower-cased whitespace-separated words as n-grams
                  (n = --repetition-n-grams); r = (1 - distinct / total) * --repetition-max-penalty;
                  0 for an empty response or one with fewer than n words.

ms-swift's ``soft_overlong`` is megarl's --overlong-buffer-len (a length penalty added to the score, not a
reward part) and its ``accuracy`` is ``boxed``; its ``code_reward`` is megarl's ``code`` (the fraction of
test cases passed; megarl's local sandbox instead of e2b, see megarl/rewards/code.py).

The parameters are process settings (`configure`, from the run's flags: megarl.run); reward worker
processes (--reward-timeout) receive them at start (megarl/rewards/workers.py).
"""

from __future__ import annotations

import math
import re

from megarl.rewards import RewardOutput, get_reward, register_reward

# ms-swift's defaults (swift/megatron/arguments/megatron_args.py: cosine_*, repetition_*); cosine_max_len
# None means the run's max_new_tokens.
DEFAULTS = {"cosine_min_len_value_wrong": -0.5, "cosine_max_len_value_wrong": 0.0,
            "cosine_min_len_value_correct": 1.0, "cosine_max_len_value_correct": 0.5, "cosine_max_len": None,
            "repetition_n_grams": 3, "repetition_max_penalty": -1.0}
SETTINGS = dict(DEFAULTS)


def configure(**settings) -> None:
    """Set this process's reward parameters (names as DEFAULTS; unknown names raise TypeError)."""
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown swift reward settings: {sorted(unknown)}")
    SETTINGS.update(settings)


def configure_from_args(args) -> None:
    """The run's flags as this process's settings; --cosine-max-len defaults to --max-new-tokens."""
    settings = {name: getattr(args, name) for name in DEFAULTS if hasattr(args, name)}
    if settings.get("cosine_max_len") is None:
        settings["cosine_max_len"] = getattr(args, "max_new_tokens", None)
    configure(**settings)


def current_settings() -> dict:
    return dict(SETTINGS)


_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_REACT_FORMAT = re.compile(r"<think>.*?</think>\s*Action:.*?Action Input:.*?$", re.DOTALL | re.MULTILINE)


@register_reward("format", system_prompt="")
def format_reward(response: str, row: dict) -> RewardOutput:
    ok = _FORMAT.fullmatch(response) is not None
    return RewardOutput(1.0 if ok else 0.0, "format" if ok else "bad format")


@register_reward("react_format", system_prompt="")
def react_format_reward(response: str, row: dict) -> RewardOutput:
    ok = _REACT_FORMAT.match(response) is not None
    return RewardOutput(1.0 if ok else 0.0, "format" if ok else "bad format")


def cosine_scaled(length: int, max_len: int, value_at_zero: float, value_at_max: float) -> float:
    """The cosine schedule from value_at_zero (length 0) to value_at_max (length max_len)."""
    return value_at_zero - (value_at_zero - value_at_max) * (1.0 - math.cos(length * math.pi / max_len)) / 2.0


@register_reward("cosine", system_prompt="")
def cosine_reward(response: str, row: dict) -> RewardOutput:
    settings = SETTINGS
    max_len = settings["cosine_max_len"]
    if not max_len:
        raise ValueError("the cosine reward needs --cosine-max-len (or --max-new-tokens)")
    if "response_tokens" not in row:
        raise ValueError("the cosine reward needs the response's token count (row['response_tokens'], which "
                         "the rollout sets)")
    correct = get_reward("boxed").fn(response, row)
    correct = getattr(correct, "score", correct) >= 1.0
    if correct:
        hi, lo = settings["cosine_min_len_value_correct"], settings["cosine_max_len_value_correct"]
    else:
        hi, lo = settings["cosine_min_len_value_wrong"], settings["cosine_max_len_value_wrong"]
    return RewardOutput(cosine_scaled(int(row["response_tokens"]), max_len, hi, lo),
                        "correct" if correct else "wrong")


def repetition_scaling(text: str, n: int) -> float:
    """1 - distinct n-grams / n-grams of the lower-cased words (0 with fewer than n words)."""
    words = text.lower().split()
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


@register_reward("repetition", system_prompt="")
def repetition_reward(response: str, row: dict) -> float:
    return repetition_scaling(response, SETTINGS["repetition_n_grams"]) * SETTINGS["repetition_max_penalty"]
