"""A prompt as the rollout receives it, and chat-template rendering."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Prompt:
    index: int  # position in this step's list
    ids: list[int]
    metadata: dict  # what the reward needs, e.g. {"answer": "85"}
    teacher_ids: list[int] | None = None  # OPSD: the row's privileged teacher prompt, rendered


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template applied to `messages`, ending with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def render_chat(tokenizer, user_text: str, system_prompt: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": user_text}]
    return chat_token_ids(tokenizer, messages)
