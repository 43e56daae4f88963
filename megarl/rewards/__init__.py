"""Reward functions, registered by the name `--reward` takes.

A reward function is `fn(response: str, row: dict) -> RewardOutput | float`:
  response  the generated text (no prompt);
  row       the dataset row's normalised fields (see megarl/data/datasets.py):
            "messages" (the prompt as a chat list), "gt_answer" (math),
            "test_cases" ({"inputs": [...], "outputs": [...]}, code),
            "data_source", "id", and any extra columns.
It returns a score (usually in [0, 1]) and, for the scoring tool and logs, a
short reason ("correct", "wrong answer", "no box", "timeout", ...). A plain
float means reason "". A reason starting with SCORER_TIMEOUT ("timeout: ...") says
the scoring itself ran past a bound (megarl's --reward-timeout, the math grader's
own): those samples are counted in the reward_timeouts metric. A bare "timeout" is
a verdict on the sample (a generated program over its time limit).

Each registered reward may carry a default system prompt (what the model is
told about the answer format); `--system-prompt` overrides it.
Plugins (`--external-plugins file.py`) register more with `@register_reward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megarl.registry import Registry


SCORER_TIMEOUT = "timeout: "


@dataclass
class RewardOutput:
    score: float
    reason: str = ""


@dataclass
class RewardSpec:
    name: str
    fn: Callable[[str, dict], "RewardOutput | float"]
    system_prompt: str | None = None


REWARDS = Registry("reward")  # name -> RewardSpec


def register_reward(name: str, system_prompt: str | None = None):
    """Decorator: register `fn(response, row)` under `name` (the value --reward takes)."""
    def wrap(fn):
        REWARDS.add(name, RewardSpec(name, fn, system_prompt))
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


def build_reward(text: str, reward_model: str | None = None, **reward_model_kwargs) -> RewardSpec:
    """The reward a run uses: `--reward` is one registered name or weighted names
    ("boxed:1.0,rm:0.5"); the name "rm" is the `--reward-model` checkpoint (built with
    `reward_model_kwargs`: micro-batch size, max length, offload)."""
    from megarl.rewards.combine import combined_reward_spec, parse_reward_weights

    extra = {}
    if reward_model:
        from megarl.rewards.reward_model import make_reward_model_reward

        extra["rm"] = make_reward_model_reward(reward_model, name="rm", **reward_model_kwargs)
    parts = parse_reward_weights(text)
    if any(name == "rm" for name, _ in parts) and not reward_model:
        raise ValueError(f"--reward {text!r} uses 'rm' but no --reward-model checkpoint is given")
    if len(parts) == 1 and parts[0][1] == 1.0:
        name = parts[0][0]
        spec = extra[name] if name in extra else get_reward(name)
    else:
        spec = combined_reward_spec(text, extra=extra)
    return spec


def default_system_prompt(text: str) -> str | None:
    """The system prompt of `--reward text`: that of its first part which has one (a reward
    model has none), without loading a reward model."""
    from megarl.rewards.combine import parse_reward_weights

    for name, _ in parse_reward_weights(text):
        if name != "rm" and get_reward(name).system_prompt:
            return get_reward(name).system_prompt
    return None


def score_all(spec: RewardSpec, responses: list[str], rows: list[dict]) -> list[RewardOutput]:
    """Score a batch. A reward that raises gives that sample 0 with reason "error: <type>: <message>"
    (the caller counts and reports them) and scoring goes on. A reward function with a
    `score_batch(responses, rows)` attribute scores the whole batch at once (a sandbox pool,
    a reward model); if the batch call raises, the samples are scored one by one."""
    batch = getattr(spec.fn, "score_batch", None)
    if batch is not None:
        try:
            return [as_output(value) for value in batch(responses, rows)]
        except Exception:  # noqa: BLE001 - fall back to one by one, which isolates the failing samples
            pass
    outputs = []
    for response, row in zip(responses, rows):
        try:
            outputs.append(as_output(spec.fn(response, row)))
        except Exception as error:  # noqa: BLE001 - a broken reward must not stop training
            outputs.append(RewardOutput(0.0, f"error: {type(error).__name__}: {error}"[:200]))
    return outputs


def reward_parts(spec: RewardSpec) -> tuple[list[tuple[RewardSpec, float]], bool]:
    """(the parts of a run's reward with their weights, whether it is a weighted combination)."""
    parts = getattr(spec.fn, "parts", None)
    return (list(parts), True) if parts is not None else ([(spec, 1.0)], False)


def sandbox_limits(text: str) -> list:
    """The sandbox limits of the parts of `--reward text` that run programs in the sandbox (a reward
    function with a `sandbox_limits` attribute: the code rewards), without loading a reward model."""
    from megarl.rewards.combine import parse_reward_weights

    limits = [getattr(get_reward(name).fn, "sandbox_limits", None)
              for name, _ in parse_reward_weights(text) if name != "rm"]
    return [limit for limit in limits if limit is not None]


def _load_builtin_rewards() -> None:
    """Import the modules that register the built-in rewards (lazily: some import heavy libraries)."""
    import importlib

    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


_BUILTIN_MODULES = [
    "megarl.rewards.arithmetic",
    "megarl.rewards.math",
    "megarl.rewards.code",
    "megarl.rewards.verl_rules",
    "megarl.rewards.swift_rules",
    "megarl.tools.environments",  # gym: a gym environment's episode return
]
