"""Actor role: the policy being trained (Megatron GPTModel + DDP + Adam), on the train ranks.

Verbs: `logprobs` (before the update, with the exact KL to the reference when
--kl-estimator full), `train_step` (one optimizer step of the composed loss; in
the on-policy shortcut its forward also stands in for `logprobs`: old = new,
and the rollout mismatch and TIS weights come from it, per micro-batch),
`hf_weights` (the weights in HF names and layout, for the sync and exports),
and from `TrainableModel` offload/onload and checkpoint state.

The loss per token is composed from the algorithm registries' functions, the
ones the formula tests check:

    POLICY_LOSSES[--policy-loss]  (x importance weight with TIS)
    x --policy-loss-coef
    + --distill-coef x GKD (algorithms GKD_TOPK_MODES / distill_full)  with a teacher
    + kl_penalty_in_loss(KL(pi || ref), coef)      when --kl-placement loss
    + entropy_bonus(entropy, --entropy-coef)
    -> LOSS_AGGREGATIONS[--loss-agg] -> (numerator, units)

Logprobs, entropy, the full KL and the distillation losses go through the fused
kernels (megarl/kernels, --kernels): vocabulary-parallel, and from the final hidden
states and the output weight whenever no full-vocabulary companion (reference or
teacher logits) is needed, so the [tokens, V/TP] logits are never formed.
"""

from __future__ import annotations

import contextlib

import torch

from megarl import batch as batching, kernels
from megarl.kernels import naive
from megarl.algorithms import (KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, entropy_bonus,
                               kl_penalty_in_loss)
from megarl.model_runner import MicroBatch, SampledLogprobs, TrainableModel, output_weight, response_aligned
from megarl.models.convert import iter_hf_weights, load_hf_weights
from megarl.models.megatron_gpt import DTYPES, build_gpt_model, trainer_config_overrides


class Actor(TrainableModel, SampledLogprobs):
    def __init__(self, args, hf_config):
        self.args, self.hf_config = args, hf_config
        module = build_gpt_model(hf_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by,
                                 **trainer_config_overrides(args))
        load_hf_weights(module, args.model, hf_config)
        super().__init__(module, args, args.lr, args.offload_model, args.offload_optimizer)
        self.policy_loss = POLICY_LOSSES[args.policy_loss]
        self.aggregate = LOSS_AGGREGATIONS[args.loss_agg]
        self.full_kl = args.kl_estimator == "full"
        self.kl_estimator = None if self.full_kl else KL_ESTIMATORS[args.kl_estimator]

    def _weight(self, hidden: bool) -> torch.Tensor | None:
        return output_weight(self.model) if hidden else None

    def _logprobs_and_entropy(self, batch: MicroBatch, output: torch.Tensor,
                              hidden: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss's sampled-token logprobs and entropy (from the final hidden states with `hidden`).
        The naive path keeps the entropy out of autograd unless --entropy-coef puts it in the loss."""
        args, vocab_size = self.args, self.hf_config.vocab_size
        if args.kernels != "naive":
            return kernels.logprobs_and_entropy(output, batch.labels, vocab_size, args.temperature, args.kernels,
                                                weight_shard=self._weight(hidden))
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(args.entropy_coef)):
            entropy = naive.entropy(output, vocab_size, args.temperature)
        return self.token_logprobs(batch, output), entropy

    def _full_kl(self, logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
        return kernels.full_kl(logits, ref_logits, self.hf_config.vocab_size, self.args.temperature, self.args.kernels)

    def logprobs(self, micro_batches: list[MicroBatch], width: int,
                 full_kl_to=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned [n, width] logprobs of the sampled tokens under the current policy; with
        `full_kl_to` (the Reference) also the exact per-token KL(pi || ref) over the vocabulary."""
        if full_kl_to is None:
            return self.sampled_logprobs(micro_batches, width), None

        def both(batch, logits, companion_outputs):
            return (kernels.token_logprobs(logits, batch.labels, self.hf_config.vocab_size, self.args.temperature,
                                           self.args.kernels),
                    self._full_kl(logits, companion_outputs["ref"]))

        with full_kl_to.resident():
            outputs = self.forward_only(micro_batches, both, companions={"ref": full_kl_to.companion_logits})
        return (response_aligned(micro_batches, [o[0] for o in outputs], width),
                response_aligned(micro_batches, [o[1] for o in outputs], width))

    def train_step(self, micro_batches: list[MicroBatch], kl_coef: float = 0.0, reference=None,
                   teacher=None, on_policy: bool = False) -> dict:
        """One optimizer step over these micro-batches (this rank's share of a mini-batch).

        kl_coef > 0 (with the reference) adds kl_coef * KL(pi || ref) per token to the loss;
        distillation adds --distill-coef times the GKD loss (top-k from the batch's teacher
        fields, or full vocabulary from the colocated teacher's logits beside each micro-batch).
        `on_policy` (batch.two_pass_reason is None; the micro-batches carry no old logprobs):
        the old logprobs are this forward's own, detached, and the mismatch metrics and TIS
        weights are computed here as `phases.prepare` would have from them.
        """
        args = self.args
        kl_in_loss = kl_coef > 0 and reference is not None
        # A distillation term (not only its policy-gradient form): top-k from the batch's teacher
        # fields (either teacher placement), full vocabulary from the colocated teacher's logits.
        distill = bool(args.distill_coef) and (micro_batches[0].teacher_topk_ids is not None or
                                                (teacher is not None and not args.gkd_logits_topk))
        companions = {}
        if kl_in_loss and self.full_kl:
            companions["ref"] = reference
        if distill and not args.gkd_logits_topk:
            companions["teacher"] = teacher
        # Without full-vocabulary companions the model's output is its final hidden states and the fused
        # kernels form each chunk of logits from them: the logits are never held.
        hidden = args.kernels != "naive" and not companions

        def loss(part, output, companion_outputs):
            # Per token on this rank's part (with context parallelism), then over whole sequences.
            logprobs, entropy = part.gather(self._logprobs_and_entropy(part, output, hidden))
            distill_loss, topk_mass = part.gather(self._distill(part, output, companion_outputs, hidden)) \
                if distill else (None, None)
            full_kl = part.gather(self._full_kl(output, companion_outputs["ref"])) \
                if kl_in_loss and self.full_kl else None
            batch = part.whole
            mask = batch.loss_mask
            old_logprobs, is_weights, sums, maxes = batch.old_logprobs, batch.is_weights, {}, {}
            if on_policy:
                old_logprobs = logprobs.detach()
                is_weights, sums, maxes = self._rollout_correction(batch, old_logprobs)
            token_loss, pg_metrics = self.policy_loss(
                logprobs, old_logprobs, batch.advantages, args.clip_eps_low, args.clip_eps_high,
                mask=mask, clip_ratio_c=args.dual_clip_c, skip_threshold=args.skip_threshold)
            if is_weights is not None:
                token_loss = token_loss * is_weights
            token_loss = args.policy_loss_coef * token_loss
            if distill:
                token_loss = token_loss + args.distill_coef * distill_loss
                sums["distill_loss"] = (distill_loss * mask).sum()
                if topk_mass is not None:
                    sums["teacher_topk_mass"] = (topk_mass * mask).sum()
            kl = torch.zeros_like(token_loss)
            if kl_in_loss:
                kl = full_kl if self.full_kl else self.kl_estimator(logprobs, batch.ref_logprobs)
                token_loss = token_loss + kl_penalty_in_loss(kl, kl_coef)
            if args.entropy_coef:
                token_loss = token_loss + entropy_bonus(entropy, args.entropy_coef)
            # Per sample (a packed row holds several): the sequence-level aggregations need each sample's row.
            numerator, units = self.aggregate(batch.response_aligned(token_loss), batch.response_aligned(mask),
                                              max_len=args.max_new_tokens)
            units = torch.as_tensor(units, dtype=torch.float32, device=mask.device)
            sums.update({"loss": numerator, "loss_units": units, "clipped": (pg_metrics["clipped"] * mask).sum(),
                         "kl_old_new": ((old_logprobs - logprobs) * mask).sum(),  # k1 KL(old || new)
                         "kl_loss": (kl * mask).sum(), "entropy": (entropy * mask).sum(), "tokens": mask.sum()})
            reduced = {"sums": {k: v.detach() for k, v in sums.items()}}
            if maxes:
                reduced["maxes"] = maxes
            return numerator, units.round().to(torch.int), reduced

        with contextlib.ExitStack() as stack:
            for role in companions.values():
                stack.enter_context(role.resident())
            sums, grad_norm = self.optimizer_step(
                micro_batches, loss, companions={name: role.companion_logits for name, role in companions.items()},
                hidden=hidden)
        tokens = max(sums["tokens"], 1.0)
        metrics = {"loss": sums["loss"] / max(sums["loss_units"], 1.0), "clip_fraction": sums["clipped"] / tokens,
                   "kl_old_new": sums["kl_old_new"] / tokens, "entropy": sums["entropy"] / tokens,
                   "grad_norm": grad_norm, "lr": self.lr}
        if kl_in_loss:
            metrics["kl_loss"] = sums["kl_loss"] / tokens
        for name in ("distill_loss", "teacher_topk_mass"):
            if name in sums:
                metrics[name] = sums[name] / tokens
        if on_policy:
            metrics.update(batching.mismatch_from_sums(sums, sums))  # the maxima arrive beside the sums
            if args.tis_level != "none":
                metrics.update(batching.importance_weight_metrics(sums))
        return metrics

    def _rollout_correction(self, batch: MicroBatch, old_logprobs: torch.Tensor):
        """On-policy shortcut, one micro-batch: what `phases.prepare` computes from the old-logprob pass,
        from this forward's (detached) logprobs instead. The micro-batch holds whole sequences, so
        sequence-level weights see all their tokens. (TIS importance weights or None, the sums and the
        maxima of the mismatch and TIS metrics.)"""
        args, response = self.args, batch.response_mask()
        sums, maxes = batching.mismatch_sums(old_logprobs, batch.rollout_logprobs, response)
        weights = None
        if args.tis_level != "none":  # truncate mode: mask mode keeps the two-pass path
            weights, _, tis_sums = batching.importance_weight_sums(old_logprobs, batch.rollout_logprobs, response,
                                                                   args.tis_level, args.tis_mode, args.tis_threshold)
            sums.update(tis_sums)
        return weights, sums, maxes

    def _distill(self, batch: MicroBatch, output: torch.Tensor, companion_outputs: dict, hidden: bool):
        """Per-token GKD loss and (top-k) the student's mass on the teacher's top-k ids."""
        args, vocab_size = self.args, self.hf_config.vocab_size
        if not args.gkd_logits_topk:
            return kernels.full_divergence(output, companion_outputs["teacher"], vocab_size, args.gkd_beta,
                                           args.gkd_temperature, args.kernels), None
        return kernels.distill_topk(output, batch.teacher_topk_ids, batch.teacher_topk_logprobs, vocab_size,
                                    args.gkd_beta, args.gkd_temperature, args.gkd_topk_mode, args.kernels,
                                    weight_shard=self._weight(hidden))

    def hf_weights(self, bucket_bytes: int):
        """(HF name, tensor) pairs of the whole policy; collective over the train ranks."""
        return iter_hf_weights(self.model, self.hf_config, bucket_bytes)
