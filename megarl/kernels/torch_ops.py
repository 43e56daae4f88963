"""Per-chunk math of the fused operations in plain torch: the "chunked" backend, and the
contract the Triton backend (triton_ops.py) implements with the same names and arguments.

Every function sees one chunk of rows of this TP rank's vocabulary shard, restricted to its real
columns (Megatron's padding columns are cut off by the caller):

    x       [n, r]  raw logits of any float dtype (a view; never written); z = x.float() / T
    labels  [n]     local label column (owned by this shard iff 0 <= label < r)
    ids     [n, K]  local teacher columns, distinct per row (owned iff 0 <= id < r)
    out     [n, r]  where a gradient w.r.t. x goes (d/dx = d/dz / T), any float dtype

Statistics are per row of this shard; fused.py combines them over the TP group (max, then the
rescaled sums) into per-row globals: M (max of z over the whole vocabulary), log_sum
(log sum exp(z - M)), and op-specific sums. Gradient arguments g_* may be None (no gradient).
"""

from __future__ import annotations

import math

import torch

from megarl.algorithms import LOGPROB_FLOOR


def _owned(local: torch.Tensor, width: int) -> torch.Tensor:
    return (local >= 0) & (local < width)


def _pick(z: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z at the local columns [n, k] or 0 where this shard does not own them, owned mask)."""
    owned = _owned(local, z.shape[-1])
    return torch.where(owned, z.gather(-1, local.clamp(0, max(z.shape[-1] - 1, 0))), 0.0), owned


def _in_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] True at this shard's columns in ids (ids of other shards go to a spare column)."""
    marks = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    return marks.scatter_(-1, torch.where(_owned(ids, width), ids, width), True)[:, :width]


def _empty_stats(x: torch.Tensor, width: int) -> torch.Tensor:
    """A shard of padding only contributes nothing: max is the dtype's min, sums are 0."""
    stats = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
    stats[:, 0] = torch.finfo(torch.float32).min
    return stats


def token_stats(x: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 5]: max m, sum exp(z - m), sum exp(z - m)(z - m), z at the label (0 if not owned), owned."""
    if x.shape[-1] == 0:
        return _empty_stats(x, 5)
    z = x.float() / temperature
    picked, owned = _pick(z, labels[:, None])
    m = z.max(dim=-1, keepdim=True).values
    shifted = z.sub_(m)
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    weighted = exp.mul_(shifted).sum(-1)
    return torch.stack([m[:, 0], sum_exp, weighted, picked[:, 0], owned[:, 0].float()], dim=-1)


def token_grad(x, labels, temperature, m, log_sum, expected, g_lp, g_h, out) -> None:
    """out = d(g_lp logprob + g_h entropy)/dx, with logprob = z_label - M - log_sum and entropy =
    log_sum - E (E = sum p (z - M)): d/dz = g_lp (onehot - p) - g_h p (z - M - E)."""
    shifted = (x.float() / temperature).sub_(m[:, None])
    grad = (shifted - log_sum[:, None]).exp_()  # p
    if g_h is None:
        grad.mul_(g_lp[:, None])
    else:
        coef = shifted.sub_(expected[:, None]).mul_(g_h[:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        grad.mul_(coef)
    grad.neg_()
    if g_lp is not None:
        rows = _owned(labels, x.shape[-1]).nonzero()[:, 0]
        grad[rows, labels[rows]] += g_lp[rows]
    out.copy_(grad.div_(temperature))


def topk_stats(x: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 3 + K]: max m, sum exp(z - m), the same sum over the columns not in ids, z at each id
    (0 where not owned)."""
    if x.shape[-1] == 0:
        return _empty_stats(x, 3 + ids.shape[-1])
    z = x.float() / temperature
    picked, owned = _pick(z, ids)
    m = z.max(dim=-1, keepdim=True).values
    exp = z.sub_(m).exp_()
    sum_exp = exp.sum(-1)
    # The rest is summed directly (not sum - top-k): the tail mass is often tiny next to the total.
    rest = exp.masked_fill_(_in_ids(ids, x.shape[-1]), 0.0).sum(-1)
    return torch.cat([m, sum_exp[:, None], rest[:, None], picked], dim=-1)


def topk_grad(x, ids, temperature, m, log_sum, log_rest, g_ids, g_tail, out) -> None:
    """out = d(sum_k g_ids[k] logprob_k + g_tail tail)/dx, with logprob_k = z_{id_k} - M - log_sum and
    tail = log_rest - log_sum (log_rest = +inf where the tail mass was floored: no gradient):
    d/dz_v = sum_k g_k [v = id_k] - p_v (sum_k g_k + g_tail) + g_tail [v not in ids] exp(z_v - M - log_rest)."""
    if x.shape[-1] == 0:
        return
    shifted = (x.float() / temperature).sub_(m[:, None])
    total = g_ids.sum(-1) if g_tail is None else g_ids.sum(-1) + g_tail
    grad = (shifted - log_sum[:, None]).exp_().mul_(-total[:, None])
    owned = _owned(ids, x.shape[-1])
    safe = ids.clamp(0, max(x.shape[-1] - 1, 0))
    if g_tail is not None:
        tail = shifted.sub_(log_rest[:, None]).exp_().mul_(g_tail[:, None])
        grad.add_(tail.masked_fill_(_in_ids(ids, x.shape[-1]), 0.0))
    grad.scatter_add_(-1, safe, torch.where(owned, g_ids, 0.0))
    out.copy_(grad.div_(temperature))


def lse_stats(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 2]: max m and sum exp(z - m)."""
    if x.shape[-1] == 0:
        return _empty_stats(x, 2)
    z = x.float() / temperature
    m = z.max(dim=-1, keepdim=True).values
    return torch.cat([m, z.sub_(m).exp_().sum(-1, keepdim=True)], dim=-1)


def _log_probs(x, temperature, log_z):
    return (x.float() / temperature).sub_(log_z[:, None])


def _floored(ls: torch.Tensor, lt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """algorithms.generalized_jsd_terms' floors, in place: both log-probs at least LOGPROB_FLOOR (the
    student's floor is straight-through, so its derivative is taken at the floored value)."""
    return ls.clamp_(min=LOGPROB_FLOOR), lt.clamp_(min=LOGPROB_FLOOR)


def _mixture(ls, lt, beta):
    """log M = log(beta P_t + (1 - beta) P_s), as algorithms.generalized_jsd_terms forms it."""
    return torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))


def full_terms(xs, xt, temperature, log_zs, log_zt, beta) -> torch.Tensor:
    """[n]: this shard's sum of algorithms.generalized_jsd_terms(ls, lt, beta), ls = zs - log Zs and
    lt = zt - log Zt the student's and the teacher's global log-softmax (log_z* = M + log_sum).
    Written out per beta (the same formulas, fewer temporaries than the general function):
    beta 1: p_s (ls - lt); beta 0: p_t (lt - ls); else beta p_t (lt - lm) + (1 - beta) p_s (ls - lm)."""
    ls, lt = _floored(_log_probs(xs, temperature, log_zs), _log_probs(xt, temperature, log_zt))
    if beta == 1:
        return ls.exp().mul_(ls - lt).sum(-1)
    if beta == 0:
        return lt.exp().mul_(lt - ls).sum(-1)
    lm = _mixture(ls, lt, beta)
    return (lt.exp().mul_(lt - lm).mul_(beta) + ls.exp().mul_(ls - lm).mul_(1.0 - beta)).sum(-1)


def _direct_grad(xs, xt, temperature, log_zs, log_zt, beta, g) -> torch.Tensor:
    """d(g sum_v terms_v)/d ls_v at fixed normalisers, [n, r]: beta 1: p_s (ls - lt + 1); beta 0: -p_t
    (0 where ls is -inf: the straight-through floor passes no gradient there); else
    (1 - beta) p_s (ls - lm) (the lm terms cancel: beta p_t + (1 - beta) p_s = M). Where the other
    two are at ls = -inf, p_s = exp(floor) is 0 already."""
    ls = _log_probs(xs, temperature, log_zs)
    if beta == 0:
        unfloored = ~torch.isfinite(ls)
        return _log_probs(xt, temperature, log_zt).clamp_(min=LOGPROB_FLOOR).exp_().neg_().mul_(
            g[:, None]).masked_fill_(unfloored, 0.0)
    ls, lt = _floored(ls, _log_probs(xt, temperature, log_zt))
    if beta == 1:
        direct = ls.exp().mul_(ls.sub_(lt).add_(1.0))
    else:
        direct = ls.exp().mul_(ls - _mixture(ls, lt, beta)).mul_(1.0 - beta)
    return direct.mul_(g[:, None])


def full_direct_sum(xs, xt, temperature, log_zs, log_zt, beta, g) -> torch.Tensor:
    """[n]: this shard's sum over v of d(g terms)/d ls_v (the normaliser's share of the gradient)."""
    return _direct_grad(xs, xt, temperature, log_zs, log_zt, beta, g).sum(-1)


def full_grad(xs, xt, temperature, log_zs, log_zt, beta, g, direct_sum, out) -> None:
    """out = d(g loss)/dxs = (d/dls - p_s * direct_sum) / T, direct_sum all-reduced over the shards."""
    direct = _direct_grad(xs, xt, temperature, log_zs, log_zt, beta, g)
    p = _log_probs(xs, temperature, log_zs).exp_()
    out.copy_(direct.sub_(p.mul_(direct_sum[:, None])).div_(temperature))
