"""Context parallelism in the RL trainer: the layout of each CP rank's part of a packed sequence (and its
padding for sequence parallelism), and on real torchrun ranks (the tiny model, gloo, the all-gather
attention of hosts without Transformer Engine) CP=2 (also with PP=2, or with TP=2 under sequence
parallelism) giving the outputs, losses and gradients of CP=1, and a GRPO run with a distillation term
that trains at CP=2, syncs its weights to vLLM and resumes at CP=1."""

import math

import pytest
import torch
from helpers import (
    ROUNDING_LEVEL,
    assert_fp32_paths_agree,
    assert_moved,
    assert_runs_agree,
    assert_signal_alive,
    flat_series,
    read_json,
    scalars,
    torchrun,
)

from megarl import context_parallel

# The critic too (gae), and a sequence-level aggregation: whole sequences must meet in the loss.
WORKER = ["--micro-batch-size", "2", "--lr", "1e-3", "--critic-lr", "1e-3", "--advantage-estimator", "gae",
          "--padding-free", "--loss-agg", "sample_level"]
SMALL = ["--config", "examples/quickstart_grpo.yaml", "--prompts-per-step", "4", "--num-generations", "4",
         "--max-new-tokens", "12", "--micro-batch-size", "4", "--lr", "1e-3", "--kl-coef", "0.05", "--padding-free",
         "--distill-coef", "0.5", "--gkd-logits-topk", "4"]
COMPARED = ("loss", "grad_norm", "entropy", "kl_ref", "mismatch", "reward_mean", "distill_loss", "teacher_kl")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_holds_two_chunks_of_every_slot_with_equal_causal_work(cp):
    slots = [context_parallel.slot_length(length, cp) for length in (5, 12, 1, 30)]
    assert all(slot % (2 * cp) == 0 and slot - length < 2 * cp for slot, length in zip(slots, (5, 12, 1, 30)))
    parts = [context_parallel.local_positions(slots, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(sum(slots)))  # every position exactly once
    starts = [0]
    for slot in slots[:-1]:
        starts.append(starts[-1] + slot)
    for rank, part in enumerate(parts):
        assert len(part) == sum(slots) // cp
        local = 0
        for start, slot in zip(starts, slots):
            chunk = slot // (2 * cp)
            first, second = part[local:local + chunk], part[local + chunk:local + 2 * chunk]
            assert first.tolist() == list(range(start + rank * chunk, start + (rank + 1) * chunk))
            assert second.tolist() == list(range(start + (2 * cp - 1 - rank) * chunk, start + (2 * cp - rank) * chunk))
            local += 2 * chunk
    # Causal attention work of a query = its place in its sequence + 1: the same on every rank.
    place = torch.cat([torch.arange(slot) for slot in slots])
    work = [int((place[part] + 1).sum()) for part in parts]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_packed_slots_give_each_rank_a_multiple_of_the_sequence_parallel_size(cp, multiple):
    lengths = [5, 12, 1, 30]
    slots = context_parallel.packed_slots(lengths, cp, multiple)
    unit = context_parallel.slot_length(1, cp)
    assert slots[:-1] == [context_parallel.slot_length(length, cp) for length in lengths[:-1]]  # the last grows
    assert all(slot % unit == 0 and slot >= length for slot, length in zip(slots, lengths))
    assert all(len(context_parallel.local_positions(slots, cp, rank)) % multiple == 0 for rank in range(cp))
    # The least padding that does it: one row-multiple less would not.
    row = math.lcm(cp * multiple, unit)
    assert sum(slots) % row == 0 and slots[-1] - context_parallel.slot_length(lengths[-1], cp) < row
    if multiple == 1:
        assert slots == [context_parallel.slot_length(length, cp) for length in lengths]


def test_no_context_parallelism_leaves_the_layout_alone():
    assert [context_parallel.slot_length(length, 1) for length in (1, 7, 12)] == [1, 7, 12]
    assert context_parallel.local_positions([3, 4], 1, 0).tolist() == list(range(7))


@pytest.fixture(scope="module")
def one_rank(tiny_model, tmp_path_factory):
    """The worker's report at CP=1 on one rank: the reference of every layout below (run once)."""
    out = tmp_path_factory.mktemp("cp1") / "cp1"
    torchrun("pipeline_worker.py", out, "--model", tiny_model, *WORKER, "--train-gpus", "1", "--rollout-gpus", "1",
             nproc=1, timeout=600)
    return read_json(f"{out}.json")


FOUR_RANKS = ["--train-gpus", "4", "--rollout-gpus", "4"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--context-parallel-size", "2"],
                                    ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     *FOUR_RANKS],
                                    ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel", *FOUR_RANKS]],
                         ids=["cp2", "cp2-pp2", "cp2-tp2-sp"])
def test_two_context_parallel_ranks_give_the_outputs_and_gradients_of_one(layout, one_rank, tiny_model, tmp_path):
    """Actor logprobs and critic values at CP=2 (2 ranks; with 2 pipeline stages or 2 tensor-parallel
    ranks under sequence parallelism, 4 ranks) equal CP=1 (1 rank) on the same packed micro-batches; two
    optimizer steps of each keep them equal: the losses (a sequence-level aggregation), their metrics and
    the gradient norms (the gathers' backward and Megatron's loss units over data x context parallel
    ranks; under sequence parallelism the norms' TP-summed gradients, and the TP-split weights counted
    once each)."""
    torchrun("pipeline_worker.py", tmp_path / "cp2", "--model", tiny_model, *WORKER, *layout,
             nproc=4 if "--train-gpus" in layout else 2, timeout=600)
    one, two = one_rank, read_json(tmp_path / "cp2.json")
    # Measured: up to 9.5e-6 on logprobs of about -10 (fp32, the attention's sums in another order).
    for key in ("logprobs", "values"):
        assert_fp32_paths_agree(two[key], one[key], key)
    assert_runs_agree(flat_series(two["logprobs_after"]), flat_series(one["logprobs_after"]), "logprobs_after")  # 2 steps later
    assert_moved(one["logprobs"], one["logprobs_after"], "one rank's two steps")
    for role, names in (("actor", ("loss", "grad_norm", "kl_loss", "entropy", "kl_old_new", "clip_fraction")),
                        ("critic", ("value_loss", "critic_grad_norm", "value_mean"))):
        assert len(two[role]) == len(one[role]) > 0, role
        for name in names:
            assert_runs_agree(dict(enumerate(s[name] for s in two[role])), dict(enumerate(s[name] for s in one[role])),
                              f"{role} {name}")
    assert two["logprobs_after"] != two["logprobs"]  # the steps changed the policy


@pytest.mark.slow
def test_grpo_with_distillation_at_two_context_parallel_ranks_syncs_and_resumes_at_one(tiny_model, tmp_path):
    common = [*SMALL, "--model", tiny_model, "--teacher-model", tiny_model, "--train-steps", "4"]
    trained = torchrun("../../megarl/train.py", *common, "--context-parallel-size", "2",
                       "--save-dir", tmp_path / "ckpt", "--save-interval", "2", "--log-dir", tmp_path / "cp2",
                       timeout=900)
    assert "CP=2 DP=1" in trained.stdout
    resumed = torchrun("../../megarl/train.py", *common, "--resume", tmp_path / "ckpt" / "step_00000002",
                       "--log-dir", tmp_path / "cp1", timeout=900)
    assert "CP=1 DP=2" in resumed.stdout and "resumed from" in resumed.stdout
    two, one = scalars(tmp_path / "cp2", COMPARED), scalars(tmp_path / "cp1", COMPARED)
    assert sorted(two["loss"]) == [0, 1, 2, 3] and sorted(one["loss"]) == [2, 3], (two["loss"], one["loss"])
    # The trained weights reach the engines: the rollout's logprobs are the trainer's after each sync.
    assert max(two["mismatch"].values()) <= ROUNDING_LEVEL, two["mismatch"]
    # At step 0 the policy is the reference (0 up to rounding); by step 2 it has left it.
    assert abs(two["kl_ref"][0]) <= ROUNDING_LEVEL and two["kl_ref"][2] > 1e-6, two["kl_ref"]
    assert two["teacher_kl"][2] > 1e-6 and two["distill_loss"][2] > 0  # ... and the teacher (the same tiny model)
    assert_signal_alive(tmp_path / "cp1", what="resumed at CP 1")
    # Steps 3 and 4 at CP=1 (DP=2) from the CP=2 checkpoint are the CP=2 run's (step 4's inputs depend on an
    # update made with the loaded optimizer state).
    for tag in COMPARED:
        assert_runs_agree(one[tag], two[tag], tag, steps=[2, 3])
