"""Stop cleanly on SIGTERM or SIGUSR1 (what SLURM and torchrun send before killing a job), and tell a
scheduler's preemption from a launcher stopping the survivors of a dead rank.

Preemption: the handler only sets a flag. After each step every rank shares its flag (one small
all-gather over all roles), so all ranks stop after the same step, save a checkpoint and exit with a
message saying how to resume. A signal that arrives mid-step lets that step finish: steps are short next
to the grace periods (torchrun waits 30 s after forwarding SIGTERM; SLURM's --signal=USR1@120 warns 120 s
ahead).

A peer's death: torchrun's agent answers a dead worker by stopping the others with the same SIGTERM
(torch/distributed/elastic/agent/server/api.py, `_invoke_run`: a FAILED group is `_stop_workers`'d or
`_restart_workers`'d, which close the workers with SIGTERM and a 30 s grace,
elastic/multiprocessing/api.py `close`). That is not a preemption: no checkpoint can be written with a
rank missing, and on NCCL the survivors' collective with the dead rank may not fail at all before the
grace runs out, so the main thread (blocked in it) never reaches the check after the step. So, on each
such signal, a watcher thread (woken through `signal.set_wakeup_fd`, which works while the main thread
is blocked inside a collective) looks for a dead peer (`distributed.dead_peers`: ranks of this host that
ended, and ranks anywhere that reported their own failure in the store); if one is dead it calls
`on_peer_death` (the entry point prints the line naming the dead rank and ends this rank at once).
`requested` checks the same before its all-gather and raises PeerDied instead of asking for a checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading

from megarl import distributed

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PeerDied(RuntimeError):
    """A stop signal arrived while another rank is dead: the launcher stopping the survivors, not a
    preemption; nothing is checkpointed."""


class Preemption:
    def __init__(self, rank: int | None = None, on_peer_death=None):
        """`rank`: this launch rank (to look for dead peers); `on_peer_death(dead)`, with the 'rank N died
        (...)' lines, is called from the watcher thread when a stop signal finds a dead peer (it should end
        the process). Without them only the flag is kept, as for a single process."""
        self.signal_name: str | None = None
        self.rank = rank
        for signum in SIGNALS:
            signal.signal(signum, self._handle)
        if rank is not None and on_peer_death is not None:
            self._watch(on_peer_death)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def _watch(self, on_peer_death) -> None:
        """The watcher thread: the C-level signal handler writes each signal's number to the wakeup fd
        even while the main thread is blocked in C code, where the Python handler cannot run."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        stops = {int(signum) for signum in SIGNALS}

        def watch():
            while True:
                received = os.read(read, 64)
                if not received:
                    return
                if stops.intersection(received):
                    # The peer's sockets close a moment before the kernel marks it dead: look for a second.
                    dead = distributed.dead_peers(self.rank, wait_seconds=1.0)
                    if dead:
                        on_peer_death(dead)

        threading.Thread(target=watch, name="megarl-stop-signals", daemon=True).start()

    def requested(self, context) -> str | None:
        """The signal any rank received (collective over every rank), or None. Raises PeerDied, before the
        collective, when this rank got a signal and another rank is known dead."""
        if self.signal_name is not None:
            dead = distributed.dead_peers(context.rank)
            if dead:
                raise PeerDied(f"{self.signal_name} received after a peer's death ({dead[0]}): the launcher "
                               f"stopping the survivors, not a preemption; no checkpoint is saved")
        names = distributed.all_gather_objects(self.signal_name, context)
        return next((name for name in names if name), None)
