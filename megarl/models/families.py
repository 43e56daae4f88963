"""Model families as data: HF <-> Megatron names and tensor layouts.

One table per family, shared by the HF -> Megatron loader, the HF exporter and
the trainer -> rollout weight sync. A rule says which Megatron parameter is
built from which HF tensors, and how it is laid out over tensor parallelism:

  replicated  same tensor on every TP rank (norms)
  column      split on dim 0 (column-parallel linear)
  row         split on dim 1 (row-parallel linear)
  vocab       padded to Megatron's vocabulary size, then split on dim 0
  qkv         q, k, v interleaved per query group, then split on dim 0
  gate_up     gate and up each split on dim 0; each rank holds cat(gate_r, up_r)
  expert_gate_up, expert, expert_up
              one routed expert's cat(gate, up) / down projection / non-gated up projection (Nemotron-H), whole
              on the EP rank that holds it (experts are not split over TP: expert_tensor_parallel_size is 1)
  gated_qkv   Qwen3.5's gated attention: q_proj holds each head's query and output gate ([q_h; gate_h]
              per head); Megatron's linear_qkv with attention_output_gate interleaves per query group
              [q heads, their gates, k, v], then split on dim 0
  gdn_in_proj a Gated DeltaNet's four input projections (HF in_proj_qkv = [q; k; v], in_proj_z, in_proj_b,
              in_proj_a) as Megatron's one in_proj: each TP rank holds cat(q_r, k_r, v_r, z_r, b_r, a_r)
  gdn_conv    the depthwise conv1d over [q; k; v] channels: each TP rank holds cat(q_r, k_r, v_r)
  mamba_in_proj, mamba_conv
              a Mamba-2 mixer's in_proj over [z; x; B; C; dt] and its conv1d (weight and bias) over [x; B; C]
              (Nemotron-H; the same order in HF and Megatron): each TP rank holds each part's share, concatenated

DeepSeek-V3's multi-latent attention needs no layout of its own: each of its projections is one of Megatron's
column-parallel linears (split on dim 0: the down projections' latent rows, the up projections' heads), the
two latent norms are replicated, and both sides keep each head's rows in the same order ([nope; rope] for q,
[k_nope; v] for kv_b_proj; the rope rows interleaved in pairs, which Megatron's MLA RoPE de-interleaves as
HF's rope_interleave does).

`{i}` stands for the global layer index, `{e}` for the global index of a routed expert (MoE
families: the EP rank that holds experts [r * E/EP, (r + 1) * E/EP) names them by their local index). With the Transformer Engine layer spec
the two pre-norms live inside the following linear (`*.layer_norm_weight`);
TE_FUSED_NAMES maps the local-spec names to those. The per-head q/k norms (Qwen3)
are modules of their own in both specs (`self_attention.{q,k}_layernorm.weight`),
so they need no TE name.

Beside its names, a family says which HF architecture features its Megatron model
mirrors (QKV bias, q/k norms, RoPE variants) and which HF config flags it refuses
because Megatron's GPT layer has no place for what they add; `megatron_gpt`
checks a config against that before building anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.registry import Registry


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str
    export: bool = True  # False for a tied copy that has no HF tensor of its own
    # The kind of layer that has it (`layer_kinds`: Qwen3.5's HF layer_types entry; DeepSeek-V3's dense or MoE
    # MLP, q_proj or its low-rank pair), else every layer.
    layer_type: str | None = None


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    qkv_bias: bool
    qk_layernorm: bool
    rope_types: tuple[str, ...]  # HF `rope_type` values the Megatron model reproduces
    refused_flags: tuple[tuple[str, str], ...]  # (HF config flag, what it adds): must be false
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]
    moe: bool = False  # routed experts in every layer's MLP (HF: num_experts, num_experts_per_tok, ...)
    shared_expert: bool = False  # plus a dense shared expert scaled by a sigmoid gate (Qwen2-MoE)
    # Qwen3.5's hybrid layers: Gated DeltaNet linear attention where HF's `layer_types` says
    # "linear_attention", softmax attention with an output gate where it says "full_attention"; norms that
    # scale by (1 + weight) (zero-centred gamma); partial rotary embeddings.
    hybrid_linear_attention: bool = False
    # Architectures whose language model sits under `model.language_model.` beside a vision tower (and, in
    # the released checkpoints, an MTP head): the text weights are read and written under that prefix, the
    # others are left out (`convert.HFCheckpoint`).
    multimodal_architectures: tuple[str, ...] = ()
    text_model_types: tuple[str, ...] = ()  # HF model_type of the text config alone (qwen3_5_text)
    # DeepSeek-V3: Megatron's multi-latent attention (MLASelfAttention), a sigmoid router whose choice adds the
    # checkpoint's expert bias (e_score_correction_bias), group-limited top-k and a routed scaling factor, and
    # dense MLPs in the first `first_k_dense_replace` layers (the others MoE, with shared experts).
    multi_latent_attention: bool = False
    sigmoid_router: bool = False
    # Attention features the HF config switches on or off (GLM-4.5: q/k/v biases where `attention_bias`, q/k
    # norms where `use_qk_norm`): (feature, HF flag). Their rules carry the feature as `layer_type`, and
    # `layer_kinds` gives it to every layer where the flag is true.
    switched_attention: tuple[tuple[str, str], ...] = ()
    # Partial RoPE where the config asks for it (partial_rotary_factor; Qwen3.5's quarter, GLM-4.5's half)
    partial_rotary: bool = False
    # Multi-token-prediction layers saved after the last decoder layer (DeepSeek-V3, GLM-4.5): left out
    mtp_layers_after_last: bool = False
    # gpt-oss: biases on every linear (q/k/v, o_proj, the router, the experts: Megatron's add_bias_linear),
    # a learned attention sink per head (Megatron's softmax_type "learnable"), the clamped SwiGLU with its
    # (up + 1) term, experts stored fused in the checkpoint (models/fused_experts.py)
    gpt_oss: bool = False
    # Sliding-window attention (megatron_gpt.window_config), by which layers transformers' model windows:
    # "layer_types" (Qwen2, Qwen3, Qwen2-MoE: the layers whose HF layer_types entry is sliding_attention, which
    # their configs compute from use_sliding_window and max_window_layers), "every_layer" (Qwen3-MoE: its config
    # has no layer_types; every layer is windowed when sliding_window is set), None: refused.
    sliding_window_layers: str | None = None
    # Nemotron-H: one mixer per layer behind one pre-norm, the kind HF's layers_block_type names (Mamba-2, attention
    # without RoPE, a squared-ReLU MLP, or MoE with squared-ReLU experts), the text model under `backbone.`
    block_types: bool = False
    embedding_name: str = "model.embed_tokens.weight"  # the input embedding (a tied output layer reads it)

    def rules(self, tied_embeddings: bool) -> tuple[Rule, ...]:
        output = Rule("output_layer.weight", (self.embedding_name,), "vocab", export=False) \
            if tied_embeddings else Rule("output_layer.weight", ("lm_head.weight",), "vocab")
        return self.global_rules + (output,)


_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
_LAYER = "decoder.layers.{i}."

_GLOBAL_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
)

_ATTENTION_LAYER_RULES = (  # and the two pre-norms: every family's
    Rule(_LAYER + "input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "qkv"),
    Rule(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row"),
    Rule(_LAYER + "pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
         "replicated"),
)
_DENSE_MLP_RULES = (
    Rule(_LAYER + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), "gate_up"),
    Rule(_LAYER + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), "row"),
)
_DENSE_LAYER_RULES = _ATTENTION_LAYER_RULES + _DENSE_MLP_RULES

_QKV_BIAS_RULES = (
    Rule(_LAYER + "self_attention.linear_qkv.bias",
         (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), "qkv"),
)

_QK_NORM_RULES = (  # RMSNorm over head_dim, shared by all heads: the same on every TP rank
    Rule(_LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), "replicated"),
)

# Megatron has one switch for every linear bias but q/k/v's (add_bias_linear): an o_proj
# bias alone, or MLP biases alone, cannot be expressed.
_ATTENTION_BIAS = ("attention_bias", "biases on q/k/v and o_proj (Megatron has no o_proj-only bias)")
_MLP_BIAS = ("mlp_bias", "biases on the MLP projections")

# MoE layers (transformers' Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock, saved per expert): the router
# (`gate`, replicated: every TP rank routes its tokens alike) and the routed experts, whole on their EP rank.
_EXPERT = "model.layers.{i}.mlp.experts.{e}."
_LOCAL_EXPERT = _LAYER + "mlp.experts.local_experts.{e}."
# Every MoE family's layers are MoE or dense MLP layers (`moe_layer_pattern`: DeepSeek-V3's and GLM-4.5's
# first_k_dense_replace, Qwen-MoE's mlp_only_layers / decoder_sparse_step); the kind each MLP rule needs.
_DENSE_MLP, _MOE_MLP = "dense_mlp", "moe_mlp"
_MOE_RULES = tuple(Rule(megatron, hf, layout, layer_type=_MOE_MLP) for megatron, hf, layout in (
    (_LAYER + "mlp.router.weight", (_MLP + "gate.weight",), "replicated"),
    (_LOCAL_EXPERT + "linear_fc1.weight", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"),
     "expert_gate_up"),
    (_LOCAL_EXPERT + "linear_fc2.weight", (_EXPERT + "down_proj.weight",), "expert"),
))
_SHARED_EXPERT_RULES = tuple(  # a dense MLP over TP like the dense families', and its sigmoid gate [1, hidden]
    Rule(megatron, hf, layout, layer_type=_MOE_MLP) for megatron, hf, layout in (
        (_LAYER + "mlp.shared_experts.linear_fc1.weight",
         (_MLP + "shared_expert.gate_proj.weight", _MLP + "shared_expert.up_proj.weight"), "gate_up"),
        (_LAYER + "mlp.shared_experts.linear_fc2.weight", (_MLP + "shared_expert.down_proj.weight",), "row"),
        (_LAYER + "mlp.shared_experts.gate_weight", (_MLP + "shared_expert_gate.weight",), "replicated"),
    ))
_MIXED_DENSE_MLP_RULES = tuple(Rule(rule.megatron, rule.hf, rule.layout, layer_type=_DENSE_MLP)
                               for rule in _DENSE_MLP_RULES)

# Qwen3.5 (transformers' Qwen3_5TextModel): full-attention layers have a gated q_proj and q/k norms;
# linear-attention layers a Gated DeltaNet (`linear_attn`): four input projections, a depthwise causal
# conv1d over q/k/v, per-head decay (A_log, dt_bias), a gated RMSNorm over each value head, out_proj.
_GDN = "model.layers.{i}.linear_attn."
_FULL, _LINEAR = "full_attention", "linear_attention"
_GATED_ATTENTION_RULES = (
    Rule(_LAYER + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "gated_qkv", layer_type=_FULL),
    Rule(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row", layer_type=_FULL),
) + tuple(Rule(rule.megatron, rule.hf, rule.layout, layer_type=_FULL) for rule in _QK_NORM_RULES)
_GATED_DELTA_NET_RULES = tuple(Rule(megatron, hf, layout, layer_type=_LINEAR) for megatron, hf, layout in (
    (_LAYER + "self_attention.in_proj.weight",
     (_GDN + "in_proj_qkv.weight", _GDN + "in_proj_z.weight", _GDN + "in_proj_b.weight", _GDN + "in_proj_a.weight"),
     "gdn_in_proj"),
    (_LAYER + "self_attention.conv1d.weight", (_GDN + "conv1d.weight",), "gdn_conv"),
    (_LAYER + "self_attention.A_log", (_GDN + "A_log",), "column"),  # one per value head
    (_LAYER + "self_attention.dt_bias", (_GDN + "dt_bias",), "column"),
    (_LAYER + "self_attention.out_norm.weight", (_GDN + "norm.weight",), "replicated"),  # over head_v_dim
    (_LAYER + "self_attention.out_proj.weight", (_GDN + "out_proj.weight",), "row"),
))
_HYBRID_LAYER_RULES = (  # each layer has one of the two attentions' parameters; the table holds both
    Rule(_LAYER + "input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
         "replicated"),
) + _GATED_ATTENTION_RULES + _GATED_DELTA_NET_RULES

# DeepSeek-V3 (transformers' DeepseekV3Model): multi-latent attention, q through a low-rank pair (q_a_proj, its
# norm, q_b_proj) or one q_proj (q_lora_rank None), kv through kv_a_proj_with_mqa (the latent and the shared
# rope key) and kv_b_proj; the first first_k_dense_replace layers dense MLPs, the others routed experts (a
# sigmoid router with its expert bias) plus shared experts (one dense MLP of n_shared_experts * width).
_Q_LORA, _Q_PROJ = "q_lora", "q_proj"
_MLA_RULES = (
    Rule(_LAYER + "input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.linear_q_down_proj.weight", (_ATTN + "q_a_proj.weight",), "column",
         layer_type=_Q_LORA),
    Rule(_LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_a_layernorm.weight",), "replicated",
         layer_type=_Q_LORA),
    Rule(_LAYER + "self_attention.linear_q_up_proj.weight", (_ATTN + "q_b_proj.weight",), "column",
         layer_type=_Q_LORA),
    Rule(_LAYER + "self_attention.linear_q_proj.weight", (_ATTN + "q_proj.weight",), "column", layer_type=_Q_PROJ),
    Rule(_LAYER + "self_attention.linear_kv_down_proj.weight", (_ATTN + "kv_a_proj_with_mqa.weight",), "column"),
    Rule(_LAYER + "self_attention.kv_layernorm.weight", (_ATTN + "kv_a_layernorm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.linear_kv_up_proj.weight", (_ATTN + "kv_b_proj.weight",), "column"),
    Rule(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row"),
    Rule(_LAYER + "pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
         "replicated"),
)
_DEEPSEEK_MLP_RULES = _MIXED_DENSE_MLP_RULES + tuple(
    Rule(megatron, hf, layout, layer_type=_MOE_MLP) for megatron, hf, layout in (
        (_LAYER + "mlp.router.weight", (_MLP + "gate.weight",), "replicated"),
        # a buffer, not a parameter: the router's expert bias, frozen at the checkpoint's values (docs/models.md)
        (_LAYER + "mlp.router.expert_bias", (_MLP + "gate.e_score_correction_bias",), "replicated"),
        *((rule.megatron, rule.hf, rule.layout) for rule in _MOE_RULES[1:]),
        (_LAYER + "mlp.shared_experts.linear_fc1.weight",
         (_MLP + "shared_experts.gate_proj.weight", _MLP + "shared_experts.up_proj.weight"), "gate_up"),
        (_LAYER + "mlp.shared_experts.linear_fc2.weight", (_MLP + "shared_experts.down_proj.weight",), "row"),
    ))
def _tagged(rules: tuple[Rule, ...], layer_type: str) -> tuple[Rule, ...]:
    return tuple(replace(rule, layer_type=layer_type) for rule in rules)


# gpt-oss (transformers' GptOssModel): grouped-query attention with biases on q/k/v and o_proj and a learned sink
# logit per head (`sinks`: Megatron's core attention's softmax_offset, split over TP with the heads), a router
# (`mlp.router`, with a bias) and experts with biases; the experts' tensors as per-expert names
# (models/fused_experts.py reads and writes the checkpoint's fused ones).
_GPT_OSS_RULES = _ATTENTION_LAYER_RULES + _QKV_BIAS_RULES + tuple(
    Rule(megatron, hf, layout) for megatron, hf, layout in (
        (_LAYER + "self_attention.linear_proj.bias", (_ATTN + "o_proj.bias",), "replicated"),
        (_LAYER + "self_attention.core_attention.softmax_offset", (_ATTN + "sinks",), "column"),
        (_LAYER + "mlp.router.weight", (_MLP + "router.weight",), "replicated"),
        (_LAYER + "mlp.router.bias", (_MLP + "router.bias",), "replicated"),
        (_LOCAL_EXPERT + "linear_fc1.weight", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"),
         "expert_gate_up"),
        (_LOCAL_EXPERT + "linear_fc1.bias", (_EXPERT + "gate_proj.bias", _EXPERT + "up_proj.bias"), "expert_gate_up"),
        (_LOCAL_EXPERT + "linear_fc2.weight", (_EXPERT + "down_proj.weight",), "expert"),
        (_LOCAL_EXPERT + "linear_fc2.bias", (_EXPERT + "down_proj.bias",), "expert"),
    ))


# Nemotron-H (transformers' NemotronHModel, under `backbone.`): layer i is `norm` then one `mixer`, of the kind
# layers_block_type[i] names. In Megatron's TransformerLayer a Mamba-2 or attention mixer takes the attention half
# (behind input_layernorm; the MLP half an identity), an MLP or MoE mixer the MLP half (behind pre_mlp_layernorm).
_MIXER = "model.layers.{i}.mixer."
_NORM = "model.layers.{i}.norm.weight"
_MAMBA, _MOE_BLOCK, _MLP_BLOCK = "linear_attention", "moe", "mlp"  # HF's layers_block_type values (and _FULL)
NEMOTRON_H_BLOCK_TYPES = (_MAMBA, _FULL, _MLP_BLOCK, _MOE_BLOCK)
_NEMOTRON_H_RULES = tuple(Rule(megatron, hf, layout, layer_type=kind) for kind, megatron, hf, layout in (
    (_MAMBA, _LAYER + "input_layernorm.weight", (_NORM,), "replicated"),
    (_MAMBA, _LAYER + "self_attention.in_proj.weight", (_MIXER + "in_proj.weight",), "mamba_in_proj"),
    (_MAMBA, _LAYER + "self_attention.conv1d.weight", (_MIXER + "conv1d.weight",), "mamba_conv"),
    (_MAMBA, _LAYER + "self_attention.conv1d.bias", (_MIXER + "conv1d.bias",), "mamba_conv"),
    (_MAMBA, _LAYER + "self_attention.dt_bias", (_MIXER + "dt_bias",), "column"),  # one per head
    (_MAMBA, _LAYER + "self_attention.A_log", (_MIXER + "A_log",), "column"),
    (_MAMBA, _LAYER + "self_attention.D", (_MIXER + "D",), "column"),
    (_MAMBA, _LAYER + "self_attention.norm.weight", (_MIXER + "norm.weight",), "column"),  # groups split over TP
    (_MAMBA, _LAYER + "self_attention.out_proj.weight", (_MIXER + "out_proj.weight",), "row"),
    (_FULL, _LAYER + "input_layernorm.weight", (_NORM,), "replicated"),
    (_FULL, _LAYER + "self_attention.linear_qkv.weight",
     (_MIXER + "q_proj.weight", _MIXER + "k_proj.weight", _MIXER + "v_proj.weight"), "qkv"),
    (_FULL, _LAYER + "self_attention.linear_proj.weight", (_MIXER + "o_proj.weight",), "row"),
    (_MLP_BLOCK, _LAYER + "pre_mlp_layernorm.weight", (_NORM,), "replicated"),
    (_MLP_BLOCK, _LAYER + "mlp.linear_fc1.weight", (_MIXER + "up_proj.weight",), "column"),
    (_MLP_BLOCK, _LAYER + "mlp.linear_fc2.weight", (_MIXER + "down_proj.weight",), "row"),
    (_MOE_BLOCK, _LAYER + "pre_mlp_layernorm.weight", (_NORM,), "replicated"),
    (_MOE_BLOCK, _LAYER + "mlp.router.weight", (_MIXER + "gate.weight",), "replicated"),
    (_MOE_BLOCK, _LAYER + "mlp.router.expert_bias", (_MIXER + "gate.e_score_correction_bias",), "replicated"),
    (_MOE_BLOCK, _LOCAL_EXPERT + "linear_fc1.weight", (_MIXER + "experts.{e}.up_proj.weight",), "expert_up"),
    (_MOE_BLOCK, _LOCAL_EXPERT + "linear_fc2.weight", (_MIXER + "experts.{e}.down_proj.weight",), "expert"),
    (_MOE_BLOCK, _LAYER + "mlp.shared_experts.linear_fc1.weight", (_MIXER + "shared_experts.up_proj.weight",),
     "column"),
    (_MOE_BLOCK, _LAYER + "mlp.shared_experts.linear_fc2.weight", (_MIXER + "shared_experts.down_proj.weight",),
     "row"),
))


# Router buffers that conversion carries (the others, e.g. the router's token counts, are not weights).
BUFFER_NAMES = ("mlp.router.expert_bias",)

QWEN2 = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    qk_layernorm=False,
    rope_types=("default", "yarn"),
    refused_flags=(),
    global_rules=_GLOBAL_RULES,
    layer_rules=_DENSE_LAYER_RULES + _QKV_BIAS_RULES,
    sliding_window_layers="layer_types",
)

QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    qkv_bias=False,
    qk_layernorm=True,
    rope_types=("default", "yarn"),
    refused_flags=(_ATTENTION_BIAS,),
    global_rules=_GLOBAL_RULES,
    layer_rules=_DENSE_LAYER_RULES + _QK_NORM_RULES,
    sliding_window_layers="layer_types",
)

LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    qkv_bias=False,
    qk_layernorm=False,
    rope_types=("default", "llama3", "yarn"),
    refused_flags=(_ATTENTION_BIAS, _MLP_BIAS),
    global_rules=_GLOBAL_RULES,
    layer_rules=_DENSE_LAYER_RULES,
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    qkv_bias=False,
    qk_layernorm=True,
    rope_types=("default", "yarn"),
    refused_flags=(_ATTENTION_BIAS,),
    global_rules=_GLOBAL_RULES,
    layer_rules=_ATTENTION_LAYER_RULES + _QK_NORM_RULES + _MOE_RULES + _MIXED_DENSE_MLP_RULES,
    moe=True,
    sliding_window_layers="every_layer",
)

QWEN2_MOE = Family(
    name="qwen2_moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    qkv_bias=True,
    qk_layernorm=False,
    rope_types=("default", "yarn"),
    refused_flags=(),
    global_rules=_GLOBAL_RULES,
    layer_rules=_ATTENTION_LAYER_RULES + _QKV_BIAS_RULES + _MOE_RULES + _SHARED_EXPERT_RULES + _MIXED_DENSE_MLP_RULES,
    moe=True,
    shared_expert=True,
    sliding_window_layers="layer_types",
)

QWEN3_5 = Family(
    name="qwen3_5",
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    qkv_bias=False,
    qk_layernorm=True,
    rope_types=("default", "yarn"),
    refused_flags=(_ATTENTION_BIAS,),
    global_rules=_GLOBAL_RULES,
    layer_rules=_HYBRID_LAYER_RULES + _DENSE_MLP_RULES,
    hybrid_linear_attention=True,
    partial_rotary=True,
    multimodal_architectures=("Qwen3_5ForConditionalGeneration",),
    text_model_types=("qwen3_5_text",),
)

QWEN3_5_MOE = replace(  # the same layers, every MLP routed experts with a gated shared expert
    QWEN3_5,
    name="qwen3_5_moe",
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    layer_rules=_HYBRID_LAYER_RULES + _MOE_RULES + _SHARED_EXPERT_RULES,
    moe=True,
    shared_expert=True,
    multimodal_architectures=("Qwen3_5MoeForConditionalGeneration",),
    text_model_types=("qwen3_5_moe_text",),
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_architectures=("DeepseekV3ForCausalLM",),
    qkv_bias=False,
    qk_layernorm=True,  # the two latent RMSNorms (q_a_layernorm, kv_a_layernorm): Megatron's MLA q/kv_layernorm
    rope_types=("default", "yarn"),  # YaRN through Megatron's MLA (megatron_gpt.mla_yarn_config)
    refused_flags=(("attention_bias", "biases on q_a_proj, kv_a_proj_with_mqa and o_proj"),),
    global_rules=_GLOBAL_RULES,
    layer_rules=_MLA_RULES + _DEEPSEEK_MLP_RULES,
    moe=True,
    shared_expert=True,
    multi_latent_attention=True,
    sigmoid_router=True,
    mtp_layers_after_last=True,
)

# GLM-4.5 / 4.6 (transformers' Glm4MoeModel): grouped-query attention with q/k/v biases where attention_bias (o_proj
# never has one) and per-head q/k norms where use_qk_norm, RoPE over the first half of each head
# (partial_rotary_factor 0.5, rotate-half pairs, as Megatron's non-interleaved RoPE); DeepSeek-V3's MLP layers (the
# sigmoid router with its expert bias, group-limited top-k, shared experts, the first first_k_dense_replace layers
# dense) under the same names; its MTP layer saved after the last decoder layer.
_QKV_BIAS, _QK_NORM = "qkv_bias", "qk_norm"
GLM4_MOE = Family(
    name="glm4_moe",
    hf_architectures=("Glm4MoeForCausalLM",),
    qkv_bias=False,  # both switched by the config (switched_attention)
    qk_layernorm=False,
    rope_types=("default", "yarn"),
    refused_flags=(),
    global_rules=_GLOBAL_RULES,
    layer_rules=_ATTENTION_LAYER_RULES + _tagged(_QKV_BIAS_RULES, _QKV_BIAS) + _tagged(_QK_NORM_RULES, _QK_NORM)
    + _DEEPSEEK_MLP_RULES,
    moe=True,
    shared_expert=True,
    sigmoid_router=True,
    switched_attention=((_QKV_BIAS, "attention_bias"), (_QK_NORM, "use_qk_norm")),
    partial_rotary=True,
    mtp_layers_after_last=True,
)

GPT_OSS = Family(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    qkv_bias=True,
    qk_layernorm=False,
    rope_types=("default", "yarn"),  # the released models': YaRN (factor 32 over 4096, truncate false)
    refused_flags=(),
    global_rules=_GLOBAL_RULES,
    layer_rules=_GPT_OSS_RULES,
    moe=True,
    gpt_oss=True,
    sliding_window_layers="layer_types",  # the released models: sliding (128) and full layers in turn
)

NEMOTRON_H = Family(
    name="nemotron_h",
    hf_architectures=("NemotronHForCausalLM",),
    qkv_bias=False,
    qk_layernorm=False,
    rope_types=("default",),  # no RoPE at all (no positional embedding): `check_supported` skips its checks
    refused_flags=(("attention_bias", "biases on q/k/v and o_proj"), ("mlp_bias", "biases on the MLP projections"),
                   ("use_bias", "biases on the Mamba-2 in_proj and out_proj (Megatron's MambaMixer has none)")),
    global_rules=(Rule("embedding.word_embeddings.weight", ("model.embeddings.weight",), "vocab"),
                  Rule("decoder.final_layernorm.weight", ("model.norm_f.weight",), "replicated")),
    layer_rules=_NEMOTRON_H_RULES,
    moe=True,  # where layers_block_type has moe layers; a model without them has no MoE rules to apply
    shared_expert=True,
    sigmoid_router=True,
    block_types=True,
    embedding_name="model.embeddings.weight",
)

FAMILIES = Registry("model family")
for _family in (QWEN2, QWEN3, LLAMA, QWEN3_MOE, QWEN2_MOE, QWEN3_5, QWEN3_5_MOE, DEEPSEEK_V3, GLM4_MOE, GPT_OSS,
                NEMOTRON_H):
    FAMILIES.add(_family.name, _family)

TE_FUSED_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def num_experts(hf_config) -> int:
    """The routed experts per MoE layer (Qwen's num_experts, DeepSeek-V3's n_routed_experts, gpt-oss's
    num_local_experts)."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", None) \
        or hf_config.num_local_experts


def moe_layer_pattern(hf_config) -> list[bool] | None:
    """Per layer, whether its MLP is routed experts (else a dense MLP of intermediate_size), as transformers
    builds them; None for a dense family. DeepSeek-V3 and GLM-4.5: the first first_k_dense_replace layers dense;
    Qwen2/3-MoE: a layer is MoE unless listed in mlp_only_layers or (its index + 1) is not a multiple of
    decoder_sparse_step; Qwen3.5-MoE (neither field): every layer MoE."""
    family = family_of(hf_config)
    if not family.moe:
        return None
    layers = range(hf_config.num_hidden_layers)
    if family.block_types:  # Nemotron-H: the moe blocks (the others have no MLP half, or a dense one)
        return [kind == _MOE_BLOCK for kind in hf_config.layers_block_type]
    if family.sigmoid_router:
        dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
        return [layer >= dense for layer in layers]
    dense_layers = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return [layer not in dense_layers and (layer + 1) % step == 0 for layer in layers]


def switched_on(hf_config, feature: str) -> bool:
    """Whether the family has attention feature `feature` (_QKV_BIAS, _QK_NORM) switched on by the HF config."""
    return any(name == feature and bool(getattr(hf_config, flag, False))
               for name, flag in family_of(hf_config).switched_attention)


def qkv_bias(hf_config) -> bool:
    """Whether q/k/v have biases (Megatron's add_qkv_bias): always for Qwen2, where attention_bias for GLM-4.5."""
    return family_of(hf_config).qkv_bias or switched_on(hf_config, _QKV_BIAS)


def qk_layernorm(hf_config) -> bool:
    """Whether attention has per-head q/k norms (Megatron's qk_layernorm; MLA's two latent norms)."""
    return family_of(hf_config).qk_layernorm or switched_on(hf_config, _QK_NORM)


def layer_kinds(hf_config) -> list[frozenset] | None:
    """Per layer, the kinds its rules' `layer_type` may name (None: the family's rules apply to every layer):
    Qwen3.5's HF layer_types entry; DeepSeek-V3's query projection (q_lora: q_a_proj, its norm and q_b_proj, with
    q_lora_rank set; else q_proj); an MoE family's MLP (`moe_layer_pattern`: moe_mlp or dense_mlp); the
    attention features the config switches on (GLM-4.5's qkv_bias, qk_norm)."""
    family = family_of(hf_config)
    if not any(rule.layer_type for rule in family.layer_rules):
        return None
    pattern = moe_layer_pattern(hf_config)
    switched = {feature for feature, _ in family.switched_attention if switched_on(hf_config, feature)}
    query = _Q_LORA if getattr(hf_config, "q_lora_rank", None) else _Q_PROJ
    kinds = []
    for layer in range(hf_config.num_hidden_layers):
        kind = set(switched)
        if family.block_types:
            kinds.append(frozenset({hf_config.layers_block_type[layer]}))
            continue
        if family.hybrid_linear_attention:
            kind.add(hf_config.layer_types[layer])
        if family.multi_latent_attention:
            kind.add(query)
        if pattern is not None:
            kind.add(_MOE_MLP if pattern[layer] else _DENSE_MLP)
        kinds.append(frozenset(kind))
    return kinds


def family_of(hf_config) -> Family:
    """The family of an HF config, by its `architectures`, else by its `model_type`.

    The model_type fallback keeps configs without `architectures` (built in code) and
    other heads on the same trunk (a critic's *ForTokenClassification) working.
    """
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    for family in FAMILIES.values():
        if set(architectures) & set(family.hf_architectures):
            return family
    for family in FAMILIES.values():
        if getattr(hf_config, "model_type", None) in (family.name, *family.text_model_types):
            return family
    supported = ", ".join(f"{arch} ({family.name})" for family in FAMILIES.values()
                          for arch in family.hf_architectures)
    raise ValueError(f"unsupported model: architectures {list(architectures)}, model_type "
                     f"{getattr(hf_config, 'model_type', None)!r}; supported: {supported}")


def load_hf_config(path: str):
    """The HF config of the checkpoint at `path` as megarl reads every model: for a multimodal checkpoint of a
    family that megarl trains as text (Qwen3.5's ...ForConditionalGeneration), its language model's config
    (`text_config`) with the checkpoint's `architectures` (so `family_of` and the weight names still know it
    is the multimodal layout) and its `tie_word_embeddings`; any other config as transformers reads it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", None) == NEMOTRON_H.name:
        # transformers (5.19) and vLLM (0.32) build Nemotron-H's lm_head untied whatever tie_word_embeddings says, and
        # its checkpoints hold one: megarl builds the model they serve
        config.tie_word_embeddings = False
    architectures = tuple(getattr(config, "architectures", None) or ())
    if not any(set(architectures) & set(family.multimodal_architectures) for family in FAMILIES.values()):
        return config
    text = config.get_text_config()
    text.architectures = list(architectures)
    if "tie_word_embeddings" in config.to_diff_dict():  # set on the whole model, not only its text part
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def module_name_prefix(hf_config) -> str:
    """Where transformers' model in memory holds the text model's modules (what PEFT names an adapter's modules
    by): the checkpoint's prefix (`hf_name_prefix`), but Nemotron-H's `model.` (its checkpoint says `backbone.`)."""
    return "model." if getattr(hf_config, "model_type", None) == NEMOTRON_H.name else hf_name_prefix(hf_config)


def hf_name_prefix(hf_config) -> str:
    """Where the text model's tensors sit in the checkpoint: `model.language_model.` in a multimodal one,
    Nemotron-H's `backbone.`, `model.` otherwise (the family tables are written with `model.`)."""
    architectures = set(getattr(hf_config, "architectures", None) or ())
    multimodal = any(architectures & set(family.multimodal_architectures) for family in FAMILIES.values())
    if multimodal:
        return "model.language_model."
    return "backbone." if getattr(hf_config, "model_type", None) == NEMOTRON_H.name else "model."


# What must agree for one checkpoint's weights to load into an engine built for another (and to be served by it as
# transformers computes them: which layers are windowed is in layer_types, or for Qwen3-MoE in sliding_window alone,
# which HF's configs set to None (Qwen2-MoE 0) without use_sliding_window; the window's width is sliding_window).
SHAPE_FIELDS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts",
                "n_routed_experts", "num_local_experts", "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts",
                "attention_bias", "use_qk_norm",
                "moe_intermediate_size", "shared_expert_intermediate_size", "layer_types", "sliding_window",
                "linear_num_key_heads",
                "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "layers_block_type", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                "moe_shared_expert_intermediate_size")


def shape_difference(hf_config, other) -> str | None:
    """The first config field (SHAPE_FIELDS) on which two models' shapes differ, or None: then the
    weights of one load into an engine built for the other (a colocated teacher served by the
    rollout engines)."""
    return next((key for key in SHAPE_FIELDS if getattr(hf_config, key, None) != getattr(other, key, None)), None)
