"""Vocabulary-parallel math on logits sharded over tensor-parallel ranks.

Each TP rank holds logits for V/TP vocabulary entries. Everything here reduces
partial sums across the shards *before* combining them (global max, global sum
of exponentials, global weighted sums), so the full vocabulary is never gathered
on one rank and every shard's gradient is exact. (A per-shard log_softmax whose
reductions have an identity backward gives wrong gradients at TP > 1.)
Megatron pads the vocabulary to a multiple of 128 * TP: the padding columns are
masked out (set to the dtype's minimum) before any softmax.

This is the module the fused kernels replace: same signatures, chunked or Triton
implementations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def scaled_logits(logits: torch.Tensor, vocab_size: int, temperature: float, held_back=None) -> torch.Tensor:
    """logits / T in fp32, with Megatron's vocabulary-padding columns of this shard set to -inf (finite min),
    and so are the ids of `held_back` (a kernels.HeldBack) this shard owns, at its positions."""
    from megatron.core import parallel_state

    z = logits.float() / temperature
    shard = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    first_padded = vocab_size - start
    if first_padded < shard:
        z[..., max(first_padded, 0):] = torch.finfo(z.dtype).min
    if held_back is not None:
        held = torch.zeros(shard, dtype=torch.bool, device=z.device)
        held[held_back.on_shard(start, shard)[1]] = True
        z = z.masked_fill(held_back.where[..., None] & held, torch.finfo(z.dtype).min)
    return z


def logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float,
             held_back=None) -> torch.Tensor:
    """log softmax(logits / T)[label] from this TP rank's vocabulary shard, [b, L]."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(scaled_logits(logits, vocab_size, temperature, held_back),
                                                         labels)


def _shifted_exp_sum(z: torch.Tensor):
    """(exp(z - m), m, sum_v exp(z_v - m) over the whole TP-sharded vocabulary), m the global max.

    The sum is all-reduced with an identity backward: every rank then combines the
    global sums into the same loss, so each shard's share of the gradient is exact.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z_max = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp = torch.exp(z - z_max)
    return exp, z_max.squeeze(-1), reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))


def _weighted_vocab_sum(exp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_v exp_v x_v over the whole vocabulary; padding columns (exp exactly 0, x possibly
    huge) contribute 0 and no NaN."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region((exp * torch.where(exp > 0, x, 0.0)).sum(dim=-1))


def entropy(logits: torch.Tensor, vocab_size: int, temperature: float, held_back=None) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, [b, L], from this TP rank's vocabulary shard:
    H = log Z - sum_v p_v z_v, from global sums."""
    z = scaled_logits(logits, vocab_size, temperature, held_back)
    exp, z_max, sum_exp = _shifted_exp_sum(z)
    return torch.log(sum_exp) + z_max - _weighted_vocab_sum(exp, z) / sum_exp


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, vocab_size: int, temperature: float,
            held_back=None) -> torch.Tensor:
    """Exact KL(pi || ref) per position over the full vocabulary, [b, L], shard by shard.

    The formula of algorithms.kl_full, sum_v p (log p - log q), rewritten over global sums:
    KL = sum_v p_v (z_v - z'_v) - log Z + log Z' with z, z' the scaled logits of the
    policy and the reference. Differentiable in `logits`; ref_logits are constants.
    """
    return _kl_over_shards(scaled_logits(logits, vocab_size, temperature, held_back),
                           scaled_logits(ref_logits.detach(), vocab_size, temperature, held_back))


def _kl_over_shards(z_p: torch.Tensor, z_q: torch.Tensor) -> torch.Tensor:
    """KL(softmax(z_p) || softmax(z_q)) per position from scaled logit shards, differentiable in
    whichever side is not detached: sum_v p_v (z_v - z'_v) - log Z + log Z', from global sums."""
    exp_p, p_max, p_sum_exp = _shifted_exp_sum(z_p)
    _, q_max, q_sum_exp = _shifted_exp_sum(z_q)
    cross = _weighted_vocab_sum(exp_p, z_p - z_q) / p_sum_exp
    return cross - (torch.log(p_sum_exp) + p_max) + (torch.log(q_sum_exp) + q_max)


def _shard_start(shard: int) -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() * shard


@torch.no_grad()
def topk_logprobs(logits: torch.Tensor, k: int, vocab_size: int, temperature: float):
    """The top-k of log softmax(logits / T) over the whole sharded vocabulary: (global ids, logprobs),
    each [..., k], best first. Each shard proposes its own top-k; the TP ranks exchange
    only those k candidates (never the vocabulary) and keep the best k."""
    from megatron.core import parallel_state

    z = scaled_logits(logits, vocab_size, temperature)
    _, z_max, sum_exp = _shifted_exp_sum(z)
    log_normalizer = torch.log(sum_exp) + z_max
    values, ids = z.topk(min(k, z.shape[-1]), dim=-1)
    ids = ids + _shard_start(z.shape[-1])
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        values = _all_gather_last_dim(values, group)
        ids = _all_gather_last_dim(ids, group)
        values, best = values.topk(k, dim=-1)
        ids = ids.gather(-1, best)
    return ids, values - log_normalizer[..., None]


def _all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at global vocabulary `ids` [..., k], differentiable in this shard's
    logits: each shard fills the ids it owns, the shards' parts are summed (identity
    backward: every shard gets the gradient of the ids it owns)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = scaled_logits(logits, vocab_size, temperature)
    _, z_max, sum_exp = _shifted_exp_sum(z)
    shard = z.shape[-1]
    local = ids - _shard_start(shard)
    owned = (local >= 0) & (local < shard)
    picked = torch.where(owned, z.gather(-1, local.clamp(0, shard - 1)), 0.0)
    return reduce_from_tensor_model_parallel_region(picked) - (torch.log(sum_exp) + z_max)[..., None]



def _tail_logprob(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """log of softmax(logits / T)'s mass outside `ids` [..., k] -> [..., 1], from global sums (exact,
    with its gradient): sum of exp over this shard's columns not in `ids`, all-reduced."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = scaled_logits(logits, vocab_size, temperature)
    exp, _, sum_exp = _shifted_exp_sum(z)
    shard = z.shape[-1]
    local = ids - _shard_start(shard)
    owned = (local >= 0) & (local < shard)
    # Ids of other shards are marked in a spare last column, then dropped.
    in_ids = torch.zeros(*z.shape[:-1], shard + 1, dtype=torch.bool, device=z.device)
    in_ids = in_ids.scatter(-1, torch.where(owned, local, shard), True)[..., :shard]
    rest = reduce_from_tensor_model_parallel_region(exp.masked_fill(in_ids, 0.0).sum(dim=-1))
    # A tail of exactly 0 must give a floored log-mass, not log(0) with an infinite gradient.
    rest = rest.clamp(min=torch.finfo(rest.dtype).tiny)
    return (torch.log(rest) - torch.log(sum_exp))[..., None]


def distill_topk(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vocab_size: int,
                 beta: float, temperature: float, mode: str) -> torch.Tensor:
    """algorithms.GKD_TOPK_MODES[mode] per position from this shard's student logits: the student's
    log-probs at the teacher's ids (and its tail mass) come from global sums, then the same
    bins and generalized JSD as the pure functions."""
    from megarl.algorithms import topk_divergence

    student = gather_logprobs(logits, teacher_ids, vocab_size, temperature)
    tail = None
    if mode == "tail" and teacher_ids.shape[-1] < vocab_size:  # K == V leaves no tail bin
        tail = _tail_logprob(logits, teacher_ids, vocab_size, temperature)[..., 0]
    return topk_divergence(student, tail, teacher_logprobs, beta, mode)


@torch.no_grad()
def topk_mass(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The probability mass of softmax(logits / T) on `ids` [..., k] -> [...] (a metric)."""
    return gather_logprobs(logits, ids, vocab_size, temperature).exp().sum(dim=-1)


class _GlobalLogNormalizer(torch.autograd.Function):
    """log Z = log sum_v exp(z_v) over the whole sharded vocabulary, per position, on every TP rank.

    For losses that are summed shard by shard and then all-reduced: every shard's terms
    depend on log Z, so its gradient is the sum of the shards' parts (an all-reduce in
    backward), spread back over this shard's columns by softmax(z).
    """

    @staticmethod
    def forward(ctx, z, group):
        z_max = z.max(dim=-1, keepdim=True).values
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(z - z_max)
        total = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total)
        ctx.group = group
        return (torch.log(total) + z_max).squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        (softmax,) = ctx.saved_tensors
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[..., None] * softmax, None


def log_softmax(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) on this shard's columns, normalised over the whole vocabulary, for
    losses summed over this shard's columns and then all-reduced (the normaliser's gradient
    collects every shard's part); padding columns are hugely negative."""
    from megatron.core import parallel_state

    z = scaled_logits(logits, vocab_size, temperature)
    return z - _GlobalLogNormalizer.apply(z, parallel_state.get_tensor_model_parallel_group())[..., None]


def distill_full(logits: torch.Tensor, teacher_logits: torch.Tensor, vocab_size: int, beta: float,
                 temperature: float) -> torch.Tensor:
    """algorithms.distill_full per position from vocabulary shards. At TP = 1 the pure function on
    the real vocabulary; at TP > 1 each shard computes the generalized JSD's per-token terms
    (algorithms.generalized_jsd_terms, every beta) from log-probs normalised over the whole
    vocabulary (`log_softmax`), drops its padding columns, and the shards' sums are all-reduced
    (identity backward: each shard's direct terms are its own; the normaliser gathers the rest)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    from megarl.algorithms import distill_full as full_vocabulary, generalized_jsd_terms

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return full_vocabulary(logits[..., :vocab_size], teacher_logits[..., :vocab_size], beta, temperature)
    terms = generalized_jsd_terms(log_softmax(logits, vocab_size, temperature),
                                  log_softmax(teacher_logits.detach(), vocab_size, temperature), beta)
    shard = terms.shape[-1]
    real = torch.arange(shard, device=terms.device) + _shard_start(shard) < vocab_size
    return reduce_from_tensor_model_parallel_region(torch.where(real, terms, 0.0).sum(dim=-1))
