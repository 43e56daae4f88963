"""Per-token logprobs and entropy of a vocabulary-sharded softmax, one signature per operation,
implementations selected by name (groundwork for fused kernels, issue 12).

    "naive"    today's math (megarl/vocab_parallel.py, Megatron's output layer): the reference.
    "chunked"  plain torch over chunks of tokens, with a custom autograd.Function that keeps only
               per-token statistics for backward and recomputes each chunk there. Besides the
               gradient it returns, it never holds an fp32 [tokens, V/TP] intermediate beyond
               one chunk; from hidden states it never holds the logits at all.

Conventions shared with vocab_parallel.py: each TP rank holds V/TP columns of the (padded)
vocabulary; partial sums are all-reduced over the TP group *before* they are combined; the
outputs are identical on every TP rank, and each rank's backward gives the gradient of those
replicated outputs w.r.t. its own shard (identity backward of the sums, as
vocab_parallel_cross_entropy does), so the caller's loss needs no TP reduction. Megatron's
padding columns (global index >= vocab_size) are excluded; they get zero gradient.
Labels that no shard owns (e.g. -100) give log p = M - log Z, M the largest logit, with no label
term in the gradient, as vocab_parallel_cross_entropy does (its label logit is 0 after the max
is subtracted).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Tokens per chunk, when not given: as many as keep one fp32 [tokens, shard width] temporary
# within this budget, so the peak follows the shard width (vocabulary / TP), not a fixed count.
# 64 MiB is 110 tokens of Qwen2's 151,936-entry vocabulary at TP=1.
CHUNK_BYTES = 64 * 2**20


def default_chunk_tokens(shard_width: int) -> int:
    return max(1, CHUNK_BYTES // (4 * shard_width))


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float,
                         impl: str, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits / T)[label], entropy of softmax(logits / T)), each [b, L], from this TP
    rank's vocabulary shard logits [b, L, V/TP]; differentiable in `logits` through both."""
    if impl == "naive":
        from megarl import vocab_parallel

        return (vocab_parallel.logprobs(logits, labels, vocab_size, temperature),
                vocab_parallel.entropy(logits, vocab_size, temperature))
    _check_impl(impl)
    chunk = chunk_tokens or default_chunk_tokens(logits.shape[-1])
    return _ChunkedFromLogits.apply(logits, labels, vocab_size, temperature, chunk)


def logprobs_and_entropy_from_hidden(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                     vocab_size: int, temperature: float, impl: str,
                                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_and_entropy` of the logits hidden @ weight_shard.T (Megatron's column-parallel
    output layer, no bias), differentiable in `hidden` [b, L, H] and `weight_shard` [V/TP, H].

    `hidden` is replicated over the TP ranks, as the output layer's input is without sequence
    parallelism (which megarl does not turn on): its gradient is the sum of every shard's part,
    all-reduced here (Megatron's copy_to_tensor_model_parallel_region).
    """
    if impl == "naive":
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        logits = torch.matmul(copy_to_tensor_model_parallel_region(hidden), weight_shard.t())
        return logprobs_and_entropy(logits, labels, vocab_size, temperature, "naive")
    _check_impl(impl)
    chunk = chunk_tokens or default_chunk_tokens(weight_shard.shape[0])
    return _ChunkedFromHidden.apply(hidden, weight_shard, labels, vocab_size, temperature, chunk)


IMPLS = ("naive", "chunked")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r} ({', '.join(IMPLS)})")


# ------------------------------------------------------------------ shared math ----
def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _real_columns(shard_width: int, vocab_size: int, group) -> tuple[int, int]:
    """(global index of this shard's first column, how many of its columns are real vocabulary).
    Padding sits at the end of the global vocabulary, hence at the end of a shard (or is all of it)."""
    start = dist.get_rank(group) * shard_width
    return start, max(0, min(shard_width, vocab_size - start))


# The per-chunk functions below work in place on `z`, a scratch fp32 chunk of scaled logits
# they own, so that a chunk costs two [n, r] fp32 buffers, not one per arithmetic step.

def _local_stats(z: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    """[n, 5] per token over this shard's real columns z [n, r] (scaled, fp32; overwritten): max m,
    sum exp(z - m), sum exp(z - m) (z - m), z at the label and 1 if this shard owns the label
    (both 0 otherwise)."""
    if z.shape[-1] == 0:  # a shard of padding only: contributes nothing (its max is the dtype's min)
        stats = torch.zeros(z.shape[0], 5, dtype=z.dtype, device=z.device)
        stats[:, 0] = torch.finfo(z.dtype).min
        return stats
    owned = (local_labels >= 0) & (local_labels < z.shape[-1])
    picked = torch.where(owned, z.gather(-1, local_labels.clamp(0, z.shape[-1] - 1)[:, None])[:, 0], 0.0)
    m = z.max(dim=-1, keepdim=True).values
    shifted = z.sub_(m)
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    weighted = exp.mul_(shifted).sum(-1)
    return torch.stack([m[:, 0], sum_exp, weighted, picked, owned.to(z.dtype)], dim=-1)


def _combine(stats: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Per-token (global max M, log sum exp(z - M), E = sum p (z - M), z at the label) from every
    shard's `_local_stats`: two all-reduces for all tokens at once (max, then the rescaled sums).
    A label no shard owns takes z = M (Megatron's convention, see the module docstring).

    The entropy is then log sum exp(z - M) - E: both terms are shifted by M, so logits of
    large magnitude do not cancel.
    """
    m_local = stats[:, 0]
    m = m_local.clone()
    sums = stats[:, 1:].clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        scale = (m_local - m).exp()
        # sum exp(z - M)(z - M) = scale (sum exp(z - m)(z - m) + (m - M) sum exp(z - m)), per shard.
        sums[:, 1] = scale * (sums[:, 1] + (m_local - m) * sums[:, 0])
        sums[:, 0] = scale * sums[:, 0]
        dist.all_reduce(sums, group=group)
    picked = torch.where(sums[:, 3] > 0, sums[:, 2], m)
    return m, sums[:, 0].log(), sums[:, 1] / sums[:, 0], picked


def _outputs(m, log_sum, expected, picked, shape):
    """(logprob, entropy) [b, L]: log p(label) = z_label - M - log sum; H = log sum - E."""
    return (picked - m - log_sum).view(shape), (log_sum - expected).view(shape)


def _grad_z(z, local_labels, m, log_sum, expected, grad_logprob, grad_entropy) -> torch.Tensor:
    """d(sum g_lp logprob + g_H entropy)/dz on this shard's real columns z [n, r] (overwritten):
    g_lp (onehot - p) - g_H p (z - M - E), p the global softmax."""
    shifted = z.sub_(m[:, None])
    grad = (shifted - log_sum[:, None]).exp_()  # p
    if grad_entropy is None:
        grad.mul_(grad_logprob[:, None])
    else:
        coef = shifted.sub_(expected[:, None]).mul_(grad_entropy[:, None])
        if grad_logprob is not None:
            coef.add_(grad_logprob[:, None])
        grad.mul_(coef)
    grad.neg_()
    if grad_logprob is not None:
        owned = (local_labels >= 0) & (local_labels < z.shape[-1])
        rows = owned.nonzero()[:, 0]
        grad[rows, local_labels[rows]] += grad_logprob[rows]
    return grad


def _flat_grads(grad_logprob, grad_entropy):
    return [None if g is None else g.reshape(-1).float() for g in (grad_logprob, grad_entropy)]


# ------------------------------------------------------------ chunked from logits ----
class _ChunkedFromLogits(torch.autograd.Function):
    """Forward: per-token statistics chunk by chunk; saved for backward: the logits (the caller's
    tensor, already alive) and three floats per token. Backward: each chunk's softmax recomputed."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature, chunk):
        ctx.set_materialize_grads(False)
        group = _tp_group()
        x = logits.reshape(-1, logits.shape[-1])
        start, real = _real_columns(x.shape[-1], vocab_size, group)
        local_labels = labels.reshape(-1) - start
        stats = torch.empty(x.shape[0], 5, dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[0], chunk):
            z = x[i:i + chunk, :real].float() / temperature
            stats[i:i + chunk] = _local_stats(z, local_labels[i:i + chunk])
        m, log_sum, expected, picked = _combine(stats, group)
        ctx.save_for_backward(logits, local_labels, m, log_sum, expected)
        ctx.temperature, ctx.real, ctx.chunk = temperature, real, chunk
        return _outputs(m, log_sum, expected, picked, labels.shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local_labels, m, log_sum, expected = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None
        g_lp, g_h = _flat_grads(grad_logprob, grad_entropy)
        x = logits.reshape(-1, logits.shape[-1])
        grad = torch.zeros_like(x)  # padding columns keep a zero gradient
        real, chunk = ctx.real, ctx.chunk
        for i in range(0, x.shape[0], chunk):
            rows = slice(i, i + chunk)
            z = x[rows, :real].float() / ctx.temperature
            grad_z = _grad_z(z, local_labels[rows], m[rows], log_sum[rows], expected[rows],
                             None if g_lp is None else g_lp[rows], None if g_h is None else g_h[rows])
            grad[rows, :real] = grad_z.div_(ctx.temperature)
        return grad.view_as(logits), None, None, None, None


# ------------------------------------------------------------ chunked from hidden ----
class _ChunkedFromHidden(torch.autograd.Function):
    """As _ChunkedFromLogits, with each chunk's logits formed from the hidden states (and formed
    again in backward): the [tokens, V/TP] logits never exist beyond one chunk. The weight's
    gradient is accumulated in fp32 over the chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, temperature, chunk):
        ctx.set_materialize_grads(False)
        group = _tp_group()
        h = hidden.reshape(-1, hidden.shape[-1])
        start, real = _real_columns(weight.shape[0], vocab_size, group)
        w = weight[:real]  # padding rows of the output layer take no part
        local_labels = labels.reshape(-1) - start
        stats = torch.empty(h.shape[0], 5, dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], chunk):
            z = (h[i:i + chunk] @ w.t()).float().div_(temperature)
            stats[i:i + chunk] = _local_stats(z, local_labels[i:i + chunk])
        m, log_sum, expected, picked = _combine(stats, group)
        ctx.save_for_backward(hidden, weight, local_labels, m, log_sum, expected)
        ctx.temperature, ctx.real, ctx.chunk, ctx.group = temperature, real, chunk, group
        return _outputs(m, log_sum, expected, picked, labels.shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, local_labels, m, log_sum, expected = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None
        g_lp, g_h = _flat_grads(grad_logprob, grad_entropy)
        h = hidden.reshape(-1, hidden.shape[-1])
        real, chunk = ctx.real, ctx.chunk
        w = weight[:real]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(h) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for i in range(0, h.shape[0], chunk):
            rows = slice(i, i + chunk)
            z = (h[rows] @ w.t()).float().div_(ctx.temperature)
            grad_z = _grad_z(z, local_labels[rows], m[rows], log_sum[rows], expected[rows],
                             None if g_lp is None else g_lp[rows], None if g_h is None else g_h[rows])
            grad_logits = grad_z.div_(ctx.temperature).to(h.dtype)
            if want_hidden:
                grad_hidden[rows] = grad_logits @ w
            if want_weight:
                grad_weight[:real].addmm_(grad_logits.t().float(), h[rows].float())
        if want_hidden and dist.get_world_size(ctx.group) > 1:  # every shard's logits depend on the hidden
            dist.all_reduce(grad_hidden, group=ctx.group)
        return (grad_hidden.view_as(hidden) if want_hidden else None,
                grad_weight.to(weight.dtype) if want_weight else None, None, None, None, None)
