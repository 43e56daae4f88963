"""Measure a learning test's run-to-run spread and the bar it can hold: the same run at several seeds.

    python tools/learning_bars.py quickstart-80 [--seeds 1234 1 2] [--window 5]

Each case is a learning test's run (the test named in CASES). Per seed it prints the reward's mean over the
first and the last `--window` steps (the run's own `reward: a -> b` line at the default 5) and the tests'
statistic, the rise of a least-squares line through every step (tests/helpers.py's reward_rise); then that
rise's mean and spread (max - min over the seeds) and the highest bar whose margin (mean rise - bar) is at
least twice the spread: what the test may assert, so that another seed or machine passes it, while a run
that does not learn (rise ~0) still fails. A bar at or below 0 says the statistic is too noisy to judge
learning there: lengthen the run.

docs/testing.md ("Learning bars") keeps the measured table; rerun a case after changing what it trains.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# name: (the test holding the bar, the launched script, its arguments)
CASES = {
    "quickstart-80": ("tests/test_train_e2e.py::test_quickstart_learns", "megarl/train.py",
                      ["--config", "examples/quickstart_grpo.yaml", "--train-steps", "80"]),
    "quickstart-hf": ("tests/test_hf_rollout.py::test_quickstart_learns_with_the_hf_backend",
                      "tests/workers/no_vllm.py",
                      ["megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--rollout-backend", "hf"]),
    "async-80": ("tests/test_async_generation.py::test_async_generation_learns", "megarl/train.py",
                 ["--config", "examples/quickstart_grpo_separate.yaml", "--async-generation", "--tis-level",
                  "token", "--train-steps", "80"]),
}
CASES.update({f"preset-{preset}": ("tests/test_presets.py::test_preset_reward_rises", "megarl/train.py",
                                   ["--config", f"examples/{preset}.yaml", "--train-steps", "60"])
              for preset in ("grpo", "dapo", "drgrpo", "ppo")})
CASES["preset-dapo-120"] = ("tests/test_presets.py::test_preset_reward_rises[dapo]", "megarl/train.py",
                            ["--config", "examples/dapo.yaml", "--train-steps", "120"])


def ends(log_dir: Path, window: int) -> tuple[float, float]:
    """The reward's mean over the first and the last `window` steps."""
    from helpers import scalars

    series = scalars(log_dir, ["reward_mean"])["reward_mean"]
    values = [series[step] for step in sorted(series)]
    window = min(window, len(values))
    return sum(values[:window]) / window, sum(values[-window:]) / window


def run_case(name: str, seed: int, out: Path) -> Path:
    _, script, args = CASES[name]
    log_dir = out / f"{name}_seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / script), *args, "--seed", str(seed), "--log-dir", str(log_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return log_dir


def main(argv=None) -> None:
    from helpers import reward_rise

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--out", default=None, help="where the runs' logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="learning_bars_"))
    for name in args.cases:
        print(f"{name} ({CASES[name][0]}), window {args.window}:", flush=True)
        rises = []
        for seed in args.seeds:
            log_dir = run_case(name, seed, out)
            first, last = ends(log_dir, args.window)
            rises.append(reward_rise(log_dir))
            print(f"  seed {seed}: {first:.3f} -> {last:.3f} ({args.window}-step means), fitted rise "
                  f"{rises[-1]:+.3f}", flush=True)
        mean, spread = statistics.mean(rises), max(rises) - min(rises)
        print(f"  fitted rise {mean:+.3f} mean, spread {spread:.3f}: bar <= {mean - 2 * spread:+.3f} "
              f"(margin >= 2 x spread)", flush=True)


if __name__ == "__main__":
    main()
