"""Build a Megatron-core GPTModel that mirrors an HF causal-LM config.

What differs between families is data (`families.py`); this module turns an HF
config plus its family into TransformerConfig and GPTModel arguments, and refuses,
in one line naming the field, any config feature the model would silently get
wrong (an unsupported RoPE variant, an o_proj-only bias, sliding windows on a
family whose windowed layers are not mapped: `window_config`).

RoPE. Megatron-core 0.16's RotaryEmbedding implements Llama-3 scaling
(`rope_scaling=True`), but passes it only the factor: low_freq_factor 1,
high_freq_factor 4 and original_max_position_embeddings 8192 (Llama 3.1's values)
are hard-coded defaults of `RotaryEmbedding._apply_scaling`. A config with those
values takes Megatron's path as is; any other values are applied by calling the
same `_apply_scaling` with the config's values on the unscaled frequencies right
after construction (the frequencies are a plain attribute, rebuilt nowhere else).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from megarl import accelerator
from megarl.models import elementwise
from megarl.models.families import (NEMOTRON_H_BLOCK_TYPES, Family, family_of, moe_layer_pattern, num_experts,
                                     qk_layernorm, qkv_bias)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of divisible_by * TP so every shard is equal."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# The Llama-3 values Megatron-core 0.16 cannot take as arguments, at the values it fixes.
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_parameters(hf_config) -> dict:
    """HF's RoPE settings as one dict with `rope_type` and `rope_theta`.

    transformers 5 keeps them in `rope_parameters` (`rope_scaling` is an alias);
    older configs have `rope_theta` at the top level and `rope_scaling` with `type`.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def rope_theta(hf_config) -> float:
    return float(rope_parameters(hf_config)["rope_theta"])


def llama3_scaling(hf_config) -> dict | None:
    """The config's Llama-3 RoPE scaling values (`_apply_scaling`'s keywords), or None."""
    params = rope_parameters(hf_config)
    if params["rope_type"] != "llama3":
        return None
    # As transformers: the original context defaults to max_position_embeddings.
    params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    missing = [key for key in ("factor", *MEGATRON_LLAMA3_FIXED) if key not in params]
    if missing:
        raise ValueError(f"rope_parameters of type llama3 lack {missing}")
    return {key: float(params[key]) for key in ("factor", *MEGATRON_LLAMA3_FIXED)}


def check_supported(hf_config, family: Family) -> None:
    """Refuse config features this family's Megatron model would not reproduce."""
    for flag, what in family.refused_flags:
        if getattr(hf_config, flag, False):
            raise ValueError(f"{family.name}: {flag}=True ({what}) is not supported; it must be false")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in family.rope_types:
        raise ValueError(f"{family.name}: rope_parameters.rope_type={rope['rope_type']!r} is not supported; "
                         f"supported: {list(family.rope_types)}")
    partial = rotary_fraction(hf_config)
    if rope["rope_type"] == "yarn" and not family.multi_latent_attention:
        check_yarn_supported(rope, partial, family)
    if partial != 1.0 and not family.partial_rotary:
        raise ValueError(f"{family.name}: partial_rotary_factor={partial} is not supported; it must be 1.0")
    if not 0 < partial <= 1 or int(head_dim(hf_config) * partial) % 2:
        raise ValueError(f"{family.name}: partial_rotary_factor={partial} must rotate an even number of each "
                         f"head's {head_dim(hf_config)} channels")
    if family.multi_latent_attention:
        check_mla_supported(hf_config, family)
    if family.block_types:
        check_block_types_supported(hf_config, family)
    elif family.moe:
        check_moe_supported(hf_config, family)
    if family.gpt_oss:
        check_gpt_oss_supported(hf_config, family)
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{family.name}: a quantized checkpoint (quantization_config quant_method {method!r}) is "
                         f"not supported; megarl trains and syncs full-precision weights: dequantize it first (for "
                         f"gpt-oss's MXFP4, transformers' Mxfp4Config(dequantize=True))")
    if family.block_types:  # its layer_types are its block types, checked above
        return
    layer_types = list(getattr(hf_config, "layer_types", None) or ())
    allowed = LAYER_TYPES if family.hybrid_linear_attention else ("full_attention",)
    if family.sliding_window_layers == "layer_types":
        allowed += ("sliding_attention",)
    unknown = [(i, kind) for i, kind in enumerate(layer_types) if kind not in allowed]
    if "sliding_attention" in layer_types and not family.hybrid_linear_attention and not family.sliding_window_layers:
        raise ValueError(f"{family.name}: sliding-window attention (use_sliding_window / layer_types) is not "
                         f"supported; every layer must be full_attention")
    check_sliding_window(hf_config, family)
    if unknown:
        raise ValueError(f"{family.name}: layer_types[{unknown[0][0]}]={unknown[0][1]!r} is not supported; each "
                         f"layer must be one of {list(allowed)}")
    if family.hybrid_linear_attention and len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"{family.name}: layer_types has {len(layer_types)} entries for num_hidden_layers="
                         f"{hf_config.num_hidden_layers}")


# Nemotron-H's activations as Megatron computes them (squared ReLU: megatron.core.activations.squared_relu, vLLM's
# relu2; silu in the Mamba-2 conv), and the parts it has that megarl does not build.
NEMOTRON_H_FIXED = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu"}
NEMOTRON_H_ABSENT = {"moe_latent_size": "MoE latent projections (fc1/fc2_latent_proj)"}


def check_block_types_supported(hf_config, family: Family) -> None:
    """Nemotron-H as megarl builds it (`block_type_specs`): every layers_block_type entry a known mixer, one per
    layer; the activations Megatron's layers compute; the MoE checks where there are MoE blocks; a mixer of whole
    groups of heads (Megatron's MambaMixer: heads divisible by n_groups)."""
    kinds = list(getattr(hf_config, "layers_block_type", None) or ())
    if len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"{family.name}: layers_block_type has {len(kinds)} entries for num_hidden_layers="
                         f"{hf_config.num_hidden_layers}")
    unknown = [(i, kind) for i, kind in enumerate(kinds) if kind not in NEMOTRON_H_BLOCK_TYPES]
    if unknown:
        raise ValueError(f"{family.name}: layers_block_type[{unknown[0][0]}]={unknown[0][1]!r} is not supported; "
                         f"each layer must be one of {list(NEMOTRON_H_BLOCK_TYPES)}")
    for field, value in NEMOTRON_H_FIXED.items():
        if getattr(hf_config, field, value) != value:
            raise ValueError(f"{family.name}: {field}={getattr(hf_config, field)!r} is not supported; it must be "
                             f"{value!r}")
    for field, what in NEMOTRON_H_ABSENT.items():
        if getattr(hf_config, field, None):
            raise ValueError(f"{family.name}: {field}={getattr(hf_config, field)} ({what}) is not supported")
    if "linear_attention" in kinds and hf_config.mamba_num_heads % hf_config.n_groups:
        raise ValueError(f"{family.name}: n_groups={hf_config.n_groups} must divide mamba_num_heads="
                         f"{hf_config.mamba_num_heads}")
    if "moe" in kinds:
        check_moe_supported(hf_config, family)


def check_yarn_supported(rope: dict, partial: float, family: Family) -> None:
    """YaRN as GPTModel's YarnRotaryEmbedding computes it (`yarn_attributes`): over whole heads (it blends
    frequencies over kv_channels whatever rotary_percent says), from factor / mscale / mscale_all_dim."""
    if partial != 1.0:
        raise ValueError(f"{family.name}: rope_type 'yarn' with partial_rotary_factor={partial} is not supported "
                         f"(Megatron's YaRN rotates whole heads)")
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{family.name}: rope_parameters.attention_factor={rope['attention_factor']} is not "
                         f"supported; Megatron derives YaRN's attention factor from factor, mscale and mscale_all_dim")
    if not rope.get("original_max_position_embeddings"):
        raise ValueError(f"{family.name}: rope_parameters of type yarn lack original_max_position_embeddings")


def sliding_window_pattern(hf_config, family: Family) -> list[bool]:
    """Per layer, whether transformers' model attends through a sliding window there (`Family.sliding_window_layers`):
    Qwen2/3 and Qwen2-MoE where layer_types says sliding_attention (their configs' rules differ: Qwen2/3 window the
    layers from max_window_layers on, Qwen2-MoE the even layers below it; both read layer_types alone when
    modelling), Qwen3-MoE every layer where sliding_window is set (its config nulls it without use_sliding_window).
    All False for the other families (`check_supported` refuses a sliding layer there)."""
    layers = hf_config.num_hidden_layers
    if family.sliding_window_layers == "every_layer":
        return [getattr(hf_config, "sliding_window", None) is not None] * layers
    if family.sliding_window_layers == "layer_types":
        layer_types = list(getattr(hf_config, "layer_types", None) or ("full_attention",) * layers)
        return [kind == "sliding_attention" for kind in layer_types]
    return [False] * layers


def check_sliding_window(hf_config, family: Family) -> None:
    """A config with windowed layers names their window: a positive sliding_window (transformers would build
    those layers' masks from None or 0, which Megatron's window cannot take), and, from layer_types, one entry
    per layer."""
    if not family.sliding_window_layers:
        return
    pattern = sliding_window_pattern(hf_config, family)
    if not any(pattern):
        return
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"{family.name}: layer_types has sliding_attention layers but sliding_window={window!r}; "
                         f"it must be a positive integer (the window's width in tokens)")
    if len(pattern) != hf_config.num_hidden_layers:
        raise ValueError(f"{family.name}: layer_types has {len(pattern)} entries for num_hidden_layers="
                         f"{hf_config.num_hidden_layers}")


def window_config(hf_config, family: Family) -> dict:
    """TransformerConfig's sliding-window fields ({} without windowed layers): window_size (left, right) =
    (sliding_window - 1, 0), since transformers lets a query see a key when q - sliding_window < k <= q (the
    token itself and sliding_window - 1 before it: masking_utils.sliding_window_overlay) and Megatron when
    q - left <= k <= q + right (transformer/utils.py: get_sliding_window_causal_mask); window_attn_skip_freq
    as a list over the global layers, 1 where windowed (utils.is_layer_window_attention reads entry
    layer_number - 1 of the global, 1-based layer number, so a pipeline stage's layers take their own
    entries). Both the local attention (its softmax builds the windowed causal mask; megarl's packed and
    context-parallel paths: models/attention.py) and Transformer Engine's (its window_size argument) read them."""
    pattern = sliding_window_pattern(hf_config, family)
    if not any(pattern):
        return {}
    return dict(window_size=(hf_config.sliding_window - 1, 0), window_attn_skip_freq=[int(w) for w in pattern])


# Qwen3.5's layer kinds (HF `layer_types`): Gated DeltaNet or gated softmax attention.
LAYER_TYPES = ("linear_attention", "full_attention")


def rotary_fraction(hf_config) -> float:
    """The share of each head's channels that RoPE rotates (HF partial_rotary_factor, in rope_parameters or at
    the top of the config; Megatron's rotary_percent)."""
    rope = rope_parameters(hf_config)
    return float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def linear_attention_pattern(hf_config) -> list[int]:
    """Megatron's linear_attention_freq as a list: 1 where HF's layer_types says linear_attention."""
    return [int(kind == "linear_attention") for kind in hf_config.layer_types]


def hybrid_config(hf_config, family: Family) -> dict:
    """TransformerConfig's fields of a Qwen3.5 model ({} for the other families): Gated DeltaNet where
    layer_types says linear_attention (its head counts and sizes, conv width), softmax attention with an
    output gate elsewhere, norms scaling by (1 + weight)."""
    if not family.hybrid_linear_attention:
        return {}
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=linear_attention_pattern(hf_config),
                linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
                linear_key_head_dim=hf_config.linear_key_head_dim,
                linear_value_head_dim=hf_config.linear_value_head_dim,
                linear_num_key_heads=hf_config.linear_num_key_heads,
                linear_num_value_heads=hf_config.linear_num_value_heads,
                attention_output_gate=True, layernorm_zero_centered_gamma=True)


def block_type_config(hf_config, family: Family) -> dict:
    """TransformerConfig's fields of a Nemotron-H model ({} for the other families): the Mamba-2 mixers' sizes
    (heads of mamba_head_dim, n_groups of B / C, ssm_state_size, conv width, the scan's chunk), non-gated MLPs and
    experts with the squared ReLU. Its norms' epsilon is layer_norm_epsilon (`transformer_config`)."""
    if not family.block_types:
        return {}
    from megatron.core.activations import squared_relu

    return dict(mamba_num_heads=hf_config.mamba_num_heads, mamba_head_dim=hf_config.mamba_head_dim,
                mamba_num_groups=hf_config.n_groups, mamba_state_dim=hf_config.ssm_state_size,
                gated_linear_unit=False, activation_func=squared_relu)


def check_mla_supported(hf_config, family: Family) -> None:
    """DeepSeek-V3's multi-latent attention as Megatron's MLASelfAttention computes it: the rope dims rotated in
    interleaved pairs (HF rope_interleave, the released checkpoints' layout: Megatron's MLA RoPE de-interleaves
    them the same way; rope_interleave false would need the rope rows permuted), a positive latent width."""
    if getattr(hf_config, "rope_interleave", True) is not True:
        raise ValueError(f"{family.name}: rope_interleave={hf_config.rope_interleave} is not supported; Megatron's "
                         f"multi-latent attention rotates the rope dims in interleaved pairs (rope_interleave true)")
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(hf_config, field, None) or getattr(hf_config, field) < 1:
            raise ValueError(f"{family.name}: {field}={getattr(hf_config, field, None)} must be a positive integer")
    if hf_config.qk_rope_head_dim % 2:
        raise ValueError(f"{family.name}: qk_rope_head_dim={hf_config.qk_rope_head_dim} must be even (RoPE rotates "
                         f"pairs)")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] == "yarn":
        if rope.get("attention_factor") is not None:
            raise ValueError(f"{family.name}: rope_parameters.attention_factor={rope['attention_factor']} is not "
                             f"supported; Megatron derives YaRN's attention factor from factor, mscale and "
                             f"mscale_all_dim")
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            raise ValueError(f"{family.name}: rope_parameters.mscale_all_dim={rope['mscale_all_dim']} without mscale "
                             f"is not supported (transformers' attention factor then ignores mscale_all_dim, "
                             f"Megatron's does not)")
        if rope.get("truncate", True) is not True:
            raise ValueError(f"{family.name}: rope_parameters.truncate={rope['truncate']} is not supported; "
                             f"Megatron rounds YaRN's correction range outward (truncate true)")
        if not rope.get("original_max_position_embeddings"):
            raise ValueError(f"{family.name}: rope_parameters of type yarn lack original_max_position_embeddings")
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        raise ValueError(f"{family.name}: num_key_value_heads={hf_config.num_key_value_heads} must equal "
                         f"num_attention_heads={hf_config.num_attention_heads} (multi-latent attention expands "
                         f"the latent into every head)")


# DeepSeek-V3's router as its config names it: the sigmoid scores (scoring_func) plus the expert bias pick the
# experts by group-limited top-k (topk_method noaux_tc, the released checkpoints'); transformers' model
# computes only this, whatever the config says, so other values are refused rather than silently changed.
SIGMOID_ROUTER = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",)}


def check_sigmoid_router_supported(hf_config, family: Family) -> None:
    """DeepSeek-V3's router as Megatron's (moe_utils.topk_routing_with_score_function, sigmoid): the top-k
    weights renormalised (Megatron always renormalises sigmoid scores when k > 1: norm_topk_prob must be
    true), groups ranked by the sum of their top (topk / topk_group) biased scores (HF: their top 2: the same
    only when num_experts_per_tok / topk_group is 2, DeepSeek-V3's 8 / 4; with every group kept, n_group ==
    topk_group as Moonlight's and Kimi's 1 / 1, the group step changes nothing), shared experts present."""
    for field, allowed in SIGMOID_ROUTER.items():
        value = getattr(hf_config, field, allowed[0])
        if value not in allowed:
            raise ValueError(f"{family.name}: {field}={value!r} is not supported; supported: {list(allowed)}")
    experts, topk = num_experts(hf_config), hf_config.num_experts_per_tok
    if topk > 1 and not getattr(hf_config, "norm_topk_prob", True):
        raise ValueError(f"{family.name}: norm_topk_prob=False is not supported; Megatron's sigmoid router "
                         f"renormalises the top-k weights (norm_topk_prob true)")
    groups, group_topk = getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1
    if experts % groups or not 1 <= group_topk <= groups:
        raise ValueError(f"{family.name}: n_group={groups}, topk_group={group_topk}: n_group must divide "
                         f"n_routed_experts={experts} and 1 <= topk_group <= n_group")
    if group_topk < groups and (topk // group_topk != 2 or experts // groups < 2):
        raise ValueError(f"{family.name}: topk_group={group_topk} with num_experts_per_tok={topk}: Megatron ranks "
                         f"groups by their top num_experts_per_tok // topk_group scores, HF by their top 2; they "
                         f"agree only when that is 2 (or topk_group == n_group)")
    if not getattr(hf_config, "n_shared_experts", 0):
        raise ValueError(f"{family.name}: n_shared_experts={getattr(hf_config, 'n_shared_experts', None)} must be "
                         f"> 0")
    dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    if dense < 0:
        raise ValueError(f"{family.name}: first_k_dense_replace={dense} must be >= 0")


def check_moe_supported(hf_config, family: Family) -> None:
    """An MoE config Megatron builds as transformers does: routed experts in the layers `moe_layer_pattern`
    names (at least one), dense MLPs in the others, a shared expert only where the family has one."""
    step = getattr(hf_config, "decoder_sparse_step", 1)
    if step is not None and (not isinstance(step, int) or step < 1):
        raise ValueError(f"{family.name}: decoder_sparse_step={step!r} must be a positive integer")
    layers = hf_config.num_hidden_layers
    outside = [layer for layer in getattr(hf_config, "mlp_only_layers", None) or () if not 0 <= layer < layers]
    if outside:
        raise ValueError(f"{family.name}: mlp_only_layers names layer {outside[0]}, outside the model's "
                         f"num_hidden_layers={layers}")
    if not any(moe_layer_pattern(hf_config)):
        raise ValueError(f"{family.name}: no layer has routed experts (mlp_only_layers / decoder_sparse_step / "
                         f"first_k_dense_replace leave every layer dense); load it as its dense family")
    experts = num_experts(hf_config)
    if experts < 1 or not 1 <= hf_config.num_experts_per_tok <= experts:
        raise ValueError(f"{family.name}: num_experts={experts}, num_experts_per_tok="
                         f"{hf_config.num_experts_per_tok}: need 1 <= num_experts_per_tok <= num_experts")
    if family.sigmoid_router:
        return check_sigmoid_router_supported(hf_config, family)
    if family.shared_expert and not getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError(f"{family.name}: shared_expert_intermediate_size must be > 0")


def moe_config(hf_config, family: Family, ep: int, te_spec: bool | None = None) -> dict:
    """TransformerConfig's MoE fields for an MoE family ({} for a dense one), as transformers routes:

      * router: logits = x W_gate^T in fp32, softmax over the experts, the top k; with norm_topk_prob the k
        weights are renormalised to sum to 1, which is Megatron's default order (top-k of the logits, then a
        softmax over those k: the same numbers), without it they are the softmax's own (pre-softmax);
      * experts: SwiGLU MLPs of moe_intermediate_size; dropless (no capacity factor), as HF;
      * Qwen2-MoE's shared expert: a dense SwiGLU MLP times sigmoid(x w_gate), added to the routed output
        (moe_shared_expert_gate);
      * the all-to-all token dispatcher (the allgather one refuses variable_seq_lengths, which pipeline stages
        need; megarl/accelerator.py runs the all-to-all one on CPU ranks);
      * dense MLPs (ffn_hidden_size = intermediate_size) in the layers `moe_layer_pattern` says are not MoE
        (moe_layer_freq's list: 0 dense, 1 MoE; `gpt_layer_spec` builds each layer by it);
      * experts whole on their EP rank (expert_tensor_parallel_size 1, as Megatron-LM's large MoE recipes), so
        their conversion is a copy; grouped GEMM where the model takes Transformer Engine's spec (`te_spec`,
        default `transformer_engine_spec`: TEGroupedMLP), else Megatron's SequentialMLP (one GEMM per expert;
        CPU ranks, and LoRA policies, whose adapters hook each expert's own linears).
    The load-balancing loss and the z-loss are off unless the run asks (`model_config_overrides`)."""
    if not family.moe or not any(moe_layer_pattern(hf_config)):  # (a Nemotron-H without MoE blocks)
        return {}
    fields = dict(num_moe_experts=num_experts(hf_config), moe_router_topk=hf_config.num_experts_per_tok,
                  # gpt-oss's experts have the config's one width (no moe_intermediate_size)
                  moe_ffn_hidden_size=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
                  moe_router_score_function="softmax",
                  # Qwen3.5-MoE has no flag: its router always renormalises the top k
                  moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True), moe_router_dtype="fp32",
                  moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=transformer_engine_spec() if te_spec is None else te_spec,
                  expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    pattern = moe_layer_pattern(hf_config)
    if not all(pattern):
        fields["moe_layer_freq"] = [int(is_moe) for is_moe in pattern]
    if family.sigmoid_router:
        return {**fields, **sigmoid_router_config(hf_config)}
    if family.shared_expert:
        fields.update(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return fields


def sigmoid_router_config(hf_config) -> dict:
    """DeepSeek-V3's MoE fields (`check_sigmoid_router_supported` has checked they match HF's router):

      * sigmoid scores; the experts chosen by scores + the router's expert bias (Megatron's `expert_bias`
        buffer, HF's `e_score_correction_bias`), their weights the unbiased scores renormalised, times
        routed_scaling_factor (moe_router_topk_scaling_factor);
      * the expert bias frozen at the checkpoint's values: Megatron's aux-loss-free update (finalize_model_grads:
        bias += rate * sign(mean load - load)) runs with rate 0, so the bias never moves (megarl trains no
        bias; every rank keeps the checkpoint's, and vLLM the same: the weight sync has nothing to send);
      * group-limited top-k (n_group, topk_group) where it selects anything (topk_group < n_group);
      * shared experts: one ungated dense MLP of n_shared_experts * moe_intermediate_size."""
    groups, group_topk = getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1
    grouped = group_topk < groups
    return dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
                moe_router_num_groups=groups if grouped else None, moe_router_group_topk=group_topk if grouped else None,
                # Nemotron-H names the shared expert's width itself
                moe_shared_expert_intermediate_size=getattr(hf_config, "moe_shared_expert_intermediate_size", None)
                or hf_config.moe_intermediate_size * hf_config.n_shared_experts,
                moe_shared_expert_gate=False)


def mla_config(hf_config, family: Family) -> dict:
    """MLATransformerConfig's fields of a DeepSeek-V3 model ({} for the other families): the latent widths, the
    per-head nope / rope / value widths, RoPE over qk_rope_head_dim at the config's theta, plain or YaRN
    (`mla_yarn_config`). kv_channels is the value width: Megatron's local attention shapes its output as
    kv_channels per head."""
    if not family.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=getattr(hf_config, "q_lora_rank", None) or None,
                kv_lora_rank=hf_config.kv_lora_rank, qk_head_dim=hf_config.qk_nope_head_dim,
                qk_pos_emb_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim,
                rotary_base=rope_theta(hf_config), rotary_percent=1.0, kv_channels=hf_config.v_head_dim,
                **mla_yarn_config(hf_config))


# gpt-oss's clamped SwiGLU as transformers and vLLM (`swigluoai`) compute it: both fix the sigmoid's slope,
# vLLM the clamp too; other values are refused (check_gpt_oss_supported)
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def check_gpt_oss_supported(hf_config, family: Family) -> None:
    """gpt-oss as Megatron builds it (`gpt_oss_config`): biases on q/k/v and o_proj, the released SwiGLU values."""
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError(f"{family.name}: attention_bias=False is not supported (Megatron's add_bias_linear gives "
                         f"every linear a bias, as the released models have)")
    for field, value in GPT_OSS_SWIGLU.items():
        if float(getattr(hf_config, field, value)) != value:
            raise ValueError(f"{family.name}: {field}={getattr(hf_config, field)} is not supported; vLLM's gpt-oss "
                             f"activation fixes it at {value}")


def gpt_oss_glu_activation(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), eager: Megatron's quick_gelu, which is torch.compile'd (an inductor build per CPU
    process); on CUDA Megatron's own (its fused bias-GLU kernel takes only that function)."""
    return x * torch.sigmoid(1.702 * x)


def gpt_oss_config(hf_config, family: Family) -> dict:
    """TransformerConfig's gpt-oss fields ({} for the other families): a learned sink logit per head
    (softmax_type "learnable": Megatron's core attention adds it as one more column of each softmax, as
    transformers' `sinks`), and the experts' clamped SwiGLU, gate clamped above at swiglu_limit, up to
    [-limit, limit], out = gate * sigmoid(1.702 gate) * (up + 1) (Megatron's activation_func_clamp_value and
    glu_linear_offset; gate and up de-interleaved by models/fused_experts.py). Biases: add_bias_linear."""
    if not family.gpt_oss:
        return {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(softmax_type="learnable", activation_func_clamp_value=float(hf_config.swiglu_limit),
                glu_linear_offset=1.0, activation_func=quick_gelu if accelerator.ON_CUDA else gpt_oss_glu_activation)


def yarn_get_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-temperature term, 0.1 * mscale * ln(factor) + 1 (1 without scaling): both libraries'."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_yarn_config(hf_config) -> dict:
    """MLA's RoPE fields: plain RoPE (rope_type "rope", no scaling: HF's softmax scale is then 1 / sqrt(qk_nope +
    qk_rope), as Megatron's), or YaRN as transformers computes it for DeepSeek-V3 (rope_type "yarn", the released
    config's: factor 40, original_max_position_embeddings 4096, mscale = mscale_all_dim = 1; Kimi's factor 32):

      * frequencies: both blend the interpolated (1 / factor) and the original ones by the same linear ramp between
        the correction dims of beta_fast and beta_slow (default 32 / 1) over original_max_position_embeddings,
        rounded outward (HF's `truncate`, default true; Megatron's only rounding: false is refused);
      * cos / sin scaled by the attention factor: HF's is get_mscale(factor, mscale) / get_mscale(factor,
        mscale_all_dim) when both are set (non-zero), else get_mscale(factor); Megatron's always the ratio of its
        mscale and mscale_all_dim fields, so a config without both gets mscale 1 and mscale_all_dim 0 (the same
        number); an explicit attention_factor, or mscale_all_dim without mscale, is refused (`check_mla_supported`);
      * the softmax scale times get_mscale(factor, mscale_all_dim)^2 in both (1 where mscale_all_dim is 0)."""
    rope = rope_parameters(hf_config)
    if rope["rope_type"] != "yarn":
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or hf_config.max_position_embeddings / original)
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    both = bool(mscale) and bool(mscale_all_dim)
    return dict(rope_type="yarn", rotary_scaling_factor=factor, original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(mscale) if both else 1.0, mscale_all_dim=float(mscale_all_dim) if both else 0.0)


def yarn_attributes(hf_config, family: Family) -> dict:
    """The TransformerConfig attributes GPTModel's YaRN RoPE reads (position_embedding_type "yarn"; not fields of
    the dataclass: set after construction), {} without YaRN or with multi-latent attention (its own YaRN:
    `mla_yarn_config`). As transformers' yarn for grouped-query attention (Qwen2/3's and Llama's long-context
    setting, gpt-oss's):

      * the frequencies blend the interpolated (1 / factor) and original ones by a linear ramp between the
        correction dims of beta_fast and beta_slow over original_max_position_embeddings, rounded outward where
        `truncate` (default true; Megatron's yarn_correction_range_round_to_int);
      * queries and keys (so cos and sin) scaled by the attention factor: get_mscale(factor, mscale) /
        get_mscale(factor, mscale_all_dim) where both are set, else 0.1 ln(factor) + 1 (Megatron's
        concentration factor does the same with None for the unset ones); the softmax scale is unchanged in
        both. An explicit attention_factor is refused (`check_supported`)."""
    rope = rope_parameters(hf_config)
    if rope["rope_type"] != "yarn" or family.multi_latent_attention:
        return {}
    original = int(rope["original_max_position_embeddings"])
    both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
    return dict(yarn_rotary_scaling_factor=float(rope.get("factor") or hf_config.max_position_embeddings / original),
                yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_mscale=float(rope["mscale"]) if both else None,
                yarn_mscale_all_dim=float(rope["mscale_all_dim"]) if both else None,
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))


def rope_arguments(hf_config) -> tuple[dict, dict | None]:
    """GPTModel's RoPE keyword arguments (YaRN: its own position-embedding type, `yarn_attributes`), and the
    Llama-3 scaling to apply after construction when Megatron's own path cannot take the config's values (else
    None)."""
    scaling = llama3_scaling(hf_config)
    megatron_path = scaling is not None and all(scaling[key] == value
                                                for key, value in MEGATRON_LLAMA3_FIXED.items())
    yarn = rope_parameters(hf_config)["rope_type"] == "yarn" and not family_of(hf_config).multi_latent_attention
    kind = "none" if family_of(hf_config).block_types else "yarn" if yarn else "rope"  # Nemotron-H: no RoPE
    kwargs = dict(rotary_base=rope_theta(hf_config), rope_scaling=megatron_path,
                  rotary_percent=rotary_fraction(hf_config), position_embedding_type=kind)
    if megatron_path:
        kwargs["rope_scaling_factor"] = scaling["factor"]
    return kwargs, (scaling if scaling is not None and not megatron_path else None)


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def check_parallel_sizes(hf_config, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp or groups % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads} "
                         f"and num_key_value_heads={groups} of the model")
    if family_of(hf_config).hybrid_linear_attention:
        linear = (hf_config.linear_num_key_heads, hf_config.linear_num_value_heads)
        if linear[0] % tp or linear[1] % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} must divide linear_num_key_heads={linear[0]} and "
                             f"linear_num_value_heads={linear[1]} of the model (its Gated DeltaNet heads)")
        if cp > 1:
            raise ValueError(f"context_parallel_size={cp}: the {family_of(hf_config).name} family's Gated DeltaNet "
                             f"layers carry a recurrent state along the sequence, which megarl does not split over "
                             f"CP ranks (Megatron-core 0.16 has no GDN context parallelism); use CP 1")
    if family_of(hf_config).block_types and "linear_attention" in hf_config.layers_block_type:
        if hf_config.mamba_num_heads % tp or hf_config.n_groups % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} must divide mamba_num_heads={hf_config.mamba_num_heads}"
                             f" and n_groups={hf_config.n_groups} of the model (its Mamba-2 heads and groups)")
        if cp > 1:
            raise ValueError(f"context_parallel_size={cp}: the {family_of(hf_config).name} family's Mamba-2 layers "
                             f"carry a state along the sequence, which megarl does not split over CP ranks; use CP 1")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} must divide num_hidden_layers="
                         f"{hf_config.num_hidden_layers} of the model")
    # A dense model at EP > 1 (a dense colocated teacher beside an MoE policy) has no experts to split.
    experts = num_experts(hf_config) if family_of(hf_config).moe else None
    if experts is not None and experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide num_experts={experts} of the model")


def _importable(*modules: str) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in modules)


def fusions(on_cuda: bool, transformer_engine: bool, importable=_importable) -> dict:
    """TransformerConfig's fusion switches for this host: Megatron-LM's defaults on CUDA (where its
    `--no-*-fusion` flags are all off) as far as the kernels behind them are there; all off on CPU ranks,
    where the unfused paths are exact and the fused ones are CUDA kernels or torch.compile'd CUDA code.
    `importable(*modules)`: whether those extension modules import (a parameter for the tests).

    On CUDA:
      * bias_activation_fusion (SwiGLU; megarl's models have no linear biases, Megatron's MLP then runs
        the bias-free SwiGLUFunction) and bias_dropout_fusion: torch.compile'd (megatron/core/jit.py), no
        extension needed;
      * apply_rope_fusion: Transformer Engine's fused RoPE (THD and CP included, rope_utils.py:
        apply_rotary_pos_emb); TransformerConfig refuses it without TE (transformer_config.py: "Please
        install TE >= 1.4");
      * masked_softmax_fusion: only the local spec's attention reads it (TE's has its own softmax), and
        FusedScaleMaskSoftmax imports `scaled_masked_softmax_cuda` (Apex / Megatron-LM's compiled
        extension) without checking it exists (fused_softmax.py: is_kernel_available): on where it imports;
      * gradient_accumulation_fusion: the output layer is Megatron's ColumnParallelLinear in either spec,
        and it raises at construction without Apex's `fused_weight_gradient_mlp_cuda`
        (tensor_parallel/layers.py: _grad_accum_fusion_available): on where that imports (the project's
        image removes Apex, so there it stays off);
      * persist_layer_norm stays off: it is Apex's persistent LayerNorm; megarl's models are RMSNorm, and
        the local spec's WrappedTorchNorm asserts it is off (torch_norm.py)."""
    if not on_cuda:
        return dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                    persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    return dict(bias_activation_fusion=True, bias_dropout_fusion=True,
                masked_softmax_fusion=importable("scaled_masked_softmax_cuda",
                                                 "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"),
                persist_layer_norm=False, apply_rope_fusion=transformer_engine,
                gradient_accumulation_fusion=importable("fused_weight_gradient_mlp_cuda"))


def transformer_config(hf_config, family: Family, tp: int, pp: int, cp: int, params_dtype: torch.dtype,
                       ep: int = 1, te_spec: bool | None = None, **overrides):
    """Megatron's TransformerConfig of this model on this host (`fusions`), with EP `ep` for an MoE family
    (`moe_config`), for the layer spec `te_spec` says (default: `transformer_engine_spec` of the family);
    `overrides` are further fields, and win over the host's."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    if te_spec is None:
        te_spec = transformer_engine_spec(local_spec_only(family))
    mla = mla_config(hf_config, family)
    oss = gpt_oss_config(hf_config, family)
    blocks = block_type_config(hf_config, family)
    config_class = MLATransformerConfig if mla else TransformerConfig
    config = config_class(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        # Qwen3.5-MoE's config has no dense width: every layer is an MoE layer
        ffn_hidden_size=getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=mla.pop("kv_channels", head_dim(hf_config)),
        normalization="RMSNorm",
        layernorm_epsilon=getattr(hf_config, "rms_norm_eps", None) or hf_config.layer_norm_epsilon,  # Nemotron-H's
        gated_linear_unit=blocks.pop("gated_linear_unit", True),
        activation_func=oss.pop("activation_func", blocks.pop("activation_func", F.silu)),
        add_bias_linear=family.gpt_oss,
        add_qkv_bias=qkv_bias(hf_config),
        qk_layernorm=qk_layernorm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not accelerator.ON_CUDA,
        # Weights come from a checkpoint right after construction.
        perform_initialization=False,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        # sequence_parallel: off unless overridden (model_config_overrides, from --sequence-parallel).
        **_with_spec_activation({"sequence_parallel": False,
                                 **fusions(accelerator.ON_CUDA, accelerator.transformer_engine_available()),
                                 **moe_config(hf_config, family, ep, te_spec), **hybrid_config(hf_config, family),
                                 **mla, **oss, **blocks, **window_config(hf_config, family),
                                 **_moe_only(overrides, family)}, family, te_spec),
    )
    for name, value in yarn_attributes(hf_config, family).items():  # GPTModel's YaRN reads them off the config
        setattr(config, name, value)
    # Nemotron-H's mixer per layer, for `gpt_layer_spec` (not a TransformerConfig field)
    config.block_types = list(hf_config.layers_block_type) if family.block_types else None
    return config


def _with_spec_activation(fields: dict, family: Family, te_spec: bool) -> dict:
    """`fields` with use_te_activation_func on where the unfused GLU would run: the local spec (`te_spec`
    off), a dense MLP, no bias-activation fusion. There gpt_layer_spec puts megarl's SwiGLU module in the
    spec: Megatron's MLP reads an activation module from its spec only under this flag, whatever its name
    says; with the flag on and no module in the spec it would apply a plain SiLU, so it is never on elsewhere."""
    local_dense_unfused = not family.moe and not fields.get("bias_activation_fusion") and not te_spec
    return {"use_te_activation_func": local_dense_unfused, **fields}


MOE_ONLY_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy")


def _moe_only(overrides: dict, family: Family) -> dict:
    """The overrides without the MoE fields for a dense family (the options are refused with a dense
    model at start, arguments.validate_args; a frozen or dense model built in the same run ignores them)."""
    if family.moe:
        if overrides.get("moe_aux_loss_coeff"):
            overrides = dict(overrides, moe_router_load_balancing_type="aux_loss")
        return overrides
    return {key: value for key, value in overrides.items() if key not in MOE_ONLY_FIELDS}


def model_config_overrides(args) -> dict:
    """TransformerConfig fields of every model on the train ranks (policy, critic, reference, colocated
    teacher) that come from the options: sequence parallelism (arguments turn it off at TP 1) and MoE token
    dropping (--moe-expert-capacity-factor). The frozen models take them too: their micro-batches are the
    policy's, padded for it, and it splits their forward's norm and residual activations the same way; the
    reference drops tokens as the policy does (as verl's and ms-swift's, built from one TransformerConfig)."""
    return dict(sequence_parallel=args.sequence_parallel,
                moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
                moe_token_drop_policy=getattr(args, "moe_token_drop_policy", "probs"))


def capacity_warning(args) -> str | None:
    """The start-of-run line of --moe-expert-capacity-factor: what token dropping costs an RL run."""
    if getattr(args, "moe_expert_capacity_factor", None) is None:
        return None
    return (f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}: the trainer drops the routed tokens "
            f"over each expert's capacity, which the rollout engine computed, so the rollout/trainer mismatch grows "
            f"(watch `mismatch`; --tis-level corrects it) and a token's logprob depends on its micro-batch")


def trainer_config_overrides(args) -> dict:
    """TransformerConfig fields of a trained model (policy, critic) that come from the training options and
    the host: `model_config_overrides`, gradient-accumulation fusion on CPU, the loss normalisation and activation recomputation
    (--recompute-granularity/-method/-num-layers; frozen models run forward-only and never recompute)."""
    # On CPU ranks the trained models' linear layers add each weight gradient into DDP's main_grad inside
    # the GEMM (accelerator._CpuWeightGradientAccumulation): no gradient tensor per weight and micro-batch,
    # no second pass to add it. Only models under DDP have a main_grad, so frozen and bare models keep it off.
    accumulation = {} if accelerator.ON_CUDA else dict(gradient_accumulation_fusion=True)
    return dict(model_config_overrides(args), **accumulation, calculate_per_token_loss=True,
                recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_z_loss_coeff=args.moe_z_loss_coeff or None)


class SequenceParallelRMSNorm:
    """The local spec's norm (Megatron's WrappedTorchNorm: torch's RMSNorm, used where Apex is absent)
    that also takes sequence parallelism. WrappedTorchNorm asserts sequence_parallel is off
    (transformer/torch_norm.py) because it does not mark its weight: under sequence parallelism each TP
    rank's norm sees only its rows of the sequence, so the weight's gradient is partial and must be summed
    over TP, which finalize_model_grads does for parameters marked `sequence_parallel`
    (_allreduce_non_tensor_model_parallel_grads), as Megatron's FusedLayerNorm and TE's norms mark theirs."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm: normalization={config.normalization!r}, not RMSNorm")
        kind = elementwise.ZeroCenteredRMSNorm if config.layernorm_zero_centered_gamma else elementwise.RMSNorm
        norm = kind(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def local_spec_only(family: Family) -> bool:
    """Whether the family's models take the local layer spec on every host (`transformer_engine_spec`'s hybrid)."""
    return family.hybrid_linear_attention or family.multi_latent_attention or family.block_types


def transformer_engine_spec(hybrid: bool = False, lora: bool = False, transformer_engine: bool | None = None) -> bool:
    """Whether a model takes Transformer Engine's layer spec: where TE is installed on a GPU host
    (`transformer_engine`, default this host's), except
      * a hybrid family's (Qwen3.5): TE's norms would centre the gated DeltaNet norm's gamma too (one config
        flag for every norm), which Qwen3.5 does not (its Qwen3_5RMSNormGated scales by weight); and
        DeepSeek-V3's multi-latent attention (`local_spec_only`): TE's MLA spec fuses the latent norms into the up
        projections and keeps the down projections whole (other names and layouts than the family table's);
      * a LoRA policy's (`lora`): the adapters hook Megatron's own column- and row-parallel linears, whose
        input is the normed hidden state; TE's layer-norm-fused linear takes the un-normed one and returns
        only its output. The local spec costs TE's fused norm+GEMM, its fused attention kernels (megarl's
        packed attention runs instead) and its grouped expert GEMM (docs/platform.md, "LoRA on TE hosts").
    Frozen models (reference, colocated teacher) and the critic keep TE's spec on such a host."""
    te = accelerator.transformer_engine_available() if transformer_engine is None else transformer_engine
    return te and not hybrid and not lora


def gpt_layer_spec(config, te_spec: bool | None = None):
    """Transformer Engine's spec where `te_spec` (default `transformer_engine_spec` of the config's family:
    its norms and fused norm-linear layers take sequence parallelism themselves), the local spec otherwise:
    each layer's spec with megarl's core attention and norms, in a block spec whose final norm is megarl's
    too (a layer spec would get Megatron's WrappedTorchNorm there, transformer_block.py: LayerNormImpl)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    dense = dict(num_experts=None, moe_grouped_gemm=False)
    hybrid = config.experimental_attention_variant == "gated_delta_net"
    block_types = getattr(config, "block_types", None)
    if te_spec is None:
        te_spec = transformer_engine_spec(hybrid or config.multi_latent_attention or bool(block_types))
    if te_spec:
        def te_layer(**mlp):
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, **mlp)

        if not isinstance(config.moe_layer_freq, list):
            return te_layer(**moe)
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=_by_moe_pattern(config, te_layer(**moe), te_layer(**dense)),
                                          layer_norm=TENorm)
    from megarl.models.attention import PackedDotProductAttention

    elementwise.install()  # the unfused rotary embedding's fewer-pass version
    mla = bool(config.multi_latent_attention)

    def local_spec(**mlp):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm",
                                                        multi_latent_attention=mla, **mlp)
        layer, attention = spec.submodules, spec.submodules.self_attention.submodules
        attention.core_attention = PackedDotProductAttention  # takes --padding-free rows
        layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
        layer.self_attn_bda = layer.mlp_bda = elementwise.bias_dropout_add
        if config.use_te_activation_func:  # a dense MLP (transformer_config): its SwiGLU from the spec
            layer.mlp.submodules.activation_func = elementwise.SwiGLU
        if mla:  # the two latent norms (over q_lora_rank, kv_lora_rank; MLA's q_layernorm and kv_layernorm)
            attention.q_layernorm = attention.kv_layernorm = LatentRMSNorm
        elif config.qk_layernorm:  # per head, after the gather: summed over TP by name (finalize_model_grads)
            attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
        return spec

    spec = local_spec(**moe)
    layer_specs = [spec] * get_num_layers_to_build(config)
    if block_types:
        layer_specs = block_type_specs(config, local_spec(**dense), local_spec(**moe) if config.num_moe_experts else None)
    elif hybrid:
        layer_specs = _hybrid_layer_specs(config, spec)
    elif isinstance(config.moe_layer_freq, list):
        layer_specs = _by_moe_pattern(config, spec, local_spec(**dense))
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=SequenceParallelRMSNorm)


def _by_moe_pattern(config, moe_spec, dense_spec) -> list:
    """This pipeline stage's layers of a model with dense and MoE layers (DeepSeek-V3's and GLM-4.5's dense
    first layers, Qwen-MoE's mlp_only_layers / decoder_sparse_step): moe_layer_freq's list, 1 MoE, 0 dense."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    pattern = config.moe_layer_freq[offset: offset + get_num_layers_to_build(config)]
    return [moe_spec if is_moe else dense_spec for is_moe in pattern]


# transformers' DeepseekV3Attention builds its two latent norms with DeepseekV3RMSNorm's default epsilon, not
# the config's rms_norm_eps (the original DeepSeek code does the same); vLLM's deepseek_v2 takes rms_norm_eps.
# The released configs differ there (DeepSeek-V3 1e-6, Moonlight 1e-5): megarl follows transformers.
HF_LATENT_NORM_EPS = 1e-6


class LatentRMSNorm:
    """MLA's q / kv latent norm: megarl's RMSNorm (`SequenceParallelRMSNorm`: under sequence parallelism MLA
    normalises the latents of this rank's rows) at transformers' epsilon for these norms."""

    def __new__(cls, config, hidden_size: int, eps: float = HF_LATENT_NORM_EPS, **unused):
        return SequenceParallelRMSNorm(config, hidden_size, eps=HF_LATENT_NORM_EPS)


def _hybrid_layer_specs(config, spec) -> list:
    """This pipeline stage's layers of a Qwen3.5 model: `spec` (gated softmax attention) where the config's
    linear_attention_freq has 0, the same layer with Megatron's GatedDeltaNet (megarl's forward:
    models/gated_delta_net.py) where it has 1."""
    import copy

    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.models.attention import GatedSelfAttention
    from megarl.models.gated_delta_net import GatedDeltaNetNorm, PackedGatedDeltaNet

    softmax = copy.deepcopy(spec)
    softmax.submodules.self_attention.module = GatedSelfAttention
    linear = copy.deepcopy(spec)
    linear.submodules.self_attention = ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=GatedDeltaNetNorm,
                                           out_proj=RowParallelLinear))
    offset = get_transformer_layer_offset(config)
    pattern = config.linear_attention_freq[offset: offset + get_num_layers_to_build(config)]
    return [linear if is_linear else softmax for is_linear in pattern]



def block_type_specs(config, dense_spec, moe_spec) -> list:
    """This pipeline stage's layers of a Nemotron-H model, one mixer each (config.block_types): a Mamba-2 mixer
    (models/mamba_mixer.py) or attention in the attention half with the MLP half an identity; a squared-ReLU MLP or
    MoE in the MLP half with the attention half an identity. An identity half passes the hidden states through
    unchanged (Megatron's IdentityOp and IdentityFuncOp: no norm, no residual added), so each layer is HF's
    `h + mixer(norm(h))`. Attention has no RoPE (GPTModel's position_embedding_type none)."""
    import copy

    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.models.mamba_mixer import PackedMambaMixer

    def without(spec, half: str):
        spec = copy.deepcopy(spec)
        layer = spec.submodules
        if half == "mlp":
            layer.pre_mlp_layernorm, layer.mlp, layer.mlp_bda = IdentityOp, IdentityOp, IdentityFuncOp
        else:
            layer.input_layernorm, layer.self_attention, layer.self_attn_bda = IdentityOp, IdentityOp, IdentityFuncOp
        return spec

    attention = without(dense_spec, "mlp")
    mamba = without(dense_spec, "mlp")
    mamba.submodules.self_attention = ModuleSpec(
        module=PackedMambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    specs = {"linear_attention": mamba, "full_attention": attention, "mlp": without(dense_spec, "attention"),
             "moe": without(moe_spec, "attention") if moe_spec is not None else None}
    offset = get_transformer_layer_offset(config)
    return [specs[kind] for kind in config.block_types[offset: offset + get_num_layers_to_build(config)]]


def whole_sequence(hidden_states: torch.Tensor, config) -> torch.Tensor:
    """The final norm's output [s, b, H] over the whole sequence: under sequence parallelism each TP rank
    holds its s/TP rows, all-gathered here (what Megatron's output layer does to its input). For consumers
    whose gradient is already whole and the same on every TP rank (megarl/kernels all-reduce their
    hidden-state gradient over TP; the critic's replicated value head computes the same loss on every
    rank): the backward keeps this rank's rows of it (tensor_parallel_output_grad=False). An all-reduce
    and a split where a reduce-scatter would do: once per micro-batch, against two of each per layer."""
    if not config.sequence_parallel:
        return hidden_states
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)


def mark_tensor_parallel_weights(model) -> None:
    """Mark each weight of Megatron's own TP layers (VocabParallelEmbedding, Column-/RowParallelLinear) as
    split over TP, along its partition dimension, as their initializers do
    (tensor_parallel/layers.py: _initialize_affine_weight_cpu/_gpu call set_tensor_model_parallel_attributes).
    Those run only with perform_initialization, which megarl turns off (the weights come from a checkpoint);
    unmarked, the grad norm (optimizer.py: get_main_grads_for_grad_norm, param_is_not_tensor_parallel_duplicate)
    counts each such weight as a TP duplicate, from TP rank 0's shard alone: at TP > 1 the norm, and with it
    --clip-grad, was that of a part of the gradient. (Biases are marked at construction; TE's layers mark
    their own weights.) Stride 1: no layer of these models interleaves its partitions."""
    from megatron.core.tensor_parallel import layers, set_tensor_model_parallel_attributes

    dims = ((layers.VocabParallelEmbedding, 0), (layers.ColumnParallelLinear, 0), (layers.RowParallelLinear, 1))
    for module in model.modules():
        dim = next((dim for cls, dim in dims if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
        # gpt-oss's learned sink logits: one per attention head, each TP rank its heads' (core attention)
        sinks = getattr(module, "softmax_offset", None)
        if isinstance(sinks, torch.nn.Parameter) and not hasattr(sinks, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(sinks, True, 0, 1)


def mark_expert_parameters(model) -> None:
    """Mark every routed expert's parameter as Megatron's linears do only at EP > 1 (`allreduce=False`,
    tensor_parallel/layers.py), at any EP: DDP then reduces their gradients over the expert data-parallel
    group (the data-parallel ranks that hold the same experts; at EP 1 the same ranks as before) and the
    optimizer keeps them in its expert part (get_megatron_optimizer: a ChainedOptimizer of the dense and
    the expert parameters). So the optimizer's layout, and with it the checkpoint's, is the same at every
    EP: an EP=2 checkpoint resumes at EP=1 (the experts' own sharded keys already count experts globally)."""
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False


def skip_identity_expert_reduce(model) -> None:
    """Routed experts' linears whose TP group has one rank (expert TP is 1 in megarl) skip their all-reduce over
    it, as Megatron's do at EP > 1 (`explicit_expert_comm`). Why: at EP 1 Megatron's RowParallelLinear passes an
    expert's output through the identity reduce, a custom autograd Function returning its input (a view), and
    Megatron's MLP then adds the experts' bias times the routing probability in place (mlp.py: `output +=
    output_bias * per_token_scale`), which autograd refuses in training ("a view ... modified inplace"): gpt-oss
    (expert biases) could not train at EP 1. The same sums either way (a reduce over one rank is the identity)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and getattr(module, "is_expert", False) \
                and module.tp_group.size() == 1:
            module.explicit_expert_comm = True


def build_gpt_model(hf_config, params_dtype: torch.dtype = torch.float32, divisible_by: int = 128,
                    lora: bool = False, **config_overrides):
    """GPTModel for this rank's pipeline stage, on the platform's device; `lora`: a LoRA policy's, whose
    layers take the local spec on every host (`transformer_engine_spec`).

    Uses Megatron's global parallel state (`init_megatron_parallel` first).
    `config_overrides` are extra TransformerConfig fields.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    accelerator.apply_megatron_shims()
    family = family_of(hf_config)
    check_supported(hf_config, family)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    check_parallel_sizes(hf_config, tp, pp, ep, cp)
    te_spec = transformer_engine_spec(local_spec_only(family), lora)
    config = transformer_config(hf_config, family, tp, pp, cp, params_dtype, ep, te_spec, **config_overrides)
    # Micro-batches differ in length (and, with a token budget, in rows): pipeline stages exchange each
    # activation's shape first. Set after construction: __post_init__ rejects it for an MoE dispatcher
    # setting that dense models never use.
    config.variable_seq_lengths = pp > 1
    rope_kwargs, late_llama3_scaling = rope_arguments(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(config, te_spec),
        vocab_size=padded_vocab_size(hf_config.vocab_size, divisible_by, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **rope_kwargs,
    )
    mark_tensor_parallel_weights(model)
    mark_expert_parameters(model)
    if family.gpt_oss:
        skip_identity_expert_reduce(model)
    if late_llama3_scaling is not None:
        # Megatron's own Llama-3 formula, fed the values its constructor does not pass on.
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **late_llama3_scaling)
    if params_dtype != torch.float32:
        # What Megatron-LM's Float16Module does to the model it wraps (module.bfloat16() / .half()): every
        # parameter in the low precision, the norms too (the local spec builds them in fp32). The wrapper
        # itself is not used: its other effect, casting the last stage's output to fp32, would form an fp32
        # copy of the logits or hidden states that megarl's loss kernels take as they are (computing in fp32
        # chunk by chunk).
        model = model.to(params_dtype)
    return model.to(accelerator.device())
