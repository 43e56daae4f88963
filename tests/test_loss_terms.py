"""An independent check of every loss term as the trainer composes it (issue 51, item 3).

Each test computes a term by its formula, written out here in float64 (torch autograd on float64 copies
for the reference gradients), and compares it with what megarl computes, on inputs where a wrong sign, a
missing mask, swapped arguments or an ignored flag change the result by O(1): logprobs that differ by
O(0.5), importance weights far from 1 on both sides of their cap, extreme values (1e4, -50, +-1e3) on
every position a mask must drop, vocabulary-padding columns holding the largest logits. Run-vs-run parity
(two megarl paths agreeing) passes a bug both sides share; these do not. What they guard:

  * the policy term of `loss.ActorLoss` with TIS / MIS importance weights (token, sequence, geometric;
    truncate and mask modes; the two-pass path, where `phases.prepare` sets them from the old and rollout
    logprobs, and the on-policy shortcut, where the loss computes them from its own detached logprobs),
    --policy-loss-coef, the loss mask and the three aggregations;
  * the distillation term (full vocabulary, top-k renorm and tail; forward KL, reverse KL, JSD_beta;
    --gkd-temperature) in value and gradient, alone and inside ActorLoss with --distill-coef, and that one
    SGD step on it lowers the divergence to the teacher (a step on the negated loss raises it);
  * the distillation reward (--distill-reward-coef) and the KL penalty in the reward (--kl-placement
    reward, each sampled-token estimator) as `phases.prepare` / `phases.compute_advantages` place them;
  * the KL penalty in the loss (k1, abs, mse, low_var_kl, full) and the entropy bonus in ActorLoss;
  * gradient clipping (--clip-grad) in a real optimizer step, and activation recomputation
    (--recompute-granularity/-method/-num-layers) shown running.

Tolerances: an fp32 result against its float64 reference is judged by the fp32 rule of tests/helpers.py
(FP32_ULPS ulps of the compared tensor's largest magnitude: the rounding of sums of a few hundred fp32
terms); a float64 result against a float64 reference by FP64_RTOL. A wrong term misses by a relative
O(1e-2) to O(1), i.e. 1e5+ fp32 ulps.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import EPS32, FP32_ULPS, micro_batches, nll, ulps

VOCAB = 16  # the vocabulary the losses are told about
PADDED = 20  # the logits' width: Megatron pads the vocabulary; the padding columns hold the largest logits
PAD_LOGIT = 30.0  # if a padding column entered a softmax it would take almost all of its mass
# Float64 against float64: the two computations round differently in the last bits of sums of at most a
# few hundred terms (< 1e-13 relative); a wrong formula misses by > 1e-3.
FP64_RTOL = 1e-10
# Values on positions a mask must drop: any of them reaching a loss, a weight or a reward changes it by O(1e3+).
HUGE_ADVANTAGE, LOW_LOGPROB, FAR = 1e4, -50.0, 1e3

# Five samples: prompt ids, response length. With max_new_tokens 6 and --filter-truncated the last one
# (6 tokens) leaves the loss mask but stays in the response mask (its weights, rewards and KL still exist).
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 3], [5]]
LENGTHS = [5, 3, 4, 2, 6]
MAX_NEW = 6
# Per-sample total log ratio log(pi_old / pi_rollout) over its tokens (lengths 5, 3, 4, 2; the filtered one 6).
# With --tis-threshold 2 (log 2 = 0.69) both levels take every branch: the products exp(total) are inside
# (1/2, 2), below, above, above; the geometric means exp(total / length) inside, below, inside, above.
SEQUENCE_LOG_RATIO = [0.45, -2.4, 1.4, 1.6, 1.1]
THRESHOLD = 2.0


@pytest.fixture(scope="module")
def world(megatron_rank):
    """Megatron's parallel state at TP = PP = DP = 1 in this process (conftest's megatron_rank)."""
    yield


def base_args(model, *flags):
    from megarl.arguments import parse_args

    return parse_args(["--model", model, "--max-new-tokens", str(MAX_NEW), *flags], world_size=1)


# ------------------------------------------------------------------------------------- references ----
def kl_sum(p, q):
    """sum p log(p / q) over the last axis (float64; every p here is > 0)."""
    return (p * (p.log() - q.log())).sum(-1)


def jsd(p_student, p_teacher, beta):
    """TRL's / ms-swift's generalised JSD from probabilities: beta 0 = KL(teacher || student), 1 = KL(student ||
    teacher), else beta KL(teacher || M) + (1 - beta) KL(student || M) with M = beta P_t + (1 - beta) P_s."""
    if beta == 0:
        return kl_sum(p_teacher, p_student)
    if beta == 1:
        return kl_sum(p_student, p_teacher)
    m = beta * p_teacher + (1 - beta) * p_student
    return beta * kl_sum(p_teacher, m) + (1 - beta) * kl_sum(p_student, m)


def divergence(kind, student, teacher, beta, temperature, ids=None, teacher_topk_logprobs=None):
    """The GKD loss per position from float64 student logits [..., V] (differentiable) and the teacher:
    its logits [..., V] (full) or its top-k ids and full-vocabulary log-probs at T (renorm, tail)."""
    p = torch.softmax(student / temperature, dim=-1)
    if kind == "full":
        return jsd(p, torch.softmax(teacher / temperature, dim=-1), beta)
    p_top, q_top = p.gather(-1, ids), teacher_topk_logprobs.exp()
    if kind == "renorm":
        return jsd(p_top / p_top.sum(-1, keepdim=True), q_top / q_top.sum(-1, keepdim=True), beta)
    outside = torch.ones_like(p, dtype=torch.bool).scatter(-1, ids, False)  # the student's tail, summed directly
    p_bins = torch.cat([p_top, (p * outside).sum(-1, keepdim=True)], dim=-1)
    q_bins = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=-1)
    return jsd(p_bins, q_bins, beta)


def tis_weights(old, rollout, response_mask, level, mode, threshold):
    """(weights, kept) [N, R] float64: pi_old / pi_rollout per token, or its product / geometric mean over each
    sample's response tokens; truncate: min(ratio, threshold); mask: ratio where 1/threshold <= ratio <=
    threshold, else rejected (weight 0, kept 0)."""
    log_ratio = (old - rollout) * response_mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old)
    elif level == "geometric":
        log_ratio = (log_ratio.sum(-1) / response_mask.sum(-1))[:, None].expand_as(old)
    ratio = log_ratio.exp()
    if mode == "truncate":
        return torch.minimum(ratio, torch.tensor(threshold, dtype=ratio.dtype)) * response_mask, response_mask
    kept = ((ratio >= 1 / threshold) & (ratio <= threshold)).to(ratio.dtype) * response_mask
    return ratio * kept, kept


KL_FORMULAS = {  # per token from the policy's and the reference's sampled-token logprobs
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: (lp - ref).abs(),
    "mse": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "low_var_kl": lambda lp, ref: torch.exp(ref - lp) - (ref - lp) - 1,  # k3; verl's clamps not reached here
}


def aggregate(token_loss, mask, how):
    """LOSS_AGGREGATIONS by their definitions: token mean; mean over samples (with a loss token) of their token
    mean; Dr. GRPO's sum / max_new_tokens, mean over samples."""
    rows = (mask.sum(-1) > 0).sum()
    if how == "token_level":
        return (token_loss * mask).sum() / mask.sum()
    if how == "sample_level":
        return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / rows
    return (token_loss * mask).sum() / MAX_NEW / rows


# ---------------------------------------------------------------------------------------- inputs ----
def case(seed, ref_logits=False, teacher=False):
    """Samples, fp32 logits [N, L, PADDED] (a leaf), and response-aligned float64 per-token tensors:
    the noise that makes the old, rollout and reference logprobs from the policy's, and advantages; with
    `ref_logits` / `teacher` also a reference's and a teacher's logits [N, L, PADDED].
    The old logprobs are within 0.35 of the policy's (PPO ratios on both sides of the clip range), the rollout
    ones differ from the old by O(0.5-1) with the per-sample totals SEQUENCE_LOG_RATIO."""
    from megarl.samples import Sample

    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    samples = [Sample(0, p, r, "", [0.0] * len(r), False, reward=float(i % 3)) for i, (p, r) in
               enumerate(zip(PROMPTS, responses))]
    n, width = len(samples), max(LENGTHS)
    rows = max(len(p) + r for p, r in zip(PROMPTS, LENGTHS))
    logits = torch.randn(n, rows, PADDED, generator=g) * 1.5
    logits[..., VOCAB:] = PAD_LOGIT
    logits.requires_grad_()
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    extra = {}
    if ref_logits:
        extra["ref_logits"] = torch.randn(n, rows, PADDED, generator=g) * 1.5
        extra["ref_logits"][..., VOCAB:] = PAD_LOGIT
    if teacher:
        extra["teacher_logits"] = torch.randn(n, rows, PADDED, generator=g) * 2.0
        extra["teacher_logits"][..., VOCAB:] = PAD_LOGIT
    old_noise = (torch.rand(n, width, generator=g, dtype=torch.float64) - 0.5) * 0.7
    tis_noise = (torch.rand(n, width, generator=g, dtype=torch.float64) - 0.5) * 2.0
    ref_noise = (torch.rand(n, width, generator=g, dtype=torch.float64) - 0.5) * 1.6
    advantages = torch.randn(n, width, generator=g, dtype=torch.float64)
    # the token log ratios old - rollout: noise in (-1, 1), shifted so that each sample's total is its target
    tis_noise = tis_noise * mask
    shift = (torch.tensor(SEQUENCE_LOG_RATIO, dtype=torch.float64) - tis_noise.sum(-1)) / mask.sum(-1)
    old_minus_rollout = (tis_noise + shift[:, None]) * mask
    return SimpleNamespace(samples=samples, logits=logits, mask=mask, old_noise=old_noise * mask,
                           old_minus_rollout=old_minus_rollout, ref_noise=ref_noise * mask,
                           advantages=advantages * mask, **extra)


def gather_positions(c, x):
    """[N, L, ...] position-aligned (row i = sample i, right-padded) -> [N, R, ...] response-aligned: response
    token j of sample i is scored at position len(prompt_i) - 1 + j."""
    out = torch.zeros(len(c.samples), max(LENGTHS), *x.shape[2:], dtype=x.dtype)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        out[i, :n] = x[i, len(prompt) - 1: len(prompt) - 1 + n]
    return out


def policy_stats(c, temperature=1.0):
    """(logits64 leaf [N, L, V], logprobs of the sampled tokens [N, R], entropy [N, R]) in float64, from the
    first VOCAB columns only."""
    logits64 = c.logits.detach().double()[..., :VOCAB].clone().requires_grad_()
    logp = torch.log_softmax(gather_positions(c, logits64) / temperature, dim=-1)
    labels = torch.zeros(len(c.samples), max(LENGTHS), dtype=torch.long)
    for i, s in enumerate(c.samples):
        labels[i, :len(s.response_ids)] = torch.tensor(s.response_ids)
    token = logp.gather(-1, labels[..., None])[..., 0] * c.mask
    entropy = -(logp.exp() * logp).sum(-1) * c.mask
    return logits64, token, entropy


def make_batch(c, args, lp, ref=False, topk=None):
    """The Batch as `prepare` leaves it (old, rollout, reference logprobs; TIS weights by the flags), fp32,
    with extreme values on the response-aligned padding columns."""
    from megarl import phases
    from megarl.batch import score_and_filter

    batch, _ = score_and_filter(c.samples, MAX_NEW, filter_truncated=True)
    pad = 1 - c.mask
    old = lp.detach() + c.old_noise
    batch.old_logprobs = (old + FAR * pad).float()
    batch.rollout_logprobs = (old - c.old_minus_rollout - FAR * pad).float()
    batch.advantages = (c.advantages + HUGE_ADVANTAGE * pad).float()
    truncated = batch.response_mask - batch.loss_mask  # the filtered sample's tokens: in no loss
    assert truncated.sum() == LENGTHS[-1]
    batch.advantages = batch.advantages + HUGE_ADVANTAGE * truncated
    if ref:
        batch.ref_logprobs = (lp.detach() + c.ref_noise + LOW_LOGPROB * pad).float()
    if topk is not None:
        batch.teacher_topk_ids, batch.teacher_topk_logprobs = topk
    phases._rollout_correction(args, batch)  # what prepare does with --tis-level/--tis-mode/--tis-threshold
    return batch


def one_micro_batch(batch):
    """The batch as one right-padded micro-batch, with extreme values wherever its loss mask is 0 (prompt
    positions, row padding, the filtered sample, tokens mask-mode TIS rejected)."""
    from megarl.model_runner import make_micro_batches

    (micro_batch,) = make_micro_batches(batch, len(batch), 0)
    off = micro_batch.loss_mask == 0
    for name, value in (("advantages", HUGE_ADVANTAGE), ("old_logprobs", LOW_LOGPROB),
                        ("ref_logprobs", LOW_LOGPROB), ("is_weights", HUGE_ADVANTAGE)):
        if name in micro_batch.fields:
            micro_batch.fields[name] = micro_batch.fields[name].masked_fill(off, value)
    return micro_batch


def run_actor_loss(args, micro_batch, logits, terms, companions=None):
    """ActorLoss on one micro-batch: the loss value (numerator / units) and the gradient on the logits."""
    from megarl.loss import ActorLoss

    loss = ActorLoss(args, VOCAB, terms, output_weight=lambda: None)
    logits.grad = None
    numerator, units, _ = loss(micro_batch, logits, companions or {})
    value = numerator / units
    value.backward()
    return value.detach(), logits.grad.detach().clone()


def assert_matches(value, grad, expected, logits64, token_scale, what):
    """megarl's fp32 loss and logits gradient against the float64 reference. The loss is a mean of per-token
    terms whose signs differ: its rounding is relative to the largest term (`token_scale`), not to the mean.
    The padding columns of the vocabulary get no gradient at all."""
    (expected_grad,) = torch.autograd.grad(expected, logits64)
    error = abs(float(value) - expected.item()) / (EPS32 * token_scale)
    assert error <= FP32_ULPS, f"{what}: loss {float(value)!r} vs {expected.item()!r} ({error:.0f} ulps)"
    assert torch.equal(grad[..., VOCAB:], torch.zeros_like(grad[..., VOCAB:])), f"{what}: vocabulary padding"
    error = ulps(grad[..., :VOCAB], expected_grad)
    assert error <= FP32_ULPS, f"{what}: gradient {error:.0f} ulps of its scale"


def assert_visible(term, token_loss, loss_mask, what):
    """A term's share of the loss is at least 10 x the value tolerance of `assert_matches`: leaving it out,
    flipping its sign or its coefficient cannot pass as rounding."""
    scale = float((token_loss.detach() * loss_mask).abs().max())
    assert abs(float(term)) > 10 * FP32_ULPS * EPS32 * scale, f"{what}: {float(term):.2e} too small to show"


def assert_margins(ratio, edges, mask, what):
    """No ratio within fp32 reach of a branch edge (cap, clip bound): fp32 and float64 take the same branch."""
    for edge in edges:
        gap = ((ratio - edge).abs() + (1 - mask) * 1e9).min()
        assert gap > 1e-4, f"{what}: a ratio {float(gap):.1e} from {edge}; pick other inputs"


def clipped_surrogate(c, lp):
    """The PPO-clip surrogate (eps 0.2) of case `c`'s tokens against its old logprobs (ratios asserted away from
    the clip's edges), and the loss mask: the response mask less the last sample (--filter-truncated)."""
    ratio = torch.exp(lp - (lp.detach() + c.old_noise))
    assert_margins(ratio.detach(), [0.8, 1.2], c.mask, "PPO ratio")
    loss_mask = c.mask.clone()
    loss_mask[-1] = 0
    return torch.maximum(-c.advantages * ratio, -c.advantages * ratio.clamp(0.8, 1.2)), loss_mask


# ------------------------------------------------------------------------- 1. policy term with TIS ----
TIS_CASES = [  # (level, mode, aggregation, kernels, --temperature)
    ("token", "truncate", "token_level", "naive", 1.0),
    ("token", "mask", "sample_level", "chunked", 0.7),
    ("sequence", "truncate", "sample_level", "naive", 0.7),
    ("sequence", "mask", "token_level", "chunked", 1.0),
    ("geometric", "truncate", "seq_mean_token_sum_norm", "chunked", 1.0),
    ("geometric", "mask", "token_level", "naive", 1.0),
    ("none", "truncate", "token_level", "chunked", 1.0),
]


@pytest.mark.parametrize("level,mode,agg,kernels,temperature", TIS_CASES)
def test_policy_term_with_importance_weights(world, tiny_model, level, mode, agg, kernels, temperature):
    """Two-pass path: prepare's TIS weights from old vs rollout logprobs (the sampler's ratio pi_old / pi_rollout,
    capped at --tis-threshold, or rejected outside [1/threshold, threshold] in mask mode, the rejected tokens
    leaving the loss mask and the aggregation's units), detached, multiplying the PPO-clip loss of each token;
    x --policy-loss-coef; aggregated over the loss mask. Catches: weights ignored or inverted (rollout / old),
    a token ratio used at sequence level, the cap not applied, rejected tokens left in the units, the ratio
    taken against the rollout instead of the old logprobs, the mask or --temperature ignored."""
    from megarl.loss import LossTerms

    args = base_args(tiny_model, "--kernels", kernels, "--tis-level", level, "--tis-mode", mode, "--tis-threshold",
                     str(THRESHOLD), "--loss-agg", agg, "--temperature", str(temperature), "--policy-loss-coef",
                     "0.6", "--clip-eps-low", "0.2", "--clip-eps-high", "0.28")
    c = case(1)
    logits64, lp, _ = policy_stats(c, temperature)
    batch = make_batch(c, args, lp)
    value, grad = run_actor_loss(args, one_micro_batch(batch), c.logits, LossTerms())

    old = lp.detach() + c.old_noise
    rollout = old - c.old_minus_rollout
    response = c.mask
    loss_mask = response.clone()
    loss_mask[-1] = 0  # --filter-truncated
    if level == "none":
        weights, kept = response, response
    else:
        weights, kept = tis_weights(old, rollout, response, level, mode, THRESHOLD)
        log_ratio = (old - rollout) * response  # every branch taken (above the cap, inside, below 1 / cap)
        if level != "token":
            log_ratio = log_ratio.sum(-1, keepdim=True) / (response.sum(-1, keepdim=True) if level == "geometric"
                                                           else 1)
        raw = log_ratio.exp().expand_as(old)[loss_mask > 0]
        assert (raw > THRESHOLD).any() and ((raw < THRESHOLD) & (raw > 1 / THRESHOLD)).any()
        assert (raw < 1 / THRESHOLD).any()
        assert_margins(raw, [THRESHOLD, 1 / THRESHOLD], torch.ones_like(raw), "TIS ratio")
    loss_mask = loss_mask * kept
    ratio = torch.exp(lp - old)
    assert_margins(ratio.detach(), [0.8, 1.28], response, "PPO ratio")
    clipped = ratio.clamp(1 - 0.2, 1 + 0.28)
    outside = (ratio.detach() != clipped.detach()) & (loss_mask > 0)
    assert outside.any() and ((~outside) & (loss_mask > 0)).any()  # some tokens clipped, some not
    pg = torch.maximum(-c.advantages * ratio, -c.advantages * clipped)
    token_loss = 0.6 * pg * weights
    expected = aggregate(token_loss, loss_mask, agg)
    scale = float((token_loss.detach() * loss_mask).abs().max())
    assert_matches(value, grad, expected, logits64, scale, f"{level}/{mode}/{agg}/{kernels}")


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_policy_term_on_policy_importance_weights(world, tiny_model, level):
    """On-policy shortcut: the old logprobs are this forward's own, detached (ratio 1, loss -A per token, gradient
    -A d log pi), and the TIS weight min(pi / pi_rollout, cap) is computed from them, detached, per micro-batch of
    whole sequences. Catches: weights left attached to the graph (a gradient term w log w), taken from the
    rollout over the trainer (inverted), not capped, or dropped."""
    from megarl.loss import LossTerms
    from megarl.batch import score_and_filter

    args = base_args(tiny_model, "--kernels", "chunked", "--tis-level", level, "--tis-threshold", str(THRESHOLD),
                     "--loss-agg", "token_level")
    c = case(2)
    logits64, lp, _ = policy_stats(c)
    batch, _ = score_and_filter(c.samples, MAX_NEW, filter_truncated=True)
    pad = 1 - c.mask
    rollout = lp.detach() - c.old_minus_rollout
    batch.rollout_logprobs = (rollout - FAR * pad).float()
    batch.advantages = (c.advantages + HUGE_ADVANTAGE * (pad + batch.response_mask - batch.loss_mask)).float()
    micro_batch = one_micro_batch(batch)
    value, grad = run_actor_loss(args, micro_batch, c.logits, LossTerms(on_policy=True))

    weights, _ = tis_weights(lp.detach(), rollout, c.mask, level, "truncate", THRESHOLD)
    live = weights[:-1][c.mask[:-1] > 0]  # the samples in the loss: capped, above 1, below 1
    assert ((live > 1.2) & (live < THRESHOLD)).any() and (live == THRESHOLD).any() and (live < 0.8).any()
    loss_mask = c.mask.clone()
    loss_mask[-1] = 0
    token_loss = -c.advantages * torch.exp(lp - lp.detach()) * weights
    expected = aggregate(token_loss, loss_mask, "token_level")
    assert_matches(value, grad, expected, logits64, float((token_loss.detach() * loss_mask).abs().max()),
                   f"on-policy {level}")


# ----------------------------------------------------------------- 4./5. KL in the loss, entropy ----
@pytest.mark.parametrize("estimator,kernels", [("k1", "naive"), ("abs", "chunked"), ("mse", "naive"),
                                               ("low_var_kl", "chunked"), ("full", "naive"), ("full", "chunked")])
def test_kl_in_the_loss(world, tiny_model, estimator, kernels):
    """--kl-placement loss: kl_coef x KL(pi || ref) per token added to the policy loss, the estimator on
    (policy, reference) logprobs that differ by up to 0.8, or the exact KL over the vocabulary (full) from the
    reference's logits; differentiable in the policy. Catches: the estimator's arguments swapped (k1, k3), the
    sign or the coefficient wrong, the KL detached, the mask ignored, the vocabulary padding in the full KL."""
    from megarl.loss import LossTerms

    args = base_args(tiny_model, "--kernels", kernels, "--kl-estimator", estimator, "--loss-agg", "sample_level")
    c = case(3, ref_logits=True)
    logits64, lp, _ = policy_stats(c)
    batch = make_batch(c, args, lp, ref=True)
    micro_batch = one_micro_batch(batch)
    companions = {"ref": c.ref_logits} if estimator == "full" else {}
    coef = 0.3
    value, grad = run_actor_loss(args, micro_batch, c.logits, LossTerms(kl_coef=coef), companions)

    ref = lp.detach() + c.ref_noise
    if estimator == "full":
        p = torch.softmax(gather_positions(c, logits64), -1)
        q = torch.softmax(gather_positions(c, c.ref_logits.double()[..., :VOCAB]), -1)
        kl = kl_sum(p, q) * c.mask
    else:
        kl = KL_FORMULAS[estimator](lp, ref) * c.mask
    pg, loss_mask = clipped_surrogate(c, lp)
    token_loss = pg + coef * kl
    expected = aggregate(token_loss, loss_mask, "sample_level")
    assert_matches(value, grad, expected, logits64, float((token_loss.detach() * loss_mask).abs().max()),
                   f"KL {estimator}")
    assert_visible(aggregate(coef * kl.detach(), loss_mask, "sample_level"), token_loss, loss_mask, "KL term")


@pytest.mark.parametrize("kernels", ["naive", "chunked"])
def test_entropy_bonus_in_the_loss(world, tiny_model, kernels):
    """--entropy-coef c: -c x H(pi) per token (more entropy, less loss), H of softmax(logits / T) over the
    vocabulary without its padding, with its gradient, beside the policy loss x --policy-loss-coef. Catches:
    +c H, the coefficient ignored, the entropy detached (the naive path computes it under no_grad unless the
    coefficient is set), padding columns in the softmax."""
    from megarl.loss import LossTerms

    args = base_args(tiny_model, "--kernels", kernels, "--entropy-coef", "0.25", "--policy-loss-coef", "0.5",
                     "--loss-agg", "token_level")
    c = case(4)
    logits64, lp, entropy = policy_stats(c)
    batch = make_batch(c, args, lp)
    value, grad = run_actor_loss(args, one_micro_batch(batch), c.logits, LossTerms())

    pg, loss_mask = clipped_surrogate(c, lp)
    token_loss = 0.5 * pg - 0.25 * entropy
    expected = aggregate(token_loss, loss_mask, "token_level")
    assert_matches(value, grad, expected, logits64, float((token_loss.detach() * loss_mask).abs().max()),
                   f"entropy {kernels}")
    assert_visible(aggregate(0.25 * entropy.detach(), loss_mask, "token_level"), token_loss, loss_mask, "entropy")


# ----------------------------------------------------------------------------- 2. distillation ----
DISTILL_KINDS = [("full", 0), ("renorm", 5), ("tail", 5)]


def teacher_topk(teacher_logits, k, temperature):
    """The teacher's top-k ids by probability and their log-probs of the full softmax(t / T) (vocabulary
    without padding): what the teacher phase gives the batch."""
    logprobs = torch.log_softmax(teacher_logits.double()[..., :VOCAB] / temperature, dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1)
    return ids, values


@pytest.mark.parametrize("kind,k", DISTILL_KINDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kernels", ["naive", "chunked"])
def test_distillation_term_in_the_loss(world, tiny_model, kind, k, beta, kernels):
    """ActorLoss with a teacher: --policy-loss-coef x PPO + --distill-coef x GKD(student || teacher) per token, at
    --gkd-temperature 0.8, from the teacher's logits (full vocabulary) or its top-k fields. Catches: the
    student and teacher swapped, the beta convention inverted (0 must be KL(teacher || student)), the
    coefficients or the temperature ignored, the teacher's padding columns in its softmax."""
    from megarl.loss import LossTerms

    temperature = 0.8
    args = base_args(tiny_model, "--kernels", kernels, "--loss-agg", "token_level", "--policy-loss-coef", "0.4")
    # the flags' values, set after parsing: their validation wants a teacher model, which ActorLoss does not read
    args.distill_coef, args.gkd_beta, args.gkd_temperature = 1.7, beta, temperature
    args.gkd_logits_topk, args.gkd_topk_mode = k, "renorm" if kind == "full" else kind
    c = case(5, teacher=True)
    logits64, lp, _ = policy_stats(c)
    teacher = gather_positions(c, c.teacher_logits)  # [N, R, PADDED]
    topk = None
    if k:
        ids, values = teacher_topk(teacher, k, temperature)
        topk = (ids * c.mask.long()[..., None], (values * c.mask[..., None]).float())
    batch = make_batch(c, args, lp, topk=topk)
    companions = {} if k else {"teacher": c.teacher_logits}
    value, grad = run_actor_loss(args, one_micro_batch(batch), c.logits, LossTerms(distill=True), companions)

    student = gather_positions(c, logits64)
    if k:
        # the fp32 log-probs the batch carries (unmasked: padding positions get a finite, then masked, value)
        d = divergence(kind, student, None, beta, temperature, ids, values.float().double())
    else:
        d = divergence(kind, student, teacher.double()[..., :VOCAB], beta, temperature)
    d = d * c.mask
    pg, loss_mask = clipped_surrogate(c, lp)
    token_loss = 0.4 * pg + 1.7 * d
    expected = aggregate(token_loss, loss_mask, "token_level")
    assert_matches(value, grad, expected, logits64, float((token_loss.detach() * loss_mask).abs().max()),
                   f"distill {kind} beta {beta} {kernels}")
    assert_visible(aggregate(1.7 * d.detach(), loss_mask, "token_level"), token_loss, loss_mask, "distillation")


def distill_loss(kind, student, teacher_logits, beta, temperature, k=5):
    """megarl's per-position GKD loss (algorithms) and the float64 reference's, on [P, V] logits."""
    from megarl import algorithms as A

    if kind == "full":
        return (A.distill_full(student, teacher_logits, beta, temperature),
                lambda s: divergence("full", s, teacher_logits.detach(), beta, temperature))
    ids, values = teacher_topk(teacher_logits, k, temperature)
    return (A.GKD_TOPK_MODES[kind](student, ids, values, beta, temperature),
            lambda s: divergence(kind, s, None, beta, temperature, ids, values))


@pytest.mark.parametrize("kind", ["full", "renorm", "tail"])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_distillation_value_gradient_and_descent(kind, beta, temperature):
    """The GKD loss in float64 against its formula, value and gradient; the teacher gets no gradient; one SGD step
    on the student's logits along -grad lowers the divergence to the teacher (measured by the formula) by about
    lr |grad|^2, and a step on the negated loss raises it as much. A reversed loss (student and teacher swapped:
    another value and gradient; the sign flipped: the step goes uphill) fails."""
    g = torch.Generator().manual_seed(6)
    student = (torch.randn(7, VOCAB, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    teacher = (torch.randn(7, VOCAB, generator=g, dtype=torch.float64) * 2.0 + 0.5).requires_grad_()
    loss, reference = distill_loss(kind, student, teacher, beta, temperature)
    expected = reference(student)
    assert torch.allclose(loss, expected, rtol=FP64_RTOL, atol=0), (loss, expected)
    assert float(expected.min()) > 0.01  # the teacher differs from the student at every position
    (grad,) = torch.autograd.grad(loss.sum(), student, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected.sum(), student)
    assert torch.allclose(grad, expected_grad, rtol=0, atol=FP64_RTOL * float(expected_grad.abs().max()))
    (teacher_grad,) = torch.autograd.grad(loss.sum(), teacher, allow_unused=True)
    assert teacher_grad is None or not teacher_grad.any()  # the teacher is a constant
    # One step of plain SGD on the leaf: to first order the divergence changes by -+lr |g|^2, and by
    # lr^2 g.H.g / 2 to second order. lr = 0.05 keeps the second-order term below a quarter of the first (checked
    # here with the formula's Hessian along g), so a step must move it by more than half of lr |g|^2.
    lr = 0.05
    first_order = lr * float((grad ** 2).sum())
    s = student.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(reference(s).sum(), s, create_graph=True)
    (hessian_g,) = torch.autograd.grad((g_ref * grad).sum(), s)
    assert 0.5 * lr ** 2 * abs(float((grad * hessian_g).sum())) < 0.25 * first_order
    before = float(reference(student.detach()).sum())
    with torch.no_grad():
        down = float(reference(student - lr * grad).sum())
        up = float(reference(student + lr * grad).sum())  # a step on -loss
    assert down < before - 0.5 * first_order, (before, down, first_order)
    assert up > before + 0.5 * first_order, (before, up, first_order)


# ------------------------------------------------------------- 3./4. rewards: distillation, KL ----
def rewarded_batch(c, lp, teacher_lp=None, ref_kl=None):
    from megarl.batch import score_and_filter

    batch, _ = score_and_filter(c.samples, MAX_NEW, filter_truncated=True)
    pad = 1 - c.mask
    batch.old_logprobs = (lp + c.old_noise + FAR * pad).float()
    if teacher_lp is not None:
        batch.teacher_logprobs = (teacher_lp - FAR * pad).float()
    if ref_kl is not None:
        batch.ref_kl = (ref_kl + FAR * pad).float()
    return batch


def returns_of(token_rewards, mask, gamma):
    """REINFORCE++ returns G_t = r_t + gamma G_{t+1} over each sample's tokens (float64)."""
    out = torch.zeros_like(token_rewards)
    for i in range(out.shape[0]):
        running = 0.0
        for t in reversed(range(int(mask[i].sum()))):
            running = float(token_rewards[i, t]) + gamma * running
            out[i, t] = running
    return out


def whiten(x, mask):
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * mask / torch.sqrt(var + 1e-8)


def advantages_run(args, kl_coef=None):
    from megarl.algorithms import FixedKLController

    return SimpleNamespace(actor=object(), args=args, activity=SimpleNamespace(phase=None),
                           kl_controller=None if kl_coef is None else FixedKLController(kl_coef))


def outcome_rewards(c):
    """Each sample's reward at its last response token (all samples, the filtered one too: it keeps its reward)."""
    out = torch.zeros_like(c.mask)
    for i, (s, n) in enumerate(zip(c.samples, LENGTHS)):
        out[i, n - 1] = s.reward
    return out


@pytest.mark.parametrize("coef", [0.5, 2.0])
def test_distillation_reward(world, tiny_model, coef):
    """--distill-reward-coef c: c x (log pi_teacher(y_t) - log pi_student(y_t)) joins each sampled token's reward
    (tokens the teacher likes more than the student earn more), on the response tokens only. Read back through
    REINFORCE++'s returns (discounted sums of the token rewards, gamma 0.9) and its whitened advantages.
    Catches: the sign (student - teacher), the coefficient ignored, the reward on padding."""
    from megarl import algorithms as A
    from megarl import phases

    args = base_args(tiny_model, "--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9",
                     "--num-generations", "1")
    args.distill_reward_coef = coef  # the flag's value (its validation wants a teacher model, not needed here)
    c = case(7)
    _, lp, _ = policy_stats(c)
    lp = lp.detach()
    teacher_lp = (lp + c.ref_noise) * c.mask  # the teacher's logprobs of the same tokens, up to 0.8 apart
    batch = rewarded_batch(c, lp, teacher_lp=teacher_lp)
    batch, _ = phases.compute_advantages(advantages_run(args), batch)

    student = (lp + c.old_noise) * c.mask  # the old logprobs: the student that sampled
    rewards = outcome_rewards(c) + coef * (teacher_lp - student) * c.mask
    returns = returns_of(rewards, c.mask, 0.9)
    assert_fp32_close_to(batch.returns, returns, "returns")
    assert_fp32_close_to(batch.advantages, whiten(returns, c.mask), "advantages")
    # the sign, on the bare function: more reward where the teacher's logprob exceeds the student's by more
    gap = ((teacher_lp - student) * c.mask)[c.mask > 0]
    token = A.distill_token_rewards(batch.old_logprobs, batch.teacher_logprobs, batch.response_mask)
    token = token[c.mask > 0].double()
    order = torch.argsort(gap)
    assert torch.all(token[order][1:] > token[order][:-1]) and (token[gap > 0] > 0).all()


@pytest.mark.parametrize("estimator", ["k1", "abs", "mse", "low_var_kl"])
def test_kl_in_the_reward(world, tiny_model, estimator):
    """--kl-placement reward: `prepare` takes the estimator of KL(pi_old || ref) per sampled token from the old and
    the reference logprobs (in that order), `compute_advantages` subtracts kl_coef x it from every response token's
    reward (the controller's value), and reports kl_ref, its token mean. Read back through REINFORCE++'s returns.
    Catches: the estimator's arguments swapped, +kl, the coefficient ignored, KL on padding tokens."""
    from megarl import phases
    from megarl.batch import score_and_filter

    coef = 0.4
    args = base_args(tiny_model, "--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9",
                     "--kl-coef", str(coef), "--kl-placement", "reward", "--kl-estimator", estimator,
                     "--num-generations", "1")
    c = case(8)
    _, lp, _ = policy_stats(c)
    old = (lp.detach() + c.old_noise) * c.mask
    ref = (lp.detach() + c.ref_noise) * c.mask
    pad = 1 - c.mask
    batch, _ = score_and_filter(c.samples, MAX_NEW, filter_truncated=True)
    seen = {}

    class Policy:  # prepare's view of the actor: the old logprobs of the whole batch (one DP rank)
        def logprobs(self, micro_batches, width, full_kl_to=None):
            seen["width"] = width
            return (old + FAR * pad).float(), None

        def routing_metrics(self):
            return {}

    class Reference:
        def logprobs(self, micro_batches, width):
            return (ref + LOW_LOGPROB * pad).float()

    run = SimpleNamespace(actor=Policy(), reference=Reference(), critic=None, args=args,
                          activity=SimpleNamespace(phase=None), tokenizer=SimpleNamespace(pad_token_id=0),
                          context=SimpleNamespace(rank=0, placement=SimpleNamespace(
                              dp=1, data_parallel_rank=lambda rank: 0)))
    batch, _ = phases.prepare(run, batch)
    assert seen["width"] == max(LENGTHS)
    run.kl_controller = advantages_run(args, coef).kl_controller
    batch, report = phases.compute_advantages(run, batch)

    kl = KL_FORMULAS[estimator](old, ref) * c.mask
    assert float(kl.abs().sum() / c.mask.sum()) > 0.02  # a penalty of O(0.1) per token against rewards of O(1)
    assert_fp32_close_to(batch.ref_kl, kl, "ref_kl")
    rewards = outcome_rewards(c) - coef * kl
    assert_fp32_close_to(batch.returns, returns_of(rewards, c.mask, 0.9), "returns")
    assert abs(report.metrics["kl_ref"] - float(kl.sum() / c.mask.sum())) <= FP32_ULPS * EPS32 * float(kl.abs().max())


def assert_fp32_close_to(actual, expected, what):
    error = ulps(actual, expected)
    assert error <= FP32_ULPS, f"{what}: {error:.0f} ulps of its scale"


# ------------------------------------------------------------------------- 6. gradient clipping ----
def actor_of(model, *flags):
    from transformers import AutoConfig

    from megarl.actor import Actor

    args = base_args(model, "--lr", "1e-3", "--micro-batch-size", "2", *flags)
    return Actor(args, AutoConfig.from_pretrained(model))


def adam_group(actor):
    """The (single) hyper-parameters of the actor's Adam groups: lr, eps, betas, weight decay."""
    groups = [group for part in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
              for group in part.optimizer.param_groups]
    keys = ("lr", "eps", "weight_decay")
    assert len({tuple(group[k] for k in keys) for group in groups}) == 1, [[g[k] for k in keys] for g in groups]
    return groups[0]


def test_gradient_clipping_scales_the_step(world, tiny_model):
    """--clip-grad c below the gradient norm: the optimizer steps with the gradient times c / (norm + 1e-6)
    (Megatron's clip_grad_by_total_norm_fp32), and the step reports the norm before clipping.

    megarl's optimizer is Adam, and Adam's first update lr m_hat / (sqrt(v_hat) + eps) = lr g / (|g| + eps) does
    not scale with g: "the clipped update is the unclipped one scaled by c / norm" holds for SGD only. So three
    checks instead: (1) the reported grad norm is the float64 norm of the unclipped gradients (the same weights and
    micro-batches without clipping); (2) the gradient the optimizer saw (main_grad after the step: Megatron clips
    it in place, it is the tensor Adam reads) is exactly the unclipped one times c / (norm + 1e-6); (3) the
    parameter update is Adam's first step on that clipped gradient. For (3) to tell the clipped gradient from
    the unclipped one, c is chosen so that the clipped entries are about Adam's eps: there the update is
    lr g_c / (|g_c| + eps), far from the unclipped lr sign(g). Catches: clipping off or by the wrong factor,
    the norm reported after clipping, Adam fed the unclipped gradient."""
    batches = micro_batches(seed=3)
    free = actor_of(tiny_model, "--clip-grad", "1e9")
    params = [p for p in free.model.parameters()]
    _, norm_free = free.optimizer_step(batches, nll)
    grads = [p.main_grad.detach().double().clone() for p in params]
    norm64 = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    assert abs(norm_free - norm64) <= FP32_ULPS * EPS32 * norm64
    eps = adam_group(free)["eps"]
    flat = torch.cat([g.flatten() for g in grads]).abs()
    clip = norm64 * eps / float(flat[flat > 0].median())  # the median clipped entry is eps
    assert clip < 1e-3 * norm64

    clipped = actor_of(tiny_model, "--clip-grad", repr(clip))
    group = adam_group(clipped)
    lr = group["lr"]
    assert group["weight_decay"] == 0.0 and lr == 1e-3
    before = [p.detach().double().clone() for p in clipped.model.parameters()]
    _, norm_clipped = clipped.optimizer_step(batches, nll)
    assert abs(norm_clipped - norm64) <= FP32_ULPS * EPS32 * norm64  # the norm before clipping
    factor = clip / (norm64 + 1e-6)
    seen = [p.main_grad.detach().double() for p in clipped.model.parameters()]
    error = ulps(torch.cat([s.flatten() for s in seen]), torch.cat([g.flatten() * factor for g in grads]))
    assert error <= FP32_ULPS, f"clipped gradient {error:.0f} ulps"
    worst = 0.0
    for param, start, g in zip(clipped.model.parameters(), before, seen):
        delta = param.detach().double() - start
        expected = -lr * g / (g.abs() + eps)
        # fp32 rounding: of the parameter (an ulp of |p|) and of the update's few operations (ulps of lr)
        bound = 16 * EPS32 * (start.abs() + lr)
        worst = max(worst, float(((delta - expected).abs() / bound).max()))
    assert worst <= 1.0, f"parameter update off Adam's step on the clipped gradient ({worst:.1f} x the bound)"
    # and it is not the unclipped gradient's step (|update| ~ lr everywhere)
    unclipped = torch.cat([(-lr * g / (g.abs() + eps)).flatten() for g in grads])
    moved = torch.cat([(p.detach().double() - b).flatten() for p, b in zip(clipped.model.parameters(), before)])
    assert float((moved - unclipped).abs().max()) > 0.4 * lr


# --------------------------------------------------------------------------- 7. recomputation ----
RECOMPUTE = {  # flags -> forwards of each of the two layers per micro-batch (layer, then core attention)
    "none": ([], [(1, 1), (1, 1)]),
    "full-uniform-1": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"], [(2, 2), (2, 2)]),
    "full-block-1": (["--recompute-granularity", "full", "--recompute-method", "block",
                      "--recompute-num-layers", "1"], [(2, 2), (1, 1)]),
    "selective": (["--recompute-granularity", "selective"], [(1, 2), (1, 2)]),
}


def test_recomputation_reruns_the_layers_it_names(world, tiny_model):
    """Forward hooks on each transformer layer and its core attention count the forwards of one optimizer step
    over two micro-batches: once each without recomputation; full recomputation runs the recomputed layers'
    forwards again in the backward (uniform 1: every layer; block 1: the first layer only), selective only the
    core attention. The second forward runs with autograd on, inside the backward; the first one of a recomputed
    layer without it. The gradients are the same in all four runs. Catches: the flags not reaching Megatron's
    TransformerConfig (nothing recomputed), method or layer count ignored."""
    count = 2
    batches = micro_batches(count=count, seed=5)
    grads = {}
    for name, (flags, expected) in RECOMPUTE.items():
        actor = actor_of(tiny_model, *flags)
        layers = actor.model.module.decoder.layers
        assert len(layers) == len(expected)
        calls = {}

        def hook(key):
            def record(module, inputs, output):
                calls.setdefault(key, []).append(torch.is_grad_enabled())
            return record

        handles = []
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(hook(("layer", index))))
            handles.append(layer.self_attention.core_attention.register_forward_hook(hook(("attention", index))))
        try:
            actor.optimizer_step(batches, nll)
        finally:
            for handle in handles:
                handle.remove()
        for index, runs in enumerate(expected):
            for module, n in zip(("layer", "attention"), runs):
                # checkpointed (2 runs): the forward under no_grad, the recomputation with grad in the backward;
                # otherwise one forward with grad
                want = [False] * count + [True] * count if n == 2 else [True] * count
                assert sorted(calls[(module, index)]) == want, (name, module, index, calls)
        grads[name] = torch.cat([p.main_grad.flatten() for p in actor.model.parameters()])
    for name in RECOMPUTE:
        error = ulps(grads[name], grads["none"])
        assert error <= 2 * FP32_ULPS, f"{name}: gradients {error:.0f} ulps from the run without recomputation"


def test_the_overlong_penalty_factor_scales_dapos_penalty():
    """--overlong-penalty-factor (verl's overlong_buffer_cfg.penalty_factor): the soft penalty times it, so a
    response at max_new_tokens loses the factor, one inside the buffer's first token nothing."""
    from megarl.batch import score_and_filter
    from megarl.samples import Sample

    samples = [Sample(prompt_index=0, prompt_ids=[1], response_ids=[5] * length, response_text="", truncated=False,
                      reward=1.0, logprobs=[0.0] * length) for length in (4, 6, 8)]
    base, _ = score_and_filter(samples, 8, overlong_buffer_len=4)
    half, _ = score_and_filter(samples, 8, overlong_buffer_len=4, overlong_penalty_factor=0.5)
    assert base.scores.tolist() == [1.0, 0.5, 0.0]
    assert half.scores.tolist() == [1.0, 0.75, 0.5]
