"""A prompt as the rollout receives it, and chat-template rendering."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Prompt:
    index: int  # position in this step's list
    ids: list[int]
    metadata: dict  # what the reward needs, e.g. {"answer": "85"}
    teacher_ids: list[int] | None = None  # OPSD: the row's privileged teacher prompt, rendered


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The tokenizer's chat template applied to `messages`, ending with the generation prompt; `tools`:
    the OpenAI schemas of the tools the model may call (megarl/tools), listed as the template lists them."""
    return template_ids(tokenizer, messages, tools, add_generation_prompt=True)


def template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                 add_generation_prompt: bool = False) -> list[int]:
    """The chat template's token ids of `messages` (by default without a generation prompt)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def render_chat(tokenizer, user_text: str, system_prompt: str | None = None,
                tools: list[dict] | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": user_text}]
    return chat_token_ids(tokenizer, messages, tools)


def reference_response_ids(tokenizer, messages: list[dict], response_text: str) -> list[int]:
    """The tokens of `response_text` as the assistant's reply to `messages`: the chat template's
    rendering of the whole exchange after the generation prompt, up to and including its first
    special token (the end of the turn, where the model's own generation stops)."""
    prompt = chat_token_ids(tokenizer, messages)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response_text}],
                                         add_generation_prompt=False, tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template renders an assistant turn that does not start with its own "
                         "generation prompt; cannot cut the reference response out of it")
    response, special = full[len(prompt):], set(tokenizer.all_special_ids)
    end = next((i + 1 for i, token in enumerate(response) if token in special), len(response))
    return response[:end]
