"""Build a Megatron-core GPTModel that mirrors an HF causal-LM config."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl import platform
from megarl.models.families import Family, family_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of divisible_by * TP so every shard is equal."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def rope_theta(hf_config) -> float:
    # transformers 5 keeps it in rope_parameters; older configs at the top level.
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def check_parallel_sizes(hf_config, tp: int, pp: int) -> None:
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % tp or groups % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide num_attention_heads={heads} "
                         f"and num_key_value_heads={groups} of the model")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size={pp} must divide num_hidden_layers="
                         f"{hf_config.num_hidden_layers} of the model")


def transformer_config(hf_config, family: Family, tp: int, pp: int, cp: int, params_dtype: torch.dtype,
                       **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        # Fusions are CUDA kernels; the unfused paths are exact and run anywhere.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=False,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not platform.ON_CUDA,
        # Weights come from a checkpoint right after construction.
        perform_initialization=False,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        **overrides,
    )


def build_gpt_model(hf_config, params_dtype: torch.dtype = torch.float32, divisible_by: int = 128,
                    **config_overrides):
    """GPTModel for this rank's pipeline stage, on the platform's device.

    Uses Megatron's global parallel state (`init_megatron_parallel` first).
    `config_overrides` are extra TransformerConfig fields.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    platform.apply_megatron_shims()
    family = family_of(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    check_parallel_sizes(hf_config, tp, pp)
    config = transformer_config(hf_config, family, tp, pp, cp, params_dtype, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=platform.gpt_layer_spec(qk_layernorm=family.qk_layernorm),
        vocab_size=padded_vocab_size(hf_config.vocab_size, divisible_by, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    return model.to(platform.device())
