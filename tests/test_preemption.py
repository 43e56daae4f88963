"""A stop signal after a peer's death is not a preemption: no checkpoint, and the rank ends at once naming the
dead rank, also while its main thread is stuck in C code (a collective with the dead rank on NCCL)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import ROOT

from megarl import distributed
from megarl.preemption import SIGNALS, PeerDied, Preemption


def _ended_process() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def restore_signals():
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_with_a_dead_peer_raises_instead_of_asking_for_a_checkpoint(monkeypatch, restore_signals):
    host = socket.gethostname()
    monkeypatch.setattr(distributed, "_processes", [(host, os.getpid()), (host, _ended_process())])
    # One rank of two and no peer to gather with: reaching the all-gather would fail, not raise PeerDied.
    context = distributed.DistContext(distributed.LaunchEnv(0, 2, 0, "127.0.0.1", 0, False), None,
                                      dist.HashStore(), "train", timedelta(seconds=5))
    preemption = Preemption()
    os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag
    assert preemption.signal_name == "SIGTERM"
    with pytest.raises(PeerDied, match=r"SIGTERM received after a peer's death \(rank 1 died \(process \d+ is gone"):
        preemption.requested(context)


def test_a_failure_published_in_the_store_names_a_rank_of_another_host(monkeypatch):
    monkeypatch.setattr(distributed, "_processes", [(socket.gethostname(), os.getpid()), ("elsewhere", 1)])
    monkeypatch.setattr(distributed, "_failure_store", [dist.HashStore()])
    assert distributed.dead_peers(0) == []  # pid 1 of another host is not looked at
    distributed.publish_failure(1, "during step 2, update: OutOfMemoryError: out of memory")
    assert distributed.dead_peers(0) == [f"rank 1 failed on {socket.gethostname()} "
                                         f"(during step 2, update: OutOfMemoryError: out of memory)"]
    assert distributed.dead_peers(1) == []  # its own failure is not a peer's


WATCHED = textwrap.dedent("""
    import os, socket, subprocess, sys
    from megarl import distributed, train
    from megarl.preemption import Preemption
    from megarl.run import Activity

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    distributed._processes[:] = [(socket.gethostname(), os.getpid()), (socket.gethostname(), child.pid)]
    activity = Activity(step=3, phase="sync")
    Preemption(0, on_peer_death=lambda dead: train._stop_for_dead_peer(0, dead, activity))
    read, _ = os.pipe()
    print("ready", flush=True)
    os.read(read, 1)  # blocked in C like a collective with a dead peer: the Python handler's flag changes nothing
    print("unblocked", flush=True)
""")


def test_the_launchers_sigterm_ends_a_rank_blocked_in_c_code_naming_the_dead_rank():
    process = subprocess.Popen([sys.executable, "-c", WATCHED], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)  # the watcher's look for a dead peer takes a moment
    finally:
        process.kill()
    assert process.returncode == 1, (out, err)
    assert "unblocked" not in out
    assert err.count("\n") == 1 and err.startswith("megarl: rank 1 died (process ") and err.rstrip().endswith(
        "rank 0 stops (step 3, sync: stop signal from the launcher, no checkpoint)"), err


ABORTED_IN_A_PHASE = textwrap.dedent("""
    import os, sys
    import megarl.train

    def update(*args, **kwargs):  # stands in for the phase whose collective NCCL's watchdog aborts
        os.abort()

    megarl.train.train = update
    megarl.train.main(["--model", sys.argv[1]])
""")


@pytest.mark.slow  # launches a command in a process of its own (python + torch start-up): the slow lane
def test_a_rank_aborted_from_c_code_prints_the_python_stack_naming_the_phase(tiny_model):
    """NCCL's watchdog ends a rank whose collective outlived --distributed-timeout-minutes with SIGABRT, past
    megarl's failure report: train.main's faulthandler prints every thread's Python stack, naming the phase."""
    result = subprocess.run([sys.executable, "-c", ABORTED_IN_A_PHASE, tiny_model], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == -signal.SIGABRT, (result.returncode, result.stderr[-3000:])
    assert "Fatal Python error: Aborted" in result.stderr, result.stderr[-3000:]
    assert 'line 6 in update' in result.stderr and "in main" in result.stderr, result.stderr[-3000:]
