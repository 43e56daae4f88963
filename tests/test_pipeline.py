"""Pipeline parallelism in the RL trainer (real torchrun ranks, the tiny model): the stages give the
outputs of one stage, a GRPO run trains and syncs every stage's weights, and its checkpoint resumes at
another pipeline size."""

import pytest
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

WORKER = ["--micro-batch-size", "2", "--lr", "1e-3", "--critic-lr", "1e-3", "--advantage-estimator", "gae"]
SMALL = ["--config", "examples/quickstart_grpo.yaml", "--prompts-per-step", "4", "--num-generations", "4",
         "--max-new-tokens", "12", "--micro-batch-size", "4", "--lr", "1e-3", "--kl-coef", "0.05"]
COMPARED = ("loss", "grad_norm", "entropy", "kl_ref", "mismatch", "reward_mean")


@pytest.mark.slow
def test_full_vocabulary_companions_at_two_stages_and_two_context_parallel_ranks_match_one(tiny_model, perturbed_tiny,
                                                                                           tmp_path):
    """A reference for --kl-estimator full and a colocated teacher's full-vocabulary distillation (every
    other sample an OPSD row): at PP=2 (the frozen models' own pipeline schedule, their logits on the last
    stage) and at CP=2 (each CP rank's part; OPSD views gathered and re-laid) the exact KL, two actor steps
    with both terms and the logprobs after them equal one rank's."""
    flags = [*WORKER, "--model", tiny_model, "--padding-free", "--loss-agg", "sample_level", "--kl-estimator", "full",
             "--kl-coef", "0.1", "--ref-model", perturbed_tiny, "--teacher-model", perturbed_tiny, "--distill-coef", "1",
             "--gkd-logits-topk", "0"]
    torchrun("pipeline_worker.py", tmp_path / "one", *flags, "--train-gpus", "1", "--rollout-gpus", "1", nproc=1,
             timeout=600)
    one = read_json(tmp_path / "one.json")
    assert min(max(row) for row in one["kl"]) > 0  # two models: a KL on every response
    for name, layout in (("pp2", ["--pipeline-model-parallel-size", "2"]), ("cp2", ["--context-parallel-size", "2"])):
        torchrun("pipeline_worker.py", tmp_path / name, *flags, *layout, timeout=600)
        two = read_json(tmp_path / f"{name}.json")
        assert_fp32_paths_agree(two["kl"], one["kl"], f"{name} kl")
        for metric in ("loss", "grad_norm", "kl_loss", "distill_loss"):
            assert_runs_agree(dict(enumerate(s[metric] for s in two["actor"])),
                              dict(enumerate(s[metric] for s in one["actor"])), f"{name} actor {metric}")
        assert_runs_agree(flat_series(two["logprobs_after"]), flat_series(one["logprobs_after"]),
                          f"{name} logprobs_after")
    assert_moved(one["logprobs"], one["logprobs_after"], "one rank's two steps")


@pytest.mark.slow
def test_two_stages_give_the_outputs_of_one(tiny_model, tmp_path):
    """Actor logprobs and critic values of PP=2 (2 ranks) equal PP=1 (1 rank) on the same micro-batches;
    two optimizer steps of each keep them equal (the loss and its metrics come from the last stage)."""
    torchrun("pipeline_worker.py", tmp_path / "pp2", "--model", tiny_model, *WORKER,
             "--pipeline-model-parallel-size", "2", timeout=600)
    torchrun("pipeline_worker.py", tmp_path / "pp1", "--model", tiny_model, *WORKER, "--train-gpus", "1",
             "--rollout-gpus", "1", nproc=1, timeout=600)
    one, two = read_json(tmp_path / "pp1.json"), read_json(tmp_path / "pp2.json")
    for key in ("logprobs", "values"):  # the same weights, summed in another order
        assert_fp32_paths_agree(two[key], one[key], key)
    assert_runs_agree(flat_series(two["logprobs_after"]), flat_series(one["logprobs_after"]), "logprobs_after")  # 2 steps later
    for role, names in (("actor", ("loss", "grad_norm", "kl_loss", "entropy", "kl_old_new")), ("critic", ("value_loss",))):
        assert len(two[role]) == len(one[role]) > 0, role
        for name in names:
            assert_runs_agree(dict(enumerate(s[name] for s in two[role])), dict(enumerate(s[name] for s in one[role])),
                              f"{role} {name}")
    assert_moved(one["logprobs"], one["logprobs_after"], "one stage's two steps")  # the steps changed the policy


# The resumed job's schedules: LR warm-up then cosine decay (to a floor, so that every step trains), and the
# adaptive KL controller with a short horizon, so that both move at every step and a resume that restarted
# either (the scheduler's step count, the controller's value) would log other values.
SCHEDULES = ["--lr-warmup-steps", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
             "--kl-controller", "adaptive", "--kl-target", "0.01", "--kl-horizon", "64"]


@pytest.mark.slow
def test_grpo_at_two_stages_trains_syncs_and_resumes_at_one(tiny_model, tmp_path):
    """GRPO at PP=2, saved after step 2, resumed at PP=1: steps 3 and 4 are the PP=2 run's (step 4 is the
    first whose inputs depend on an update made after the load: Adam's moments and step as loaded, the LR
    the scheduler gives the loaded step count, the KL coefficient the controller carried), with the LR and
    the KL coefficient equal bit for bit."""
    common = [*SMALL, *SCHEDULES, "--model", tiny_model, "--train-steps", "4"]
    torchrun("../../megarl/train.py", *common, "--pipeline-model-parallel-size", "2",
             "--save-dir", tmp_path / "ckpt", "--save-interval", "2", "--log-dir", tmp_path / "pp2", timeout=900)
    resumed = torchrun("../../megarl/train.py", *common,
                       "--resume", tmp_path / "ckpt" / "step_00000002", "--log-dir", tmp_path / "pp1", timeout=900)
    assert "PP=1" in resumed.stdout and "resumed from" in resumed.stdout
    tags = (*COMPARED, "lr", "kl_coef")
    two, one = scalars(tmp_path / "pp2", tags), scalars(tmp_path / "pp1", tags)
    assert sorted(two["loss"]) == [0, 1, 2, 3] and sorted(one["loss"]) == [2, 3], (two["loss"], one["loss"])
    # Every stage's weights reach the engines: the rollout's logprobs are the trainer's after each sync.
    assert max(two["mismatch"].values()) <= ROUNDING_LEVEL, two["mismatch"]
    # At step 0 the policy is the reference (0 up to rounding); by step 2 it has left it.
    assert abs(two["kl_ref"][0]) <= ROUNDING_LEVEL and two["kl_ref"][2] > 1e-6, two["kl_ref"]
    assert_signal_alive(tmp_path / "pp1", what="resumed at PP 1")
    for tag in ("lr", "kl_coef"):  # scheduled values: the same arithmetic on the loaded state, bit for bit
        assert len(set(two[tag].values())) == 4, (tag, two[tag])  # each step its own value
        assert {step: one[tag][step] for step in (2, 3)} == {step: two[tag][step] for step in (2, 3)}, tag
    for tag in COMPARED:  # steps 3 and 4 at PP=1 from the PP=2 checkpoint are the PP=2 run's
        assert_runs_agree(one[tag], two[tag], tag, steps=[2, 3])
