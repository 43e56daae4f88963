"""verl's PPO trainer configuration (ppo_trainer.yaml and ppo_megatron_trainer.yaml, nested YAML) and the
Hydra-style overrides verl users launch with (`actor_rollout_ref.actor.optim.lr=1e-6 trainer.total_epochs=15`,
`+key=value` to add, `++key=value` to add or replace, `~key` to delete), read as verl means them.

Semantics that differ from megarl's own and are applied here:
  * the hybrid engine: actor, rollout and reference share all `trainer.nnodes * trainer.n_gpus_per_node`
    ranks (colocated);
  * `data.train_batch_size` counts prompts; `actor.ppo_mini_batch_size` counts prompts too (times
    `rollout.n` samples); `ppo_micro_batch_size` is over all ranks (deprecated), `..._per_gpu` per rank;
  * `trainer.total_epochs` passes over the data set (steps per epoch = rows // train_batch_size, verl's
    drop_last), unless `trainer.total_training_steps` is set;
  * LR warm-up and the minimum LR as ratios (`lr_warmup_steps_ratio` of all optimizer steps, used when
    `lr_warmup_steps` is -1 or unset; `min_lr_ratio` of the peak LR); AdamW weight decay 0.01;
  * KL: `algorithm.use_kl_in_reward` with `kl_penalty` and `kl_ctrl` (in the rewards), or
    `actor.use_kl_loss` with `kl_loss_coef` and `kl_loss_type` (in the loss); verl's `kl` is megarl's k1.
    A file from before `use_kl_in_reward` existed (no such key, no `use_kl_loss`) penalises in the reward;
  * PPO's dual clip at `clip_ratio_c` (3.0) is always on;
  * rewards: `reward_model.enable` scores with the reward model alone; otherwise verl's rule rewards, routed
    by each row's `data_source` (megarl's `verl_data_source` reward), and no system prompt is added (verl's
    prepared data carry their instructions in the prompt).
"""

from __future__ import annotations

import re

import yaml

from megarl.config_formats.common import (
    DEFAULT, IGNORED, INFORMS, LORA_LAYOUT, VIRTUAL_PIPELINE, Context, Rule, Translation, apply_table, as_list, closest,
    custom, expand_path, flatten, ignore, informs, lora_targets, lookup, routing_replay_mode, rslora_alpha, to,
)
from megarl.errors import ConfigError

A, R, F, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model", \
    "actor_rollout_ref.ref"
KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "mse", "k2": "k2", "low_var_kl": "low_var_kl",
            "k3": "k3", "full": "full"}
LOSS_AGG = {"token-mean": "token_level", "seq-mean-token-mean": "sample_level",
            "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}
ESTIMATORS = ("gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo")
INF = informs()


def _paths(value):
    return [expand_path(str(p), "data.train_files") for p in as_list(value)]


def _val_files(value, ctx):
    files = as_list(value)
    return {"eval_dataset": [f"val{i if len(files) > 1 else ''}={expand_path(str(p), 'data.val_files')}"
                             for i, p in enumerate(files)]} if files else {}


# vLLM engine arguments about images and video (some of older vLLM versions): nothing to a text-only run.
VLLM_MULTIMODAL = ("disable_mm_preprocessor_cache", "mm_processor_cache_gb", "limit_mm_per_prompt", "mm_processor_kwargs",
                   "mm_encoder_tp_mode", "skip_mm_profiling")

# verl's tool classes (verl/tools/) with a megarl counterpart: the tool megarl runs in their place.
VERL_TOOLS = {"Gsm8kTool": "calc_gsm8k_reward", "SandboxFusionTool": "python"}
VERL_INTERACTIONS = {"Gsm8kInteraction": "retry"}


def _verl_yaml_list(path, key: str, section: str, ctx) -> list[dict]:
    """The `section` list of a verl tool/interaction YAML (a one-line error naming the key and file)."""
    from megarl.config_formats.common import expand_path

    path = expand_path(path, key)
    try:
        with open(path) as handle:
            entries = (yaml.safe_load(handle) or {}).get(section)
    except (OSError, yaml.YAMLError, AttributeError) as error:
        ctx.fail(key, f"{path}: cannot read it as verl's {section} YAML ({str(error).splitlines()[0]})")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "class_name" in e for e in entries):
        ctx.fail(key, f"{path}: verl's {section} YAML is a list `{section}:` of entries with a class_name")
    return entries


def _verl_tools(path, key: str, ctx) -> dict:
    """verl's tool config: each tool class as megarl's tool of the same job (VERL_TOOLS); a class without
    one stops in one line. megarl's tools keep their own schemas, except calc_gsm8k_reward (verl's)."""
    if not path:
        return {}
    names = []
    for entry in _verl_yaml_list(path, key, "tools", ctx):
        cls = entry["class_name"].rsplit(".", 1)[-1]
        if cls not in VERL_TOOLS:
            ctx.fail(key, f"tool class {entry['class_name']} has no megarl counterpart (megarl maps "
                          f"{', '.join(f'{k} -> {v}' for k, v in VERL_TOOLS.items())}; register a tool with "
                          f"--external-plugins and name it in --tools)")
        names.append(VERL_TOOLS[cls])
    return {"tools": ",".join(dict.fromkeys(names))}


def _verl_interaction(path, key: str, ctx) -> dict:
    """verl's interaction config: one interaction, as megarl's of the same job (VERL_INTERACTIONS)."""
    if not path:
        return {}
    entries = _verl_yaml_list(path, key, "interaction", ctx)
    classes = [entry["class_name"].rsplit(".", 1)[-1] for entry in entries]
    unknown = [cls for cls in classes if cls not in VERL_INTERACTIONS]
    if unknown or len(classes) != 1:
        ctx.fail(key, f"interaction classes {classes}: megarl runs one interaction per run and maps "
                      f"{', '.join(f'{k} -> {v}' for k, v in VERL_INTERACTIONS.items())}")
    return {"interaction": VERL_INTERACTIONS[classes[0]]}


def _megatron_backend(source: dict) -> bool:
    """verl's Megatron back-end (ppo_megatron_trainer.yaml sets actor.strategy megatron; its recipes set
    actor.megatron.* keys); the FSDP back-end otherwise. A few keys mean something in one back-end only."""
    return source.get(f"{A}.strategy") == "megatron" or source.get("model_engine") == "megatron" or \
        any(key.startswith(f"{A}.megatron.") for key in source)


def _kl_name(key):
    def convert(value, ctx):
        if value not in KL_NAMES:
            ctx.fail(key, f"{value!r} has no megarl KL estimator (verl names megarl reads: {', '.join(KL_NAMES)})")
        return {}
    return custom(convert, "kl -> k1; abs, mse, low_var_kl, k1, k2, k3, full as named", dest="kl_estimator")


def _choice(key, allowed, dest, names=None):
    def convert(value, ctx):
        if value is None:  # null: unset (verl's deprecated names default to it)
            return {}
        if value not in allowed:
            ctx.fail(key, f"{value!r} has no megarl counterpart (megarl reads: {', '.join(allowed)})")
        return {dest: (names or {}).get(value, value)}
    shown = ", ".join(f"{a} -> {(names or {}).get(a, a)}" if (names or {}).get(a, a) != a else a for a in allowed)
    return custom(convert, shown, dest=dest)


def _truthy(value):
    return bool(value)


HYBRID_ENGINE = ("the hybrid engine is megarl's colocated placement; so is false with rollout.name trtllm "
                 "(TensorRT-LLM's colocated mode: the engine in processes of its own on the training GPUs)")


def _hybrid_engine(value, ctx) -> dict:
    """hybrid_engine: true, or false with TensorRT-LLM (whose colocated mode needs it off), is megarl's colocated
    placement: the roles share the devices and take turns. Another false (a rollout pool of its own) stops."""
    if not value and ctx.get(f"{R}.name") != "trtllm":
        ctx.fail("actor_rollout_ref.hybrid_engine", f"megarl supports only: {HYBRID_ENGINE}")
    return {}


# verl's own rule scorers (verl/utils/reward_score/), named as a custom reward function file, that megarl has.
VERL_SCORERS = {"gsm8k.py": "gsm8k"}


def _verl_scorer(path, name=None) -> str | None:
    """megarl's reward for a custom_reward_function that is one of verl's own scorer modules (its
    compute_score), or None."""
    if not isinstance(path, str) or name not in (None, "compute_score"):
        return None
    directory, _, file = path.replace("\\", "/").rpartition("/")
    return VERL_SCORERS.get(file) if directory.endswith("verl/utils/reward_score") else None


def _max_samples(value, key: str, ctx) -> int:
    """verl's data.*_max_samples: a positive N keeps N rows; -1 (its default), 0 or null keeps every row."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        ctx.fail(key, f"{value!r}: expected a whole number of rows (-1: every row)")
    return max(value, 0)


def _nonempty(value):
    return value not in (None, {}, [], "", 0, False)


EXCLUDE = "excluding modules: name the ones that get adapters in target_modules"
PERF = "performance only: megarl's forward-only passes use micro_batch_size"
FSDP = "FSDP settings: megarl trains with Megatron-core"

TABLE: dict[str, Rule] = {
    # data
    "data.tokenizer": to("tokenizer", expand_path),
    "data.train_files": to("train_data", _paths),
    "data.val_files": custom(_val_files),
    "data.prompt_key": to("prompt_key"),
    "data.prompt_id_key": to("prompt_id_key"),
    "data.max_prompt_id_length": ignore("the id is read as it is, not tokenized"),
    "data.reward_fn_key": ignore("data_source routes the rule rewards", refuse_if=lambda v: v != "data_source",
                                 refusal="megarl routes verl's rule rewards by data_source only"),
    "data.max_prompt_length": to("max_prompt_length"),
    "data.max_response_length": to("max_new_tokens"),
    "data.train_batch_size": to("prompts_per_step"),
    "data.val_batch_size": ignore("megarl evaluates each set in one generate call (vLLM batches it), as verl "
                                  "does since it deprecated val_batch_size"),
    "data.truncation": _choice("data.truncation", ("error", "left", "right"), "truncation"),
    "data.filter_overlong_prompts": custom(lambda v, ctx: {"truncation": "drop"} if v else {},
                                           "true: `truncation` drop (over-long rows left out, before data.truncation "
                                           "would apply)"),
    "data.filter_overlong_prompts_workers": ignore("data loading workers"),
    "data.return_raw_input_ids": ignore("megarl's reward model re-renders the conversation itself"),
    "data.return_raw_chat": ignore("megarl keeps each row's chat"),
    "data.return_full_prompt": ignore("megarl keeps each row's chat"),
    "data.shuffle": ignore("megarl shuffles the rows every epoch (seeded)"),
    "data.validation_shuffle": ignore("evaluation sets are read in file order"),
    "data.seed": ignore("one --seed seeds the data order"),
    "data.dataloader_num_workers": ignore("data loading workers"),
    "data.use_shm": ignore("shared-memory model loading"),
    "data.trust_remote_code": ignore("no remote code"),
    "data.image_key": ignore("multimodal data (megarl is text only)"),
    "data.image_patch_size": ignore("multimodal data (megarl is text only)"),
    "data.train_max_samples": custom(lambda v, ctx: {"train_max_samples":
                                                         _max_samples(v, "data.train_max_samples", ctx)},
                                     "N rows drawn with --seed (verl: with data.seed when data.shuffle)"),
    "data.val_max_samples": custom(lambda v, ctx: {"eval_max_samples":
                                                       _max_samples(v, "data.val_max_samples", ctx)},
                                   "the first N prompts of each evaluation set (verl draws N when data.shuffle)"),
    "data.video_key": ignore("multimodal data (megarl is text only)"),
    "data.return_multi_modal_inputs": ignore("multimodal data (megarl is text only)"),
    "data.custom_cls.*": ignore("the built-in dataset class", refuse_if=_nonempty,
                                refusal="a custom dataset class: use a megarl preprocessor (--preprocessor)"),
    "data.sampler.*": ignore("the built-in sampler", refuse_if=_nonempty,
                             refusal="a custom sampler has no megarl counterpart"),
    "data.datagen.*": ignore("dynamic data generation", refuse_if=_nonempty),
    "data.apply_chat_template_kwargs.*": INF,
    "data.apply_chat_template_kwargs": ignore("none given"),
    "data.tool_config_path": custom(lambda v, ctx: _verl_tools(v, "data.tool_config_path", ctx),
                                    "verl's tool-config YAML: its tool classes as megarl's tools"),
    # the model
    f"{F}.path": to("model", expand_path),
    f"{F}.tokenizer_path": to("tokenizer", expand_path),
    f"{F}.external_lib": ignore("none", refuse_if=_nonempty,
                                refusal="external_lib registers models with HF; megarl's families are built in"),
    f"{F}.override_config": ignore("empty"),
    # The model's positions as the engine sees them (verl's recipes raise them to prompt + response): vLLM's
    # hf_overrides. Megatron's rotary embedding has no table to size.
    f"{F}.override_config.model_config.max_position_embeddings": custom(
        lambda v, ctx: {"rollout_engine_kwargs.hf_overrides": {"max_position_embeddings": v}},
        "vLLM's hf_overrides (Megatron's rotary embedding needs no table)", dest="rollout_engine_kwargs"),
    f"{F}.override_config.*": ignore("empty", refuse_if=_nonempty,
                                     refusal="megarl overrides only model_config.max_position_embeddings (the "
                                             "engine's positions); change the model in its config.json"),
    f"{F}.enable_gradient_checkpointing": custom(
        lambda v, ctx: {"recompute_granularity": "full", "recompute_method": "uniform",
                        "recompute_num_layers": 1} if v and not _megatron_backend(ctx.source) else {},
        "FSDP back-end: recompute every layer (the Megatron back-end reads override_transformer_config)"),
    f"{F}.enable_activation_offload": ignore("off", refuse_if=_truthy),
    f"{F}.use_remove_padding": custom(lambda v, ctx: {} if _megatron_backend(ctx.source) else {"padding_free": bool(v)},
                                      "FSDP back-end: `padding_free` (the Megatron back-end reads "
                                      "actor.megatron.use_remove_padding)"),
    f"{F}.use_fused_kernels": ignore("megarl picks its kernels (--kernels)"),
    f"{F}.fused_kernel_options.*": ignore("megarl picks its kernels (--kernels)"),
    f"{F}.trust_remote_code": ignore("no remote code"),
    f"{F}.use_shm": ignore("shared-memory model loading"),
    f"{F}.use_liger": ignore("megarl picks its kernels (--kernels)"),
    f"{F}.custom_chat_template": to("chat_template"),
    f"{F}.custom_chat_template_file": custom(lambda v, ctx: {"chat_template": f"@{expand_path(v)}"} if v else {},
                                             "the template read from the file", dest="chat_template"),
    # LoRA: the FSDP back-end's PEFT keys (model.lora_rank ...) and the Megatron back-end's (model.lora.*),
    # read by _lora; at rank 0 they are ignored.
    **{f"{F}.{key}": INF for key in ("lora_rank", "lora_alpha", "target_modules", "lora_dropout", "use_rslora",
                                     "lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules", "lora.type")},
    f"{F}.lora_adapter_path": to("lora_load", note="the trained PEFT adapter the LoRA run starts from"),
    f"{F}.lora.adapter_path": to("lora_load", note="the trained PEFT adapter the LoRA run starts from"),
    f"{F}.exclude_modules": ignore("none", refuse_if=_nonempty, refusal=EXCLUDE),
    f"{F}.lora.exclude_modules": ignore("none", refuse_if=_nonempty, refusal=EXCLUDE),
    f"{F}.use_dora": ignore("off", refuse_if=_truthy, refusal="DoRA has no megarl counterpart (plain LoRA)"),
    f"{F}.lora_bias": ignore("none: the biases stay frozen", refuse_if=lambda v: v not in (None, "none", False),
                             refusal="trainable biases: megarl trains the adapters alone"),
    f"{F}.lora.merge": ignore("megarl always syncs the merged weights (W + scale * B A) into the engines"),
    f"{F}.lora.dropout_position": ignore("pre: dropout on the adapters' input", refuse_if=lambda v: v != "pre",
                                         refusal="dropout after the low-rank projection: megarl's is on its input"),
    f"{F}.lora.lora_A_init_method": ignore("megarl initialises A as PEFT does (uniform +-1/sqrt(in))"),
    f"{F}.lora.lora_B_init_method": ignore("zero", refuse_if=lambda v: v != "zero",
                                           refusal="B must start at zero (the run starts from the base model)"),
    f"{F}.lora.a2a_experimental": ignore("off", refuse_if=_truthy),
    f"{F}.lora.dtype": ignore("the adapters are kept in the parameters' dtype", refuse_if=_nonempty),
    f"{F}.lora.fully_sharded_loras": ignore("vLLM's LoRA sharding (megarl syncs merged weights)"),
    **{f"{F}.lora.{key}": ignore("multimodal models (megarl is text only)")
       for key in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model")},
    f"{F}.hf_config_path": ignore("from the model directory", refuse_if=_nonempty),
    "actor_rollout_ref.hybrid_engine": custom(_hybrid_engine, HYBRID_ENGINE),
    "actor_rollout_ref.nccl_timeout": to("distributed_timeout_minutes", lambda v: v / 60.0, "seconds -> minutes"),
    # the actor
    f"{A}.strategy": ignore("megarl trains with Megatron-core"),
    f"{A}.ppo_mini_batch_size": INF,
    f"{A}.ppo_micro_batch_size": INF,
    f"{A}.ppo_micro_batch_size_per_gpu": INF,
    f"{A}.use_dynamic_bsz": INF,
    f"{A}.ppo_max_token_len_per_gpu": INF,
    f"{A}.grad_clip": to("clip_grad"),
    f"{A}.clip_ratio": INF,
    f"{A}.clip_ratio_low": to("clip_eps_low"),
    f"{A}.clip_ratio_high": to("clip_eps_high"),
    f"{A}.clip_ratio_c": to("dual_clip_c"),
    f"{A}.entropy_coeff": to("entropy_coef"),
    f"{A}.use_kl_loss": INF,
    f"{A}.kl_loss_coef": INF,
    f"{A}.kl_loss_type": _kl_name(f"{A}.kl_loss_type"),
    f"{A}.loss_agg_mode": _choice(f"{A}.loss_agg_mode", tuple(LOSS_AGG), "loss_agg", LOSS_AGG),
    f"{A}.policy_loss.loss_mode": _choice(f"{A}.policy_loss.loss_mode", ("vanilla", "gspo"), "policy_loss",
                                          {"vanilla": "ppo_clip", "gspo": "gspo"}),
    **{f"{A}.policy_loss.{key}": ignore("options of policy losses this config does not select")
       for key in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")},
    f"{A}.ppo_epochs": to("ppo_epochs"),
    f"{A}.shuffle": to("shuffle"),
    f"{A}.ulysses_sequence_parallel_size": custom(
        lambda v, ctx: {"context_parallel_size": v, "padding_free": True} if v > 1 else {},
        "sequence split over ranks: megarl's context parallelism (packed sequences)"),
    f"{A}.entropy_from_logits_with_chunking": ignore("megarl picks its kernels (--kernels)"),
    f"{A}.entropy_checkpointing": ignore("megarl picks its kernels (--kernels)"),
    f"{A}.use_torch_compile": ignore("no torch.compile"),
    f"{A}.use_fused_kernels": ignore("megarl picks its kernels (--kernels)"),
    f"{A}.checkpoint.*": ignore("megarl's checkpoints hold the model, optimizer and run state"),
    f"{A}.use_remove_padding": to("padding_free"),
    f"{A}.optim.lr": to("lr"),
    f"{A}.optim.lr_warmup_steps": custom(lambda v, ctx: {"lr_warmup_steps": v} if v is not None and v >= 0 else {},
                                         "-1: use lr_warmup_steps_ratio"),
    f"{A}.optim.lr_warmup_steps_ratio": INF,
    f"{A}.optim.min_lr_ratio": to("min_lr_ratio"),
    f"{A}.optim.warmup_style": _choice(f"{A}.optim.warmup_style", ("constant", "cosine"), "lr_decay_style"),
    f"{A}.optim.lr_scheduler_type": _choice(f"{A}.optim.lr_scheduler_type", ("constant", "cosine"),
                                            "lr_decay_style"),
    f"{A}.optim.lr_decay_style": _choice(f"{A}.optim.lr_decay_style", ("constant", "linear", "cosine"),
                                         "lr_decay_style"),
    f"{A}.optim.total_training_steps": ignore("injected by verl at run time (megarl: trainer.total_epochs or "
                                              "total_training_steps)"),
    f"{A}.optim.weight_decay": to("weight_decay"),
    f"{A}.optim.betas": custom(lambda v, ctx: {"adam_beta1": v[0], "adam_beta2": v[1]}),
    f"{A}.optim.clip_grad": to("clip_grad"),
    f"{A}.optim.optimizer": ignore("AdamW", refuse_if=lambda v: str(v).lower() not in ("adam", "adamw"),
                                   refusal="megarl trains with Adam(W) only"),
    f"{A}.optim.optimizer_impl": ignore("Megatron's Adam"),
    f"{A}.optim.num_cycles": ignore("one cosine half-cycle"),
    f"{A}.optim.min_lr": to("min_lr"),
    f"{A}.optim.lr_decay_steps": ignore("decay runs over the whole run", refuse_if=_nonempty),
    f"{A}.optim.lr_warmup_init": ignore("warm-up starts from 0", refuse_if=_truthy),
    f"{A}.optim.weight_decay_incr_style": ignore("constant weight decay", refuse_if=lambda v: v != "constant"),
    f"{A}.optim.override_optimizer_config": ignore("none", refuse_if=_nonempty),
    f"{A}.optim.use_checkpoint_opt_param_scheduler": ignore("the LR schedule is always in the checkpoint"),
    f"{A}.fsdp_config.param_offload": to("offload_model", note="FSDP's offload as megarl's (host memory between "
                                                                 "the actor's phases)"),
    f"{A}.fsdp_config.optimizer_offload": to("offload_optimizer"),
    f"{A}.fsdp_config.*": ignore(FSDP),
    f"{A}.megatron.tensor_model_parallel_size": to("tensor_model_parallel_size"),
    f"{A}.megatron.pipeline_model_parallel_size": to("pipeline_model_parallel_size"),
    # verl's Megatron back-end packs the rows it splits over CP (THD), as megarl's CP needs
    f"{A}.megatron.context_parallel_size": custom(
        lambda v, ctx: {"context_parallel_size": v, **({"padding_free": True} if v and v > 1 else {})},
        dest="context_parallel_size (and padding_free when > 1)"),
    f"{A}.megatron.use_distributed_optimizer": to("use_distributed_optimizer"),
    f"{A}.megatron.param_offload": to("offload_model"),
    f"{A}.megatron.optimizer_offload": to("offload_optimizer"),
    f"{A}.megatron.sequence_parallel": INF,
    f"{A}.megatron.virtual_pipeline_model_parallel_size": ignore(VIRTUAL_PIPELINE),
    f"{A}.megatron.expert_model_parallel_size": to("expert_model_parallel_size"),
    f"{A}.megatron.expert_tensor_parallel_size": ignore("1: each expert whole on its EP rank",
                                                        refuse_if=lambda v: v not in (None, 1),
                                                        refusal="megarl keeps each expert whole on its EP rank "
                                                                "(expert_tensor_parallel_size 1)"),
    f"{A}.megatron.override_transformer_config.*": ignore("", refuse_if=_nonempty,
                                                          refusal="transformer config overrides: not in megarl"),
    **{f"{A}.megatron.{key}": ignore("Megatron back-end details megarl sets itself")
       for key in ("grad_offload", "use_dist_checkpointing", "dist_checkpointing_path", "dist_checkpointing_prefix",
                   "seed", "use_mbridge", "vanilla_mbridge", "override_ddp_config", "override_transformer_config",
                   "override_mcore_model_config", "forward_only", "dtype")},
    f"{A}.megatron.override_transformer_config.recompute_granularity": to("recompute_granularity"),
    f"{A}.megatron.override_transformer_config.recompute_method": to("recompute_method"),
    f"{A}.megatron.override_transformer_config.recompute_num_layers": to("recompute_num_layers"),
    f"{A}.megatron.override_transformer_config.moe_expert_capacity_factor": to("moe_expert_capacity_factor",
                                                                               note="token dropping in the trainer"),
    f"{A}.megatron.override_transformer_config.moe_token_drop_policy": to("moe_token_drop_policy"),
    f"{A}.megatron.override_transformer_config.*": ignore("Megatron TransformerConfig tuning megarl sets itself "
                                                          "(attention back-end, recomputed modules)"),
    f"{A}.megatron.override_mcore_model_config.*": ignore("empty", refuse_if=_nonempty,
                                                          refusal="Megatron model config overrides: not in megarl"),
    f"{A}.freeze_vision_tower": ignore("multimodal models (megarl is text only)"),
    f"{A}.data_loader_seed": ignore("one --seed seeds the data order"),
    f"{A}.load_weight": ignore("megarl loads the HF weights", refuse_if=lambda v: not v),
    f"{A}.optim.lr_wsd_decay_style": ignore("WSD schedule options (lr_decay_style is not WSD)"),
    f"{A}.optim.lr_wsd_decay_steps": ignore("WSD schedule options (lr_decay_style is not WSD)"),
    f"{A}.megatron.override_ddp_config.*": ignore("", refuse_if=_nonempty,
                                                  refusal="DDP config overrides: not in megarl"),
    f"{A}.profiler.*": ignore("profiler"),
    # the reference
    **{f"{REF}.{key}": ignore("the reference is built like the actor (its parallelism, micro-batches)")
       for key in ("strategy", "use_torch_compile", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
                   "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "model", "ulysses_sequence_parallel_size",
                   "entropy_from_logits_with_chunking", "entropy_checkpointing", "fsdp_config.*", "megatron.*",
                   "profiler.*", "use_remove_padding", "use_fused_kernels", "load_weight")},
    # the rollout
    f"{R}.name": custom(lambda v, ctx: {"rollout_backend": "hf"} if v == "hf" else {},
                        "vllm (sglang, trtllm: megarl's vLLM); hf: megarl's transformers backend"),
    f"{R}.mode": ignore("megarl's engines run in-process"),
    f"{R}.n": to("num_generations"),
    f"{R}.temperature": to("temperature"),
    f"{R}.top_k": to("top_k"),
    f"{R}.top_p": to("top_p"),
    f"{R}.response_length": to("max_new_tokens"),
    f"{R}.prompt_length": ignore("data.max_prompt_length"),
    f"{R}.dtype": ignore("the rollout's weights follow the trainer's (params_dtype)"),
    f"{R}.gpu_memory_utilization": to("rollout_gpu_memory_utilization"),
    f"{R}.ignore_eos": ignore("responses end at EOS", refuse_if=_truthy,
                              refusal="ignore_eos has no megarl counterpart (min_new_tokens = max_new_tokens "
                                      "fixes lengths but still stops at EOS after them)"),
    f"{R}.enforce_eager": to("rollout_engine_kwargs.enforce_eager"),
    f"{R}.free_cache_engine": ignore("colocated engines always sleep while training"),
    f"{R}.load_format": ignore("megarl syncs the trainer's weights into the engines"),
    f"{R}.layered_summon": ignore("FSDP weight gathering"),
    f"{R}.tensor_model_parallel_size": to("rollout_tensor_parallel_size"),
    f"{R}.max_num_batched_tokens": to("rollout_engine_kwargs.max_num_batched_tokens"),
    f"{R}.max_num_seqs": to("rollout_engine_kwargs.max_num_seqs"),
    f"{R}.max_model_len": to("rollout_engine_kwargs.max_model_len"),
    f"{R}.enable_chunked_prefill": to("rollout_engine_kwargs.enable_chunked_prefill"),
    f"{R}.enable_prefix_caching": to("rollout_engine_kwargs.enable_prefix_caching"),
    f"{R}.disable_log_stats": ignore("vLLM's own statistics log"),
    f"{R}.do_sample": ignore("sampling", refuse_if=lambda v: not v,
                             refusal="greedy training rollouts: megarl samples (temperature > 0)"),
    f"{R}.log_prob_micro_batch_size": ignore(PERF),
    f"{R}.log_prob_micro_batch_size_per_gpu": ignore(PERF),
    f"{R}.log_prob_use_dynamic_bsz": ignore(PERF),
    f"{R}.log_prob_max_token_len_per_gpu": ignore(PERF),
    f"{R}.val_kwargs.temperature": to("eval_temperature"),
    f"{R}.val_kwargs.n": to("eval_samples"),
    f"{R}.val_kwargs.do_sample": custom(lambda v, ctx: {} if v else {"eval_temperature": 0.0}),
    f"{R}.val_kwargs.top_k": ignore("evaluation samples with the rollout's top_k"),
    f"{R}.val_kwargs.top_p": ignore("evaluation samples with the rollout's top_p"),
    f"{R}.engine_kwargs.vllm.*": INF,
    f"{R}.engine_kwargs.vllm": ignore("none given"),
    f"{R}.engine_kwargs.sglang": ignore("SGLang's arguments"),
    f"{R}.engine_kwargs.sglang.*": ignore("SGLang's arguments"),
    f"{R}.cudagraph_capture_sizes": ignore("vLLM's CUDA-graph sizes (performance)"),
    f"{R}.over_sample_rate": ignore("0: no over-sampling", refuse_if=_truthy),
    f"{R}.skip_rollout": ignore("off", refuse_if=_truthy),
    f"{R}.skip_dump_dir": ignore("skip_rollout's dump"),
    f"{R}.profiler.*": ignore("profiler"),
    f"{R}.use_fire_sampling": ignore("off", refuse_if=_truthy),
    f"{R}.chat_scheduler": ignore("single-turn", refuse_if=_nonempty),
    f"{R}.data_parallel_size": ignore("vLLM's data parallelism inside an engine (performance): megarl runs an engine "
                                      "per rollout TP group"),
    f"{R}.expert_parallel_size": ignore("vLLM's expert parallelism (performance): megarl's engines shard experts "
                                        "over their tensor parallelism"),
    f"{R}.pipeline_model_parallel_size": ignore("vLLM engines run tensor parallel only",
                                                refuse_if=lambda v: v not in (None, 1)),
    f"{R}.quantization": ignore("unquantized rollout weights", refuse_if=_truthy),
    f"{R}.use_block_quant_rollout": ignore("quantized rollouts (quantization false)"),
    f"{R}.layer_name_map.*": ignore("weight-sync layer names for quantized rollouts"),
    f"{R}.skip_tokenizer_init": ignore("megarl's engines tokenize themselves"),
    f"{R}.prometheus.*": ignore("metrics export"),
    f"{R}.multi_turn.enable": ignore("episodes are multi-turn when tools or an interaction are given"),
    f"{R}.multi_turn.tool_config_path": custom(lambda v, ctx: _verl_tools(v, f"{R}.multi_turn.tool_config_path", ctx),
                                               "verl's tool-config YAML: its tool classes as megarl's tools"),
    f"{R}.multi_turn.interaction_config_path": custom(
        lambda v, ctx: _verl_interaction(v, f"{R}.multi_turn.interaction_config_path", ctx),
        "verl's interaction YAML: its GSM8K interaction as megarl's `retry`"),
    f"{R}.multi_turn.max_assistant_turns": to("max_turns", note="null: megarl's --max-turns default"),
    f"{R}.multi_turn.format": to("tool_parser"),
    f"{R}.multi_turn.max_user_turns": ignore("an interaction replies after each assistant turn until max_turns"),
    f"{R}.multi_turn.max_parallel_calls": ignore("every call of a turn runs (on --tool-workers threads)"),
    f"{R}.multi_turn.max_tool_response_length": ignore("a tool's text is cut at 4000 characters and the episode's "
                                                       "token budget"),
    f"{R}.multi_turn.tool_response_truncate_side": ignore("tool text is cut at its end"),
    f"{R}.multi_turn.use_inference_chat_template": ignore("megarl renders every turn with the model's chat template"),
    f"{R}.multi_turn.tokenization_sanity_check_mode": ignore("megarl tokenizes each turn once, in order"),
    f"{R}.multi_turn.*": ignore("multi-turn settings"),
    f"{R}.agent.*": ignore("agent loop settings (single-turn)"),
    f"{R}.trace.*": ignore("tracing"),
    f"{R}.update_weights_bucket_megabytes": to("sync_bucket_mb"),
    f"{R}.calculate_log_probs": ignore("megarl keeps the rollout's log-probs for TIS"),
    f"{R}.multi_stage_wake_up": ignore("FSDP wake-up staging"),
    f"{R}.seed": ignore("one --seed"),
    # the critic (PPO with GAE)
    "critic.optim.lr": to("critic_lr"),
    "critic.model.path": to("critic_model", expand_path),
    "critic.cliprange_value": to("value_clip"),
    **{f"critic.{key}": ignore("megarl's critic shares the actor's parallelism, micro-batches, epochs and LR "
                               "schedule (its own: critic_lr, value_clip)")
       for key in ("rollout_n", "strategy", "enable", "optim.lr_warmup_steps_ratio", "optim.total_training_steps",
                   "optim.weight_decay", "optim.lr_warmup_steps", "optim.min_lr_ratio", "optim.warmup_style",
                   "optim.lr_scheduler_type", "optim.betas", "optim.clip_grad", "optim.num_cycles",
                   "model.tokenizer_path", "model.override_config", "model.override_config.*", "model.external_lib",
                   "model.trust_remote_code", "nccl_timeout", "load_weight", "data_loader_seed",
                   "optim.optimizer", "optim.lr_warmup_init", "optim.lr_decay_steps", "optim.lr_decay_style",
                   "optim.min_lr", "optim.weight_decay_incr_style", "optim.lr_wsd_decay_style",
                   "optim.lr_wsd_decay_steps", "optim.use_checkpoint_opt_param_scheduler",
                   "optim.override_optimizer_config",
                   "model.use_shm", "model.enable_gradient_checkpointing", "model.enable_activation_offload",
                   "model.use_remove_padding", "model.fsdp_config.*", "model.lora_rank", "model.lora_alpha",
                   "model.target_modules", "ppo_mini_batch_size", "ppo_micro_batch_size",
                   "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
                   "forward_max_token_len_per_gpu", "ppo_epochs", "shuffle", "loss_agg_mode", "checkpoint.*",
                   "profiler.*", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu",
                   "ulysses_sequence_parallel_size", "grad_clip", "megatron.*")},
    # reward
    "reward_model.enable": INF,
    "reward_model.model.path": INF,
    "reward_model.micro_batch_size": to("reward_model_micro_batch_size"),
    "reward_model.micro_batch_size_per_gpu": to("reward_model_micro_batch_size"),
    "reward_model.max_length": to("reward_model_max_length"),
    "reward_model.reward_manager": ignore("the naive manager (per-sample scoring)",
                                          refuse_if=lambda v: v not in ("naive", "batch", "dapo", None),
                                          refusal="this reward manager has no megarl counterpart"),
    "reward_model.overlong_buffer.enable": INF,
    "reward_model.overlong_buffer.len": INF,
    "reward_model.overlong_buffer.*": ignore("DAPO's overlong buffer penalty is megarl's (linear, up to 1)"),
    "reward_model.sandbox_fusion.url": ignore("no sandbox server", refuse_if=_nonempty,
                                              refusal="a sandbox_fusion server: megarl runs code rewards in its "
                                                      "own sandbox"),
    "model_engine": ignore("megatron or fsdp: which back-end's defaults apply (megarl trains with Megatron-core "
                           "either way)", refuse_if=lambda v: v not in (None, "megatron", "fsdp", "dtensor"),
                           refusal="megarl reads the megatron and fsdp back-ends' configurations"),
    # Newer verl configs (verl/trainer/config/_generated_ppo_megatron_trainer.yaml): its defaults walk in
    # tests/test_migrating.py reads every key of it.
    f"{A}.megatron.use_remove_padding": to("padding_free", bool, "the Megatron back-end's packing (default true)"),
    f"{A}.rollout_n": ignore("rollout.n"),
    f"{REF}.rollout_n": ignore("rollout.n"),
    f"{A}.tau_pos": ignore("SAPO's temperature (policy_loss.loss_mode sapo)"),
    f"{A}.tau_neg": ignore("SAPO's temperature (policy_loss.loss_mode sapo)"),
    f"{A}.loss_scale_factor": ignore("none: each aggregation's own normaliser", refuse_if=lambda v: v is not None,
                                     refusal="a constant loss divisor: megarl's loss_agg modes normalise by "
                                             "tokens, samples or max length"),
    f"{A}.calculate_entropy": ignore("megarl logs the entropy of every step"),
    f"{A}.use_prefix_grouper": ignore("shared-prefix batching (performance)"),
    f"{A}.router_replay.mode": routing_replay_mode(),
    f"{A}.router_replay.record_file": ignore("none", refuse_if=_nonempty,
                                             refusal="routes to or from a file: megarl replays the rollout's"),
    f"{A}.router_replay.replay_file": ignore("none", refuse_if=_nonempty,
                                             refusal="routes to or from a file: megarl replays the rollout's"),
    f"{REF}.router_replay.*": ignore("the reference replays the policy's routes when routing replay is on"),
    f"{A}.megatron.router_replay.mode": routing_replay_mode(),
    f"{A}.megatron.router_replay.*": ignore("routes to or from a file: none"),
    f"{A}.megatron.use_megatron_fsdp": ignore("Megatron's FSDP sharding (memory): megarl's distributed optimizer "
                                              "shards the optimizer states"),
    f"{F}.use_prefix_tree": ignore("prefix-tree attention over a group's shared prompt (performance)"),
    f"{R}.enable_sleep_mode": ignore("colocated engines always sleep while training"),
    f"{R}.moe_tp_size": ignore("vLLM's expert sharding (performance)"),
    f"{R}.moe_ep_size": ignore("vLLM's expert sharding (performance)"),
    f"{F}.prefix_tree_attention": ignore("prefix-tree attention over a group's shared prompt (performance)"),
    f"{R}.enable_expert_parallel": ignore("vLLM's expert sharding (performance)"),
    f"{R}.enable_rollout_routing_replay": custom(lambda v, ctx: {"routing_replay": "on"} if v else {},
                                                 "the engine records routes: `routing_replay` on"),
    f"{R}.logprobs_mode": ignore("megarl's engines return processed_logprobs (after temperature)",
                                 refuse_if=lambda v: v not in (None, "processed_logprobs"),
                                 refusal="megarl's engines return processed_logprobs, the sampler's"),
    f"{R}.scheduling_policy": ignore("fcfs", refuse_if=lambda v: v not in (None, "fcfs"),
                                     refusal="vLLM's priority scheduling: megarl submits a step's requests at once"),
    f"{R}.engine_kwargs.trtllm": ignore("TensorRT-LLM's arguments"),
    f"{R}.engine_kwargs.trtllm.*": ignore("TensorRT-LLM's arguments"),
    f"{R}.checkpoint_engine.update_weights_bucket_megabytes": to("sync_bucket_mb"),
    f"{R}.checkpoint_engine.backend": ignore("megarl's weight sync (collectives in place)"),
    f"{R}.checkpoint_engine.engine_kwargs": ignore("megarl's weight sync (collectives in place)"),
    f"{R}.checkpoint_engine.engine_kwargs.*": ignore("megarl's weight sync (collectives in place)"),
    f"{R}.quantization_config_file": ignore("unquantized rollout weights", refuse_if=_nonempty),
    f"{R}.mtp": ignore("no MTP head in the rollout", refuse_if=_nonempty),
    f"{R}.mtp.*": ignore("no MTP head in the rollout"),
    f"{F}.mtp.enable": ignore("MTP layers are left out", refuse_if=_truthy,
                              refusal="MTP training or speculative decoding with it: megarl leaves MTP layers out"),
    f"{F}.mtp.*": ignore("MTP settings (mtp.enable false)"),
    f"{F}.tiled_mlp.*": ignore("tiled MLP (an FSDP memory saving)"),
    "reward_manager.name": ignore("the naive manager (per-sample scoring)",
                                  refuse_if=lambda v: v not in ("naive", "batch", "dapo", None),
                                  refusal="this reward manager has no megarl counterpart"),
    "reward_manager.source": ignore("register: a manager by name"),
    "reward_manager.module.path": ignore("none", refuse_if=_nonempty,
                                         refusal="a custom reward manager: register a reward with external_plugins"),
    "reward_manager.module.name": ignore("reward_manager.module.path is unset"),
    "critic.model.lora.rank": ignore("0: the critic trains every weight", refuse_if=_truthy,
                                     refusal="LoRA on the critic: megarl's critic trains every weight"),
    "critic.model.lora.*": ignore("critic LoRA settings (critic.model.lora.rank 0)"),
    "reward_model.rollout.*": ignore("a generative reward model's engine: megarl's reward model is a classifier"),
    "reward_model.model.override_config": ignore("empty", refuse_if=_nonempty,
                                                 refusal="reward model config overrides: not in megarl"),
    **{f"reward_model.{key}": ignore("verl's reward loop (workers scoring beside generation)")
       for key in ("reward_loop_source", "reward_loop_module_path", "reward_loop_class_name", "use_reward_loop",
                   "num_workers")},
    **{f"reward_model.{key}": ignore("reward model worker settings (FSDP, batching)")
       for key in ("strategy", "model.input_tokenizer", "model.external_lib", "model.trust_remote_code",
                   "model.use_shm", "model.use_remove_padding", "model.use_fused_kernels", "model.fsdp_config.*",
                   "use_dynamic_bsz", "forward_max_token_len_per_gpu", "launch_reward_fn_async",
                   "sandbox_fusion.max_concurrent", "sandbox_fusion.memory_limit_mb", "profiler.*",
                   "ulysses_sequence_parallel_size", "megatron.*", "enable_resource_pool",
                   "n_gpus_per_node", "nnodes", "nccl_timeout", "load_weight")},
    # DAPO's reward manager kwargs (its overlong buffer): megarl's overlong penalty.
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": INF,
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": INF,
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": INF,
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": ignore("megarl logs overlong_penalty_mean"),
    "reward_model.reward_kwargs.max_resp_len": INF,
    "reward_model.reward_kwargs.*": ignore("", refuse_if=_nonempty, refusal="this reward manager argument has no "
                                                                            "megarl counterpart"),
    "reward_model.sandbox_fusion.*": ignore("no sandbox server"),
    # Newer verl (generated ppo_trainer.yaml): the parts megarl has no use for, refused where they would matter.
    "distillation.enabled": ignore("off", refuse_if=_truthy,
                                   refusal="verl's distillation section is not read yet: give the teacher with "
                                           "megarl's --teacher-model or a teacher: group, GKD's loss with --gkd-*"),
    "distillation.*": ignore("distillation settings (distillation.enabled false)"),
    "trainer.use_v1": ignore("verl's trainer implementation"),
    "trainer.v1.trainer_mode": ignore("sync", refuse_if=lambda v: v not in (None, "sync"),
                                      refusal="verl's asynchronous trainer modes: megarl's --async-generation "
                                              "overlaps one step"),
    "trainer.v1.*": ignore("verl's v1 trainer settings (trainer_mode sync)"),
    **{f"skip.{kind}.enable": ignore("off", refuse_if=_truthy, refusal="skipping rollouts from a dump: not in megarl")
       for kind in ("rollout", "rollout_tq", "async_rollout")},
    "skip.*": ignore("rollout skipping (off)"),
    "algorithm.filter_groups.max_inflight_gen_batches": ignore("megarl generates one batch at a time"),
    "data.gen_batch_size": ignore("train_batch_size prompts per round", refuse_if=lambda v: v is not None,
                                  refusal="a generation batch larger than data.train_batch_size: megarl's dynamic "
                                          "sampling generates train_batch_size prompts per round "
                                          "(filter_groups.max_num_gen_batches rounds)"),
    "data.function_tool_path": ignore("no tools", refuse_if=_nonempty,
                                      refusal="verl's function tools: megarl's tools are registered functions "
                                              "(--tools, --external-plugins)"),
    "data.audio_key": ignore("multimodal data (megarl is text only)"),
    "data.mm_processor_kwargs": ignore("multimodal data (megarl is text only)"),
    "data.mm_processor_kwargs.*": ignore("multimodal data (megarl is text only)"),
    f"{A}.optim.zero_indexed_step": ignore("the LR schedule's step indexing"),
    f"{A}.optim.optimizer_impl": ignore("AdamW"),
    f"{A}.optim.override_optimizer_config.*": ignore("Megatron optimizer tuning (CPU offload of the step, precision-"
                                                     "aware states): performance only"),
    f"{A}.policy_loss.dro_beta": ignore("options of policy losses this config does not select"),
    f"{A}.calculate_sum_pi_squared": ignore("a diagnostic metric"),
    f"{A}.qat.enable": ignore("off", refuse_if=_truthy, refusal="quantization-aware training: not in megarl"),
    f"{A}.qat.*": ignore("quantization-aware training (off)"),
    f"{A}.entropy_from_logits_chunk_size": ignore(PERF),
    f"{A}.pad_to_length": ignore(PERF),
    f"{REF}.entropy_from_logits_chunk_size": ignore(PERF),
    f"{REF}.pad_to_length": ignore(PERF),
    f"{R}.nnodes": ignore("0: the rollout shares the trainer's nodes", refuse_if=_truthy,
                          refusal="rollout replicas on nodes of their own: megarl's separate placement "
                                  "(colocate_groups [], rollout.gpus) in its own YAML"),
    f"{R}.n_gpus_per_node": ignore("trainer.n_gpus_per_node"),
    f"{R}.full_determinism": ignore("megarl's engines are seeded per step"),
    f"{R}.checkpoint_engine.custom_backend_module": ignore("none", refuse_if=_nonempty),
    f"{R}.moe_load_balance_metrics_interval": ignore("megarl logs routing metrics every step"),
    f"{R}.moe_tensor_parallel_size": ignore("vLLM's expert sharding (performance)"),
    f"{R}.qat": ignore("quantization-aware training (off)"),
    f"{R}.qat.*": ignore("quantization-aware training (off)"),
    f"{R}.disaggregation.enabled": ignore("off", refuse_if=_truthy,
                                          refusal="prefill/decode disaggregation: not in megarl"),
    f"{R}.disaggregation.*": ignore("prefill/decode disaggregation (off)"),
    **{f"critic.{key}": ignore("megarl's critic shares the actor's parallelism, micro-batches, epochs and LR "
                               "schedule (its own: critic_lr, value_clip)")
       for key in ("fsdp.*", "optim.optimizer_impl", "optim.zero_indexed_step", "loss_scale_factor",
                   "model.hf_config_path", "model.custom_chat_template", "model.exclude_modules",
                   "model.lora_adapter_path", "model.use_liger", "model.use_fused_kernels",
                   "model.fused_kernel_options.*", "model.tiled_mlp.*", "model.mtp.*")},
    "custom_reward_function.path": custom(lambda v, ctx: {}, INFORMS,
                                          refuse_if=lambda v: _nonempty(v) and not _verl_scorer(v),
                                          refusal="register the function as a megarl reward (@register_reward) "
                                                  "in a file given to --external-plugins, and name it in --reward"),
    "custom_reward_function.name": ignore("no custom reward"),
    # algorithm
    "algorithm.gamma": to("gamma"),
    "algorithm.lam": to("lam"),
    "algorithm.adv_estimator": _choice("algorithm.adv_estimator", ESTIMATORS, "advantage_estimator"),
    "algorithm.norm_adv_by_std_in_grpo": to("scale_rewards", lambda v: "group" if v else "none"),
    "algorithm.use_kl_in_reward": INF,
    "algorithm.kl_penalty": _kl_name("algorithm.kl_penalty"),
    "algorithm.kl_ctrl.type": INF,
    "algorithm.kl_ctrl.kl_coef": INF,
    "algorithm.kl_ctrl.horizon": INF,
    "algorithm.kl_ctrl.target_kl": INF,
    "algorithm.use_pf_ppo": ignore("off", refuse_if=_truthy),
    "algorithm.pf_ppo.reweight_method": ignore("PF-PPO settings (use_pf_ppo false)"),
    "algorithm.pf_ppo.weight_pow": ignore("PF-PPO settings (use_pf_ppo false)"),
    "algorithm.filter_groups.enable": custom(lambda v, ctx: {"dynamic_sampling": [0.0, 1.0]} if v else {},
                                             "DAPO dynamic sampling: keep groups whose rewards differ"),
    "algorithm.filter_groups.max_num_gen_batches": custom(lambda v, ctx: {"max_num_gen_batches": v} if v else {}),
    "algorithm.filter_groups.metric": ignore("megarl filters on the reward"),
    "algorithm.rollout_is": INF, "algorithm.rollout_is_level": INF, "algorithm.rollout_is_mode": INF,
    "algorithm.rollout_is_threshold": to("tis_threshold"),
    "algorithm.rollout_is_threshold_lower": ignore("1 / threshold"),
    "algorithm.rollout_is_veto_threshold": ignore("no veto", refuse_if=_nonempty),
    "algorithm.rollout_correction.rollout_is": custom(
        lambda v, ctx: {"tis_level": v} if v in ("token", "sequence") else {}),
    "algorithm.rollout_correction.rollout_is_threshold": to("tis_threshold"),
    "algorithm.rollout_correction.*": ignore("rejection sampling and bypass modes (off)"),
    # trainer
    "trainer.total_epochs": INF,
    "trainer.total_training_steps": to("train_steps"),
    "trainer.project_name": INF,
    "trainer.experiment_name": INF,
    "trainer.logger": INF,
    "trainer.nnodes": INF,
    "trainer.n_gpus_per_node": INF,
    "trainer.save_freq": to("save_interval", lambda v: v if v > 0 else -1, "-1 (or 0): nothing is saved"),
    "trainer.test_freq": INF,
    "trainer.critic_warmup": to("critic_warmup"),
    "trainer.default_local_dir": to("save_dir", expand_path),
    "trainer.default_hdfs_dir": ignore("HDFS upload"),
    "trainer.del_local_ckpt_after_load": ignore("checkpoints are kept (save_keep)"),
    "trainer.resume_mode": INF,
    "trainer.resume_from_path": INF,
    "trainer.max_actor_ckpt_to_keep": to("save_keep", lambda v: v or 0),
    "trainer.max_critic_ckpt_to_keep": ignore("the critic is saved with the actor"),
    "trainer.val_before_train": ignore("megarl evaluates before the first step whenever it has a set"),
    "trainer.val_only": ignore("off", refuse_if=_truthy, refusal="evaluation only: use megarl/score.py"),
    "trainer.log_val_generations": ignore("--rollout-save-dir dumps every evaluation"),
    "trainer.rollout_data_dir": to("rollout_save_dir", expand_path),
    "trainer.validation_data_dir": to("rollout_save_dir", expand_path),
    "trainer.balance_batch": to("balance_batch", bool),
    "trainer.balance_keep_minibatch": ignore("megarl balances each mini-batch's share by tokens (balance_batch)"),
    "trainer.device": ignore("the launcher's device"),
    "trainer.esi_redundant_time": ignore("elastic preemption margin"),
    "trainer.ray_wait_register_center_timeout": ignore("Ray"),
    "trainer.use_legacy_worker_impl": ignore("verl's worker implementation"),
    **{f"trainer.{key}": ignore("profiling") for key in (
        "profile_steps", "profile_continuous_steps", "controller_nsight_options.*", "worker_nsight_options.*",
        "npu_profile.*")},
    # orchestration
    "ray_init.*": ignore("Ray orchestration: megarl runs every role under torchrun"),
    "ray_kwargs.*": ignore("Ray orchestration: megarl runs every role under torchrun"),
    "global_profiler.*": ignore("profiler"),
    "transfer_queue.*": ignore("verl's data transfer queue"),
    "hydra.*": ignore("Hydra's own settings"),
    "defaults": ignore("Hydra composition (the file is read as given)"),
}

_INTERPOLATION = re.compile(r"\$\{([^{}]+)\}")


def _resolve(tree: dict, where: str) -> dict:
    """OmegaConf's interpolations: `${a.b}`, relative `${.b}` / `${..b}`, `${oc.env:VAR[,default]}` and
    `${oc.select:a.b[,default]}`. One that cannot be resolved stays as written: only a key megarl maps
    needs its value (apply_table then says so), an ignored profiler setting does not."""
    def find(path):
        node = tree
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return KeyError
            node = node[part]
        return node

    def target(name, here):
        if name.startswith("."):
            ups = len(name) - len(name.lstrip("."))
            return here[:len(here) - (ups - 1)] + name.lstrip(".").split(".") if ups - 1 <= len(here) else None
        return name.split(".")

    def value_of(expression, here, depth):
        if depth > 20:
            return KeyError
        name, _, default = expression.partition(",")
        name = name.strip()
        if name.startswith("oc.env:"):
            import os

            var = name[len("oc.env:"):].strip()
            return os.environ[var] if var in os.environ else yaml.safe_load(default) if default else KeyError
        select = name.startswith("oc.select:")
        path = target(name[len("oc.select:"):].strip() if select else name, here)
        found = find(path) if path is not None else KeyError
        if found is KeyError:
            return yaml.safe_load(default) if select and default else None if select else KeyError
        return resolve(found, path[:-1], depth + 1)

    def resolve(node, here, depth=0):
        if isinstance(node, dict):
            return {key: resolve(value, here + [key], depth) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item, here, depth) for item in node]
        if isinstance(node, str) and "${" in node:
            container = here[:-1] if here else here
            whole = _INTERPOLATION.fullmatch(node)
            if whole:
                value = value_of(whole.group(1), container, depth)
                return node if value is KeyError else value
            parts = [value_of(m.group(1), container, depth) for m in _INTERPOLATION.finditer(node)]
            if any(part is KeyError for part in parts):
                return node
            values = iter(parts)
            return _INTERPOLATION.sub(lambda m: str(next(values)), node)
        return node

    return resolve(tree, [])


def is_override(token: str) -> bool:
    """`a.b=c`, `+a.b=c`, `++a.b=c` or `~a.b[=c]`: a Hydra override, not a flag or a file."""
    return bool(re.fullmatch(r"(\+\+|\+|~)?[A-Za-z_][\w.]*(=.*)?", token, re.S)) and (
        "=" in token or token.startswith("~"))


def script_overrides(tokens: list[str], where) -> list[str]:
    """The overrides of a `python3 -m verl.trainer.main_ppo ...` line: up to a pipe or redirection, without
    the script's own `$@`; Hydra's --config-path/--config-name are refused (megarl reads the overrides over
    verl's defaults, not a composed config: pass that config with --config instead)."""
    out = []
    for token in tokens:
        if token in ("|", "||", "&&", ";", "&") or token.startswith(("2>", ">", "1>")):
            break
        if token in ("$@", "$*", '"$@"', "\\"):  # the script's own arguments; a stray trailing backslash
            continue
        if token.startswith("--config-"):
            if _verl_own_config(token):  # verl's packaged trainer config: the defaults megarl applies anyway
                if "megatron" in token:  # ppo_megatron_trainer.yaml: what sets the Megatron back-end's defaults
                    out.insert(0, f"{A}.strategy=megatron")
                continue
            raise ConfigError(f"{where}: {token}: Hydra composes that config; give it to megarl as --config FILE "
                              f"and the overrides after it")
        if not is_override(token):
            raise ConfigError(f"{where}: {token!r} is not a verl override (key=value)")
        out.append(token)
    return out


# verl's launch scripts name its own trainer configs (verl/trainer/config/): megarl reads their overrides over
# verl's defaults, which are those configs'
VERL_OWN_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")


def _verl_own_config(token: str) -> bool:
    """`--config-path=config` (verl/trainer's own folder) or `--config-name=ppo_[megatron_]trainer[.yaml]`."""
    flag, _, value = token.partition("=")
    value = value.strip("'\"")
    if flag == "--config-path":  # verl/trainer/config, named from verl/trainer or from the repository
        return value.rstrip("/") in ("config", "./config") or value.rstrip("/").endswith("verl/trainer/config")
    return flag == "--config-name" and value.removesuffix(".yaml") in VERL_OWN_CONFIGS


def apply_overrides(tree: dict, overrides: list[str], where: str) -> dict:
    """Hydra's override grammar for plain values: dotted keys, YAML values (lists, numbers, null)."""
    for token in overrides:
        prefix = re.match(r"\+\+|\+|~", token)
        mode = prefix.group(0) if prefix else ""
        key, _, text = token[len(mode):].partition("=")
        parts = key.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {token}: {part} is not a mapping")
        exists = parts[-1] in node
        if mode == "~":
            if not exists:
                raise ConfigError(f"override {token}: {key} is not in {where}")
            del node[parts[-1]]
            continue
        if mode == "+" and exists:
            raise ConfigError(f"override {token}: {key} is already in {where} (use {key}=... or ++{key}=...)")
        if not exists and not mode and lookup(TABLE, _older_names({key: None}, where)[0].popitem()[0]) is None:
            known = [k for k in TABLE if not k.endswith(".*")]
            raise ConfigError(f"override {token}: unknown verl key{closest(key, known)}")
        try:
            node[parts[-1]] = yaml.safe_load(text) if text != "" else None
        except yaml.YAMLError:
            node[parts[-1]] = text
    return tree


# Newer verl moved the reward settings under `reward.` (verl/trainer/config/reward/): each new name, read as
# the older one it replaces (the import table keeps the name the file used).
RENAMED = (("reward.reward_model.model_path", "reward_model.model.path"),
           ("reward.reward_manager.", "reward_manager."),
           ("reward.custom_reward_function.", "custom_reward_function."),
           ("reward.reward_kwargs.", "reward_model.reward_kwargs."),
           ("reward.sandbox_fusion.", "reward_model.sandbox_fusion."),
           ("reward.reward_model.", "reward_model."),
           ("reward.num_workers", "reward_model.num_workers"),
           ("sandbox_fusion.", "reward_model.sandbox_fusion."))


def _older_names(flat: dict, where: str) -> tuple[dict, dict]:
    """`flat` with RENAMED's new names as the older ones, and {older name: the name the file used}. verl's
    newer defaults keep the older keys at null beside the new ones: a null yields to the other name."""
    out, used = dict(flat), {}
    for key, value in flat.items():
        older = next((old + key[len(new):] for new, old in RENAMED if key == new or
                      (new.endswith(".") and key.startswith(new))), key)
        if older == key:
            continue
        del out[key]
        if flat.get(older) is not None and value is not None and flat[older] != value:
            raise ConfigError(f"{where}: {key}={value!r} and its older name {older}={flat[older]!r} disagree; "
                              f"keep one")
        if value is not None or older not in flat:
            out[older], used[older] = value, key
    return out, used


def translate(raw: dict, where: str, megarl_options, overrides: list[str] = ()) -> Translation:
    tree = _resolve(apply_overrides(raw, list(overrides), where), where)
    flat = {key: value for key, value in flatten(tree).items() if not key.endswith("._target_")}
    flat, used = _older_names(flat, where)
    out = Translation("verl", where, how="verl PPO trainer config"
                      + (f" with {len(overrides)} override(s)" if overrides else ""))
    ctx = Context(flat, where)
    apply_table(out, TABLE, flat, ctx)
    _semantics(out, flat, ctx, megarl_options)
    for row in out.rows:
        row.key = used.get(row.key, row.key)
    return out


# verl's LoRA defaults: the FSDP back-end's PEFT keys (model/hf_model.yaml), the Megatron back-end's model.lora
# (Megatron-Bridge's fused LoRA on every linear).
LORA_FSDP = {"lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
LORA_MEGATRON = {"lora.alpha": 32, "lora.target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                 "lora.dropout": 0.0}
LORA_TYPES = ("lora", "canonical_lora")


def _lora(out: Translation, flat: dict, ctx: Context) -> None:
    """model.lora_rank (FSDP, PEFT) or model.lora.rank (Megatron) > 0: the adapters, with that back-end's
    defaults; at rank 0 every LoRA key is listed as ignored."""
    keys = [key for key in flat if key.startswith(f"{F}.lora") or key in (f"{F}.target_modules", f"{F}.use_rslora")]
    fsdp, megatron = flat.get(f"{F}.lora_rank") or 0, flat.get(f"{F}.lora.rank") or 0
    if fsdp and megatron:
        ctx.fail(f"{F}.lora.rank", f"and model.lora_rank are both set ({megatron}, {fsdp}): one LoRA rank")
    if not (fsdp or megatron):
        for key in keys:
            if lookup(TABLE, key) is INF:
                out.set(key, flat[key], "ignored", {}, "LoRA settings (lora_rank 0)")
        return
    names, defaults = ((("lora_rank", "lora_alpha", "lora_dropout", "target_modules"), LORA_FSDP)
                       if fsdp else (("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules"), LORA_MEGATRON))
    rank_key, alpha_key, dropout_key, targets_key = (f"{F}.{name}" for name in names)
    rank = fsdp or megatron
    if not isinstance(rank, int) or rank < 0:
        ctx.fail(rank_key, f"{rank!r}: a LoRA rank is a whole number (0: off)")
    kind = (flat.get(f"{F}.lora.type") or "lora") if megatron else "peft"
    if megatron and kind not in LORA_TYPES:
        ctx.fail(f"{F}.lora.type", f"{kind!r} has no megarl counterpart (megarl: {', '.join(LORA_TYPES)})")
    chosen = {rank_key, alpha_key, dropout_key, targets_key, f"{F}.use_rslora"}
    if megatron and f"{F}.lora.type" in flat:
        chosen.add(f"{F}.lora.type")
        out.set(f"{F}.lora.type", kind, "mapped", {}, "canonical_lora: one adapter per HF module, as megarl's")
    for key in keys:  # the other back-end's keys: verl's LoRA guide says they are ignored
        if lookup(TABLE, key) is INF and key not in chosen:
            out.set(key, flat[key], "ignored", {}, f"the {'FSDP' if megatron else 'Megatron'} back-end's LoRA keys")
    out.set(rank_key, rank, "mapped", {"lora_rank": rank})
    alpha = flat.get(alpha_key)
    status = "mapped" if alpha is not None else DEFAULT
    alpha = defaults[names[1]] if alpha is None else alpha
    if flat.get(f"{F}.use_rslora"):
        out.set(f"{F}.use_rslora", True, "mapped", {}, "rsLoRA's scale alpha / sqrt(rank) as megarl's alpha / rank")
        alpha = rslora_alpha(alpha, rank)
    elif f"{F}.use_rslora" in flat:
        out.set(f"{F}.use_rslora", flat[f"{F}.use_rslora"], "mapped", {})
    out.set(alpha_key, flat.get(alpha_key), status, {"lora_alpha": alpha}, "scale = alpha / rank")
    dropout = flat.get(dropout_key)
    out.set(dropout_key, dropout, "mapped" if dropout is not None else DEFAULT,
            {"lora_dropout": defaults[names[2]] if dropout is None else dropout})
    targets = flat.get(targets_key)
    note = "" if kind in ("peft", "canonical_lora") else LORA_LAYOUT
    out.set(targets_key, targets, "mapped" if targets is not None else DEFAULT,
            {"lora_target_modules": lora_targets(defaults[names[3]] if targets is None else targets, targets_key,
                                                 ctx)}, note)


# verl's defaults (verl/trainer/config/_generated_ppo_[megatron_]trainer.yaml) for the keys megarl maps that
# change what a run does; tests/test_migrating.py walks both files and checks that a key left out reads as
# given at its default. (key, its default, megarl's options for it); the back-end's own keys by back-end.
BOTH_DEFAULTS = (
    (f"{R}.tensor_model_parallel_size", 2, {"rollout_tensor_parallel_size": 2}),
    ("trainer.resume_mode", "auto", {}),  # read below, with the checkpoint directory
)
MEGATRON_DEFAULTS = (
    (f"{A}.megatron.use_remove_padding", True, {"padding_free": True}),
    (f"{A}.megatron.use_distributed_optimizer", True, {"use_distributed_optimizer": True}),
)
FSDP_DEFAULTS = (
    (f"{F}.enable_gradient_checkpointing", True, {"recompute_granularity": "full", "recompute_method": "uniform",
                                                 "recompute_num_layers": 1}),
    (f"{F}.use_remove_padding", True, {"padding_free": True}),
    (f"{A}.optim.min_lr_ratio", 0.0, {"min_lr_ratio": 0.0}),
)


def _backend_defaults(out: Translation, flat: dict) -> None:
    """verl's default for each key of BOTH_DEFAULTS and the back-end's table that the config leaves out."""
    table = MEGATRON_DEFAULTS if _megatron_backend(flat) else FSDP_DEFAULTS
    for key, value, targets in BOTH_DEFAULTS + table:
        if key not in flat and targets and not any(dest in out.values for dest in targets):
            out.set(key, value, DEFAULT, targets, "verl default")


def _semantics(out: Translation, flat: dict, ctx: Context, megarl_options) -> None:
    _lora(out, flat, ctx)
    if out.values.get("rollout_backend") == "hf":  # verl's hf rollout reads none of the vLLM settings
        dropped = out.values.pop("rollout_engine_kwargs", None)
        if dropped:
            out.set("(rollout.name hf)", sorted(dropped), IGNORED, {}, "vLLM settings, unused by the HF backend")

    def get(key, default=None):
        value = flat.get(key)
        return default if value is None else value

    def put(key, targets, note="", given=True):
        out.set(key, flat.get(key), "mapped" if given else DEFAULT, targets, note)

    # Placement: the hybrid engine puts every role on all ranks.
    gpus = get("trainer.nnodes", 1) * get("trainer.n_gpus_per_node", 8)
    put("trainer.n_gpus_per_node", {"colocate_groups": [["train", "rollout"]], "train_gpus": gpus,
                                    "rollout_gpus": gpus}, "hybrid engine: nnodes * n_gpus_per_node ranks, colocated",
        "trainer.n_gpus_per_node" in flat)
    if "trainer.nnodes" in flat:
        put("trainer.nnodes", {}, "ranks = nnodes * n_gpus_per_node")
    # Batch sizes: prompts -> samples.
    n = get(f"{R}.n", 1)
    prompts = get("data.train_batch_size", 1024)
    mini = get(f"{A}.ppo_mini_batch_size", 256)
    put(f"{A}.ppo_mini_batch_size", {"global_batch_size": mini * n}, f"prompts * rollout.n={n} samples",
        f"{A}.ppo_mini_batch_size" in flat)
    if "data.train_batch_size" not in flat:
        put("data.train_batch_size", {"prompts_per_step": prompts}, "verl default", False)
    if f"{R}.n" not in flat:
        put(f"{R}.n", {"num_generations": 1}, "verl default", False)
    tp, pp = get(f"{A}.megatron.tensor_model_parallel_size", 1), get(f"{A}.megatron.pipeline_model_parallel_size", 1)
    cp = get(f"{A}.megatron.context_parallel_size", 1) * get(f"{A}.ulysses_sequence_parallel_size", 1)
    dp = max(gpus // (tp * pp * cp), 1)
    if get(f"{A}.use_dynamic_bsz"):
        put(f"{A}.use_dynamic_bsz", {"max_tokens_per_micro_batch": get(f"{A}.ppo_max_token_len_per_gpu", 16384)},
            "micro-batches by tokens per rank")
    elif f"{A}.ppo_micro_batch_size_per_gpu" in flat and flat[f"{A}.ppo_micro_batch_size_per_gpu"] is not None:
        put(f"{A}.ppo_micro_batch_size_per_gpu", {"micro_batch_size": flat[f"{A}.ppo_micro_batch_size_per_gpu"]})
    elif get(f"{A}.ppo_micro_batch_size"):
        total = flat[f"{A}.ppo_micro_batch_size"]
        if total % dp:
            ctx.fail(f"{A}.ppo_micro_batch_size", f"{total} (over all ranks) is not divisible by the {dp} "
                                                  f"data-parallel ranks")
        put(f"{A}.ppo_micro_batch_size", {"micro_batch_size": total // dp}, f"over all ranks / {dp} data-parallel")
    else:
        per_rank = max(mini * n // dp, 1)
        out.set("(micro-batch size omitted)", None, DEFAULT, {"micro_batch_size": per_rank},
                "one micro-batch per mini-batch and rank")
    _backend_defaults(out, flat)
    if get("data.filter_overlong_prompts"):  # verl filters before data.truncation could apply to any row
        out.values["truncation"] = "drop"
    # Clip: clip_ratio is both bounds unless clip_ratio_low/high are set.
    clip = get(f"{A}.clip_ratio", 0.2)
    targets = {}
    if get(f"{A}.clip_ratio_low") is None:
        targets["clip_eps_low"] = clip
    if get(f"{A}.clip_ratio_high") is None:
        targets["clip_eps_high"] = clip
    put(f"{A}.clip_ratio", targets, "", f"{A}.clip_ratio" in flat)
    # KL: in the reward (use_kl_in_reward) or in the loss (use_kl_loss).
    in_reward, in_loss = flat.get("algorithm.use_kl_in_reward"), flat.get(f"{A}.use_kl_loss")
    legacy = in_reward is None and in_loss is None and any(k.startswith("algorithm.kl_ctrl.") for k in flat)
    if legacy:
        in_reward = True
    if in_reward and in_loss:
        ctx.fail("algorithm.use_kl_in_reward", "and actor.use_kl_loss are both on: megarl applies one KL term")
    if in_reward:
        kind = get("algorithm.kl_ctrl.type", "fixed")
        if kind not in ("fixed", "adaptive"):
            ctx.fail("algorithm.kl_ctrl.type", f"{kind!r}: megarl has fixed and adaptive")
        targets = {"kl_placement": "reward", "kl_coef": get("algorithm.kl_ctrl.kl_coef", 0.001),
                   "kl_estimator": KL_NAMES[get("algorithm.kl_penalty", "kl")], "kl_controller": kind}
        if kind == "adaptive":
            targets.update(kl_target=get("algorithm.kl_ctrl.target_kl", 0.1),
                           kl_horizon=get("algorithm.kl_ctrl.horizon", 10000))
        put("algorithm.use_kl_in_reward", targets,
            "verl before use_kl_in_reward: the KL penalty is in the reward" if legacy else "KL in the reward")
    elif in_loss:
        put(f"{A}.use_kl_loss", {"kl_placement": "loss", "kl_coef": get(f"{A}.kl_loss_coef", 0.001),
                                 "kl_estimator": KL_NAMES[get(f"{A}.kl_loss_type", "low_var_kl")]}, "KL in the loss")
    else:
        put("algorithm.use_kl_in_reward", {"kl_coef": 0.0}, "no KL term", "algorithm.use_kl_in_reward" in flat)
    # Run length and the LR schedule.
    if get("trainer.total_training_steps") is None:
        epochs = get("trainer.total_epochs", 30)
        put("trainer.total_epochs", {"train_epochs": epochs}, "passes over the data set",
            "trainer.total_epochs" in flat)
    ratio = get(f"{A}.optim.lr_warmup_steps_ratio", 0.0)
    if get(f"{A}.optim.lr_warmup_steps", -1) < 0 and ratio:
        put(f"{A}.optim.lr_warmup_steps_ratio", {"lr_warmup_ratio": ratio}, "of all optimizer steps")
    for dest, key, value in (("lr", f"{A}.optim.lr", 1e-6), ("weight_decay", f"{A}.optim.weight_decay", 0.01),
                             ("advantage_estimator", "algorithm.adv_estimator", "gae"),
                             ("max_prompt_length", "data.max_prompt_length", 512),
                             ("max_new_tokens", "data.max_response_length", 512),
                             ("dual_clip_c", f"{A}.clip_ratio_c", 3.0)):
        if dest not in out.values:
            out.set(key, None, DEFAULT, {dest: value}, "verl default")
    # Rewards: the reward model alone, or the rule rewards routed by data_source.
    if get("reward_model.enable"):
        path = get("reward_model.model.path")
        if not path:
            ctx.fail("reward_model.model.path", "reward_model.enable needs the reward model's path")
        put("reward_model.enable", {"reward": "rm", "reward_model": expand_path(path)}, "scores with the RM alone")
    elif _verl_scorer(get("custom_reward_function.path"), get("custom_reward_function.name")):
        reward = _verl_scorer(get("custom_reward_function.path"), get("custom_reward_function.name"))
        put("custom_reward_function.path", {"reward": reward, "system_prompt": ""},
            f"verl's own scorer module: megarl's `{reward}` reward for every row")
    else:
        out.set("(rule reward)", None, DEFAULT, {"reward": "verl_data_source", "system_prompt": ""},
                "verl's rule rewards by data_source; no system prompt added")
    if get("reward_model.overlong_buffer.enable"):
        put("reward_model.overlong_buffer.len", {"overlong_buffer_len": get("reward_model.overlong_buffer.len", 0)})
    buffer = "reward_model.reward_kwargs.overlong_buffer_cfg"
    if get(f"{buffer}.enable"):  # DAPO's reward manager: -(L - (max_resp_len - len)) / len * penalty_factor
        limit = get("reward_model.reward_kwargs.max_resp_len", get("data.max_response_length", 512))
        if limit != get("data.max_response_length", 512):
            ctx.fail("reward_model.reward_kwargs.max_resp_len", f"{limit} differs from data.max_response_length: "
                                                                 f"megarl counts the buffer back from the latter")
        put(f"{buffer}.len", {"overlong_buffer_len": get(f"{buffer}.len", 0),
                              "overlong_penalty_factor": float(get(f"{buffer}.penalty_factor", 1.0))},
            "DAPO's soft overlong penalty, times penalty_factor")
    # Rollout importance sampling (older key names).
    if get("algorithm.rollout_is"):
        put("algorithm.rollout_is", {"tis_level": get("algorithm.rollout_is_level", "token"),
                                     "tis_mode": get("algorithm.rollout_is_mode", "truncate")})
    template = {key[len("data.apply_chat_template_kwargs."):]: value for key, value in flat.items()
                if key.startswith("data.apply_chat_template_kwargs.")}
    if template:
        for key in template:
            put(f"data.apply_chat_template_kwargs.{key}", {"chat_template_kwargs": template},
                "every chat-template rendering")
    # vLLM engine arguments.
    for key, value in flat.items():
        if key.startswith(f"{R}.engine_kwargs.vllm."):
            name = key[len(f"{R}.engine_kwargs.vllm."):]
            if name.split(".")[0] in VLLM_MULTIMODAL:
                out.set(key, value, IGNORED, {}, "vLLM's multimodal settings (megarl is text only)")
            else:
                put(key, {f"rollout_engine_kwargs.{name}": value})
    megatron_backend = any(key.startswith(f"{A}.megatron.") for key in flat)
    if f"{A}.megatron.sequence_parallel" not in flat and megatron_backend and tp > 1:
        # ppo_megatron_trainer.yaml's default (megatron.sequence_parallel: True), which Megatron's MoE needs at TP > 1
        out.set(f"{A}.megatron.sequence_parallel", True, DEFAULT, {"sequence_parallel": True},
                "verl's Megatron back-end default")
    elif get(f"{A}.megatron.sequence_parallel") and "sequence_parallel" in megarl_options and tp > 1:
        put(f"{A}.megatron.sequence_parallel", {"sequence_parallel": True})
    elif f"{A}.megatron.sequence_parallel" in flat:
        out.set(f"{A}.megatron.sequence_parallel", flat[f"{A}.megatron.sequence_parallel"], "ignored", {},
                "no sequence parallelism in megarl yet, or TP 1")
    if "trainer.test_freq" in flat:
        if out.values.get("eval_dataset"):
            put("trainer.test_freq", {"eval_interval": max(get("trainer.test_freq", -1), 0)}, "-1: after the last step")
        else:
            out.set("trainer.test_freq", flat["trainer.test_freq"], "ignored", {}, "no data.val_files to evaluate")
    # Checkpoints: verl saves every save_freq steps (-1, its default: never) into trainer.default_local_dir,
    # which defaults to checkpoints/${trainer.project_name}/${trainer.experiment_name} (verl_examples / gsm8k),
    # and resume_mode auto (its default) resumes from the newest checkpoint there.
    if "trainer.default_local_dir" not in flat:
        directory = f"checkpoints/{get('trainer.project_name', 'verl_examples')}/" \
                    f"{get('trainer.experiment_name', 'gsm8k')}"
        out.set("trainer.default_local_dir", directory, DEFAULT, {"save_dir": expand_path(directory)},
                "verl's default: checkpoints/${trainer.project_name}/${trainer.experiment_name}")
    # Logging and resuming.
    if "trainer.save_freq" not in flat:
        out.set("trainer.save_freq", -1, DEFAULT, {"save_interval": -1}, "verl default: nothing is saved")
    loggers = as_list(get("trainer.logger", ["console", "wandb"]))  # verl's default logs to wandb
    if "wandb" in loggers:
        put("trainer.logger", {"wandb_project": get("trainer.project_name", "verl_examples"),
                               "wandb_name": get("trainer.experiment_name", "gsm8k")},
            "wandb: the project and run name", "trainer.logger" in flat)
    elif "trainer.logger" in flat:
        out.set("trainer.logger", flat["trainer.logger"], "ignored", {}, "console and TensorBoard are always on")
    if "trainer.project_name" in flat and "wandb" not in loggers:
        out.set("trainer.project_name", flat["trainer.project_name"], "ignored", {}, "wandb project (no wandb logger)")
    mode = get("trainer.resume_mode", "auto")
    if mode == "resume_path":
        put("trainer.resume_mode", {"resume": expand_path(get("trainer.resume_from_path", ""))})
    elif mode in ("auto", "disable"):
        if "save_dir" in out.values or mode == "disable":
            put("trainer.resume_mode", {"resume": "auto" if mode == "auto" else "none"},
                "", "trainer.resume_mode" in flat)
        elif "trainer.resume_mode" in flat:
            out.set("trainer.resume_mode", mode, "ignored", {}, "no checkpoint directory to resume from")
    else:
        ctx.fail("trainer.resume_mode", f"{mode!r}: verl has auto, disable and resume_path")


# Where the keys that are read together with others end up (docs/migrating.md's table).
SEMANTICS = {
    f"{A}.ppo_mini_batch_size": "`global_batch_size` = ppo_mini_batch_size x rollout.n samples",
    f"{A}.ppo_micro_batch_size": "`micro_batch_size` = it / data-parallel ranks (it counts over all ranks)",
    f"{A}.ppo_micro_batch_size_per_gpu": "`micro_batch_size`",
    f"{A}.use_dynamic_bsz": "`max_tokens_per_micro_batch` = ppo_max_token_len_per_gpu",
    f"{A}.ppo_max_token_len_per_gpu": "`max_tokens_per_micro_batch` (with use_dynamic_bsz)",
    f"{A}.clip_ratio": "`clip_eps_low` and `clip_eps_high` (unless clip_ratio_low / clip_ratio_high)",
    f"{A}.use_kl_loss": "`kl_placement` loss with `kl_coef` = kl_loss_coef, `kl_estimator` = kl_loss_type",
    f"{A}.kl_loss_coef": "`kl_coef` (with use_kl_loss)",
    f"{A}.optim.lr_warmup_steps_ratio": "`lr_warmup_ratio` (when lr_warmup_steps is -1)",
    f"{A}.megatron.sequence_parallel": "`sequence_parallel` where megarl has it and TP > 1",
    f"{R}.engine_kwargs.vllm.*": "`rollout_engine_kwargs`",
    "reward_model.enable": "`reward` rm and `reward_model` = reward_model.model.path; off: `reward` "
                           "verl_data_source, `system_prompt` ''",
    "reward_model.model.path": "`reward_model` (with enable)",
    "reward_model.overlong_buffer.enable": "`overlong_buffer_len` = overlong_buffer.len",
    "reward_model.overlong_buffer.len": "`overlong_buffer_len` (with enable)",
    "algorithm.use_kl_in_reward": "`kl_placement` reward with kl_ctrl's coefficient and controller (a file without "
                                  "the key and without use_kl_loss: on, as verl then did)",
    "algorithm.kl_ctrl.type": "`kl_controller` (fixed, adaptive)",
    "algorithm.kl_ctrl.kl_coef": "`kl_coef` (KL in the reward)",
    "algorithm.kl_ctrl.horizon": "`kl_horizon`",
    "algorithm.kl_ctrl.target_kl": "`kl_target`",
    "algorithm.rollout_is": "`tis_level` / `tis_mode` from rollout_is_level / rollout_is_mode",
    "algorithm.rollout_is_level": "`tis_level`", "algorithm.rollout_is_mode": "`tis_mode`",
    "trainer.total_epochs": "`train_epochs` (default 30; unless total_training_steps)",
    "trainer.project_name": "`wandb_project` (logger wandb); the default checkpoint directory",
    "trainer.experiment_name": "`wandb_name` (logger wandb); the default checkpoint directory",
    "trainer.logger": "wandb (in verl's default, console + wandb): `wandb_project`, `wandb_name`; console and "
                      "TensorBoard are always on",
    "trainer.nnodes": "`train.gpus` = `rollout.gpus` = nnodes x n_gpus_per_node, colocated",
    "trainer.n_gpus_per_node": "`train.gpus` = `rollout.gpus` = nnodes x n_gpus_per_node (default 8), colocated",
    "trainer.resume_mode": "`resume`: auto, disable -> none, resume_path -> resume_from_path",
    "trainer.resume_from_path": "`resume` (resume_mode resume_path)",
    "trainer.test_freq": "`eval_interval` (with val_files; -1: after the last step)",
    f"{F}.lora_rank": "`lora_rank` (FSDP back-end, PEFT; 0: off)",
    f"{F}.lora_alpha": "`lora_alpha` (default 16; rank 0: ignored)",
    f"{F}.lora_dropout": "`lora_dropout` (default 0)",
    f"{F}.target_modules": "`lora_target_modules` (default all-linear)",
    f"{F}.use_rslora": "`lora_alpha` = alpha x sqrt(rank): the same scale alpha / sqrt(rank)",
    f"{F}.lora.rank": "`lora_rank` (Megatron back-end; 0: off)",
    f"{F}.lora.alpha": "`lora_alpha` (default 32)",
    f"{F}.lora.dropout": "`lora_dropout` (default 0)",
    f"{F}.lora.target_modules": "`lora_target_modules` (default all four linears; canonical linear_q/k/v, "
                                "linear_fc1_gate/up -> q/k/v_proj, gate/up_proj)",
    f"{F}.lora.type": "lora (fused) or canonical_lora (one per HF module, as megarl's); dora, vlm_lora refused",
}
