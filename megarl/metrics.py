"""Per-step metrics: one progress line, TensorBoard scalars (and wandb when asked), from rank 0.

`accuracy` is the fraction of samples whose reward reaches 1.0 (the built-in
rewards give 1.0 for a correct answer). Each phase of the step (megarl/phases.py)
reports its own seconds and metrics: `<phase>_seconds` (generate, score,
prepare, advantages, update, sync), `step_seconds` their sum, and
`reward_seconds` what the rewards added to generate (the slowest rollout rank): with
--reward-workers > 0 they are scored while the engine generates (megarl/rewards/scoring.py) and this is
the wait after generation ended; with 0, all of the scoring.
rss_mb is rank 0's resident memory after the step (/proc/self/status), to see a leak.
tokens_per_second counts prompt and response tokens of the step's samples over
the whole step; rollout_tokens_per_second counts the generated tokens over
generation without scoring.
"""

from __future__ import annotations

import math
import os
import time

import torch


class MetricsLogger:
    def __init__(self, args, is_main: bool):
        self.args, self.is_main = args, is_main
        self.rewards: list[float] = []
        self.pass_at_1: dict[str, dict[str, list[float]]] = {}  # eval set -> "student"/"teacher" -> values
        self.writer = self.wandb = None
        self.started, self.first_step = time.monotonic(), None
        if not is_main:
            return
        if args.log_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(args.log_dir, exist_ok=True)
            self.writer = SummaryWriter(args.log_dir)
        if args.wandb_project:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_name,
                                    config={k: v for k, v in vars(args).items() if _plain(v)})

    def log_step(self, step: int, batch, reports: dict) -> dict:
        """reports: phase name -> phases.PhaseReport. Returns the flat metrics written."""
        samples = batch.samples
        metrics = {}
        for name, report in reports.items():
            metrics.update(report.metrics)
            metrics[f"{name}_seconds"] = report.seconds
        metrics["step_seconds"] = sum(report.seconds for report in reports.values())
        rewards = torch.tensor([s.reward for s in samples])
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        prompt_tokens = sum(len(s.prompt_ids) for s in samples)
        generation_seconds = metrics.get("generate_seconds", 0.0) - metrics.get("reward_seconds", 0.0)
        metrics.update(
            reward_mean=rewards.mean().item(),
            reward_std=rewards.std().item() if len(rewards) > 1 else 0.0,
            accuracy=(rewards >= 1.0).float().mean().item(),
            response_length_mean=lengths.mean().item(),
            response_length_max=lengths.max().item(),
            truncated_fraction=sum(s.truncated for s in samples) / len(samples),
            tokens_per_second=(prompt_tokens + lengths.sum().item()) / max(metrics["step_seconds"], 1e-9),
            rollout_tokens_per_second=lengths.sum().item() / max(generation_seconds, 1e-9),
        )
        rss = resident_memory_mb()
        if rss is not None:
            metrics["rss_mb"] = rss
        self.rewards.append(metrics["reward_mean"])
        if not self.is_main:
            return metrics
        if self.first_step is None:
            self.first_step = step
        if step % self.args.log_interval == 0 or step == self.args.train_steps - 1:
            print(f"step {step + 1}/{self.args.train_steps} | reward {metrics['reward_mean']:.3f} | "
                  f"acc {metrics['accuracy']:.3f} | mismatch {metrics.get('mismatch', math.nan):.2e} | "
                  f"kl {metrics.get('kl_old_new', math.nan):.1e} | clip {metrics.get('clip_fraction', math.nan):.3f} | "
                  f"len {metrics['response_length_mean']:.1f} | " +
                  (f"teacher_kl {metrics['teacher_kl']:.3f} | " if "teacher_kl" in metrics else "") +
                  f"sync {metrics.get('sync_seconds', 0):.2f}s | "
                  f"{metrics['step_seconds']:.1f}s | eta {self._eta(step)}", flush=True)
        self._write(metrics, step)
        return metrics

    def log_eval(self, completed_steps: int, metrics: dict) -> None:
        """Evaluation metrics, at TensorBoard step = training steps completed (0: before training)."""
        if not self.is_main:
            return
        parts = [f"{key.removeprefix('eval/')} {value:.3f}" for key, value in metrics.items()
                 if not key.endswith(("reward_errors", "reward_timeouts"))]
        print(f"eval after {completed_steps} steps | " + " | ".join(parts), flush=True)
        self._write(metrics, completed_steps)
        for key, value in metrics.items():
            name, _, metric = key.removeprefix("eval/").rpartition("/")
            if metric in ("pass@1", "teacher_pass@1"):
                policy = "teacher" if metric.startswith("teacher") else "student"
                self.pass_at_1.setdefault(name, {}).setdefault(policy, []).append(value)

    def _write(self, metrics: dict, step: int) -> None:
        scalars = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def _eta(self, step: int) -> str:
        done = step + 1 - self.first_step
        seconds = (time.monotonic() - self.started) / done * (self.args.train_steps - step - 1)
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.is_main and self.rewards:
            window = min(5, len(self.rewards))
            first = sum(self.rewards[:window]) / window
            last = sum(self.rewards[-window:]) / window
            print(f"reward: {first:.3f} -> {last:.3f}", flush=True)
        if self.is_main:
            for name, series in self.pass_at_1.items():  # first and last evaluation, and the teacher's mark
                student, teacher = series.get("student", []), series.get("teacher", [])
                where = f" ({name})" if len(self.pass_at_1) > 1 else ""
                if student and teacher:
                    print(f"pass@1{where}: student {student[0]:.3f} -> {student[-1]:.3f}, teacher {teacher[0]:.3f}",
                          flush=True)
                elif student:
                    print(f"pass@1{where}: {student[0]:.3f} -> {student[-1]:.3f}", flush=True)


def resident_memory_mb() -> float | None:
    """This process's resident memory (VmRSS, MiB; rank 0's is logged as rss_mb), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), list))
