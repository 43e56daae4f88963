"""Micro-batches by a token budget, and the layout of sequences packed into one row.

Token budget (--max-tokens-per-micro-batch N, verl's dynamic batch size): a rank's
samples are grouped so that each group's real tokens (prompt + response) sum to at
most N; a sample longer than N is a group of its own. Megatron's schedule and the DDP
gradient all-reduce are collective over the data-parallel ranks, so every rank must
run the same number of micro-batches: each rank counts the groups it needs
(`partition_count`), the ranks take the largest count, and each splits its samples
into exactly that many groups (`token_budget_partitions`), balanced by tokens when
the balanced split fits the budget.

Data-parallel balance (--balance-batch, on by default): each mini-batch's samples go to the
data-parallel ranks in equal numbers and near-equal tokens (`data_parallel_partitions`) rather than
in contiguous shares, since the ranks' update ends at the gradient all-reduce, when the slowest is done.

Packing (--padding-free): the samples of a micro-batch are laid end to end in one
row; each restarts its positions at 0 and attends only to itself (the THD format,
`offsets` are its cu_seqlens; megarl/models/attention.py on hosts without
Transformer Engine), so no padding token enters the model.
"""

from __future__ import annotations

import itertools


def partition_count(lengths: list[int], budget: int) -> int:
    """How many groups first-fit decreasing needs to keep each within `budget` tokens."""
    return len(_first_fit_decreasing(lengths, budget))


def token_budget_partitions(lengths: list[int], budget: int, count: int) -> list[list[int]]:
    """Exactly `count` non-empty groups of the indices of `lengths`, each summing to at most
    `budget` unless it is one sample; count must lie between `partition_count` and len(lengths).
    Groups hold ascending indices and are ordered by their first index."""
    if not partition_count(lengths, budget) <= count <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} samples into {count} groups of <= {budget} tokens")
    groups = _balanced(range(len(lengths)), lengths, count)
    if not all(_fits(group, lengths, budget) for group in groups):
        # The balanced split overflows: fill to the budget, then halve the largest groups.
        groups = _first_fit_decreasing(lengths, budget)
        while len(groups) < count:
            largest = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
            groups.remove(largest)
            groups += _balanced(largest, lengths, 2)
    return sorted((sorted(group) for group in groups), key=lambda group: group[0])


def _fits(group: list[int], lengths: list[int], budget: int) -> bool:
    return len(group) == 1 or sum(lengths[i] for i in group) <= budget


def data_parallel_partitions(lengths: list[int], count: int) -> list[list[int]]:
    """The samples of a mini-batch split over `count` data-parallel ranks: equal numbers of samples, near-equal
    tokens (verl's balance_batch), so that no rank's update waits on a rank with more tokens. Ascending indices
    per group; the same answer on every rank (it depends on the lengths only). len(lengths) must divide."""
    if len(lengths) % count:
        raise ValueError(f"{len(lengths)} samples do not split evenly over {count} data-parallel ranks")
    return [sorted(group) for group in _balanced(range(len(lengths)), lengths, count, len(lengths) // count)]


def _balanced(indices, lengths: list[int], count: int, capacity: int | None = None) -> list[list[int]]:
    """Longest first, each to the lightest group (LPT) that holds fewer than `capacity` indices: `count`
    groups of near-equal tokens. Ties go to the lowest group, so the result is deterministic."""
    groups, loads = [[] for _ in range(count)], [0] * count
    for i in sorted(indices, key=lambda i: -lengths[i]):
        lightest = min((g for g in range(count) if capacity is None or len(groups[g]) < capacity),
                       key=lambda g: loads[g])
        groups[lightest].append(i)
        loads[lightest] += lengths[i]
    return groups


def _first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    groups, loads = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((g for g, load in enumerate(loads) if load + lengths[i] <= budget), None)
        if fit is None:
            groups.append([i])
            loads.append(lengths[i])
        else:
            groups[fit].append(i)
            loads[fit] += lengths[i]
    return groups


def offsets(lengths: list[int]) -> list[int]:
    """Where each of the sequences laid end to end starts: [0, l0, l0 + l1, ...] (one more than lengths)."""
    return [0, *itertools.accumulate(lengths)]
