"""The sandbox fails loudly: a run with a code reward probes it at start-up and stops with one line when
it cannot run; the pool's memory is bounded by a budget; a kill's reason says what happened. Real
sandbox runs; unavailability is made real (a namespace step that fails, a user namespace without the
sandbox's uid), never mocked away."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT
from megarl.rewards import sandbox
from megarl.rewards.sandbox import SandboxError, SandboxLimits, SandboxPool, pool_concurrency, probe

SMALL = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, memory_mb=64, max_processes=2, max_file_mb=4,
                      max_output_bytes=1 << 20)  # run_memory_mb = 2 * 64 + 4 + 2 = 134


def _args(**overrides) -> argparse.Namespace:
    fields = dict(reward="code", reward_workers=1, reward_timeout=0.0, sandbox_memory_budget_mb=0)
    return argparse.Namespace(**{**fields, **overrides})


@pytest.fixture
def broken_sandbox(monkeypatch):
    """A host where one of the sandbox's steps fails: pivot_root is called with a syscall number the
    kernel does not have (ENOSYS), as a kernel or seccomp policy without it would answer."""
    monkeypatch.setitem(sandbox._PIVOT_ROOT_SYSCALL, os.uname().machine, 99999)


# --- the start-up probe


def test_the_probe_passes_where_the_sandbox_works():
    from megarl.rewards.scoring import check_sandbox

    probe(SMALL)
    check_sandbox(_args())
    check_sandbox(_args(reward="boxed:1.0,code_all_or_nothing:0.5"))


def test_the_probe_fails_in_one_line(broken_sandbox):
    from megarl.errors import ConfigError
    from megarl.rewards.scoring import check_sandbox

    with pytest.raises(SandboxError, match=r"^sandbox unavailable: \[Errno 38\] syscall\(99999") as raised:
        probe(SMALL)
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="^--reward boxed:1,code:1: sandbox unavailable") as raised:
        check_sandbox(_args(reward="boxed:1,code:1"))
    assert "\n" not in str(raised.value)
    check_sandbox(_args(reward="boxed"))  # no code reward: no probe, nothing to fail


def _code_run(tiny_model: str, *extra: str) -> list[str]:
    return ["--config", "examples/quickstart_grpo.yaml", "--model", tiny_model, "--reward", "code",
            "--train-steps", "1", *extra]


@pytest.mark.slow  # launches a command in a process of its own (python + torch start-up): the slow lane
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_run_with_a_code_reward_stops_at_start_when_the_sandbox_cannot_run(tiny_model):
    """Under a user namespace that maps root only, the sandbox cannot drop to its uid (as on a host
    without unprivileged user namespaces, it cannot be made): train.py stops before any model loads,
    exit code 2, with one line. (Rank 0 of the config's two, alone: it stops before it would connect.)"""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "megarl/train.py",
                           *_code_run(tiny_model)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megarl:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == [errors[0]] and errors[0].startswith("megarl: error: --reward code: sandbox unavailable: ")
    assert "step 1/" not in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_two_rank_run_stops_at_start_when_the_sandbox_cannot_run(tiny_model):
    command = ["unshare", "--user", "--map-root-user", sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "megarl/train.py", *_code_run(tiny_model)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    # At most one line per rank (each names its own probe's temporary directory), all the same error.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megarl:")]
    assert proc.returncode != 0
    assert 1 <= len(errors) <= 2, errors
    assert all(line.startswith("megarl: error: --reward code: sandbox unavailable") for line in errors), errors
    assert "step 1/" not in proc.stdout


# --- the memory budget


def test_the_budget_bounds_how_many_programs_run_at_once():
    assert SMALL.run_memory_mb == 134
    assert pool_concurrency(SMALL, 8) == 8
    assert pool_concurrency(SMALL, 8, memory_budget_mb=2 * 134 + 133) == 2
    assert pool_concurrency(SMALL, 1, memory_budget_mb=10_000) == 1
    with pytest.raises(ValueError, match="below one run's bound of 134 MB"):
        pool_concurrency(SMALL, 8, memory_budget_mb=133)
    patient = SandboxLimits(cpu_seconds=5, wall_seconds=60.0, memory_mb=64, max_processes=2, max_file_mb=4,
                            max_output_bytes=1 << 20)  # the same bound, a wall clock no load reaches
    # Each run prints when it started and ended: at no moment are more than two running (with 8 at once, all
    # four intervals would share the moment the last one started). Order of events, not seconds: a loaded
    # host only stretches the intervals.
    program = "import time\nprint(time.time())\ntime.sleep(0.5)\nprint(time.time(), input())"
    with SandboxPool(workers=8, limits=patient, memory_budget_mb=2 * 134) as pool:
        results = pool.run_jobs([(program, ["a", "b", "c", "d"])])
    assert pool.concurrency == 2
    assert [r.stdout.split()[-1] for r in results[0]] == ["a", "b", "c", "d"], results
    intervals = [tuple(map(float, r.stdout.split()[:2])) for r in results[0]]
    running = [sum(start <= moment < end for start, end in intervals) for moment, _ in intervals]
    assert max(running) <= 2, intervals


def test_the_budget_is_split_between_ranks_and_reward_processes():
    from megarl.errors import ConfigError
    from megarl.rewards.code import LIMITS
    from megarl.rewards.scoring import check_sandbox, sandbox_memory_budget_mb

    bound = LIMITS.run_memory_mb
    assert sandbox_memory_budget_mb(_args(reward="boxed")) is None  # no code reward, no budget
    assert sandbox_memory_budget_mb(_args(sandbox_memory_budget_mb=8 * bound), local_ranks=2) == 4 * bound
    # --reward-timeout: the rank's share is split again between its 2 reward processes; 4 * bound fits.
    timed = _args(sandbox_memory_budget_mb=8 * bound, reward_timeout=5.0, reward_workers=2)
    assert sandbox_memory_budget_mb(timed, local_ranks=2) == 4 * bound
    with pytest.raises(ValueError, match=r"split between 4 rank\(s\) and 4 reward process\(es\) each leaves"):
        sandbox_memory_budget_mb(_args(sandbox_memory_budget_mb=8 * bound, reward_timeout=5.0, reward_workers=4),
                                 local_ranks=4)
    # The default (half the host's memory) never refuses: at least one program per process.
    assert sandbox_memory_budget_mb(_args(reward_timeout=5.0, reward_workers=4), local_ranks=512) == 4 * bound
    with pytest.raises(ConfigError, match="^--reward code: --sandbox-memory-budget-mb 100 split"):
        check_sandbox(_args(sandbox_memory_budget_mb=100))


# --- why a program was killed


@pytest.mark.parametrize("program, wall, reason", [
    ("x = []\nwhile True: x.append(' ' * 10**6)", 60.0, "memory limit"),  # grows until RLIMIT_AS
    ("b = bytearray(10 * 2**30)", 60.0, "memory limit"),  # one allocation over it
    ("while True: pass", 60.0, "timeout"),  # RLIMIT_CPU: the kernel's SIGKILL
    ("import time\ntime.sleep(100)", 3.0, "timeout"),  # the wall clock: the trainer's kill
])
def test_a_kill_says_what_happened(program, wall, reason):
    from megarl.rewards.code import score_batch

    row = {"test_cases": {"inputs": [""], "outputs": [""]}}
    with SandboxPool(workers=1, limits=SandboxLimits(cpu_seconds=1, wall_seconds=wall, memory_mb=128)) as pool:
        output = score_batch([f"```python\n{program}\n```"], [row], pool=pool)[0]
    assert (output.score, output.reason) == (0.0, reason)


def test_the_code_reward_in_reward_worker_processes():
    """--reward-timeout with the code reward: the sandbox runs from a worker process (with its share
    of the budget), its reasons come back unchanged."""
    from megarl.rewards import get_reward
    from megarl.rewards.code import LIMITS
    from megarl.rewards.scoring import TimedRewards

    timed = TimedRewards(get_reward("code"), 1, 60.0, sandbox_memory_budget_mb=LIMITS.run_memory_mb)
    try:
        row = {"test_cases": {"inputs": ["2\n"], "outputs": ["4\n"]}}
        programs = ["print(int(input()) * 2)", "b = bytearray(10 * 2**30)", "print(5)"]
        outputs = timed([f"```python\n{p}\n```" for p in programs], [row] * 3)
    finally:
        timed.close()
    assert [(o.score, o.reason) for o in outputs] == [(1.0, "correct"), (0.0, "memory limit"), (0.0, "wrong answer")]
