"""Where each tensor of megarl's weight stream lands in a transformers model in memory (the HF rollout backend's
weight sync, megarl/hf_rollout.py).

The stream names tensors as checkpoints do (the family tables, families.py). transformers 5 keeps some of them in
another layout in memory than on disk, and converts at load time with its own table
(transformers.conversion_mapping): the routed experts of Qwen2/3-MoE, Qwen3.5-MoE, DeepSeek-V3 and GLM-4.5 are
stored per expert (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj`) and held fused
(`mlp.experts.gate_up_proj` [E, 2I, H]: the experts stacked, gate then up; `mlp.experts.down_proj` [E, H, I]).
`InMemoryLayout` reads that same table (its converters that stack a module list on dim 0 and concatenate the
sources on dim 1) and writes each per-expert tensor into its slice of the fused parameter in place, so no layer's
experts are gathered first. A converter of another shape is not followed: its tensors are named as unknown by the
sync, in one line. tests/test_hf_rollout.py checks the result against transformers' own loading of the checkpoint.

The targets are the parameters and the persistent buffers (DeepSeek-V3's and GLM-4.5's `e_score_correction_bias`:
not trained, but the trainer's checkpoint may carry another one than the rollout model's, and the router reads it).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch


class InMemoryLayout:
    def __init__(self, model: torch.nn.Module):
        state = set(model.state_dict())
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.targets.update((name, buffer) for name, buffer in model.named_buffers() if name in state)
        self._rules = _stacked_expert_rules(model)
        self._written: dict[str, int] = defaultdict(int)

    def view(self, name: str) -> tuple[str, torch.Tensor] | None:
        """(target name, the tensor or slice the streamed `name` is copied into), or None if it has no place."""
        if name in self.targets:
            return name, self.targets[name]
        for pattern, target, slot in self._rules:
            match = pattern.fullmatch(name)
            if match is None:
                continue
            fused_name = match["prefix"] + target
            fused = self.targets.get(fused_name)
            if fused is None:
                return None
            expert = fused[int(match["expert"])]
            if slot is None:
                return fused_name, expert
            size = expert.shape[0] // slot[1]
            return fused_name, expert.narrow(0, slot[0] * size, size)
        return None

    def begin(self) -> None:
        self._written.clear()

    def wrote(self, target_name: str, numel: int) -> None:
        self._written[target_name] += numel

    def unwritten(self) -> list[str]:
        """The targets not wholly written since begin() (a fused tensor counts its experts' slices)."""
        return sorted(name for name, tensor in self.targets.items() if self._written[name] < tensor.numel())


def _stacked_expert_rules(model) -> list[tuple[re.Pattern, str, tuple[int, int] | None]]:
    """From transformers' conversion table for `model`: (pattern of a per-expert name with groups prefix and
    expert, the fused tensor's name after the prefix, (slot, slots) of a concatenation or None)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    rules = []
    for transform in get_model_conversion_mapping(model):
        if not isinstance(transform, WeightConverter) or len(transform.target_patterns) != 1:
            continue
        ops = transform.operations
        stacked = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        concatenated = len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1
        if not stacked or len(ops) > 1 + concatenated:
            continue
        sources = transform.source_patterns
        for slot, source in enumerate(sources):
            if source.count("*") != 1:
                continue
            body = re.escape(source).replace(r"\*", r"(?P<expert>\d+)")
            rules.append((re.compile(r"(?P<prefix>(?:.*\.)?)" + body), transform.target_patterns[0],
                          (slot, len(sources)) if concatenated else None))
    return rules
