"""The algorithm presets run on the tiny model (real torchrun, 2 ranks) and their reward rises.

Measured over 60 steps (reward mean of the first 5 -> last 5 steps): grpo 0.45 -> 0.62,
dapo 0.47 -> 0.61 (DAPO's kept groups are the mixed ones, so its batch reward starts
near 0.5), drgrpo 0.45 -> 0.60, ppo (GAE with a Megatron critic, KL in the reward with
the adaptive controller, 2 epochs of 2 shuffled mini-batches) 0.41 -> 0.71. The threshold,
+0.05, leaves room for the noise of 5-step means while still failing on a run that does
not learn.
"""

import pytest

from helpers import torchrun

pytestmark = [pytest.mark.slow,  # real torchrun ranks with vLLM and Megatron-core
              pytest.mark.learning]  # 60 steps each: outside CI (bash run_tests.sh -m learning)

PRESETS = ["grpo", "dapo", "drgrpo", "ppo"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_reward_rises(preset, tiny_model, tmp_path):
    result = torchrun("../../megarl/train.py", "--config", f"examples/{preset}.yaml", "--model", tiny_model,
                      "--train-steps", "60", "--log-dir", tmp_path / "tb", timeout=900)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 60
    line = [text for text in result.stdout.splitlines() if text.startswith("reward: ")][-1]
    first, last = (float(x) for x in line.removeprefix("reward: ").split(" -> "))
    assert last >= first + 0.05, line
