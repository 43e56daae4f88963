"""Evaluation: each eval set sampled by the rollout engines (and, before the first step, by the
distillation teacher), scored like training samples; pass@1, mean@k and pass@k.

`train.py` evaluates before the first step, every --eval-interval steps and after the last
(`should_evaluate`). Not a phase of the step: it reads no batch and changes no weights.
"""

from __future__ import annotations

import torch

from megarl import generation
from megarl.data.dumps import write_samples
from megarl.run import Run


def should_evaluate(run: Run, completed_steps: int) -> bool:
    """Before the first step (0), every --eval-interval steps and after the last, with eval sets."""
    args = run.args
    if not run.eval_sets:
        return False
    return completed_steps in (0, args.train_steps) or bool(
        args.eval_interval and completed_steps % args.eval_interval == 0)


def evaluate(run: Run, completed_steps: int) -> dict:
    """Each eval set at --eval-temperature with --eval-samples k per prompt:
    pass@1 = fraction of samples scoring >= 1 (the unbiased pass@1 estimate from k samples),
    mean@k = mean score, and with k > 1 pass@k = fraction of prompts with a sample scoring >= 1.
    Before the first step, with a distillation teacher, the same for the teacher (teacher_pass@1, ...):
    the mark the student is distilled towards."""
    run.activity.phase = "evaluate"
    metrics = _evaluate(run, completed_steps, policy="student")
    if completed_steps == 0 and _teacher_can_generate(run):
        metrics.update(_evaluate(run, completed_steps, policy="teacher"))
    return metrics


def _evaluate(run: Run, completed_steps: int, policy: str) -> dict:
    args = run.args
    k = 1 if args.eval_temperature == 0 else args.eval_samples
    prefix = "" if policy == "student" else "teacher_"
    metrics = {}
    with generation.serving(run, policy), run.rollout_turn():  # one turn for all the eval sets
        for name, prompts in run.eval_sets.items():
            options = dict(n=k, temperature=args.eval_temperature, seed_key=("eval", name))
            if policy == "teacher" and run.teacher_engine_placed:
                samples, _ = generation.teacher_rollout(run, prompts, completed_steps, **options)
            else:
                samples, _ = generation.rollout(run, prompts, completed_steps, policy=policy, **options)
            scores = torch.tensor([s.reward for s in samples]).view(len(prompts), k)
            correct = scores >= 1.0
            metrics[f"eval/{name}/{prefix}pass@1"] = correct.float().mean().item()
            metrics[f"eval/{name}/{prefix}mean@{k}"] = scores.mean().item()
            if k > 1:
                metrics[f"eval/{name}/{prefix}pass@{k}"] = correct.any(dim=1).float().mean().item()
            metrics.update({f"eval/{name}/{prefix}{key}": value for key, value in
                            generation.reward_errors(samples, f"eval {name} ({policy})", run.is_main).items()})
            if args.rollout_save_dir and run.is_main:
                write_samples(args.rollout_save_dir, f"eval_{name}_{prefix}step{completed_steps}.jsonl", samples,
                              run.tokenizer, completed_steps)
    return metrics


def _teacher_can_generate(run: Run) -> bool:
    """Whether the teacher's pass@1 can be measured: its standalone vLLM engines generate; a colocated
    teacher's weights are served by the rollout engines for the evaluation, which needs the student's
    architecture (same shapes). Otherwise rank 0 says why it is skipped."""
    args = run.args
    if run.teacher_engine_placed:
        return True
    if not args.teacher_model:
        return False
    from megarl.models.families import load_hf_config, shape_difference

    differ = shape_difference(load_hf_config(args.teacher_model), run.hf_config)
    if differ and run.is_main:
        print(f"megarl: the teacher's pass@1 is not measured: its {differ} differs from the student's, so the "
              f"rollout engines cannot serve it (standalone teacher ranks can)", flush=True)
    return differ is None
