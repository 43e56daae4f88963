"""Megatron's local attention, taught the packed (THD) format for --padding-free on hosts without
Transformer Engine.

Megatron's `DotProductAttention` refuses `packed_seq_params`; before this module megarl gave a packed
row one dense block-diagonal causal mask instead, which costs T^2 in the row's total length T (16
sequences of 100 tokens: 16x the attention work of the same sequences padded). Here each sequence of
the row runs the unchanged local attention on its own slice ([s_i, 1, heads, dim]; no mask: the
local path builds the causal one), so the work is the sum of s_i^2 and every sequence sees exactly
the computation its own padded row gets. Where it is the same computation (causal, the plain softmax,
no attention dropout: every model megarl converts) each sequence runs torch's
scaled_dot_product_attention instead of the local attention's matmuls, mask and softmax (on CPU a flash
kernel, 1.4x faster on the bench job's rows; issue 28), or, on CPU ranks at the lengths where it was
measured faster, megarl's own GEMM-based causal attention (`_ShortCausalAttention`,
`_BlockedCausalAttention`, below; megarl/models/attention_paths.py). Megatron's attention layer has
already applied RoPE per sequence (its THD path restarts positions at each cu_seqlens boundary) and
squeezed the batch dimension, and it reshapes the [T, 1, hidden] result back.

With context parallelism (megarl/context_parallel.py) a rank holds two chunks of each sequence's
slot: the keys and values of the whole slots are gathered over the CP group (the backward sums
their gradients back to the ranks that hold them), and the rank's queries attend to them under the
causal mask of their places in the sequence. This is all-gather context parallelism (TE's
`cp_comm_type="all_gather"`), not TE's ring; on CPU hosts it is what lets CP run at all.

Sliding-window layers (Qwen2/3's use_sliding_window; megatron_gpt.window_config sets config.window_size for
them) keep Megatron's local attention on every path: padded rows and each sequence of a packed row get its
softmax's windowed causal mask; under context parallelism the window joins the explicit mask.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megarl import accelerator, context_parallel
from megarl.models import attention_paths
from megarl.models.causal_attention import run_path


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        # Multi-latent attention (DeepSeek-V3) passes its key and value widths (k_channels: qk_nope + qk_rope,
        # v_channels: v_head_dim), which Megatron's local attention does not take (TE's does): its matmuls read
        # them off the tensors, and its output width is kv_channels per head, which megarl's MLA config sets to
        # v_head_dim (megatron_gpt.mla_config).
        # Megatron's local attention asserts CP == 1 when built; the packed path below does CP itself.
        cp, config.context_parallel_size = config.context_parallel_size, 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp
        # A sliding-window layer (config.window_size for this layer: megatron_gpt.window_config): the softmax
        # builds the windowed causal mask itself (fused_softmax.py: forward_torch_softmax, in place of any mask
        # passed in). Its fused CUDA kernels would not: the causal one (ScaledUpperTriangMaskedSoftmax) ignores
        # the window, so they stay off for such a layer.
        self.window_size = self.scale_mask_softmax.window_size
        if self.window_size is not None:
            self.scale_mask_softmax.scaled_masked_softmax_fusion = False

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
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        if self._fused_attention_applies(attn_mask_type):
            return self._fused_per_sequence(query, key, value, lengths)
        # [t, heads, dim] -> one [s_i, 1, heads, dim] piece per sequence (split, not slices: the backward of a
        # split is one concatenation, that of a slice a zero tensor of the whole row per sequence)
        return torch.cat([super(PackedDotProductAttention, self).forward(q[:, None], k[:, None], v[:, None], None,
                                                                         attn_mask_type)
                          for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))])

    def _fused_attention_applies(self, attn_mask_type) -> bool:
        """Whether torch's scaled_dot_product_attention computes exactly what Megatron's local attention does
        here: causal, the plain softmax at this module's scale, no attention dropout while training."""
        config = self.config
        # a sliding-window layer keeps the local attention (per sequence: its softmax's windowed mask); torch's
        # kernel and megarl's GEMM paths compute full causal attention
        return (self.window_size is None
                and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
                and getattr(config, "softmax_type", "vanilla") == "vanilla"
                and not config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0))

    def _fused_per_sequence(self, query, key, value, lengths):
        """Each sequence's causal attention in one call: torch's scaled_dot_product_attention (on CPU its flash
        kernel: no [s, s] scores, masks or softmax tensors kept for the backward; queries' head groups share
        their key/value heads, as Megatron's repeat_interleave does), or, on a CPU rank (fp32),
        `_ShortCausalAttention` or `_BlockedCausalAttention` where megarl/models/attention_paths.py measured
        them faster at the sequence's length with the rank's GEMM library. Measured on the bench job's rows
        (16 sequences of 80-200 tokens, 8 heads of 64, 2 groups, one thread): 67 ms forward and backward per
        layer against 95 ms for the local attention per sequence; the outputs agree within fp32 rounding."""
        heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
        # megarl's own CPU paths take one width for queries, keys and values; MLA's values are narrower
        measured = _cpu_fp32(query) and value.shape[-1] == query.shape[-1]
        outputs = []  # [s_i, heads, dim] each
        for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
            path = attention_paths.path_for(q.shape[0], heads, groups, dim) if measured else "flash"
            outputs.append(run_path(path, q, k, v, self.softmax_scale))
        # -> [t, 1, heads * dim], the local attention's output layout
        return torch.cat(outputs).reshape(query.shape[0], 1, -1)

    def _context_parallel(self, query, key, value, bounds, cp, attn_mask_type):
        """This rank's two chunks of each slot (`bounds`: the whole slots) against the whole slot's keys."""
        from megatron.core import parallel_state

        slots = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        key, value = context_parallel.gather(key, slots, dim=0), context_parallel.gather(value, slots, dim=0)
        rank = parallel_state.get_context_parallel_rank()
        outputs, local_start = [], 0
        for slot, start in zip(slots, bounds[:-1]):
            places = context_parallel.local_positions([slot], cp, rank).to(query.device)
            keys = torch.arange(slot, device=query.device)[None, :]
            # True = masked: keys after the query's own place in the sequence; in a sliding-window layer also
            # those more than window_size[0] before it (transformers' window: megatron_gpt.window_config)
            masked = places[:, None] < keys
            if self.window_size is not None:
                masked |= keys < places[:, None] - self.window_size[0]
            local = slice(local_start, local_start + slot // cp)
            with self._explicit_mask():
                outputs.append(super().forward(query[local, None], key[start:start + slot, None],
                                               value[start:start + slot, None], masked[None, None], attn_mask_type))
            local_start += slot // cp
        return torch.cat(outputs)

    @contextlib.contextmanager
    def _explicit_mask(self):
        """The softmax takes the mask passed in: in a sliding-window layer it would replace it with its own
        windowed mask (fused_softmax.py: forward_torch_softmax), laid out for queries at the end of the keys
        (bottom-right), which a CP rank's two chunks are not; the context-parallel path folds the window into
        its mask instead."""
        softmax = self.scale_mask_softmax
        window, softmax.window_size = softmax.window_size, None
        try:
            yield
        finally:
            softmax.window_size = window


class GatedSelfAttention(SelfAttention):
    """Megatron's SelfAttention (Qwen3.5's full-attention layers: attention_output_gate, out * sigmoid(gate))
    whose output gate runs eagerly on CPU ranks, where Megatron's torch.compile'd one (megatron.core.jit) would
    compile with Inductor in every process; on CUDA Megatron's own."""

    def _apply_output_gate(self, x, gate):
        if accelerator.ON_CUDA:
            return super()._apply_output_gate(x, gate)
        return (x * torch.sigmoid(gate.contiguous().view(*x.shape).float())).to(x.dtype)


def _cpu_fp32(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype == torch.float32


def _bounds(cu_seqlens, cu_seqlens_padded) -> list[int]:
    """The slots' boundaries: the padded ones where given (context parallelism), else the sequences'; from the
    host copy megarl's micro-batches carry (no sync per layer)."""
    return accelerator.packed_bounds(cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)
