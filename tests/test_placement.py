"""Placement: rank sets, sizes and one-line errors, computed from arguments alone (no torchrun)."""

from types import SimpleNamespace

import pytest

from megarl.placement import Placement, PlacementError


def args(**overrides):
    values = dict(colocate_groups=[["train", "rollout"]], train_gpus=None, rollout_gpus=None, teacher_gpus=0,
                  tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                  rollout_tensor_parallel_size=1, teacher_tensor_parallel_size=1, teacher_model=None)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_colocate_takes_every_rank_and_splits_train_into_tp_and_dp():
    placement = Placement.from_args(args(tensor_model_parallel_size=2, rollout_tensor_parallel_size=4), 8)
    assert placement.colocated and placement.train_ranks == placement.rollout_ranks == tuple(range(8))
    assert (placement.tp, placement.dp) == (2, 4)
    # Megatron's order: TP fastest, so ranks 0,1 are data-parallel rank 0, ranks 6,7 rank 3.
    assert [placement.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert placement.rollout.num_engines == 2
    assert [placement.rollout.engine_index(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [r for r in range(8) if placement.rollout.is_engine_leader(r)] == [0, 4]
    assert placement.roles_of(3) == ("train", "rollout")
    assert placement.world_of(5) == ("train+rollout", tuple(range(8)))
    assert not placement.needs_cross_role_group and placement.weight_sync_members == ()


def test_context_parallel_sits_between_tp_and_dp():
    placement = Placement.from_args(args(tensor_model_parallel_size=2, context_parallel_size=2), 8)
    assert placement.dp == 2
    assert [placement.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_separate_places_rollout_after_train_and_fills_in_the_other_count():
    placement = Placement.from_args(args(colocate_groups=[], rollout_gpus=2, rollout_tensor_parallel_size=2), 6)
    assert placement.train_ranks == (0, 1, 2, 3) and placement.rollout_ranks == (4, 5)
    assert placement.dp == 4 and placement.rollout.num_engines == 1
    assert placement.rollout.role_rank(5) == 1 and placement.rollout.engine_index(5) == 0
    assert placement.roles_of(4) == ("rollout",) and placement.world_of(4) == ("rollout", (4, 5))
    assert placement.world_of(1) == ("train", (0, 1, 2, 3))
    assert placement.needs_cross_role_group
    assert placement.weight_sync_members == (0, 4, 5)
    assert "separate, 6 ranks" in placement.describe() and "rollout ranks 4-5: TP=2, 1 vLLM engine(s)" in \
        placement.describe()


def test_standalone_teacher_ranks_come_last_in_a_world_of_their_own():
    placement = Placement.from_args(args(teacher_gpus=2, teacher_tensor_parallel_size=2), 6)
    assert placement.train_ranks == placement.rollout_ranks == (0, 1, 2, 3)
    assert placement.teacher_ranks == (4, 5) and placement.teacher.num_engines == 1
    assert placement.roles_of(5) == ("teacher",) and placement.world_of(5) == ("teacher", (4, 5))
    assert placement.needs_cross_role_group  # two worlds, though train and rollout share ranks
    separate = Placement.from_args(args(colocate_groups=[], train_gpus=1, rollout_gpus=1, teacher_gpus=1), 3)
    assert (separate.train_ranks, separate.rollout_ranks, separate.teacher_ranks) == ((0,), (1,), (2,))


def test_colocated_teacher_lives_on_the_train_ranks():
    placement = Placement.from_args(args(colocate_groups=[["train", "rollout", "teacher"]]), 2)
    assert placement.teacher_colocated and placement.teacher is None and placement.teacher_ranks == ()
    assert placement.roles_of(1) == ("train", "rollout", "teacher")
    top_level = Placement.from_args(args(teacher_model="teacher/"), 2)  # teacher_model alone: on the train ranks
    assert top_level.teacher_colocated and top_level.roles_of(0) == ("train", "rollout", "teacher")
    separate_rollout = Placement.from_args(args(colocate_groups=[["train", "teacher"]], train_gpus=1), 2)
    assert not separate_rollout.colocated and separate_rollout.roles_of(0) == ("train", "teacher")
    assert separate_rollout.roles_of(1) == ("rollout",)


INVALID = [
    (dict(tensor_model_parallel_size=3), 2, ["train.gpus=2", "tensor_model_parallel_size"]),
    (dict(train_gpus=2, rollout_gpus=1), 2, ["different rank counts", "train.gpus=2", "rollout.gpus=1"]),
    (dict(colocate_groups=[], train_gpus=2, rollout_gpus=1), 2, ["needs 3 ranks", "2 were launched"]),
    (dict(colocate_groups=[], rollout_gpus=1), 4, []),  # valid: 3 train + 1 rollout
    (dict(colocate_groups=[]), 2, ["separate placement needs train.gpus or rollout.gpus"]),
    (dict(colocate_groups=[], train_gpus=2), 2, ["rollout.gpus=0", "at least one"]),
    (dict(train_gpus=1), 2, ["2 ranks were launched", "uses 1", "idle ranks"]),
    (dict(rollout_tensor_parallel_size=2), 3, ["rollout.gpus=3", "rollout.tensor_parallel_size=2"]),
    (dict(teacher_gpus=3, teacher_tensor_parallel_size=2), 5, ["teacher.gpus=3", "teacher.tensor_parallel_size=2"]),
    (dict(colocate_groups=[["train", "rolout"]]), 2, ["unknown role 'rolout'", "did you mean 'rollout'"]),
    (dict(colocate_groups=[["train", "rollout"], ["rollout", "teacher"]]), 2, ["'rollout' is listed twice"]),
    (dict(colocate_groups=[["rollout", "teacher"]], train_gpus=1), 2, ["share ranks only with train"]),
    (dict(colocate_groups=[["train", "rollout", "teacher"]], teacher_gpus=1), 3, ["teacher.gpus=1", "colocated"]),
    (dict(pipeline_model_parallel_size=0), 2, ["--pipeline-model-parallel-size must be >= 1"]),
    (dict(teacher_gpus=-1), 2, ["--teacher-gpus must be >= 0"]),
]


@pytest.mark.parametrize("overrides,world,words", INVALID)
def test_invalid_placements_fail_on_one_line(overrides, world, words):
    if not words:
        Placement.from_args(args(**overrides), world)
        return
    with pytest.raises(PlacementError) as error:
        Placement.from_args(args(**overrides), world)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
