"""Rewards that hang or crash (--reward-timeout, megarl/rewards/workers.py): real plugin rewards in real
worker processes. Time bounds are generous (a loaded 2-core machine): they tell "bounded" from "hung"."""

from __future__ import annotations

import os
import time

import pytest
from helpers import ROOT, scalars, torchrun

PLUGIN = str(ROOT / "tests" / "plugins" / "bad_rewards.py")
TIMEOUT = 5.0  # far above an arithmetic call, even on a loaded machine
GRACE = 60.0  # waits for killing and answering past the timeout: a hang guard (it takes well under a second)


@pytest.fixture(scope="module", autouse=True)
def plugin():
    from megarl.plugins import load_plugins

    load_plugins([PLUGIN])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _samples(responses):
    from megarl.samples import Sample

    return [Sample(i, [1], [2], text, None, False, metadata={"answer": "1"}) for i, text in enumerate(responses)]


def _timed(name: str, workers: int = 2, timeout: float = TIMEOUT):
    from megarl.plugins import loaded_plugins
    from megarl.rewards import get_reward
    from megarl.rewards.scoring import TimedRewards

    return TimedRewards(get_reward(name), workers, timeout, loaded_plugins())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_that_hangs_for_ever_scores_timeout_and_the_step_goes_on(workers, capsys):
    """The scoring path of a step (OverlappedScoring + phases' count): the hanging sample scores 0 with
    reason timeout, the others keep their verdicts, scoring returns within timeout + grace, the count is
    reported, the hung worker is gone and a new one scores what follows."""
    from megarl.generation import reward_errors
    from megarl.rewards.scoring import OverlappedScoring

    timed = _timed("hanging_arithmetic", workers)
    try:
        old_pids = timed.pool.pids()
        samples = _samples(["\\boxed{1}", "HANG \\boxed{1}", "\\boxed{2}", "\\boxed{1}"])
        started = time.monotonic()
        scoring = OverlappedScoring(None, workers, timed)
        scoring.submit(samples[:2])
        scoring.submit(samples[2:])
        scoring.finish()
        scoring.close()
        seconds = time.monotonic() - started
        assert [(s.reward, s.reason) for s in samples] == [
            (1.0, "correct"), (0.0, "timeout: reward call over 5 s"), (0.0, "wrong answer"), (1.0, "correct")]
        assert TIMEOUT <= seconds  # waited for the timeout (how much longer depends on the machine's load)
        assert reward_errors(samples, "step 1", report=True) == {"reward_errors": 0, "reward_timeouts": 1}
        warning = capsys.readouterr().out
        assert "ran past --reward-timeout on 1 of 4 samples" in warning and "timeout: reward call" in warning
        deadline = time.monotonic() + GRACE  # the replacement starts after the sample was answered
        while timed.pool.replaced < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert timed.pool.replaced == 1
        assert sum(not _alive(pid) for pid in old_pids) == 1  # the hung worker was killed, not left behind
        again = _samples(["\\boxed{1}"] * 4)
        scoring = OverlappedScoring(None, workers, timed)
        scoring.submit(again)
        scoring.finish()
        assert [s.reason for s in again] == ["correct"] * 4
    finally:
        timed.close()
    assert not any(_alive(pid) for pid in old_pids + timed.pool.pids())


def test_a_worker_that_dies_is_replaced():
    """os._exit in the reward: that sample is an error naming the death, the pool starts a new worker
    and goes on scoring; nothing is left running after close."""
    from megarl.generation import reward_errors

    timed = _timed("dying_arithmetic", workers=1, timeout=60.0)
    try:
        (first,) = timed.pool.pids()
        outputs = timed(["\\boxed{1}", "DIE", "\\boxed{1}", "\\boxed{3}"], [{"answer": "1"}] * 4)
        assert [(o.score, o.reason) for o in outputs] == [
            (1.0, "correct"), (0.0, "error: reward worker died (exit code 3)"), (1.0, "correct"),
            (0.0, "wrong answer")]
        assert timed.pool.replaced == 1 and timed.pool.pids() != [first] and not _alive(first)
        samples = _samples(["DIE"])
        samples[0].reward, samples[0].reason = outputs[1].score, outputs[1].reason
        assert reward_errors(samples, "step 1", report=False) == {"reward_errors": 1, "reward_timeouts": 0}
    finally:
        timed.close()
    assert not any(_alive(pid) for pid in timed.pool.pids())


def test_in_process_parts_stay_in_the_trainer():
    """A combination with a part marked in_process (as the reward model is): that part is scored in this
    process, the others in the workers, combined as combine_rewards does."""
    from megarl.plugins import loaded_plugins
    from megarl.rewards import RewardOutput, RewardSpec
    from megarl.rewards.combine import combine_rewards
    from megarl.rewards.scoring import TimedRewards

    def local(response, row):
        return RewardOutput(0.5, str(os.getpid()))

    local.in_process = True
    spec = RewardSpec("pid_arithmetic:1.0,local:2.0",
                      combine_rewards([("pid_arithmetic", 1.0), (RewardSpec("local", local), 2.0)]))
    timed = TimedRewards(spec, 1, 60.0, loaded_plugins())
    try:
        (worker,) = timed.pool.pids()
        outputs = timed(["\\boxed{1}", "\\boxed{2}"], [{"answer": "1"}] * 2)
        assert [(o.score, o.reason) for o in outputs] == [
            (2.0, f"pid_arithmetic={worker}, local={os.getpid()}"), (1.0, f"pid_arithmetic={worker}, local={os.getpid()}")]
    finally:
        timed.close()


def test_a_worker_that_cannot_start_is_a_setup_error():
    from megarl.rewards.workers import RewardProcessPool, RewardWorkerError

    with pytest.raises(RewardWorkerError, match="not registered"):
        RewardProcessPool(["no_such_reward"], 1, 5.0)


@pytest.mark.slow
def test_a_run_with_a_hanging_reward_finishes_and_counts_the_timeouts(tiny_model, tmp_path):
    """Two ranks, one step: each rank's reward worker hangs on its 5th call; the step ends, the
    timeouts are logged (reward_timeouts) and printed."""
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                      "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12",
                      "--micro-batch-size", "8", "--train-steps", "1", "--reward", "hanging_arithmetic",
                      "--external-plugins", PLUGIN, "--reward-timeout", "3", "--log-dir", tmp_path / "tb",
                      timeout=900, env={"MEGARL_TEST_HANG_EVERY": "5"})
    series = scalars(tmp_path / "tb", ["reward_timeouts", "reward_errors"])
    timeouts = series["reward_timeouts"][0]
    assert timeouts >= 1 and series["reward_errors"][0] == 0
    assert f"ran past --reward-timeout on {int(timeouts)} of 16 samples" in result.stdout + result.stderr


def test_a_worker_that_cannot_be_replaced_breaks_the_pool_loudly(tmp_path):
    """The reward kills its worker, and the plugin no longer imports: the sample that killed it is an
    error, and what follows raises (the run stops) instead of waiting for ever."""
    from megarl.rewards.workers import RewardProcessPool, RewardWorkerError

    marker = tmp_path / "broken"
    plugin = tmp_path / "fragile.py"
    plugin.write_text(
        "import os, pathlib\n"
        "from megarl.rewards import register_reward\n"
        f"if pathlib.Path({str(marker)!r}).exists():\n"
        "    raise ImportError('the plugin broke')\n"
        "@register_reward('fragile')\n"
        "def fragile(response, row):\n"
        "    os._exit(1)\n")
    pool = RewardProcessPool(["fragile"], 1, 60.0, [str(plugin)])
    try:
        marker.touch()
        first = pool.submit("x", {})
        assert first.result(GRACE)[0].reason == "error: reward worker died (exit code 1)"
        deadline = time.monotonic() + GRACE
        while pool._broken is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RewardWorkerError, match="the plugin broke"):
            pool.submit("y", {}).result(GRACE)
    finally:
        pool.close()


def test_the_math_graders_own_timeout_counts_and_a_programs_time_limit_does_not():
    """reward_timeouts counts scoring that ran past a bound (the worker's, the math grader's own); a code
    sample whose program ran past its time limit is a verdict on the sample (reason "timeout"), not one."""
    from types import SimpleNamespace

    from megarl import generation
    from megarl.rewards import math as math_rewards
    from megarl.rewards.workers import timeout_reason

    reasons = [timeout_reason(2.0), math_rewards.GRADING_TIMEOUT, "timeout", "correct", "error: reward worker died"]
    counts = generation.reward_errors([SimpleNamespace(reason=r) for r in reasons], "step 1", report=False)
    assert counts == {"reward_errors": 1, "reward_timeouts": 2}
