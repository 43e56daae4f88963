"""Weighted sums of rewards, e.g. correctness plus a reward model: ``boxed:1.0,rm:0.5``.

    fn = combine_rewards([("boxed", 1.0), (rm_spec, 0.5)])
    fn(response, row)   # RewardOutput(score=1.0*s_boxed + 0.5*s_rm, reason="boxed=correct, rm=0.37")

A part is a registered reward's name, a RewardSpec, or a plain
``fn(response, row)``; it is labelled by its name (a function by its __name__).
The reason joins each part's ``label=reason``, the part's score (3 significant
digits) standing in for an empty reason. Each part scores the whole batch
(`score_batch`, so a reward model or sandbox pool part keeps its batch path):
there is no short-circuit, since every weight contributes. A part that raises
scores 0 for the samples it failed on, with reason "error: ..." in its place.

The command-line form ``name:weight,name:weight`` (a missing weight means 1.0) is
parsed by `parse_reward_weights`; `combined_reward_spec` parses, resolves and
combines in one step, taking the system prompt of the first part that has one.
Names outside the registry (a reward model built from a path) are passed in
``extra``.
"""

from __future__ import annotations

from collections.abc import Iterable

from megarl.rewards import RewardOutput, RewardSpec, get_reward, score_all


def parse_reward_weights(text: str) -> list[tuple[str, float]]:
    """``"boxed:1.0,rm:0.5"`` -> ``[("boxed", 1.0), ("rm", 0.5)]``; ``"boxed"`` -> ``[("boxed", 1.0)]``."""
    parts = []
    for item in text.split(","):
        name, _, weight = item.strip().partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"reward weights {text!r}: empty reward name")
        try:
            parts.append((name, float(weight) if weight.strip() else 1.0))
        except ValueError:
            raise ValueError(f"reward weights {text!r}: weight {weight!r} of {name!r} is not a number") from None
    names = [name for name, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"reward weights {text!r}: a reward is named twice")
    return parts


def _resolve(part, extra: dict[str, RewardSpec]) -> RewardSpec:
    """A part as a RewardSpec: names through `extra` then the registry; functions named by __name__."""
    if isinstance(part, RewardSpec):
        return part
    if isinstance(part, str):
        return extra[part] if part in extra else get_reward(part)
    return RewardSpec(getattr(part, "__name__", type(part).__name__), part)


def combine_rewards(parts: Iterable[tuple], extra: dict[str, RewardSpec] | None = None):
    """``fn(response, row) -> RewardOutput``: the weighted sum of the parts (see the module docstring)."""
    specs = [(_resolve(part, extra or {}), float(weight)) for part, weight in parts]
    if not specs:
        raise ValueError("combine_rewards needs at least one reward")

    def score_batch(responses: list[str], rows: list[dict]) -> list[RewardOutput]:
        # Part by part over the whole batch, so a part with its own batch path (a reward
        # model, a sandbox pool) gets the batch; a part that raises scores 0 for its share.
        return combine_outputs(specs, [score_all(spec, responses, rows) for spec, _ in specs])

    def combined_reward(response: str, row: dict) -> RewardOutput:
        return score_batch([response], [row])[0]

    combined_reward.score_batch = score_batch
    combined_reward.parts = specs  # for logs and tests: [(RewardSpec, weight), ...]
    return combined_reward


def combine_outputs(specs: list[tuple[RewardSpec, float]], per_part: list[list[RewardOutput]]) -> list[RewardOutput]:
    """Each sample's weighted sum of its part outputs (per_part[j][i]: part j on sample i), reason
    "name=reason, ..." (the score standing in for an empty reason)."""
    combined = []
    for outputs in zip(*per_part):
        total = sum(weight * out.score for (_, weight), out in zip(specs, outputs))
        reasons = [f"{spec.name}={out.reason or f'{out.score:.3g}'}" for (spec, _), out in zip(specs, outputs)]
        combined.append(RewardOutput(total, ", ".join(reasons)))
    return combined


def combined_reward_spec(text: str, extra: dict[str, RewardSpec] | None = None) -> RewardSpec:
    """The RewardSpec for ``--reward boxed:1.0,rm:0.5``: its system prompt is the first part's that has one."""
    fn = combine_rewards(parse_reward_weights(text), extra)
    prompt = next((spec.system_prompt for spec, _ in fn.parts if spec.system_prompt), None)
    return RewardSpec(text, fn, prompt)
