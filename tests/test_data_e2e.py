"""Training from dataset files with a math reward, evaluation, dumps, and a reward that raises
(real torchrun, 2 ranks, the tiny model)."""

import json

import pytest
from helpers import assert_fp32_close, scalars, torchrun

from megarl.data.tasks import arithmetic

pytestmark = pytest.mark.slow  # real torchrun ranks with vLLM and Megatron-core

SMALL = ["--config", "examples/quickstart_grpo.yaml", "--prompts-per-step", "4", "--num-generations", "4",
         "--max-new-tokens", "12", "--micro-batch-size", "8", "--rollout-kv-cache-gb", "1"]


def _dataset(path, seed, count):
    """The built-in task as a ColossalChat-layout file; no system prompt, as the tiny model was trained."""
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": p["prompt"]}], "gt_answer": p["answer"]}
            for i, p in enumerate(arithmetic.make_problems(count, seed=seed))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_train_on_files_with_evaluation_and_dumps(tiny_model, tmp_path):
    train = _dataset(tmp_path / "train.jsonl", seed=1, count=40)
    held_out = _dataset(tmp_path / "test.jsonl", seed=2, count=12)
    result = torchrun("../../megarl/train.py", *SMALL, "--model", tiny_model, "--train-data", train,
                      "--reward", "boxed", "--system-prompt", "", "--train-steps", "3",
                      "--eval-dataset", f"sums={held_out}", "--eval-interval", "2",
                      "--rollout-save-dir", tmp_path / "dumps", "--log-dir", tmp_path / "tb", timeout=900)
    evals = [line for line in result.stdout.splitlines() if line.startswith("eval after")]
    assert [line.split(" steps")[0] for line in evals] == ["eval after 0", "eval after 2", "eval after 3"], evals
    pass_at_1 = [float(line.split("sums/pass@1 ")[1].split()[0]) for line in evals]
    assert all(0.0 < value < 1.0 for value in pass_at_1), evals  # the tiny model solves some, not all
    dumps = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert dumps == ["eval_sums_step0.jsonl", "eval_sums_step2.jsonl", "eval_sums_step3.jsonl",
                     "train_step1.jsonl", "train_step2.jsonl", "train_step3.jsonl"], dumps
    records = [json.loads(line) for line in (tmp_path / "dumps" / "train_step1.jsonl").read_text().splitlines()]
    assert len(records) == 16
    assert {"step", "prompt", "response", "reward", "reason", "id", "gt_answer"} <= set(records[0])
    assert all(r["reason"] in ("correct", "wrong answer", "no box", "unclosed box", "unparsable") for r in records)
    assert all(r["step"] == 1 and "What is" in r["prompt"] for r in records)
    # the token counts megarl trained: a truncated response is exactly --max-new-tokens long
    assert all(r["prompt_tokens"] > 0 and 0 < r["response_tokens"] <= 12 for r in records), records
    assert all(r["response_tokens"] == 12 for r in records if r["truncated"]), records
    evaluated = [json.loads(line) for line in (tmp_path / "dumps" / "eval_sums_step0.jsonl").read_text().splitlines()]
    assert [r["id"] for r in evaluated] == [f"p{i}" for i in range(12)]  # greedy: one per prompt, file order
    # The dumped evaluation is the one whose pass@1 was logged: TensorBoard holds the logged value
    # (a float32) and the console prints it to three decimals.
    dumped_mean = sum(r["reward"] for r in evaluated) / 12
    assert_fp32_close(scalars(tmp_path / "tb", ["eval/sums/pass@1"])["eval/sums/pass@1"][0], dumped_mean, scale=1.0)
    assert evals[0].split("sums/pass@1 ")[1].split()[0] == f"{dumped_mean:.3f}", evals[0]


FLAKY = '''
from megarl.rewards import register_reward
from megarl.rewards.arithmetic import arithmetic_reward


@register_reward("flaky_sum")
def flaky_sum(response, row):
    if int(row["answer"]) % 2:
        raise ZeroDivisionError("odd answers break this reward")
    return arithmetic_reward(response, row)
'''


def test_a_reward_that_raises_scores_zero_and_training_goes_on(tiny_model, tmp_path):
    """Also: k-sample evaluation (k = 2 at temperature 1) reports pass@1, mean@2 and pass@2."""
    plugin = tmp_path / "flaky.py"
    plugin.write_text(FLAKY)
    held_out = _dataset(tmp_path / "test.jsonl", seed=2, count=6)
    result = torchrun("../../megarl/train.py", *SMALL, "--model", tiny_model, "--external-plugins", plugin,
                      "--reward", "flaky_sum", "--train-steps", "2", "--log-dir", tmp_path / "tb",
                      "--eval-dataset", f"sums={held_out}", "--eval-samples", "2", "--eval-temperature", "1.0",
                      "--rollout-save-dir", tmp_path / "dumps", timeout=900)
    warnings = [line for line in result.stdout.splitlines() if line.startswith("megarl: warning: step")]
    assert warnings and "ZeroDivisionError: odd answers break this reward" in warnings[0], result.stdout[-2000:]
    assert "which score 0" in warnings[0]
    assert len([line for line in result.stdout.splitlines() if line.startswith("step ")]) == 2
    evals = [line for line in result.stdout.splitlines() if line.startswith("eval after")]
    assert len(evals) == 2 and all(f"sums/{key} " in evals[0] for key in ("pass@1", "mean@2", "pass@2")), evals
    dumped = (tmp_path / "dumps" / "eval_sums_step2.jsonl").read_text().splitlines()
    assert len(dumped) == 12  # 6 prompts x 2 samples
