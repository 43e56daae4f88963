"""Benchmark: synchronous, one-step (--async-generation) and streaming (--max-staleness K, with and without
--partial-rollout) generation on the same long-tailed job, side by side, in one run.

    python bench/async.py [--steps 16 --warmup 3 --tail 16 384 --prompts 8 --generations 4]
                          [--modes sync one-step K2 K2-partial K4 K4-partial]

The job: examples/quickstart_grpo_separate.yaml (the tiny Qwen2, one train rank and one rollout rank, torchrun on
this machine), --prompts prompts x --generations samples a step, every prompt's responses forced to a length drawn
log-normally between the --tail bounds (--min-new-tokens-tail: median LOW * (HIGH/LOW)^(1/4), the tail up to
HIGH = --max-new-tokens; the tiny model's 512 positions less its 128 prompt tokens bound HIGH at 384), what
reasoning RL's response lengths look like; streaming modes keep twice a step's
prompt groups in flight (--stream-groups). Each mode is one megarl/train.py run with the same seed.

Printed per mode: the median step seconds and the trained tokens per second over the steps after --warmup (the
responses' tokens the trainer took, over the trainer's step_seconds), the ratio of that to the sync mode's and to
the one-step mode's, the mean staleness and share of partial samples, and the reward's first and last means (the
curve; the runs are short, so it says little about learning: the learning lane does). The goals of issue 55
(streaming with partial rollout >= 1.5x sync and >= 1.15x one-step) are printed with the measured ratios.
It prints; it asserts nothing. Run it on an otherwise idle machine: the two ranks take the two cores.
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

MODES = {
    "sync": [],
    "one-step": ["--async-generation"],
    "K1": ["--max-staleness", "1"],
    "K2": ["--max-staleness", "2"],
    "K2-partial": ["--max-staleness", "2", "--partial-rollout"],
    "K4": ["--max-staleness", "4"],
    "K4-partial": ["--max-staleness", "4", "--partial-rollout"],
}
TAGS = ("step_seconds", "response_length_mean", "reward_mean", "staleness", "staleness_mean", "partial_fraction",
        "generate_seconds", "update_seconds")


def run_mode(name: str, args, out: Path) -> dict:
    from helpers import scalars

    low, high = args.tail
    extra = MODES[name] + (["--stream-groups", str(2 * args.prompts)] if "--max-staleness" in MODES[name] else [])
    log_dir = out / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "megarl/train.py"), "--config", "examples/quickstart_grpo_separate.yaml",
               "--prompts-per-step", str(args.prompts), "--num-generations", str(args.generations),
               "--micro-batch-size", str(args.generations), "--max-new-tokens", str(high),
               "--min-new-tokens-tail", str(low), str(high), "--train-steps", str(args.steps),
               "--tis-level", "token", "--log-dir", str(log_dir), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    series = scalars(log_dir, TAGS)
    steps = sorted(series["step_seconds"])[args.warmup:]
    seconds = [series["step_seconds"][s] for s in steps]
    tokens = sum(series["response_length_mean"][s] * args.prompts * args.generations for s in steps)
    rewards = [series["reward_mean"][s] for s in sorted(series["reward_mean"])]
    window = max(1, min(3, len(rewards) // 2))
    return {"median_step": statistics.median(seconds), "tokens_per_second": tokens / sum(seconds),
            # streaming logs the mean over samples; the other modes' samples all share one version
            "staleness": statistics.mean(series.get("staleness_mean", series["staleness"])[s] for s in steps),
            "partial": statistics.mean(series.get("partial_fraction", {}).get(s, 0.0) for s in steps),
            "generate": statistics.median(series["generate_seconds"][s] for s in steps),
            "update": statistics.median(series["update_seconds"][s] for s in steps),
            "reward": (sum(rewards[:window]) / window, sum(rewards[-window:]) / window)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timings")
    parser.add_argument("--tail", type=int, nargs=2, default=[16, 384], metavar=("LOW", "HIGH"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["sync", "one-step", "K2", "K2-partial", "K4", "K4-partial"],
                        choices=sorted(MODES))
    parser.add_argument("--out", default=None, help="where the runs' logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_async_"))
    results = {}
    for name in args.modes:
        print(f"[bench/async] {name} ...", flush=True)
        results[name] = run_mode(name, args, out)
    print(f"\njob: {args.prompts} prompts x {args.generations} samples, lengths {args.tail[0]}-{args.tail[1]} "
          f"(log-normal), {args.steps} steps ({args.warmup} warm-up), 1 train + 1 rollout rank; logs in {out}")
    print(f"{'mode':<12}{'step s':>8}{'tok/s':>9}{'x sync':>8}{'x 1-step':>9}{'gen s':>7}{'upd s':>7}"
          f"{'stale':>7}{'partial':>8}  reward")
    for name, r in results.items():
        vs_sync = r["tokens_per_second"] / results["sync"]["tokens_per_second"] if "sync" in results else float("nan")
        vs_one = r["tokens_per_second"] / results["one-step"]["tokens_per_second"] if "one-step" in results \
            else float("nan")
        print(f"{name:<12}{r['median_step']:>8.2f}{r['tokens_per_second']:>9.1f}{vs_sync:>8.2f}{vs_one:>9.2f}"
              f"{r['generate']:>7.2f}{r['update']:>7.2f}{r['staleness']:>7.2f}{r['partial']:>8.2f}  "
              f"{r['reward'][0]:.3f} -> {r['reward'][1]:.3f}")
    best = max((n for n in results if n.endswith("partial")), key=lambda n: results[n]["tokens_per_second"],
               default=None)
    if best and "sync" in results and "one-step" in results:
        ratio_sync = results[best]["tokens_per_second"] / results["sync"]["tokens_per_second"]
        ratio_one = results[best]["tokens_per_second"] / results["one-step"]["tokens_per_second"]
        print(f"goals (issue 55): {best} {ratio_sync:.2f}x sync (>= 1.5: {'met' if ratio_sync >= 1.5 else 'not met'}), "
              f"{ratio_one:.2f}x one-step (>= 1.15: {'met' if ratio_one >= 1.15 else 'not met'})")


if __name__ == "__main__":
    main()
