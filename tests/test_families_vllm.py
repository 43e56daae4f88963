"""The new model families in vLLM's CPU build: a Qwen3 (q/k norms, head_dim != hidden /
heads), a Llama with Llama-3 RoPE scaling, a Qwen3-MoE and the Qwen3.5 families (dense, MoE and
the multimodal checkpoint layout), each loaded into a colocated rollout
engine (TP=2, external launcher) from an HF checkpoint and then through the weight
sync from Megatron (TP=2), checked against transformers after each.

Each family runs one torchrun launch; the Llama uses the "custom" Llama-3 values
(original context 64), so that the scaling shows within a 96-token prompt.
"""

import pytest

from helpers import FP32_ULPS, make_random_model, make_random_multimodal_qwen3_5, read_json, torchrun

pytestmark = pytest.mark.slow  # real torchrun ranks with vLLM and Megatron-core

CASES = {  # family: (tied, Llama-3 RoPE)
    "qwen3": (True, None),
    "llama": (False, "custom"),
    "qwen3_moe": (False, None),  # vLLM's fused experts; Megatron at EP=2 (experts gathered for the sync)
    # Gated DeltaNet layers: vLLM's qwen3_5 model with megarl's fp32 CPU core (megarl/vllm_cpu.py)
    "qwen3_5": (True, None),
    "qwen3_5_moe": (False, None),
    # the released layout (...ForConditionalGeneration): vLLM serves its language model alone, the sync
    # streams model.language_model.* names, the vision tower and MTP tensors stay out
    "qwen3_5_multimodal": (True, None),
}


@pytest.mark.parametrize("family", list(CASES))
def test_family_in_vllm_fresh_and_synced(family, tmp_path):
    tied, rope = CASES[family]
    # MoE: experts of width 64, which vLLM's CPU kernel packs without padding (the packed experts keep the
    # loaded shape: the case a shape check would miss)
    fields = dict(moe_intermediate_size=64) if family.endswith("_moe") else {}
    if family == "qwen3_5_multimodal":
        fresh, synced = (make_random_multimodal_qwen3_5(tmp_path / name, tied, seed)
                         for name, seed in (("fresh", 11), ("synced", 12)))
    else:
        fresh, synced = (make_random_model(tmp_path / name, family, tied, seed, llama3_rope=rope, **fields)
                         for name, seed in (("fresh", 11), ("synced", 12)))
    out = tmp_path / "report.json"
    parallel = ["--tp", "1", "--ep", "2"] if family.endswith("_moe") else []
    torchrun("families_vllm_worker.py", "--fresh", fresh, "--synced", synced, "--out", out, *parallel, timeout=900)
    report = read_json(out)
    for stage in ("fresh", "synced"):
        result = report[stage]
        # vLLM (fp32) against transformers in float64, within the fp32 rule (tests/helpers.py).
        assert result["prompt_logprob_ulps"] <= FP32_ULPS, (stage, result)
        assert result["greedy_gap_ulps"] <= FP32_ULPS, (stage, result)  # vLLM's greedy token is transformers' argmax
        if rope is not None:
            assert result["rope_scaling_effect"] > 1e-2, (stage, result)
    assert report["synced"]["sync_bytes"] > 0
    # The sync really changed the engine's weights: other greedy continuations.
    assert report["fresh"]["greedy_tokens"] != report["synced"]["greedy_tokens"]
