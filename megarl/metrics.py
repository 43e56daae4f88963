"""Per-step metrics: one console line and TensorBoard scalars, from rank 0.

`accuracy` is the fraction of samples whose reward reaches 1.0 (the built-in
rewards give 1.0 for a correct answer).
"""

from __future__ import annotations

import math
import os

import torch


class MetricsLogger:
    def __init__(self, args, is_main: bool):
        self.args, self.is_main = args, is_main
        self.rewards: list[float] = []
        self.writer = None
        if is_main and args.log_dir:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(args.log_dir, exist_ok=True)
            self.writer = SummaryWriter(args.log_dir)

    def log_step(self, step: int, samples, metrics: dict) -> dict:
        rewards = torch.tensor([s.reward for s in samples])
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        metrics = dict(metrics)
        metrics.update(
            reward_mean=rewards.mean().item(),
            accuracy=(rewards >= 1.0).float().mean().item(),
            response_length_mean=lengths.mean().item(),
            response_length_max=lengths.max().item(),
            truncated_fraction=sum(s.truncated for s in samples) / len(samples),
        )
        self.rewards.append(metrics["reward_mean"])
        if not self.is_main:
            return metrics
        if step % self.args.log_interval == 0 or step == self.args.train_steps - 1:
            print(f"step {step + 1}/{self.args.train_steps} | reward {metrics['reward_mean']:.3f} | "
                  f"acc {metrics['accuracy']:.3f} | mismatch {metrics.get('mismatch', math.nan):.2e} | "
                  f"kl {metrics.get('kl_old_new', math.nan):.1e} | clip {metrics.get('clip_fraction', math.nan):.3f} | "
                  f"len {metrics['response_length_mean']:.1f} | sync {metrics.get('sync_seconds', 0):.2f}s | "
                  f"{metrics['step_seconds']:.1f}s", flush=True)
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        return metrics

    def log_eval(self, completed_steps: int, metrics: dict) -> None:
        """Evaluation metrics, at TensorBoard step = training steps completed (0: before training)."""
        if not self.is_main:
            return
        parts = [f"{key.removeprefix('eval/')} {value:.3f}" for key, value in metrics.items()
                 if not key.endswith("reward_errors")]
        print(f"eval after {completed_steps} steps | " + " | ".join(parts), flush=True)
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, completed_steps)
            self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.is_main and self.rewards:
            window = min(5, len(self.rewards))
            first = sum(self.rewards[:window]) / window
            last = sum(self.rewards[-window:]) / window
            print(f"reward: {first:.3f} -> {last:.3f}", flush=True)
