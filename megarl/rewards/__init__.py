"""Reward functions, registered by the name `--reward` takes.

A reward function is `fn(response: str, row: dict) -> RewardOutput | float`:
  response  the generated text (no prompt);
  row       the dataset row's normalised fields (see megarl/datasets.py):
            "messages" (the prompt as a chat list), "gt_answer" (math),
            "test_cases" ({"inputs": [...], "outputs": [...]}, code),
            "data_source", "id", and any extra columns.
It returns a score (usually in [0, 1]) and, for the scoring tool and logs, a
short reason ("correct", "wrong answer", "no box", "timeout", ...). A plain
float means reason "".

Each registered reward may carry a default system prompt (what the model is
told about the answer format); `--system-prompt` overrides it.
Plugins (`--external-plugins file.py`) register more with `@register_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class RewardOutput:
    score: float
    reason: str = ""


@dataclass
class RewardSpec:
    name: str
    fn: Callable[[str, dict], "RewardOutput | float"]
    system_prompt: str | None = None


REWARDS: dict[str, RewardSpec] = {}


def register_reward(name: str, system_prompt: str | None = None):
    """Decorator: register `fn(response, row)` under `name` (the value --reward takes)."""
    def wrap(fn):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = RewardSpec(name, fn, system_prompt)
        return fn
    return wrap


def as_output(value) -> RewardOutput:
    """A reward function's return value as a RewardOutput (a float means no reason)."""
    if isinstance(value, RewardOutput):
        return RewardOutput(float(value.score), value.reason)
    return RewardOutput(float(value))


def get_reward(name: str) -> RewardSpec:
    _load_builtin_rewards()
    if name not in REWARDS:
        raise ValueError(f"--reward {name!r} is not registered; known: {sorted(REWARDS)}")
    return REWARDS[name]


def _load_builtin_rewards() -> None:
    """Import the modules that register the built-in rewards (lazily: some import heavy libraries)."""
    import importlib

    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


_BUILTIN_MODULES = [
    "megarl.rewards.arithmetic",
    "megarl.rewards.math",
    "megarl.rewards.code",
]
