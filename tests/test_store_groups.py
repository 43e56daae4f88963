"""megarl's own process groups between roles (new_store_group: cross-role, weight-sync), with every launched
rank a thread of this process on one in-memory store (helpers.in_thread_ranks): real gloo groups, no launch."""

import torch

from helpers import in_thread_ranks

from megarl.placement import EngineGroup, Placement
from megarl.weight_sync import build_weight_sync


def separate(train: int = 1, rollout: int = 2, teacher: int = 0) -> Placement:
    """Separate placement: train ranks first, then rollout ranks, then standalone teacher ranks (TP 1 each)."""
    rollout_ranks = tuple(range(train, train + rollout))
    teacher_ranks = tuple(range(train + rollout, train + rollout + teacher))
    return Placement(train + rollout + teacher, False, False, tuple(range(train)), EngineGroup(rollout_ranks, 1),
                     EngineGroup(teacher_ranks, 1) if teacher else None, 1, 1, 1)


class _Actor:
    """Stands in for megarl's Actor: its weight stream only (`hf_weights`)."""

    def __init__(self, weights):
        self.weights = weights

    def hf_weights(self, bucket_bytes):
        return iter(self.weights)


class _Engine:
    """Stands in for a rollout engine: keeps what `load_weights` receives."""

    def __init__(self):
        self.loaded = {}

    def load_weights(self, stream):
        self.loaded.update((name, tensor.clone()) for name, tensor in stream)


def test_weight_sync_group_is_named_and_warmed_up_at_build_then_carries_the_weights():
    """The group's first collective runs when the strategy is built (NCCL would create its communicator
    there, on the rank's device, not inside the first sync); the sync afterwards is unaffected."""
    weights = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(5, dtype=torch.bfloat16)),
               ("c", torch.arange(4))]

    def rank(context):
        strategy = build_weight_sync(context, bucket_bytes=32)
        group = strategy.group
        built = (group._get_sequence_number_for_group(), group.options.group_name)
        engine = None if context.is_train else _Engine()
        strategy.sync(_Actor(weights) if context.is_train else None, engine)
        return built, None if engine is None else engine.loaded

    results = in_thread_ranks(separate(train=1, rollout=2), rank)
    for built, _ in results:
        assert built == (1, "megarl/weight-sync")  # one collective, the warm-up, before any sync
    for _, loaded in results[1:]:
        assert list(loaded) == ["a", "b", "c"]
        assert all(torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
                   for name, tensor in weights)


def test_cross_role_group_is_warmed_up_at_build():
    def rank(context):
        return context.cross_role_group._get_sequence_number_for_group(), context.cross_role_group.size()

    assert in_thread_ranks(separate(train=1, rollout=1), rank) == [(1, 2), (1, 2)]


def test_tensor_dicts_cross_roles_as_tensors_in_rank_order():
    """Standalone teacher -> every rank: two teacher engines' shards of different sizes and dtypes arrive
    bit for bit on every rank, in launch-rank order; ranks without a part give None."""
    from megarl.distributed import gather_tensor_dicts

    def part(rank):
        n = 3 if rank == 2 else 2  # uneven shards, as contiguous_shard gives
        generator = torch.Generator().manual_seed(rank)
        return {"teacher_topk_ids": torch.randint(0, 2**31 - 1, (n, 5, 4), generator=generator, dtype=torch.int32),
                "teacher_topk_logprobs": torch.randn(n, 5, 4, generator=generator),
                "teacher_logprobs": torch.randn(n, 5, generator=generator, dtype=torch.float64)[:, 1:],  # a view
                "empty": torch.zeros(0, 5)}

    def rank(context):
        return gather_tensor_dicts(part(context.rank) if "teacher" in context.roles else None, context)

    placement = separate(train=1, rollout=1, teacher=2)
    for gathered in in_thread_ranks(placement, rank):
        assert gathered[:2] == [None, None]
        for source in (2, 3):
            expected = part(source)
            assert list(gathered[source]) == list(expected)
            for name, tensor in expected.items():
                got = gathered[source][name]
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (source, name)
