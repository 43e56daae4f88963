"""Checkpoints that store a layer's routed experts as one tensor per kind (gpt-oss), read and written as the
per-expert tensors the family tables name.

gpt-oss's checkpoints (transformers' GptOssExperts, its own save format) hold, per MoE layer:

  mlp.experts.gate_up_proj       [E, hidden, 2 * I]  x @ W: gate and up interleaved on the last dim (gate at
                                                     even columns, up at odd ones)
  mlp.experts.gate_up_proj_bias  [E, 2 * I]          interleaved the same way
  mlp.experts.down_proj          [E, I, hidden]      x @ W
  mlp.experts.down_proj_bias     [E, hidden]

megarl's tables (families.py) name each expert's tensors as transformers' nn.Linear layout has them
(`mlp.experts.{e}.gate_proj.weight` [I, hidden], `.up_proj`, `.down_proj` [hidden, I], and their biases), as the
Qwen-MoE checkpoints store them. So one set of expert rules serves both: `PerExpertView` reads a fused checkpoint
as if it held the per-expert tensors (each a slice of the fused one, de-interleaved and transposed), and `fuse`
turns an export stream's per-expert tensors back into the fused ones, a layer's tensor emitted once all of its
experts have passed (the stream carries one layer's experts together: convert.iter_hf_weights's order).
Why not a layout of its own: the export and the weight sync stream one HF tensor per Megatron parameter (each
expert a parameter of its EP rank); a fused tensor is every expert of a layer at once.
"""

from __future__ import annotations

import re

import torch

# per-expert name (after `mlp.experts.{e}.`) -> (the fused tensor's name after `mlp.experts.`, its part)
PARTS = {
    "gate_proj.weight": ("gate_up_proj", "even"), "up_proj.weight": ("gate_up_proj", "odd"),
    "down_proj.weight": ("down_proj", "whole"),
    "gate_proj.bias": ("gate_up_proj_bias", "even"), "up_proj.bias": ("gate_up_proj_bias", "odd"),
    "down_proj.bias": ("down_proj_bias", "whole"),
}
_PER_EXPERT = re.compile(r"(.+\.mlp\.experts\.)(\d+)\.(" + "|".join(re.escape(p) for p in PARTS) + r")")
_FUSED = re.compile(r"(.+\.mlp\.experts\.)(" + "|".join(sorted({f for f, _ in PARTS.values()}, key=len,
                                                              reverse=True)) + r")")


def expert_slice(fused: torch.Tensor, expert: int, part: str) -> torch.Tensor:
    """Expert `expert`'s tensor in nn.Linear's layout from a fused one (weights [E, in, out], biases [E, out])."""
    piece = fused[expert]
    if part != "whole":
        piece = piece[..., 0::2] if part == "even" else piece[..., 1::2]
    return (piece.t() if piece.dim() == 2 else piece).contiguous()


class PerExpertView:
    """An HF checkpoint (convert.HFCheckpoint) whose fused expert tensors read as per-expert ones: `weight_map`
    lists the per-expert names beside the others (the fused ones left out), `get` slices. The fused tensor last
    read is kept, so a layer's experts are read from the file once."""

    def __init__(self, checkpoint, num_experts: int):
        self.checkpoint, self.path = checkpoint, checkpoint.path
        self.weight_map = {}
        for name, file in checkpoint.weight_map.items():
            match = _FUSED.fullmatch(name)
            if match is None:
                self.weight_map[name] = file
                continue
            for suffix, (fused, _) in PARTS.items():
                if fused == match.group(2):
                    self.weight_map.update({f"{match.group(1)}{e}.{suffix}": file for e in range(num_experts)})
        self._kept = (None, None)

    def get(self, name: str) -> torch.Tensor:
        match = _PER_EXPERT.fullmatch(name)
        if match is None or name in self.checkpoint.weight_map:
            return self.checkpoint.get(name)
        fused_name, part = PARTS[match.group(3)]
        fused_name = match.group(1) + fused_name
        if self._kept[0] != fused_name:
            self._kept = (fused_name, self.checkpoint.get(fused_name))
        return expert_slice(self._kept[1], int(match.group(2)), part)


def fuse(stream, num_experts: int):
    """(name, tensor) pairs with each layer's per-expert tensors replaced by the fused ones: a fused tensor is
    yielded when its last part arrives (all experts, both halves of gate_up), in the order its first part came;
    the other pairs pass through as they come. The parts are copied (the stream's tensors may be views of a
    buffer it reuses)."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in stream:
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        fused_name, part = PARTS[match.group(3)]
        fused_name = match.group(1) + fused_name
        parts = pending.setdefault(fused_name, {})
        parts[int(match.group(2)), part] = tensor.detach().clone()
        halves = ("whole",) if part == "whole" else ("even", "odd")
        if len(parts) == num_experts * len(halves):
            yield fused_name, _fused(parts, num_experts, halves)
            del pending[fused_name]
    if pending:
        raise RuntimeError(f"export stream ended with experts missing from {sorted(pending)}")


def _fused(parts: dict, num_experts: int, halves: tuple[str, ...]) -> torch.Tensor:
    """[E, in, out] (or [E, out] for biases) from each expert's nn.Linear-layout tensors, gate and up
    interleaved on the last dim."""
    experts = []
    for expert in range(num_experts):
        pieces = [parts[expert, half] for half in halves]
        pieces = [piece.t() if piece.dim() == 2 else piece for piece in pieces]
        experts.append(pieces[0] if len(pieces) == 1 else torch.stack(pieces, dim=-1).flatten(-2))
    return torch.stack(experts)
