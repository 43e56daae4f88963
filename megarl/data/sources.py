"""Prompt sources: the training prompts of each step and the evaluation sets.

Each step's prompts are a pure function of (seed, step) (plus, for files, the
data position a checkpoint restores), so every rank builds the same list without
communication and a resumed run sees the same prompts. Imports go one way:
data -> datasets (files and layouts) -> prompts (the Prompt record, chat rendering).
"""

from __future__ import annotations

from megarl.data.datasets import DatasetError, PromptDataset, load_eval_dataset, load_rows, make_prompts
from megarl.data.prompts import Prompt, render_chat
from megarl.data.tasks import arithmetic


# `--eval-dataset NAME=builtin[:N]`: N held-out problems of the built-in task (default 200), drawn
# from a seed no training step uses (training seeds are seed * 1_000_003 + step + ...).
BUILTIN_EVAL = "builtin"
BUILTIN_EVAL_SEED = -1


class ArithmeticPrompts:
    """megarl's built-in task: 'What is a + b?', answer in \\boxed{}."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.max_operand = args.task_max_operand or arithmetic.MAX_OPERAND
        # The longest problem now, so that a too small --max-prompt-length fails at start, not at a step.
        top = self.max_operand
        arithmetic_prompts([{"prompt": f"What is {top} + {top}?", "answer": str(2 * top)}], tokenizer,
                           args.max_prompt_length, "the built-in task", args.tools)

    def batch(self, step: int, attempt: int = 0) -> list[Prompt]:
        """The prompts of `step`; attempt > 0 gives fresh ones for DAPO's extra generation batches."""
        seed = self.args.seed * 1_000_003 + step + attempt * 7_919_993
        return arithmetic_prompts(arithmetic.make_problems(self.args.prompts_per_step, seed=seed,
                                                           max_operand=self.max_operand), self.tokenizer,
                                  self.args.max_prompt_length, f"step {step}", self.args.tools)

    def peek(self, step: int) -> list[Prompt]:
        """PromptDataset.peek's: here every batch is a function of its step."""
        return self.batch(step)

    def state_dict(self) -> dict:
        """Nothing to keep: a step's problems are a function of (seed, step, attempt)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def arithmetic_prompts(problems, tokenizer, max_prompt_length: int, where: str, tools: list[str] = ()) -> list[Prompt]:
    """The problems as prompts; `tools` (--tools): every enabled tool is listed to the model."""
    from megarl.tools import tool_schemas

    schemas = tool_schemas(list(tools))
    prompts = []
    for index, problem in enumerate(problems):
        ids = render_chat(tokenizer, problem["prompt"], tools=schemas)
        if len(ids) > max_prompt_length:
            raise DatasetError(f"prompt {index} of {where} has {len(ids)} tokens, over "
                               f"--max-prompt-length {max_prompt_length}")
        # The chat and reference response serve GKD's off-policy steps (--gkd-lmbda < 1).
        prompts.append(Prompt(index, ids, {"answer": problem["answer"],
                                           "messages": [{"role": "user", "content": problem["prompt"]}],
                                           "reference_solution": arithmetic.format_response(problem["answer"])}))
    return prompts


def prompt_source(args, tokenizer, system_prompt: str | None):
    """Training prompts: --train-data files (megarl/data/datasets.py), else the built-in arithmetic task."""
    if not args.train_data:
        return ArithmeticPrompts(args, tokenizer)
    rows = load_rows(args.train_data, format=args.data_format, prompt_key=args.prompt_key,
                     preprocessor=args.preprocessor, id_key=args.prompt_id_key)
    if 0 < args.train_max_samples < len(rows):  # a seeded subset, as verl's data.train_max_samples draws one
        import numpy as np

        drawn = np.random.default_rng(args.seed).choice(len(rows), size=args.train_max_samples, replace=False)
        rows = [rows[i] for i in sorted(drawn.tolist())]
    rows = with_environment(args, rows)
    if args.gkd_lmbda < 1.0 and not args.seq_kd:  # some steps train on the rows' own responses
        missing = next((row for row in rows if not (row.extra.get("reference_solution") or row.extra.get("response"))),
                       None)
        if missing is not None:
            raise DatasetError(f"{missing.origin}: --gkd-lmbda {args.gkd_lmbda} trains some steps on the dataset's "
                               f"responses, but this row has none (a final assistant message or a 'response' field)")
    return PromptDataset(rows, tokenizer, prompts_per_step=args.prompts_per_step, seed=args.seed,
                         system_prompt=system_prompt, max_prompt_length=args.max_prompt_length,
                         truncation=args.truncation, tools=args.tools)


def with_environment(args, rows):
    """--gym-env: each row's prompt is the environment's opening on its env_config (environments.opening),
    whatever its messages held. A row whose env_config has no `seed` gets one, fixed by --seed and the row's
    origin (environments.seeded): megarl replays an episode from its env_config at every turn, so an unseeded
    environment would draw another world each turn."""
    if not getattr(args, "gym_env", ""):
        return rows
    from megarl.tools.environments import opening, seeded

    for row in rows:
        try:
            row.extra["env_config"] = seeded(row.extra, f"{args.seed}:{row.origin or row.id}")
            row.messages = opening(args.gym_env, row.extra)
        except (ValueError, TypeError, KeyError) as error:
            raise DatasetError(f"{row.origin}: --gym-env {args.gym_env}: {error}") from None
    return rows


def eval_prompts(args, tokenizer, system_prompt: str | None) -> dict[str, list[Prompt]]:
    """Every --eval-dataset, rendered once: {name: prompts in file order}; `builtin[:N]` is N held-out
    problems of the built-in arithmetic task."""
    sets = {}
    for name, path in args.eval_datasets.items():
        if path.split(":")[0] == BUILTIN_EVAL:
            count = int(path.split(":")[1]) if ":" in path else 200
            count = min(count, args.eval_max_samples or count)
            problems = arithmetic.make_problems(count, seed=BUILTIN_EVAL_SEED,
                                                max_operand=args.task_max_operand or arithmetic.MAX_OPERAND)
            sets[name] = arithmetic_prompts(problems, tokenizer,
                                            args.max_prompt_length, f"--eval-dataset {name}", args.tools)
        else:
            try:
                rows = load_eval_dataset(path, format=args.data_format, prompt_key=args.prompt_key,
                                         preprocessor=args.preprocessor, id_key=args.prompt_id_key)
                if args.eval_max_samples:
                    rows = rows[:args.eval_max_samples]
                rows = with_environment(args, rows)
                sets[name] = make_prompts(rows, tokenizer, system_prompt, args.max_prompt_length, args.truncation,
                                          args.tools)
            except DatasetError as error:  # which set, as well as which file and line
                raise DatasetError(f"--eval-dataset {name}: {error}") from None
    return sets
