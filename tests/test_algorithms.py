"""megarl/algorithms.py against independent implementations of the paper formulas.

The references here are written with Python loops over samples and tokens and
numpy / the statistics module, never with the module's helpers. Inputs are
random, with ragged right-padded masks (garbage values on the padding), groups
whose rewards are all equal and groups of one sample.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from helpers import assert_fp32_close

from megarl import algorithms as A

SEEDS = [0, 1, 2]
TOL = dict(rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ inputs ----
def ragged(rng, batch: int, width: int):
    """Lengths (one full row, one of length 1) and the right-padded mask [B, L] (numpy)."""
    lengths = rng.integers(1, width + 1, size=batch)
    lengths[0], lengths[-1] = width, 1
    mask = np.zeros((batch, width))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return lengths, mask


def t(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x), dtype=torch.float64)


def pad(rows, width: int) -> np.ndarray:
    out = np.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def whiten(rows):
    """verl's masked_whiten over a list of per-sample arrays of valid tokens."""
    flat = np.concatenate(rows)
    mean = flat.mean()
    var = flat.var(ddof=1) if flat.size > 1 else 0.0
    return [(np.asarray(r) - mean) / math.sqrt(var + 1e-8) for r in rows]


def group_rewards(rng, groups: int, group_size: int) -> np.ndarray:
    """Binary rewards; group 0 all correct, group 1 all wrong (when there are >= 2 groups)."""
    rewards = rng.integers(0, 2, size=(groups, group_size)).astype(float)
    rewards[0] = 1.0
    if groups > 1:
        rewards[1] = 0.0
    if groups > 2:
        rewards[2] = rng.normal(size=group_size)  # a continuous group too
    return rewards.reshape(-1)


def assert_close(actual: torch.Tensor, expected, **tol):
    np.testing.assert_allclose(actual.detach().numpy(), np.asarray(expected, dtype=float), **(tol or TOL))


# ----------------------------------------------------------- token rewards ----
@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_rewards_at_last_valid_token(seed):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 6, 7)
    mask[2] = 0.0  # a row with no valid token gets nothing
    scores = rng.normal(size=6)
    expected = np.zeros_like(mask)
    for i, n in enumerate(lengths):
        if i != 2:
            expected[i, n - 1] = scores[i]
    assert_close(A.sequence_rewards_to_tokens(t(scores), t(mask)), expected)


# ------------------------------------------------------ outcome estimators ----
def grpo_reference(rewards, group_size, scale_rewards, eps=1e-6):
    out = []
    for g in range(0, len(rewards), group_size):
        group = list(rewards[g: g + group_size])
        mean = sum(group) / len(group)
        if scale_rewards == "group":
            std = statistics.stdev(group) if len(group) > 1 else 0.0
        elif scale_rewards == "batch":
            std = statistics.stdev(list(rewards)) if len(rewards) > 1 else 0.0
        else:
            std = None
        for r in group:
            out.append((r - mean) / (std + eps) if std is not None else r - mean)
    return np.array(out)


def rloo_reference(rewards, group_size):
    out = []
    for g in range(0, len(rewards), group_size):
        group = list(rewards[g: g + group_size])
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1:]
            out.append(r - sum(others) / len(others) if others else 0.0)
    return np.array(out)


def outcome_batch(seed, group_size, width=6):
    rng = np.random.default_rng(seed)
    rewards = group_rewards(rng, 4, group_size)
    lengths, mask = ragged(rng, rewards.size, width)
    garbage = rng.normal(size=mask.shape) * (1 - mask)  # padding must not enter the score
    token_rewards = A.sequence_rewards_to_tokens(t(rewards), t(mask)) + t(garbage)
    return rewards, lengths, mask, token_rewards


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 2, 5])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo(seed, group_size, scale_rewards):
    rewards, _, mask, token_rewards = outcome_batch(seed, group_size)
    expected = grpo_reference(rewards, group_size, scale_rewards)
    advantages, returns = A.ADVANTAGE_ESTIMATORS["grpo"](token_rewards, t(mask), group_size,
                                                          scale_rewards=scale_rewards)
    assert_close(advantages, expected[:, None] * mask)
    assert_close(returns, advantages.numpy())
    # the per-sample function behind it gives the per-sample values
    assert_close(A.grpo_advantages(t(rewards), group_size, scale_rewards), expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_rloo(seed, group_size):
    rewards, _, mask, token_rewards = outcome_batch(seed, group_size)
    expected = rloo_reference(rewards, group_size)
    advantages, returns = A.ADVANTAGE_ESTIMATORS["rloo"](token_rewards, t(mask), group_size)
    assert_close(advantages, expected[:, None] * mask)
    assert_close(returns, advantages.numpy())
    assert_close(A.rloo_advantages(t(rewards), group_size), expected)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baselines_edge_cases(name):
    """All-equal groups and lone samples give exactly 0 (finite, no 0/0)."""
    estimator = A.ADVANTAGE_ESTIMATORS[name]
    mask = torch.ones(8, 3, dtype=torch.float64)
    equal = A.sequence_rewards_to_tokens(t([1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5]), mask)
    for group_size, rewards in [(4, equal), (1, A.sequence_rewards_to_tokens(t(np.arange(8.0)), mask))]:
        advantages, _ = estimator(rewards, mask, group_size)
        assert torch.isfinite(advantages).all()
        assert torch.equal(advantages, torch.zeros_like(advantages))
    # and one informative group is not zeroed
    mixed = A.sequence_rewards_to_tokens(t([1, 0, 1, 1, 0.5, 0.5, 0.5, 0.5]), mask)
    advantages, _ = estimator(mixed, mask, 4)
    assert advantages[:4].abs().min() > 0 and advantages[4:].abs().max() < 1e-3


# --------------------------------------------------------------- REINFORCE++ ----
def discounted_rows(token_rewards, lengths, gamma):
    rows = []
    for i, n in enumerate(lengths):
        row, running = [0.0] * n, 0.0
        for k in reversed(range(n)):
            running = token_rewards[i, k] + gamma * running
            row[k] = running
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(seed, gamma):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 8, 7)
    token_rewards = rng.normal(size=mask.shape)  # dense token rewards, garbage on padding too
    rows = discounted_rows(token_rewards, lengths, gamma)
    advantages, returns = A.ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](t(token_rewards), t(mask), 4, gamma=gamma)
    assert_close(returns, pad(rows, 7))
    assert_close(advantages, pad(whiten(rows), 7))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_outcome_reward_is_length_weighted_whitening(seed):
    """gamma = 1 and a sequence reward: every valid token's return is the score."""
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 8, 7)
    scores = rng.normal(size=8)
    advantages, returns = A.ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](
        A.sequence_rewards_to_tokens(t(scores), t(mask)), t(mask))
    assert_close(returns, scores[:, None] * mask)
    assert_close(advantages, pad(whiten([[s] * n for s, n in zip(scores, lengths)]), 7))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_reinforce_plus_plus_baseline(seed, group_size):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 8, 6)
    token_rewards = rng.normal(size=mask.shape)
    scores = [sum(token_rewards[i, :n]) for i, n in enumerate(lengths)]  # the sum over valid tokens
    rows = []
    for g in range(0, 8, group_size):
        group = scores[g: g + group_size]
        for i in range(g, g + group_size):
            rows.append([scores[i] - sum(group) / len(group)] * lengths[i])
    advantages, returns = A.ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](
        t(token_rewards), t(mask), group_size)
    assert_close(advantages, pad(whiten(rows), 6), rtol=1e-8, atol=1e-8)
    assert_close(returns, advantages.numpy())


# ----------------------------------------------------------------------- GAE ----
def gae_reference(rewards, values, lengths, gamma, lam):
    advantages, returns = [], []
    for i, n in enumerate(lengths):
        adv = [0.0] * n
        last = 0.0
        for k in reversed(range(n)):
            next_value = values[i, k + 1] if k + 1 < n else 0.0
            delta = rewards[i, k] + gamma * next_value - values[i, k]
            last = delta + gamma * lam * last
            adv[k] = last
        advantages.append(adv)
        returns.append([a + values[i, k] for k, a in enumerate(adv)])
    return advantages, returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("whiten_advantages", [True, False])
def test_gae(seed, whiten_advantages):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 6, 8)
    rewards, values = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.5, 1.0)
    adv_rows, ret_rows = gae_reference(rewards, values, lengths, gamma, lam)
    advantages, returns = A.ADVANTAGE_ESTIMATORS["gae"](t(rewards), t(mask), None, values=t(values),
                                                         gamma=gamma, lam=lam, whiten=whiten_advantages)
    assert_close(returns, pad(ret_rows, 8))
    assert_close(advantages, pad(whiten(adv_rows) if whiten_advantages else adv_rows, 8))


def test_gae_gamma_lam_one_is_return_minus_value():
    """gamma = lam = 1: A_t = sum_{k >= t} r_k - V_t (telescoping)."""
    rng = np.random.default_rng(5)
    lengths, mask = ragged(rng, 5, 6)
    rewards, values = rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    advantages, _ = A.gae(t(rewards), t(mask), values=t(values), whiten=False)
    expected = [[sum(rewards[i, k:n]) - values[i, k] for k in range(n)] for i, n in enumerate(lengths)]
    assert_close(advantages, pad(expected, 6))


def test_estimator_options_are_checked():
    mask = torch.ones(4, 2, dtype=torch.float64)
    rewards = torch.zeros(4, 2, dtype=torch.float64)
    for name in A.ADVANTAGE_ESTIMATORS:  # one option set for every estimator
        A.ADVANTAGE_ESTIMATORS[name](rewards, mask, 2, values=rewards, gamma=1.0, lam=0.9,
                                     scale_rewards="group", whiten=True)
    with pytest.raises(TypeError):
        A.ADVANTAGE_ESTIMATORS["grpo"](rewards, mask, 2, gama=0.9)
    with pytest.raises(ValueError):
        A.ADVANTAGE_ESTIMATORS["rloo"](rewards, mask, 3)
    with pytest.raises(ValueError):
        A.grpo_advantages(torch.zeros(4), 2, "std")


# ------------------------------------------------------------- policy losses ----
def policy_batch(seed, spread=0.6, width=7):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 6, width)
    old = rng.normal(-1.5, 0.5, size=mask.shape)
    logp = old + rng.normal(0.0, spread, size=mask.shape)
    advantages = rng.normal(size=mask.shape)
    return lengths, mask, logp, old, advantages


def ppo_reference(logp, old, advantages, low, high, c):
    loss = np.zeros_like(logp)
    grad = np.zeros_like(logp)  # d loss / d logp
    clipped = np.zeros_like(logp)
    dual = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        a, r = advantages[idx], math.exp(logp[idx] - old[idx])
        unclipped, clip = -a * r, -a * min(max(r, 1 - low), 1 + high)
        value, slope = (unclipped, -a * r) if unclipped >= clip else (clip, 0.0)
        if clip > unclipped:
            clipped[idx] = 1.0
        if c is not None and a < 0 and value > -a * c:
            value, slope, dual[idx] = -a * c, 0.0, 1.0
        loss[idx], grad[idx] = value, slope
    return loss, grad, clipped, dual


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 1.5)])
def test_ppo_clip(seed, low, high, c):
    _, _, logp, old, advantages = policy_batch(seed)
    exp_loss, exp_grad, exp_clipped, exp_dual = ppo_reference(logp, old, advantages, low, high, c)
    assert 0 < exp_clipped.mean() < 1  # both regimes are exercised
    if c is not None:
        assert exp_dual.any()
    lp = t(logp).requires_grad_()
    loss, metrics = A.POLICY_LOSSES["ppo_clip"](lp, t(old), t(advantages), low, high, clip_ratio_c=c)
    assert_close(loss, exp_loss)
    assert_close(metrics["clipped"], exp_clipped)
    assert_close(metrics["dual_clipped"], exp_dual)
    assert_close(metrics["ratio"], np.exp(logp - old))
    weights = torch.rand(loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    (grad,) = torch.autograd.grad((loss * weights).sum(), lp)
    assert_close(grad, exp_grad * weights.numpy())


def test_ppo_clip_positional_call_as_trainer():
    """actor.py's call: (logprobs, old, advantages, low, high) -> (loss, metrics with "clipped")."""
    _, _, logp, old, advantages = policy_batch(4)
    loss, metrics = A.POLICY_LOSSES["ppo_clip"](t(logp).float(), t(old).float(), t(advantages).float(), 0.2, 0.28)
    assert loss.dtype == torch.float32 and metrics["clipped"].shape == loss.shape
    assert_fp32_close(loss, ppo_reference(logp, old, advantages, 0.2, 0.28, None)[0])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["ppo_clip", "skip_threshold"])
def test_policy_loss_gradcheck(seed, name):
    """Finite differences vs autograd. Not for gspo: its stop-gradients make the autograd gradient
    differ from the forward's derivative on purpose (see test_gspo and the sequence-objective test)."""
    _, mask, logp, old, advantages = policy_batch(seed, width=5)
    options = dict(mask=t(mask), clip_ratio_c=1.5)
    low, high = 0.2, 0.28
    if name == "skip_threshold":
        options["skip_threshold"] = 1.3

    def f(lp):
        return A.POLICY_LOSSES[name](lp, t(old), t(advantages), low, high, **options)[0]

    assert torch.autograd.gradcheck(f, (t(logp).requires_grad_(),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "skip_threshold"])
def test_first_step_policy_loss_is_minus_advantage(seed, name):
    _, mask, logp, _, advantages = policy_batch(seed)
    loss, metrics = A.POLICY_LOSSES[name](t(logp), t(logp), t(advantages), 0.2, 0.28, mask=t(mask),
                                          clip_ratio_c=3.0)
    assert_close(loss, -advantages)
    for key in ("clipped", "dual_clipped"):
        assert not metrics[key].any()
    assert_close(metrics["ratio"], np.ones_like(logp))


def gspo_reference(logp, old, advantages, lengths, low, high):
    """Values and d loss[i, k] / d logp[i, k] of GSPO-token (the gradient only reaches its own token)."""
    loss, grad, clipped = np.zeros_like(logp), np.zeros_like(logp), np.zeros_like(logp)
    for i, n in enumerate(lengths):
        s = math.exp(sum(logp[i, k] - old[i, k] for k in range(n)) / n)
        for k in range(logp.shape[1]):
            a = advantages[i, k]
            unclipped, clip = -a * s, -a * min(max(s, 1 - low), 1 + high)
            loss[i, k] = max(unclipped, clip)
            grad[i, k] = -a * s if unclipped >= clip else 0.0
            clipped[i, k] = float(clip > unclipped)
    return loss, grad, clipped


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("low,high,spread", [(3e-4, 4e-4, 0.002), (0.05, 0.08, 0.25)])
def test_gspo(seed, low, high, spread):
    lengths, mask, logp, old, advantages = policy_batch(seed, spread=spread)
    logp[mask == 0] = 5.0  # padding must not enter the sequence ratio
    exp_loss, exp_grad, exp_clipped = gspo_reference(logp, old, advantages, lengths, low, high)
    assert 0 < (exp_clipped * mask).sum() < mask.sum()
    lp = t(logp).requires_grad_()
    loss, metrics = A.POLICY_LOSSES["gspo"](lp, t(old), t(advantages), low, high, mask=t(mask))
    assert_close(loss, exp_loss)
    assert_close(metrics["clipped"], exp_clipped)
    weights = torch.rand(loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    (grad,) = torch.autograd.grad((loss * weights).sum(), lp)
    assert_close(grad, exp_grad * weights.numpy())


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_token_equals_sequence_objective(seed):
    """Sequence-constant advantages + sample_level aggregation = GSPO's sequence-level objective,
    value and gradient (the sequence ratio differentiated through its mean, no stop-gradient)."""
    lengths, mask, logp, old, _ = policy_batch(seed, spread=0.1)
    seq_adv = np.random.default_rng(seed + 10).normal(size=len(lengths))
    low, high = 0.05, 0.08
    lp_ref = t(logp).requires_grad_()
    objective = 0.0
    for i, n in enumerate(lengths):
        s = torch.exp(sum(lp_ref[i, k] - old[i, k] for k in range(n)) / n)
        objective = objective + torch.maximum(-seq_adv[i] * s, -seq_adv[i] * torch.clamp(s, 1 - low, 1 + high))
    objective = objective / len(lengths)
    (expected_grad,) = torch.autograd.grad(objective, lp_ref)

    lp = t(logp).requires_grad_()
    loss, _ = A.gspo_loss(lp, t(old), t(seq_adv[:, None] * np.ones_like(logp)), low, high, mask=t(mask))
    numerator, units = A.LOSS_AGGREGATIONS["sample_level"](loss, t(mask))
    (grad,) = torch.autograd.grad(numerator / units, lp)
    assert_close(numerator / units, objective.item())
    assert_close(grad, expected_grad.numpy())


@pytest.mark.parametrize("seed", SEEDS)
def test_skip_threshold(seed):
    lengths, mask, logp, old, advantages = policy_batch(seed)
    logp[mask == 0] = 50.0  # padding must not enter the mean ratio
    threshold = 1.3
    exp_loss, exp_grad, _, _ = ppo_reference(logp, old, advantages, 0.2, 0.28, None)
    skipped = np.zeros_like(logp)
    for i, n in enumerate(lengths):
        if sum(math.exp(logp[i, k] - old[i, k]) for k in range(n)) / n > threshold:
            skipped[i] = 1.0
    assert 0 < skipped[:, 0].sum() < len(lengths)
    lp = t(logp).requires_grad_()
    loss, metrics = A.POLICY_LOSSES["skip_threshold"](lp, t(old), t(advantages), 0.2, 0.28, mask=t(mask),
                                                      skip_threshold=threshold)
    assert_close(metrics["skipped"], skipped)
    keep = 1.0 - skipped
    assert_close(loss * t(mask), exp_loss * keep * mask)
    (grad,) = torch.autograd.grad((loss * t(mask)).sum(), lp)
    assert_close(grad, exp_grad * keep * mask)


def test_policy_loss_options_are_checked():
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError):
        A.POLICY_LOSSES["ppo_clip"](x, x, x, 0.2, 0.2, clip_c=3.0)
    with pytest.raises(TypeError):
        A.POLICY_LOSSES["gspo"](x, x, x, 0.2, 0.2)  # needs the mask
    with pytest.raises(ValueError):
        A.POLICY_LOSSES["ppo_clip"](x, x, x, 0.2, 0.2, clip_ratio_c=1.0)


def test_entropy_bonus_lowers_the_loss_with_entropy():
    entropy = t([[0.5, 2.0]]).requires_grad_()
    term = A.entropy_bonus(entropy, 0.01)
    assert_close(term, [[-0.005, -0.02]])
    (grad,) = torch.autograd.grad(term.sum(), entropy)
    assert_close(grad, [[-0.01, -0.01]])


# -------------------------------------------------------------- value loss ----
@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss(seed):
    rng = np.random.default_rng(seed)
    _, mask = ragged(rng, 5, 6)
    values, old, returns = rng.normal(size=mask.shape), rng.normal(size=mask.shape), rng.normal(size=mask.shape)
    clip = 0.3
    expected, grad, clipped = np.zeros_like(values), np.zeros_like(values), np.zeros_like(values)
    for idx in np.ndindex(values.shape):
        v, o, r = values[idx], old[idx], returns[idx]
        vc = min(max(v, o - clip), o + clip)
        l1, l2 = (v - r) ** 2, (vc - r) ** 2
        if l1 >= l2:
            expected[idx], grad[idx] = 0.5 * l1, v - r
        else:
            expected[idx], grad[idx] = 0.5 * l2, (vc - r) if abs(v - o) < clip else 0.0
        clipped[idx] = float(l2 > l1)
    assert 0 < clipped.mean() < 1
    v = t(values).requires_grad_()
    loss, metrics = A.value_loss(v, t(old), t(returns), t(mask), clip)
    assert_close(loss, expected * mask)
    assert_close(metrics["clipped"], clipped * mask)
    (g,) = torch.autograd.grad(loss.sum(), v)
    assert_close(g, grad * mask)
    assert torch.autograd.gradcheck(lambda x: A.value_loss(x, t(old), t(returns), t(mask), clip)[0],
                                    (t(values).requires_grad_(),), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------- loss aggregation ----
def aggregation_reference(name, loss, mask, max_len):
    rows = [[loss[i, k] for k in range(loss.shape[1]) if mask[i, k]] for i in range(loss.shape[0])]
    rows = [r for r in rows if r]
    if name == "token_level":
        return sum(map(sum, rows)), sum(map(len, rows))
    if name == "sample_level":
        return sum(sum(r) / len(r) for r in rows), len(rows)
    return sum(sum(r) / max_len for r in rows), len(rows)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["token_level", "sample_level", "seq_mean_token_sum_norm"])
def test_loss_aggregation(seed, name):
    rng = np.random.default_rng(seed)
    _, mask = ragged(rng, 8, 6)
    mask[3] = 0.0  # a sample with no token (e.g. filtered) counts nowhere
    loss = rng.normal(size=mask.shape)
    max_len = 10
    numerator, units = A.LOSS_AGGREGATIONS[name](t(loss), t(mask), max_len=max_len)
    exp_num, exp_units = aggregation_reference(name, loss, mask, max_len)
    assert_close(numerator, exp_num)
    assert units.item() == exp_units
    # micro-batches (and data-parallel ranks) add up to the global value
    parts = [A.LOSS_AGGREGATIONS[name](t(loss[s]), t(mask[s]), max_len=max_len) for s in (slice(0, 3), slice(3, 8))]
    assert_close(sum(p[0] for p in parts) / sum(p[1] for p in parts), exp_num / exp_units)
    assert torch.autograd.gradcheck(lambda x: A.LOSS_AGGREGATIONS[name](x, t(mask), max_len=max_len)[0],
                                    (t(loss).requires_grad_(),))


def test_dr_grpo_aggregation_needs_max_len():
    with pytest.raises(ValueError):
        A.LOSS_AGGREGATIONS["seq_mean_token_sum_norm"](torch.zeros(2, 2), torch.ones(2, 2))


# ------------------------------------------------------------------------- KL ----
def kl_reference(name, lp, ref):
    """k3 is clamped at 10 as in verl (documented convention)."""
    d = lp - ref
    return {"k1": d, "abs": abs(d), "mse": 0.5 * d * d, "k2": 0.5 * d * d,
            "low_var_kl": min(math.exp(-d) + d - 1, 10.0), "k3": min(math.exp(-d) + d - 1, 10.0)}[name]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators(seed, name):
    rng = np.random.default_rng(seed)
    lp, ref = rng.normal(-2, 1, size=(4, 5)), rng.normal(-2, 1, size=(4, 5))
    expected = np.vectorize(lambda a, b: kl_reference(name, a, b))(lp, ref)
    estimator = A.KL_ESTIMATORS[name]
    assert_close(estimator(t(lp), t(ref)), expected)
    assert_close(estimator(t(lp), t(lp)), np.zeros_like(lp))  # first step: policy == reference
    assert torch.autograd.gradcheck(estimator, (t(lp).requires_grad_(), t(ref)), eps=1e-6, atol=1e-7)


def test_low_var_kl_clamped_like_verl():
    assert A.KL_ESTIMATORS["k3"](t([0.0]), t([15.0])).item() == 10.0


@pytest.mark.parametrize("seed", SEEDS)
def test_estimator_expectations_match_exact_kl(seed):
    """Under x ~ pi, E[k1] = E[k3] = KL(pi || ref) exactly (sum over the vocabulary)."""
    rng = np.random.default_rng(seed)
    logits, ref_logits = rng.normal(0, 0.5, size=(3, 11)), rng.normal(0, 0.5, size=(3, 11))  # k3 < 10: no clamp
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logq = ref_logits - np.log(np.exp(ref_logits).sum(-1, keepdims=True))
    exact = [sum(math.exp(logp[b, v]) * (logp[b, v] - logq[b, v]) for v in range(11)) for b in range(3)]
    p = t(np.exp(logp))
    for name in ("k1", "k3"):
        assert_close((p * A.KL_ESTIMATORS[name](t(logp), t(logq))).sum(-1), exact)
    assert_close(A.KL_ESTIMATORS["full"](t(logp)[None], t(logq)[None])[0], exact)


def test_full_kl_gradcheck_and_zero_at_equal():
    rng = np.random.default_rng(3)
    logits, ref = t(rng.normal(size=(2, 3, 5))), t(rng.normal(size=(2, 3, 5)))

    def f(x):
        return A.KL_ESTIMATORS["full"](torch.log_softmax(x, -1), torch.log_softmax(ref, -1))

    assert torch.autograd.gradcheck(f, (logits.requires_grad_(),), eps=1e-6, atol=1e-7)
    same = torch.log_softmax(ref, -1)
    assert_close(A.KL_ESTIMATORS["full"](same, same), np.zeros((2, 3)))


def test_kl_placement():
    rewards, kl, mask = t([[0.0, 1.0, 0.0]]), t([[0.2, -0.1, 0.5]]).requires_grad_(), t([[1, 1, 0]])
    shaped = A.kl_penalty_in_reward(rewards, kl, 0.1, mask)
    assert_close(shaped, [[-0.02, 1.01, 0.0]])
    assert not shaped.requires_grad  # a reward carries no gradient
    term = A.kl_penalty_in_loss(kl, 0.1)
    (grad,) = torch.autograd.grad(term.sum(), kl)
    assert_close(term, [[0.02, -0.01, 0.05]])
    assert_close(grad, [[0.1, 0.1, 0.1]])


def test_kl_controllers():
    fixed = A.KL_CONTROLLERS["fixed"](0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    adaptive = A.KL_CONTROLLERS["adaptive"](0.1, target=0.02, horizon=1000)
    coef = 0.1
    for kl, n in [(0.03, 64), (0.5, 64), (0.0, 32), (0.019, 128)]:
        error = kl / 0.02 - 1
        error = 0.2 if error > 0.2 else (-0.2 if error < -0.2 else error)
        coef = coef * (1 + error * n / 1000)
        adaptive.update(kl, n)
        assert adaptive.value == pytest.approx(coef, rel=1e-12)
    restored = A.AdaptiveKLController(1.0, 0.02, 1000)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == adaptive.value
    with pytest.raises(ValueError):
        A.AdaptiveKLController(0.1, target=0.0, horizon=10)


# ---------------------------------------------------------------------- DAPO ----
@pytest.mark.parametrize("seed", SEEDS)
def test_dynamic_sampling_keep(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 2, size=(10, 4)).astype(float)
    scores[0], scores[1] = 1.0, 0.0
    for low, high in [(0.0, 1.0), (0.25, 0.75)]:
        expected = []
        for group in scores:
            accuracy = sum(s > 0.5 for s in group) / len(group)
            expected.append(low < accuracy < high)
        keep = A.dynamic_sampling_keep(t(scores), low, high)
        assert keep.dtype == torch.bool and keep.tolist() == expected
    assert not A.dynamic_sampling_keep(t(scores))[:2].any()


def test_soft_overlong_penalty():
    max_len, cache = 20, 8
    lengths = list(range(0, 26))
    expected = []
    for n in lengths:
        if n <= max_len - cache:
            expected.append(0.0)
        elif n <= max_len:
            expected.append(((max_len - cache) - n) / cache)
        else:
            expected.append(-1.0)
    assert_close(A.soft_overlong_penalty(torch.tensor(lengths), max_len, cache).double(), expected, rtol=1e-6,
                 atol=1e-7)
    assert expected[max_len] == -1.0 and expected[max_len - cache + 1] == -1 / 8


def test_truncation_keep():
    assert A.truncation_keep(torch.tensor([3, 8, 7, 9]), 8).tolist() == [True, False, True, False]


# ------------------------------------------------------- off-policy weights ----
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_truncated_importance_weights(seed, level, mode):
    rng = np.random.default_rng(seed)
    lengths, mask = ragged(rng, 6, 5)
    rollout = rng.normal(-1.5, 0.5, size=mask.shape)
    old = rollout + rng.normal(0.1, 0.4, size=mask.shape)
    old[mask == 0] = 9.0  # garbage on padding
    threshold = {"token": 1.3, "sequence": 1.5, "geometric": 1.15}[level]
    weights_ref = np.zeros_like(mask)
    ratio_ref = np.zeros_like(mask)
    bounded = np.zeros_like(mask)
    for i, n in enumerate(lengths):
        diffs = [old[i, k] - rollout[i, k] for k in range(n)]
        for k in range(n):
            if level == "token":
                r = math.exp(diffs[k])
            elif level == "sequence":
                r = math.prod(math.exp(d) for d in diffs)
            else:
                r = math.exp(sum(diffs) / n)
            ratio_ref[i, k] = r
            if mode == "truncate":
                weights_ref[i, k], bounded[i, k] = min(r, threshold), float(r > threshold)
            else:
                inside = 1 / threshold <= r <= threshold
                weights_ref[i, k], bounded[i, k] = (r if inside else 0.0), float(not inside)
    assert 0 < bounded.sum() < mask.sum()
    weights, metrics = A.truncated_importance_weights(t(old), t(rollout), t(mask), level=level, mode=mode,
                                                      threshold=threshold)
    assert not weights.requires_grad
    assert_close(weights, weights_ref)
    assert_close(metrics["ratio"], ratio_ref)
    assert_close(metrics["clipped" if mode == "truncate" else "masked"], bounded)
    assert_close(metrics["masked" if mode == "truncate" else "clipped"], np.zeros_like(mask))
    diff = (old - rollout) * mask
    assert_close(metrics["abs_diff"], np.abs(diff))
    assert_close(metrics["k1"], -diff)
    assert_close(metrics["k3"], (np.exp(diff) - diff - 1) * mask)


def test_importance_weights_on_policy_are_one():
    rng = np.random.default_rng(0)
    _, mask = ragged(rng, 4, 5)
    logp = rng.normal(size=mask.shape)
    for level in ("token", "sequence", "geometric"):
        weights, metrics = A.truncated_importance_weights(t(logp), t(logp), t(mask), level=level, mode="mask")
        assert_close(weights, mask)
        for key in ("abs_diff", "k1", "k3", "clipped", "masked"):
            assert not metrics[key].any()


def test_masked_whiten_edges():
    x = t([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    one = A.masked_whiten(x, t([[0, 1, 0], [0, 0, 0]]))  # a single valid token: 0, not nan
    assert torch.equal(one, torch.zeros_like(one))
