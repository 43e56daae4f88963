"""Context parallelism (--context-parallel-size CP): each sequence's tokens split over CP ranks.

Layout (Megatron-LM's, so that Transformer Engine's context-parallel attention reads it as its
own): a packed micro-batch (--padding-free) lays each sequence in a slot padded to a multiple
of 2 x CP tokens (`slot_length`); the slot is cut into 2 x CP equal chunks and CP rank r holds
chunks r and 2 x CP - 1 - r of every sequence, in that order (`local_positions`). Pairing an
early chunk with a late one gives every rank the same causal-attention work. The packed
sequence parameters keep the whole slots' boundaries (TE and Megatron's THD RoPE divide them by
CP themselves); padding sits at the end of each slot, after the sequence's last token, so no
real token attends to it.

What a CP rank computes is this rank's tokens only; the per-token results every loss and every
kept output needs are gathered back into the whole micro-batch (`gather`), so losses, metrics
and sequence-level terms (seq-mean-token-mean, sequence-level TIS) see whole sequences and are
computed exactly as without CP, redundantly on each CP rank. The gather's backward sums the
gradients of all CP ranks' copies of the loss before each keeps its own tokens' part, so every
rank's gradient is CP times that of one copy; Megatron counts the loss units over the
data-parallel x context-parallel group (finalize_model_grads), CP times as well, and the
ratio is the exact mean. The same gather with the same backward brings every rank the keys and
values of whole sequences in the local attention of hosts without Transformer Engine
(megarl/models/attention.py), where TE's ring attention is not available.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size() if parallel_state.is_initialized() else 1


def slot_length(length: int, cp: int) -> int:
    """A sequence's slot in a packed row: its length rounded up to a multiple of 2 x CP (itself at CP 1)."""
    multiple = 2 * cp if cp > 1 else 1
    return -(-length // multiple) * multiple


def packed_slots(lengths: list[int], cp: int, sequence_multiple: int = 1) -> list[int]:
    """The slots of sequences of these lengths in one packed row: each `slot_length`, the last one
    lengthened so that each CP rank's share of the row (1/CP of it) is a multiple of `sequence_multiple`
    (the TP size under sequence parallelism, which splits the sequence over the TP ranks). The extra
    padding sits after the last sequence's end, like a slot's own, in whole 2 x CP steps so that the
    slot's CP chunks stay equal."""
    slots = [slot_length(length, cp) for length in lengths]
    row = math.lcm(cp * sequence_multiple, slot_length(1, cp))  # sum(slots) is a multiple of slot_length(1, cp)
    slots[-1] += -sum(slots) % row
    return slots


def local_positions(slots: list[int], cp: int, rank: int) -> torch.Tensor:
    """The packed row's positions CP rank `rank` holds, in its local order: for each slot (laid end to
    end), chunk `rank` and chunk 2 x CP - 1 - `rank` of its 2 x CP equal chunks (every position, in
    order, at CP 1)."""
    if cp == 1:
        return torch.arange(sum(slots))
    positions, start = [], 0
    for slot in slots:
        chunk = slot // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            positions.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += slot
    return torch.cat(positions)


def gather(local: torch.Tensor, slots: list[int], dim: int = 1) -> torch.Tensor:
    """Every CP rank's `local` tensor (positions along `dim`, as `local_positions`) placed back into the
    whole packed row, differentiable (the backward sums all CP ranks' gradients of the whole row and
    keeps this rank's positions)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    return _GatherPositions.apply(local, slots, dim, group)


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, slots, dim, group):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        shape = list(local.shape)
        shape[dim] = sum(slots)
        whole = local.new_empty(shape)
        for source, part in enumerate(parts):
            whole.index_copy_(dim, local_positions(slots, cp, source).to(local.device), part)
        ctx.dim, ctx.group, ctx.mine = dim, group, local_positions(slots, cp, rank).to(local.device)
        return whole

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: not autograd's buffer
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(ctx.dim, ctx.mine), None, None, None
