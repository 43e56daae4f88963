"""Prompt sources. Each step's prompts are a pure function of (seed, step), so
every rank builds the same list without communication and a resumed run sees
the same prompts."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.tasks import arithmetic


@dataclass
class Prompt:
    index: int  # position in this step's list
    ids: list[int]
    metadata: dict  # what the reward needs, e.g. {"answer": "85"}


def render_chat(tokenizer, user_text: str, system_prompt: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": user_text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class ArithmeticPrompts:
    """megarl's built-in task: 'What is a + b?', answer in \\boxed{}."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer

    def batch(self, step: int, attempt: int = 0) -> list[Prompt]:
        """The prompts of `step`; attempt > 0 gives fresh ones for DAPO's extra generation batches."""
        seed = self.args.seed * 1_000_003 + step + attempt * 7_919_993
        problems = arithmetic.make_problems(self.args.prompts_per_step, seed=seed)
        prompts = []
        for index, problem in enumerate(problems):
            ids = render_chat(self.tokenizer, problem["prompt"])
            if len(ids) > self.args.max_prompt_length:
                raise ValueError(f"prompt {index} of step {step} has {len(ids)} tokens, over "
                                 f"--max-prompt-length {self.args.max_prompt_length}")
            prompts.append(Prompt(index, ids, {"answer": problem["answer"]}))
        return prompts


def prompt_source(args, tokenizer):
    return ArithmeticPrompts(args, tokenizer)
