"""Reward functions, registered by the name `--reward` takes: fn(response_text, metadata) -> float."""

from megarl.tasks import arithmetic

REWARDS = {
    "arithmetic": lambda text, metadata: arithmetic.score(text, metadata["answer"]),
}


def get_reward(name: str):
    if name not in REWARDS:
        raise ValueError(f"--reward {name!r} is not registered; known: {sorted(REWARDS)}")
    return REWARDS[name]
