"""Qwen3.5's Gated DeltaNet layers on Megatron-core's `GatedDeltaNet`, taught packed rows and CPU ranks.

Megatron-core 0.16 builds the layer (its in_proj, depthwise conv1d, A_log, dt_bias, out_norm and out_proj,
their TP split and sharded checkpoint keys); this module replaces only its forward, for three reasons:

  * its forward refuses `packed_seq_params` (--padding-free): here each sequence of a packed row is laid in
    a row of its own ([sequences, longest, channels], zero past each end) and the conv1d and the delta rule
    run over those rows, so the recurrent state and the conv window start afresh at every sequence's first
    token, exactly as for a sequence alone (tests/test_conversion.py checks a packed row against each
    sequence run alone);
  * it calls flash-linear-attention's Triton kernels (l2norm, chunk_gated_delta_rule) even in its
    deterministic mode; on CPU ranks they cannot run, so there the delta rule is Megatron's own torch
    chunked implementation (`torch_chunk_gated_delta_rule`, transformers' algorithm) and the l2norm plain
    torch, as transformers computes it; on CUDA FLA's chunk kernel takes the rows;
  * its gated norm is torch.compile'd (megatron.core.jit), which on CPU would compile with Inductor in every
    process; here it is eager: RMSNorm(x) * silu(gate).

Padding: a padded (not packed) micro-batch is right-padded (model_runner.MicroBatch), so the pads come after
every real token and, the layer being causal, change nothing before them.

The gated norm's weight (one per value-head channel, shared by every head) sees only this TP rank's heads:
its gradient is summed over TP in the backward (`copy_to_tensor_model_parallel_region`), which Megatron's
finalize_model_grads does for q/k norms by name but not for this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as megatron_gdn
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule

from megarl import accelerator
from megarl.models import elementwise

# Megatron's constructor refuses to build the layer without flash-linear-attention, which only its forward
# uses. CPU hosts do not install FLA: transformers 5.19 picks FLA's Triton kernels for Qwen3.5 whenever the
# package imports, whatever the device, and they cannot run on CPU (the HF reference, the HF rollout backend
# and the tiny-model builder would fail). GPU hosts install it (setup.py's gpu extra) and `_delta_rule` uses it.
megatron_gdn.HAVE_FLA = True

L2NORM_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm


class GatedDeltaNetNorm(torch.nn.Module):
    """The output norm over one value head's channels: a plain RMSNorm (weight, not 1 + weight: Qwen3.5's
    Qwen3_5RMSNormGated) whose weight's gradient is summed over TP (each rank normalises its own heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device=accelerator.device()))
        self.eps = eps
        self.tensor_parallel = config.tensor_model_parallel_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tensor_parallel:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight)
        return elementwise.rms_norm(x, weight, self.eps)


class PackedGatedDeltaNet(GatedDeltaNet):
    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("Gated DeltaNet layers generate through vLLM, not Megatron's inference path")
        mixed, _ = self.in_proj(hidden_states)  # [s, b, local channels]; under SP the whole sequence
        rows, lengths = _rows(mixed, packed_seq_params)
        out = _unrows(self._mix(rows), lengths, mixed.shape[0])
        return self.out_proj(out)

    def _mix(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, L, in_proj channels] (each row one sequence from its first token) -> [n, L, value channels]."""
        tp = self.tp_size
        n, length, _ = rows.shape
        qkv, gate, beta, alpha = torch.split(rows, [self.conv_dim_local_tp, self.v_dim // tp,
                                                    self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
        # depthwise causal conv over each row (zeros before its first token), then the activation
        qkv = F.conv1d(qkv.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=self.conv_kernel_dim - 1,
                       groups=self.conv_dim_local_tp)[..., :length]
        qkv = self.act_fn(qkv).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = _l2norm(query.reshape(n, length, -1, self.key_head_dim))
        key = _l2norm(key.reshape(n, length, -1, self.key_head_dim))
        value = value.reshape(n, length, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:  # value head j reads key head j // repeat (as transformers and vLLM)
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # per-head log decay, fp32
        core = _delta_rule(query.contiguous(), key.contiguous(), value.contiguous(), g, beta.sigmoid())
        # gated norm over each value head: RMSNorm(out) * silu(gate), in fp32 for the gate as transformers
        normed = self.out_norm(core.reshape(-1, self.value_head_dim))
        gated = normed * self.act_fn(gate.reshape(-1, self.value_head_dim).float())
        return gated.to(core.dtype).reshape(n, length, -1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _delta_rule(query, key, value, g, beta) -> torch.Tensor:
    """The gated delta rule over [n, L, heads, dim] rows from a zero state: FLA's chunk kernel on CUDA,
    Megatron's torch chunked implementation elsewhere."""
    if accelerator.ON_CUDA and query.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError as error:
            raise ImportError("Gated DeltaNet layers on GPU need flash-linear-attention: pip install fla-core "
                              "(setup.py's gpu extra)") from error

        out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False)
        return out
    out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta)
    return out


def _rows(mixed: torch.Tensor, packed_seq_params) -> tuple[torch.Tensor, list[int] | None]:
    """[s, b, c] -> ([b, s, c], None) for padded rows; for a packed row ([T, 1, c]) one row per sequence,
    zero-padded to the longest ([n, longest, c]), and the sequences' lengths."""
    if packed_seq_params is None:
        return mixed.transpose(0, 1), None
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences in format {packed_seq_params.qkv_format!r}: only 'thd' is supported")
    cu = packed_seq_params.cu_seqlens_q_padded
    bounds = accelerator.packed_bounds(packed_seq_params.cu_seqlens_q if cu is None else cu)
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    pieces = mixed[: bounds[-1], 0].split(lengths)
    return torch.nn.utils.rnn.pad_sequence(list(pieces), batch_first=True), lengths


def _unrows(out: torch.Tensor, lengths: list[int] | None, total: int) -> torch.Tensor:
    """Inverse of `_rows`: [s, b, c]; a packed row's sequences end to end again, then zeros to its `total`
    length where it ran past the last sequence."""
    if lengths is None:
        return out.transpose(0, 1).contiguous()
    pieces = [row[:length] for row, length in zip(out, lengths)]
    if sum(lengths) < total:
        pieces.append(out.new_zeros(total - sum(lengths), out.shape[-1]))
    return torch.cat(pieces).unsqueeze(1)
