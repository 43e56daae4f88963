"""Rewards scored while the engine generates (megarl/rewards/scoring.py, --reward-workers)."""

from __future__ import annotations

import threading

import pytest

from helpers import ROOT, SIGNAL_TAGS, assert_signal_alive, scalars, torchrun


def _samples(n: int):
    from megarl.samples import Sample

    return [Sample(i, [1], [2], f"\\boxed{{{i}}}", None, False, metadata={"answer": str(i % 3)}) for i in range(n)]


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_overlapped_scoring_scores_every_sample_where_it_should(workers):
    """Each group is scored exactly once with the reward's own verdict; with workers, off the calling
    thread (so while it generates), without, in it at `finish`."""
    from megarl.rewards import RewardSpec
    from megarl.rewards.arithmetic import arithmetic_reward
    from megarl.rewards.scoring import OverlappedScoring

    threads = []

    def reward(response, row):
        threads.append(threading.current_thread().name)
        return arithmetic_reward(response, row)

    scoring = OverlappedScoring(RewardSpec("test", reward), workers)
    samples = _samples(12)
    for start in range(0, 12, 4):
        scoring.submit(samples[start:start + 4])
    if workers == 0:
        assert threads == []  # nothing scored before finish
    scoring.finish()
    scoring.close()
    assert len(threads) == 12
    assert [s.reward for s in samples] == [1.0 if i % 3 == i else 0.0 for i in range(12)]
    assert [s.reason for s in samples].count("correct") == 3
    main = threading.current_thread().name
    assert all((name == main) == (workers == 0) for name in threads), threads


@pytest.mark.slow
def test_a_run_scores_the_same_with_and_without_overlap(tiny_model, tmp_path):
    """Two steps with a slow plugin reward, --reward-workers 0 vs 2: the same samples, rewards and losses
    (generation does not depend on the streaming), and the overlapped run scored off the main thread."""
    series = {}
    for workers in (0, 2):
        threads = tmp_path / f"threads{workers}.txt"
        torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                 "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12",
                 "--micro-batch-size", "8", "--train-steps", "2", "--reward", "slow_arithmetic",
                 "--external-plugins", ROOT / "tests/plugins/slow_reward.py", "--reward-workers", str(workers),
                 "--log-dir", tmp_path / f"tb{workers}", timeout=900,
                 env={"MEGARL_TEST_REWARD_SLEEP": "0.01", "MEGARL_TEST_REWARD_THREADS": str(threads)})
        series[workers] = scalars(tmp_path / f"tb{workers}", ["reward_mean", "loss", "response_length_mean",
                                                             *SIGNAL_TAGS, "entropy"])
        names = threads.read_text().split()
        assert len(names) == 2 * 16  # every sample of both steps, once
        assert all(name.startswith("megarl-reward") == bool(workers) for name in names), set(names)
    assert series[0] == series[2]
    # ... and the equal series carry a signal: rewards that differ, a gradient (the loss alone is the same for
    # any model on-policy: its ratio is exactly 1), so step 2 samples from an update both runs made alike
    assert_signal_alive(series[0], steps=(0, 1), what="--reward-workers 0")
