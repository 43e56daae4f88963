"""Megatron's local attention, taught the packed (THD) format for --padding-free on hosts without
Transformer Engine.

Megatron's `DotProductAttention` refuses `packed_seq_params`; before this module megarl gave a packed
row one dense block-diagonal causal mask instead, which costs T^2 in the row's total length T (16
sequences of 100 tokens: 16x the attention work of the same sequences padded). Here each sequence of
the row runs the unchanged local attention on its own slice ([s_i, 1, heads, dim]; no mask: the
local path builds the causal one), so the work is the sum of s_i^2 and every sequence sees exactly
the computation its own padded row gets. Megatron's attention layer has already applied RoPE per
sequence (its THD path restarts positions at each cu_seqlens boundary) and squeezed the batch
dimension, and it reshapes the [T, 1, hidden] result back.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if packed_seq_params.cu_seqlens_kv.tolist() != bounds:
            raise ValueError("packed sequences: queries and keys must share their boundaries (self-attention)")
        # [t, heads, dim] -> one [s_i, 1, heads, dim] slice per sequence
        return torch.cat([super(PackedDotProductAttention, self).forward(
            query[start:end, None], key[start:end, None], value[start:end, None], None, attn_mask_type)
            for start, end in zip(bounds[:-1], bounds[1:])])
