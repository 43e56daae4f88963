"""ms-swift's Megatron RLHF configuration (`megatron rlhf --config x.yaml`, rlhf_type grpo or gkd), read as
ms-swift means it (swift/megatron/arguments/megatron_args.py, RLHFMegatronArgumentsMixin and
MegatronArguments; the Ray examples' role groups).

Semantics that differ from megarl's own and are applied here:
  * an omitted `colocate_groups` is the *separate* placement (train and rollout on disjoint ranks);
  * `beta` is the JSD interpolation of GKD (default 0.5) and the KL coefficient of GRPO (default 0.04);
  * `lmbda` (the on-policy fraction of GKD) defaults to 0.5; GKD samples one response per prompt;
  * `temperature` (default 0.9) is used for sampling and, in GKD, for the distillation loss;
  * batch sizes count completions (samples): generation_batch_size = global_batch_size *
    steps_per_generation, and prompts per generation = generation_batch_size / num_generations;
  * `train_iters` counts optimizer steps (megarl's train_steps count generation batches);
  * Megatron's optimizer defaults: cosine decay, weight decay 0.1, Adam beta2 0.95, distributed optimizer;
  * a `teacher_model` (or `teacher_model_server`) on a GRPO run is OPD-RL: the teacher's log-ratio enters the
    token rewards (`teacher_kl_coef`), not a distillation loss.
Role groups: `train.X` is X for the trainer; `rollout.vllm_X` and `teacher.vllm_X` are the vLLM settings
of the rollout and of the standalone teacher; `<role>.gpus` the rank counts; `teacher.model` the standalone
teacher's checkpoint.
"""

from __future__ import annotations

import json
import math

from megarl.config_formats.common import (
    DEFAULT, IGNORED, LORA_LAYOUT, Context, Rule, Translation, apply_table, custom, expand_path, ignore, ignore_all, informs,
    VIRTUAL_PIPELINE, lora_targets, refuse, routing_replay_mode, rslora_alpha, to,
)
from megarl.errors import ConfigError

ROLES = ("train", "rollout", "teacher")


def _engine_kwargs(role: str):
    def convert(value, ctx):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                ctx.fail(f"{role}.vllm_engine_kwargs", f"not valid JSON: {value!r}")
        if not isinstance(value, dict):
            ctx.fail(f"{role}.vllm_engine_kwargs", f"expected a mapping, got {value!r}")
        return {f"{role}_engine_kwargs.{key}": item for key, item in value.items()}
    return convert


def _vllm_rules(role: str) -> dict[str, Rule]:
    """ms-swift's vllm_* options for the rollout (top level or `rollout:`) or the teacher (`teacher:`)."""
    kw = f"{role}_engine_kwargs"
    return {
        "vllm_gpu_memory_utilization": to(f"{role}_gpu_memory_utilization"),
        "vllm_tensor_parallel_size": to(f"{role}_tensor_parallel_size"),
        "vllm_max_model_len": to(f"{kw}.max_model_len"),
        "vllm_enforce_eager": to(f"{kw}.enforce_eager"),
        "vllm_enable_prefix_caching": to(f"{kw}.enable_prefix_caching"),
        "vllm_disable_cascade_attn": to(f"{kw}.disable_cascade_attn"),
        "vllm_max_num_seqs": to(f"{kw}.max_num_seqs"),
        "vllm_engine_kwargs": custom(_engine_kwargs(role)),
        "vllm_limit_mm_per_prompt": ignore("multimodal inputs (megarl is text only)", refuse_if=bool),
        "vllm_mm_processor_cache_gb": ignore("multimodal inputs (megarl is text only)"),
        "vllm_enable_lora": custom(lambda value, ctx: {"lora_sync": "adapter"}
                                   if value and role == "rollout" and _tuner(ctx.source) == "lora" else {},
                                   "with tuner_type lora the engines serve the adapters with vLLM's LoRA and each "
                                   "sync sends the adapters alone (--lora-sync adapter); otherwise no meaning",
                                   dest="lora_sync"),
    }


def _reward_funcs(value, ctx):
    names = value if isinstance(value, list) else [value]
    weights = ctx.get("reward_weights") or [1.0] * len(names)
    if len(weights) != len(names):
        ctx.fail("reward_weights", f"{len(weights)} weights for {len(names)} reward_funcs")
    parts = []
    for name, weight in zip(names, weights):
        if name == "soft_overlong" and weight != 1.0:
            ctx.fail("reward_weights", f"soft_overlong weighted {weight:g}: megarl's overlong penalty "
                                       f"(--overlong-buffer-len) enters the score with weight 1")
        name = SWIFT_REWARDS.get(name, name)
        if name is None:
            continue  # soft_overlong: a length penalty, see soft_cache_length
        if name in UNMATCHED_REWARDS and not _own_plugins(ctx.get("external_plugins")):
            ctx.fail("reward_funcs", f"{name!r} is an ms-swift built-in reward megarl does not have; register one "
                                     f"under that name with external_plugins (@register_reward)")
        parts.append(f"{name}:{weight:g}" if weight != 1.0 else name)
    if ctx.get("reward_model"):
        parts.append("rm")
    return {"reward": ",".join(parts)} if parts else {}


# ms-swift's example plugin files whose entries megarl has built in: a recipe that loads one (it imports ms-swift,
# so megarl could not) reads as if it did not. Matched by the path's ending, as the recipes name them.
SWIFT_BUILT_IN_PLUGINS = {
    "examples/megatron/grpo/multi_turn/frozen_lake_plugin.py": "the frozen_lake gym environment (--gym-env frozen_lake)",
}


def _own_plugins(value) -> list[str]:
    """external_plugins less ms-swift's example plugins that megarl has built in (SWIFT_BUILT_IN_PLUGINS)."""
    paths = [] if value is None else value if isinstance(value, list) else [value]
    return [path for path in paths
            if not any(str(path).replace("\\", "/").endswith(bundled) for bundled in SWIFT_BUILT_IN_PLUGINS)]


# ms-swift's built-in reward names -> megarl's (None: not a reward in megarl, handled by another option).
# format, react_format, cosine and repetition keep their names (megarl/rewards/swift_rules.py).
SWIFT_REWARDS = {"accuracy": "boxed", "soft_overlong": None, "code_reward": "code"}
UNMATCHED_REWARDS = ("code_format",)

_LOSS_TYPES = {"grpo": "sample_level", "bnpo": "token_level", "dapo": "token_level",
               "dr_grpo": "seq_mean_token_sum_norm", "cispo": "token_level", "sapo": "sample_level"}
# loss types that are their own policy loss (ms-swift's swift/rlhf_trainers grpo loss: compute_per_token_loss),
# with its reduction (reduce_loss: cispo over the tokens, sapo over the samples)
_POLICY_LOSS_TYPES = ("cispo", "sapo")
_IS_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
             "sequence_truncate": ("sequence", "truncate"), "sequence_mask": ("sequence", "mask")}


def _loss_type(value, ctx):
    if value == "real":  # its on-policy gradient as advantages (megarl/algorithms.py, real_advantages)
        if ctx.get("advantage_estimator", "grpo") != "grpo":
            ctx.fail("advantage_estimator", f"{ctx.get('advantage_estimator')!r} with loss_type real: REAL splits "
                                            f"each group by grpo's advantage sign")
        return {"advantage_estimator": "real", "loss_agg": "sample_level"}
    if value == "fipo":
        ctx.fail("loss_type", f"{value!r} has no megarl counterpart yet (FIPO: future-KL influence weights; "
                              f"megarl: {', '.join(_LOSS_TYPES)}, real)")
    if value not in _LOSS_TYPES:
        ctx.fail("loss_type", f"{value!r} has no megarl counterpart (megarl: {', '.join(_LOSS_TYPES)})")
    if value not in _POLICY_LOSS_TYPES:
        return {"loss_agg": _LOSS_TYPES[value]}
    if ctx.get("importance_sampling_level", "token") != "token":
        ctx.fail("importance_sampling_level", f"{ctx.get('importance_sampling_level')!r} with loss_type {value}: "
                                              f"megarl's {value} uses the token ratio (token)")
    if ctx.get("delta") is not None:
        ctx.fail("delta", f"the dual clip applies to grpo-type losses; ms-swift ignores it with loss_type {value}")
    out = {"loss_agg": _LOSS_TYPES[value], "policy_loss": value}
    if value == "cispo":  # ms-swift caps the weight at epsilon_high itself: megarl at 1 + clip_eps_high
        cap = ctx.get("epsilon_high")
        if cap is None or cap <= 1.0:
            ctx.fail("epsilon_high", f"{cap if cap is not None else 'unset (epsilon)'} with loss_type cispo: ms-swift "
                                     f"caps the IS weight at epsilon_high itself, below 1 here; give the cap, "
                                     f"> 1 (ms-swift's docs use 5.0)")
        out["clip_eps_high"] = cap - 1.0
    return out


def _repetition_penalty(value, ctx):
    if value is None or value == 1.0:
        return {}
    if not ctx.get("rollout_importance_sampling_mode"):
        ctx.fail("repetition_penalty", f"{value}: vLLM samples from penalised logits the trained policy does not "
                                       f"have; set rollout_importance_sampling_mode to correct for them")
    return {"repetition_penalty": value}


def _is_mode(value, ctx):
    if value is None:
        return {}
    level, mode = _IS_MODES[value]
    return {"tis_level": level, "tis_mode": mode}


def _constant_weight_decay(key, value, ctx):
    """Megatron's start/end weight decay: the same as weight_decay (0.1 by default) under the constant style."""
    if value != ctx.get("weight_decay", 0.1):
        ctx.fail(key, f"{value} differs from weight_decay: megarl's weight decay is constant")
    return {}


def _truncation(value, ctx):
    if value in (None, "left", "right", "delete"):
        return {"truncation": "drop" if value == "delete" else value} if value else {}
    ctx.fail("truncation_strategy", f"{value!r} splits over-long rows; megarl stops on them, cuts them (left, "
                                    f"right) or leaves them out (delete)")


def _dataset(value, ctx):
    paths = []
    for item in value if isinstance(value, list) else [value]:
        path, mark, count = str(item).rpartition("#")
        if mark and not count.isdigit():
            ctx.fail("dataset", f"{item!r}: '#{count}' is not a row count (ms-swift's name#N)")
        # name#N: megarl's data loader draws N rows as ms-swift does (megarl/data/datasets.py sample_rows)
        paths.append(expand_path(path, "dataset") + f"#{count}" if mark else expand_path(str(item), "dataset"))
    return {"train_data": paths}


def _val_dataset(value, ctx):
    items = value if isinstance(value, list) else [value]
    return {"eval_dataset": [f"val{i if len(items) > 1 else ''}={expand_path(str(p), 'val_dataset')}"
                             for i, p in enumerate(items)]} if items else {}


def _sleep_level(value, ctx):
    return {"rollout_sleep_level": 2} if value == 2 else {}


def _report_to(value, ctx):
    return {}


def _recompute(value, ctx):
    return {"recompute_granularity": None if value in (None, "none") else value}


def _not(value_ok):
    return lambda value: value not in value_ok


_INFORMS = informs()

TUNERS = "megarl trains every weight (full) or LoRA adapters (lora)"
LOAD_ADAPTER = ("adapters for the reference or in Megatron's format: megarl's LoRA reference is the base with the "
                "adapters off, and it loads PEFT adapter directories (adapters)")

# ms-swift's LoRA keys (tuner_type lora), read by _lora; with tuner_type full they are ignored.
LORA_TABLE: dict[str, Rule] = {
    "lora_rank": _INFORMS,
    "lora_alpha": _INFORMS,
    "lora_dropout": _INFORMS,
    "target_modules": _INFORMS,
    "use_rslora": _INFORMS,
    "lora_bias": ignore("none: the biases stay frozen", refuse_if=_not((None, "none")),
                        refusal="trainable biases (lora_bias all): megarl trains the adapters alone"),
    "lora_dtype": ignore("the adapters are kept in the parameters' dtype", refuse_if=lambda v: v is not None),
    "target_regex": ignore("none", refuse_if=bool,
                           refusal="a regular expression over module paths: name the modules in target_modules"),
    "modules_to_save": ignore("none", refuse_if=bool,
                              refusal="training whole modules beside the adapters: megarl trains the adapters alone"),
    "use_dora": ignore("off", refuse_if=bool, refusal="DoRA has no megarl counterpart (plain LoRA)"),
    "init_weights": ignore("PEFT's initialisation (A uniform, B zero)", refuse_if=_not((None, True, "true")),
                           refusal="megarl initialises the adapters as PEFT does by default (A uniform, B zero)"),
}


def _scheduler(value, ctx) -> dict:
    """multi_turn_scheduler: an interaction of megarl's, or gym_scheduler, whose environment gym_env names."""
    if value == "gym_scheduler":
        if not ctx.get("gym_env"):
            ctx.fail("multi_turn_scheduler", "gym_scheduler needs gym_env, the environment it runs")
        return {}
    return {"interaction": value} if value else {}


TABLE: dict[str, Rule] = {
    # what the run is
    "rlhf_type": custom(lambda v, ctx: {}, refuse_if=_not(("grpo", "gkd")),
                        refusal="megarl trains online RL (grpo) and distillation (gkd) only"),
    "colocate_groups": _INFORMS,
    "model": to("model", expand_path),
    "teacher_model": to("teacher_model", expand_path),
    "ref_model": to("ref_model", expand_path),
    "external_plugins": custom(lambda v, ctx: {"external_plugins": [expand_path(p) for p in _own_plugins(v)]}
                               if _own_plugins(v) else {},
                               "ms-swift's example plugins megarl has built in are left out: "
                               + "; ".join(f"{path}: {what}" for path, what in SWIFT_BUILT_IN_PLUGINS.items()),
                               dest="external_plugins"),
    "teacher_model_server": to("teacher_server"),
    "teacher_tag_key": ignore("multi-teacher routing over teacher servers"),
    "tuner_type": custom(lambda v, ctx: {}, refuse_if=_not(("full", "lora")), refusal=TUNERS),
    "train_type": custom(lambda v, ctx: {}, refuse_if=_not(("full", "lora")), refusal=TUNERS),
    "task_type": ignore("causal LM is megarl's task", refuse_if=_not((None, "causal_lm"))),
    # GKD
    "gkd_logits_topk": to("gkd_logits_topk", lambda v: v or 0),
    "lmbda": custom(lambda v, ctx: {"gkd_lmbda": v} if ctx.get("rlhf_type") == "gkd" else {},
                    "gkd: `gkd_lmbda` (a GRPO run has no off-policy steps: ignored)"),
    "seq_kd": to("seq_kd"),
    "offload_teacher_model": to("offload_teacher_model"),
    "sft_alpha": to("sft_alpha", note="cross-entropy on the dataset's responses, on the off-policy steps"),
    "teacher_kl_coef": _INFORMS,
    "beta": _INFORMS,
    "temperature": _INFORMS,
    # generation and GRPO
    "num_generations": _INFORMS,
    "generation_batch_size": _INFORMS,
    "steps_per_generation": _INFORMS,
    "global_batch_size": _INFORMS,
    "train_iters": _INFORMS,
    "num_generations_eval": to("eval_samples"),
    "max_completion_length": to("max_new_tokens"),
    "max_length": to("max_prompt_length"),
    "importance_sampling_level": custom(lambda v, ctx: ({} if ctx.get("loss_type") in _POLICY_LOSS_TYPES else
                                                        {"policy_loss": {"token": "ppo_clip", "sequence": "gspo"}[v]})
                                        if v in ("token", "sequence") else ctx.fail(
                                            "importance_sampling_level", f"{v!r} has no megarl policy loss "
                                                                         f"(token: ppo_clip, sequence: gspo)")),
    "epsilon": to("clip_eps_low"),
    "epsilon_high": custom(
        lambda v, ctx: {} if v is None or ctx.get("loss_type") == "cispo" else {"clip_eps_high": v},
        "cispo: the weight cap, clip_eps_high = epsilon_high - 1", dest="clip_eps_high"),
    "delta": to("dual_clip_c", note="two-sided clipping of negative-advantage ratios (dual clip)"),
    "top_k": to("top_k"),
    "top_p": to("top_p"),
    "repetition_penalty": custom(_repetition_penalty,
                                 "the engine's penalised logprobs correct it (--tis-level)",
                                 refuse_if=lambda v: v is not None and v <= 0,
                                 refusal="a repetition penalty is > 0 (1: none)", dest="repetition_penalty"),
    "use_vllm": ignore("megarl always generates with vLLM", refuse_if=lambda v: not v),
    "use_ray": ignore("Ray orchestration: megarl runs every role under torchrun"),
    "vllm_mode": ignore("the placement: colocate, every rank; server, the separate placement",
                        refuse_if=_not((None, "colocate", "server"))),
    "sleep_level": custom(_sleep_level, "megarl has no level 0: it reads as level 1"),
    "offload_optimizer": to("offload_optimizer"),
    "offload_model": to("offload_model"),
    "offload_bridge": ignore("mcore-bridge export buffers"),
    "reward_funcs": custom(_reward_funcs),
    "reward_weights": _INFORMS,
    "reward_model": to("reward_model", lambda v: expand_path(v[0] if isinstance(v, list) else v)),
    "reward_model_plugin": refuse("reward model plugins: register a reward with external_plugins"),
    "soft_max_length": _INFORMS,
    "tau_pos": to("sapo_tau_pos"),
    "tau_neg": to("sapo_tau_neg"),
    "cosine_min_len_value_wrong": to("cosine_min_len_value_wrong"),
    "cosine_max_len_value_wrong": to("cosine_max_len_value_wrong"),
    "cosine_min_len_value_correct": to("cosine_min_len_value_correct"),
    "cosine_max_len_value_correct": to("cosine_max_len_value_correct"),
    "cosine_max_len": to("cosine_max_len"),
    "repetition_n_grams": to("repetition_n_grams"),
    "repetition_max_penalty": to("repetition_max_penalty"),
    "soft_cache_length": _INFORMS,
    "dynamic_sample": custom(lambda v, ctx: {"dynamic_sampling": [0.0, 1.0]} if v else {},
                             "keeps groups whose rewards differ"),
    "max_resample_times": to("max_num_gen_batches", lambda v: v + 1, "extra generation batches + the first"),
    "overlong_filter": to("filter_truncated"),
    "scale_rewards": to("scale_rewards", refuse_if=lambda v: v == "gdpo",
                        refusal="per-reward normalisation (gdpo) has no megarl counterpart"),
    "advantage_estimator": to("advantage_estimator"),
    "kl_in_reward": to("kl_placement", lambda v: "reward" if v else "loss"),
    "loss_type": custom(_loss_type),
    "real_tau": to("real_tau"),
    "rollout_importance_sampling_mode": custom(_is_mode),
    "rollout_importance_sampling_threshold": to("tis_threshold"),
    "off_policy_sequence_mask_delta": ignore("off", refuse_if=lambda v: v is not None),
    "top_entropy_quantile": ignore("1.0 trains on every token", refuse_if=lambda v: v != 1.0),
    "router_replay_mode": routing_replay_mode(),
    "sync_ref_model": ignore("the reference stays frozen", refuse_if=bool),
    "async_generate": to("async_generation"),
    "num_iterations": to("ppo_epochs"),
    "multi_turn_scheduler": custom(_scheduler,
                                   "the `interaction` of that name: math_tip_trick_multi_turn (the tip as a user "
                                   "turn, once), math_tip_trick (the answer cut at <answer>, the tip appended in "
                                   "the assistant's own turn for it to go on, once); gym_scheduler: the gym "
                                   "environment gym_env names (--gym-env, megarl/tools/environments.py)",
                                   refuse_if=lambda v: v not in (None, "", "math_tip_trick_multi_turn",
                                                                 "math_tip_trick", "gym_scheduler"),
                                   refusal="megarl maps math_tip_trick, math_tip_trick_multi_turn (--interaction) "
                                           "and gym_scheduler (--gym-env); a custom scheduler is an --interaction "
                                           "or tool plugin in megarl"),
    "max_turns": to("max_turns"),
    "use_gym_env": ignore("gym_scheduler runs the environment gym_env names"),
    "gym_env": custom(lambda v, ctx: {} if v is None else {"gym_env": v},
                      "`gym_env`, with multi_turn_scheduler gym_scheduler: the gym environment of that name "
                      "(megarl/tools/environments.py: built in, frozen_lake; plugins register more)"),
    "enable_thinking": custom(lambda v, ctx: {} if v is None else {"chat_template_kwargs": {"enable_thinking": v}},
                              "`chat_template_kwargs` enable_thinking (Qwen3's template)"),
    "log_interval": to("log_interval"),
    "moe_aux_loss_coeff": to("moe_aux_loss_coeff"),
    "moe_z_loss_coeff": to("moe_z_loss_coeff"),
    "moe_router_load_balancing_type": ignore("aux_loss (Switch's, per micro-batch)",
                                             refuse_if=lambda v: v not in (None, "aux_loss", "none"),
                                             refusal="megarl's load-balancing loss is aux_loss (moe_aux_loss_coeff)"),
    "moe_expert_capacity_factor": to("moe_expert_capacity_factor", note="token dropping in the trainer"),
    "moe_token_drop_policy": to("moe_token_drop_policy"),
    **{key: ignore("MoE performance settings megarl sets itself (dispatcher, overlap, recomputation, padding)")
       for key in ("moe_router_dtype", "moe_token_dispatcher_type", "moe_enable_deepep", "moe_shared_expert_overlap",
                   "moe_layer_recompute", "moe_pad_expert_input_to_capacity")},
    "manual_gc_interval": ignore("Python's garbage collector (megarl collects at start-up only)"),
    "gradient_checkpointing_kwargs": ignore("recomputation: recompute_granularity"),
    "load_safetensors": ignore("megarl reads the HF checkpoint's safetensors (mcore-bridge loading)"),
    # training
    "micro_batch_size": to("micro_batch_size"),
    "recompute_granularity": custom(_recompute),
    "recompute_method": to("recompute_method"),
    "recompute_num_layers": to("recompute_num_layers"),
    "recompute_modules": ignore("selective recomputation covers the core attention",
                                refuse_if=lambda v: v not in (None, ["core_attn"], "core_attn")),
    "num_train_epochs": to("train_epochs"),
    "max_epochs": to("train_epochs"),
    "seed": to("seed"),
    "padding_free": to("padding_free"),
    "lr": to("lr"),
    "learning_rate": to("lr"),
    "lr_decay_style": to("lr_decay_style"),
    "lr_warmup_iters": to("lr_warmup_steps"),
    "lr_warmup_fraction": to("lr_warmup_ratio", lambda v: v or 0.0),
    "lr_warmup_init": ignore("warm-up starts from 0", refuse_if=bool),
    "lr_decay_iters": ignore("decay runs over the whole run", refuse_if=lambda v: v is not None),
    "min_lr": to("min_lr"),
    "weight_decay": to("weight_decay"),
    "weight_decay_incr_style": ignore("constant weight decay", refuse_if=_not(("constant",))),
    "start_weight_decay": custom(lambda v, ctx: _constant_weight_decay("start_weight_decay", v, ctx),
                                 "constant weight decay: must equal weight_decay"),
    "end_weight_decay": custom(lambda v, ctx: _constant_weight_decay("end_weight_decay", v, ctx),
                               "constant weight decay: must equal weight_decay"),
    "clip_grad": to("clip_grad"),
    "max_grad_norm": to("clip_grad"),
    "adam_beta1": to("adam_beta1"),
    "adam_beta2": to("adam_beta2"),
    "adam_eps": ignore("1e-8, Megatron's default", refuse_if=lambda v: float(v) != 1e-8),
    "optimizer": ignore("Adam", refuse_if=_not(("adam",))),
    "use_distributed_optimizer": to("use_distributed_optimizer"),
    "tensor_model_parallel_size": to("tensor_model_parallel_size"),
    "pipeline_model_parallel_size": to("pipeline_model_parallel_size"),
    "context_parallel_size": to("context_parallel_size"),
    "sequence_parallel": _INFORMS,
    "expert_model_parallel_size": to("expert_model_parallel_size"),
    "expert_tensor_parallel_size": ignore("1: each expert whole on its EP rank", refuse_if=lambda v: v not in (None, 1),
                                          refusal="megarl keeps each expert whole on its EP rank "
                                                  "(expert_tensor_parallel_size 1)"),
    "virtual_pipeline_model_parallel_size": ignore(VIRTUAL_PIPELINE),
    "decoder_first_pipeline_num_layers": ignore("even split", refuse_if=lambda v: v is not None),
    "decoder_last_pipeline_num_layers": ignore("even split", refuse_if=lambda v: v is not None),
    "pipeline_model_parallel_layout": ignore("even split", refuse_if=lambda v: v is not None),
    "use_megatron_fsdp": ignore("Megatron DDP", refuse_if=bool),
    "fp16": to("fp16"),
    "bf16": to("bf16"),
    "torch_dtype": to("params_dtype", lambda v: str(v).replace("torch.", "")),
    "fp8_format": ignore("no FP8 training", refuse_if=lambda v: v is not None),
    "fp4_format": ignore("no FP4 training", refuse_if=lambda v: v is not None),
    "mtp_num_layers": ignore("no multi-token prediction", refuse_if=lambda v: v is not None),
    "megatron_extra_kwargs": ignore("", refuse_if=bool),
    "rope_scaling": ignore("from the model's config.json", refuse_if=lambda v: v is not None),
    "enable_dft_loss": ignore("", refuse_if=bool),
    "enable_channel_loss": ignore("", refuse_if=bool),
    "freeze_llm": ignore("every weight trains", refuse_if=bool),
    "freeze_parameters": ignore("every weight trains", refuse_if=bool),
    "freeze_parameters_regex": ignore("every weight trains", refuse_if=bool),
    "freeze_parameters_ratio": ignore("every weight trains", refuse_if=bool),
    "trainable_parameters": ignore("every weight trains", refuse_if=bool),
    "trainable_parameters_regex": ignore("every weight trains", refuse_if=bool),
    "adapters": to("lora_load", lambda v: v[0] if isinstance(v, list) else v,
                   note="the trained adapter the LoRA run starts from (its r, alpha and targets)",
                   refuse_if=lambda v: isinstance(v, list) and len(v) > 1,
                   refusal="megarl starts from one adapter directory (--lora-load DIR)"),
    "ref_adapters": ignore("none", refuse_if=bool, refusal=LOAD_ADAPTER),
    "mcore_model": ignore("megarl loads HF checkpoints", refuse_if=lambda v: v is not None),
    "mcore_adapter": ignore("none", refuse_if=lambda v: v is not None, refusal=LOAD_ADAPTER),
    "mcore_ref_model": ignore("megarl loads HF checkpoints", refuse_if=lambda v: v is not None),
    "mcore_ref_adapter": ignore("none", refuse_if=lambda v: v is not None, refusal=LOAD_ADAPTER),
    # data
    "dataset": custom(_dataset),
    "val_dataset": custom(_val_dataset),
    "split_dataset_ratio": ignore("0: no split", refuse_if=bool),
    "system": to("system_prompt"),
    "truncation_strategy": custom(_truncation),
    "columns": ignore("", refuse_if=bool),
    "streaming": ignore("", refuse_if=bool),
    "custom_dataset_info": ignore("", refuse_if=bool),
    "new_special_tokens": ignore("", refuse_if=bool),
    # checkpoints and logs
    "output_dir": to("save_dir", expand_path),
    "save_steps": _INFORMS,
    "save_total_limit": to("save_keep"),
    "no_save_optim": to("no_save_optim"),
    "no_save_rng": to("no_save_rng"),
    "no_load_optim": ignore("a resumed run loads what the checkpoint holds", refuse_if=bool),
    "no_load_rng": ignore("a resumed run loads what the checkpoint holds", refuse_if=bool),
    "save_strategy": ignore("steps", refuse_if=_not(("steps",))),
    "logging_steps": to("log_interval"),
    "tensorboard_dir": to("log_dir", expand_path),
    "report_to": custom(_report_to, "wandb when it lists wandb"),
    "wandb_project": _INFORMS,
    "wandb_exp_name": to("wandb_name"),
    "eval_steps": _INFORMS,
    "ddp_timeout": to("distributed_timeout_minutes", lambda v: v / 60.0, "seconds -> minutes"),
    **_vllm_rules("rollout"),
    **ignore_all("Megatron kernel and fusion switches (megarl picks its kernels, --kernels)", [
        "masked_softmax_fusion", "bias_dropout_fusion", "bias_activation_fusion", "apply_rope_fusion",
        "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
        "attention_backend", "attn_impl", "moe_grouped_gemm", "moe_permute_fusion", "apply_query_key_layer_scaling",
        "attention_softmax_in_fp32", "accumulate_allreduce_grads_in_fp32", "te_rng_tracker", "mlp_padding_free",
        "sequence_packing_scheduler"]),
    **ignore_all("communication overlap and memory tuning (performance only)", [
        "overlap_grad_reduce", "overlap_param_gather", "overlap_param_gather_with_optimizer_step", "align_grad_reduce",
        "align_param_gather", "overlap_p2p_comm", "batch_p2p_comm", "tp_comm_overlap", "nccl_comm_warmup",
        "cp_comm_type", "cp_partition_mode", "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split", "microbatch_group_size_per_vp_stage", "optimizer_cpu_offload",
        "optimizer_offload_fraction", "optimizer_cuda_graph", "use_precision_aware_optimizer", "main_grads_dtype",
        "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "manual_gc", "manual_gc_steps", "manual_gc_eval",
        "calculate_per_token_loss", "data_parallel_sharding_strategy", "move_model_batches"]),
    **ignore_all("data loading workers and caches (megarl reads the files once, in memory)", [
        "dataset_num_proc", "load_from_cache_file", "dataloader_num_workers", "dataloader_pin_memory",
        "dataloader_persistent_workers", "dataloader_prefetch_factor", "data_sharding", "lazy_tokenize",
        "train_dataloader_shuffle", "dataset_shuffle", "data_seed", "group_by_length", "data_parallel_random_init",
        "remove_unused_columns", "strict"]),
    **ignore_all("model hub, template and export settings (megarl reads a local HF directory and its tokenizer's "
                 "chat template)", [
        "model_type", "model_revision", "teacher_model_type", "teacher_model_revision", "use_hf", "hub_token",
        "template", "bridge_backend", "check_model", "save_safetensors", "max_shard_size", "merge_lora",
        "language_model_only", "loss_scale", "finetune", "perform_initialization", "use_cpu_initialization",
        "async_save", "use_persistent_ckpt_worker", "dist_ckpt_save_pre_mcore_014",
        "dist_ckpt_optim_fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient", "local_rank",
        "ddp_backend", "callbacks", "metric_for_best_model", "greater_is_better", "apply_wd_to_qk_layernorm",
        "linear_decoupled_in_proj", "num_labels", "problem_type", "mrl_dims"]),
    **ignore_all("logging back-ends and extra logs (megarl logs to TensorBoard, wandb, --rollout-save-dir)", [
        "log_completions", "wandb_log_unique_prompts", "log_entropy", "log_rollout_offpolicy_metrics",
        "tensorboard_queue_size", "swanlab_project", "swanlab_exp_name", "eval_iters"]),
    **ignore_all("the server's address (vllm_mode server: megarl's rollout ranks stand in for the server)", [
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "vllm_server_group_port", "vllm_server_pass_dataset"]),
    **ignore_all("options of loss types and rewards this config does not select", [
        "fipo_decay_rate", "fipo_clip_range", "fipo_clip_high_only",
        "fipo_safety_threshold", "ref_model_sync_steps", "ref_model_mixup_alpha", "completion_length_limit_scope",
        "rpo_alpha", "reference_free", "label_smoothing", "f_divergence_type", "desirable_weight",
        "undesirable_weight", "calculate_KL", "center_rewards_coefficient", "lr_wsd_decay_style",
        "lr_wsd_decay_iters", "fp8_recipe", "fp8_param_gather", "fp8_amax_history_len", "fp8_amax_compute_algo",
        "fp4_recipe", "fp4_param_gather", "mtp_loss_scaling_factor", "mtp_decoder_input_detach",
        "mtp_shared_weights", "sgd_momentum"]),
    **LORA_TABLE,
    **ignore_all("multimodal settings (megarl is text only)", [
        "freeze_vit", "freeze_aligner", "vit_gradient_checkpointing", "vit_gradient_checkpointing_kwargs",
        "vit_attn_impl", "vit_lr", "aligner_lr", "max_pixels"]),
}

# Role-group keys beside the top-level ones: `train.X` is X; these are the rest.
ROLE_TABLE: dict[str, Rule] = {
    "train.gpus": to("train_gpus"),
    "rollout.gpus": to("rollout_gpus"),
    "teacher.gpus": to("teacher_gpus"),
    "teacher.model": to("standalone_teacher_model", expand_path),
    **{f"rollout.{key}": rule for key, rule in _vllm_rules("rollout").items()},
    **{f"teacher.{key}": rule for key, rule in _vllm_rules("teacher").items()},
}



def parse_flags(tokens: list[str], where) -> dict:
    """`--key value [value ...]` (a bare `--flag` is true) as a config mapping; values read as YAML scalars."""
    import yaml

    from megarl.errors import ConfigError

    raw, key = {}, None
    for token in tokens:
        if token.startswith("--"):
            key, _, value = token[2:].partition("=")
            key = key.replace("-", "_")
            raw[key] = [] if not value else [value]
        elif key is None:
            raise ConfigError(f"{where}: {token!r} before any --option")
        else:
            raw[key].append(token)

    def scalar(text):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text

    return {k: True if not v else scalar(v[0]) if len(v) == 1 else [scalar(x) for x in v] for k, v in raw.items()}


def flatten(raw: dict, where: str) -> dict:
    from megarl.errors import ConfigError

    flat = {}
    for key, value in raw.items():
        key = str(key).replace("-", "_")
        if key in ROLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: role group '{key}' must be a mapping (e.g. gpus: 2)")
            for sub, sub_value in value.items():
                flat[f"{key}.{str(sub).replace('-', '_')}"] = sub_value
        else:
            flat[key] = value
    return flat


# ms-swift's Megatron arguments take Megatron-LM's names for some of its trainer keys: read as those keys.
MEGATRON_NAMES = {"save_interval": "save_steps", "eval_interval": "eval_steps", "num_workers": "dataloader_num_workers"}

# megarl flags that name a teacher: given after the config, ms-swift's "no teacher_model" is not self-distillation.
TEACHER_FLAGS = ("--teacher-model", "--standalone-teacher-model", "--teacher-gpus", "--teacher-server")


def translate(raw: dict, where: str, megarl_options, command_line: list[str] = (),
              server: dict | None = None) -> Translation:
    """`command_line`: megarl's flags given after the config (they win over it); `server`: the flags of the
    `swift rollout` command a launch script starts beside it (vllm_mode server)."""
    from megarl.config_formats.common import lookup

    flat = flatten(raw, where)
    if flat.get("vllm_mode") == "server":
        _server_settings(flat, server or {})
    used = {}
    for megatron_name, name in MEGATRON_NAMES.items():  # ms-swift's Megatron spellings of its own keys
        for prefix in ("", "train."):
            if prefix + megatron_name in flat:
                if prefix + name in flat:
                    raise ConfigError(f"{where}: {prefix + megatron_name} and {prefix + name} name one setting; "
                                      f"keep one")
                flat[prefix + name] = flat.pop(prefix + megatron_name)
                used[prefix + name] = prefix + megatron_name
    out = Translation("swift", where, how="ms-swift Megatron RLHF config")
    ctx = Context(flat, where)
    table = dict(TABLE)
    if _tuner(flat) != "lora":  # LoRA's keys mean nothing in a full fine-tuning run (ms-swift ignores them too)
        for key in LORA_TABLE:
            table[key] = ignore("LoRA settings (tuner_type full)")
    # `train.X` is the trainer's X: the top-level rule of X.
    top = dict(table)
    table.update(ROLE_TABLE)
    for key in flat:
        if key.startswith("train.") and key not in table and lookup(top, key[len("train."):]) is not None:
            table[key] = top[key[len("train."):]]
    rlhf = flat.get("rlhf_type")
    if rlhf is None:
        ctx.fail("rlhf_type", "missing: an ms-swift RLHF config names grpo or gkd")
    # ms-swift's arguments are dataclass fields whose null is "unset": ms-swift's own default (or the one its
    # __post_init__ computes) applies, as when the key is left out.
    for key in [key for key, value in flat.items() if value is None and key != "rlhf_type"]:
        out.set(key, None, IGNORED, {}, "null: ms-swift's default, as when left out")
        del flat[key]
    apply_table(out, table, flat, ctx)
    teacher_given = any(arg.split("=")[0] in TEACHER_FLAGS for arg in command_line)
    _semantics(out, flat, ctx, rlhf, megarl_options, teacher_given)
    for row in out.rows:
        row.key = used.get(row.key, row.key)
    return out


# The `swift rollout` server's engine settings that become the rollout role's (megarl's rollout ranks stand in
# for the server): its vLLM options, and its size, tensor x data parallel, as the rollout's rank count.
SERVER_ENGINE_KEYS = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_len",
                      "vllm_enforce_eager", "vllm_enable_prefix_caching", "vllm_max_num_seqs", "vllm_engine_kwargs")
SERVER_EPISODE_KEYS = ("multi_turn_scheduler", "max_turns", "use_gym_env", "gym_env")


def _server_settings(flat: dict, server: dict) -> None:
    """vllm_mode server: the trainer command's own vllm_* engine settings are the colocated engine's, unused
    by ms-swift with a server (dropped here); the server's (its `swift rollout` flags) are the rollout role's,
    `rollout.X`, unless the config gives those, and its GPU count (vllm_tensor_parallel_size x
    vllm_data_parallel_size, 1 x 1 by default) is rollout.gpus; its multi-turn scheduler is the run's."""
    for key in SERVER_ENGINE_KEYS:
        flat.pop(key, None)
    for key in SERVER_ENGINE_KEYS:
        if server.get(key) is not None:
            flat.setdefault(f"rollout.{key}", server[key])
    for key in SERVER_EPISODE_KEYS:  # the server runs the episodes: its scheduler is the run's
        if server.get(key) is not None:
            flat.setdefault(key, server[key])
    if server or "rollout.gpus" not in flat:
        flat.setdefault("rollout.gpus", (server.get("vllm_tensor_parallel_size") or 1) *
                        (server.get("vllm_data_parallel_size") or 1))


def _given(flat, key):
    return flat.get(key, flat.get(f"train.{key}"))


def _tuner(flat) -> str:
    """tuner_type (ms-swift 4) or train_type (ms-swift 3), top level or in the train group; default full."""
    for key in ("tuner_type", "train_type"):
        if _given(flat, key) is not None:
            return _given(flat, key)
    return "full"


# ms-swift's LoRA defaults (swift/megatron/arguments, tuner arguments).
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["all-linear"]}


def _lora(out: Translation, flat: dict, ctx: Context) -> None:
    """tuner_type lora: the adapters' rank, scale, dropout and targets, with ms-swift's defaults."""
    def value(key):
        given = _given(flat, key)
        return (LORA_DEFAULTS[key], DEFAULT) if given is None else (given, "mapped")

    rank, rank_status = value("lora_rank")
    if not isinstance(rank, int) or rank <= 0:
        ctx.fail("lora_rank", f"{rank!r}: tuner_type lora needs a rank > 0")
    out.set("lora_rank", rank, rank_status, {"lora_rank": rank})
    alpha, status = value("lora_alpha")
    if _given(flat, "use_rslora"):
        out.set("use_rslora", True, "mapped", {}, "rsLoRA's scale alpha / sqrt(rank) as megarl's alpha / rank")
        alpha = rslora_alpha(alpha, rank)
    out.set("lora_alpha", _given(flat, "lora_alpha"), status, {"lora_alpha": alpha}, "scale = alpha / rank")
    dropout, status = value("lora_dropout")
    out.set("lora_dropout", dropout, status, {"lora_dropout": dropout})
    targets, status = value("target_modules")
    key = "target_modules" if "target_modules" in flat else "train.target_modules"
    out.set("target_modules", _given(flat, "target_modules"), status,
            {"lora_target_modules": lora_targets(targets, key, ctx)}, LORA_LAYOUT)


def _semantics(out: Translation, flat: dict, ctx: Context, rlhf: str, megarl_options, teacher_given: bool) -> None:
    """What depends on several keys or on rlhf_type, and ms-swift's defaults where megarl's differ."""
    def put(key, value, targets, note="", status="mapped"):
        out.set(key, value, status, targets, note)

    def default(dest, value, why):
        if dest not in out.values:
            put(f"({why})", value, {dest: value}, status=DEFAULT)

    # Placement. Ray configs (role groups, use_ray): an omitted colocate_groups is the separate placement.
    # Without Ray, vLLM runs colocated on every rank (vllm_mode colocate) or as an external server.
    ray = flat.get("use_ray") or any("." in key for key in flat) or "colocate_groups" in flat
    if "colocate_groups" in flat:
        put("colocate_groups", flat["colocate_groups"], {"colocate_groups": flat["colocate_groups"] or []})
    elif flat.get("vllm_mode") == "server":  # a `swift rollout` server on GPUs of its own, synced every step
        default("colocate_groups", [], "vllm_mode server: the separate placement, rollout.gpus ranks in the "
                                       "server's place (launch train + rollout ranks)")
    elif ray:
        default("colocate_groups", [], "colocate_groups omitted: separate placement")
    else:
        default("colocate_groups", [["train", "rollout"]], "no Ray: vllm_mode colocate, every rank")
    if _tuner(flat) == "lora":
        _lora(out, flat, ctx)
    beta = flat.get("beta")
    temperature = _given(flat, "temperature")
    temperature = 0.9 if temperature is None else temperature
    put("temperature", temperature, {"temperature": temperature, **({"gkd_temperature": temperature}
                                                                     if rlhf == "gkd" else {})},
        "GKD: sampling and loss" if rlhf == "gkd" else "", "mapped" if _given(flat, "temperature") is not None
        else DEFAULT)
    num_generations = _given(flat, "num_generations")
    if rlhf == "gkd":
        num_generations = 1  # ms-swift forces one response per prompt for GKD
        put("beta", beta, {"gkd_beta": 0.5 if beta is None else beta}, "GKD: JSD interpolation",
            "mapped" if beta is not None else DEFAULT)
        default("gkd_lmbda", 0.5, "lmbda default")
        default("policy_loss_coef", 0.0, "GKD: distillation alone, no RL loss")
        if not teacher_given and not any(_given(flat, key) for key in ("teacher_model", "teacher_model_server",
                                                                        "teacher.model")):
            default("self_distill", True, "no teacher_model: OPSD's fixed teacher, the initial policy")
    else:
        num_generations = 8 if num_generations is None else num_generations
        put("beta", beta, {"kl_coef": 0.04 if beta is None else beta}, "GRPO: KL coefficient",
            "mapped" if beta is not None else DEFAULT)
        # OPD-RL: the teacher's log-ratio as a per-token reward
        if flat.get("teacher_model") or flat.get("teacher_model_server"):
            coef = flat.get("teacher_kl_coef", 1.0)
            put("teacher_kl_coef", coef, {"distill_reward_coef": coef, "distill_coef": 0.0},
                "GRPO + teacher = OPD-RL", "mapped" if "teacher_kl_coef" in flat else DEFAULT)
    # Batch geometry, in completions: generation_batch_size = global_batch_size * steps_per_generation.
    global_batch = _given(flat, "global_batch_size") or 16
    steps = _given(flat, "steps_per_generation")
    generation = _given(flat, "generation_batch_size")
    if generation is None:
        steps = steps or 1
        generation = global_batch * steps
    elif steps is None:
        if generation % global_batch:
            ctx.fail("generation_batch_size", f"{generation} is not divisible by global_batch_size {global_batch}")
        steps = generation // global_batch
    elif generation != global_batch * steps:
        ctx.fail("generation_batch_size", f"{generation} != global_batch_size {global_batch} * "
                                          f"steps_per_generation {steps}")
    if generation % num_generations:
        ctx.fail("generation_batch_size", f"{generation} completions do not split into groups of "
                                          f"num_generations={num_generations}")
    put("generation_batch_size", generation, {"num_generations": num_generations,
                                              "prompts_per_step": generation // num_generations,
                                              "global_batch_size": global_batch, "steps_per_generation": steps},
        "completions: prompts = generation_batch_size / num_generations")
    iters = _given(flat, "train_iters")
    if iters is not None:  # ms-swift derives train_iters from num_train_epochs only when it is unset
        out.values.pop("train_epochs", None)
        put("train_iters", iters, {"train_steps": math.ceil(iters / steps)},
            f"optimizer steps / steps_per_generation {steps}; wins over num_train_epochs")
    if flat.get("epsilon_high") is None and "epsilon" in flat:
        default("clip_eps_high", flat["epsilon"], "epsilon_high unset: epsilon")
    if rlhf == "grpo":
        default("truncation", "left", "truncation_strategy default for grpo")
        default("loss_agg", "sample_level", "loss_type default for grpo: grpo")
    else:
        default("truncation", "drop", "truncation_strategy default for gkd: delete")
    # ms-swift's sampling defaults (RolloutTrainerArgumentsMixin): top_k 50, top_p 0.9 (temperature above).
    default("top_k", 50, "top_k default")
    default("top_p", 0.9, "top_p default")
    # Soft overlong punishment (DAPO): megarl counts its buffer back from max_new_tokens.
    funcs = flat.get("reward_funcs") or []
    if "soft_overlong" in (funcs if isinstance(funcs, list) else [funcs]):
        cache = flat.get("soft_cache_length")
        if cache is None:
            ctx.fail("soft_cache_length", "the soft_overlong reward needs soft_cache_length")
        limit = flat.get("soft_max_length") or flat.get("max_completion_length", 512)
        if limit != flat.get("max_completion_length", 512):
            ctx.fail("soft_max_length", f"{limit} differs from max_completion_length: megarl's overlong buffer "
                                        f"ends at max_new_tokens")
        put("soft_cache_length", cache, {"overlong_buffer_len": cache})
    if flat.get("sequence_parallel"):
        tp = _given(flat, "tensor_model_parallel_size") or 1
        if "sequence_parallel" in megarl_options and tp > 1:
            put("sequence_parallel", True, {"sequence_parallel": True})
        else:
            out.set("sequence_parallel", True, "ignored", {},
                    "no effect at tensor_model_parallel_size 1" if tp == 1 else
                    "megarl has no sequence parallelism yet (the GPU-readiness issue adds it)")
    # Checkpoints and evaluation: ms-swift saves every save_steps (500) into output_dir.
    if out.values.get("save_dir"):
        save = _given(flat, "save_steps") or 500
        put("save_steps", save, {"save_interval": save}, "", "mapped" if "save_steps" in flat else DEFAULT)
    if "val_dataset" in flat:
        every = flat.get("eval_steps") or flat.get("save_steps") or 500
        put("eval_steps", every, {"eval_interval": every}, "", "mapped" if "eval_steps" in flat else DEFAULT)
    report = flat.get("report_to") or ["tensorboard"]
    if "wandb" in (report if isinstance(report, list) else [report]):
        project = flat.get("wandb_project", "megatron-swift")
        put("wandb_project", project, {"wandb_project": project})
    # Megatron's and ms-swift's defaults where megarl's differ.
    for dest, value, why in (
            ("lr", 1e-4 if _tuner(flat) == "lora" else 1e-5, f"lr default ({_tuner(flat)})"), ("lr_decay_style", "cosine", "Megatron default"),
            ("weight_decay", 0.1, "Megatron default"), ("adam_beta2", 0.95, "Megatron default"),
            ("micro_batch_size", 1, "default"), ("seed", 42, "default"), ("max_new_tokens", 512, "default"),
            ("padding_free", True, "default"), ("use_distributed_optimizer", True, "default"),
            ("recompute_granularity", "selective", "default"), ("log_interval", 5, "logging_steps default"),
            ("rollout_gpu_memory_utilization", 0.9, "vllm_gpu_memory_utilization default")):
        default(dest, value, why)


# Where the keys that are read together with others end up (docs/migrating.md's table).
SEMANTICS = {
    "colocate_groups": "`colocate_groups` (omitted: `[]`, the separate placement)",
    "rlhf_type": "grpo: RL; gkd: distillation alone (`policy_loss_coef` 0, one response per prompt)",
    "beta": "gkd: `gkd_beta` (default 0.5); grpo: `kl_coef` (default 0.04)",
    "temperature": "`temperature`, and `gkd_temperature` for gkd (default 0.9)",
    "teacher_kl_coef": "grpo with `teacher_model` (OPD-RL): `distill_reward_coef` (default 1.0), `distill_coef` 0",
    "num_generations": "`num_generations` (gkd: 1)",
    "generation_batch_size": "`prompts_per_step` = generation_batch_size / num_generations",
    "steps_per_generation": "`steps_per_generation` (generation_batch_size = global_batch_size x it)",
    "global_batch_size": "`global_batch_size` (completions; default 16)",
    "train_iters": "`train_steps` = ceil(train_iters / steps_per_generation)",
    "reward_funcs": "`reward` (accuracy -> boxed; code_reward -> code; format, react_format, cosine, repetition "
                    "by name; soft_overlong -> `overlong_buffer_len`, weight 1 only)",
    "reward_weights": "`reward` NAME:WEIGHT,...",
    "soft_max_length": "must equal max_completion_length",
    "soft_cache_length": "`overlong_buffer_len` (with reward_funcs soft_overlong)",
    "sequence_parallel": "`sequence_parallel` where megarl has it and TP > 1, else ignored",
    "save_steps": "`save_interval` (with output_dir; default 500)",
    "wandb_project": "`wandb_project` (report_to wandb)",
    "eval_steps": "`eval_interval` (with val_dataset; default save_steps)",
    "importance_sampling_level": "`policy_loss`: token -> ppo_clip, sequence -> gspo (cispo and sapo: token only)",
    "sleep_level": "`rollout_sleep_level` (0 and 1: megarl's level 1; 2: level 2, the weights discarded while "
                   "the engine sleeps and re-sent by the next sync)",
    "dynamic_sample": "`dynamic_sampling` [0, 1]",
    "loss_type": "`loss_agg`: grpo -> sample_level, bnpo and dapo -> token_level, dr_grpo -> seq_mean_token_sum_norm; "
                 "cispo -> `policy_loss` cispo, token_level, `clip_eps_high` = epsilon_high - 1 (epsilon_high > 1); "
                 "sapo -> `policy_loss` sapo, sample_level",
    "rollout_importance_sampling_mode": "`tis_level` and `tis_mode` (token_truncate, sequence_mask, ...)",
    "truncation_strategy": "`truncation` (left, right; delete: drop)",
    "dataset": "`train_data` (local files)",
    "val_dataset": "`eval_dataset` val=PATH",
    "recompute_granularity": "`recompute_granularity` (none: off)",
    "report_to": "wandb when it lists wandb",
    "vllm_engine_kwargs": "`rollout_engine_kwargs`",
    "tuner_type": "lora: `lora_rank` and the keys below (lr default 1e-4); full: every weight trains",
    "train_type": "ms-swift 3's tuner_type",
    "lora_rank": "`lora_rank` (tuner_type lora; default 8)",
    "lora_alpha": "`lora_alpha` (default 32; with use_rslora: alpha x sqrt(rank))",
    "lora_dropout": "`lora_dropout` (default 0.05)",
    "target_modules": "`lora_target_modules` (default all-linear; module names as given, canonical linear_q/k/v -> "
                      "q_proj/k_proj/v_proj)",
    "use_rslora": "`lora_alpha` = lora_alpha x sqrt(lora_rank): the same scale alpha / sqrt(rank)",
    "teacher.vllm_engine_kwargs": "`teacher_engine_kwargs`",
    "rollout.vllm_engine_kwargs": "`rollout_engine_kwargs`",
}
