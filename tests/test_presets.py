"""The algorithm presets run on the tiny model (real torchrun, 2 ranks) and their reward rises.

The statistic is the rise of a least-squares line through every step's reward (helpers.reward_rise); each
preset's bar keeps a margin of twice its spread over seeds 1234, 1 and 2 (tools/learning_bars.py preset-NAME;
docs/testing.md, "Learning bars"): grpo +0.154/+0.178/+0.160, drgrpo +0.120/+0.149/+0.141, ppo (GAE with a
Megatron critic, KL in the reward with the adaptive controller, 2 epochs of 2 shuffled mini-batches)
+0.278/+0.313/+0.362. dapo is judged on every generated sample's reward (dapo_reward_all_mean: its batch
keeps the mixed groups only, so its reward_mean is not the policy's accuracy; on reward_mean it read
+0.068/+0.113/+0.127, too spread for a bar): +0.145/+0.121/+0.143.
"""

import pytest

from helpers import reward_rise, torchrun

pytestmark = [pytest.mark.slow,  # real torchrun ranks with vLLM and Megatron-core
              pytest.mark.learning]  # 60 steps each: outside CI (bash run_tests.sh -m learning)

BARS = {"grpo": 0.10, "dapo": 0.08, "drgrpo": 0.07, "ppo": 0.14}
PRESETS = list(BARS)
TAGS = {"dapo": "dapo_reward_all_mean"}  # the reward the statistic reads (default reward_mean)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_reward_rises(preset, tiny_model, tmp_path):
    result = torchrun("../../megarl/train.py", "--config", f"examples/{preset}.yaml", "--model", tiny_model,
                      "--train-steps", "60", "--log-dir", tmp_path / "tb", timeout=900)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 60
    line = [text for text in result.stdout.splitlines() if text.startswith("reward: ")][-1]
    rise = reward_rise(tmp_path / "tb", TAGS.get(preset, "reward_mean"))
    assert rise >= BARS[preset], (rise, line)
