"""--async-generation (separate placement): the rollout ranks generate step k+1 while the train ranks
train on step k, one weight version behind, and the run still learns."""

import pytest

from helpers import scalars, torchrun

SEPARATE = ["--config", "examples/quickstart_grpo_separate.yaml"]
SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "16",
         "--lr", "1e-3", "--rollout-kv-cache-gb", "1"]


@pytest.mark.parametrize("flags,words", [
    (["--config", "examples/quickstart_grpo.yaml"], ["--async-generation needs the separate placement"]),
    (SEPARATE + ["--dynamic-sampling", "0", "1"], ["--async-generation does not support --dynamic-sampling"]),
])
def test_unsupported_combinations_are_refused_in_one_line(flags, words, tiny_model):
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        parse_args([*flags, "--model", tiny_model, "--async-generation"], world_size=2)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.slow
def test_staleness_is_one_step_at_most(tiny_model, tmp_path):
    """The weight version of every step's samples (stamped by the engine that sampled them) is at most
    one behind the trainer's: 0 for the first step, exactly 1 after; a synchronous run is always at 0.
    The rollout/trainer mismatch shows the one-step gap, and every step's samples were gathered
    (not generated) in the generate phase."""
    series = {}
    for mode, extra in (("async", ["--async-generation"]), ("sync", [])):
        torchrun("../../megarl/train.py", *SEPARATE, "--model", tiny_model, *SMALL, "--train-steps", "4", *extra,
                 "--log-dir", tmp_path / mode, timeout=900)
        series[mode] = scalars(tmp_path / mode, ["staleness", "mismatch", "generate_ahead_seconds"])
    assert series["async"]["staleness"] == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}, series
    assert set(series["sync"]["staleness"].values()) == {0.0}, series
    assert "generate_ahead_seconds" not in series["sync"] and len(series["async"]["generate_ahead_seconds"]) == 4
    assert series["async"]["mismatch"][0] < 1e-5  # the first step samples with the trainer's own weights
    assert min(series["async"]["mismatch"][step] for step in (1, 2, 3)) > 1e-4  # the others one version behind


@pytest.mark.slow
def test_async_generation_learns(tiny_model, tmp_path):
    """The separate quickstart with --async-generation and token-level TIS, shortened like
    test_train_e2e.py's quickstart test: the reward must rise by 0.10."""
    result = torchrun("../../megarl/train.py", *SEPARATE, "--model", tiny_model, "--async-generation",
                      "--tis-level", "token", "--train-steps", "80", "--log-dir", tmp_path / "tb", timeout=900)
    line = [text for text in result.stdout.splitlines() if text.startswith("reward: ")][-1]
    first, last = (float(x) for x in line.removeprefix("reward: ").split(" -> "))
    assert last >= first + 0.10, line
