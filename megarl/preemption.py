"""Stop cleanly on SIGTERM or SIGUSR1 (what SLURM and torchrun send before killing a job).

The handler only sets a flag. After each step every rank shares its flag (one
small all-gather over all roles), so all ranks stop after the same step, save a
checkpoint and exit with a message saying how to resume. A signal that arrives
mid-step lets that step finish: steps are short next to the grace periods
(torchrun waits 30 s after forwarding SIGTERM; SLURM's --signal=USR1@120 warns
120 s ahead).
"""

from __future__ import annotations

import signal

from megarl import distributed

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self):
        self.signal_name: str | None = None
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def requested(self, context) -> str | None:
        """The signal any rank received (collective over every rank), or None."""
        names = distributed.all_gather_objects(self.signal_name, context)
        return next((name for name in names if name), None)
