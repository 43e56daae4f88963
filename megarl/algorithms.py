"""RL algorithms as pure functions, registered under the names their flags take.

Conventions (each one chosen on purpose; see README "Algorithms"):
  * group std is the unbiased (Bessel-corrected) std, as in verl and TRL; a group
    of one sample gets advantage 0 (mean = its reward, nothing to compare with);
  * advantages are divided by (std + eps) with eps = 1e-6;
  * the PPO-clip loss is per token; aggregation happens in the trainer, which
    sums token losses and lets Megatron divide by the global token count.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = {}
POLICY_LOSSES = {}
EPS = 1e-6


def register(registry: dict, name: str):
    def wrap(fn):
        if name in registry:
            raise ValueError(f"{name!r} is already registered")
        registry[name] = fn
        return fn
    return wrap


@register(ADVANTAGE_ESTIMATORS, "grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) per sample; rewards are grouped consecutively.

    scale="none" skips the division (Dr. GRPO).
    """
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        if group_size > 1:
            centred = centred / (groups.std(dim=1, keepdim=True) + EPS)
    elif scale != "none":
        raise ValueError(f"unknown reward scaling {scale!r}")
    return centred.reshape(-1)


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float):
    """Token-level PPO-clip: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)).

    Returns (loss per token, clipped indicator per token).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()
