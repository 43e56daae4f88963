"""Reference role: the frozen policy a KL term measures against (built only when --kl-coef > 0).

Full training: a Megatron GPTModel on the train ranks with the trainer's TP, loaded from
--ref-model, without DDP or optimizer. It waits in host memory between its
forwards (megarl/offload.py) and is not checkpointed: it is rebuilt exactly from
--ref-model.

LoRA (--lora-rank > 0): the policy's base weights are frozen, so the reference is the policy's
own model with its adapters switched off (`BaseOfPolicy`): no second copy of the weights.
"""

from __future__ import annotations

import contextlib

import torch

from megarl.model_runner import FrozenModel, MicroBatch, last_stage_outputs, run_model


class Reference(FrozenModel):
    def __init__(self, args, hf_config):
        super().__init__(args, hf_config, args.ref_model, offload=True, replay_routes=args.routing_replay == "on")

    def logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """Response-aligned [n, width] logprobs of the sampled tokens under the reference."""
        return self.sampled_logprobs(micro_batches, width)


class BaseOfPolicy:
    """The reference of a LoRA run: the actor's model with its adapters off. The same verbs as
    `Reference`; it holds no weights, so `resident` and offload have nothing to move (the actor's
    model is on the device whenever the actor runs)."""

    def __init__(self, actor):
        self.actor = actor

    def logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.actor.model):
            return self.actor.sampled_logprobs(micro_batches, width)

    @torch.no_grad()
    def logits(self, batch: MicroBatch) -> torch.Tensor:
        """This TP rank's vocabulary shard of the base model's logits of the micro-batch."""
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.actor.model):
            return run_model(self.actor.model, batch)

    def companion_logits(self, batch: MicroBatch) -> torch.Tensor:
        return self.logits(batch)

    @torch.no_grad()
    def pipelined_companion_logits(self, micro_batches: list[MicroBatch]) -> list:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.actor.model):
            return last_stage_outputs(self.actor.model, micro_batches, self.actor.args.micro_batch_size,
                                      lambda i, part, logits: logits)

    @contextlib.contextmanager
    def resident(self):
        yield self

    def offload(self) -> None:
        pass

    def onload(self) -> None:
        pass


def build_reference(args, hf_config, actor):
    """The reference this run needs (--kl-coef > 0): the policy's base with LoRA, else a model of its own."""
    return BaseOfPolicy(actor) if args.lora_rank else Reference(args, hf_config)
