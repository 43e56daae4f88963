"""Ranks and roles: who launched us, which ranks train and which generate.

Launch: torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, and the
agent's TCPStore), or plain `srun` (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and
the first host of SLURM_JOB_NODELIST; rank 0 then serves the TCPStore itself).
Either way, init_distributed leaves torchrun's variables set (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT): vLLM's external launcher and platform.device() read them.

Placement (DESIGN.md, "Placements"): vLLM and Megatron both assume they own the
whole default world, so
  * colocate: one world of all ranks; every rank trains and generates;
  * separate: each role gets a world of its own (`init_process_group` on a
    PrefixStore of the launcher's store, with the rank and size inside the role),
    and cross-role traffic uses one extra group over all launched ranks, built
    directly on the same store.
Megatron's parallel state is built over the train world only.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl import platform
from megarl.arguments import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    store_served_by_agent: bool  # torchrun's agent owns the store; we connect as clients


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a node list")
    prefix, _, ranges = head.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(environ=os.environ) -> LaunchEnv:
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", "29500")),
            store_served_by_agent=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if "SLURM_PROCID" in environ:
        job = int(environ.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            master_addr=environ.get("MASTER_ADDR") or first_slurm_host(environ["SLURM_JOB_NODELIST"]),
            master_port=int(environ.get("MASTER_PORT", 15000 + job % 20000)),
            store_served_by_agent=False,
        )
    # A plain `python megarl/train.py`: a world of one.
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(environ.get("MASTER_PORT", "29500")), False)


def export_launch_env(env: LaunchEnv, environ=os.environ) -> None:
    """Set the variables torchrun sets, where the launcher did not (plain `srun`, plain python).

    vLLM's external launcher reads LOCAL_RANK (and RANK) from the environment
    (`int(os.environ["LOCAL_RANK"])`: a KeyError under plain srun), and
    `platform.device()` picks `cuda:$LOCAL_RANK` (else every rank of a node would
    use GPU 0). Values a launcher already set are kept.
    """
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                       ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        environ.setdefault(key, str(value))


@dataclass(frozen=True)
class Layout:
    """Which global ranks play which role, and the train role's parallel sizes."""

    world_size: int
    colocated: bool
    train_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    teacher_ranks: tuple[int, ...]
    tp: int
    pp: int
    cp: int
    rollout_tp: int

    @property
    def dp(self) -> int:
        return len(self.train_ranks) // (self.tp * self.pp * self.cp)

    def roles_of(self, rank: int) -> tuple[str, ...]:
        return tuple(role for role, ranks in (("train", self.train_ranks), ("rollout", self.rollout_ranks),
                                              ("teacher", self.teacher_ranks)) if rank in ranks)

    def world_of(self, rank: int) -> tuple[str, tuple[int, ...]]:
        """The (name, global ranks) of the world this rank initialises as its default group."""
        if self.colocated:
            return "all", tuple(range(self.world_size))
        role = self.roles_of(rank)[0]
        return role, getattr(self, f"{role}_ranks")

    def describe(self) -> str:
        def span(ranks):
            return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"

        lines = [f"placement: {'colocate' if self.colocated else 'separate'}, {self.world_size} ranks"]
        lines.append(f"  train   ranks {span(self.train_ranks)}: TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp}")
        lines.append(f"  rollout ranks {span(self.rollout_ranks)}: TP={self.rollout_tp}, "
                     f"{len(self.rollout_ranks) // self.rollout_tp} vLLM engine(s)")
        if self.teacher_ranks:
            lines.append(f"  teacher ranks {span(self.teacher_ranks)}")
        return "\n".join(lines)


def build_layout(args, world_size: int) -> Layout:
    colocated = any("train" in g and "rollout" in g for g in args.colocate_groups)
    train = tuple(range(args.train_gpus))
    rollout = train if colocated else tuple(range(args.train_gpus, args.train_gpus + args.rollout_gpus))
    next_free = max(train + rollout) + 1
    teacher_colocated = any("teacher" in g for g in args.colocate_groups)
    teacher = () if teacher_colocated or not args.teacher_gpus else tuple(
        range(next_free, next_free + args.teacher_gpus))
    return Layout(world_size, colocated, train, rollout, teacher, args.tensor_model_parallel_size,
                  args.pipeline_model_parallel_size, args.context_parallel_size,
                  args.rollout_tensor_parallel_size)


@dataclass
class DistContext:
    env: LaunchEnv
    layout: Layout
    store: dist.Store
    world_name: str  # "all" when colocated, else this rank's role
    timeout: timedelta
    cross_role_group: object | None = None  # over all launched ranks; None when colocated
    roles: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_train(self) -> bool:
        return "train" in self.roles

    @property
    def is_rollout(self) -> bool:
        return "rollout" in self.roles


def _connect_store(env: LaunchEnv, timeout: timedelta) -> dist.Store:
    serve = env.rank == 0 and not env.store_served_by_agent
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=serve,
                         timeout=timeout, wait_for_workers=False, use_libuv=True)


def init_distributed(args, env: LaunchEnv | None = None) -> DistContext:
    """Create the default (per-role or shared) world and the cross-role group."""
    env = env or launch_env()
    export_launch_env(env)
    layout = build_layout(args, env.world_size)
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    platform.set_device(env.local_rank)
    store = _connect_store(env, timeout)
    world_name, world_ranks = layout.world_of(env.rank)
    dist.init_process_group(
        backend=platform.backend(), store=dist.PrefixStore(f"megarl/world/{world_name}/", store),
        rank=world_ranks.index(env.rank), world_size=len(world_ranks), timeout=timeout)
    context = DistContext(env, layout, store, world_name, timeout, roles=layout.roles_of(env.rank))
    if not layout.colocated:
        context.cross_role_group = new_store_group("cross-role", context)
    if env.rank == 0:
        print(f"[megarl] {layout.describe()}", flush=True)
    return context


def new_store_group(name: str, context: DistContext, members: tuple[int, ...] | None = None):
    """A gloo group over `members` (default: every launched rank), outside the default world.

    Built directly on the launcher's store, so it can span roles that live in
    different worlds. Call only on member ranks, and use its own collectives
    (`group.broadcast(tensor, root).wait()`), since torch.distributed's
    helpers only know groups of the default world.
    """
    members = tuple(range(context.env.world_size)) if members is None else members
    options = dist.ProcessGroupGloo._Options()
    options._timeout = context.timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"megarl/group/{name}/", context.store),
                                 members.index(context.env.rank), len(members), options)


def init_megatron_parallel(context: DistContext, seed: int) -> None:
    """Megatron's TP x PP x CP x DP groups over the train world (train ranks only)."""
    if not context.is_train:
        return
    from megatron.core import parallel_state, tensor_parallel

    platform.apply_megatron_shims()
    layout = context.layout
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp)
    # Megatron's RNG tracker (dropout, init) needs its per-TP-rank states.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rank0_print(*args) -> None:
    if not dist.is_initialized() or int(os.environ.get("RANK", dist.get_rank())) == 0:
        print(*args, flush=True)


def all_gather_objects(obj, context: DistContext) -> list:
    """Every launched rank's `obj`, in launch-rank order (cross-role group, or the shared world)."""
    if context.cross_role_group is None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    group, size = context.cross_role_group, context.env.world_size
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    group.allgather([lengths], [torch.tensor([payload.numel()], dtype=torch.int64)]).wait()
    longest = int(max(length.item() for length in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    group.allgather([buffers], [padded]).wait()
    return [pickle.loads(buf[: int(n.item())].numpy().tobytes()) for buf, n in zip(buffers, lengths)]
