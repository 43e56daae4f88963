"""Measure a learning test's run-to-run spread and the bar it can hold: the same run at several seeds.

    python tools/learning_bars.py quickstart-80 [--seeds 1234 1 2] [--window 5]

Each case is a learning test's run (the test named in CASES). Per seed it prints the reward's mean over the
first and the last `--window` steps (the run's own `reward: a -> b` line at the default 5) and the tests'
statistic, the rise of a least-squares line through every step (tests/helpers.py's reward_rise), or for a
distillation case the share of the student's pass@1 gap to the teacher that the run closes; then that
statistic's mean and spread (max - min over the seeds) and the highest bar whose margin (mean rise - bar) is at
least twice the spread: what the test may assert, so that another seed or machine passes it, while a run
that does not learn (rise ~0) still fails. A bar at or below 0 says the statistic is too noisy to judge
learning there: lengthen the run.

docs/testing.md ("Learning bars") keeps the measured table; rerun a case after changing what it trains.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_moe import NEW_MOE_FLAGS  # noqa: E402 - the new MoE families' runs beyond the MoE quickstart's flags
# name: (the test holding the bar, the launched script, its arguments)
CASES = {
    "quickstart-80": ("tests/test_train_e2e.py::test_quickstart_learns", "megarl/train.py",
                      ["--config", "examples/quickstart_grpo.yaml", "--train-steps", "80"]),
    "quickstart-hf": ("tests/test_hf_rollout.py::test_quickstart_learns_with_the_hf_backend",
                      "tests/workers/no_vllm.py",
                      ["megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--rollout-backend", "hf"]),
    "separate-200": ("tests/test_streaming.py::test_streaming_learns_as_sync_does", "megarl/train.py",
                     ["--config", "examples/quickstart_grpo_separate.yaml"]),
    "stream-K2-partial": ("tests/test_streaming.py::test_streaming_learns_as_sync_does", "megarl/train.py",
                          ["--config", "examples/quickstart_grpo_separate.yaml", "--max-staleness", "2",
                           "--partial-rollout", "--tis-level", "token"]),
    "async-80": ("tests/test_async_generation.py::test_async_generation_learns", "megarl/train.py",
                 ["--config", "examples/quickstart_grpo_separate.yaml", "--async-generation", "--tis-level",
                  "token", "--train-steps", "80"]),
}
CASES.update({f"preset-{preset}": ("tests/test_presets.py::test_preset_reward_rises", "megarl/train.py",
                                   ["--config", f"examples/{preset}.yaml", "--train-steps", "60"])
              for preset in ("grpo", "dapo", "drgrpo", "ppo")})
# The reward a case's statistic reads (default reward_mean): DAPO's batch keeps its mixed groups only, so its
# reward_mean is not the policy's accuracy; every generated sample's reward is
RISE_TAG = {"preset-dapo": "dapo_reward_all_mean", "preset-dapo-120": "dapo_reward_all_mean"}
CASES["preset-dapo-120"] = ("tests/test_presets.py::test_preset_reward_rises[dapo]", "megarl/train.py",
                            ["--config", "examples/dapo.yaml", "--train-steps", "120"])
QUICKSTARTS = {"colocate": "examples/quickstart_grpo.yaml", "separate": "examples/quickstart_grpo_separate.yaml"}
CASES.update({f"lora-{placement}-{sync}": (f"tests/test_lora.py::test_lora_quickstart_learns[{placement}-{sync}]",
                                           "megarl/train.py", ["--config", QUICKSTARTS[placement], "--lora-rank", "8",
                                                               "--lr", "5e-4", "--lora-sync", sync])
              for placement in QUICKSTARTS for sync in ("merged", "adapter")})
CASES.update({
    "moe": ("tests/test_moe.py::test_moe_quickstart_learns", "megarl/train.py",
            ["--config", "examples/quickstart_grpo_moe.yaml"]),
    "tools": ("tests/test_multiturn.py::test_tool_quickstart_learns", "megarl/train.py",
              ["--config", "examples/quickstart_grpo_tools.yaml"]),
    **{f"moe-{family}": (f"tests/test_moe.py::test_the_new_moe_families_learn[{family}]", "megarl/train.py",
                         ["--config", "examples/quickstart_grpo_moe.yaml", "--model", f"artifacts/tiny-{family}-warm",
                          *NEW_MOE_FLAGS.get(family, [])])
       for family in ("deepseek_v3", "glm4_moe", "gpt_oss", "nemotron_h")},
    "qwen3_5": ("tests/test_train_e2e.py::test_the_quickstart_learns_on_qwen3_5", "megarl/train.py",
                ["--config", "examples/quickstart_grpo.yaml", "--model", "artifacts/tiny-qwen3_5"]),
})
# Distillation: the share of the student's pass@1 gap to the teacher that the run closes (its own `pass@1:` line)
GAP_CASES = {
    "gkd": ("tests/test_distill_e2e.py::test_the_distillation_quickstart_closes_half_the_gap_to_the_teacher",
            "megarl/train.py", ["--config", "examples/quickstart_gkd.yaml"]),
    "lora-gkd": ("tests/test_lora.py::test_lora_distillation_closes_half_the_gap_to_the_teacher", "megarl/train.py",
                 ["--config", "examples/quickstart_gkd.yaml", "--lora-rank", "8", "--lr", "2e-3"]),
    "gkd-qwen3_5": ("tests/test_distill_e2e.py::test_the_qwen3_5_distillation_quickstart_closes_most_of_the_gap",
                    "megarl/train.py", ["--config", "examples/quickstart_gkd_qwen3_5.yaml"]),
}
CASES.update(GAP_CASES)


def ends(log_dir: Path, window: int, tag: str = "reward_mean") -> tuple[float, float]:
    """The reward's mean over the first and the last `window` steps."""
    from helpers import scalars

    series = scalars(log_dir, [tag])[tag]
    values = [series[step] for step in sorted(series)]
    window = min(window, len(values))
    return sum(values[:window]) / window, sum(values[-window:]) / window


def gap_closed(stdout: str) -> float:
    """The share of the student's pass@1 gap to the teacher closed, from the run's last `pass@1:` line."""
    line = [text for text in stdout.splitlines() if text.startswith("pass@1: ")][-1]
    before, after, teacher = (float(value) for value in
                              re.fullmatch(r"pass@1: student ([\d.]+) -> ([\d.]+), teacher ([\d.]+)", line).groups())
    return (after - before) / (teacher - before)


def run_case(name: str, seed: int, out: Path, extra: tuple[str, ...] = ()) -> tuple[Path, str]:
    """The case's run at `seed` (with `extra` options): its log directory and its stdout."""
    _, script, args = CASES[name]
    args = [*args, *extra]
    log_dir = out / f"{name}{'_' + '_'.join(extra).replace('-', '') if extra else ''}_seed{seed}"
    for flag in ("--config", "--model"):  # the tiny models named, built once (run_quickstart.sh's step)
        if flag in args:
            subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_model.py"), f"--for-{flag[2:]}",
                            args[args.index(flag) + 1]], cwd=ROOT, check=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / script), *args, "--seed", str(seed), "--log-dir", str(log_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return log_dir, result.stdout


def main(argv=None) -> None:
    from helpers import reward_rise

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    parser.add_argument("--out", default=None, help="where the runs' logs go (default: a temporary directory)")
    parser.add_argument("--extra", default="", help="more options for each run, after the case's (one string: "
                        "'--lr 3e-3'), to try a setting before changing the test")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="learning_bars_"))
    for name in args.cases:
        print(f"{name} ({CASES[name][0]}){' with ' + args.extra if args.extra else ''}, window {args.window}:",
              flush=True)
        values, statistic = [], "gap closed" if name in GAP_CASES else "fitted rise"
        for seed in args.seeds:
            log_dir, stdout = run_case(name, seed, out, tuple(args.extra.split()))
            if name in GAP_CASES:
                values.append(gap_closed(stdout))
                print(f"  seed {seed}: {[t for t in stdout.splitlines() if t.startswith('pass@1: ')][-1]}, gap "
                      f"closed {values[-1]:+.3f}", flush=True)
                continue
            tag = RISE_TAG.get(name, "reward_mean")
            first, last = ends(log_dir, args.window, tag)
            values.append(reward_rise(log_dir, tag))
            print(f"  seed {seed}: {first:.3f} -> {last:.3f} ({args.window}-step means), fitted rise "
                  f"{values[-1]:+.3f}", flush=True)
        mean, spread = statistics.mean(values), max(values) - min(values)
        print(f"  {statistic} {mean:+.3f} mean, spread {spread:.3f}: bar <= {mean - 2 * spread:+.3f} "
              f"(margin >= 2 x spread)", flush=True)


if __name__ == "__main__":
    main()
