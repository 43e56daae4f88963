"""--profile-step N: torch.profiler around one step's update on every rank, the table written to disk.

Where the update's time goes, per operation (issue 28: linear layers, attention, the loss, the optimizer
step, the gradient all-reduce, Python overhead), the way Megatron-LM's --profile and torchtitan's
profiling do it: one step, chosen by the user, profiled on every rank (ranks differ: the last pipeline
stage holds the loss, a DP rank may wait in the all-reduce). Each rank writes
`<dir>/rank<R>_step<N>_update.txt`, torch.profiler's operator table sorted by self time (CPU, and the
device's on GPU), and `rank<R>_step<N>_update.json`, a Chrome trace (chrome://tracing or Perfetto).
`<dir>` is `--profile-dir`, by default `profile/` under --log-dir. Other steps run unprofiled.
"""

from __future__ import annotations

import contextlib
import os

import torch

ROWS = 40  # operators in the table


def profile_dir(args) -> str:
    return args.profile_dir or os.path.join(args.log_dir or ".", "profile")


@contextlib.contextmanager
def profiled_update(args, step: int, rank: int):
    """Profile the block when `step` (0-based) is --profile-step's (1-based); otherwise do nothing."""
    if args.profile_step != step + 1:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=False, with_stack=False) as profiler:
        yield
    out = profile_dir(args)
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"rank{rank}_step{step + 1}_update")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(stem + ".txt", "w") as f:
        f.write(profiler.key_averages().table(sort_by=sort, row_limit=ROWS))
    profiler.export_chrome_trace(stem + ".json")
