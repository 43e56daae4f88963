"""--rollout-sleep-level 2 on a real CPU engine (tests/workers/sleep_level_worker.py): the engine's weights
discarded while it sleeps (poisoned with NaN, its derived state rebuilt from the poison), then the next
weight sync rebuilds it, and it samples exactly what a level-1 engine samples; without the rebuild it does
not. One launch per model family: dense, MoE (vLLM's packed CPU experts), Qwen3.5 (Gated DeltaNet)."""

import pytest

from helpers import WORKERS, load_script, read_json, torchrun

pytestmark = pytest.mark.slow  # a real torchrun rank with vLLM and Megatron-core

COMMON = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "8", "--temperature", "1.0",
          "--micro-batch-size", "4", "--global-batch-size", "4",
          "--rollout-kv-cache-gb", "1", "--log-dir", ""]
# The tiny model, and random models of the other two families with its tokenizer (built in seconds, so every
# checkout runs all three: what is compared is level 2 against level 1 on the same weights, not what they learned).
MODELS = {"dense": "tiny_model", "moe": "random_moe_policy", "qwen3_5": "random_qwen3_5_policy"}
EXTRA = {"qwen3_5": ["--params-dtype", "float32"]}


@pytest.mark.parametrize("family", list(MODELS))
def test_level_two_rebuilds_from_the_sync(family, request, tmp_path):
    model = request.getfixturevalue(MODELS[family])
    out = tmp_path / "sleep"
    torchrun("sleep_level_worker.py", out, "--model", model, *COMMON, *EXTRA.get(family, []), nproc=1, timeout=900)
    report = read_json(f"{out}.json")
    assert load_script(WORKERS / "sleep_level_worker.py").problems(report, on_cuda=False, moe=family == "moe") == []
