"""Placement: which launched ranks play which role, and every size that follows from it.

Built once from the arguments and the launched world size (`Placement.from_args`),
it is the only place that does rank arithmetic. Everything else asks it: the
argument checks (`arguments.validate_args`), the process groups
(`distributed.py`), the rollout engines (engine index and count), the RL phases
(data-parallel size and rank, which ranks contribute samples) and the weight
sync (who takes part in the broadcast).

Rank order: train ranks first, then (separate placement) the rollout ranks,
then the ranks of a standalone teacher:

    colocate  [[train, rollout]]   train = rollout = ranks 0..T-1; teacher ranks T..
    separate  []                   train 0..T-1, rollout T..T+R-1, teacher T+R..

A teacher listed in a colocate group with train, or given as a top-level
teacher_model without teacher ranks, lives on the train ranks and has no ranks
of its own.

Trainer parallelism follows Megatron's default rank order (tp-cp-ep-dp-pp, TP
fastest): within the train ranks, rank r has TP rank r % TP and data-parallel
rank (r // (TP * CP)) % DP. `distributed.init_megatron_parallel` checks that
Megatron agrees.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

ROLES = ("train", "rollout", "teacher")


class PlacementError(ValueError):
    """An impossible placement; the message is one line that names the options."""


@dataclass(frozen=True)
class EngineGroup:
    """The ranks of one vLLM role, cut into engines of `tp` consecutive ranks."""

    ranks: tuple[int, ...]
    tp: int

    @property
    def num_engines(self) -> int:
        return len(self.ranks) // self.tp

    def role_rank(self, rank: int) -> int:
        """This rank's index inside the role (its rank in the role's own world)."""
        return self.ranks.index(rank)

    def engine_index(self, rank: int) -> int:
        return self.role_rank(rank) // self.tp

    def is_engine_leader(self, rank: int) -> bool:
        """The first rank of its engine: the ranks of one TP engine hold identical outputs,
        and only the leader contributes them."""
        return self.role_rank(rank) % self.tp == 0


@dataclass(frozen=True)
class Placement:
    world_size: int
    colocated: bool  # train and rollout share ranks, taking turns
    teacher_colocated: bool  # the teacher lives on the train ranks
    train_ranks: tuple[int, ...]
    rollout: EngineGroup
    teacher: EngineGroup | None  # standalone teacher ranks; None when colocated or absent
    tp: int
    pp: int
    cp: int
    ep: int = 1  # expert parallelism (MoE): experts split over EP ranks of each stage, whole on each (ETP 1)

    # ------------------------------------------------------------- sizes ----
    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        return self.rollout.ranks

    @property
    def teacher_ranks(self) -> tuple[int, ...]:
        return self.teacher.ranks if self.teacher is not None else ()

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return len(self.train_ranks) // self.model_parallel

    def data_parallel_rank(self, rank: int) -> int:
        """Megatron's data-parallel rank of train rank `rank` (default order tp-cp-ep-dp-pp)."""
        return (self.train_ranks.index(rank) // (self.tp * self.cp)) % self.dp

    # ------------------------------------------------------------- roles ----
    def roles_of(self, rank: int) -> tuple[str, ...]:
        roles = tuple(role for role, ranks in (("train", self.train_ranks), ("rollout", self.rollout_ranks),
                                                ("teacher", self.teacher_ranks)) if rank in ranks)
        if self.teacher_colocated and "train" in roles:
            roles += ("teacher",)
        return roles

    def world_of(self, rank: int) -> tuple[str, tuple[int, ...]]:
        """The (name, launch ranks) of the world this rank initialises as its default group.

        vLLM and Megatron each assume they own the whole default world, so in separate
        placement every role gets a world of its own; colocated roles share one. A
        standalone teacher always has its own world.
        """
        if rank in self.teacher_ranks:
            return "teacher", self.teacher_ranks
        if self.colocated:
            return "train+rollout", self.train_ranks
        role = self.roles_of(rank)[0]
        return role, self.train_ranks if role == "train" else self.rollout_ranks

    @property
    def needs_cross_role_group(self) -> bool:
        """More than one world: objects and weights cross worlds over groups of their own."""
        return not self.colocated or bool(self.teacher_ranks)

    @property
    def weight_sync_members(self) -> tuple[int, ...]:
        """Separate placement: train rank 0 (the sender) and every rollout rank; () when colocated."""
        return () if self.colocated else (self.train_ranks[0],) + self.rollout_ranks

    def describe(self, rollout_backend: str = "vllm") -> str:
        """The layout printed at start-up; `rollout_backend` names the rollout's engines (vllm or hf)."""
        def span(ranks):
            return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"

        lines = [f"placement: {'colocate' if self.colocated else 'separate'}, {self.world_size} ranks"]
        lines.append(f"  train   ranks {span(self.train_ranks)}: TP={self.tp} PP={self.pp} CP={self.cp} "
                     f"DP={self.dp}" + (f" EP={self.ep}" if self.ep > 1 else "") + (", teacher colocated" if self.teacher_colocated else ""))
        lines.append(f"  rollout ranks {span(self.rollout_ranks)}: TP={self.rollout.tp}, "
                     f"{self.rollout.num_engines} {'vLLM' if rollout_backend == 'vllm' else 'HF'} engine(s)")
        if self.teacher is not None:
            lines.append(f"  teacher ranks {span(self.teacher_ranks)}: TP={self.teacher.tp}, "
                         f"{self.teacher.num_engines} vLLM engine(s)")
        return "\n".join(lines)

    # ------------------------------------------------------------- build ----
    @classmethod
    def from_args(cls, args, world_size: int) -> Placement:
        """The placement `args` ask for on `world_size` launched ranks; PlacementError if impossible.

        Reads colocate_groups, train_gpus / rollout_gpus / teacher_gpus (None: what the
        others leave), the trainer's TP/PP/CP and the vLLM roles' TP sizes.
        """
        groups = [list(group) for group in args.colocate_groups]
        colocated, teacher_colocated = _check_groups(groups)
        # A top-level teacher_model without teacher ranks is a teacher on the train ranks.
        teacher_colocated = teacher_colocated or bool(args.teacher_model and not args.teacher_gpus)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "rollout_tensor_parallel_size", "teacher_tensor_parallel_size"):
            if getattr(args, name, 1) < 1:
                raise PlacementError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        for name in ("train_gpus", "rollout_gpus"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise PlacementError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if args.teacher_gpus < 0:
            raise PlacementError(f"--teacher-gpus must be >= 0, got {args.teacher_gpus}")
        if teacher_colocated and args.teacher_gpus:
            raise PlacementError(f"teacher.gpus={args.teacher_gpus} with the teacher in colocate_groups: a "
                                 f"colocated teacher uses the train ranks; drop one of them")

        train, rollout, teacher = _rank_counts(args, world_size, colocated, teacher_colocated)
        counts = f"train.gpus={train}, rollout.gpus={rollout}, teacher.gpus={teacher}"
        if train < 1 or rollout < 1:
            raise PlacementError(f"placement leaves train.gpus={train}, rollout.gpus={rollout} of {world_size} "
                                 f"launched ranks; each role needs at least one")
        needed = (train if colocated else train + rollout) + teacher
        if needed > world_size:
            raise PlacementError(f"the {'colocated' if colocated else 'separate'} placement needs {needed} ranks "
                                 f"({counts}) but {world_size} were launched")
        if needed < world_size:
            raise PlacementError(f"{world_size} ranks were launched but the placement uses {needed} ({counts}); "
                                 f"idle ranks would hang")
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        if train % (tp * pp * cp):
            raise PlacementError(f"train.gpus={train} is not divisible by tensor_model_parallel_size * "
                                 f"pipeline_model_parallel_size * context_parallel_size = {tp}*{pp}*{cp}")
        ep = getattr(args, "expert_model_parallel_size", 1)
        if train % (pp * ep):
            raise PlacementError(f"train.gpus={train} is not divisible by pipeline_model_parallel_size * "
                                 f"expert_model_parallel_size = {pp}*{ep}: each pipeline stage's ranks hold the "
                                 f"experts split EP ways")
        if rollout % args.rollout_tensor_parallel_size:
            raise PlacementError(f"rollout.gpus={rollout} is not divisible by "
                                 f"rollout.tensor_parallel_size={args.rollout_tensor_parallel_size}")
        if teacher % args.teacher_tensor_parallel_size:
            raise PlacementError(f"teacher.gpus={teacher} is not divisible by "
                                 f"teacher.tensor_parallel_size={args.teacher_tensor_parallel_size}")

        train_ranks = tuple(range(train))
        rollout_ranks = train_ranks if colocated else tuple(range(train, train + rollout))
        first_teacher = max(train_ranks + rollout_ranks) + 1
        teacher_group = EngineGroup(tuple(range(first_teacher, first_teacher + teacher)),
                                    args.teacher_tensor_parallel_size) if teacher else None
        return cls(world_size, colocated, teacher_colocated, train_ranks,
                   EngineGroup(rollout_ranks, args.rollout_tensor_parallel_size), teacher_group, tp, pp, cp, ep)


def _check_groups(groups: list[list[str]]) -> tuple[bool, bool]:
    """(train and rollout colocated, teacher colocated with train); rejects unknown or odd groups."""
    seen = set()
    for group in groups:
        for role in group:
            if role not in ROLES:
                match = difflib.get_close_matches(role, ROLES, n=1, cutoff=0.5)
                hint = f" (did you mean '{match[0]}'?)" if match else ""
                raise PlacementError(f"colocate_groups: unknown role '{role}'{hint}")
            if role in seen:
                raise PlacementError(f"colocate_groups: role '{role}' is listed twice; a role lives in one group")
            seen.add(role)
        if len(group) > 1 and "train" not in group:
            raise PlacementError(f"colocate_groups {group}: roles share ranks only with train")
    with_train = next((group for group in groups if "train" in group), [])
    return "rollout" in with_train, "teacher" in with_train


def _rank_counts(args, world_size: int, colocated: bool, teacher_colocated: bool) -> tuple[int, int, int]:
    """(train, rollout, standalone teacher) rank counts; a count left unset takes what the others leave."""
    teacher = 0 if teacher_colocated else args.teacher_gpus
    if colocated:
        given = {role: getattr(args, f"{role}_gpus") for role in ("train", "rollout")}
        if given["train"] and given["rollout"] and given["train"] != given["rollout"]:
            raise PlacementError(f"colocate_groups [train, rollout]: members ask for different rank counts "
                                 f"(train.gpus={given['train']}, rollout.gpus={given['rollout']}); colocated "
                                 f"roles share the same ranks")
        shared = given["train"] or given["rollout"] or world_size - teacher
        return shared, shared, teacher
    if args.train_gpus is None and args.rollout_gpus is None:
        raise PlacementError("separate placement needs train.gpus or rollout.gpus (--train-gpus / --rollout-gpus)")
    train = args.train_gpus if args.train_gpus is not None else world_size - args.rollout_gpus - teacher
    rollout = args.rollout_gpus if args.rollout_gpus is not None else world_size - train - teacher
    return train, rollout, teacher
