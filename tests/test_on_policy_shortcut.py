"""The on-policy shortcut (issue 13, item 2): an exactly on-policy update takes the old logprobs from
its own training forward instead of a separate pass. The decision function over its conditions, and
training runs with and without the shortcut step by step."""

from __future__ import annotations

import pytest

from helpers import assert_runs_agree, scalars, torchrun
from megarl.arguments import parse_args
from megarl.batch import on_policy_update, two_pass_reason


def _args(*flags: str):
    # 16 prompts x 8 samples = 128 samples; one mini-batch by default.
    return parse_args(["--prompts-per-step", "16", "--num-generations", "8", "--micro-batch-size", "8", *flags],
                      world_size=2)


@pytest.mark.parametrize("flags,step,reason", [
    ([], 0, None),
    (["--tis-level", "sequence"], 0, None),  # truncate mode: the weights come from the training forward
    (["--tis-level", "token", "--tis-mode", "mask"], 0, "--tis-mode mask"),
    (["--tis-mode", "mask"], 0, None),  # mask mode without TIS does nothing
    (["--no-on-policy-shortcut"], 0, "--no-on-policy-shortcut"),
    (["--ppo-epochs", "2"], 0, "--ppo-epochs 2"),
    (["--global-batch-size", "64"], 0, "2 mini-batches per generated batch"),
    (["--steps-per-generation", "4"], 0, "4 mini-batches per generated batch"),
    (["--kl-coef", "0.1"], 0, "a reference model (--kl-coef > 0)"),
    (["--kl-coef", "0.1", "--kl-placement", "reward"], 0, "a reference model (--kl-coef > 0)"),
    (["--teacher-model", "artifacts/tiny-qwen2"], 0, "a distillation teacher"),
    (["--teacher-model", "artifacts/tiny-qwen2", "--distill-reward-coef", "0.5"], 0,
     "a distillation teacher"),
    (["--advantage-estimator", "gae"], 0, None),  # the critic reads its own values only
    (["--advantage-estimator", "gae", "--critic-warmup", "2"], 1, "critic warm-up (--critic-warmup 2)"),
    (["--advantage-estimator", "gae", "--critic-warmup", "2"], 2, None),
    (["--dynamic-sampling", "0", "1"], 0, None),  # filters on rewards
    (["--filter-truncated", "--overlong-buffer-len", "4"], 0, None),
    (["--padding-free", "--tis-level", "token"], 0, None),  # per token: the row layout does not matter
    (["--padding-free", "--tis-level", "sequence"], 0, "--padding-free with --tis-level sequence"),
])
def test_two_pass_reason(flags, step, reason):
    args = _args(*flags)
    assert two_pass_reason(args, step) == reason
    assert on_policy_update(args, step) == (reason is None)


def test_the_first_reason_is_given():
    args = _args("--ppo-epochs", "2", "--kl-coef", "0.1", "--no-on-policy-shortcut")
    assert two_pass_reason(args, 0) == "--no-on-policy-shortcut"


COMPARED = ["loss", "grad_norm", "entropy", "clip_fraction", "kl_old_new", "mismatch", "mismatch_max",
            "mismatch_kl", "ratio_dev_max", "tis_clipped_fraction", "tis_masked_fraction"]


# (name, flags, the steps that take the shortcut, metrics compared beyond COMPARED). --tis-threshold 1
# clips the tokens (or sequences) whose trainer logprob exceeds the rollout's by any amount, so the
# weights are not all 1 and the clipped fraction is not 0. GAE: the critic's values still come from
# prepare, and the first step (critic warm-up) keeps the two-pass path.
RUNS = [
    ("token", ["--tis-level", "token", "--tis-threshold", "1.0"], [0, 1, 2], []),
    ("sequence", ["--tis-level", "sequence", "--tis-threshold", "1.0"], [0, 1, 2], []),
    ("gae-warmup", ["--tis-level", "token", "--tis-threshold", "1.0", "--advantage-estimator", "gae",
                    "--critic-warmup", "1"], [1, 2], ["value_loss"]),
]
VARIANTS = {"sequence"}  # -m variants; CI runs the token-level weights and the GAE warm-up


@pytest.mark.slow
@pytest.mark.parametrize("name,flags,shortcut_steps,tags",
                         [pytest.param(*run, id=run[0], marks=[pytest.mark.variants] if run[0] in VARIANTS else [])
                          for run in RUNS])
def test_shortcut_matches_the_two_pass_path(name, flags, shortcut_steps, tags, tiny_model, tmp_path):
    """Three GRPO (or PPO) steps with the shortcut and with --no-on-policy-shortcut, same seed: every
    loss, gradient, mismatch and TIS metric equal within tests/helpers.py's rule for two training runs
    (2 micro-batches per rank: the sums and maxima add up over them). The shortcut's prepare ran no
    forward pass: on_policy_shortcut is 1 exactly at the steps whose prepare skipped it."""
    series, output, tags = {}, {}, [*COMPARED, *tags]
    for path, extra in (("shortcut", []), ("two_pass", ["--no-on-policy-shortcut"])):
        result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                          "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12",
                          "--micro-batch-size", "4", "--lr", "1e-3", "--train-steps", "3", *flags, *extra,
                          "--log-dir", tmp_path / path, timeout=900)
        series[path] = scalars(tmp_path / path, [*tags, "on_policy_shortcut"])
        output[path] = result.stdout
    assert "old logprobs: from the update's own forward" in output["shortcut"]
    assert "old logprobs: a separate forward pass before each update (--no-on-policy-shortcut)" in output["two_pass"]
    shortcut, two_pass = series["shortcut"], series["two_pass"]
    assert shortcut["on_policy_shortcut"] == {step: float(step in shortcut_steps) for step in range(3)}
    assert two_pass["on_policy_shortcut"] == {0: 0.0, 1: 0.0, 2: 0.0}
    for tag in tags:
        steps = sorted(two_pass[tag])
        assert sorted(shortcut[tag]) == steps and set(shortcut_steps) <= set(steps), (tag, series)
        assert_runs_agree(shortcut[tag], two_pass[tag], tag)
    assert max(shortcut["tis_clipped_fraction"].values()) > 0, series  # the weights were exercised
    assert max(shortcut["mismatch"].values()) > 0, series
