"""Prompt sources: the training prompts of each step and the evaluation sets.

Each step's prompts are a pure function of (seed, step) (plus, for files, the
data position a checkpoint restores), so every rank builds the same list without
communication and a resumed run sees the same prompts. Imports go one way:
data -> datasets (files and layouts) -> prompts (the Prompt record, chat rendering).
"""

from __future__ import annotations

from megarl.datasets import PromptDataset, load_eval_dataset, load_rows, make_prompts
from megarl.prompts import Prompt, render_chat
from megarl.tasks import arithmetic


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

    def state_dict(self) -> dict:
        """Nothing to keep: a step's problems are a function of (seed, step, attempt)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def prompt_source(args, tokenizer, system_prompt: str | None):
    """Training prompts: --train-data files (megarl/datasets.py), else the built-in arithmetic task."""
    if not args.train_data:
        return ArithmeticPrompts(args, tokenizer)
    rows = load_rows(args.train_data, format=args.data_format, prompt_key=args.prompt_key,
                     preprocessor=args.preprocessor)
    return PromptDataset(rows, tokenizer, prompts_per_step=args.prompts_per_step, seed=args.seed,
                         system_prompt=system_prompt, max_prompt_length=args.max_prompt_length,
                         truncation=args.truncation)


def eval_prompts(args, tokenizer, system_prompt: str | None) -> dict[str, list[Prompt]]:
    """Every --eval-dataset, rendered once: {name: prompts in file order}."""
    return {name: make_prompts(load_eval_dataset(path, format=args.data_format, prompt_key=args.prompt_key,
                                                 preprocessor=args.preprocessor),
                               tokenizer, system_prompt, args.max_prompt_length, args.truncation)
            for name, path in args.eval_datasets.items()}
