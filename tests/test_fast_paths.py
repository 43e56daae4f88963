"""The trainer's speed paths on CPU hosts (issue 28) compute what the plain paths compute, within fp32 rounding:
torch's fused Adam against its per-parameter loop. In-process, one Megatron rank."""

from __future__ import annotations

import torch

from helpers import assert_fp32_paths_agree, micro_batches, nll


def actor_of(model: str):
    from transformers import AutoConfig

    from megarl.actor import Actor
    from megarl.arguments import parse_args

    args = parse_args(["--model", model, "--lr", "1e-2", "--micro-batch-size", "2"], world_size=1)
    return Actor(args, AutoConfig.from_pretrained(model))


def adam_groups(optimizer):
    return [group for part in getattr(optimizer, "chained_optimizers", [optimizer])
            for group in part.optimizer.param_groups]


def test_cpu_adam_is_torchs_fused_kernel_and_steps_as_its_loop(megatron_rank, tiny_model, monkeypatch):
    from megarl import accelerator

    fused = actor_of(tiny_model)
    assert adam_groups(fused.optimizer) and all(group["fused"] for group in adam_groups(fused.optimizer))
    monkeypatch.setattr(accelerator, "fuse_torch_adam", lambda optimizer: 0)
    loop = actor_of(tiny_model)
    assert not any(group["fused"] for group in adam_groups(loop.optimizer))
    before = {name: param.detach().clone() for name, param in fused.model.named_parameters()}
    batches = micro_batches(seed=1)
    for actor in (fused, loop):  # one step: the same gradients, then each Adam's update
        actor.optimizer_step(batches, nll)
    named = dict(loop.model.named_parameters())
    for name, param in fused.model.named_parameters():
        assert not torch.equal(param, before[name]), f"{name} did not move"
        assert_fp32_paths_agree(param.detach(), named[name].detach(), name)
