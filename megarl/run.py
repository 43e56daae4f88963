"""The run: every role this rank plays and the state shared by the phases, declared up front.

`build_run` makes them in the measured order (vLLM engines before Megatron's
parallel state, docs/design.md) and only where the placement puts them: an
attribute is None on ranks that do not play that role. `load_inputs` reads and checks
what comes from files (model directories, tokenizer, datasets) first, before any
process group or engine, so that a bad input fails at once with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megarl import distributed, startup_gc
from megarl.algorithms import KL_CONTROLLERS
from megarl.errors import ConfigError

if TYPE_CHECKING:  # the roles import vLLM or Megatron: only the ranks that play them load those
    from megarl.actor import Actor
    from megarl.critic import Critic
    from megarl.hf_rollout import HfRolloutEngine
    from megarl.reference import BaseOfPolicy, Reference
    from megarl.rewards import RewardSpec
    from megarl.rollout import RolloutEngine
    from megarl.teacher import Teacher, TeacherEngine
    from megarl.teacher_server import TeacherServer


@dataclass
class Activity:
    """What this rank is doing: the 1-based step and its phase (or "evaluate", "checkpoint save", ...),
    for the line a rank prints when it fails or stops because another rank died (train.main)."""
    step: int = 0
    phase: str = "start-up"

    def __str__(self) -> str:
        return f"step {self.step}, {self.phase}" if self.step else self.phase


@dataclass
class Run:
    args: argparse.Namespace
    context: distributed.DistContext
    hf_config: object  # the policy's transformers config
    tokenizer: object
    prompts: object  # data.ArithmeticPrompts or datasets.PromptDataset: batch(step, attempt)
    eval_sets: dict  # name -> list of prompts.Prompt
    reward: RewardSpec | None  # on rollout ranks (a reward model lives there)
    rollout: RolloutEngine | HfRolloutEngine | None  # on rollout ranks (--rollout-backend)
    actor: Actor | None  # on train ranks
    critic: Critic | None  # on train ranks with --advantage-estimator gae
    reference: Reference | BaseOfPolicy | None  # on train ranks when a KL term needs one (LoRA: the policy's base)
    teacher: Teacher | None  # colocated distillation teacher: a frozen Megatron model on the train ranks
    teacher_engine: TeacherEngine | None  # standalone distillation teacher: a vLLM engine on the teacher ranks
    teacher_server: TeacherServer | None  # --teacher-server's client, on launch rank 0 (the rank that asks)
    kl_controller: object | None  # an algorithms.KL_CONTROLLERS entry when --kl-coef > 0
    weight_sync: object  # a weight_sync.WEIGHT_SYNC_STRATEGIES entry
    weight_version: int = 0  # trainer -> rollout syncs so far, the same count on every rank (SPMD)
    timed_rewards: object | None = None  # scoring.TimedRewards on rollout ranks with --reward-timeout
    activity: Activity = field(default_factory=Activity)
    episodes: object | None = None  # multiturn.EpisodeSettings on rollout ranks with --tools (its ToolRunner)
    stream: object | None = None  # streaming.GenerationStream on rollout ranks with --max-staleness (train.py)

    @property
    def teacher_engine_placed(self) -> bool:
        """The launch has standalone teacher ranks (`teacher_engine` is set on those ranks only)."""
        return self.context.placement.teacher is not None

    @property
    def is_main(self) -> bool:
        return self.context.rank == 0

    def trainables(self) -> dict:
        """The models this rank trains, by checkpoint name."""
        return {name: role for name, role in (("policy", self.actor), ("critic", self.critic)) if role is not None}

    @contextlib.contextmanager
    def rollout_turn(self):
        """Colocated: the rollout engine has the devices for the duration. The trainers' memory goes to
        host first (--offload-model / --offload-optimizer; nothing moves without them), then the engine
        wakes what still sleeps (the KV cache, after a weight sync woke only the weights), and at the
        end it sleeps and the trainers come back. So the KV cache and the trainers' states never share
        the device. Separate placement: nothing to do."""
        if not self.context.placement.colocated:
            yield
            return
        if getattr(self.rollout, "weights_discarded", False):
            # --rollout-sleep-level 2 discarded the engine's weights at the end of its last turn and no sync
            # came since (an evaluation's turn, then the step's): the trainer's, re-sent while it is on the
            # device. The same weights as the last sync's: not a new weight version.
            self.weight_sync.sync(self.actor, self.rollout)
        for role in self.trainables().values():
            role.offload()
        try:
            if self.rollout is not None:
                self.rollout.onload()
            yield
        finally:
            if self.rollout is not None:
                self.rollout.offload()
            for role in self.trainables().values():
                role.onload()

    def state_dict(self) -> dict:
        """Run state outside the models: the KL controller, the data position and the weight version (what the
        staleness of --async-generation's in-flight samples is measured against)."""
        return {"kl_controller": self.kl_controller.state_dict() if self.kl_controller is not None else None,
                "data": self.prompts.state_dict(), "weight_version": self.weight_version}

    def load_state_dict(self, state: dict) -> None:
        self.weight_version = state.get("weight_version", self.weight_version)
        if self.kl_controller is not None and state.get("kl_controller"):
            self.kl_controller.load_state_dict(state["kl_controller"])
        if state.get("data"):
            self.prompts.load_state_dict(state["data"])


@dataclass
class Inputs:
    """What a run reads from files before any process group or engine exists (`load_inputs`)."""
    hf_config: object
    tokenizer: object
    prompts: object
    eval_sets: dict
    teacher_server: object | None = None  # --teacher-server's client, its checks passed (teacher_server.connect)


def load_inputs(args) -> Inputs:
    """Read and check the model directories, the tokenizer and the datasets, before any engine or process
    group starts and before anything is written: a bad input fails here with one line (ConfigError)."""
    from transformers import AutoTokenizer

    from megarl.data.sources import eval_prompts, prompt_source
    from megarl.rewards import default_system_prompt

    hf_config = check_model_dir("--model", args.model)
    # The other checkpoints that are loaded: by Megatron (safetensors only) or by vLLM alone.
    for flag, path, used, megatron in (
            ("--rollout-model", args.rollout_model, True, False),
            ("--ref-model", args.ref_model, args.kl_coef > 0, True),
            ("--critic-model", args.critic_model, args.advantage_estimator == "gae", True),
            ("--teacher-model", args.teacher_model, bool(args.teacher_model), True),
            ("teacher.model", args.standalone_teacher_model, bool(args.standalone_teacher_model), False)):
        if used and path != args.model:
            check_model_dir(flag, path, megatron)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, TypeError, ...
        raise ConfigError(f"--tokenizer {args.tokenizer}: cannot load a tokenizer "
                          f"({_first_line(error)})") from None
    overridden = (args.rollout_engine_kwargs.get("hf_overrides") or {}).get("max_position_embeddings")
    limit = overridden or getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    asked = args.rollout_engine_kwargs.get("max_model_len")
    where = f"--model {args.model}'s max_position_embeddings={limit}" \
        f"{' (as rollout.engine_kwargs.hf_overrides sets it)' if overridden else ''}"
    if limit and asked and asked > limit:  # vLLM's own check fails at engine start with a validation traceback
        raise ConfigError(f"rollout.engine_kwargs.max_model_len={asked} (vLLM's max_model_len) is over {where}")
    needed = args.max_prompt_length + args.max_new_tokens  # the rollout engine's max_model_len when not given
    if limit and not asked and args.rollout_backend == "vllm" and needed > limit:
        raise ConfigError(f"--max-prompt-length {args.max_prompt_length} + --max-new-tokens {args.max_new_tokens} = "
                          f"{needed} tokens (the rollout engine's max_model_len) is over {where}")
    if args.chat_template is not None:  # rendering and HF exports (save_pretrained writes it) use it
        tokenizer.chat_template = args.chat_template
    if args.chat_template_kwargs:  # every rendering (prompts, episodes' turns) goes through this method
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **args.chat_template_kwargs)
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(f"--tokenizer {args.tokenizer} has {len(tokenizer)} tokens but --model {args.model} has "
                          f"vocab_size={hf_config.vocab_size} (config.json): the tokenizer is not this model's")
    system_prompt = args.system_prompt if args.system_prompt is not None else default_system_prompt(args.reward)
    prompts = prompt_source(args, tokenizer, system_prompt or None)
    if getattr(prompts, "dropped", 0) and int(os.environ.get("RANK", "0")) == 0:
        print(f"megarl: {prompts.dropped} training rows are over --max-prompt-length {args.max_prompt_length} and "
              f"left out (--truncation drop); {len(prompts)} remain", flush=True)
    if args.train_epochs is not None:  # the run's length follows from the data set's
        from megarl.arguments import resolve_epochs

        resolve_epochs(args, len(prompts))
    teacher_server = None
    if args.teacher_server:  # the server answers, serves the top K and shares the student's tokenizer
        from megarl.teacher_server import connect

        teacher_server = connect(args, tokenizer, hf_config.vocab_size)
    return Inputs(hf_config, tokenizer, prompts,
                  eval_prompts(args, tokenizer, system_prompt or None) if args.eval_datasets else {},
                  teacher_server)


def check_model_dir(flag: str, path: str, megatron: bool = True):
    """An HF checkpoint directory megarl can load: its config (a supported family) and its weights, in
    safetensors where Megatron loads them (vLLM alone also reads .bin and .pt); returns the config."""
    from megarl.models.convert import check_checkpoint_tensors, open_checkpoint
    from megarl.models.families import family_of, load_hf_config
    from megarl.models.megatron_gpt import check_supported

    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory")
    try:
        config = load_hf_config(path)
        check_supported(config, family_of(config))
        if megatron or not any(name.endswith((".bin", ".pt")) for name in os.listdir(path)):
            # a critic's checkpoint may carry a value head instead of lm_head (critic.attach_value_head)
            check_checkpoint_tensors(config, open_checkpoint(path, config), output_layer=flag != "--critic-model")
    except Exception as error:  # noqa: BLE001 - OSError, ValueError, safetensors' errors: all one line
        raise ConfigError(f"{flag} {path}: {_first_line(error).removeprefix(f'{path}: ')}") from None
    return config


def _first_line(error: BaseException) -> str:
    """The error's first line, or its first two where the first only announces the second (transformers'
    config validation: "Class validation error for validator 'x':" then the cause)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def build_run(args, context: distributed.DistContext, inputs: Inputs | None = None,
              activity: Activity | None = None) -> Run:
    """The roles of this rank; `inputs` from `load_inputs` (read here when not given); `activity`: the
    caller's, when it reports failures (train.main)."""
    from megarl.weight_sync import build_weight_sync

    inputs = inputs or load_inputs(args)
    placement, rank = context.placement, context.rank
    hf_config, tokenizer = inputs.hf_config, inputs.tokenizer
    rollout = actor = critic = reference = teacher = teacher_engine = None
    if context.is_rollout:  # engines before Megatron's parallel state (the measured order)
        if args.rollout_backend == "hf":  # transformers: no vLLM on this path (megarl/hf_rollout.py)
            from megarl.hf_rollout import HfRolloutEngine as Engine
        else:
            from megarl.rollout import RolloutEngine as Engine
        rollout = Engine(args, placement.rollout, rank, colocated=placement.colocated)
    if rank in placement.teacher_ranks:
        from megarl.teacher import TeacherEngine

        teacher_engine = TeacherEngine(args, placement.teacher, rank)
    distributed.init_megatron_parallel(context, args.seed)
    if context.is_train:
        _choose_cpu_gemm(args, context, hf_config)
        from megarl.actor import Actor

        actor = Actor(args, hf_config)
        if args.advantage_estimator == "gae":
            from megarl.critic import Critic

            critic = Critic(args, hf_config)
        if args.kl_coef > 0:
            from megarl.reference import build_reference

            reference = build_reference(args, hf_config, actor)
        if args.teacher_model:
            from megarl.teacher import build_teacher

            teacher, reference = build_teacher(args, actor, reference)
    kl_controller = None
    if args.kl_coef > 0:
        kl_controller = KL_CONTROLLERS["fixed"](args.kl_coef) if args.kl_controller == "fixed" else \
            KL_CONTROLLERS["adaptive"](args.kl_coef, args.kl_target, args.kl_horizon)
    reward, timed_rewards = _build_reward(args, context.placement.colocated) if context.is_rollout else (None, None)
    episodes = None
    if (args.tools or args.interaction) and context.is_rollout:
        from megarl.multiturn import EpisodeSettings
        from megarl.tools import ToolRunner, environments  # noqa: F401  (environments registers gym:<name>)
        from megarl.tools.interactions import INTERACTIONS

        interaction = INTERACTIONS[args.interaction](reward) if args.interaction else None
        episodes = EpisodeSettings(ToolRunner(args.tools, args.tool_workers, args.tool_timeout), tokenizer,
                                   args.max_turns, args.tool_parser, interaction)
    # Every role built before the first group that spans them (the weight sync's) waits for the others.
    distributed.wait_for_every_rank(context, args.startup_timeout_minutes)
    startup_gc.resume_full_collections()  # the run is built (a no-op where the start did not defer them)
    return Run(
        args=args, context=context, hf_config=hf_config, tokenizer=tokenizer,
        prompts=inputs.prompts, eval_sets=inputs.eval_sets,
        reward=reward, rollout=rollout, actor=actor, critic=critic, reference=reference, teacher=teacher,
        teacher_engine=teacher_engine, teacher_server=inputs.teacher_server if rank == 0 else None,
        kl_controller=kl_controller, timed_rewards=timed_rewards,
        activity=activity or Activity(), episodes=episodes,
        weight_sync=build_weight_sync(context, int(args.sync_bucket_mb * 2**20)))


def _choose_cpu_gemm(args, context: distributed.DistContext, hf_config) -> None:
    """--cpu-gemm on CPU trainer ranks (every train rank of the default world agrees; megarl/cpu_gemm.py) and,
    with the library chosen and packed rows (--padding-free: the paths are their sequences'), which attention
    path each sequence length takes for each attention shape per rank of the models a train rank builds
    (megarl/models/attention_paths.py); on GPU the GEMMs are cuBLAS's."""
    from megarl import accelerator, cpu_gemm
    from megarl.models import attention_paths

    if accelerator.ON_CUDA:
        return
    backend = cpu_gemm.choose(args.cpu_gemm)
    if context.rank == 0:
        print(f"megarl: CPU fp32 GEMMs through {'oneDNN' if backend == 'onednn' else 'torch'} "
              f"({cpu_gemm.decided_by()})", flush=True)
    if not args.padding_free:
        return
    for model, (heads, groups, dim) in trained_attention_shapes(args, hf_config).items():
        pieces, decided_by = attention_paths.choose(heads, groups, dim)
        if context.rank == 0:
            whose = "" if model == "policy" else f" ({model}: {heads} heads in {groups} groups of {dim})"
            print(f"megarl: packed attention on CPU{whose}: {attention_paths.describe(pieces)} ({decided_by})",
                  flush=True)


def trained_attention_shapes(args, hf_config) -> dict[str, tuple[int, int, int]]:
    """{model: (query heads, query groups, head size) per tensor-parallel rank} of each attention shape among
    the models a train rank runs: the policy's (the critic and the reference share it) and a colocated
    teacher's where it differs (a teacher of another size would otherwise take the default pieces)."""
    from megarl.models.megatron_gpt import head_dim

    tp = args.tensor_model_parallel_size
    configs = {"policy": hf_config}
    if args.teacher_model:
        from megarl.models.families import load_hf_config

        configs["teacher"] = load_hf_config(args.teacher_model)
    shapes = {}
    for model, config in configs.items():
        shape = (config.num_attention_heads // tp, max(1, config.num_key_value_heads // tp), head_dim(config))
        if shape not in shapes.values():
            shapes[model] = shape
    return shapes


def _build_reward(args, colocated: bool):
    """The reward (a rollout rank scores its samples) and, with --reward-timeout, its worker processes;
    a code reward's sandbox pool gets this rank's share of --sandbox-memory-budget-mb."""
    from megarl.plugins import loaded_plugins
    from megarl.rewards import build_reward
    from megarl.rewards.scoring import TimedRewards, sandbox_memory_budget_mb, tool_sandbox_limits

    # The reward model on this rollout rank's device; colocated with the trainer and vLLM it waits in host
    # memory between scoring calls (a GPU-only move, megarl.accelerator; a no-op on CPU).
    reward = build_reward(args.reward, args.reward_model, batch_size=args.reward_model_micro_batch_size,
                          max_length=args.reward_model_max_length,
                          offload=colocated)
    from megarl.rewards import swift_rules

    swift_rules.configure_from_args(args)  # ms-swift's reward parameters (workers get them at start)
    budget = sandbox_memory_budget_mb(args)
    if args.reward_timeout > 0:
        timed = TimedRewards(reward, args.reward_workers, args.reward_timeout, loaded_plugins(), budget)
        if budget is not None and tool_sandbox_limits(args):  # the python tool's programs run in this process
            from megarl.rewards.code import configure_pool

            configure_pool(budget)
        return reward, timed
    if budget is not None:
        from megarl.rewards.code import configure_pool

        configure_pool(budget)
    return reward, None
