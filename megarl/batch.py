"""The typed batch of one step, and the pure functions that cut it.

`Batch` carries a step's samples and their per-token tensors between the phases
(score and filter -> prepare -> advantages -> update). Per-token tensors are
*response-aligned* [N, R]: column j is response token j of sample i, R the
longest response of the step, zero past a sample's end. Position-aligned
copies for a forward pass are made per micro-batch (`model_runner.MicroBatch`).

Every function here is pure (no ranks, no models): tested without torchrun.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl import packing
from megarl.algorithms import soft_overlong_penalty, truncated_importance_weights, truncation_keep

# The per-token fields of a Batch a micro-batch can carry, in a fixed order.
TOKEN_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "ref_kl", "old_values", "advantages",
                "returns", "is_weights", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs",
                "constrained", "policy")


@dataclass
class Batch:
    samples: list  # rollout.Sample, ordered by prompt (groups of num_generations)
    scores: torch.Tensor  # [N] sequence scores: reward (+ overlong penalty)
    response_mask: torch.Tensor  # [N, R] 1 on each sample's response tokens that are the policy's own (not
    # a tool's result in a multi-turn episode): every loss, KL, mismatch and TIS term reads it or loss_mask
    loss_mask: torch.Tensor  # [N, R] response tokens left in the loss (filters, TIS masking)
    rollout_logprobs: torch.Tensor  # [N, R] the engines' logprobs of the sampled tokens
    old_logprobs: torch.Tensor | None = None  # trainer logprobs before the update
    ref_logprobs: torch.Tensor | None = None  # reference policy's (sampled-token KL estimators)
    ref_kl: torch.Tensor | None = None  # per-token KL(old policy || reference)
    old_values: torch.Tensor | None = None  # critic values before the update (gae)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # critic targets
    is_weights: torch.Tensor | None = None  # rollout -> trainer importance weights (TIS)
    teacher_logprobs: torch.Tensor | None = None  # the teacher's logprobs of the sampled tokens (GKD)
    teacher_topk_ids: torch.Tensor | None = None  # [N, R, K] long: the teacher's top-k next tokens (GKD)
    teacher_topk_logprobs: torch.Tensor | None = None  # [N, R, K] their logprobs at --gkd-temperature
    # The sampler's constraint (`sampler_constraint`): [N, R] bool, True where `held_back_ids` were held back
    # (None: nowhere). The policy and the reference are scored under it, the teacher is not.
    constrained: torch.Tensor | None = None
    held_back_ids: tuple[int, ...] = ()
    # [N, R] float, 1 on the policy's tokens, 0 on tool-result tokens and past the end (`policy_tokens`);
    # None when every response token is the policy's. It rides along the micro-batches, where
    # MicroBatch.response_mask() reads it.
    policy: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def width(self) -> int:
        return self.response_mask.shape[1]

    def select(self, indices) -> Batch:
        """The samples at `indices` (a list or 1-D tensor), with every tensor's rows."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        picked = {field.name: (value[indices] if torch.is_tensor(value) else value)
                  for field in dataclasses.fields(self) for value in [getattr(self, field.name)]}
        picked["samples"] = [self.samples[i] for i in indices.tolist()]
        return Batch(**picked)

    def token_fields(self) -> dict[str, torch.Tensor]:
        """The per-token fields that are set, by name (what a micro-batch carries)."""
        return {name: getattr(self, name) for name in TOKEN_FIELDS if getattr(self, name) is not None}


def response_lengths(samples) -> torch.Tensor:
    return torch.tensor([len(s.response_ids) for s in samples])


def response_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """Ragged per-token lists as a zero-padded [N, width] float32 tensor."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def score_and_filter(samples, max_new_tokens: int, overlong_buffer_len: int = 0,
                     filter_truncated: bool = False, overlong_penalty_factor: float = 1.0) -> tuple[Batch, dict]:
    """The step's Batch: scores (reward, minus DAPO's soft overlong penalty when its buffer is set)
    and masks (responses that hit max_new_tokens leave the loss with --filter-truncated; they
    keep their reward in the group statistics). Also the filters' metrics."""
    lengths = response_lengths(samples)
    width = max(int(lengths.max()), 1)
    policy = policy_tokens(samples, width)
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    if policy is not None:
        response_mask = response_mask * policy
    loss_mask = response_mask
    scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    metrics = {}
    if overlong_buffer_len:
        penalty = overlong_penalty_factor * soft_overlong_penalty(lengths, max_new_tokens, overlong_buffer_len)
        scores = scores + penalty
        metrics["overlong_penalty_mean"] = penalty.mean().item()
    if filter_truncated:
        keep = truncation_keep(lengths, max_new_tokens)
        loss_mask = loss_mask * keep[:, None].float()
        metrics["truncated_filtered"] = 1.0 - keep.float().mean().item()
    # Dataset and teacher responses have no rollout logprobs (0 here; `prepare` gives them the trainer's).
    rollout = response_aligned([s.logprobs if s.logprobs is not None else [] for s in samples], width)
    held_back_ids, constrained = sampler_constraint(samples, width)
    return Batch(samples, scores, response_mask, loss_mask, rollout, constrained=constrained,
                 held_back_ids=held_back_ids, policy=policy), metrics


def policy_tokens(samples, width: int) -> torch.Tensor | None:
    """[N, width] float: 1 on the response tokens each sample's policy sampled, 0 on the tokens a tool's
    result put between its turns (Sample.policy_mask) and past its end; None when no sample has tool
    tokens (every response token is the policy's). A tool's tokens are context for the turns after them,
    never trained: off this mask they leave the loss, the KL, the mismatch and TIS (they have no rollout
    logprob to compare with either)."""
    if all(s.policy_mask is None for s in samples):
        return None
    for i, s in enumerate(samples):
        if s.policy_mask is not None and len(s.policy_mask) != len(s.response_ids):
            raise ValueError(f"sample {i}: policy_mask has {len(s.policy_mask)} entries for "
                             f"{len(s.response_ids)} response tokens")
    return response_aligned([s.policy_mask if s.policy_mask is not None else [1] * len(s.response_ids)
                             for s in samples], width)


def sampler_constraint(samples, width: int) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """What the sampler held back from the samples' responses: vLLM's min_tokens (--min-new-tokens) sets
    the logits of EOS and the stop ids (`Sample.held_back_ids`) to -inf before response token
    `Sample.min_tokens`, so the rollout logprobs there come from the softmax without them. Returns
    (those ids, [N, width] bool True at response token j < min_tokens of each sample they apply to),
    or ((), None) when no sample was constrained (evaluation, dataset and teacher responses never are).
    The trainer scores the policy under the same constraint (kernels.HeldBack), so that its logprobs
    and the rollout's compare the same distribution."""
    ids = {tuple(s.held_back_ids) for s in samples if s.min_tokens and s.held_back_ids}
    if not ids:
        return (), None
    if len(ids) > 1:
        raise ValueError(f"the samples were generated with different held-back token ids {sorted(ids)}: one "
                         f"batch is scored under one set")
    (ids,) = ids
    limits = torch.tensor([s.min_tokens if s.held_back_ids else 0 for s in samples])
    for i, s in enumerate(samples):
        held = [j for j, token in enumerate(s.response_ids[:limits[i]]) if token in ids]
        if held:
            raise ValueError(f"sample {i}: response token {held[0]} is id {s.response_ids[held[0]]}, which the "
                             f"sampler held back before token {int(limits[i])}: the sample and its constraint disagree")
    positions = torch.arange(width)[None, :]
    return tuple(ids), (positions < limits[:, None]) & (positions < response_lengths(samples)[:, None])


def contiguous_shard(count: int, index: int, parts: int) -> slice:
    """Part `index` of `count` items cut into `parts` contiguous pieces, sizes differing by at most one."""
    per, extra = divmod(count, parts)
    start = index * per + min(index, extra)
    return slice(start, start + per + (1 if index < extra else 0))


def data_parallel_shard(count: int, dp: int, dp_rank: int) -> slice:
    """This data-parallel rank's contiguous share of `count` samples (count must divide evenly)."""
    if count % dp:
        raise ValueError(f"{count} samples do not split evenly over {dp} data-parallel ranks")
    return contiguous_shard(count, dp_rank, dp)


def mini_batch_indices(count: int, global_batch_size: int, dp: int, dp_rank: int,
                       shuffle_seed: int | None = None, lengths: list[int] | None = None) -> list[torch.Tensor]:
    """This data-parallel rank's sample indices of each mini-batch of one epoch.

    Mini-batches are consecutive runs of `global_batch_size` samples of the (optionally
    permuted) order; each data-parallel rank takes its contiguous share of each, or with the
    samples' token `lengths` its share of equal size and near-equal tokens
    (packing.data_parallel_partitions). With `shuffle_seed` the order is a permutation seeded by
    it, the same on every rank. Which rank trains a sample changes only the order of the loss's
    sums: the loss and its units are summed over ranks (calculate_per_token_loss).
    """
    if count % global_batch_size:
        raise ValueError(f"{count} samples do not split into mini-batches of {global_batch_size}")
    order = torch.arange(count)
    if shuffle_seed is not None:
        order = torch.randperm(count, generator=torch.Generator().manual_seed(shuffle_seed))
    shares = []
    for start in range(0, count, global_batch_size):
        mini_batch = order[start:start + global_batch_size]
        if lengths is None or dp == 1:
            shares.append(mini_batch[data_parallel_shard(global_batch_size, dp, dp_rank)])
        else:
            groups = packing.data_parallel_partitions([lengths[i] for i in mini_batch.tolist()], dp)
            shares.append(mini_batch[torch.tensor(groups[dp_rank], dtype=torch.long)])
    return shares


def shuffle_seed(seed: int, step: int, epoch: int) -> int:
    """The mini-batch permutation's seed for (--seed, step, epoch)."""
    return seed * 1_000_003 + step * 1_009 + epoch


def mismatch_sums(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> tuple[dict, dict]:
    """The parts of `mismatch_metrics` over some of the samples, to add up over micro-batches and
    ranks (the on-policy shortcut measures them per micro-batch in the loss): sums, with the token
    count `mismatch_tokens`, and maxima. Any layout (response- or position-aligned), 0 off `mask`."""
    diff = (trainer_logprobs - rollout_logprobs) * mask
    sums = {"mismatch": diff.abs().sum(), "mismatch_kl": ((torch.exp(diff) - diff - 1.0) * mask).sum(),
            "mismatch_tokens": mask.sum()}
    return sums, {"mismatch_max": diff.abs().max(), "ratio_dev_max": ((diff.exp() - 1) * mask).abs().max()}


def mismatch_from_sums(sums: dict, maxes: dict) -> dict:
    """`mismatch_metrics` from the (float) totals of `mismatch_sums`."""
    tokens = max(float(sums["mismatch_tokens"]), 1.0)
    return {"mismatch": float(sums["mismatch"]) / tokens, "mismatch_max": float(maxes["mismatch_max"]),
            "mismatch_kl": float(sums["mismatch_kl"]) / tokens, "ratio_dev_max": float(maxes["ratio_dev_max"])}


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Rollout vs trainer logprobs of the sampled tokens, over the whole batch.

    mismatch: mean |trainer - rollout|; mismatch_kl: mean k3 estimate of
    KL(rollout || trainer) from the rollout's samples; ratio_dev_max: max
    |exp(trainer - rollout) - 1|, the importance ratio's distance from 1.
    """
    return mismatch_from_sums(*mismatch_sums(old_logprobs, rollout_logprobs, mask))


def importance_weight_sums(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                           level: str, mode: str, threshold: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """TIS importance weights of some whole samples (any layout, 0 off the response `mask`), the tokens
    mask mode rejects, and the sums behind `importance_weight_metrics` (the clipped and masked tokens
    and `tis_tokens`, the response tokens)."""
    weights, stats = truncated_importance_weights(old_logprobs, rollout_logprobs, mask, level=level, mode=mode,
                                                  threshold=threshold)
    return weights, stats["masked"], {"tis_clipped": stats["clipped"].sum(), "tis_masked": stats["masked"].sum(),
                                      "tis_tokens": mask.sum()}


def importance_weight_metrics(sums: dict) -> dict:
    """The clipped and masked token fractions from the (float) totals of `importance_weight_sums`."""
    tokens = max(float(sums["tis_tokens"]), 1.0)
    return {"tis_clipped_fraction": float(sums["tis_clipped"]) / tokens,
            "tis_masked_fraction": float(sums["tis_masked"]) / tokens}


def importance_weights(batch: Batch, level: str, mode: str, threshold: float) -> dict:
    """Set the batch's rollout -> trainer importance weights (TIS); in mask mode the rejected
    tokens also leave the loss. The clipped and masked token fractions."""
    batch.is_weights, masked, sums = importance_weight_sums(batch.old_logprobs, batch.rollout_logprobs,
                                                            batch.response_mask, level, mode, threshold)
    if mode == "mask":  # rejected tokens leave the aggregation's units too
        batch.loss_mask = batch.loss_mask * (1.0 - masked)
    return importance_weight_metrics(sums)


def two_pass_reason(args, step: int) -> str | None:
    """Why step `step` needs the separate forward pass for the old logprobs before the update, or None:
    the on-policy shortcut applies, and the update's training forward gives them (old = new, detached;
    ratio exactly 1, as verl and TRL do on-policy), the mismatch metrics and TIS weights with them.

    The update is on-policy when it is a single optimizer step on the generated batch, taken before the
    policy changes: --ppo-epochs 1, one mini-batch (--global-batch-size = the whole batch), and the
    actor is updated this step (past --critic-warmup; during it nothing reads the old logprobs but the
    metrics). The shortcut needs that nothing reads the old logprobs before the update either:
      - no reference (--kl-coef 0): its KL (ref_kl: kl_ref, the adaptive controller, the KL in the
        reward with --kl-placement reward) comes from the old logprobs, or from their pass with
        --kl-estimator full;
      - no teacher (--teacher-model, standalone teacher ranks or --teacher-server): --distill-reward-coef puts
        -(log pi_old - log pi_teacher) into the rewards, teacher_kl is measured from the old logprobs,
        and --gkd-lmbda < 1 trains on responses without rollout logprobs (they get the old ones);
      - TIS in truncate mode (or off): mask mode takes tokens out of the loss mask, which advantage_mean
        reads before the update;
      - not sequence-level TIS with --padding-free: the update's micro-batch rows would hold several
        sequences.
    Not in the way: a critic (GAE reads its own values, not the policy's logprobs), dynamic sampling
    (it filters on rewards) and the truncation filter (on lengths).
    """
    reasons = [
        (args.no_on_policy_shortcut, "--no-on-policy-shortcut"),
        (args.ppo_epochs != 1, f"--ppo-epochs {args.ppo_epochs}"),
        (args.steps_per_generation != 1, f"{args.steps_per_generation} mini-batches per generated batch"),
        (step < args.critic_warmup, f"critic warm-up (--critic-warmup {args.critic_warmup})"),
        (args.kl_coef > 0, "a reference model (--kl-coef > 0)"),
        (bool(args.teacher_model or args.standalone_teacher_model or args.teacher_server), "a distillation teacher"),
        (args.tis_level != "none" and args.tis_mode == "mask", "--tis-mode mask"),
        # The update computes them per row of its micro-batches, and a packed row holds several sequences.
        (args.padding_free and args.tis_level in ("sequence", "geometric"),
         f"--padding-free with --tis-level {args.tis_level}"),
    ]
    return next((reason for applies, reason in reasons if applies), None)


def on_policy_update(args, step: int) -> bool:
    """Whether step `step` takes the on-policy shortcut (`two_pass_reason` gives the conditions)."""
    return two_pass_reason(args, step) is None


def describe_old_logprobs_path(args) -> str:
    """Where the old logprobs come from in this run (`two_pass_reason` at the first step the actor updates),
    said once at the start."""
    first = args.critic_warmup
    reason = two_pass_reason(args, first)
    if reason is not None:
        return f"old logprobs: a separate forward pass before each update ({reason})"
    warmup = f" (from step {first + 1}; a separate pass during the critic warm-up)" if first else ""
    return f"old logprobs: from the update's own forward, on-policy, no separate pass{warmup}"
