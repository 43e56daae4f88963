"""Micro-batches by a token budget, and the layout of sequences packed into one row.

Token budget (--max-tokens-per-micro-batch N, verl's dynamic batch size): a rank's
samples are grouped so that each group's real tokens (prompt + response) sum to at
most N; a sample longer than N is a group of its own. Megatron's schedule and the DDP
gradient all-reduce are collective over the data-parallel ranks, so every rank must
run the same number of micro-batches: each rank counts the groups it needs
(`partition_count`), the ranks take the largest count, and each splits its samples
into exactly that many groups (`token_budget_partitions`), balanced by tokens when
the balanced split fits the budget.

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


def _balanced(indices, lengths: list[int], count: int) -> list[list[int]]:
    """Longest first, each to the lightest group (LPT): `count` groups of near-equal tokens."""
    groups, loads = [[] for _ in range(count)], [0] * count
    for i in sorted(indices, key=lambda i: -lengths[i]):
        lightest = loads.index(min(loads))
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
