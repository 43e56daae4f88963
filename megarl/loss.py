"""The actor's loss, apart from the forward step (as Megatron keeps `loss_func` apart from `forward_step`).

`ActorLoss` is called once per micro-batch by model_runner.forward_backward with the
model's output (the final hidden states, or the logits when a full-vocabulary companion
needs them) and returns (numerator, loss units, metric sums). Per token it composes the
algorithm registries' functions, the ones the formula tests check:

    POLICY_LOSSES[--policy-loss]  (x importance weight with TIS)
    x --policy-loss-coef
    + --distill-coef x GKD (algorithms GKD_TOPK_MODES / distill_full)  with a teacher
    + --sft-alpha x (-log pi(y_t) at temperature 1)  on a step that trains on the dataset's (or
      --seq-kd teacher's) responses, not the student's (ms-swift's GKD sft_alpha)
    + kl_penalty_in_loss(KL(pi || ref), coef)      when --kl-placement loss
    + entropy_bonus(entropy, --entropy-coef)
    -> LOSS_AGGREGATIONS[--loss-agg] -> (numerator, units)

Logprobs, entropy, the full KL and the distillation losses go through the fused kernels
(megarl/kernels, --kernels): vocabulary-parallel, and from the final hidden states and
the output weight whenever no full-vocabulary companion (reference or teacher logits) is
needed, so the [tokens, V/TP] logits are never formed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megarl import batch as batching, kernels
from megarl.kernels import naive
from megarl.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, entropy_bonus, kl_penalty_in_loss


@dataclass(frozen=True)
class LossTerms:
    """What one optimizer step's loss holds, decided before its forward passes (Actor.train_step)."""

    kl_coef: float = 0.0  # > 0: kl_coef * KL(pi || ref) per token (--kl-placement loss, with a reference)
    distill: bool = False  # a GKD term: top-k from the batch's teacher fields, or full vocabulary from the
    # colocated teacher's logits beside each micro-batch (companion "teacher")
    on_policy: bool = False  # the on-policy shortcut: the old logprobs are this forward's own, detached
    hidden: bool = False  # the output is the final hidden states; the kernels form the logits chunk by chunk
    sft: bool = False  # --sft-alpha's cross-entropy on the responses: the step trains on the dataset's (or
    # the teacher's, --seq-kd) responses, not the student's samples


def full_kl(args, vocab_size: int, logits: torch.Tensor, ref_logits: torch.Tensor,
            held_back: kernels.HeldBack | None = None) -> torch.Tensor:
    """The exact per-token KL(pi || ref) over the vocabulary (--kl-estimator full), both under the
    sampler's constraint `held_back` (MicroBatch.held_back) where there is one."""
    return kernels.full_kl(logits, ref_logits, vocab_size, args.temperature, args.kernels, held_back=held_back)


class ActorLoss:
    """loss_func(part, output, companion_outputs) -> (numerator, units, {"sums": ..., "maxes": ...}).

    `output_weight()`: this rank's shard of the output layer's weight (read at each call: offloading
    may move it between steps), used when `terms.hidden`."""

    def __init__(self, args, vocab_size: int, terms: LossTerms, output_weight: Callable[[], torch.Tensor]):
        self.args, self.vocab_size, self.terms, self.output_weight = args, vocab_size, terms, output_weight
        self.policy_loss = POLICY_LOSSES[args.policy_loss]
        self.aggregate = LOSS_AGGREGATIONS[args.loss_agg]
        self.full_kl = args.kl_estimator == "full"
        self.kl_estimator = None if self.full_kl else KL_ESTIMATORS[args.kl_estimator]

    def __call__(self, part, output: torch.Tensor, companion_outputs: dict):
        # Per token on this rank's part (with context parallelism), then over whole sequences.
        args, terms = self.args, self.terms
        logprobs, entropy = part.gather(self.logprobs_and_entropy(part, output))
        distill_loss, topk_mass = part.gather(self._distill(part, output, companion_outputs)) \
            if terms.distill else (None, None)
        kl_in_loss = terms.kl_coef > 0
        exact_kl = part.gather(full_kl(args, self.vocab_size, output, companion_outputs["ref"], part.held_back())) \
            if kl_in_loss and self.full_kl else None
        batch = part.whole
        mask = batch.loss_mask
        old_logprobs, is_weights, sums, maxes = batch.old_logprobs, batch.is_weights, {}, {}
        if terms.on_policy:
            old_logprobs = logprobs.detach()
            is_weights, sums, maxes = self._rollout_correction(batch, old_logprobs)
        token_loss, pg_metrics = self.policy_loss(
            logprobs, old_logprobs, batch.advantages, args.clip_eps_low, args.clip_eps_high,
            mask=mask, clip_ratio_c=args.dual_clip_c, skip_threshold=args.skip_threshold,
            tau_pos=args.sapo_tau_pos, tau_neg=args.sapo_tau_neg)
        if is_weights is not None:
            token_loss = token_loss * is_weights
        token_loss = args.policy_loss_coef * token_loss
        if terms.distill:
            token_loss = token_loss + args.distill_coef * distill_loss
            sums["distill_loss"] = (distill_loss * mask).sum()
            if topk_mass is not None:
                sums["teacher_topk_mass"] = (topk_mass * mask).sum()
        if terms.sft:
            nll = -self._sft_logprobs(part, output, logprobs)
            token_loss = token_loss + args.sft_alpha * nll
            sums["sft_loss"] = (nll.detach() * mask).sum()
        kl = torch.zeros_like(token_loss)
        if kl_in_loss:
            kl = exact_kl if self.full_kl else self.kl_estimator(logprobs, batch.ref_logprobs)
            token_loss = token_loss + kl_penalty_in_loss(kl, terms.kl_coef)
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

    def metrics(self, sums: dict, grad_norm: float, lr: float) -> dict:
        """The optimizer step's metrics from the sums (and maxima) over its micro-batches and DP ranks."""
        tokens = max(sums["tokens"], 1.0)
        metrics = {"loss": sums["loss"] / max(sums["loss_units"], 1.0), "clip_fraction": sums["clipped"] / tokens,
                   "kl_old_new": sums["kl_old_new"] / tokens, "entropy": sums["entropy"] / tokens,
                   "grad_norm": grad_norm, "lr": lr}
        if self.terms.kl_coef > 0:
            metrics["kl_loss"] = sums["kl_loss"] / tokens
        for name in ("distill_loss", "teacher_topk_mass", "sft_loss"):
            if name in sums:
                metrics[name] = sums[name] / tokens
        if self.terms.on_policy:
            metrics.update(batching.mismatch_from_sums(sums, sums))  # the maxima arrive beside the sums
            if self.args.tis_level != "none":
                metrics.update(batching.importance_weight_metrics(sums))
        return metrics

    def logprobs_and_entropy(self, batch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled tokens' logprobs and the entropy per token, under the sampler's constraint (the
        --min-new-tokens mask, MicroBatch.held_back). The naive path keeps the entropy out of autograd
        unless --entropy-coef puts it in the loss."""
        args, held_back = self.args, batch.held_back()
        if args.kernels != "naive":
            return kernels.logprobs_and_entropy(output, batch.labels, self.vocab_size, args.temperature,
                                                args.kernels, weight_shard=self._weight(), held_back=held_back)
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(args.entropy_coef)):
            entropy = naive.entropy(output, self.vocab_size, args.temperature, held_back)
        return kernels.token_logprobs(output, batch.labels, self.vocab_size, args.temperature, "naive",
                                      held_back=held_back), entropy

    def _sft_logprobs(self, part, output: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """The response tokens' log-probs for --sft-alpha's cross-entropy: at temperature 1 and without the
        --min-new-tokens constraint (ms-swift's language-model loss on the raw logits); the training
        logprobs themselves when those are the same (--temperature 1: a response that is not the student's
        sample has no held-back ids)."""
        if self.args.temperature == 1.0:
            return logprobs
        return part.gather(kernels.token_logprobs(output, part.labels, self.vocab_size, 1.0, self.args.kernels,
                                                  weight_shard=self._weight()))

    def _weight(self) -> torch.Tensor | None:
        return self.output_weight() if self.terms.hidden else None

    def _distill(self, batch, output: torch.Tensor, companion_outputs: dict):
        """Per-token GKD loss and (top-k) the student's mass on the teacher's top-k ids, between the
        distributions without --min-new-tokens' mask (docs/design.md: the teacher is never masked)."""
        args = self.args
        if not args.gkd_logits_topk:
            return kernels.full_divergence(output, companion_outputs["teacher"], self.vocab_size, args.gkd_beta,
                                           args.gkd_temperature, args.kernels), None
        return kernels.distill_topk(output, batch.teacher_topk_ids, batch.teacher_topk_logprobs, self.vocab_size,
                                    args.gkd_beta, args.gkd_temperature, args.gkd_topk_mode, args.kernels,
                                    weight_shard=self._weight())

    def _rollout_correction(self, batch, old_logprobs: torch.Tensor):
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
