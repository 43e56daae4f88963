"""Rewards scored while the rollout engine is still generating (issue 13: overlap).

The engine hands over each prompt's samples the moment its request finishes
(`VllmEngine.generate(on_prompt_done=...)`); a pool of `--reward-workers` threads scores them
(`rewards.score_all`, one call per prompt's group, so batch rewards such as the code sandbox or a
reward model still get a batch). When generation ends only the scoring still running is waited
for: a slow reward costs the step what it adds after the last sample, not its whole time.

Threads, not processes, by default: the built-in rewards that do real work already leave the
interpreter (the math judge runs in a helper process off the main thread, the code sandbox in
subprocesses, the reward model in torch), and a plugin keeps its process state. Rewards must
therefore be safe to call from several threads at once when --reward-workers > 1 (the built-in ones
are: the reward model and the sandbox pool take locks). --reward-workers 0 scores after generation
in the calling thread, as before this module.

--reward-timeout SECONDS (`TimedRewards`): a thread cannot be killed, so a reward that never returns
would hold the step for ever. With a timeout every reward call runs in one of max(1, --reward-workers)
worker processes (megarl/rewards/workers.py), one sample a call; a call past the timeout is killed
with its worker (the sample scores 0, reason "timeout: reward call over N s"), a worker that dies
is replaced ("error: reward worker died ..."), and the step goes on. The threads above then only
hand the samples over and wait. The reward model part (`rm`) stays in this process (it holds a
torch model; a forward pass does not hang), scored beside the workers and combined with their parts.

Timing: `wait_seconds` is what the step paid for scoring (after generation, or all of it without
workers); `busy_seconds` the scoring calls' total time, whatever they overlapped.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from megarl.rewards.workers import RewardProcessPool
from megarl.rewards import RewardOutput, RewardSpec, reward_parts, score_all
from megarl.rewards.combine import combine_outputs


class TimedRewards:
    """A run's reward with every call bounded by `timeout` seconds: its parts in `workers` worker
    processes, one sample a call, except the parts that must stay in this process (a reward model,
    `in_process = True`), which are scored here as ever; the parts combined as `combine_rewards` does.

    plugins: the plugin files the workers import (the run's, in order);
    sandbox_memory_budget_mb: this process's share of the sandbox memory budget, which the workers split.
    """

    def __init__(self, reward: RewardSpec, workers: int, timeout: float, plugins: list[str] = (),
                 sandbox_memory_budget_mb: int | None = None):
        self.parts, self.combined = reward_parts(reward)
        self.remote = [i for i, (spec, _) in enumerate(self.parts) if not getattr(spec.fn, "in_process", False)]
        self.pool = None
        if self.remote:
            self.pool = RewardProcessPool([self.parts[i][0].name for i in self.remote], max(workers, 1), timeout,
                                          plugins, sandbox_memory_budget_mb=sandbox_memory_budget_mb)

    def __call__(self, responses: list[str], rows: list[dict]) -> list[RewardOutput]:
        futures = [self.pool.submit(response, row) for response, row in zip(responses, rows)] if self.pool else []
        per_part = [None] * len(self.parts)
        for i, (spec, _) in enumerate(self.parts):
            if i not in self.remote:  # here, while the workers score the rest
                per_part[i] = score_all(spec, responses, rows)
        remote = [future.result() for future in futures]  # each bounded by the pool's timeout
        for k, i in enumerate(self.remote):
            per_part[i] = [outputs[k] for outputs in remote]
        return combine_outputs(self.parts, per_part) if self.combined else per_part[0]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def sandbox_memory_budget_mb(args, local_ranks: int | None = None) -> int | None:
    """This rank's share of --sandbox-memory-budget-mb when its reward runs programs in the sandbox
    (a code reward), else None. The budget is per host, split evenly between its ranks
    (LOCAL_WORLD_SIZE, else 1); 0 means half the host's physical memory, but at least one program at
    a time per process that runs them (the rank, or each of its reward worker processes). A budget
    given that leaves a process less than one program's bound raises ValueError (one line)."""
    from megarl.rewards import sandbox_limits

    limits = sandbox_limits(args.reward) + tool_sandbox_limits(args)
    if not limits:
        return None
    processes = max(args.reward_workers, 1) if args.reward_timeout > 0 else 1
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    budget = args.sandbox_memory_budget_mb
    if not budget:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 // (1 << 20)
    share = budget // max(local_ranks, 1)
    needed = max(limit.run_memory_mb for limit in limits)
    if share // processes < needed:
        if args.sandbox_memory_budget_mb:
            raise ValueError(f"--sandbox-memory-budget-mb {args.sandbox_memory_budget_mb} split between {local_ranks} "
                             f"rank(s) and {processes} reward process(es) each leaves {share // processes} MB, below "
                             f"one sandboxed program's bound of {needed} MB")
        share = needed * processes
    return share


def tool_sandbox_limits(args) -> list:
    """The sandbox limits of the --tools that run programs in the sandbox (a tool function with a
    `sandbox_limits` attribute, as the code rewards carry: the built-in `python`)."""
    from megarl.tools import TOOLS

    limits = [getattr(TOOLS[name].function, "sandbox_limits", None) for name in getattr(args, "tools", [])]
    return [limit for limit in limits if limit is not None]


def check_sandbox(args) -> None:
    """At start-up, when the reward or a tool runs programs in the sandbox: the memory budget fits one
    program, and a real sandboxed run works (`megarl.rewards.sandbox.probe`). Raises ConfigError, one line."""
    from megarl.errors import ConfigError
    from megarl.rewards import sandbox_limits
    from megarl.rewards.sandbox import SandboxError, probe

    try:
        if sandbox_memory_budget_mb(args) is not None:
            probe(min(sandbox_limits(args.reward) + tool_sandbox_limits(args), key=lambda limit: limit.wall_seconds))
    except (ValueError, SandboxError) as error:
        what = f"--reward {args.reward}" if sandbox_limits(args.reward) else f"--tools {','.join(args.tools)}"
        raise ConfigError(f"{what}: {error}") from None


def reward_row(sample) -> dict:
    """The row a reward reads for `sample`: its prompt's row, "response_tokens" (the response's token
    count: the policy's own tokens in a multi-turn episode; ms-swift's cosine reward reads it) and, for a
    multi-turn episode, the whole conversation after the prompt under "conversation" (Sample.turns:
    assistant turns with their tool calls, tool messages with their errors); the response is then the
    episode's last assistant turn."""
    tokens = len(sample.response_ids) if sample.policy_mask is None else sum(sample.policy_mask)
    if sample.turns is None:
        return {**sample.metadata, "response_tokens": tokens}
    return {**sample.metadata, "response_tokens": tokens, "conversation": sample.turns}


class OverlappedScoring:
    """Score groups of samples in place as they arrive; `finish` waits for the rest.
    `timed`: the run's TimedRewards under --reward-timeout (it scores instead of `reward` in this process)."""

    def __init__(self, reward, workers: int, timed: TimedRewards | None = None):
        self.reward, self.busy_seconds, self.wait_seconds = reward, 0.0, 0.0
        self.scorer = timed or partial(score_all, reward)
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
        outputs = self.scorer([s.response_text for s in samples], [reward_row(s) for s in samples])
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
