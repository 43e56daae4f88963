"""Each CPU rank on its own cores (--cpu-affinity auto).

torchrun starts every rank of a host with the host's whole CPU mask, and vLLM's in-rank engine (the
external launcher) binds no threads, so on CPU ranks the scheduler moves each rank's compute thread
between cores and the ranks' caches with it. Bound, each local rank keeps one contiguous share of the
mask: on the bench job (bench/e2e.py, 2 ranks on 2 cores, one thread each) a step took 5% less, in
generation and in the update alike (docs/benchmarks.md). This is what vLLM's own multiprocessing executor
does for its CPU workers (VLLM_CPU_OMP_THREADS_BIND) and torchrun's --numa-binding does per GPU.

A rank is bound only where nobody bound it: CPU ranks (no CUDA), its mask the same as its launcher's
(torchrun's agent, srun's step daemon: under `srun --cpu-bind` or `taskset` per rank the masks differ and
the launcher's placement stands), and at least one CPU per local rank (oversubscribed hosts, as a test
running 4 ranks on 2 cores, are left to the scheduler). Every thread the rank has so far is moved
(sched_setaffinity applies per thread) and those it starts later inherit the mask. Linux only.
The threads per rank stay what OMP_NUM_THREADS says (torchrun's default: 1): set it to the share's size
to use all of a rank's cores.
"""

from __future__ import annotations

import os
import sys


def local_world_size(environ=os.environ) -> int | None:
    """How many ranks this host runs: torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks on this node."""
    if "LOCAL_WORLD_SIZE" in environ:
        return int(environ["LOCAL_WORLD_SIZE"])
    tasks = environ.get("SLURM_TASKS_PER_NODE")  # "4" or "4(x2),3": this node's entry is not named, use it if all agree
    if tasks:
        counts = {int(part.split("(")[0]) for part in tasks.split(",")}
        if len(counts) == 1:
            return counts.pop()
    return None


def rank_cpus(mask: set[int], launcher_mask: set[int] | None, local_rank: int, local_ranks: int | None
              ) -> list[int] | None:
    """The CPUs local rank `local_rank` of `local_ranks` is bound to, or None where it stays as it is: its
    contiguous share of the sorted `mask` (the first len(mask) % local_ranks ranks one CPU more)."""
    if not local_ranks or local_ranks < 2 or len(mask) < local_ranks or launcher_mask != mask:
        return None
    cpus = sorted(mask)
    share, extra = divmod(len(cpus), local_ranks)
    start = local_rank * share + min(local_rank, extra)
    return cpus[start:start + share + (local_rank < extra)]


def bind(mode: str, local_rank: int, environ=os.environ, on_cuda: bool | None = None) -> list[int] | None:
    """Apply --cpu-affinity to this process's threads; the CPUs it is now bound to, or None if left alone."""
    if mode == "none" or not sys.platform.startswith("linux"):
        return None
    if on_cuda is None:
        from megarl import accelerator

        on_cuda = accelerator.ON_CUDA
    if on_cuda:
        return None
    mask = os.sched_getaffinity(0)
    try:
        launcher_mask = os.sched_getaffinity(os.getppid())
    except OSError:  # the launcher is gone or not ours to read
        launcher_mask = None
    cpus = rank_cpus(mask, launcher_mask, local_rank, local_world_size(environ))
    if cpus is None:
        return None
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return cpus
