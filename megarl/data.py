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


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template applied to `messages`, ending with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def render_chat(tokenizer, user_text: str, system_prompt: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": user_text}]
    return chat_token_ids(tokenizer, messages)


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


def prompt_source(args, tokenizer, system_prompt: str | None):
    """Training prompts: --train-data files (megarl/datasets.py), else the built-in arithmetic task."""
    if not args.train_data:
        return ArithmeticPrompts(args, tokenizer)
    from megarl.datasets import PromptDataset, load_rows

    rows = load_rows(args.train_data, format=args.data_format, prompt_key=args.prompt_key,
                     preprocessor=args.preprocessor)
    return PromptDataset(rows, tokenizer, prompts_per_step=args.prompts_per_step, seed=args.seed,
                         system_prompt=system_prompt, max_prompt_length=args.max_prompt_length,
                         truncation=args.truncation)


def eval_prompts(args, tokenizer, system_prompt: str | None) -> dict[str, list[Prompt]]:
    """Every --eval-dataset, rendered once: {name: prompts in file order}."""
    from megarl.datasets import load_eval_dataset, make_prompts

    return {name: make_prompts(load_eval_dataset(path, format=args.data_format, prompt_key=args.prompt_key,
                                                 preprocessor=args.preprocessor),
                               tokenizer, system_prompt, args.max_prompt_length, args.truncation)
            for name, path in args.eval_datasets.items()}
