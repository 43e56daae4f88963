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

With context parallelism (megarl/context_parallel.py) a rank holds two chunks of each sequence's
slot: the keys and values of the whole slots are gathered over the CP group (the backward sums
their gradients back to the ranks that hold them), and the rank's queries attend to them under the
causal mask of their places in the sequence. This is all-gather context parallelism (TE's
`cp_comm_type="all_gather"`), not TE's ring; on CPU hosts it is what lets CP run at all.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl import context_parallel


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        # Megatron's local attention asserts CP == 1 when built; the packed path below does CP itself.
        cp, config.context_parallel_size = config.context_parallel_size, 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cp = self.config.context_parallel_size
        if packed_seq_params is None:
            if cp > 1:
                raise ValueError("context parallelism needs packed sequences (--padding-free)")
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
        bounds = _bounds(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded)
        if _bounds(packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_kv_padded) != bounds:
            raise ValueError("packed sequences: queries and keys must share their boundaries (self-attention)")
        if cp > 1:
            return self._context_parallel(query, key, value, bounds, cp, attn_mask_type)
        # [t, heads, dim] -> one [s_i, 1, heads, dim] slice per sequence
        return torch.cat([super(PackedDotProductAttention, self).forward(
            query[start:end, None], key[start:end, None], value[start:end, None], None, attn_mask_type)
            for start, end in zip(bounds[:-1], bounds[1:])])

    def _context_parallel(self, query, key, value, bounds, cp, attn_mask_type):
        """This rank's two chunks of each slot (`bounds`: the whole slots) against the whole slot's keys."""
        from megatron.core import parallel_state

        slots = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        key, value = context_parallel.gather(key, slots, dim=0), context_parallel.gather(value, slots, dim=0)
        rank = parallel_state.get_context_parallel_rank()
        outputs, local_start = [], 0
        for slot, start in zip(slots, bounds[:-1]):
            places = context_parallel.local_positions([slot], cp, rank).to(query.device)
            # True = masked: keys after the query's own place in the sequence.
            masked = places[:, None] < torch.arange(slot, device=query.device)[None, :]
            local = slice(local_start, local_start + slot // cp)
            outputs.append(super().forward(query[local, None], key[start:start + slot, None],
                                           value[start:start + slot, None], masked[None, None], attn_mask_type))
            local_start += slot // cp
        return torch.cat(outputs)


def _bounds(cu_seqlens, cu_seqlens_padded) -> list[int]:
    """The slots' boundaries: the padded ones where given (context parallelism), else the sequences'."""
    return (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).tolist()
