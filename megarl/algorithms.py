"""RL algorithms as pure functions, registered under the names their flags take.

Nothing here knows about ranks, models or micro-batches: every function maps
tensors to tensors, so each one is testable against its paper formula
(tests/test_algorithms.py).

Registries (flag value -> function):

  ADVANTAGE_ESTIMATORS  grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae, real
  POLICY_LOSSES         ppo_clip, gspo, skip_threshold, cispo, sapo
  LOSS_AGGREGATIONS     token_level, sample_level, seq_mean_token_sum_norm
  KL_ESTIMATORS         k1, abs, mse (= k2), low_var_kl (= k3), full
  KL_CONTROLLERS        fixed, adaptive
  GKD_TOPK_MODES        renorm, tail  (see Distillation below)

Tensor layout
  Per-token tensors are [B, L], *response-aligned and right-padded*: column 0 is
  the first response token of each sample, `mask` is 1 on the sample's response
  tokens and 0 on padding. (Most functions only rely on `mask`, not on where the
  padding is; GAE and the discounted returns treat masked-out positions as
  absent.) Samples are grouped consecutively: rows g*G .. g*G+G-1 are the G
  responses to prompt g (G = `group_size`).

Advantage estimators: one calling convention, verl's
  ADVANTAGE_ESTIMATORS[name](token_rewards [B, L], mask [B, L], group_size, **options)
      -> (advantages [B, L], returns [B, L])
  * An outcome (sequence) reward enters as a token reward at the sample's last
    valid token: `sequence_rewards_to_tokens(scores, mask)`. Outcome estimators
    (grpo, rloo, reinforce_plus_plus_baseline) use the sample score, the sum
    of token_rewards[i, t] over valid tokens, so per-token terms such as a KL penalty placed in
    the reward (`kl_penalty_in_reward`) are summed into it, as in verl.
  * Options are keyword-only. Every estimator accepts every name in
    ADVANTAGE_OPTIONS (so a caller can pass one option set whatever the flag)
    and ignores those it does not use; an unknown name raises TypeError.
  * Advantages and returns are 0 on padding. Estimators run without autograd.
  * `grpo_advantages` / `rloo_advantages` are the per-sample math ([B] -> [B])
    behind grpo and rloo.

Conventions (each chosen on purpose):
  * group std is the unbiased (Bessel-corrected) std, as in verl and TRL;
    advantages are divided by (std + eps), eps = EPS = 1e-6 outside the sqrt
    (verl's epsilon; TRL uses 1e-4).
  * a group of one sample gets advantage 0 in grpo, rloo and
    reinforce_plus_plus_baseline: its baseline is its own reward, there is
    nothing to compare with. (verl instead uses mean 0 / std 1 for a lone sample,
    i.e. advantage = r / (1 + eps) in grpo and no baseline in RF++-baseline.)
  * grpo scale_rewards: "group" divides by the group's std (GRPO), "batch" by the
    std of all rewards of the batch (TRL's scale_rewards="batch"; the mean stays
    the group mean), "none" does not divide (Dr. GRPO).
  * whitening (`masked_whiten`, used by reinforce_plus_plus(_baseline) and gae) is
    verl's masked_whiten: (x - mean) / sqrt(var + 1e-8) over the valid tokens
    of the whole batch, mean and var token-weighted, var unbiased
    (n / (n - 1)); eps inside the sqrt. Fewer than two valid tokens -> var 0.
    Unlike verl's gae, whitened advantages are zeroed on padding.
  * reinforce_plus_plus: returns G_t = r_t + gamma G_{t+1} over valid tokens
    (gamma defaults to 1, so an outcome reward gives G_t = score at every valid
    token); advantages = masked_whiten(returns).
  * reinforce_plus_plus_baseline: A = masked_whiten(score - group mean), the
    centred score broadcast to every valid token; returns = advantages (verl).
  * gae: delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last valid
    token, A_t = delta_t + gamma lam A_{t+1}; returns = A (before whitening) + V,
    advantages whitened unless whiten=False. gamma = lam = 1 by default (verl).

Policy losses: one calling convention
  POLICY_LOSSES[name](logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high, **options)
      -> (token_loss [B, L], metrics)
  * all [B, L]; the loss is per token and not masked: aggregation
    (LOSS_AGGREGATIONS) applies the mask. Options: POLICY_LOSS_OPTIONS (mask,
    clip_ratio_c, skip_threshold, tau_pos, tau_neg), accepted by every loss, unused ones ignored.
  * metrics maps names to detached per-token float tensors [B, L] (indicators
    such as "clipped", or values such as "ratio"); the trainer reduces them with
    the mask, summed over micro-batches and data-parallel ranks. Every loss
    returns "ratio", "clipped" and "dual_clipped".
  * the ratio is exp(clamp(logp - old_logp, -20, 20)) (verl's stability clamp;
    GSPO clamps the log ratio at 10 from above, as verl does).
  * "clipped" is verl's pg_clipfrac: the clipped term is the larger one.
  * dual clip (clip_ratio_c = c > 1, None = off): for A < 0 the loss is
    min(ppo_loss, -A c) (verl's compute_policy_loss); "dual_clipped" marks where
    -A c won. Applies to ppo_clip, gspo and skip_threshold (cispo caps a stop-gradient
    weight instead, sapo gates softly: neither takes it).
  * cispo and sapo (ms-swift's loss_type cispo / sapo) are defined at their functions;
    sapo's temperatures are the options tau_pos / tau_neg.
  * entropy and KL enter as extra per-token loss terms the caller adds:
    `entropy_bonus(entropy, coef)` = -coef * entropy,
    `kl_penalty_in_loss(kl, coef)` = coef * kl (GRPO style); or the KL goes into
    the reward instead (`kl_penalty_in_reward`, PPO style).

Loss aggregation: LOSS_AGGREGATIONS[name](token_loss, mask, max_len=None)
  -> (numerator, units), two 0-d tensors whose ratio is the loss. Numerators and
  units are sums, so summing both over micro-batches and data-parallel ranks and
  dividing once gives the global value: this is what Megatron does with
  calculate_per_token_loss=True (the loss function returns (numerator, units);
  the gradient is divided by the summed units).

Off-policy correction and the DAPO pieces are plain helpers documented below.

Distillation (GKD, Agarwal et al. 2024; as TRL's GKDTrainer and ms-swift's Megatron GKD)
  Losses between the student's and the teacher's next-token distributions on
  the student's responses. Flags -> functions: --gkd-logits-topk 0 (full
  vocabulary) -> distill_full; --gkd-logits-topk K > 0 -> GKD_TOPK_MODES[mode]
  with mode = --gkd-topk-mode (renorm or tail). distill_support(topk, mode)
  returns that function; --gkd-beta and --gkd-temperature are its beta and
  temperature arguments.

  Calling conventions, all per position (per token), shape [...] (the vocabulary /
  support is summed, nothing else is reduced: the trainer masks and aggregates
  with LOSS_AGGREGATIONS):
    distill_full(student_logits [..., V], teacher_logits [..., V], beta, temperature) -> [...]
    GKD_TOPK_MODES[mode](student_logits [..., V], teacher_topk_ids [..., K] long,
                         teacher_topk_logprobs [..., K], beta, temperature) -> [...]
    generalized_jsd(student_logprobs [..., N], teacher_logprobs [..., N], beta) -> [...]
      the divergence over any N bins of already-normalised log-probs (the building
      block: a vocabulary-parallel caller passes its shard's log-probs to
      generalized_jsd_terms, sums its shard and all-reduces over the TP group, as
      with kl_full).
    student_topk_mass(student_logits, teacher_topk_ids, temperature) -> [...]  (metric, no grad)
    distill_token_rewards(student_logprobs [B, L], teacher_logprobs [B, L]) -> [B, L]  (no grad)

  Conventions (each chosen on purpose):
    * beta (--gkd-beta) has TRL's / ms-swift's meaning exactly: beta == 0 is the
      forward KL(teacher || student) (mode covering, classic KD), beta == 1 the
      reverse KL(student || teacher) (mode seeking, on-policy distillation); in
      between, M = beta P_teacher + (1 - beta) P_student (formed in log space with
      logaddexp) and the loss is beta KL(P_teacher || M) + (1 - beta) KL(P_student || M).
      (This generalised JSD tends to 0, not to a KL, as beta -> 0 or 1: the two
      endpoints are special-cased, as in TRL.)
    * temperature T (--gkd-temperature, > 0): both distributions are
      softmax(logits / T). No T^2 factor (TRL and ms-swift have none).
    * top-k input: teacher_topk_logprobs are log softmax(teacher_logits / T) of the
      FULL teacher vocabulary at the ids teacher_topk_ids (the caller scales by T
      before taking the top-k; at T = 1 these are vLLM's prompt logprobs). The
      renorm mode renormalises them over the K ids, so for it log-probs taken at
      T = 1 divided by T give the same loss (ms-swift's convention); the tail mode
      needs the tail mass at T, i.e. the full distribution at T.
      Top-k ids are distinct; K == V means they cover the vocabulary.
    * renorm: teacher q = softmax over the K teacher log-probs, student p =
      log_softmax(s / T) at the ids renormalised over them (= log_softmax(s_I / T));
      loss = JSD_beta(q || p) over K bins. This is ms-swift's top-k GKD. Reverse KL
      over these bins cannot see the mass the student puts outside the teacher's
      top-k and is known to let it grow: log student_topk_mass every step.
    * tail: K + 1 bins, no renormalisation: the K top-k bins (teacher exp(lt),
      student exp(log_softmax(s / T)[I])) and one tail bin holding each side's
      remaining mass. The student's tail log-mass is logsumexp of s / T over the
      ids not in the top-k minus logsumexp over all (exact, with its gradient);
      the teacher's is log(1 - sum exp(lt)) (summed in float64). Both tail
      masses are floored at GKD_TAIL_MASS_FLOOR = 1e-7, the student's in value
      only (straight-through gradient): the teacher's tail is known only to
      about float32 resolution (rounding can make it 0 or negative), and an
      equal floor on both sides keeps two negligible tails from producing a
      spurious term (a tail of 1e-7 against one of exactly 0). With K == V the
      tail bin is empty on both sides and dropped, so both modes equal
      distill_full.
    * numerics: computed in float32 (float64 kept), in log space (log_softmax,
      logsumexp, logaddexp), never exp of a positive number. A bin with
      probability 0 contributes 0 (0 log 0 = 0) with gradient 0. Log-probs are
      floored at LOGPROB_FLOOR = -1e4 (exp of it is 0 in float32): the teacher's
      (constant) by clamping, the student's in value only, its gradient staying the
      unfloored one (straight-through) where it is finite, so a student logit of
      -inf or -1e30 gives finite values and gradients. A divergence that is
      mathematically infinite (reverse KL where the teacher's probability is exactly
      0 and the student's is not; forward KL with the roles swapped) is therefore
      finite and large, about p * 1e4.
    * the teacher is a constant: its inputs are detached.
    * policy-gradient form (distill_token_rewards): the token reward
      -(log pi_student(y_t) - log pi_teacher(y_t)) of the sampled tokens, the
      negative k1 estimate of the per-token reverse KL (its expectation under the
      student's samples is -KL(student || teacher)); detached, for any advantage
      estimator (add it to token_rewards, or use it alone).
"""

from __future__ import annotations

import math

import torch

# `register` is also the plugins' API: @megarl.algorithms.register(REGISTRY, name).
from megarl.registry import Registry, register

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")
KL_CONTROLLERS = Registry("KL controller")

EPS = 1e-6  # group-std epsilon, outside the sqrt (verl)
WHITEN_EPS = 1e-8  # whitening epsilon, inside the sqrt (verl's masked_whiten)
LOG_RATIO_BOUND = 20.0  # |log ratio| clamp before exp (verl)

ADVANTAGE_OPTIONS = frozenset({"scale_rewards", "eps", "gamma", "lam", "values", "whiten", "real_tau"})
POLICY_LOSS_OPTIONS = frozenset({"mask", "clip_ratio_c", "skip_threshold", "tau_pos", "tau_neg"})


def _check_options(options: dict, known: frozenset) -> None:
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; known: {sorted(known)}")


def _floating(x: torch.Tensor) -> torch.Tensor:
    """x as float32, or float64 if it already is (never lower precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# ------------------------------------------------------------------ helpers ----
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid positions, unbiased var; 0 on padding."""
    x = _floating(x)
    mask = mask.to(x.dtype)
    count = mask.sum()
    mean = (x * mask).sum() / count.clamp(min=1)
    centred = (x - mean) * mask
    var = (centred ** 2).sum() / (count - 1).clamp(min=1)  # 0 when count <= 1: centred is then 0
    return centred * torch.rsqrt(var + eps)


def sequence_rewards_to_tokens(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, L]: each sample's score at its last valid token, 0 elsewhere.

    The last valid token is the last position where mask is 1 (the EOS token, or
    the last generated token of a truncated response). A row with no valid token
    gets no reward.
    """
    scores = _floating(scores)
    mask = mask.to(scores.dtype)
    length = mask.shape[1]
    last = length - 1 - torch.argmax(mask.flip(dims=[1]), dim=1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0], device=mask.device), last] = scores
    return out * mask


def _grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size is None:
        raise TypeError("this estimator needs group_size")
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} samples do not split into groups of {group_size}")
    return _floating(scores).reshape(-1, group_size)


def _scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sample scores [B]: the sum of the token rewards over valid tokens."""
    return (_floating(token_rewards) * mask).sum(dim=-1)


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sample[:, None] * mask.to(per_sample.dtype)


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} over valid tokens (masked positions are skipped); 0 on padding."""
    rewards = token_rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


# ------------------------------------------------------ advantage estimators ----
def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                    eps: float = EPS) -> torch.Tensor:
    """Per-sample GRPO advantages [B] from rewards [B]: (r - mean_group) / (std + eps).

    scale_rewards: "group" (std of the group), "batch" (std of all B rewards),
    "none" (no division, Dr. GRPO). Unbiased std; a lone sample gets 0.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        centred = centred / (std + eps)
    elif scale_rewards == "batch":
        std = groups.std() if groups.numel() > 1 else torch.zeros_like(groups[0, 0])
        centred = centred / (std + eps)
    elif scale_rewards != "none":
        raise ValueError(f"unknown reward scaling {scale_rewards!r} (group, batch, none)")
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-sample RLOO advantages [B]: r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean); lone sample -> 0."""
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).reshape(-1)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred * group_size / (group_size - 1)).reshape(-1)


@register(ADVANTAGE_ESTIMATORS, "grpo")
@torch.no_grad()
def grpo(token_rewards, mask, group_size=None, *, scale_rewards: str = "group", eps: float = EPS, **options):
    """GRPO: group-normalised outcome advantage, broadcast to the valid tokens. returns = advantages."""
    _check_options(options, ADVANTAGE_OPTIONS)
    advantages = _broadcast(grpo_advantages(_scores(token_rewards, mask), group_size, scale_rewards, eps), mask)
    return advantages, advantages


@register(ADVANTAGE_ESTIMATORS, "rloo")
@torch.no_grad()
def rloo(token_rewards, mask, group_size=None, **options):
    """RLOO: leave-one-out baseline, broadcast to the valid tokens. returns = advantages."""
    _check_options(options, ADVANTAGE_OPTIONS)
    advantages = _broadcast(rloo_advantages(_scores(token_rewards, mask), group_size), mask)
    return advantages, advantages


@register(ADVANTAGE_ESTIMATORS, "reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(token_rewards, mask, group_size=None, *, gamma: float = 1.0, **options):
    """REINFORCE++: discounted returns over valid tokens, whitened over the batch's valid tokens.

    group_size is not used (no group baseline). returns are the unwhitened returns.
    """
    _check_options(options, ADVANTAGE_OPTIONS)
    token_rewards = _floating(token_rewards)
    mask = mask.to(token_rewards.dtype)
    returns = _discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@register(ADVANTAGE_ESTIMATORS, "reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(token_rewards, mask, group_size=None, **options):
    """REINFORCE++-baseline: (score - group mean) on every valid token, whitened over the batch."""
    _check_options(options, ADVANTAGE_OPTIONS)
    groups = _grouped(_scores(token_rewards, mask), group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    advantages = masked_whiten(_broadcast(centred, mask), mask)
    return advantages, advantages


def real_advantages(rewards: torch.Tensor, group_size: int, tau: float) -> torch.Tensor:
    """REAL's per-sample weights [B] (ms-swift's loss_type real), as advantages of the on-policy update.

    REAL scores each sample by its mean token log-ratio s_i = mean_t(log pi - log pi_old) and, per group with
    both signs of advantage (positive: reward above the group's mean; the others negative), takes
    L_g = log(1 + sum_neg e^(s_i/tau)) + log(1 + sum_pos e^(-s_i/tau)), averaged over the groups. Its
    gradient is sum_i (dL/ds_i) grad s_i; on-policy (one optimizer step per generated batch, so s_i = 0 when it
    is taken) dL/ds_i = 1/(tau (1 + n_neg)) for a negative sample and -1/(tau (1 + n_pos)) for a positive one.
    With megarl's sample-level loss (the mean over B samples of each one's token mean of -A_i logp) the same
    gradient is A_i = -G dL/ds_i, G = group_size (B/G groups): G/(tau (1 + n_pos)) for a positive sample,
    -G/(tau (1 + n_neg)) for a negative one, 0 in a group whose rewards are all equal."""
    groups = _grouped(rewards, group_size)
    positive = groups > groups.mean(dim=1, keepdim=True)
    n_pos = positive.sum(dim=1, keepdim=True).to(groups.dtype)
    n_neg = group_size - n_pos
    weights = torch.where(positive, group_size / (tau * (1 + n_pos)), -group_size / (tau * (1 + n_neg)))
    mixed = (n_pos > 0) & (n_neg > 0)
    return (weights * mixed).reshape(-1)


@register(ADVANTAGE_ESTIMATORS, "real")
@torch.no_grad()
def real(token_rewards, mask, group_size=None, *, real_tau: float = 0.5, **options):
    """REAL (ms-swift's loss_type real): its group log-sum-exp loss's on-policy gradient as per-sample advantages
    (real_advantages), broadcast to the valid tokens. returns = advantages."""
    _check_options(options, ADVANTAGE_OPTIONS)
    if real_tau <= 0:
        raise ValueError(f"real_tau must be > 0, got {real_tau}")
    advantages = _broadcast(real_advantages(_scores(token_rewards, mask), group_size, real_tau), mask)
    return advantages, advantages


@register(ADVANTAGE_ESTIMATORS, "gae")
@torch.no_grad()
def gae(token_rewards, mask, group_size=None, *, values, gamma: float = 1.0, lam: float = 1.0,
        whiten: bool = True, **options):
    """Generalised advantage estimation (Schulman et al. 2016) with critic values [B, L].

    Computed backward over the valid tokens only; returns = advantages + values
    (before whitening), advantages whitened over the batch's valid tokens
    unless whiten=False. Both are 0 on padding.
    """
    _check_options(options, ADVANTAGE_OPTIONS)
    token_rewards = _floating(token_rewards)
    mask = mask.to(token_rewards.dtype)
    values = values.detach().to(token_rewards.dtype) * mask
    rewards = token_rewards * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(valid, delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = next_advantage
    advantages = advantages * mask
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


# ------------------------------------------------------------ policy losses ----
def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high, clip_ratio_c):
    """max(-A r, -A clip(r, 1 - low, 1 + high)), then the dual clip for A < 0; (loss, metrics)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"dual-clip constant clip_ratio_c must be > 1, got {clip_ratio_c}")
        floor = -advantages * clip_ratio_c
        negative = advantages < 0
        dual = negative & (loss > floor)
        loss = torch.where(negative, torch.minimum(loss, floor), loss)
    metrics = {"ratio": ratio.detach(), "clipped": (clipped > unclipped).detach().to(loss.dtype),
               "dual_clipped": dual.to(loss.dtype)}
    return loss, metrics


def _require_mask(mask, like: torch.Tensor, loss: str) -> torch.Tensor:
    if mask is None:
        raise TypeError(f"policy loss {loss!r} needs mask= (sequence-level quantities)")
    return mask.to(like.dtype)


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float, *,
                  clip_ratio_c: float | None = None, **options):
    """Token-level PPO-clip: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old).

    clip_eps_high > clip_eps_low is DAPO's clip-higher. clip_ratio_c: dual clip.
    Returns (loss per token, metrics).
    """
    _check_options(options, POLICY_LOSS_OPTIONS)
    ratio = _ratio(logprobs - old_logprobs)
    return _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high, clip_ratio_c)


@register(POLICY_LOSSES, "gspo")
def gspo_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float, *, mask=None,
              clip_ratio_c: float | None = None, **options):
    """GSPO-token (Zheng et al. 2025): the clipped surrogate with the sequence-level ratio.

    s_i = exp(mean over valid tokens of (logp - old)); token ratio
    s_i,t = sg(s_i) exp(logp_t - sg(logp_t)): its value is s_i, its gradient
    s_i grad logp_t. With advantages constant over a sequence and the
    sample_level aggregation this is GSPO's sequence objective. The paper's clip
    ranges are small (3e-4 / 4e-4); pass them in. metrics["seq_ratio"] = s_i.
    """
    _check_options(options, POLICY_LOSS_OPTIONS)
    mask = _require_mask(mask, logprobs, "gspo")
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss, metrics = _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high, clip_ratio_c)
    metrics["seq_ratio"] = torch.exp(seq_log_ratio.detach())[:, None].expand_as(loss)
    return loss, metrics


@register(POLICY_LOSSES, "skip_threshold")
def skip_threshold_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float, *,
                        mask=None, skip_threshold: float = 20.0, clip_ratio_c: float | None = None, **options):
    """PPO-clip that drops samples whose mean importance ratio exceeds skip_threshold.

    From ColossalChat's GRPO PolicyLoss (skip_threshold=20): a sample is
    skipped when the arithmetic mean of r_t = exp(logp_t - old_t) over its
    valid tokens is > skip_threshold; its token losses are set to 0 and
    metrics["skipped"] is 1 on its tokens. ColossalChat decides for a whole
    micro-batch (mean over all positions, padding counting as ratio 1) and
    skips its backward; here the decision is per sample and padding is left
    out. Skipped tokens still count in the aggregation's units unless the
    caller drops them from the mask (mask * (1 - metrics["skipped"])).
    """
    _check_options(options, POLICY_LOSS_OPTIONS)
    mask = _require_mask(mask, logprobs, "skip_threshold")
    ratio = _ratio(logprobs - old_logprobs)
    loss, metrics = _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high, clip_ratio_c)
    with torch.no_grad():
        mean_ratio = (ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        keep = (mean_ratio <= skip_threshold).to(loss.dtype)[:, None]
    metrics["skipped"] = (1.0 - keep).expand_as(loss)
    return loss * keep, metrics


@register(POLICY_LOSSES, "cispo")
def cispo_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float, **options):
    """CISPO (MiniMax-M1, Chen et al. 2025): REINFORCE with a clipped, stop-gradient importance weight.

    loss_t = -sg(min(r_t, 1 + clip_eps_high)) * A_t * logp_t, r_t = exp(logp_t - old_t): every token keeps
    its gradient -w A grad logp (PPO-clip zeroes it where the clip is active); only the weight is capped.
    The paper's lower bound is left off, as in the paper's runs and ms-swift (clip_eps_low is unused).
    ms-swift's `epsilon_high` is the cap itself (clamp(r, max=epsilon_high)): its X is megarl's
    clip_eps_high = X - 1. The value is not a surrogate ratio but -w A logp (ms-swift's too).
    metrics["clipped"]: the weight was capped.
    """
    _check_options(options, POLICY_LOSS_OPTIONS)
    ratio = _ratio(logprobs - old_logprobs)
    cap = 1.0 + clip_eps_high
    weight = torch.clamp(ratio, max=cap).detach()
    loss = -weight * advantages * logprobs
    return loss, {"ratio": ratio.detach(), "clipped": (ratio > cap).detach().to(loss.dtype),
                  "dual_clipped": torch.zeros_like(loss)}


@register(POLICY_LOSSES, "sapo")
def sapo_loss(logprobs, old_logprobs, advantages, clip_eps_low: float, clip_eps_high: float, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05, **options):
    """SAPO (Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347): a sigmoid gate instead of the hard clip.

    loss_t = -f(r_t; tau) A_t, f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else
    tau_neg (ms-swift's defaults 1.0 and 1.05). Its gradient is -4 s (1 - s) r A grad logp, s = sigmoid(tau (r - 1)):
    exactly the policy gradient -A grad logp at r = 1, decaying smoothly as r leaves 1 (faster for larger tau).
    The clip ranges are unused; metrics["clipped"] is 0 (there is no hard clip).
    """
    _check_options(options, POLICY_LOSS_OPTIONS)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    ratio = _ratio(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * advantages
    return loss, {"ratio": ratio.detach(), "clipped": torch.zeros_like(loss).detach(),
                  "dual_clipped": torch.zeros_like(loss).detach()}


def entropy_bonus(entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token term to add to the token loss: -coef * entropy (higher entropy lowers the loss)."""
    return -coef * entropy


def value_loss(values, old_values, returns, mask, clip_range: float):
    """PPO critic loss per token: 0.5 max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    The 0.5 makes the gradient (v - R), as in verl's compute_value_loss and TRL.
    Returns (loss * mask, metrics) with metrics["clipped"] = the clipped term is larger.
    """
    mask = mask.to(values.dtype)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss) * mask
    return loss, {"clipped": (clipped_loss > unclipped_loss).detach().to(values.dtype) * mask}


# --------------------------------------------------------- loss aggregation ----
@register(LOSS_AGGREGATIONS, "token_level")
def token_level(token_loss, mask, max_len=None):
    """Token mean: (sum of valid token losses, number of valid tokens)."""
    mask = mask.to(token_loss.dtype)
    return (token_loss * mask).sum(), mask.sum()


def _valid_rows(mask: torch.Tensor):
    counts = mask.sum(dim=-1)
    return counts, (counts > 0).to(mask.dtype).sum()


@register(LOSS_AGGREGATIONS, "sample_level")
def sample_level(token_loss, mask, max_len=None):
    """Sequence mean of token means: (sum_i mean_t loss_i, samples with a valid token)."""
    mask = mask.to(token_loss.dtype)
    counts, rows = _valid_rows(mask)
    return ((token_loss * mask).sum(dim=-1) / counts.clamp(min=1)).sum(), rows


@register(LOSS_AGGREGATIONS, "seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(token_loss, mask, max_len=None):
    """Dr. GRPO: (sum_i sum_t loss_i / max_len, samples with a valid token).

    max_len is a constant (e.g. max_new_tokens), the same on every micro-batch.
    verl's agg_loss "seq-mean-token-sum-norm" returns sum_i sum_t loss_i / L
    with L the padded width of the batch and no division by the sample count:
    B times this value (a constant factor, i.e. a learning-rate scale), and its
    L varies with the batch. Dr. GRPO's objective keeps the 1/G mean over
    samples, which is what the units give here.
    """
    if not max_len:
        raise ValueError("seq_mean_token_sum_norm needs max_len (e.g. max_new_tokens)")
    mask = mask.to(token_loss.dtype)
    _, rows = _valid_rows(mask)
    return (token_loss * mask).sum() / max_len, rows


# ------------------------------------------------------------------------ KL ----
@register(KL_ESTIMATORS, "k1")
def kl_k1(logprobs, ref_logprobs):
    """k1 = logp - ref: unbiased for KL(pi || ref) under samples of pi; can be negative."""
    return logprobs - ref_logprobs


@register(KL_ESTIMATORS, "abs")
def kl_abs(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).abs()


@register(KL_ESTIMATORS, "mse")
def kl_mse(logprobs, ref_logprobs):
    """k2 = 0.5 (logp - ref)^2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register(KL_ESTIMATORS, "low_var_kl")
def kl_low_var(logprobs, ref_logprobs):
    """k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman), >= 0; verl's clamps: log ratio to
    [-20, 20] and the result to [-10, 10]."""
    log_ratio = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


register(KL_ESTIMATORS, "k2")(kl_mse)  # verl's aliases
register(KL_ESTIMATORS, "k3")(kl_low_var)


@register(KL_ESTIMATORS, "full")
def kl_full(logprobs, ref_logprobs):
    """Exact KL(pi || ref) per token from full-vocabulary log-probs [B, L, V]: sum_v p (log p - log q).

    With a vocabulary-parallel layout each rank passes its shard and gets its
    shard's partial sum; all-reduce it over the tensor-parallel group.
    """
    return (torch.exp(logprobs) * (logprobs - ref_logprobs)).sum(dim=-1)


def kl_penalty_in_reward(token_rewards, kl, coef: float, mask):
    """PPO-style placement: r_t - coef * kl_t on valid tokens (kl is detached: it is a reward)."""
    return (token_rewards - coef * kl.detach()) * mask.to(token_rewards.dtype)


def kl_penalty_in_loss(kl, coef: float):
    """GRPO-style placement: per-token term coef * kl to add to the token loss."""
    return coef * kl


@register(KL_CONTROLLERS, "fixed")
class FixedKLController:
    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@register(KL_CONTROLLERS, "adaptive")
class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019 / verl: coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL controller needs target > 0 and horizon > 0")
        super().__init__(init_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# ---------------------------------------------------------------------- DAPO ----
def dynamic_sampling_keep(group_scores: torch.Tensor, low: float = 0.0, high: float = 1.0,
                          correct_threshold: float = 0.5) -> torch.Tensor:
    """Groups to keep [num_groups] (bool) from scores [num_groups, group_size].

    A group's accuracy is the fraction of its samples with score > correct_threshold;
    it is kept when low < accuracy < high (strict, ColossalChat's filter_range).
    The defaults drop the groups that are all wrong or all right (DAPO), whose
    group-normalised advantages are all 0. For 0/1 rewards this is DAPO's
    "std of the group > 0".
    """
    accuracy = (group_scores > correct_threshold).to(torch.float64).mean(dim=-1)
    return (accuracy > low) & (accuracy < high)


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO eq. 13, per sample: 0 if len <= max_len - cache_len; ((max_len - cache_len) - len) / cache_len
    up to max_len (reaching -1 at max_len); -1 beyond max_len."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    lengths = _floating(lengths)
    expected = max_len - cache_len
    penalty = torch.clamp((expected - lengths) / cache_len, max=0.0)
    return torch.where(lengths > max_len, torch.full_like(penalty, -1.0), penalty)


def truncation_keep(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Samples to keep [B] (bool) when filtering truncated responses: length < max_len.

    A response that used all max_len tokens is treated as truncated, even if its
    last token happens to be EOS (the conservative choice, as in ColossalChat).
    Apply to a token mask as mask * keep[:, None].
    """
    return lengths < max_len


# -------------------------------------------------------- off-policy rollout ----
def truncated_importance_weights(old_logprobs, rollout_logprobs, mask, level: str = "token",
                                 mode: str = "truncate", threshold: float = 2.0,
                                 threshold_low: float | None = None):
    """Importance weights pi_train / pi_rollout correcting rollout-vs-trainer mismatch (verl rollout_is).

    old_logprobs: the trainer's logprobs of the sampled tokens before the update;
    rollout_logprobs: the engine's. Ratio per level: "token" exp(old - rollout);
    "sequence" exp(sum over valid tokens), the product of token ratios;
    "geometric" exp(mean over valid tokens). Log ratios are clamped to [-20, 20].
    mode "truncate" (TIS): w = min(ratio, threshold). mode "mask" (MIS,
    rejection): w = ratio where threshold_low <= ratio <= threshold (default
    threshold_low = 1 / threshold), else 0; verl rejects through the response
    mask, so also drop metrics["masked"] from the loss mask to leave rejected
    tokens out of the aggregation's units. Weights are detached and 0 on padding.

    Returns (weights [B, L], metrics) with per-token tensors: "abs_diff" |old -
    rollout|, "k1" rollout - old and "k3" exp(old - rollout) - (old - rollout) - 1
    (both estimate KL(pi_rollout || pi_train) from rollout samples), "ratio"
    (before bounding), "clipped" (truncate mode: ratio > threshold) and
    "masked" (mask mode: rejected); all 0 on padding.
    """
    with torch.no_grad():
        mask = mask.to(old_logprobs.dtype)
        diff = (old_logprobs - rollout_logprobs) * mask
        if level == "token":
            log_ratio = diff
        elif level == "sequence":
            log_ratio = diff.sum(dim=-1, keepdim=True).expand_as(diff)
        elif level == "geometric":
            log_ratio = (diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1))[:, None].expand_as(diff)
        else:
            raise ValueError(f"unknown importance-weight level {level!r} (token, sequence, geometric)")
        ratio = _ratio(log_ratio)
        zeros = torch.zeros_like(ratio)
        if mode == "truncate":
            weights, clipped, masked = torch.clamp(ratio, max=threshold), (ratio > threshold).to(ratio.dtype), zeros
        elif mode == "mask":
            low = 1.0 / threshold if threshold_low is None else threshold_low
            keep = ((ratio >= low) & (ratio <= threshold)).to(ratio.dtype)
            weights, clipped, masked = ratio * keep, zeros, 1.0 - keep
        else:
            raise ValueError(f"unknown importance-weight mode {mode!r} (truncate, mask)")
        metrics = {"abs_diff": diff.abs(), "k1": -diff, "k3": (torch.exp(diff) - diff - 1.0) * mask,
                   "ratio": ratio * mask, "clipped": clipped * mask, "masked": masked * mask}
        return weights * mask, metrics



# -------------------------------------------------------------- distillation ----
# Conventions: the module docstring, section Distillation.

GKD_TOPK_MODES = Registry("GKD top-k mode")

LOGPROB_FLOOR = -1e4  # log-probs below this are floored (exp(-1e4) == 0 in float32)
GKD_TAIL_MASS_FLOOR = 1e-7  # tail-bin masses are at least this (about float32 resolution of 1 - sum)


def _check_gkd(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gkd beta must be in [0, 1], got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"gkd temperature must be > 0, got {temperature}")


def _floor_student(logprobs: torch.Tensor, floor: float = LOGPROB_FLOOR) -> torch.Tensor:
    """max(logprobs, floor) in value; the gradient of logprobs where it is finite (straight-through), 0 at -inf."""
    floored = logprobs.clamp(min=floor)
    straight = torch.where(torch.isfinite(logprobs), logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    return floored.detach() + straight


def _floor_teacher(logprobs: torch.Tensor) -> torch.Tensor:
    return _floating(logprobs.detach()).clamp(min=LOGPROB_FLOOR)


def _kl_terms(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-bin p (log p - log q) for finite (floored) log-probs; p == 0 gives 0 and gradient 0."""
    return torch.exp(logp) * (logp - logq)


def generalized_jsd_terms(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          beta: float) -> torch.Tensor:
    """Per-bin terms [..., N] of the generalised JSD (see the section's conventions); sum them for the loss.

    beta == 0: KL(teacher || student); beta == 1: KL(student || teacher); else
    beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta P_t + (1 - beta) P_s.
    Both inputs are normalised log-probs over the same bins (a shard of them for
    a vocabulary-parallel caller).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gkd beta must be in [0, 1], got {beta}")
    ls = _floor_student(_floating(student_logprobs))
    lt = _floor_teacher(teacher_logprobs).to(ls.dtype)
    if beta == 0:
        return _kl_terms(lt, ls)
    if beta == 1:
        return _kl_terms(ls, lt)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * _kl_terms(lt, lm) + (1.0 - beta) * _kl_terms(ls, lm)


def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta over the last dimension's bins: [..., N] log-probs -> [...]."""
    return generalized_jsd_terms(student_logprobs, teacher_logprobs, beta).sum(dim=-1)


def distill_full(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                 temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary GKD loss per position [...] from logits [..., V]: JSD_beta of softmax(logits / T)."""
    _check_gkd(beta, temperature)
    ls = torch.log_softmax(_floating(student_logits) / temperature, dim=-1)
    lt = torch.log_softmax(_floating(teacher_logits.detach()) / temperature, dim=-1)
    return generalized_jsd(ls, lt, beta)


def topk_renorm_bins(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor):
    """(student, teacher) log-probs over the K teacher ids, each renormalised over them. The student's
    may be normalised over the whole vocabulary or not: renormalising removes the difference."""
    return (torch.log_softmax(_floating(student_topk_logprobs), dim=-1),
            torch.log_softmax(_floor_teacher(teacher_topk_logprobs), dim=-1))


def topk_tail_bins(student_topk_logprobs: torch.Tensor, student_tail_logprob: torch.Tensor | None,
                   teacher_topk_logprobs: torch.Tensor):
    """(student, teacher) log-probs over K + 1 bins: the K teacher ids (normalised over the whole
    vocabulary) and each side's tail [..., 1]; student_tail_logprob None means K == V (no tail bin)."""
    ls, lt = _floating(student_topk_logprobs), _floor_teacher(teacher_topk_logprobs)
    if student_tail_logprob is None:
        return ls, lt.to(ls.dtype)
    tail = _floor_student(_floating(student_tail_logprob), math.log(GKD_TAIL_MASS_FLOOR))
    return (torch.cat([ls, tail], dim=-1),
            torch.cat([lt, teacher_tail_logprob(teacher_topk_logprobs).to(lt.dtype)], dim=-1).to(ls.dtype))


def topk_divergence(student_topk_logprobs: torch.Tensor, student_tail_logprob: torch.Tensor | None,
                    teacher_topk_logprobs: torch.Tensor, beta: float, mode: str) -> torch.Tensor:
    """GKD_TOPK_MODES[mode]'s loss [...] from the student's log-probs at the teacher's ids (normalised
    over the whole vocabulary) and its tail log-mass [...] (None when K == V): for callers that
    compute those without the full logits (vocabulary-parallel, fused kernels)."""
    if mode == "renorm":
        return generalized_jsd(*topk_renorm_bins(student_topk_logprobs, teacher_topk_logprobs), beta)
    if mode != "tail":
        raise ValueError(f"unknown gkd top-k mode {mode!r} (renorm, tail)")
    tail = None if student_tail_logprob is None else student_tail_logprob[..., None]
    return generalized_jsd(*topk_tail_bins(student_topk_logprobs, tail, teacher_topk_logprobs), beta)


@register(GKD_TOPK_MODES, "renorm")
def distill_topk_renorm(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor,
                        teacher_topk_logprobs: torch.Tensor, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Top-k GKD loss [...] over the K teacher ids, both sides renormalised over them (ms-swift)."""
    _check_gkd(beta, temperature)
    student = torch.gather(_floating(student_logits), -1, teacher_topk_ids.long()) / temperature
    return generalized_jsd(*topk_renorm_bins(student, teacher_topk_logprobs), beta)


def teacher_tail_logprob(teacher_topk_logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(lt)) [..., 1], the teacher's mass outside its top-k, floored at GKD_TAIL_MASS_FLOOR."""
    lt = teacher_topk_logprobs.detach().to(torch.float64)
    mass = -torch.expm1(torch.logsumexp(lt, dim=-1, keepdim=True).clamp(max=0.0))
    out_dtype = torch.promote_types(teacher_topk_logprobs.dtype, torch.float32)
    return torch.log(mass.clamp(min=GKD_TAIL_MASS_FLOOR)).to(out_dtype)


@register(GKD_TOPK_MODES, "tail")
def distill_topk_tail(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor,
                      teacher_topk_logprobs: torch.Tensor, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Top-k GKD loss [...] over K + 1 bins: the teacher's K ids unrenormalised, plus a tail bin per side."""
    _check_gkd(beta, temperature)
    ids = teacher_topk_ids.long()
    scaled = _floating(student_logits) / temperature
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    tail = None
    if ids.shape[-1] < scaled.shape[-1]:
        in_topk = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, ids, True)
        # finfo.min, not -inf (also for -inf logits): a remainder with no finite logit gives a finite
        # (then floored) log-mass and no NaN gradient from logsumexp's backward
        lowest = torch.finfo(scaled.dtype).min
        rest = scaled.clamp(min=lowest).masked_fill(in_topk, lowest)
        tail = torch.logsumexp(rest, dim=-1, keepdim=True) - lse
    bins = topk_tail_bins(torch.gather(scaled, -1, ids) - lse, tail, teacher_topk_logprobs)
    return generalized_jsd(*bins, beta)


def distill_support(topk: int, mode: str = "renorm"):
    """The loss function for --gkd-logits-topk topk (0 = full vocabulary) and --gkd-topk-mode mode."""
    if topk < 0:
        raise ValueError(f"gkd_logits_topk must be >= 0 (0 = full vocabulary), got {topk}")
    if topk == 0:
        return distill_full
    if mode not in GKD_TOPK_MODES:
        raise ValueError(f"unknown gkd top-k mode {mode!r} ({', '.join(sorted(GKD_TOPK_MODES))})")
    return GKD_TOPK_MODES[mode]


@torch.no_grad()
def student_topk_mass(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """The student's probability mass [...] on the teacher's top-k ids, at temperature T (a metric)."""
    scaled = _floating(student_logits) / temperature
    top = torch.gather(scaled, -1, teacher_topk_ids.long())
    return torch.exp(torch.logsumexp(top, dim=-1) - torch.logsumexp(scaled, dim=-1))


@torch.no_grad()
def distill_token_rewards(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token rewards -(log pi_s(y_t) - log pi_t(y_t)) of the sampled tokens (negative k1 reverse KL).

    Detached; multiplied by mask when given (0 on padding).
    """
    rewards = _floating(teacher_logprobs) - _floating(student_logprobs)
    if mask is not None:
        rewards = rewards * mask.to(rewards.dtype)
    return rewards


# ------------------------------------------------------------------ presets ----------
# --algo NAME: the algorithm options of examples/<name>.yaml (what tests/test_presets.py trains), applied
# where the config and the command line leave them unset. A value may be a function of the parsed options.
PRESETS: dict[str, dict] = {
    "grpo": {"advantage_estimator": "grpo", "scale_rewards": "group", "policy_loss": "ppo_clip",
             "clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "sample_level", "kl_coef": 0.001,
             "kl_estimator": "low_var_kl"},
    "dapo": {"advantage_estimator": "grpo", "scale_rewards": "group", "policy_loss": "ppo_clip",
             "clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg": "token_level", "kl_coef": 0.0,
             "dynamic_sampling": [0.01, 0.99], "max_num_gen_batches": 4, "filter_truncated": True,
             # soft overlong punishment over the last quarter of the response (at most 1024 tokens), as
             # ColossalChat's DAPO setting does
             "overlong_buffer_len": lambda args: min(1024, args.max_new_tokens // 4)},
    "drgrpo": {"advantage_estimator": "grpo", "scale_rewards": "none", "policy_loss": "ppo_clip",
               "clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "seq_mean_token_sum_norm", "kl_coef": 0.0},
    "ppo": {"advantage_estimator": "gae", "gamma": 1.0, "lam": 0.95, "policy_loss": "ppo_clip",
            "clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "token_level", "kl_coef": 0.001,
            "kl_estimator": "k1", "kl_placement": "reward", "kl_controller": "adaptive", "kl_target": 0.05,
            "kl_horizon": 10000.0, "value_clip": 0.5},
}


def preset(name: str, args) -> dict:
    """The options of preset `name`, callables evaluated on `args`."""
    return {dest: value(args) if callable(value) else value for dest, value in PRESETS[name].items()}
