"""Rank/role layouts on 2 real torchrun ranks, and launch-environment parsing."""

import pytest
from helpers import read_json, torchrun

from megarl.distributed import first_slurm_host, launch_env


def _layout(tmp_path, *argv):
    out = tmp_path / "layout"
    result = torchrun("layout_worker.py", out, *argv)
    return [read_json(f"{out}.{rank}.json") for rank in range(2)], result.stdout


@pytest.mark.slow
def test_colocate_tp2(tmp_path):
    ranks, stdout = _layout(tmp_path, "--tensor-model-parallel-size", "2")
    for rank, report in enumerate(ranks):
        assert report["roles"] == ["train", "rollout"]
        assert (report["world_name"], report["world_rank"], report["world_size"]) == ("train+rollout", rank, 2)
        assert report["megatron"] == {"tp": 2, "tp_rank": rank, "pp": 1, "dp": 1, "dp_rank": 0}
        assert "cross_role_broadcast" not in report
    assert "placement: colocate, 2 ranks" in stdout
    assert "train   ranks 0-1: TP=2 PP=1 CP=1 DP=2" not in stdout and "TP=2 PP=1 CP=1 DP=1" in stdout
    assert stdout.count("placement:") == 1  # printed once, by rank 0


@pytest.mark.slow
def test_colocate_data_parallel(tmp_path):
    ranks, _ = _layout(tmp_path)
    assert [r["megatron"]["dp_rank"] for r in ranks] == [0, 1]
    assert all(r["megatron"]["dp"] == 2 and r["megatron"]["tp"] == 1 for r in ranks)


@pytest.mark.slow
def test_separate_one_train_one_rollout(tmp_path, ):
    ranks, stdout = _layout(tmp_path, "--colocate-groups", "none", "--train-gpus", "1", "--rollout-gpus", "1")
    train, rollout = ranks
    assert train["roles"] == ["train"] and rollout["roles"] == ["rollout"]
    # Each role is a world of its own; Megatron sees only the train rank.
    assert (train["world_name"], train["world_rank"], train["world_size"]) == ("train", 0, 1)
    assert (rollout["world_name"], rollout["world_rank"], rollout["world_size"]) == ("rollout", 0, 1)
    assert train["megatron"] == {"tp": 1, "tp_rank": 0, "pp": 1, "dp": 1, "dp_rank": 0}
    assert "megatron" not in rollout
    assert train["cross_role_broadcast"] == rollout["cross_role_broadcast"] == 1.0
    assert "placement: separate, 2 ranks" in stdout and "rollout ranks 1: TP=1" in stdout


@pytest.mark.slow
def test_separate_from_yaml(tmp_path):
    config = tmp_path / "separate.yaml"
    config.write_text("colocate_groups: []\ntrain: {gpus: 1}\nrollout: {gpus: 1}\n")
    ranks, _ = _layout(tmp_path, "--config", config)
    assert [r["roles"] for r in ranks] == [["train"], ["rollout"]]


def test_torchrun_environment():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                      "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "node7", 29400)
    assert env.store_served_by_agent


def test_slurm_environment_without_torchrun():
    env = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                      "SLURM_JOB_NODELIST": "gpu[003-004,010]", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 1, "gpu003")
    assert env.master_port == 15000 + 4242 and not env.store_served_by_agent


def test_first_slurm_host():
    assert first_slurm_host("node1") == "node1"
    assert first_slurm_host("node[1-4]") == "node1"
    assert first_slurm_host("a-gpu[07,09-12],b1") == "a-gpu07"
    assert first_slurm_host("x1,x2") == "x1"
