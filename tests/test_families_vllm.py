"""The new model families in vLLM's CPU build: a Qwen3 (q/k norms, head_dim != hidden /
heads; also with YaRN, and with sliding-window attention), a Llama with Llama-3 RoPE scaling, a Qwen3-MoE,
the Qwen3.5 families (dense, MoE and the multimodal checkpoint layout), a DeepSeek-V3 (multi-latent attention, sigmoid-routed experts), a GLM-4.5
a Qwen2-MoE with dense layers among its MoE layers and a Nemotron-H (Mamba-2, attention, MLP and MoE mixers),
each loaded into a colocated rollout engine (TP=2, external launcher) from an HF checkpoint and then
through the weight sync from Megatron (TP=2), checked against transformers after each; then the first
checkpoint synced back, the engine's every tensor against the fresh load's.

Each family runs one torchrun launch; the Llama uses the "custom" Llama-3 values
(original context 64), so that the scaling shows within a 96-token prompt.
"""

import pytest

from conftest import DEEPSEEK_YARN, GQA_YARN
from helpers import FP32_ULPS, make_random_model, make_random_multimodal_qwen3_5, read_json, torchrun

pytestmark = pytest.mark.slow  # real torchrun ranks with vLLM and Megatron-core

CASES = {  # family: (tied, Llama-3 RoPE)
    "qwen3": (True, None),
    # YaRN on grouped-query attention (conftest.GQA_YARN: factor 4 over an original context of 64, truncate false)
    "qwen3_yarn": (False, None),
    # sliding-window attention over 16 tokens of the 96-token prompts in every layer (max_window_layers 0: vLLM 0.32
    # gives every layer the config's window, megarl/rollout.py: window_overrides); Megatron's windowed layers
    # produce the synced weights
    "qwen3_sliding": (False, None),
    "llama": (False, "custom"),
    "qwen3_moe": (False, None),  # vLLM's fused experts; Megatron at EP=2 (experts gathered for the sync)
    # Gated DeltaNet layers: vLLM's qwen3_5 model with megarl's fp32 CPU core (megarl/vllm_cpu.py)
    "qwen3_5": (True, None),
    "qwen3_5_moe": (False, None),
    # the released layout (...ForConditionalGeneration): vLLM serves its language model alone, the sync
    # streams model.language_model.* names, the vision tower and MTP tensors stay out
    "qwen3_5_multimodal": (True, None),
    # vLLM's MLA (its CPU decode kernel takes the released widths alone: a latent of 512 plus a rope key of 64)
    # and experts under a sigmoid router with an expert bias; Megatron at EP=2. Two MTP layers' tensors in the
    # checkpoint, which the sync does not send.
    "deepseek_v3": (False, None),
    # the released model's RoPE: YaRN (at a tiny scale: conftest.DEEPSEEK_YARN; vLLM's DeepseekScalingRotaryEmbedding)
    "deepseek_v3_yarn": (False, None),
    # GLM-4.5: the same router and MLP layers under grouped-query attention with q/k/v biases, q/k norms and half
    # of each head rotated; its MTP layer's tensors stay out of the sync
    "glm4_moe": (False, None),
    # a mixed stack: Qwen2-MoE (gated shared expert, plain top-k) whose every other layer is dense
    # (decoder_sparse_step 2), so the sync streams dense and expert layers in turn
    "qwen2_moe_mixed": (True, None),
    # gpt-oss: biases, sinks, the clamped SwiGLU, YaRN; experts fused in the checkpoint and in the sync's stream
    "gpt_oss": (False, None),
    # Nemotron-H: vLLM's Mamba-2 (its CPU scan), attention without RoPE, a squared-ReLU MLP, and non-gated
    # squared-ReLU experts under the sigmoid router (megarl/vllm_cpu.py serves them on CPU); names under backbone.
    "nemotron_h": (False, None),
}
MOE = ("qwen3_moe", "qwen3_5_moe", "deepseek_v3", "deepseek_v3_yarn", "glm4_moe", "qwen2_moe_mixed", "gpt_oss",
       "nemotron_h")


@pytest.mark.parametrize("family", list(CASES))
def test_family_in_vllm_fresh_and_synced(family, tmp_path):
    tied, rope = CASES[family]
    # MoE: experts of width 64, which vLLM's CPU kernel packs without padding (the packed experts keep the
    # loaded shape: the case a shape check would miss)
    fields = dict(moe_intermediate_size=64) if family in MOE else {}
    if family.startswith("deepseek_v3"):
        fields.update(kv_lora_rank=512, qk_rope_head_dim=64)
    # YaRN: weights at std 0.2, so that attention depends on positions enough for the scaling to show
    if family == "gpt_oss":  # expert width from intermediate_size (no moe_intermediate_size); a window of 16 of the
        fields = dict(sliding_window=16)  # 96-token prompts on its even layers, as vLLM's gpt_oss model places them
    if family == "qwen3_yarn":
        family, fields = "qwen3", dict(fields, rope_extra=GQA_YARN, std=0.2)
    if family == "qwen3_sliding":  # std 0.2: attention depends on position enough for the window to show
        family, fields = "qwen3", dict(fields, use_sliding_window=True, sliding_window=16, max_window_layers=0,
                                       std=0.2)
    if family == "deepseek_v3_yarn":
        family, fields = "deepseek_v3", dict(fields, rope_extra=DEEPSEEK_YARN, std=0.2)
    if family == "qwen2_moe_mixed":
        # hidden 128: heads of 32 (vLLM's CPU attention has no kernel for Qwen2-MoE's hidden / heads = 16)
        family, fields = "qwen2_moe", dict(fields, num_hidden_layers=4, decoder_sparse_step=2, hidden_size=128)
    if family == "qwen3_5_multimodal":
        fresh, synced = (make_random_multimodal_qwen3_5(tmp_path / name, tied, seed)
                         for name, seed in (("fresh", 11), ("synced", 12)))
    else:
        fresh, synced = (make_random_model(tmp_path / name, family, tied, seed, llama3_rope=rope, **fields)
                         for name, seed in (("fresh", 11), ("synced", 12)))
    out = tmp_path / "report.json"
    parallel = ["--tp", "1", "--ep", "2"] if family in MOE else []
    torchrun("families_vllm_worker.py", "--fresh", fresh, "--synced", synced, "--out", out, *parallel, timeout=900)
    report = read_json(out)
    print(f"{family}: engine KV cache per token: {report['kv_cache']}; prompt logprob ulps fresh / synced: "
          f"{report['fresh']['prompt_logprob_ulps']:.0f} / {report['synced']['prompt_logprob_ulps']:.0f}"
          + (f"; sliding window's effect {report['fresh']['sliding_window_effect_ulps']:.0f} ulps"
             if "sliding_window_effect_ulps" in report["fresh"] else ""))
    for stage in ("fresh", "synced"):
        result = report[stage]
        # vLLM (fp32) against transformers in float64, within the fp32 rule (tests/helpers.py). DeepSeek-V3 with
        # plain RoPE was 608-1080 ulps off before megarl/vllm_cpu.py's fix of vLLM's CPU RoPE on MLA's 3-D inputs.
        assert result["prompt_logprob_ulps"] <= FP32_ULPS, (stage, result)
        assert result["greedy_gap_ulps"] <= FP32_ULPS, (stage, result)  # vLLM's greedy token is transformers' argmax
        if rope is not None or "rope_extra" in fields:  # the scaling moves transformers' own log-probs past the rule
            assert result["rope_scaling_effect_ulps"] > 2 * FP32_ULPS, (stage, result)
        if fields.get("use_sliding_window"):  # so does the window: an engine that ignored it would fail
            assert result["sliding_window_effect_ulps"] > 2 * FP32_ULPS, (stage, result)
    assert report["synced"]["sync_bytes"] > 0
    if fields.get("use_sliding_window"):  # vLLM's KV cache for windowed layers
        assert report["kv_cache"]["spec"] == "SlidingWindowSpec", report["kv_cache"]
    # The sync really changed the engine's weights: other greedy continuations.
    assert report["fresh"]["greedy_tokens"] != report["synced"]["greedy_tokens"]
    # Synced back to the first checkpoint, the engine is the fresh one again, bit for bit, on both TP ranks:
    # what post-load processing derives (the CPU experts' packed w13 / w2, MLA's W_UK_T / W_UV) follows a
    # change of weights, however the stream orders the tensors.
    for rank in report["back"]:
        assert rank["mismatched"] == [] and rank["max_diff"] == 0.0, (rank["worst"], rank["max_diff"],
                                                                      rank["mismatched"])
    if family in ("glm4_moe", "qwen2_moe"):  # the 3 MoE layers of 4, and the mixed stack's 2 of 4: packed experts
        compared = report["back"][0]["compared"]
        assert sum(name.endswith("experts.w13_weight") for name in compared) == (3 if family == "glm4_moe" else 2)
    if family == "deepseek_v3":
        compared = report["back"][0]["compared"]
        derived = {suffix: sum(name.endswith(suffix) for name in compared)
                   for suffix in (".W_UK_T", ".W_UV", "experts.w13_weight", "experts.w2_weight")}
        # every layer's MLA, the 3 MoE layers' experts (the first is dense): among the tensors compared
        assert derived == {".W_UK_T": 4, ".W_UV": 4, "experts.w13_weight": 3, "experts.w2_weight": 3}, derived
        # MLA caches one latent per token and layer: kv_lora_rank + qk_rope_head_dim = 576 fp32 values,
        # not keys and values of its 4 heads
        kv = report["kv_cache"]
        assert (kv["spec"], kv["kv_heads"], kv["head_size"], kv["per_layer"]) == ("MLAAttentionSpec", 1, 576, 576 * 4)
