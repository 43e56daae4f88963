"""Rewards scored while the rollout engine is still generating (issue 13: overlap).

The engine hands over each prompt's samples the moment its request finishes
(`VllmEngine.generate(on_prompt_done=...)`); a pool of `--reward-workers` threads scores them
(`rewards.score_all`, one call per prompt's group, so batch rewards such as the code sandbox or a
reward model still get a batch). When generation ends only the scoring still running is waited
for: a slow reward costs the step what it adds after the last sample, not its whole time.

Threads, not processes: the built-in rewards that do real work already leave the interpreter (the
math judge runs in a helper process off the main thread, the code sandbox in subprocesses, the
reward model in torch), and a plugin keeps its process state. Rewards must therefore be safe to
call from several threads at once when --reward-workers > 1 (the built-in ones are: the reward
model and the sandbox pool take locks). --reward-workers 0 scores after generation in the calling
thread, as before this module.

Timing: `wait_seconds` is what the step paid for scoring (after generation, or all of it without
workers); `busy_seconds` the scoring calls' total time, whatever they overlapped.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from megarl.rewards import score_all


class OverlappedScoring:
    """Score groups of samples in place as they arrive; `finish` waits for the rest."""

    def __init__(self, reward, workers: int):
        self.reward, self.busy_seconds, self.wait_seconds = reward, 0.0, 0.0
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megarl-reward") if workers else None
        self.futures: list[Future] = []
        self.pending: list = []

    def submit(self, samples) -> None:
        """Score these samples (each with its prompt's row in `metadata`) now or, without workers, at `finish`."""
        if self.pool is None:
            self.pending.extend(samples)
        else:
            self.futures.append(self.pool.submit(self._score, samples))

    def _score(self, samples) -> float:
        started = time.perf_counter()
        outputs = score_all(self.reward, [s.response_text for s in samples], [s.metadata for s in samples])
        for sample, output in zip(samples, outputs):
            sample.reward, sample.reason = output.score, output.reason
        return time.perf_counter() - started

    def finish(self) -> None:
        """Every submitted sample scored; a reward that raised inside the pool re-raises here (score_all
        itself turns a reward's exceptions into a 0 with its reason, so this is megarl's own failure)."""
        started = time.perf_counter()
        if self.pending:
            self.busy_seconds += self._score(self.pending)
            self.pending = []
        self.busy_seconds += sum(future.result() for future in self.futures)
        self.futures = []
        self.wait_seconds += time.perf_counter() - started

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
