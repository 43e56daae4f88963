"""--cpu-affinity (megarl/cpu_affinity.py): which CPUs each local rank gets, and a real 2-rank torchrun
binding every thread of each rank to its own share."""

from __future__ import annotations

import json
import os

import pytest

from helpers import torchrun
from megarl.cpu_affinity import local_world_size, rank_cpus

HOST = {0, 1, 2, 3, 4, 5, 6, 7}


def test_each_local_rank_gets_a_contiguous_share_of_the_launchers_cpus():
    assert [rank_cpus(HOST, HOST, rank, 2) for rank in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cpus({0, 1, 2}, {0, 1, 2}, rank, 2) for rank in range(2)] == [[0, 1], [2]]
    assert [rank_cpus({3, 5, 9}, {3, 5, 9}, rank, 3) for rank in range(3)] == [[3], [5], [9]]


def test_a_rank_the_launcher_placed_or_a_crowded_host_is_left_alone():
    assert rank_cpus({0, 1}, HOST, 0, 4) is None  # srun --cpu-bind / taskset per rank: its mask is not the launcher's
    assert rank_cpus({0, 1}, {0, 1}, 0, 4) is None  # 4 ranks on 2 CPUs: the scheduler shares them
    assert rank_cpus(HOST, HOST, 0, 1) is None and rank_cpus(HOST, HOST, 0, None) is None
    assert rank_cpus(HOST, None, 0, 2) is None  # the launcher's mask unreadable


def test_local_world_size_from_torchrun_or_slurm():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "SLURM_TASKS_PER_NODE": "8"}) == 4
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3"}) is None  # this node's count is not named
    assert local_world_size({}) is None


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding 2 ranks needs 2 CPUs")
def test_two_torchrun_ranks_bind_every_thread_to_their_own_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    for mode in ("auto", "none"):
        output = torchrun("cpu_affinity_worker.py", mode, timeout=120).stdout
        # the two ranks' lines may interleave in the shared pipe: each JSON object read from its marker on
        ranks = sorted((json.JSONDecoder().raw_decode(part)[0] for part in output.split("AFFINITY ")[1:]),
                       key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], output
        if mode == "none":
            assert all(r["bound"] is None and r["threads"] == [cpus] for r in ranks), ranks
            continue
        expected = [rank_cpus(set(cpus), set(cpus), rank, 2) for rank in (0, 1)]
        assert [r["bound"] for r in ranks] == expected and not set(expected[0]) & set(expected[1]), ranks
        # every thread, the one started before the binding and the one after included
        assert [r["threads"] for r in ranks] == [[e] for e in expected], ranks
