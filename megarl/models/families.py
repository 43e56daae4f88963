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

`{i}` stands for the global layer index. With the Transformer Engine layer spec
the two pre-norms live inside the following linear (`*.layer_norm_weight`);
TE_FUSED_NAMES maps the local-spec names to those.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str
    export: bool = True  # False for a tied copy that has no HF tensor of its own


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    qkv_bias: bool
    qk_layernorm: bool
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]

    def rules(self, tied_embeddings: bool) -> tuple[Rule, ...]:
        output = Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", export=False) \
            if tied_embeddings else Rule("output_layer.weight", ("lm_head.weight",), "vocab")
        return self.global_rules + (output,)


_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."
_LAYER = "decoder.layers.{i}."

_GLOBAL_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
)

_DENSE_LAYER_RULES = (
    Rule(_LAYER + "input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "qkv"),
    Rule(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row"),
    Rule(_LAYER + "pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
         "replicated"),
    Rule(_LAYER + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), "gate_up"),
    Rule(_LAYER + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), "row"),
)

_QKV_BIAS_RULES = (
    Rule(_LAYER + "self_attention.linear_qkv.bias",
         (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), "qkv"),
)

QWEN2 = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    qkv_bias=True,
    qk_layernorm=False,
    global_rules=_GLOBAL_RULES,
    layer_rules=_DENSE_LAYER_RULES + _QKV_BIAS_RULES,
)

FAMILIES = {family.name: family for family in (QWEN2,)}

TE_FUSED_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def family_of(hf_config) -> Family:
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    for family in FAMILIES.values():
        if hf_config.model_type == family.name or set(architectures) & set(family.hf_architectures):
            return family
    raise ValueError(f"model_type {hf_config.model_type!r} ({architectures}) is not a supported family; "
                     f"supported: {sorted(FAMILIES)}")
