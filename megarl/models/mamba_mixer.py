"""Mamba-2 mixers (Nemotron-H's `M` layers) on Megatron-core's `MambaMixer`, taught packed rows and CPU ranks.

Nemotron-H's `M` layers (models/families.py, megatron_gpt.block_type_specs; docs/models.md, "Nemotron-H").

Megatron-core 0.16 builds the layer (in_proj over [z, x, B, C, dt], the depthwise conv1d over [x, B, C], dt_bias,
A_log, D, the gated norm's weight, out_proj; their TP split and sharded checkpoint keys); this module replaces
its forward and its norm, for these reasons:

  * Megatron's constructor refuses to build without the `mamba-ssm` package, and its training forward is that
    package's fused Triton kernel (`mamba_split_conv1d_scan_combined`), which cannot run on CPU ranks. Here the
    scan is the chunked state-space-dual form of the Mamba-2 paper (Dao & Gu, 2024, "Transformers are SSMs",
    its minimal listing), written in torch and computed in fp32, as the kernels accumulate;
  * its gated norm is mamba-ssm's `RMSNormGated` (a Triton kernel): here `GatedGroupRMSNorm`, RMSNorm over each
    group of d_inner / ngroups channels of y * silu(z), times the weight (norm_before_gate False, as Megatron
    and Nemotron-H have it). A group is whole on one TP rank (ngroups is split over TP), so the weight is
    sharded with the heads and its gradient needs no TP sum;
  * packed rows (--padding-free): each sequence is laid in a row of its own ([sequences, longest, channels],
    zero past each end; models/gated_delta_net.py's `_rows`), so the conv window and the state start afresh at
    every sequence's first token, as for a sequence alone.

dt = softplus(dt_proj + dt_bias) is not clamped below: Megatron's and vLLM's kernels use no limit. transformers
(5.19) clamps it at time_step_min in its prefill scan only (not in decode); `without_dt_floor` lifts that clamp
(the HF rollout backend, the parity tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.ssm import mamba_mixer as megatron_mamba
from megatron.core.ssm.mamba_mixer import MambaMixer

from megarl.models.gated_delta_net import _rows, _unrows


class GatedGroupRMSNorm(torch.nn.Module):
    """RMSNorm over groups of `group_size` channels of x * silu(gate), times the weight (fp32 inside, as
    mamba-ssm's RMSNormGated and transformers' Zamba2RMSNormGated). Megatron's constructor builds it in place of
    mamba-ssm's with the same arguments."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device=None, dtype=None):
        super().__init__()
        if norm_before_gate:
            raise ValueError("Mamba-2's gated norm: norm_before_gate is not supported (Nemotron-H gates first)")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps, self.group_size = eps, group_size or hidden_size

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight split over TP on its only axis, as Megatron's ExtendedRMSNorm's (each rank its heads' groups):
        a distributed checkpoint then holds every rank's part and reshards it."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if gate is not None:
            x = x * F.silu(gate.float())
        grouped = x.reshape(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (grouped.reshape(x.shape) * self.weight.float()).to(dtype)


# Megatron's constructor checks for mamba-ssm (used only by the forward replaced here) and builds mamba-ssm's gated
# norm under this name: the constructor runs as written, with the torch norm above.
megatron_mamba.HAVE_MAMBA_SSM = True
megatron_mamba.ExtendedRMSNorm = GatedGroupRMSNorm


class PackedMambaMixer(MambaMixer):
    """Megatron's MambaMixer in a TransformerLayer's self-attention place (it takes the attention call's
    arguments), with the torch forward above."""

    def __init__(self, config, submodules, layer_number=None, pg_collection=None, **kwargs):
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        kwargs.pop("attn_mask_type", None)  # given to every self-attention module; a mixer has none
        super().__init__(config, submodules, d_model=config.hidden_size, layer_number=layer_number,
                         pg_collection=pg_collection, **kwargs)
        if self.D_has_hdim:
            raise ValueError("Mamba-2 with a D per channel (D_has_hdim) is not supported; Nemotron-H has one per head")

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None,
                **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("Mamba-2 layers generate through vLLM, not Megatron's inference path")
        if self.cp.cp_size > 1:
            raise NotImplementedError("Mamba-2 layers at context parallel > 1 are not supported")
        mixed, _ = self.in_proj(hidden_states)  # [s, b, local z x B C dt]
        rows, lengths = _rows(mixed, packed_seq_params)
        out = _unrows(self._mix(rows), lengths, mixed.shape[0])
        return self.out_proj(out)

    def _mix(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, L, in_proj channels] (each row one sequence from its first token) -> [n, L, d_inner local]."""
        n, length, _ = rows.shape
        heads, groups, state = self.nheads_local_tp, self.ngroups_local_tp, self.d_state
        z, xbc, dt = torch.split(rows, [self.d_inner_local_tp, self.d_inner_local_tp + 2 * groups * state, heads],
                                 dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=self.d_conv - 1,
                       groups=xbc.shape[-1])[..., :length]
        xbc = F.silu(xbc).transpose(1, 2)
        x, B, C = torch.split(xbc, [self.d_inner_local_tp, groups * state, groups * state], dim=-1)
        x = x.reshape(n, length, heads, self.headdim).float()
        per_group = heads // groups  # head h reads group h // per_group's B and C
        B = B.reshape(n, length, groups, state).float().repeat_interleave(per_group, dim=2)
        C = C.reshape(n, length, groups, state).float().repeat_interleave(per_group, dim=2)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [n, L, heads]
        A = -torch.exp(self.A_log.float())
        y = state_space_dual(x * dt[..., None], A * dt, B, C, self.chunk_size)
        y = y + x * self.D.float()[:, None]
        y = y.reshape(n, length, -1)
        return self.norm(y, z).to(rows.dtype)


def without_dt_floor(model):
    """transformers' model with its Mamba-2 mixers' dt floor lifted (their `time_step_limit`, which its prefill scan
    applies and its decode does not), so that it computes what Megatron and vLLM compute; `model`, returned. Other
    models are unchanged (the HF rollout backend and the parity tests call it on every model)."""
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
    return model


def state_space_dual(x: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mamba-2's scan from a zero state, chunk by chunk: h_t = exp(a_t) h_{t-1} + B_t x_t^T, y_t = h_t C_t.

    x [n, L, heads, dim] (already times dt), a [n, L, heads] (A dt, <= 0), B and C [n, L, heads, state]; returns y
    like x. Within a chunk the output is the quadratic (attention-like) form; the chunks pass their final states on
    through the decays between them. The length is padded with zeros to whole chunks (a = 0 there: after the
    sequence's end, so nothing before it changes)."""
    n, length, heads, dim = x.shape
    pad = (-length) % chunk
    if pad:
        x, a, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, a, B, C))
    chunks = x.shape[1] // chunk
    x, B, C = (t.reshape(n, chunks, chunk, heads, t.shape[-1]) for t in (x, B, C))
    a = a.reshape(n, chunks, chunk, heads).permute(0, 3, 1, 2)  # [n, heads, chunks, chunk]
    a_cumsum = torch.cumsum(a, dim=-1)
    # 1. within each chunk: y_l = sum_{s <= l} C_l . B_s exp(a_{s+1} + ... + a_l) x_s
    decay = torch.exp(_segment_sum(a))  # [n, heads, chunks, l, s]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, decay, x)
    # 2. each chunk's final state from its own inputs
    to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # [n, heads, chunks, chunk]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    # 3. the state entering each chunk: the earlier chunks' states, decayed across the chunks between
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    between = torch.exp(_segment_sum(F.pad(a_cumsum[..., -1], (1, 0))))  # [n, heads, chunks + 1, chunks + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", between, states)[:, :-1]
    # 4. the entering state's contribution to each position of the chunk
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(a_cumsum))
    return y.reshape(n, chunks * chunk, heads, dim)[:, :length]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry (l, s) = a_{s+1} + ... + a_l for s <= l, -inf above the diagonal (so that
    exp gives the decay from position s to l, and 0 where l < s). Sums of differences would lose precision."""
    length = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, length)  # [..., l, s] = a_l
    strictly_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    summed = torch.cumsum(expanded.masked_fill(~strictly_lower, 0), dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return summed.masked_fill(~lower, float("-inf"))

