"""The code rewards: run the response's Python program on the row's test cases, sandboxed.

Two registered names, one implementation (`score_batch(..., all_or_nothing=)`):
  "code"                 score = the fraction of test cases passed;
  "code_all_or_nothing"  score = 1 only when every case passes, else 0 (after the
                         first failure the cases not yet started are cancelled).

Conventions:
  program     the last ```python / ```py / ```python3 fenced block of the response
              (any letter case); without one, the last fenced block of any language;
              no fenced block at all: score 0, reason "no code".
  test cases  row["test_cases"] = {"inputs": [stdin, ...], "outputs": [expected
              stdout, ...]} (ColossalChat's layout), strings of equal count; or, without
              it, ms-swift's / open-r1's row["verification_info"] = {"language": "python",
              "test_cases": [{"input", "output"}, ...]}. Missing or empty cases raise
              ValueError ("no test cases"): a dataset error, not a 0.
  comparison  stdout and the expected output after `normalise_output`: trailing
              whitespace of every line ("\\r" included) and trailing blank lines dropped.
  reason      "correct" when every case passes, else the first failing case's:
              "wrong answer" (ran fine, other output) or the sandbox status ("timeout",
              "memory limit", "output limit", "runtime error"); "no code".
  sandbox     every run is its own sandbox (megarl/rewards/sandbox.py) with `LIMITS`, on a
              process-wide SandboxPool of os.cpu_count() workers, so the runs of a batch
              (all cases of all responses) overlap; fewer when `configure_pool` gives it
              a memory budget (--sandbox-memory-budget-mb). A sandbox that cannot be set
              up raises SandboxError; a run probes the sandbox at start-up and stops
              there rather than score unsandboxed (or score every program 0).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from functools import partial

from megarl.rewards import RewardOutput, register_reward
from megarl.rewards import sandbox
from megarl.rewards.sandbox import SandboxLimits, SandboxPool

SYSTEM_PROMPT = (
    "Solve the programming problem. Write a complete Python 3 program that reads the input "
    "from standard input and prints the answer to standard output. Put the whole program in "
    "a single ```python code block at the end of your answer."
)
LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10.0, memory_mb=512)
_PYTHON_TAGS = {"python", "py", "python3"}
_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)```", re.DOTALL)
_pool: SandboxPool | None = None
_pool_lock = threading.Lock()
_memory_budget_mb: int | None = None


def extract_program(response: str) -> str | None:
    """The program of a response (see the module docstring), or None."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else None


def normalise_output(text: str) -> str:
    """Drop trailing whitespace of every line and trailing blank lines."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _verification_info(row: dict) -> dict | None:
    """ms-swift's / open-r1's layout, row["verification_info"] = {"language": "python", "test_cases":
    [{"input": ..., "output": ...}, ...]} (or its JSON text), as megarl's {"inputs", "outputs"}; None
    without one. Another language raises ValueError: megarl's sandbox runs Python."""
    info = row.get("verification_info")
    if not info:
        return None
    if isinstance(info, str):
        import json

        info = json.loads(info)
    language = info.get("language", "python")
    if language != "python":
        raise ValueError(f"row {row.get('id')!r}: verification_info language {language!r}; megarl's code reward "
                         f"runs Python only")
    cases = info.get("test_cases") or []
    return {"inputs": [case.get("input") for case in cases], "outputs": [case.get("output") for case in cases]}


def read_test_cases(row: dict) -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a row; ValueError when the row has no usable test cases."""
    cases = row.get("test_cases") or _verification_info(row) or {}
    inputs, outputs = cases.get("inputs") or [], cases.get("outputs") or []
    if not inputs:
        raise ValueError(f"no test cases in row {row.get('id')!r}: the code reward needs "
                         "row['test_cases'] = {'inputs': [...], 'outputs': [...]}")
    if len(inputs) != len(outputs) or not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError(f"row {row.get('id')!r}: test_cases needs as many 'inputs' as 'outputs', all strings")
    return inputs, outputs


def configure_pool(memory_budget_mb: int | None) -> None:
    """Bound the runs of this process's pool to `memory_budget_mb` together (see
    megarl.rewards.sandbox.pool_concurrency); before the pool's first use. ValueError when it is below one run."""
    global _memory_budget_mb
    with _pool_lock:
        if _pool is not None:
            raise RuntimeError("configure_pool after the code reward's pool was made")
        sandbox.pool_concurrency(LIMITS, None, memory_budget_mb)  # fail now, not at the first sample
        _memory_budget_mb = memory_budget_mb


def shared_pool() -> SandboxPool:
    """The process-wide pool, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = SandboxPool(limits=LIMITS, memory_budget_mb=_memory_budget_mb)
        return _pool


def _case_reason(future: Future, expected: str) -> str:
    result = future.result()
    if result.status != "ok":
        return result.status
    return "correct" if normalise_output(result.stdout) == normalise_output(expected) else "wrong answer"


def _score(futures: list[Future], outputs: list[str], all_or_nothing: bool) -> RewardOutput:
    """Score one response from its runs (in case order)."""
    passed, failure = 0, None
    for i, future in enumerate(futures):
        reason = _case_reason(future, outputs[i])
        if reason == "correct":
            passed += 1
            continue
        failure = failure or reason
        if all_or_nothing:
            for rest in futures[i + 1:]:
                rest.cancel()
            return RewardOutput(0.0, failure)
    if all_or_nothing:
        return RewardOutput(1.0, "correct")
    return RewardOutput(passed / len(futures), failure or "correct")


def score_batch(responses: list[str], rows: list[dict], all_or_nothing: bool = False,
                pool: SandboxPool | None = None) -> list[RewardOutput]:
    """Score responses[i] on rows[i]'s test cases; every run of the batch is submitted at once."""
    if len(responses) != len(rows):
        raise ValueError(f"{len(responses)} responses for {len(rows)} rows")
    pool = pool or shared_pool()
    cases = [read_test_cases(row) for row in rows]  # a dataset error fails before anything runs
    programs = [extract_program(response) for response in responses]
    futures = [[pool.submit(program, stdin) for stdin in inputs] if program is not None else None
               for program, (inputs, _) in zip(programs, cases)]
    return [RewardOutput(0.0, "no code") if runs is None else _score(runs, outputs, all_or_nothing)
            for runs, (_, outputs) in zip(futures, cases)]


@register_reward("code", system_prompt=SYSTEM_PROMPT)
def code_reward(response: str, row: dict) -> RewardOutput:
    return score_batch([response], [row])[0]


@register_reward("code_all_or_nothing", system_prompt=SYSTEM_PROMPT)
def code_all_or_nothing_reward(response: str, row: dict) -> RewardOutput:
    return score_batch([response], [row], all_or_nothing=True)[0]


# The batch path `megarl.rewards.score_all` uses: every run of the batch goes to the pool at once.
code_reward.score_batch = score_batch
code_all_or_nothing_reward.score_batch = partial(score_batch, all_or_nothing=True)
# A run with these rewards probes the sandbox at start-up (megarl.rewards.check_reward_environment).
code_reward.sandbox_limits = code_all_or_nothing_reward.sandbox_limits = LIMITS
