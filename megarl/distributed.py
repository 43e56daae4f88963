"""Ranks and roles: who launched us, which ranks train and which generate.

Launch: torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, and the
agent's TCPStore), or plain `srun` (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and
the first host of SLURM_JOB_NODELIST; rank 0 then serves the TCPStore itself).
Either way, init_distributed leaves torchrun's variables set (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT): vLLM's external launcher and accelerator.device() read them.

Worlds (docs/platform.md, "Placements"; docs/design.md, "Ranks, roles and groups"): vLLM and Megatron both assume they own the
whole default world, so
  * colocate: one world of the train (= rollout) ranks; they train and generate;
  * separate: each role gets a world of its own (`init_process_group` on a
    PrefixStore of the launcher's store, with the rank and size inside the role),
    and cross-role traffic uses one extra group over all launched ranks, built
    directly on the same store. A standalone teacher's ranks are a world of their own.
Megatron's parallel state is built over the train world only.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl import accelerator
from megarl.errors import ConfigError
from megarl.placement import Placement


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
    `accelerator.device()` picks `cuda:$LOCAL_RANK` (else every rank of a node would
    use GPU 0). Values a launcher already set are kept.
    """
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                       ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        environ.setdefault(key, str(value))


@dataclass
class DistContext:
    env: LaunchEnv
    placement: Placement
    store: dist.Store
    world_name: str  # "train+rollout" when colocated, else this rank's role
    timeout: timedelta
    cross_role_group: object | None = None  # over all launched ranks; None with a single world
    roles: tuple[str, ...] = field(default_factory=tuple)

    @property
    def rank(self) -> int:
        """This process's launch rank."""
        return self.env.rank

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
    placement = Placement.from_args(args, env.world_size)
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    accelerator.set_device(env.local_rank)
    store = _connect_store(env, timeout)
    world_name, world_ranks = placement.world_of(env.rank)
    dist.init_process_group(
        backend=accelerator.backend(), store=dist.PrefixStore(f"megarl/world/{world_name}/", store),
        rank=world_ranks.index(env.rank), world_size=len(world_ranks), timeout=timeout)
    context = DistContext(env, placement, store, world_name, timeout, roles=placement.roles_of(env.rank))
    if placement.needs_cross_role_group:
        context.cross_role_group = new_store_group("cross-role", context)
    # Where every rank runs, for the message when one dies (dead_peers).
    _processes[:] = all_gather_objects((socket.gethostname(), os.getpid()), context)
    _failure_store[:] = [store]
    if env.rank == 0:
        print(f"[megarl] {placement.describe(getattr(args, 'rollout_backend', 'vllm'))}", flush=True)
    return context


def new_store_group(name: str, context: DistContext, members: tuple[int, ...] | None = None,
                    carries_device_tensors: bool = False):
    """A group over `members` (default: every launched rank), outside the default world.

    Built directly on the launcher's store, so it can span roles that live in
    different worlds. Call only on member ranks, and use its own collectives
    (`group.broadcast(tensor, root).wait()`), since torch.distributed's
    helpers only know groups of the default world. gloo for objects and CPU
    tensors; NCCL on GPU hosts when it carries device tensors (accelerator.store_group).
    Named "megarl/<name>", and warmed up by one collective before it is returned (an
    NCCL communicator is created here, on this rank's device, not at the group's first use).
    """
    members = tuple(range(context.env.world_size)) if members is None else members
    return accelerator.store_group(dist.PrefixStore(f"megarl/group/{name}/", context.store),
                                   members.index(context.env.rank), len(members), context.timeout,
                                   carries_device_tensors, name=f"megarl/{name}")


class StartupTimeout(RuntimeError):
    """Some ranks had not built their roles within --startup-timeout-minutes (train.main prints it as one line)."""


def wait_for_every_rank(context: DistContext, minutes: float, phase: str = "start-up") -> None:
    """Return once every launched rank has reached this call, or raise StartupTimeout after `minutes`.

    At start-up the roles take very different times: the train ranks build Megatron quickly, the rollout
    ranks' vLLM engines compile and capture CUDA graphs first. Waiting here, on the launcher's store
    with its own bound (--startup-timeout-minutes), keeps that wait out of the first cross-role
    collective, which is bounded by --distributed-timeout-minutes and would name no cause."""
    store = dist.PrefixStore(f"megarl/reached/{phase}/", context.store)
    store.set(str(context.rank), "1")
    keys = [str(rank) for rank in range(context.env.world_size)]
    try:
        store.wait(keys, timedelta(minutes=minutes))
    except dist.DistStoreError:
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise StartupTimeout(f"{phase}: ranks {_ranges(missing)} were not ready after --startup-timeout-minutes "
                             f"{minutes:g} (the rollout and teacher ranks build their vLLM engines then); "
                             f"raise it if they are still starting") from None


def _ranges(ranks: list[int]) -> str:
    """'0-3, 6' for [0, 1, 2, 3, 6]."""
    parts, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def init_megatron_parallel(context: DistContext, seed: int) -> None:
    """Megatron's TP x PP x CP x DP groups over the train world (train ranks only), and the expert groups
    (EP x expert DP, expert TP 1: megarl/models/megatron_gpt.py, moe_config)."""
    if not context.is_train:
        return
    from megatron.core import parallel_state, tensor_parallel

    accelerator.apply_megatron_shims()
    placement = context.placement
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=placement.tp, pipeline_model_parallel_size=placement.pp,
        context_parallel_size=placement.cp, expert_model_parallel_size=placement.ep,
        expert_tensor_parallel_size=1)
    expected = (placement.dp, placement.data_parallel_rank(context.rank))
    actual = (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())
    if expected != actual:
        raise RuntimeError(f"Megatron's data-parallel (size, rank) {actual} differs from the placement's "
                           f"{expected}: the rank order assumed in megarl/placement.py is out of date")
    # Megatron's RNG tracker (dropout, init) needs its per-TP-rank states.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


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


def gather_tensor_dicts(mine: dict[str, torch.Tensor] | None, context: DistContext) -> list[dict | None]:
    """Every launched rank's dict of tensors (None where a rank contributes none), in launch-rank order, on
    every rank, over the cross-role group (a placement with more than one world has it; with one world, its
    default group), as tensors, not pickles: first each rank's layout (name, shape, dtype, byte offset per
    field: a small object gather), then each contributing rank broadcasts its fields packed into one flat
    byte buffer. A receiver's tensors are views into its copy of that buffer (host memory); the contributor
    gets its own dict back. (all_gather_objects would pickle every rank's tensors and pad each to the
    longest, on every rank.)"""
    tensors, layout = None, None
    if mine is not None:
        tensors = {name: value.detach().cpu().contiguous() for name, value in mine.items()}
        layout, size = [], 0
        for name, value in tensors.items():
            offset = align(size, TENSOR_ALIGN)
            layout.append((name, tuple(value.shape), value.dtype, offset))
            size = offset + value.numel() * value.element_size()
    gathered = []
    for source, fields in enumerate(all_gather_objects(layout, context)):
        if fields is None:
            gathered.append(None)
            continue
        buffer = torch.empty(layout_nbytes(fields), dtype=torch.uint8)
        if source == context.env.rank:
            for name, shape, dtype, offset in fields:
                byte_view(buffer, shape, dtype, offset).copy_(tensors[name])
        if buffer.numel():
            buffer = _broadcast_bytes(buffer, source, context)
        gathered.append(mine if source == context.env.rank else
                        {name: byte_view(buffer, shape, dtype, offset) for name, shape, dtype, offset in fields})
    return gathered


def _broadcast_bytes(buffer: torch.Tensor, source: int, context: DistContext) -> torch.Tensor:
    """`buffer` from launch rank `source` on every rank (host memory): over the cross-role group (group rank
    = launch rank: it spans every rank), else over the one world (world rank = launch rank), on this rank's
    device where that world is NCCL's."""
    if context.cross_role_group is not None:
        context.cross_role_group.broadcast(buffer, source).wait()
        return buffer
    on_device = buffer.to(accelerator.device())
    dist.broadcast(on_device, source)
    return on_device.cpu()


# Flat byte buffers holding several tensors (weight-sync buckets, gather_tensor_dicts): each tensor starts at
# a multiple of TENSOR_ALIGN bytes, so a view of any dtype is aligned.
TENSOR_ALIGN = 64


def align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def nbytes_of(shape, dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def layout_nbytes(layout) -> int:
    """Bytes of a flat buffer holding [(name, shape, dtype, byte offset), ...] (offsets ascending)."""
    if not layout:
        return 0
    _, shape, dtype, offset = layout[-1]
    return offset + nbytes_of(shape, dtype)


def byte_view(buffer: torch.Tensor, shape, dtype, offset: int) -> torch.Tensor:
    """The tensor of `shape` and `dtype` at byte `offset` of the flat uint8 `buffer` (a view)."""
    return buffer[offset: offset + nbytes_of(shape, dtype)].view(dtype).view(shape)


_processes: list[tuple[str, int]] = []  # (host, pid) of each launched rank, in launch-rank order
_failure_store: list = []  # the launcher's store, where a rank that fails on its own leaves a line (publish_failure)
_STORE_SECONDS = 2.0  # the most a failure report waits on the store (it may have died with its rank)


def publish_failure(rank: int, what: str) -> None:
    """Leave 'rank N failed on HOST: what' in the store, for the ranks of other hosts (whose dead_peers
    cannot see this process end). Best effort and bounded: the store may be gone."""
    if _failure_store:
        line = f"rank {rank} failed on {socket.gethostname()} ({what[:200]})"
        _within(_STORE_SECONDS, lambda: _failure_store[0].set(f"megarl/failed/{rank}", line))


def _published_failures(rank: int, skip: set[int]) -> list[str]:
    if not _failure_store:
        return []
    store = _failure_store[0]
    keys = {peer: f"megarl/failed/{peer}" for peer in range(len(_processes)) if peer != rank and peer not in skip}

    def read():
        return [store.get(key).decode() for peer, key in keys.items() if store.check([key])]

    return _within(_STORE_SECONDS, read) or []


def _within(seconds: float, fn):
    """fn() in a daemon thread, waiting at most `seconds` for it (None then, or when it raised)."""
    result = []

    def call():
        try:
            result.append(fn())
        except Exception:  # noqa: BLE001 - a store that is gone: nothing to learn from it
            pass

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def dead_peers(rank: int, wait_seconds: float = 0.0) -> list[str]:
    """'rank N died (...)' for each other rank on this host whose process has ended, and 'rank N failed on
    HOST (...)' for each rank that published its own failure (publish_failure: ranks of other hosts too),
    looking again for up to `wait_seconds` while none has (a peer's sockets close, failing our collective,
    a moment before the kernel marks it dead). A rank of another host killed outright cannot be seen from
    here: its launcher reports it."""
    host, deadline = socket.gethostname(), time.monotonic() + wait_seconds
    while True:
        ended = {peer: _how_it_ended(pid) for peer, (peer_host, pid) in enumerate(_processes)
                 if peer != rank and peer_host == host}
        found = [f"rank {peer} died ({how})" for peer, how in ended.items() if how is not None]
        found += _published_failures(rank, skip={peer for peer, how in ended.items() if how is not None})
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def _how_it_ended(pid: int) -> str | None:
    """None while process `pid` runs; else how it ended, as far as /proc still tells (a zombie keeps its
    exit status until its parent, the launcher, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return f"process {pid} is gone"
    except OSError:
        return None
    if fields[0] not in "ZX":  # state, after the command name
        return None
    status = int(fields[49]) if len(fields) > 49 else None  # exit_code (Linux >= 3.5): a wait status
    if status is None:
        return f"process {pid} exited"
    if status & 0x7F:
        return f"signal {status & 0x7F}: {signal.Signals(status & 0x7F).name}, process {pid}"
    return f"exit code {status >> 8}, process {pid}"


def init_single_process_world() -> None:
    """A one-rank gloo world on a free local port with Megatron's parallel state at TP = 1, for code that
    reads Megatron's groups outside a launch (in-process tests, benchmarks). Undo with
    `destroy_single_process_world`."""
    import socket

    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def destroy_single_process_world() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
