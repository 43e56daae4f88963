"""The run: every role this rank plays and the state shared by the phases, declared up front.

`build_run` makes them in the measured order (vLLM engines before Megatron's
parallel state, docs/design.md) and only where the placement puts them: an
attribute is None on ranks that do not play that role.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl import distributed
from megarl.algorithms import KL_CONTROLLERS

if TYPE_CHECKING:  # the roles import vLLM or Megatron: only the ranks that play them load those
    from megarl.actor import Actor
    from megarl.critic import Critic
    from megarl.reference import Reference
    from megarl.rewards import RewardSpec
    from megarl.rollout import RolloutEngine
    from megarl.teacher import Teacher, TeacherEngine


@dataclass
class Run:
    args: argparse.Namespace
    context: distributed.DistContext
    hf_config: object  # the policy's transformers config
    tokenizer: object
    prompts: object  # data.ArithmeticPrompts or datasets.PromptDataset: batch(step, attempt)
    eval_sets: dict  # name -> list of prompts.Prompt
    reward: RewardSpec | None  # on rollout ranks (a reward model lives there)
    rollout: RolloutEngine | None  # on rollout ranks
    actor: Actor | None  # on train ranks
    critic: Critic | None  # on train ranks with --advantage-estimator gae
    reference: Reference | None  # on train ranks when a KL term needs one
    teacher: Teacher | TeacherEngine | None  # distillation: on the train ranks with --teacher-model
    # (a frozen Megatron model), or on the standalone teacher ranks (a vLLM engine)
    kl_controller: object | None  # an algorithms.KL_CONTROLLERS entry when --kl-coef > 0
    weight_sync: object  # a weight_sync.WEIGHT_SYNC_STRATEGIES entry
    weight_version: int = 0  # trainer -> rollout syncs so far, the same count on every rank (SPMD)
    timed_rewards: object | None = None  # scoring.TimedRewards on rollout ranks with --reward-timeout

    @property
    def is_main(self) -> bool:
        return self.context.rank == 0

    def trainables(self) -> dict:
        """The models this rank trains, by checkpoint name."""
        return {name: role for name, role in (("policy", self.actor), ("critic", self.critic)) if role is not None}

    @contextlib.contextmanager
    def train_roles_offloaded(self):
        """Colocated: the trainers' memory goes to host while the rollout generates
        (--offload-model / --offload-optimizer; nothing moves without them)."""
        if not self.context.placement.colocated:
            yield
            return
        for role in self.trainables().values():
            role.offload()
        try:
            yield
        finally:
            for role in self.trainables().values():
                role.onload()

    def state_dict(self) -> dict:
        """Run state outside the models: the KL controller and the data position."""
        return {"kl_controller": self.kl_controller.state_dict() if self.kl_controller is not None else None,
                "data": self.prompts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.kl_controller is not None and state.get("kl_controller"):
            self.kl_controller.load_state_dict(state["kl_controller"])
        if state.get("data"):
            self.prompts.load_state_dict(state["data"])


def build_run(args, context: distributed.DistContext) -> Run:
    from transformers import AutoConfig, AutoTokenizer

    from megarl.data import eval_prompts, prompt_source
    from megarl.rewards import default_system_prompt
    from megarl.weight_sync import build_weight_sync

    placement, rank = context.placement, context.rank
    hf_config = AutoConfig.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    system_prompt = args.system_prompt if args.system_prompt is not None else default_system_prompt(args.reward)
    rollout = actor = critic = reference = teacher = None
    if context.is_rollout:  # engines before Megatron's parallel state (the measured order)
        from megarl.rollout import RolloutEngine

        rollout = RolloutEngine(args, placement.rollout, rank)
    if rank in placement.teacher_ranks:
        from megarl.teacher import TeacherEngine

        teacher = TeacherEngine(args, placement.teacher, rank)
    distributed.init_megatron_parallel(context, args.seed)
    if context.is_train:
        from megarl.actor import Actor

        actor = Actor(args, hf_config)
        if args.advantage_estimator == "gae":
            from megarl.critic import Critic

            critic = Critic(args, hf_config)
        if args.kl_coef > 0:
            from megarl.reference import Reference

            reference = Reference(args, hf_config)
        if args.teacher_model:
            from megarl.teacher import Teacher, TeacherEngine

            teacher = Teacher(args)
    kl_controller = None
    if args.kl_coef > 0:
        kl_controller = KL_CONTROLLERS["fixed"](args.kl_coef) if args.kl_controller == "fixed" else \
            KL_CONTROLLERS["adaptive"](args.kl_coef, args.kl_target, args.kl_horizon)
    reward, timed_rewards = _build_reward(args) if context.is_rollout else (None, None)
    return Run(
        args=args, context=context, hf_config=hf_config, tokenizer=tokenizer,
        prompts=prompt_source(args, tokenizer, system_prompt or None),
        eval_sets=eval_prompts(args, tokenizer, system_prompt or None) if args.eval_datasets else {},
        reward=reward, rollout=rollout, actor=actor, critic=critic, reference=reference, teacher=teacher,
        kl_controller=kl_controller, timed_rewards=timed_rewards,
        weight_sync=build_weight_sync(context, int(args.sync_bucket_mb * 2**20)))


def _build_reward(args):
    """The reward (a rollout rank scores its samples) and, with --reward-timeout, its worker processes;
    a code reward's sandbox pool gets this rank's share of --sandbox-memory-budget-mb."""
    from megarl.arguments import loaded_plugins
    from megarl.rewards import build_reward
    from megarl.scoring import TimedRewards, sandbox_memory_budget_mb

    reward = build_reward(args.reward, args.reward_model)
    budget = sandbox_memory_budget_mb(args)
    if args.reward_timeout > 0:
        return reward, TimedRewards(reward, args.reward_workers, args.reward_timeout, loaded_plugins(), budget)
    if budget is not None:
        from megarl.rewards.code import configure_pool

        configure_pool(budget)
    return reward, None
