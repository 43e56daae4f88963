"""Actor role: the policy being trained (Megatron GPTModel + DDP + Adam), on the train ranks.

Verbs: `logprobs` (before the update, with the exact KL to the reference when
--kl-estimator full), `train_step` (one optimizer step of the composed loss; in
the on-policy shortcut its forward also stands in for `logprobs`: old = new,
and the rollout mismatch and TIS weights come from it, per micro-batch),
`hf_weights` (the weights in HF names and layout, for the sync and exports),
and from `TrainableModel` offload/onload and checkpoint state.

The loss is its own object (megarl/loss.py: ActorLoss, composed from the algorithm
registries' functions); `train_step` decides which terms it holds and which
full-vocabulary companions (reference, teacher logits) run beside each micro-batch.
"""

from __future__ import annotations

import contextlib

import torch

from megarl import kernels, routing_replay
from megarl.loss import ActorLoss, LossTerms, full_kl
from megarl.model_runner import MicroBatch, SampledLogprobs, TrainableModel, output_weight, response_aligned
from megarl.models.convert import iter_hf_weights, load_hf_weights
from megarl.models.megatron_gpt import DTYPES, build_gpt_model, trainer_config_overrides


class Actor(TrainableModel, SampledLogprobs):
    def __init__(self, args, hf_config):
        self.args, self.hf_config = args, hf_config
        module = build_gpt_model(hf_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by,
                                 lora=bool(args.lora_rank), **trainer_config_overrides(args))
        load_hf_weights(module, args.model, hf_config)
        if args.lora_rank:  # the base frozen before DDP and the optimizer see it: they keep nothing for it
            from megarl.models.lora import apply_lora, lora_config

            apply_lora(module, hf_config, lora_config(args, hf_config), args.seed)
            if args.lora_load:  # a trained adapter to start from (a resume's checkpoint overwrites it later)
                from megarl.models.lora import load_peft_adapter

                load_peft_adapter(module, args.lora_load)
        if args.routing_replay == "on":  # the routers take the rollout's routes (megarl/routing_replay.py)
            routing_replay.install_on_model(module)
        super().__init__(module, args, args.lr, args.offload_model, args.offload_optimizer)

    def logprobs(self, micro_batches: list[MicroBatch], width: int,
                 full_kl_to=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned [n, width] logprobs of the sampled tokens under the current policy; with
        `full_kl_to` (the Reference) also the exact per-token KL(pi || ref) over the vocabulary. With routing
        replay, how often the policy's own routing differs from the rollout's is counted here
        (`routing_metrics`): these are the weights the rollout sampled with."""
        routing_replay.measure(self.model, True)
        try:
            return self._logprobs(micro_batches, width, full_kl_to)
        finally:
            routing_replay.measure(self.model, False)

    def routing_metrics(self) -> dict:
        """routing_replay_flip of the last `logprobs` (or on-policy `train_step`); {} without routing replay.
        Collective over the train ranks."""
        return routing_replay.routing_metrics(self.model)

    def _logprobs(self, micro_batches: list[MicroBatch], width: int,
                  full_kl_to) -> tuple[torch.Tensor, torch.Tensor | None]:
        if full_kl_to is None:
            return self.sampled_logprobs(micro_batches, width), None

        def both(batch, logits, companion_outputs):
            return (kernels.token_logprobs(logits, batch.labels, self.hf_config.vocab_size, self.args.temperature,
                                           self.args.kernels, held_back=batch.held_back()),
                    full_kl(self.args, self.hf_config.vocab_size, logits, companion_outputs["ref"], batch.held_back()))

        with full_kl_to.resident():
            outputs = self.forward_only(micro_batches, both, companions={"ref": full_kl_to})
        return (response_aligned(micro_batches, [o[0] for o in outputs], width),
                response_aligned(micro_batches, [o[1] for o in outputs], width))

    def train_step(self, micro_batches: list[MicroBatch], kl_coef: float = 0.0, reference=None,
                   teacher=None, on_policy: bool = False, sft: bool = False) -> dict:
        """One optimizer step over these micro-batches (this rank's share of a mini-batch).

        kl_coef > 0 (with the reference) adds kl_coef * KL(pi || ref) per token to the loss;
        distillation adds --distill-coef times the GKD loss (top-k from the batch's teacher
        fields, or full vocabulary from the colocated teacher's logits beside each micro-batch).
        `on_policy` (batch.two_pass_reason is None; the micro-batches carry no old logprobs):
        the old logprobs are this forward's own, detached, and the mismatch metrics and TIS
        weights are computed here as `phases.prepare` would have from them.
        `sft` (--sft-alpha, a step on the dataset's or the teacher's responses): adds --sft-alpha times the
        responses' cross-entropy (ms-swift's GKD sft_alpha).
        """
        args = self.args
        kl_in_loss = kl_coef > 0 and reference is not None
        # A distillation term (not only its policy-gradient form): top-k from the batch's teacher
        # fields (either teacher placement), full vocabulary from the colocated teacher's logits.
        distill = bool(args.distill_coef) and (micro_batches[0].teacher_topk_ids is not None or
                                                (teacher is not None and not args.gkd_logits_topk))
        companions = {}
        if kl_in_loss and args.kl_estimator == "full":
            companions["ref"] = reference
        if distill and not args.gkd_logits_topk:
            companions["teacher"] = teacher
        # Without full-vocabulary companions the model's output is its final hidden states and the fused
        # kernels form each chunk of logits from them: the logits are never held.
        hidden = args.kernels != "naive" and not companions
        loss = ActorLoss(args, self.hf_config.vocab_size,
                         LossTerms(kl_coef if kl_in_loss else 0.0, distill, on_policy, hidden,
                                   sft=sft and args.sft_alpha > 0),
                         output_weight=lambda: output_weight(self.model))
        routing_replay.measure(self.model, on_policy)  # the on-policy forward stands in for `logprobs`
        with contextlib.ExitStack() as stack:
            for role in companions.values():
                stack.enter_context(role.resident())
            sums, grad_norm = self.optimizer_step(
                micro_batches, loss, companions=companions, hidden=hidden)
        routing_replay.measure(self.model, False)
        routing = self.routing_metrics() if on_policy else {}
        return {**loss.metrics(sums, grad_norm, self.lr), **self.moe_losses, **routing}

    def hf_weights(self, bucket_bytes: int):
        """What the weight sync sends (policy_weights); collective over the train ranks."""
        return policy_weights(self.model, self.hf_config, self.args, bucket_bytes)


def policy_weights(model, hf_config, args, bucket_bytes: int):
    """(HF name, tensor) pairs of the whole policy (with LoRA, the adapters merged), or with --lora-sync adapter
    of its adapters only, in PEFT's names (the engine serves them on its unchanged base: RolloutEngine)."""
    if args.lora_rank and args.lora_sync == "adapter":
        from megarl.models.lora import iter_peft_weights

        return iter_peft_weights(model, bucket_bytes)
    return iter_hf_weights(model, hf_config, bucket_bytes)
