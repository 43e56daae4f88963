"""GKD with a teacher colocated on the train ranks, end to end on 2 real torchrun ranks, and its
one-line configuration errors."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, scalars, torchrun

from megarl.arguments import ConfigError, parse_args

SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "8",
         "--rollout-kv-cache-gb", "1", "--train-steps", "3"]


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory) -> str:
    """Another tiny model with the built-in tokenizer: same vocabulary, different weights."""
    out = tmp_path_factory.mktemp("teacher") / "tiny-teacher"
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(out), "--seed", "1", "--steps", "150",
                    "--quiet"], cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   timeout=600)
    return str(out)


LAYOUTS = {
    # name: (config, extra flags, distillation loss tags expected)
    "rollout-colocate-topk-renorm": ("examples/gkd/rollout_colocate_teacher_colocate.yaml", [], True),
    "rollout-separate-topk-tail-rl": ("examples/gkd/rollout_separate_teacher_colocate.yaml", [], True),
    "colocate-full-vocabulary-tp2": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                                     ["--gkd-logits-topk", "0", "--gkd-beta", "1", "--tensor-model-parallel-size", "2"],
                                     False),
    # The policy-gradient form alone: the teacher's per-token reverse KL as a negative reward.
    "policy-gradient-form": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                             ["--gkd-logits-topk", "0", "--distill-coef", "0", "--policy-loss-coef", "1",
                              "--distill-reward-coef", "1", "--reward", "arithmetic"], False),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_few_distillation_steps(layout, tiny_model, teacher_model, tmp_path):
    config, extra, topk = LAYOUTS[layout]
    result = torchrun("../../megarl/train.py", "--config", config, "--model", tiny_model, "--teacher-model",
                      teacher_model, *SMALL, *extra, "--log-dir", tmp_path / "tb", timeout=900)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, result.stdout[-3000:]
    series = {tag: list(values.values()) for tag, values in scalars(
        tmp_path / "tb", ["distill_loss", "teacher_topk_mass", "teacher_seconds", "teacher_kl"]).items()}
    # Two different models: the divergences are positive from the first step on.
    assert len(series["teacher_kl"]) == 3 and min(series["teacher_kl"]) > 0, series
    if "--distill-coef" in extra:  # the policy-gradient form only: no distillation loss term
        assert "distill_loss" not in series, series
        return
    assert len(series["distill_loss"]) == 3 and min(series["distill_loss"]) > 0, series
    if topk:
        assert all(0.0 < mass <= 1.0 for mass in series["teacher_topk_mass"]), series
        assert len(series["teacher_seconds"]) == 3, series
    else:
        assert "teacher_topk_mass" not in series


BAD = [
    (["--gkd-logits-topk", "8"], ["--gkd-logits-topk needs a teacher", "--teacher-model"]),
    (["--policy-loss-coef", "0"], ["--policy-loss-coef 0 needs a teacher"]),
    (["--distill-reward-coef", "1"], ["--distill-reward-coef needs a teacher"]),
    (["--teacher-model", "{model}", "--teacher-gpus", "1"], ["teacher.gpus=1", "not implemented yet"]),
    (["--teacher-model", "{model}", "--gkd-beta", "1.5"], ["--gkd-beta must be in [0, 1]"]),
    (["--teacher-model", "{random}"], ["vocab_size=250", "vocab_size", "one vocabulary"]),
    (["--teacher-model", "{model}", "--tensor-model-parallel-size", "2"],
     ["full-vocabulary GKD with --gkd-beta 0.5", "tensor_model_parallel_size=2", "--gkd-logits-topk"]),
]


@pytest.mark.parametrize("flags,words", BAD)
def test_distillation_configuration_errors_are_one_line(flags, words, tiny_model, random_qwen2_tied):
    argv = ["--model", tiny_model] + [f.format(model=tiny_model, random=random_qwen2_tied) for f in flags]
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=2)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def _arithmetic_rows(path, teacher_prompts: bool) -> str:
    """The built-in task in ms-swift's layout; with teacher_prompts, every other row carries a
    privileged teacher prompt that states the answer (OPSD), the others fall back to plain GKD."""
    import json

    from megarl.tasks import arithmetic

    rows = []
    for i, problem in enumerate(arithmetic.make_problems(16, seed=3)):
        row = {"id": f"p{i}", "messages": [{"role": "user", "content": problem["prompt"]}],
               "solution": problem["answer"]}
        if teacher_prompts and i % 2 == 0:
            row["teacher_prompt"] = f"The answer is {problem['answer']}. {problem['prompt']}"
        rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
def test_opsd_rows_are_scored_after_the_teacher_prompt(tiny_model, teacher_model, tmp_path):
    """Same student samples (same seeds, prompts and weights) with and without teacher prompts: the
    teacher's view of them changes only through its privileged prompt."""
    kl = {}
    for opsd in (False, True):
        log_dir = tmp_path / f"tb_{opsd}"
        torchrun("../../megarl/train.py", "--config", "examples/gkd/rollout_colocate_teacher_colocate.yaml",
                 "--model", tiny_model, "--teacher-model", teacher_model, *SMALL, "--train-steps", "2",
                 "--train-data", _arithmetic_rows(tmp_path / f"rows_{opsd}.jsonl", opsd), "--reward", "boxed",
                 "--system-prompt", "", "--log-dir", log_dir, timeout=900)
        series = scalars(log_dir, ["teacher_kl", "reward_mean", "distill_loss"])
        assert len(series["distill_loss"]) == 2 and min(series["distill_loss"].values()) > 0, series
        kl[opsd] = series
    assert kl[True]["reward_mean"][0] == kl[False]["reward_mean"][0]  # the student sampled the same responses
    assert kl[True]["teacher_kl"][0] != kl[False]["teacher_kl"][0], kl
