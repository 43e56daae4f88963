"""HF <-> Megatron for every model family (Qwen2, Qwen3, Llama), on real torchrun ranks
(gloo); also the trainer's vocab-parallel logprobs, entropy and full KL against a
full-vocabulary softmax, and the critic's value head against HF hidden states.

Matrix (one torchrun launch per family and layout; a family's checkpoints share the
launch, because start-up dominates and the checks per checkpoint take a second):

  family  checkpoints (tests/conftest.py)                       (TP, PP) layouts
  qwen2   built-in tiny model, random untied, random tied        (1,1) (2,1) (1,2)
  qwen3   random untied, random tied (q/k norms, head_dim 32),   (1,1) (2,1) (1,2) (with qwen3_5's)
          YaRN, sliding window (layer 1 of 2 windowed to 5
          tokens at 150: padded and packed logits, the window's
          effect on transformers' own)
  llama   random untied (Llama-3 RoPE, our scaling path),        (1,1) (2,1)
          random tied (Llama-3 RoPE, Megatron's own path)
  qwen3_5 random untied, random tied (Gated DeltaNet and gated   (1,1) (2,1) (1,2)
          softmax layers in turn, partial RoPE, 1 + w norms),
          multimodal (...ForConditionalGeneration: vision tower
          and MTP head left out, text under model.language_model.)

Logits, logprobs, entropy, KL and values are compared where PP == 1; the bit-exact
HF round trip everywhere. PP=2 covers Qwen3, whose q/k norms are the only names the
new families add; Llama's names are Qwen2's without the biases. Llama runs 1024
tokens, so that Llama-3 scaling with an original context of 8192 visibly changes
the logits (it only touches low frequencies). Qwen3.5 runs 150 tokens, so the delta rule's chunks of
64 hand their state on twice (the Qwen3 checkpoints share its launches and length). Eight launches in all.

Mixture of experts (Qwen3-MoE: renormalised top-k; Qwen2-MoE: plain top-k and a gated shared expert;
Qwen3.5-MoE: Qwen3.5's hybrid layers with renormalised top-k and a gated shared expert),
both families' checkpoints in one launch per layout: TP=2 with EP=2 (attention split over TP, four whole
experts per rank: expert TP 1, tokens exchanged all-to-all between the same two ranks) and PP=2 (export
only, as above). Two launches.

The config checks (which family, which features are refused) run in-process.
"""

import re

import pytest
from helpers import fp32_limit, read_json, torchrun

FAMILY_CHECKPOINTS = {
    "qwen2": ["tiny_model", "random_qwen2_untied", "random_qwen2_tied"],
    "qwen3": ["random_qwen3_untied", "random_qwen3_tied", "random_qwen3_yarn", "random_qwen3_sliding"],
    "llama": ["random_llama_untied", "random_llama_tied"],
    "qwen3_5": ["random_qwen3_5_untied", "random_qwen3_5_tied", "multimodal_qwen3_5"],
}
# A launch may hold several families' checkpoints (one torchrun start-up for both): "a+b".
LAYOUTS = {"qwen2": [(1, 1), (2, 1), (1, 2)], "qwen3+qwen3_5": [(1, 1), (2, 1), (1, 2)], "llama": [(1, 1), (2, 1)]}
SEQ_LEN = {"qwen2": 17, "qwen3": 17, "llama": 1024, "qwen3_5": 150}
MATRIX = [(families, tp, pp) for families, layouts in LAYOUTS.items() for tp, pp in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("families,tp,pp", MATRIX, ids=[f"{f}-tp{tp}-pp{pp}" for f, tp, pp in MATRIX])
def test_logits_parity_and_round_trip(families, tp, pp, request, tmp_path):
    family_of_path = {request.getfixturevalue(name): family for family in families.split("+")
                      for name in FAMILY_CHECKPOINTS[family]}
    paths = list(family_of_path)
    out = tmp_path / "report.json"
    # Two ranks always: TP=1, PP=1 then runs as two data-parallel replicas.
    torchrun("parity_worker.py", "--hf", *paths, "--out", out, "--tp", tp, "--pp", pp,
             "--seq-len", max(SEQ_LEN[family] for family in families.split("+")), nproc=2)
    run = read_json(out)
    assert run["tp"] == tp and run["pp"] == pp
    assert [r["model"] for r in run["models"]] == paths
    for family in families.split("+"):
        assert {r["tied"] for r in run["models"] if "random" in r["model"] and
                family_of_path[r["model"]] == family} == {False, True}, family
    for report in run["models"]:
        assert report["family"] == family_of_path[report["model"]], report
        # the multimodal checkpoint's 21 vision-tower and 2 MTP tensors are neither read nor written
        assert report["left_out"] == (23 if "multimodal" in report["model"] else 0), report
        if pp == 1:
            _assert_parity(report)
        # Round trip: every HF tensor comes back bit-exact, none missing, none invented.
        assert report["exported"] > 0
        assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report


MOE_CHECKPOINTS = ["random_qwen3_moe_untied", "random_qwen3_moe_tied", "random_qwen2_moe_untied",
                   "random_qwen3_5_moe_untied", "random_qwen3_moe_mixed", "random_qwen2_moe_mixed",
                   "random_gpt_oss_untied"]
# routed-expert layers of each: every layer; the mixed stacks' 3 of 4 (mlp_only_layers [2]) and 2 of 4
# (decoder_sparse_step 2)
MOE_LAYERS = {"random_qwen3_5_moe_untied": 4, "random_qwen3_moe_mixed": 3, "random_qwen2_moe_mixed": 2}
MOE_LAYOUTS = [(2, 1, 2), (1, 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", MOE_LAYOUTS, ids=[f"tp{tp}-pp{pp}-ep{ep}" for tp, pp, ep in MOE_LAYOUTS])
def test_moe_logits_parity_and_round_trip(tp, pp, ep, request, tmp_path):
    """Every MoE family's logits (routing included: the top-k experts and their weights decide them) against
    transformers in float64, and the bit-exact HF round trip, with experts gathered from their EP ranks; mixed
    stacks (dense MLP layers among the MoE ones) too."""
    paths = [request.getfixturevalue(name) for name in MOE_CHECKPOINTS]
    out = tmp_path / "report.json"
    torchrun("parity_worker.py", "--hf", *paths, "--out", out, "--tp", tp, "--pp", pp, "--ep", ep, nproc=2)
    run = read_json(out)
    assert (run["tp"], run["pp"], run["ep"]) == (tp, pp, ep)
    assert [r["family"] for r in run["models"]] == ["qwen3_moe", "qwen3_moe", "qwen2_moe", "qwen3_5_moe",
                                                    "qwen3_moe", "qwen2_moe", "gpt_oss"]
    for name, report in zip(MOE_CHECKPOINTS, run["models"]):
        if pp == 1:
            _assert_parity(report)
        if report["family"] == "gpt_oss":  # sinks, clamp (and window, YaRN: _assert_parity) matter; experts fused
            if pp == 1:
                limit = fp32_limit(0.0) * report["logit_scale"] * 2.0**-23
                assert report["sinks_effect"] > 2 * limit and report["swiglu_clamp_effect"] > 2 * limit, report
            assert sorted(n.rsplit(".", 1)[-1] for n in report["exported_names"] if ".mlp.experts." in n) == sorted(
                ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"] * 2), report
            assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report
            continue
        # 8 experts x 3 tensors x the MoE layers beside the attention's: every expert of every EP rank
        assert sum(".mlp.experts." in name for name in report["exported_names"]) == 24 * MOE_LAYERS.get(name, 2), report
        dense = [n for n in report["exported_names"] if n.endswith(".mlp.gate_proj.weight")]
        assert len(dense) == {"random_qwen3_moe_mixed": 1, "random_qwen2_moe_mixed": 2}.get(name, 0), report
        assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report


DEEPSEEK_CHECKPOINTS = ["random_deepseek_v3_untied", "random_deepseek_v3_q_proj_tied", "random_deepseek_v3_yarn",
                        "random_glm4_moe_untied", "random_glm4_moe_plain_tied"]
DEEPSEEK_LAYOUTS = [(1, 1, 1), (2, 1, 2), (1, 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", DEEPSEEK_LAYOUTS, ids=[f"tp{tp}-pp{pp}-ep{ep}" for tp, pp, ep in DEEPSEEK_LAYOUTS])
def test_sigmoid_router_families_logits_parity_and_round_trip(tp, pp, ep, request, tmp_path):
    """DeepSeek-V3 and GLM-4.5 (one launch per layout). DeepSeek-V3 (Megatron's multi-latent attention, q through its low-rank pair and through one q_proj; the
    sigmoid router with its expert bias, group-limited top-k and routed scaling; a shared expert; the first
    layer dense) against transformers in float64 at TP 1, at TP 2 with EP 2 (latents and heads split over TP,
    four experts per rank), and the bit-exact HF round trip (the expert bias, a buffer, included) at each and
    at PP 2 (the dense layer and an MoE layer on stage 0); the checkpoint's MTP layers neither read nor written.
    Each feature moves transformers' own logits by far more than the fp32 rule allows (`*_effect`), so a
    model that ignored one, or laid the rope dims out otherwise, would fail the logit check. GLM-4.5: the same
    router and MLP layers, grouped-query attention with and without q/k/v biases and q/k norms, half of each
    head rotated (its effect checked as the router's), its MTP layer left out. A DeepSeek-V3 with YaRN RoPE
    (Megatron's MLA YarnRotaryEmbedding and softmax scale): its frequencies against transformers' (`inv_freq`),
    the logits within the rule, and YaRN's effect on transformers' own logits past it."""
    paths = [request.getfixturevalue(name) for name in DEEPSEEK_CHECKPOINTS]
    out = tmp_path / "report.json"
    torchrun("parity_worker.py", "--hf", *paths, "--out", out, "--tp", tp, "--pp", pp, "--ep", ep, nproc=2)
    run = read_json(out)
    assert (run["tp"], run["pp"], run["ep"]) == (tp, pp, ep)
    assert [(r["family"], r["tied"], r["rope_type"] if pp == 1 else None) for r in run["models"]] == [
        ("deepseek_v3", False, "default" if pp == 1 else None), ("deepseek_v3", True, "default" if pp == 1 else None),
        ("deepseek_v3", False, "yarn" if pp == 1 else None), ("glm4_moe", False, "default" if pp == 1 else None),
        ("glm4_moe", True, "default" if pp == 1 else None)]
    for report in run["models"]:
        glm = report["family"] == "glm4_moe"
        if pp == 1:
            _assert_parity(report)
            limit = fp32_limit(0.0) * report["logit_scale"] * 2.0**-23
            for effect in ("expert_bias", "routed_scaling", "group_limit", "partial_rotary" if glm else "rope_interleave"):
                assert report[f"{effect}_effect"] > 2 * limit, (effect, report)
            if report["rope_type"] == "yarn":  # YaRN's frequencies and its two attention terms matter
                assert report["rope_scaling_effect"] > 2 * limit, report
        names = report["exported_names"]
        if glm:  # 3 MoE layers x 8 experts x 3 tensors; 1 MTP layer x 4 tensors; biases and norms where switched on
            assert sum(".mlp.experts." in name for name in names) == 3 * 8 * 3, report
            assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
            assert ("model.layers.0.self_attn.q_proj.bias" in names) is not report["tied"], report
            assert ("model.layers.0.self_attn.q_norm.weight" in names) is not report["tied"], report
            assert report["left_out"] == 4, report
            assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report
            continue
        # 3 MoE layers x 8 experts x 3 tensors; the router's weight and expert bias in each; 2 MTP layers x 4
        assert sum(".mlp.experts." in name for name in names) == 3 * 8 * 3, report
        assert sorted(n for n in names if "e_score_correction_bias" in n) == [
            f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)], report
        assert "model.layers.0.mlp.gate_proj.weight" in names and not any("layers.0.mlp.gate." in n for n in names)
        assert ("model.layers.0.self_attn.q_proj.weight" in names) is report["tied"], report
        assert report["left_out"] == 8, report
        assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report


NEMOTRON_H_CHECKPOINTS = ["random_nemotron_h_untied", "random_nemotron_h_dense"]
# TP 1 (one rank's model, the layer alone: test_mamba_mixer.py; its gradients: test_weight_gradients_match_transformers)
# left out for CI's time: TP 2 computes the same with everything split
NEMOTRON_H_LAYOUTS = [(2, 1, 2), (1, 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", NEMOTRON_H_LAYOUTS, ids=[f"tp{tp}-pp{pp}-ep{ep}" for tp, pp, ep in NEMOTRON_H_LAYOUTS])
def test_nemotron_h_logits_parity_and_round_trip(tp, pp, ep, request, tmp_path):
    """Nemotron-H (one mixer per layer, ME*M-E: Megatron's MambaMixer with megarl's scan, attention without RoPE, a
    squared-ReLU MLP, MoE with squared-ReLU experts under the sigmoid router; and a model without MoE layers) against
    transformers in float64 at
    TP 1, at TP 2 with EP 2 (Mamba heads and groups, attention heads split over TP; the in_proj's five parts each
    split), and the bit-exact round trip under `backbone.` at each and at PP 2 (each stage its own mixers).
    The expert bias, routed scaling, group limit and squared ReLU each move transformers' own logits past the rule."""
    paths = [request.getfixturevalue(name) for name in NEMOTRON_H_CHECKPOINTS]
    out = tmp_path / "report.json"
    torchrun("parity_worker.py", "--hf", *paths, "--out", out, "--tp", tp, "--pp", pp, "--ep", ep, "--seq-len", 40,
             nproc=2)
    run = read_json(out)
    assert (run["tp"], run["pp"], run["ep"]) == (tp, pp, ep)
    assert [r["family"] for r in run["models"]] == ["nemotron_h", "nemotron_h"]
    for report, moe_layers in zip(run["models"], (2, 0)):
        if pp == 1:
            _assert_parity(report)
            limit = fp32_limit(0.0) * report["logit_scale"] * 2.0**-23
            for effect in ("expert_bias", "routed_scaling", "group_limit", "squared_relu")[:4 if moe_layers else 0]:
                assert report[f"{effect}_effect"] > 2 * limit, (effect, report)
        names = report["exported_names"]
        # 8 experts x 2 tensors (up, down: no gate) per MoE layer; every name under backbone. but lm_head
        assert sum(".mixer.experts." in name for name in names) == moe_layers * 8 * 2, report
        assert all(name.startswith("backbone.") for name in names if name != "lm_head.weight"), report
        assert sum(name.endswith(".mixer.A_log") for name in names) == 2, report
        assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report


def _assert_parity(report):
    """Every float check within the fp32 rule (tests/helpers.py) of its float64 reference, and each
    compared quantity far enough from 0 (or from its alternative) that a wrong path would show."""
    measured = {name: value for name, value in report.items() if name.endswith("_ulps") and "_plain" not in name}
    problem = {name: value for name, value in measured.items()
               if not value <= fp32_limit(report.get(name.replace("_ulps", "_plain_ulps"), 0.0))}
    assert not problem, f"over the fp32 rule: {problem} ({report})"
    # The forward (logits, values: Megatron fp32 vs transformers float64), then the vocabulary-parallel
    # functions on Megatron's logits: logprobs, entropy, full KL, top-k, top-k GKD (renorm, tail),
    # full-vocabulary GKD at three betas, each with its gradient.
    expected = {"logit", "logprob", "entropy", "value", "inv_freq", "topk_logprob", "topk_mass", "full_kl",
                "full_kl_grad", *(f"gkd_{mode}{grad}" for mode in ("renorm", "tail", "full_beta0", "full_beta0.5",
                                                                  "full_beta1") for grad in ("", "_grad"))}
    if "sliding_window_effect" in report:  # the same sequences packed into one row (--padding-free)
        expected.add("packed_logit")
    if report["rope_type"] == "none":  # Nemotron-H: no RoPE, no frequencies to compare
        expected.remove("inv_freq")
    assert {name[: -len("_ulps")] for name in measured} == expected, report
    assert report["full_kl_mean"] > 1e-3, report  # the KL itself is far from 0
    for name in ("full_kl", "gkd_renorm", "gkd_tail", "gkd_full_beta0", "gkd_full_beta0.5", "gkd_full_beta1"):
        assert report[f"{name}_mean"] > 1e-5, report  # random models: near-uniform logits
        assert report[f"{name}_padding_grad_max"] == 0.0, report
    # Teacher top-k over vocabulary shards: the same ids wherever the ranking is not within rounding.
    assert report["topk_clear_positions"] > 0 and report["topk_ids_differ_where_clear"] == 0, report
    # Critic: the value head on the trunk equals HF's final hidden states times the head.
    assert report["value_std"] > 1e-3, report
    # RoPE: where scaled, the scaling moves HF's logits by far more than the logits' rounding, so a
    # model that ignored it would fail.
    # (the Llama checkpoints' Llama-3 scaling; DeepSeek-V3's YaRN, whose test checks its effect against the rule)
    scaled = {"llama": ("llama3",), "deepseek_v3": ("default", "yarn"), "qwen3": ("default", "yarn"),
              "gpt_oss": ("yarn",), "nemotron_h": ("none",)}.get(
        report["family"], ("default",))
    assert report["rope_type"] in scaled, report
    if report["rope_type"] not in ("default", "none"):
        limit = fp32_limit(0.0) * report["logit_scale"] * 2.0**-23
        assert report["rope_scaling_effect"] > max(2 * limit, 1e-2 if report["rope_type"] == "llama3" else 0), report
    if "sliding_window_effect" in report:  # the window moves transformers' logits far past the rule: it is not ignored
        assert report["sliding_window_effect"] > 2 * fp32_limit(0.0) * report["logit_scale"] * 2.0**-23, report


# ------------------------------------------------------------ config checks --

def _config(family, **fields):
    from transformers import (DeepseekV3Config, Glm4MoeConfig, GptOssConfig, LlamaConfig, NemotronHConfig, Qwen2Config,
                              Qwen2MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig)

    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig,
                    "qwen2_moe": Qwen2MoeConfig, "qwen3_5": Qwen3_5TextConfig,
                    "qwen3_5_moe": Qwen3_5MoeTextConfig, "deepseek_v3": DeepseekV3Config,
                    "glm4_moe": Glm4MoeConfig, "gpt_oss": GptOssConfig, "nemotron_h": NemotronHConfig}[family]
    if family.startswith("qwen3_5"):
        fields = {"head_dim": 32, "layer_types": ["linear_attention", "full_attention"], **fields}
    kv_heads = 2
    if family == "deepseek_v3":  # DeepSeek-V3's router and MLA widths at a tiny scale; MLA expands every head
        kv_heads = 4
        fields = {**dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                         first_k_dense_replace=1), **fields}
    if family == "gpt_oss":
        fields = {**dict(num_local_experts=8, num_experts_per_tok=2, layer_types=["full_attention"] * 2), **fields}
    if family == "glm4_moe":
        fields = {**dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                         first_k_dense_replace=1), **fields}
    if family == "nemotron_h":
        fields = {**dict(hybrid_override_pattern="M*-E", head_dim=32, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), **fields}
    fields = {"num_hidden_layers": len(fields.get("hybrid_override_pattern", "xx")), **fields}
    return config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads,
                        max_position_embeddings=16384, **fields)


@pytest.mark.parametrize("family", [*FAMILY_CHECKPOINTS, "qwen3_moe", "qwen2_moe", "qwen3_5_moe", "deepseek_v3",
                                    "glm4_moe", "gpt_oss", "nemotron_h"])
def test_family_of_picks_by_architecture_then_model_type(family):
    from megarl.models.families import FAMILIES, family_of

    config = _config(family)
    assert family_of(config) is FAMILIES[family]  # no `architectures`: by model_type
    config.architectures = list(FAMILIES[family].hf_architectures)
    assert family_of(config) is FAMILIES[family]


def test_unsupported_architecture_is_one_line_listing_the_supported():
    from transformers import MistralConfig

    from megarl.models.families import family_of

    config = MistralConfig(architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError) as error:
        family_of(config)
    message = str(error.value)
    assert "\n" not in message and "MistralForCausalLM" in message
    for supported in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                      "Qwen2MoeForCausalLM"):
        assert supported in message


LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)

REFUSED = [
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, attention_factor=1.0,
                                        original_max_position_embeddings=64)), "attention_factor=1.0"),
    ("glm4_moe", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, partial_rotary_factor=0.5,
                                           original_max_position_embeddings=64)), "partial_rotary_factor=0.5"),
    ("qwen3", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)), "rope_type='dynamic'"),
    ("qwen2", dict(rope_parameters=dict(LLAMA3)), "rope_type='llama3'"),
    ("qwen3", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)), "rope_type='linear'"),
    # sliding windows: on a family whose windowed layers megarl does not map; a windowed layer without its width
    ("llama", dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    ("glm4_moe", dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]), "sliding_window=None"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=0, max_window_layers=2), "sliding_window=0"),
    ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("qwen2_moe", dict(mlp_only_layers=[5]), "mlp_only_layers names layer 5"),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1]), "no layer has routed experts"),
    ("qwen3_moe", dict(decoder_sparse_step=3), "no layer has routed experts"),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ("qwen3_5", dict(layer_types=["linear_attention", "sliding_attention"]), "layer_types[1]='sliding_attention'"),
    ("qwen3_5", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.3)),
     "partial_rotary_factor=0.3"),
    # DeepSeek-V3: a router or attention variant its Megatron model would compute otherwise
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy'"),
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=False"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=False"),
    ("deepseek_v3", dict(n_group=2, topk_group=1), "topk_group=1"),
    ("deepseek_v3", dict(n_shared_experts=0), "n_shared_experts=0"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0, attention_factor=1.2,
                                              original_max_position_embeddings=4096)), "attention_factor=1.2"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0, truncate=False,
                                              original_max_position_embeddings=4096)), "truncate=False"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0, mscale_all_dim=1.0,
                                              original_max_position_embeddings=4096)), "mscale_all_dim=1.0 without"),
    ("deepseek_v3", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0)), "rope_type='linear'"),
    # GLM-4.5: its router is DeepSeek-V3's, its attention grouped-query with half the head rotated
    # gpt-oss: values vLLM's activation fixes, biases Megatron gives every linear, a quantized release
    ("gpt_oss", dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    ("gpt_oss", dict(swiglu_limit=10.0), "swiglu_limit=10.0"),
    ("gpt_oss", dict(attention_bias=False), "attention_bias=False"),
    ("gpt_oss", dict(quantization_config=dict(quant_method="mxfp4")), "quant_method 'mxfp4'"),
    ("glm4_moe", dict(norm_topk_prob=False), "norm_topk_prob=False"),
    ("glm4_moe", dict(n_shared_experts=0), "n_shared_experts=0"),
    ("glm4_moe", dict(first_k_dense_replace=2), "no layer has routed experts"),
    # Nemotron-H: activations, parts and groupings Megatron's layers (and megarl's tables) do not have
    ("nemotron_h", dict(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu'"),
    ("nemotron_h", dict(moe_latent_size=16), "moe_latent_size=16"),
    ("nemotron_h", dict(n_groups=3), "n_groups=3 must divide mamba_num_heads=8"),
    ("nemotron_h", dict(use_bias=True), "use_bias"),
    ("nemotron_h", dict(norm_topk_prob=False), "norm_topk_prob=False"),
]


@pytest.mark.parametrize("groups,group_topk,megatron_groups", [(4, 2, (4, 2)), (1, 1, (None, None)), (4, 4, (None, None))])
def test_deepseek_v3_config_reaches_megatron(groups, group_topk, megatron_groups):
    """DeepSeek-V3's config as Megatron's MLATransformerConfig: the latent and head widths, the sigmoid router
    with its expert bias frozen (update rate 0), routed scaling, group-limited top-k only where it limits
    (Moonlight's and Kimi's n_group = topk_group = 1 keep every group), the ungated shared experts, the first
    layer dense (moe_layer_freq), the value width as kv_channels."""
    import torch

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, transformer_config

    config = _config("deepseek_v3", n_group=groups, topk_group=group_topk, num_experts_per_tok=2 * group_topk,
                     routed_scaling_factor=2.5, n_shared_experts=2)
    family = family_of(config)
    check_supported(config, family)
    megatron = transformer_config(config, family, 1, 1, 1, torch.float32)
    assert type(megatron).__name__ == "MLATransformerConfig" and megatron.multi_latent_attention
    assert (megatron.q_lora_rank, megatron.kv_lora_rank, megatron.qk_head_dim, megatron.qk_pos_emb_head_dim,
            megatron.v_head_dim, megatron.kv_channels) == (48, 32, 32, 16, 24, 24)
    assert megatron.rope_type == "rope" and megatron.rotary_scaling_factor == 1.0 and megatron.mscale_all_dim == 0.0
    assert (megatron.moe_router_score_function, megatron.moe_router_enable_expert_bias,
            megatron.moe_router_bias_update_rate, megatron.moe_router_topk_scaling_factor) == ("sigmoid", True, 0.0, 2.5)
    assert (megatron.moe_router_num_groups, megatron.moe_router_group_topk) == megatron_groups
    assert megatron.moe_shared_expert_intermediate_size == 64 and not megatron.moe_shared_expert_gate
    assert megatron.moe_layer_freq == [0, 1] and megatron.ffn_hidden_size == config.intermediate_size


def test_qwen3_5_partial_rope_and_layer_pattern_reach_megatron():
    """Qwen3.5's config as Megatron's: a quarter of each head rotated, Gated DeltaNet where layer_types says
    linear_attention, the attention's output gate and 1 + w norms."""
    import torch

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, rope_arguments, transformer_config

    config = _config("qwen3_5", rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
                     linear_num_key_heads=2, linear_num_value_heads=4)
    family = family_of(config)
    check_supported(config, family)
    assert rope_arguments(config)[0]["rotary_percent"] == 0.25
    megatron = transformer_config(config, family, 1, 1, 1, torch.float32)
    assert megatron.linear_attention_freq == [1, 0] and megatron.experimental_attention_variant == "gated_delta_net"
    assert megatron.attention_output_gate and megatron.layernorm_zero_centered_gamma
    assert (megatron.linear_num_key_heads, megatron.linear_num_value_heads) == (2, 4)


SLIDING = dict(use_sliding_window=True, sliding_window=7)


@pytest.mark.parametrize("family,fields,windowed", [
    ("qwen2", dict(SLIDING, num_hidden_layers=4, max_window_layers=1), [0, 1, 1, 1]),  # from max_window_layers on
    ("qwen3", dict(SLIDING, num_hidden_layers=4, max_window_layers=0), [1, 1, 1, 1]),
    ("qwen3", dict(SLIDING, num_hidden_layers=4, max_window_layers=4), None),  # sliding_window set, no layer windowed
    ("qwen3", dict(num_hidden_layers=4, max_window_layers=0), None),  # use_sliding_window false
    ("qwen2_moe", dict(SLIDING, num_hidden_layers=6, max_window_layers=5), [1, 0, 1, 0, 1, 0]),  # even layers below it
    ("qwen3_moe", dict(SLIDING, num_hidden_layers=3), [1, 1, 1]),  # no layer_types: every layer
])
def test_sliding_window_layers_are_where_transformers_windows(family, fields, windowed):
    """Which layers attend through a sliding window (Megatron's window_attn_skip_freq, 1 = windowed) and over how
    many tokens (window_size (sliding_window - 1, 0)) is read off transformers' own model of the config: each
    attention module's sliding_window, as its masks use it. The families' rules differ (Qwen2/3: layers from
    max_window_layers on; Qwen2-MoE: the even layers below it; Qwen3-MoE: every layer)."""
    import torch
    import transformers

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, transformer_config

    config = _config(family, **fields)
    model_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                   "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    config.architectures = [model_class]
    with torch.device("meta"):
        hf_model = getattr(transformers, model_class)(config)
    hf_windows = [getattr(layer.self_attn, "sliding_window", None) for layer in hf_model.model.layers]
    check_supported(config, family_of(config))
    megatron = transformer_config(config, family_of(config), 1, 1, 1, torch.float32)
    if windowed is None:
        assert megatron.window_size is None and megatron.window_attn_skip_freq is None
        assert not any(hf_windows), hf_windows
        return
    assert [int(bool(w)) for w in hf_windows] == windowed == megatron.window_attn_skip_freq, hf_windows
    assert {w for w in hf_windows if w} == {7} and megatron.window_size == (6, 0)


@pytest.mark.parametrize("family,fields,overrides", [
    ("qwen3", dict(SLIDING, max_window_layers=0), {}),  # every layer windowed: vLLM's model-wide window is right
    ("qwen3_moe", dict(SLIDING), {}),
    ("qwen3", dict(SLIDING, max_window_layers=2), {"sliding_window": None}),  # none windowed, sliding_window set
    ("qwen2", dict(max_window_layers=0), {}),  # use_sliding_window false: sliding_window None already
    ("llama", {}, {}),
    ("qwen2", dict(SLIDING, max_window_layers=1), "sliding-window attention in layers [1] of 2 only"),
    ("qwen2_moe", dict(SLIDING, max_window_layers=2), "sliding-window attention in layers [0] of 2 only"),
])
def test_vllm_engines_window_the_layers_transformers_windows(family, fields, overrides, tmp_path):
    """vLLM 0.32's Qwen models give every layer the config's sliding_window: the engine's config overrides make
    that transformers' windows (none: sliding_window None), and a model windowed in some layers only is refused
    in one line before vLLM starts."""
    from megarl.rollout import window_overrides

    config = _config(family, **fields)
    config.save_pretrained(tmp_path)
    if isinstance(overrides, dict):
        assert window_overrides(str(tmp_path)) == overrides
        return
    with pytest.raises(ValueError) as error:
        window_overrides(str(tmp_path))
    assert overrides in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("family,fields", [
    ("qwen3_moe", dict(num_hidden_layers=6, mlp_only_layers=[0, 3])),
    ("qwen2_moe", dict(num_hidden_layers=6, decoder_sparse_step=2)),
    ("qwen3_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[5])),
    ("deepseek_v3", dict(num_hidden_layers=4, first_k_dense_replace=2)),
    ("glm4_moe", dict(num_hidden_layers=4, first_k_dense_replace=3)),
])
def test_dense_and_moe_layers_are_where_transformers_builds_them(family, fields):
    """Mixed stacks: which layers are MoE (Megatron's moe_layer_freq, the conversion's expected tensors) is
    read off transformers' own model of the config (its layers' `mlp` modules), not off megarl's rule."""
    import torch
    import transformers

    from megarl.models.convert import expected_hf_names
    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, transformer_config

    config = _config(family, **fields)
    model_class = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                   "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}[family]
    config.architectures = [model_class]
    with torch.device("meta"):
        hf_model = getattr(transformers, model_class)(config)
    is_moe = [int(hasattr(layer.mlp, "experts")) for layer in hf_model.model.layers]
    assert 0 < sum(is_moe) < len(is_moe), is_moe  # the case is mixed
    check_supported(config, family_of(config))
    assert transformer_config(config, family_of(config), 1, 1, 1, torch.float32).moe_layer_freq == is_moe
    names = set(expected_hf_names(config))
    hf_names = {name for name, _ in hf_model.named_parameters()} | {
        name for name, _ in hf_model.named_buffers() if name.endswith("e_score_correction_bias")}
    for layer, moe in enumerate(is_moe):
        assert (f"model.layers.{layer}.mlp.gate.weight" in names) == bool(moe)
        assert (f"model.layers.{layer}.mlp.gate_proj.weight" in names) == (not moe)
        # per-layer names agree with transformers' own (its experts are fused there, per expert in a checkpoint)
        ours = {name for name in names if name.startswith(f"model.layers.{layer}.") and ".experts." not in name}
        theirs = {name for name in hf_names if name.startswith(f"model.layers.{layer}.") and ".experts." not in name}
        assert ours == theirs, (layer, ours ^ theirs)


def test_gpt_oss_config_reaches_megatron():
    """gpt-oss as Megatron's config: biases on every linear, a learned sink per head, the clamped SwiGLU with
    its (up + 1) term, experts of intermediate_size, top-k then softmax over the k (transformers' router)."""
    import torch

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, gpt_oss_glu_activation, transformer_config

    config = _config("gpt_oss", intermediate_size=96)
    check_supported(config, family_of(config))
    megatron = transformer_config(config, family_of(config), 1, 1, 1, torch.float32)
    assert (megatron.add_bias_linear, megatron.softmax_type, megatron.activation_func_clamp_value,
            megatron.glu_linear_offset) == (True, "learnable", 7.0, 1.0)
    assert megatron.activation_func is gpt_oss_glu_activation and megatron.gated_linear_unit
    assert (megatron.num_moe_experts, megatron.moe_router_topk, megatron.moe_ffn_hidden_size) == (8, 2, 96)
    assert megatron.moe_router_score_function == "softmax" and not megatron.moe_router_pre_softmax


def test_fused_experts_read_and_written_as_transformers_computes():
    """gpt-oss's fused expert tensors (interleaved gate/up, x @ W) read as per-expert nn.Linear tensors that
    compute transformers' own gate and up, and an export stream of those fused back bit for bit."""
    import torch

    from megarl.models import fused_experts

    experts, hidden, width = 3, 8, 6
    generator = torch.Generator().manual_seed(0)
    stored = {f"model.layers.2.mlp.experts.{name}": torch.randn(*shape, generator=generator) for name, shape in (
        ("gate_up_proj", (experts, hidden, 2 * width)), ("gate_up_proj_bias", (experts, 2 * width)),
        ("down_proj", (experts, width, hidden)), ("down_proj_bias", (experts, hidden)))}

    class Stored:
        path, weight_map = "stored", dict.fromkeys(stored, "model.safetensors")

        def get(self, name):
            return stored[name]

    view = fused_experts.PerExpertView(Stored(), experts)
    prefix = "model.layers.2.mlp.experts."
    x = torch.randn(4, hidden, generator=generator)
    for expert in range(experts):
        gate_up = x @ stored[prefix + "gate_up_proj"][expert] + stored[prefix + "gate_up_proj_bias"][expert]
        gate = torch.nn.functional.linear(x, view.get(f"{prefix}{expert}.gate_proj.weight"),
                                          view.get(f"{prefix}{expert}.gate_proj.bias"))
        up = torch.nn.functional.linear(x, view.get(f"{prefix}{expert}.up_proj.weight"),
                                        view.get(f"{prefix}{expert}.up_proj.bias"))
        assert torch.allclose(gate, gate_up[:, ::2], atol=1e-5) and torch.allclose(up, gate_up[:, 1::2], atol=1e-5)
    names = [name for name in view.weight_map if name.startswith(prefix)]
    assert len(names) == experts * len(fused_experts.PARTS)
    stream = [(name, view.get(name)) for expert in range(experts) for name in names if f".{expert}." in name]
    fused = dict(fused_experts.fuse(iter([("model.norm.weight", torch.ones(2))] + stream), experts))
    assert set(fused) == set(stored) | {"model.norm.weight"}
    assert all(torch.equal(fused[name], stored[name]) for name in stored)
    with pytest.raises(RuntimeError, match="experts missing"):
        list(fused_experts.fuse(iter(stream[:-1]), experts))


@pytest.mark.parametrize("bias,qk_norm", [(True, True), (False, False), (True, False)])
def test_glm4_moe_config_reaches_megatron(bias, qk_norm):
    """GLM-4.5's config as Megatron's: q/k/v biases where attention_bias, per-head q/k norms where use_qk_norm
    (the conversion expects their tensors exactly then), half of each head rotated, DeepSeek-V3's router."""
    import torch

    from megarl.models.convert import expected_hf_names
    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported, rope_arguments, transformer_config

    config = _config("glm4_moe", attention_bias=bias, use_qk_norm=qk_norm, routed_scaling_factor=2.5)
    family = family_of(config)
    check_supported(config, family)
    assert rope_arguments(config)[0]["rotary_percent"] == 0.5  # transformers' GLM-4.5 default
    megatron = transformer_config(config, family, 1, 1, 1, torch.float32)
    assert (megatron.add_qkv_bias, megatron.qk_layernorm, megatron.add_bias_linear) == (bias, qk_norm, False)
    assert (megatron.moe_router_score_function, megatron.moe_router_enable_expert_bias,
            megatron.moe_router_topk_scaling_factor, megatron.moe_layer_freq) == ("sigmoid", True, 2.5, [0, 1])
    names = expected_hf_names(config)
    assert ("model.layers.1.self_attn.q_proj.bias" in names) == bias
    assert ("model.layers.1.self_attn.o_proj.bias" in names) is False
    assert ("model.layers.0.self_attn.k_norm.weight" in names) == qk_norm


def test_multimodal_checkpoint_config_is_its_language_model(tmp_path):
    """A Qwen3.5 ...ForConditionalGeneration checkpoint's config is read as its text model's, keeping the
    architecture (so its tensors are looked up under model.language_model.) and the tied flag."""
    from transformers import Qwen3_5Config

    from megarl.models.convert import expected_hf_names
    from megarl.models.families import FAMILIES, family_of, hf_name_prefix, load_hf_config

    text = _config("qwen3_5").to_dict()
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                intermediate_size=64, out_hidden_size=64),
                           tie_word_embeddings=True, architectures=["Qwen3_5ForConditionalGeneration"])
    config.save_pretrained(tmp_path)
    loaded = load_hf_config(str(tmp_path))
    assert loaded.model_type == "qwen3_5_text" and loaded.hidden_size == 64 and loaded.tie_word_embeddings
    assert family_of(loaded) is FAMILIES["qwen3_5"] and hf_name_prefix(loaded) == "model.language_model."
    names = expected_hf_names(loaded)
    assert "model.language_model.layers.0.linear_attn.A_log" in names and "lm_head.weight" not in names
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in names
    assert not any("layers.0.self_attn" in name or "layers.1.linear_attn" in name for name in names)


@pytest.mark.parametrize("family,fields,field", REFUSED, ids=[r[2] + "-" + r[0] for r in REFUSED])
def test_unsupported_features_are_refused_in_one_line(family, fields, field):
    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import check_supported

    config = _config(family, **fields)
    with pytest.raises(ValueError) as error:
        check_supported(config, family_of(config))
    assert field in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("values,megatron_path", [
    ({}, True),  # Llama 3.1's values: Megatron's own rope_scaling path
    ({"factor": 32.0}, True),  # the factor reaches Megatron as an argument
    ({"original_max_position_embeddings": 64}, False),
    ({"low_freq_factor": 2.0}, False),
    ({"high_freq_factor": 8.0}, False),
])
def test_llama3_rope_arguments(values, megatron_path):
    """Values Megatron hard-codes go its way; others are applied after construction."""
    from megarl.models.megatron_gpt import rope_arguments

    kwargs, late = rope_arguments(_config("llama", rope_parameters={**LLAMA3, **values}))
    expected = {**LLAMA3, **values}
    assert kwargs["rope_scaling"] is megatron_path and kwargs["rotary_base"] == 10000.0
    if megatron_path:
        assert late is None and kwargs["rope_scaling_factor"] == expected["factor"]
    else:
        assert late == {key: expected[key] for key in late} and set(late) == {
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    plain, late = rope_arguments(_config("llama"))
    assert plain == {"rotary_base": 10000.0, "rope_scaling": False, "rotary_percent": 1.0,
                     "position_embedding_type": "rope"} and late is None
    yarn, _ = rope_arguments(_config("llama", rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                                   original_max_position_embeddings=64)))
    assert yarn["position_embedding_type"] == "yarn" and not yarn["rope_scaling"]



@pytest.mark.parametrize("rope,expected", [
    (dict(factor=4.0, original_max_position_embeddings=64), (4.0, 64, 32.0, 1.0, None, None, True)),
    (dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=16, truncate=False),  # gpt-oss's kind
     (32.0, 4096, 16.0, 1.0, None, None, False)),
    (dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.5, mscale_all_dim=1.0),
     (40.0, 4096, 32.0, 1.0, 0.5, 1.0, True)),
    (dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.5),  # one set: HF's plain attention factor
     (40.0, 4096, 32.0, 1.0, None, None, True)),
])
def test_yarn_reaches_megatron_on_grouped_query_attention(rope, expected):
    """YaRN on GQA (Qwen2/3, Llama): GPTModel's own yarn position embedding, fed the attributes its
    YarnRotaryEmbedding and the attention's concentration factor read off the config; MLA keeps its own."""
    import torch

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import transformer_config

    config = _config("qwen3", rope_parameters=dict(rope_type="yarn", rope_theta=1e4, **rope))
    megatron = transformer_config(config, family_of(config), 1, 1, 1, torch.float32)
    names = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
             "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")
    assert tuple(getattr(megatron, name) for name in names) == expected
    mla = transformer_config(_config("deepseek_v3", rope_parameters=dict(rope_type="yarn", rope_theta=1e4, **rope)),
                             family_of(_config("deepseek_v3")), 1, 1, 1, torch.float32) if "truncate" not in rope else None
    if mla is not None:
        assert not hasattr(mla, "yarn_rotary_scaling_factor") and mla.rope_type == "yarn"


@pytest.mark.parametrize("family", ["gpt_oss", "glm4_moe", "qwen3_moe", "nemotron_h"])
def test_weight_gradients_match_transformers(family, tmp_path):
    """The backward, not only the forward: every weight's gradient of the summed token log-probs of random
    sequences, Megatron (fp32, one rank, EP 1, the trainer's path) against transformers (float64), relative to
    the HF gradient's largest entry. Experts compared through the checkpoint's layout (gpt-oss's fused,
    interleaved tensors: models/fused_experts.py; transformers 5's in-memory [E, 2I, H] gate-then-up for the
    others). gpt-oss could not train at EP 1 before megatron_gpt.skip_identity_expert_reduce (Megatron's in-place
    expert-bias add on a view). Nemotron-H: megarl's Mamba-2 scan and gated norm (models/mamba_mixer.py) through
    autograd against transformers' torch scan, and its non-gated experts. Measured: <= 8.6e-6 (gpt-oss), 3.2e-6
    (Qwen3-MoE)."""
    import torch
    from helpers import make_random_model
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from megarl import accelerator, distributed
    from megarl.models import fused_experts
    from megarl.models.convert import _hf_names, _local_entries, load_hf_weights, to_hf_tensors
    from megarl.models.families import load_hf_config
    from megarl.models.mamba_mixer import without_dt_floor
    from megarl.models.megatron_gpt import build_gpt_model

    path = make_random_model(tmp_path / family, family, False, 42)
    config = load_hf_config(path)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    distributed.init_single_process_world()
    try:
        accelerator.apply_megatron_shims()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build_gpt_model(config)
        load_hf_weights(model, path, config)
        logits = model(tokens, torch.arange(24)[None].expand(2, -1), attention_mask=None)[..., :config.vocab_size]
        torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).sum().backward()
        entries = list(_local_entries(model, config))
    finally:
        distributed.destroy_single_process_world()
    hf = without_dt_floor(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager"))
    torch.log_softmax(hf(tokens).logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).sum().backward()
    hf_grads = {name: param.grad for name, param in hf.named_parameters()}

    def reference(name):
        # Nemotron-H's experts are not gated: up_proj [E, I, H] and down_proj [E, H, I] in memory, in its mixers
        mixer = re.fullmatch(r"(.+\.mixer\.experts\.)(\d+)\.(up|down)_proj\.weight", name)
        if mixer is not None:
            return hf_grads[f"{mixer.group(1)}{mixer.group(3)}_proj"][int(mixer.group(2))]
        match = fused_experts._PER_EXPERT.fullmatch(name)
        if match is None:
            return hf_grads[name]
        expert, kind = int(match.group(2)), match.group(3)
        if family == "gpt_oss":
            fused, part = fused_experts.PARTS[kind]
            return fused_experts.expert_slice(hf_grads[match.group(1) + fused], expert, part)
        if kind.startswith("down"):
            return hf_grads[match.group(1) + "down_proj"][expert]
        gate_up = hf_grads[match.group(1) + "gate_up_proj"][expert]
        return gate_up.chunk(2)[0 if kind.startswith("gate") else 1]

    compared = {}
    for _, rule, index, param in entries:
        if rule.layout == "vocab" or param.grad is None and rule.megatron.endswith("expert_bias"):
            continue  # the padded vocabulary rows; a frozen buffer
        assert param.grad is not None, (rule.megatron, index)
        for name, grad in zip(_hf_names(rule, index), to_hf_tensors(rule, [param.grad.double()], config)):
            expected = reference(name)
            compared[name] = ((grad - expected).abs().max() / expected.abs().max()).item()
    assert len(compared) > 20 and max(compared.values()) < 1e-4, sorted(compared.items(), key=lambda kv: -kv[1])[:5]
    if family == "gpt_oss":  # the sinks, router bias and expert biases took part
        assert {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
                "model.layers.1.mlp.experts.3.down_proj.bias"} <= set(compared)


def test_built_model_marks_its_tensor_parallel_weights_and_sequence_parallel_norms():
    """Megatron's TP layers mark their weights as TP-split only when they initialize them (off in megarl):
    build_gpt_model marks them, or the grad norm would count each from TP rank 0's shard alone at TP > 1.
    Every norm (the layers', q/k's and the final one) is torch's RMSNorm whose weight carries the
    `sequence_parallel` mark that finalize_model_grads sums over TP (Megatron's WrappedTorchNorm, which
    the local spec would use, refuses sequence parallelism). One rank, TP 1, where Megatron refuses
    sequence parallelism: the TP 2 spec is checked on its config alone."""
    import torch

    from megarl import distributed
    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import (SequenceParallelRMSNorm, build_gpt_model, gpt_layer_spec,
                                            transformer_config)

    hf_config = _config("qwen3", vocab_size=300, tie_word_embeddings=False)
    distributed.init_single_process_world()
    try:
        model = build_gpt_model(hf_config)
        block = gpt_layer_spec(transformer_config(hf_config, family_of(hf_config), 2, 1, 1, torch.float32,
                                                  sequence_parallel=True))
    finally:
        distributed.destroy_single_process_world()
    split = {name: p.partition_dim for name, p in model.named_parameters()
             if name.endswith("weight") and getattr(p, "tensor_model_parallel", False)}
    expected = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0}
    for layer in range(2):
        expected.update({f"decoder.layers.{layer}.self_attention.linear_qkv.weight": 0,
                         f"decoder.layers.{layer}.self_attention.linear_proj.weight": 1,
                         f"decoder.layers.{layer}.mlp.linear_fc1.weight": 0,
                         f"decoder.layers.{layer}.mlp.linear_fc2.weight": 1})
    assert split == expected
    norms = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.RMSNorm)}
    assert len(norms) == 2 * 4 + 1 and "decoder.final_layernorm" in norms, sorted(norms)
    assert all(norm.weight.sequence_parallel is False for norm in norms.values())

    layer = block.layer_specs[0].submodules
    assert block.layer_norm is layer.input_layernorm is layer.pre_mlp_layernorm is SequenceParallelRMSNorm
    assert layer.self_attention.submodules.q_layernorm is SequenceParallelRMSNorm
    assert SequenceParallelRMSNorm(model.config, 64).weight.sequence_parallel is False


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_config_follows_the_hf_router(norm_topk_prob):
    """The HF router renormalises its top-k softmax weights with norm_topk_prob: Megatron's default order
    (top-k of the logits, softmax over them) gives exactly that; without it, the softmax's own weights
    (pre-softmax). Experts whole on their EP rank; the dense families get no MoE field."""
    import torch

    from megarl.models.families import family_of
    from megarl.models.megatron_gpt import moe_config, transformer_config

    config = _config("qwen3_moe", norm_topk_prob=norm_topk_prob, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=48)
    fields = moe_config(config, family_of(config), ep=2)
    assert fields["moe_router_pre_softmax"] is (not norm_topk_prob)
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_ffn_hidden_size"]) == (8, 2, 48)
    assert fields["expert_model_parallel_size"] == 2 and fields["expert_tensor_parallel_size"] == 1
    assert "moe_shared_expert_intermediate_size" not in fields
    shared = _config("qwen2_moe", shared_expert_intermediate_size=80)
    assert moe_config(shared, family_of(shared), ep=1)["moe_shared_expert_gate"] is True
    dense = _config("qwen3")
    assert moe_config(dense, family_of(dense), ep=1) == {}
    # The loss coefficients reach an MoE model (aux_loss on when its weight is), never a dense one.
    moe = transformer_config(config, family_of(config), 1, 1, 1, torch.float32, moe_aux_loss_coeff=0.01,
                             moe_z_loss_coeff=0.001)
    assert (moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff) == (
        "aux_loss", 0.01, 0.001)
    plain = transformer_config(dense, family_of(dense), 1, 1, 1, torch.float32, moe_aux_loss_coeff=0.01,
                               moe_z_loss_coeff=0.001)
    assert plain.num_moe_experts is None and plain.moe_aux_loss_coeff == 0.0 and plain.moe_z_loss_coeff is None
