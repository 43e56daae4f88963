"""Command-line and YAML arguments, Megatron style.

The parser is built from `_add_<topic>_args(parser)` groups. `--config x.yaml`
supplies defaults: its top-level keys are the same options (dashes or
underscores), and the role groups `train:`, `rollout:` and `teacher:` carry a
rank count (`gpus:`) and per-role overrides, e.g.

    colocate_groups: [[train, rollout]]
    train:   {gpus: 2, tensor_model_parallel_size: 2}
    rollout: {gpus: 2, tensor_parallel_size: 1, engine_kwargs: {max_num_seqs: 64}}

A role key `k` in group `g` sets option `g_k` (`rollout.tensor_parallel_size` ->
`--rollout-tensor-parallel-size`); for the train role, whose options are the
top-level training options, it falls back to plain `k`. Flags on the command
line override the YAML. `validate_args` is the one place that rejects impossible
combinations, each with a one-line message naming the options.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Any

from megarl import algorithms
from megarl.config_formats.common import load_yaml_mapping
from megarl.errors import ConfigError
from megarl.placement import ROLES, Placement, PlacementError
from megarl.plugins import load_plugins

DEFAULT_MODEL = "artifacts/tiny-qwen2"


# Role keys whose option is not `<role>_<key>`: `teacher_model` (top level) is the teacher
# colocated on the train ranks, so the teacher group's model has an option of its own.
ROLE_KEY_DESTS = {("teacher", "model"): "standalone_teacher_model"}


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}, column {error.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _colocate_groups(text: str) -> list[list[str]]:
    """`train,rollout` or `train,rollout;teacher,...`, or `none` for separate placement."""
    if text.strip().lower() in ("", "none", "[]"):
        return []
    return [[role.strip() for role in group.split(",") if role.strip()] for group in text.split(";")]


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint directory of the policy")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    g.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of trainer and rollout weights (bfloat16: as --bf16, float16: as --fp16; CPU ranks: "
                        "float32 or bfloat16)")
    g.add_argument("--bf16", action="store_true",
                   help="mixed precision, Megatron-LM's meaning: bf16 parameters and compute in the trainer and the "
                        "rollout (= --params-dtype bfloat16), fp32 main parameters and Adam states in the "
                        "optimizer, gradients accumulated and reduced in fp32")
    g.add_argument("--fp16", action="store_true",
                   help="as --bf16 with float16 (= --params-dtype float16), plus loss scaling (dynamic unless "
                        "--loss-scale); GPU hosts only")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a static loss scale (default: dynamic loss scaling)")
    # 2^10, not Megatron-LM's 2^32: a skipped step costs a whole rollout here, and Megatron's hysteresis lets two
    # overflows pass before the first halving, so 2^32 would skip ~18 RL steps before a scale fp16 can hold. megarl's
    # loss is a per-token sum (calculate_per_token_loss), not a mean, so its activation gradients are larger than a
    # mean loss's by the token count: on the tiny model, its own samples, the largest at scale 1 measured 16 (layer
    # 0's attention probabilities; 25 on random tokens), so 2^12 overflows fp16 (65504) and 2^10 leaves a factor 4.
    g.add_argument("--initial-loss-scale", type=float, default=2.0**10,
                   help="--fp16, dynamic loss scaling: the first scale (halved on overflow after Megatron's "
                        "hysteresis of 2; 2^10 suits megarl's per-token-sum loss)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the TP size (Megatron)")
    g.add_argument("--seed", type=int, default=1234, help="seeds prompts, Megatron RNG and vLLM engines")


def _add_parallelism_args(parser):
    g = parser.add_argument_group("parallelism (train role)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="trainer TP size")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="trainer PP size: Megatron's 1F1B schedule, the loss on the last stage")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="trainer CP size: each packed sequence split over CP ranks (needs --padding-free; "
                        "Transformer Engine's attention where installed, all-gather attention otherwise)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="trainer EP size (mixture-of-experts models): each MoE layer's routed experts split over "
                        "this many ranks of a pipeline stage, tokens exchanged all-to-all; experts are not split "
                        "over TP (Megatron's expert TP size 1). Must divide the model's num_experts and train "
                        "ranks / PP")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="MoE: weight of Megatron's load-balancing loss (aux_loss: Switch Transformer's, over each "
                        "micro-batch), added to the policy loss and logged as moe_load_balancing_loss; 0: off")
    g.add_argument("--moe-z-loss-coeff", type=float, default=0.0,
                   help="MoE: weight of the router z-loss (ST-MoE: mean logsumexp(router logits)^2), added to the "
                        "policy loss and logged as moe_z_loss; 0: off")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="MoE token dropping in the trainer (Megatron's moe_expert_capacity_factor): each expert takes "
                        "at most factor x its even share of a micro-batch's routed tokens, the rest of its tokens "
                        "skip it. The rollout engine drops none, so the rollout/trainer mismatch grows (TIS "
                        "corrects it) and a token's logprob depends on its micro-batch; default: no capacity")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="with --moe-expert-capacity-factor, which tokens an expert over capacity drops: the lowest "
                        "router probabilities (probs) or the last in the micro-batch (position)")
    g.add_argument("--routing-replay", default="auto", choices=["auto", "on", "off"], type=_auto_on_off,
                   help="MoE routing replay (R3, megarl/routing_replay.py): the rollout engine records the experts "
                        "each token was routed to and the trainer's routers take exactly those in every forward "
                        "(old logprobs, the update, the reference), probabilities from the trainer's own router; "
                        "logged: routing_replay_flip, the share of (token, layer) routes the trainer's own top-k "
                        "would change. auto: on for an MoE --model with the vLLM rollout backend and no --tools, "
                        "off otherwise; on where the engine cannot record routes is refused. On CPU it turns vLLM's "
                        "prefix caching off")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism at TP > 1: the activations outside attention and the MLP "
                        "(norms, residuals) split along the sequence over the TP ranks, all-gathered before and "
                        "reduce-scattered after each TP region; the sequence is padded to a multiple of TP (x CP). "
                        "Same losses as without it. A no-op at --tensor-model-parallel-size 1 (as in Megatron-LM)")
    g.add_argument("--offload-model", action="store_true",
                   help="colocated: move the trainer's parameters and gradient buffers (policy, critic) to host memory "
                        "while the rollout generates; back before they are needed")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="colocated: move the optimizer states to host memory while the rollout generates")
    g.add_argument("--kernels", default="auto", choices=["auto", "naive", "chunked", "triton"],
                   help="logprobs, entropy, the KL to the reference and the distillation losses (megarl/kernels): "
                        "naive (full fp32 logits; the reference), chunked (torch, per chunk of tokens, from the "
                        "final hidden states), triton (the same with Triton kernels; GPU); auto: triton on a GPU "
                        "host with Triton, chunked otherwise")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: the optimizer states (and fp32 main parameters) are "
                        "sharded over the data-parallel ranks (ZeRO-1); gradients are reduce-scattered and the "
                        "parameters all-gathered after the step. Checkpoints hold them shaped like the "
                        "parameters (fully_reshardable) and resume at another data-parallel, TP or PP size")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recomputation (Megatron): full recomputes whole transformer layers in the "
                        "backward (needs --recompute-method and --recompute-num-layers), selective only the core "
                        "attention; off when unset")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="--recompute-granularity full: uniform recomputes groups of --recompute-num-layers layers "
                        "(storing only each group's input), block recomputes the first --recompute-num-layers "
                        "layers of each pipeline stage and keeps the rest")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="--recompute-granularity full: layers per group (uniform) or layers recomputed per "
                        "pipeline stage (block)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="collectives that wait longer than this fail instead of hanging")
    g.add_argument("--startup-timeout-minutes", type=float, default=60.0,
                   help="how long ranks wait at start-up for the other roles to build their models and engines "
                        "(a large vLLM engine compiles and captures CUDA graphs first)")


def _add_lora_args(parser):
    g = parser.add_argument_group("LoRA (adapters on the policy; megarl/models/lora.py)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank on the policy's linears, the base weights frozen (no "
                        "gradients, main copies or optimizer states for them); the KL reference is the base, the "
                        "rollout gets the merged weights; 0: train every parameter")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="adapter scale = alpha / rank (default with --lora-rank: 32, ms-swift's)")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input while training (0 keeps the PPO ratio at 1 on-policy)")
    g.add_argument("--lora-target-modules", nargs="+", default=["all-linear"],
                   help="the linears that get adapters: the model family's module names (q_proj k_proj v_proj "
                        "o_proj gate_proj up_proj down_proj), Megatron's fused linears (linear_qkv linear_proj "
                        "linear_fc1 linear_fc2: every module inside), or all-linear")
    g.add_argument("--lora-load", default=None, metavar="DIR",
                   help="start the adapters from a trained PEFT LoRA directory (adapter_config.json, "
                        "adapter_model.safetensors) on --model: its r, lora_alpha and target_modules become "
                        "--lora-rank, --lora-alpha and --lora-target-modules unless given (then they must agree); "
                        "ms-swift's `adapters`, verl's `lora_adapter_path`")
    g.add_argument("--lora-export", choices=["adapter", "merged", "both"], default=None,
                   help="what --save-hf-dir (and tools/export_hf.py --out) holds for a LoRA run: 'adapter', a PEFT "
                        "adapter directory (adapter_config.json, adapter_model.safetensors) for --model; 'merged', "
                        "the HF checkpoint with the adapters merged into the base; 'both', the merged checkpoint "
                        "with the adapter directory in its adapter/ (default with --lora-rank: adapter)")
    g.add_argument("--lora-sync", choices=["merged", "adapter"], default=None,
                   help="how the rollout engines get the policy after each update: 'merged', the changed layers' "
                        "W + scale * B A through the weight sync; 'adapter', only the adapters, served by vLLM's LoRA "
                        "support on the unchanged base (default with --lora-rank: merged)")


def _add_placement_args(parser):
    g = parser.add_argument_group("placement")
    g.add_argument("--colocate-groups", type=_colocate_groups, default=[["train", "rollout"]],
                   help="roles that share ranks: 'train,rollout' (default), or 'none' for separate ranks")
    g.add_argument("--train-gpus", type=int, default=None,
                   help="ranks of the train role (default: all ranks, or what the other roles leave)")
    g.add_argument("--rollout-gpus", type=int, default=None, help="ranks of the rollout role")
    g.add_argument("--teacher-gpus", type=int, default=0, help="ranks of a standalone teacher role")
    g.add_argument("--teacher-model", default=None,
                   help="HF checkpoint of a distillation teacher colocated on the train ranks (turns GKD on)")
    g.add_argument("--teacher-tensor-parallel-size", type=int, default=1,
                   help="vLLM TP size per engine of a standalone teacher")
    g.add_argument("--standalone-teacher-model", default=None,
                   help="HF checkpoint of the standalone teacher's vLLM engines "
                        "(YAML: teacher.model, with teacher.gpus)")
    g.add_argument("--teacher-engine-kwargs", type=_json_dict, default={},
                   help="extra keyword arguments for the standalone teacher's vllm.LLM, as JSON (max_logprobs "
                        "defaults to --gkd-logits-topk)")
    g.add_argument("--teacher-kv-cache-gb", type=float, default=1.0,
                   help="standalone teacher: vLLM KV cache size per engine in GiB (CPU hosts)")
    g.add_argument("--teacher-gpu-memory-utilization", type=float, default=0.8,
                   help="standalone teacher: fraction of GPU memory vLLM may take (GPU hosts)")
    g.add_argument("--cpu-affinity", default="auto", choices=["auto", "none"],
                   help="CPU ranks: auto binds each local rank to its own share of the host's CPUs where the "
                        "launcher bound none (megarl/cpu_affinity.py); none leaves placement to the OS")
    g.add_argument("--cpu-gemm", default="auto", choices=["auto", "onednn", "torch"],
                   help="CPU trainer ranks: the fp32 GEMMs of the linear layers and loss kernels through oneDNN or "
                        "torch's BLAS (MKL on x86, which runs AVX2 code on AMD CPUs); auto times both at start-up, "
                        "leaves the library the CPU leans to (oneDNN on AMD CPUs with AVX-512, torch's elsewhere) only "
                        "for one a tenth faster or more, and keeps that choice for the machine in "
                        "$MEGARL_CACHE_DIR/cpu_gemm.json (default ~/.cache/megarl), so later runs compute alike "
                        "(megarl/cpu_gemm.py); with --padding-free, which attention path each packed sequence length "
                        "takes with that library is measured per machine and kept there too "
                        "(megarl/models/attention_paths.py); --rollout-backend hf computes its linear layers with "
                        "oneDNN in a process that chose it (megarl/hf_rollout.py)")


def _add_rollout_args(parser):
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout-backend", default="vllm", choices=["vllm", "hf"],
                   help="what generates the samples: vllm (an in-process vLLM engine), or hf (transformers on the "
                        "rollout ranks' devices, megarl/hf_rollout.py: no vLLM needed; TP 1, no standalone teacher)")
    g.add_argument("--hf-rollout-batch-tokens", type=int, default=131072,
                   help="--rollout-backend hf: the most cache tokens one micro-batch of samples holds, each row "
                        "counted at its micro-batch's longest prompt + --max-new-tokens (a row longer than that "
                        "runs alone)")
    g.add_argument("--rollout-model", default=None, help="checkpoint the rollout engine starts from (default: --model)")
    g.add_argument("--rollout-tensor-parallel-size", type=int, default=1, help="vLLM TP size per engine")
    g.add_argument("--rollout-kv-cache-gb", type=float, default=1.0,
                   help="vLLM KV cache size per engine in GiB")
    g.add_argument("--rollout-gpu-memory-utilization", type=float, default=0.5,
                   help="fraction of GPU memory vLLM may take (GPU hosts)")
    g.add_argument("--rollout-sleep-level", type=int, default=1, choices=[1, 2],
                   help="colocated: vLLM sleep level while training (1 offloads the weights to host memory; 2 "
                        "discards them and the next weight sync, a full one, brings them back: no host copy; "
                        "docs/platform.md)")
    g.add_argument("--rollout-engine-kwargs", type=_json_dict, default={},
                   help="extra keyword arguments for vllm.LLM, as JSON")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (trainer logprobs use it too)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--top-k", type=int, default=-1, help="top-k sampling (-1: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's repetition penalty (1: off). The engine samples from penalised logits the trainer "
                        "does not have: != 1 needs --tis-level (not none), which corrects for the penalised "
                        "sampler with the engine's (penalised, processed_logprobs) logprobs")
    g.add_argument("--max-new-tokens", type=int, default=32, help="response length limit")
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="the student's training samples are at least N tokens long (vLLM's min_tokens: EOS and "
                        "stop token ids are held back until then, and a --stop string counts only where it ends "
                        "after the N-th token); N = --max-new-tokens fixes every response's length. Evaluation "
                        "and --seq-kd's teacher responses stop where they stop")
    g.add_argument("--min-new-tokens-tail", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="each training prompt's samples at least their own length, drawn log-normally between LOW "
                        "and HIGH (median LOW * (HIGH/LOW)^(1/4); generation.forced_min_tokens): long-tailed "
                        "response lengths on any model, for benchmarks (bench/async.py); sets --min-new-tokens LOW")
    g.add_argument("--num-generations", type=int, default=8, help="samples per prompt")
    g.add_argument("--stop", nargs="*", default=[], help="stop strings")
    g.add_argument("--sync-bucket-mb", type=float, default=256.0,
                   help="trainer -> rollout weight sync bucket size")


def _add_algorithm_args(parser):
    g = parser.add_argument_group("algorithm")
    g.add_argument("--algo", default=None, type=str.lower, choices=sorted(algorithms.PRESETS),
                   help="algorithm preset (examples/<name>.yaml's algorithm options); options given in the config "
                        "or on the command line win")
    g.add_argument("--advantage-estimator", default="grpo",
                   choices=sorted(algorithms.ADVANTAGE_ESTIMATORS),
                   help="advantage estimator (megarl/algorithms.py or a plugin)")
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="grpo: divide by the group's std, the batch's, or not at all (Dr. GRPO)")
    g.add_argument("--real-tau", type=float, default=0.5,
                   help="real: the temperature of REAL's group log-sum-exp (ms-swift real_tau)")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (reinforce_plus_plus returns, gae)")
    g.add_argument("--lam", type=float, default=1.0, help="gae lambda")
    g.add_argument("--policy-loss", default="ppo_clip", choices=sorted(algorithms.POLICY_LOSSES),
                   help="policy loss (megarl/algorithms.py or a plugin)")
    g.add_argument("--clip-eps-low", type=float, default=0.2, help="PPO clip: ratio >= 1 - eps_low")
    g.add_argument("--clip-eps-high", type=float, default=0.2,
                   help="PPO clip: ratio <= 1 + eps_high (> eps_low: DAPO clip-higher)")
    g.add_argument("--dual-clip-c", type=float, default=None, help="dual-clip constant c > 1 (off when unset)")
    g.add_argument("--skip-threshold", type=float, default=20.0,
                   help="skip_threshold loss: drop samples whose mean ratio exceeds this")
    g.add_argument("--sapo-tau-pos", type=float, default=1.0,
                   help="sapo loss: gate temperature where the advantage is > 0 (ms-swift tau_pos)")
    g.add_argument("--sapo-tau-neg", type=float, default=1.05,
                   help="sapo loss: gate temperature where the advantage is <= 0 (ms-swift tau_neg)")
    g.add_argument("--loss-agg", default="token_level",
                   choices=sorted(algorithms.LOSS_AGGREGATIONS),
                   help="token-mean, seq-mean-token-mean, or Dr. GRPO's token-sum / max_new_tokens")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus: loss -= coef * entropy")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL-to-reference coefficient (initial value with the adaptive controller; "
                        "0: no reference model is built)")
    g.add_argument("--kl-estimator", default="low_var_kl", choices=sorted(algorithms.KL_ESTIMATORS),
                   help="per-token KL estimator (full: exact over the vocabulary)")
    g.add_argument("--kl-placement", default="loss", choices=["loss", "reward"],
                   help="KL term in the loss (GRPO style) or subtracted from the token rewards (PPO style)")
    g.add_argument("--kl-controller", default="fixed", choices=sorted(algorithms.KL_CONTROLLERS),
                   help="fixed coefficient, or adaptive (Ziegler et al.: steer the KL to --kl-target)")
    g.add_argument("--kl-target", type=float, default=0.1, help="adaptive KL controller: target KL per token")
    g.add_argument("--kl-horizon", type=float, default=10000.0, help="adaptive KL controller: horizon in samples")
    g.add_argument("--ref-model", default=None, help="reference checkpoint (default: --model)")


def _add_distillation_args(parser):
    g = parser.add_argument_group("distillation (GKD, with --teacher-model)")
    g.add_argument("--gkd-logits-topk", type=int, default=0,
                   help="distil over the teacher's top-K tokens per position (0: the full vocabulary)")
    g.add_argument("--gkd-topk-mode", default="renorm", choices=sorted(algorithms.GKD_TOPK_MODES),
                   help="top-k support: renormalised over the K ids (ms-swift), or K ids plus a tail bin")
    g.add_argument("--gkd-beta", type=float, default=0.5,
                   help="generalized JSD: 0 forward KL(teacher || student), 1 reverse KL(student || teacher)")
    g.add_argument("--gkd-temperature", type=float, default=1.0,
                   help="teacher and student distributions are softmax(logits / T) in the distillation loss")
    g.add_argument("--distill-coef", type=float, default=1.0, help="weight of the distillation loss per token")
    g.add_argument("--sft-alpha", type=float, default=0.0,
                   help="ms-swift's GKD sft_alpha: on steps that train on the dataset's (or --seq-kd teacher's) "
                        "responses, add alpha x their cross-entropy (temperature 1) per token (0: off)")
    g.add_argument("--distill-reward-coef", type=float, default=0.0,
                   help="policy-gradient form: add coef * -(log pi_student - log pi_teacher) of each sampled token "
                        "to the token rewards, for any advantage estimator (0: off)")
    g.add_argument("--policy-loss-coef", type=float, default=1.0,
                   help="weight of the RL policy loss (0: distillation alone; rewards are still scored for "
                        "metrics and evaluation)")
    g.add_argument("--offload-teacher-model", action="store_true",
                   help="keep the colocated teacher in host memory between its forwards")
    g.add_argument("--teacher-server", default=None, metavar="URL",
                   help="a teacher behind an OpenAI-compatible vLLM server (`vllm serve TEACHER --max-logprobs K`), "
                        "e.g. http://host:8000: launch rank 0 asks it for the top-K prompt logprobs of each sample's "
                        "prompt + response and every rank receives them (top-k distillation only: needs "
                        "--gkd-logits-topk K; ms-swift's teacher_model_server; megarl/teacher_server.py)")
    g.add_argument("--teacher-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="--teacher-server: each request must be answered within this (retries included), else "
                        "the run stops with an error naming the URL, before the step's update")
    g.add_argument("--teacher-server-batch", type=int, default=16,
                   help="--teacher-server: sequences per request")
    g.add_argument("--teacher-server-concurrency", type=int, default=4,
                   help="--teacher-server: requests in flight at once")
    g.add_argument("--gkd-lmbda", type=float, default=1.0,
                   help="fraction of steps on the student's own samples (on-policy); the other steps train on "
                        "the dataset's responses, or the teacher's with --seq-kd (TRL/ms-swift lmbda; drawn per "
                        "step from --seed)")
    g.add_argument("--seq-kd", action="store_true",
                   help="off-policy steps (see --gkd-lmbda) use responses sampled by the teacher instead of the "
                        "dataset's: by its standalone engines, or by the rollout engines serving a colocated teacher's "
                        "weights (which needs the student's shapes)")
    g.add_argument("--self-distill", action="store_true",
                   help="OPSD's fixed teacher (ms-swift opsd.sh, Self-Distilled Reasoner): the teacher is the frozen "
                        "initial policy, --model (with LoRA: the policy's base, adapters off), scoring each response "
                        "after its row's teacher_prompt; no --teacher-model")


def _add_batch_args(parser):
    g = parser.add_argument_group("batch geometry")
    g.add_argument("--steps-per-generation", type=int, default=None,
                   help="mini-batches (optimizer steps) per generated batch and epoch "
                        "(default: from --global-batch-size, else 1)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step over all data-parallel ranks, i.e. the mini-batch "
                        "(default: the generated batch / --steps-per-generation)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each generated batch")
    g.add_argument("--shuffle", action="store_true",
                   help="shuffle the samples before splitting them into mini-batches, per epoch (seeded)")
    g.add_argument("--balance-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="give each data-parallel rank its share of a mini-batch by tokens (equal sample counts, "
                        "near-equal prompt + response tokens; verl's trainer.balance_batch) instead of a "
                        "contiguous share (default: on)")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward on a rank")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                   help="form micro-batches by tokens instead of --micro-batch-size: each holds samples whose "
                        "prompt + response lengths sum to at most this (a longer sample alone), balanced, the "
                        "same number on every data-parallel rank (default: off)")
    g.add_argument("--padding-free", action="store_true",
                   help="pack each micro-batch's sequences end to end in one row (each attends only to itself, "
                        "positions restart at 0): no padding token is computed")
    g.add_argument("--no-on-policy-shortcut", action="store_true",
                   help="always run the separate forward pass for the old logprobs; by default an exactly on-policy "
                        "update (one epoch, one mini-batch, no reference or teacher) takes them from its own "
                        "training forward (batch.two_pass_reason)")


def _add_critic_args(parser):
    g = parser.add_argument_group("critic (PPO with --advantage-estimator gae)")
    g.add_argument("--critic-model", default=None,
                   help="critic checkpoint: trunk, and a `score` head if it has one (default: --model)")
    g.add_argument("--critic-lr", type=float, default=1e-5, help="critic peak learning rate")
    g.add_argument("--value-clip", type=float, default=0.5, help="value clipping range around the old values")
    g.add_argument("--critic-warmup", type=int, default=0,
                   help="first steps that train only the critic (the policy is not updated)")


def _add_dapo_and_off_policy_args(parser):
    g = parser.add_argument_group("DAPO and off-policy correction")
    g.add_argument("--dynamic-sampling", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="keep groups whose success rate is strictly inside (LOW, HIGH); off when unset")
    g.add_argument("--max-num-gen-batches", type=int, default=4,
                   help="dynamic sampling: generated batches per step before topping up with dropped groups")
    g.add_argument("--overlong-buffer-len", type=int, default=0,
                   help="DAPO soft overlong punishment over the last N tokens of max_new_tokens (0: off)")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0,
                   help="the soft overlong punishment reaches -factor at max_new_tokens (verl's DAPO "
                        "overlong_buffer_cfg.penalty_factor)")
    g.add_argument("--filter-truncated", action="store_true",
                   help="mask responses that hit max_new_tokens out of the loss")
    g.add_argument("--tis-level", default="none", choices=["none", "token", "sequence", "geometric"],
                   help="importance weights trainer/rollout logprobs: at which level (none: off)")
    g.add_argument("--tis-mode", default="truncate", choices=["truncate", "mask"],
                   help="truncate weights at the threshold, or mask tokens outside [1/threshold, threshold]")
    g.add_argument("--tis-threshold", type=float, default=2.0, help="importance-weight threshold")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--train-data", nargs="*", default=[],
                   help="JSONL / Parquet files, globs or directories of prompts (none: the built-in "
                        "arithmetic task); layouts in megarl/data/datasets.py")
    g.add_argument("--data-format", default="auto", choices=["auto", "colossalchat", "verl", "swift"],
                   help="row layout (auto: detected per row)")
    g.add_argument("--prompt-key", default="prompt", help="verl layout: the column holding the chat")
    g.add_argument("--prompt-id-key", default=None,
                   help="the column holding each row's id (default: 'id'; verl's data.prompt_id_key)")
    g.add_argument("--preprocessor", default=None,
                   help="registered dataset preprocessor (a plugin's) applied to every raw row")
    g.add_argument("--task-max-operand", type=int, default=None,
                   help="the built-in arithmetic task's operands are drawn from [0, N] (default 19, what the tiny "
                        "model learns); a large N (e.g. 10**15) makes the tool task: numbers too long for a small "
                        "model to add, with --tools calculator or python to add them")
    g.add_argument("--train-max-samples", type=int, default=0,
                   help="train on N distinct rows of --train-data, drawn with --seed and kept in file order (0: "
                        "every row; verl's data.train_max_samples)")
    g.add_argument("--prompts-per-step", type=int, default=16, help="prompts per generated batch, all ranks")
    g.add_argument("--max-prompt-length", type=int, default=128, help="longest prompt in tokens")
    g.add_argument("--truncation", default="error", choices=["error", "left", "right", "drop"],
                   help="a prompt over --max-prompt-length: error (naming file and line), keep its end, its start, "
                        "or leave its row out (verl's filter_overlong_prompts)")
    g.add_argument("--system-prompt", default=None,
                   help="system prompt for rows without one (default: the reward's; '' for none)")
    g.add_argument("--chat-template", default=None, metavar="JINJA|@FILE",
                   help="the chat template every rendering uses instead of the tokenizer's (a Jinja string, or @FILE "
                        "to read one; verl's model.custom_chat_template / custom_chat_template_file); HF exports "
                        "carry it")
    g.add_argument("--chat-template-kwargs", type=_json_dict, default={},
                   help="JSON arguments of every chat-template rendering, e.g. '{\"enable_thinking\": false}' (Qwen3; "
                        "ms-swift enable_thinking, verl data.apply_chat_template_kwargs)")


def _add_reward_args(parser):
    g = parser.add_argument_group("reward")
    g.add_argument("--reward", default="arithmetic",
                   help="reward name (megarl/rewards/ or a plugin), or weighted names such as boxed:1.0,rm:0.5")
    # ms-swift's reward functions (megarl/rewards/swift_rules.py), with ms-swift's defaults
    g.add_argument("--cosine-min-len-value-wrong", type=float, default=-0.5,
                   help="cosine reward: a wrong answer's reward at length 0")
    g.add_argument("--cosine-max-len-value-wrong", type=float, default=0.0,
                   help="cosine reward: a wrong answer's reward at --cosine-max-len")
    g.add_argument("--cosine-min-len-value-correct", type=float, default=1.0,
                   help="cosine reward: a correct answer's reward at length 0")
    g.add_argument("--cosine-max-len-value-correct", type=float, default=0.5,
                   help="cosine reward: a correct answer's reward at --cosine-max-len")
    g.add_argument("--cosine-max-len", type=int, default=None,
                   help="cosine reward: the length (tokens) of the cosine's half period (default --max-new-tokens)")
    g.add_argument("--repetition-n-grams", type=int, default=3, help="repetition reward: n-gram size (words)")
    g.add_argument("--repetition-max-penalty", type=float, default=-1.0,
                   help="repetition reward: the reward of a response that is one n-gram repeated (<= 0)")
    g.add_argument("--reward-model", default=None,
                   help="HF AutoModelForSequenceClassification checkpoint used as the reward named 'rm'")
    g.add_argument("--reward-model-micro-batch-size", type=int, default=8,
                   help="--reward-model: samples per forward pass (scores do not depend on it)")
    g.add_argument("--reward-model-max-length", type=int, default=None,
                   help="--reward-model: a longer conversation is scored on its last this many tokens (its start "
                        "dropped, the response's end kept; counted in a warning line); default: no limit")
    g.add_argument("--async-generation", action="store_true",
                   help="separate placement: the rollout ranks generate the next step's samples while the train "
                        "ranks train on this step's (one weight version behind; the staleness metric; TIS "
                        "corrects the gap); off: every step samples with the newest weights")
    g.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="streaming generation (megarl/streaming.py; implies --async-generation): the rollout engines "
                        "keep --stream-groups prompt groups in flight and cut the next step's batch as soon as "
                        "enough groups finished; a group may train at most K weight versions after its oldest "
                        "token's (1: no response kept across a sync); unset: --async-generation's whole batches")
    g.add_argument("--partial-rollout", action="store_true",
                   help="--max-staleness: a response in flight at a weight sync keeps its tokens and goes on under "
                        "the new weights (its prefix re-read by them); off: it restarts from its prompt")
    g.add_argument("--stale-groups", choices=("restart", "drop"), default="restart",
                   help="--max-staleness: a group that would train more than K versions after its oldest token "
                        "restarts from its prompt (restart) or is given up for the next prompt (drop)")
    g.add_argument("--stream-groups", type=int, default=None,
                   help="--max-staleness: prompt groups in flight per rollout engine (default: its share of a "
                        "step's prompts, prompts_per_step / engines)")
    g.add_argument("--reward-workers", type=int, default=1,
                   help="threads that score each prompt's samples as soon as the engine finishes them, while the "
                        "rest still generate (megarl/rewards/scoring.py); more than 1 also scores prompts in parallel "
                        "(a plugin reward must then be thread-safe); 0: score after generation, in the main thread. "
                        "With --reward-timeout: that many reward worker processes (at least 1)")
    g.add_argument("--reward-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="bound every reward call: rewards run in worker processes, one sample a call; a call "
                        "past SECONDS is killed with its worker (replaced), the sample scores 0 with reason "
                        "'timeout: ...' (the reward_timeouts metric) and the step goes on; a reward model (rm) "
                        "stays in the trainer, unbounded (0: off, rewards run in the trainer's threads)")
    g.add_argument("--sandbox-memory-budget-mb", type=int, default=0,
                   help="code rewards: memory all sandboxed programs of a host may hold together, split between "
                        "its ranks (and reward worker processes); a rank runs at most its share // (max "
                        "processes x memory limit of a program) programs at once (0: half the host's memory, "
                        "at least one program at a time)")


def _add_tool_args(parser):
    from megarl.tools import TOOL_PARSERS

    g = parser.add_argument_group("tools (multi-turn episodes, megarl/multiturn.py)")
    g.add_argument("--tools", default="",
                   help="comma-separated tools the policy may call (built in: calculator, python; plugins register "
                        "more with megarl.tools.register_tool): each sample becomes a multi-turn episode, tool "
                        "results between the policy's turns, trained on the policy's tokens only; a dataset row's "
                        "'tools' list picks among them. Empty: one turn, no tools")
    g.add_argument("--tool-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from an assistant turn (hermes: Qwen2.5 / Hermes "
                        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>)")
    g.add_argument("--max-turns", type=int, default=4,
                   help="assistant turns per episode at most (a last turn's tool calls are not run); the "
                        "episode's tokens after the prompt, tool results included, stay within --max-new-tokens")
    g.add_argument("--tool-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a tool call still running after SECONDS answers the model with a timeout error (counted "
                        "in tool_errors_timeout) and the episode goes on")
    g.add_argument("--tool-workers", type=int, default=8,
                   help="threads running tool calls per rollout rank, beside generation")
    g.add_argument("--interaction", default="",
                   help="an environment that answers (megarl/tools/interactions.py; built in: retry, which asks "
                        "for another try while the run's --reward scores the answer below 1): after a turn without "
                        "tool calls it replies as the user and the episode goes on, up to --max-turns. Empty: none")
    g.add_argument("--gym-env", default="",
                   help="a gym-style environment (megarl/tools/environments.py; built in: frozen_lake): it opens "
                        "each episode from the row's env_config (its observation is the prompt), steps on every "
                        "assistant turn without tool calls (its observation the user's reply, its reward the "
                        "turn's), and ends it when done; the interaction gym:NAME. The reward defaults to `gym`, "
                        "the sum of the step rewards. Needs --train-data. Empty: none")


def _add_eval_args(parser):
    g = parser.add_argument_group("evaluation and dumps")
    g.add_argument("--eval-dataset", nargs="*", default=[], metavar="NAME=PATH",
                   help="evaluation sets, each NAME=PATH (PATH: a file, glob or directory as --train-data, or "
                        "builtin[:N] for N held-out problems of the built-in arithmetic task, default 200)")
    g.add_argument("--eval-interval", type=int, default=0,
                   help="evaluate every this many steps, and after the last (0: only with --eval-dataset, "
                        "after the last step)")
    g.add_argument("--eval-samples", type=int, default=1, help="samples per evaluation prompt (k of mean@k)")
    g.add_argument("--eval-max-samples", type=int, default=0,
                   help="evaluate on the first N prompts of each --eval-dataset (0: all; verl's data.val_max_samples)")
    g.add_argument("--eval-temperature", type=float, default=0.0,
                   help="evaluation sampling temperature (0: greedy; needs --eval-samples 1)")
    g.add_argument("--rollout-save-dir", default=None,
                   help="write each step's samples (train_stepN.jsonl) and evaluations "
                        "(eval_NAME_stepN.jsonl) here: prompt, response, reward, reason, step")


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (Adam)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    g.add_argument("--lr-warmup-steps", type=int, default=0, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"],
                   help="decay after warm-up, over all optimizer steps of the run")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clipping")
    g.add_argument("--train-steps", type=int, default=None,
                   help="generation batches (steps) to run (default: 10, or from --train-epochs)")
    g.add_argument("--train-epochs", type=int, default=None,
                   help="run this many passes over --train-data instead of --train-steps: rows // "
                        "prompts_per_step steps each (a last partial batch is dropped, as verl's and ms-swift's "
                        "loaders do)")
    g.add_argument("--lr-warmup-ratio", type=float, default=None,
                   help="warm-up as a fraction of all optimizer steps (instead of --lr-warmup-steps; verl's "
                        "lr_warmup_steps_ratio, Megatron's lr_warmup_fraction)")
    g.add_argument("--min-lr-ratio", type=float, default=None,
                   help="--min-lr as a fraction of --lr (verl's min_lr_ratio)")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--save-dir", default=None,
                   help="Megatron distributed checkpoints go here (step_N; see megarl/checkpoint.py)")
    g.add_argument("--save-interval", type=int, default=0,
                   help="save every this many steps (0: only after the last step and on SIGTERM/SIGUSR1; -1: never, "
                        "as verl's save_freq -1; --resume auto still reads --save-dir)")
    g.add_argument("--save-keep", type=int, default=3, help="keep the newest this many checkpoints (0: all)")
    g.add_argument("--resume", default="none",
                   help="'auto': continue from the newest complete checkpoint in --save-dir (fresh if none); "
                        "a checkpoint directory; or 'none'")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints leave out the optimizer states (smaller; a resumed run starts Adam afresh)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="checkpoints leave out the RNG states (a resumed run reseeds from --seed)")
    g.add_argument("--save-hf-dir", default=None,
                   help="write the final policy here as an HF checkpoint (safetensors, config, tokenizer)")
    g.add_argument("--save-hf-interval", type=int, default=0,
                   help="also write the policy to <--save-hf-dir>_step_N every this many steps")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-dir", default="runs/megarl", help="TensorBoard directory")
    g.add_argument("--log-interval", type=int, default=1, help="print a step line every this many steps")
    g.add_argument("--wandb-project", default=None, help="also log to this Weights & Biases project (needs wandb)")
    g.add_argument("--wandb-name", default=None, help="wandb run name")
    g.add_argument("--profile-step", type=int, default=0, metavar="N",
                   help="profile step N's update on every rank with torch.profiler: an operator table and a "
                        "Chrome trace per rank in --profile-dir (megarl/profiling.py); 0: off")
    g.add_argument("--profile-dir", default=None,
                   help="where --profile-step writes (default: profile/ under --log-dir)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage dump
        raise ConfigError(f"command line: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="megarl/train.py",
        description="megarl: RL post-training with Megatron-core and in-process vLLM",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", default=None,
                        help="YAML file of options (command-line flags win); an ms-swift, verl or ColossalChat "
                             "configuration is read as that framework means it (docs/migrating.md)")
    parser.add_argument("--config-format", default=None, choices=["megarl", "swift", "verl", "colossalchat"],
                        help="the format of --config (default: detected from the file); colossalchat without "
                             "--config reads rl_example.py's flags from the command line")
    parser.add_argument("--external-plugins", nargs="*", default=[],
                        help="Python files imported before the options are checked; they register algorithms "
                             "with megarl.algorithms.register(REGISTRY, name)")
    for add in (_add_model_args, _add_parallelism_args, _add_lora_args, _add_placement_args, _add_rollout_args, _add_algorithm_args,
                _add_distillation_args, _add_batch_args, _add_critic_args,
                _add_dapo_and_off_policy_args, _add_data_args, _add_reward_args, _add_tool_args, _add_eval_args, _add_optimizer_args,
                _add_checkpoint_args, _add_logging_args):
        add(parser)
    return parser


# ---------------------------------------------------------------- YAML ----------

def _actions(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}


def _auto_on_off(value: str) -> str:
    """An auto / on / off option's value (YAML reads a bare on / off as a boolean: _coerce_scalar maps it back)."""
    return value


def _closest(name: str, names) -> str:
    match = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    """Check a YAML value against the option's type; return it as the parser would."""
    def fail(expected):
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")

    # BooleanOptionalAction (--x / --no-x) has nargs 0: a YAML bool like store_true's, not a list of 0 values.
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if action.type is _colocate_groups:
        if value is None:
            return []
        if isinstance(value, str):
            return _colocate_groups(value)
        if not (isinstance(value, list) and all(isinstance(g, list) for g in value)):
            fail("a list of role lists such as [[train, rollout]]")
        return [[str(role) for role in group] for group in value]
    if action.type is _json_dict:
        if not isinstance(value, dict):
            fail("a mapping")
        return value
    if action.nargs in ("*", "+"):
        value = value if isinstance(value, list) else [value]
        return [_coerce_scalar(action, v, where, fail) for v in value]
    if isinstance(action.nargs, int):
        if value is None:
            return None
        if not isinstance(value, list) or len(value) != action.nargs:
            fail(f"a list of {action.nargs} values")
        return [_coerce_scalar(action, v, where, fail) for v in value]
    return _coerce_scalar(action, value, where, fail)


def _coerce_scalar(action, value, where, fail):
    if value is None:
        return None
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer")
    elif action.type is float:
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                fail("a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a number")
        value = float(value)
    elif action.type is _auto_on_off and isinstance(value, bool):
        value = "on" if value else "off"
    elif isinstance(value, (dict, list)) or isinstance(value, bool):
        fail("a string")
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        fail(f"one of {list(action.choices)}")
    return value


def load_yaml_config(path: str, parser, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Read a YAML config into {dest: value}, rejecting unknown keys and wrong types.

    `only`: read just these top-level keys (the plugin list, before plugins can add choices).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
        raw = load_yaml_mapping(path, data.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:  # a directory, no permission
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text") from None

    actions = _actions(parser)
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}

    def put(dest: str, value: Any, where: str, name: str, known):
        if dest not in actions:
            raise ConfigError(f"{where}: unknown option{_closest(name, known)}")
        # `max-new-tokens` and `max_new_tokens`, or `train.lr` and `lr`, set the same option: one would win silently.
        spelled = where.split(": ", 1)[1]
        if dest in given_as:
            raise ConfigError(f"{path}: {given_as[dest]} and {spelled} set the same option; keep one")
        given_as[dest] = spelled
        values[dest] = _coerce(actions[dest], value, where)

    top_level_names = [d for d in actions] + list(ROLES)
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if only is not None and name not in only:
            continue
        if name in ROLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: role group '{name}' must be a mapping (e.g. gpus: 2)")
            role_names = [d[len(name) + 1:] for d in actions if d.startswith(name + "_")]
            if name == "train":
                role_names += list(actions)
            for sub, sub_value in value.items():
                sub_name = str(sub).replace("-", "_")
                dest = ROLE_KEY_DESTS.get((name, sub_name), f"{name}_{sub_name}")
                if dest not in actions and name == "train":
                    dest = sub_name
                put(dest, sub_value, f"{path}: {name}.{sub}", sub_name, role_names)
        else:
            put(name, value, f"{path}: {key}", name, top_level_names)
    return values


# ------------------------------------------------------------ parse ------------

def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Defaults < --algo preset < YAML < command line, then `validate_args`. Raises ConfigError.

    A `--config` in another framework's format (megarl/config_formats: ms-swift, verl with its Hydra-style
    overrides, ColossalChat's rl_example.py flags), detected from the file or named by --config-format, is
    read with that framework's meaning into the same defaults; `args.config_notes` says how (rank 0 prints it).
    """
    import sys

    from megarl import config_formats

    argv = list(sys.argv[1:] if argv is None else argv)
    foreign = config_formats.read(argv, set(_actions(build_parser())))
    translation = None
    if foreign is not None:
        translation, argv = foreign
    # First only --config and --external-plugins: plugins add choices to the full parser.
    pre = _Parser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--external-plugins", nargs="*", default=[])
    known, _ = pre.parse_known_args(argv)
    plugins = list(known.external_plugins)
    if translation is not None:
        plugins += translation.values.get("external_plugins", [])
    elif known.config:
        plugins += load_yaml_config(known.config, build_parser(), only=("external_plugins",)).get(
            "external_plugins", [])
    from megarl.config_formats.common import expand_path

    load_plugins([expand_path(path, "--external-plugins") for path in plugins])
    parser = build_parser()  # again: plugins add choices
    config_values = {}
    if translation is not None:
        config_values = _translated_values(translation, parser)
    elif known.config:
        config_values = load_yaml_config(known.config, parser)
    parser.set_defaults(**config_values)
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    for pair in EXCLUSIVE:  # the command line's choice of the two replaces the config's
        for mine, other in (pair, pair[::-1]):
            if mine in given and other not in given and other in config_values:
                setattr(args, other, build_parser().get_default(other))
    _apply_algorithm_preset(args, set(config_values) | given)
    args.config_notes = [] if translation is None else [
        line for line in (translation.summary(), translation.ignored_line()) if line]
    where = translation.where if translation is not None else known.config
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args, world_size)
    except ConfigError as error:
        if where:
            raise ConfigError(f"{error} (config: {where})") from None
        raise
    return args


def _translated_values(translation, parser) -> dict[str, Any]:
    """A foreign config's megarl values, type-checked like YAML values; errors name the source key."""
    actions = _actions(parser)
    source_of = {dest: row.key for row in translation.rows for dest in row.targets}
    values = {}
    for dest, value in translation.values.items():
        where = f"{translation.where}: {source_of.get(dest, dest)}"
        if dest not in actions:
            raise ConfigError(f"{where}: maps to megarl option '{dest}', which this megarl does not have")
        values[dest] = _coerce(actions[dest], value, where)
    return values


# Options that say the same thing two ways: given both in one place is an error (validate_args); the command
# line's choice of one replaces the config's other.
EXCLUSIVE = (("train_steps", "train_epochs"), ("lr_warmup_steps", "lr_warmup_ratio"), ("min_lr", "min_lr_ratio"))


def _apply_algorithm_preset(args, explicit: set[str]) -> None:
    """--algo NAME: the preset's algorithm options (algorithms.PRESETS) where neither the config nor the
    command line set them (`explicit`)."""
    if args.algo is None:
        return
    for dest, value in algorithms.preset(args.algo, args).items():
        if dest not in explicit:
            setattr(args, dest, value)


def _given_on_command_line(parser, argv: list[str]) -> set[str]:
    """The dests the command line sets (a parse in which nothing has a default)."""
    import copy

    bare = copy.deepcopy(parser)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    bare._defaults = {}
    return set(vars(bare.parse_args(argv)))


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """The one place that turns impossible combinations into one-line errors."""
    _expand_paths(args)
    _resolve_precision(args)
    _resolve_schedule(args)
    if args.tokenizer is None:
        args.tokenizer = args.model
    if args.rollout_model is None:
        args.rollout_model = args.model
    if args.ref_model is None:
        args.ref_model = args.model
    for name in ("num_generations", "micro_batch_size", "prompts_per_step", "max_new_tokens", "ppo_epochs",
                 "max_prompt_length"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile_step < 0:
        raise ConfigError(f"--profile-step must be >= 0 (0: off), got {args.profile_step}")
    from megarl import cpu_gemm

    if args.cpu_gemm == "onednn" and not cpu_gemm.onednn_available():
        raise ConfigError("--cpu-gemm onednn: this torch has no oneDNN (torch.backends.mkldnn); use auto or torch")
    if args.reward_workers < 0:
        raise ConfigError(f"--reward-workers must be >= 0, got {args.reward_workers}")
    if args.reward_timeout < 0 or args.sandbox_memory_budget_mb < 0:
        raise ConfigError(f"--reward-timeout and --sandbox-memory-budget-mb must be >= 0, got "
                          f"{args.reward_timeout} and {args.sandbox_memory_budget_mb}")
    if args.distributed_timeout_minutes <= 0 or args.startup_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes and --startup-timeout-minutes must be > 0, got "
                          f"{args.distributed_timeout_minutes} and {args.startup_timeout_minutes}")
    _validate_teacher_group(args)
    _validate_rollout_backend(args)
    _validate_tools(args)
    if args.task_max_operand is not None and args.task_max_operand < 1:
        raise ConfigError(f"--task-max-operand must be >= 1, got {args.task_max_operand}")
    try:
        placement = Placement.from_args(args, world_size)
    except PlacementError as error:
        raise ConfigError(str(error)) from None
    # Resolved counts, for the checkpoint's record and the config reference.
    args.train_gpus, args.rollout_gpus = len(placement.train_ranks), len(placement.rollout_ranks)
    _validate_moe(args)
    _validate_routing_replay(args)
    _validate_model_layout(args)
    from megarl import accelerator

    unsupported = accelerator.check_supported(args)
    if unsupported:
        raise ConfigError(unsupported)
    if args.kernels == "auto":
        args.kernels = accelerator.default_kernels()
    _validate_batch_geometry(args, data_parallel=placement.dp)
    if args.train_epochs is None:
        resolve_epochs(args, 0)
    _validate_async_generation(args, placement)
    if args.max_tokens_per_micro_batch is not None and args.max_tokens_per_micro_batch < 1:
        raise ConfigError(f"--max-tokens-per-micro-batch must be >= 1, got {args.max_tokens_per_micro_batch}")
    if (args.train_steps is not None and args.train_steps < 0) or args.temperature <= 0:
        raise ConfigError(f"--train-steps must be >= 0 and --temperature > 0, got {args.train_steps} "
                          f"and {args.temperature}")
    _validate_pipeline(args)
    _validate_kl_and_critic(args)
    _validate_data_and_eval(args)
    _validate_checkpointing(args)
    if args.dual_clip_c is not None and args.dual_clip_c <= 1.0:
        raise ConfigError(f"--dual-clip-c must be > 1, got {args.dual_clip_c}")
    _validate_swift_extras(args)
    if args.dynamic_sampling is not None:
        low, high = args.dynamic_sampling
        if not 0.0 <= low < high <= 1.0:
            raise ConfigError(f"--dynamic-sampling needs 0 <= LOW < HIGH <= 1, got {low} {high}")
        if args.max_num_gen_batches < 1:
            raise ConfigError(f"--max-num-gen-batches must be >= 1, got {args.max_num_gen_batches}")
    if args.min_new_tokens_tail is not None:
        low, high = args.min_new_tokens_tail
        if not 1 <= low <= high <= args.max_new_tokens:
            raise ConfigError(f"--min-new-tokens-tail {low} {high}: give 1 <= LOW <= HIGH <= --max-new-tokens "
                              f"({args.max_new_tokens})")
        if args.min_new_tokens not in (0, low):
            raise ConfigError(f"--min-new-tokens {args.min_new_tokens} with --min-new-tokens-tail {low} {high}: the "
                              f"tail forces each prompt's own length from LOW up; give one of them")
        if args.rollout_backend == "hf" or args.tools or args.interaction:
            raise ConfigError("--min-new-tokens-tail: per-prompt lengths are built for single-turn vLLM generation "
                              "only (not --rollout-backend hf, --tools, --interaction)")
        args.min_new_tokens = low
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        raise ConfigError(f"--min-new-tokens must be in [0, --max-new-tokens={args.max_new_tokens}], "
                          f"got {args.min_new_tokens}")
    if args.filter_truncated and args.min_new_tokens == args.max_new_tokens:
        raise ConfigError(f"--filter-truncated with --min-new-tokens = --max-new-tokens = {args.max_new_tokens} "
                          f"would mask every response out of the loss (each one hits the limit)")
    if args.overlong_penalty_factor < 0:
        raise ConfigError(f"--overlong-penalty-factor must be >= 0, got {args.overlong_penalty_factor}")
    if not 0 <= args.overlong_buffer_len <= args.max_new_tokens:
        raise ConfigError(f"--overlong-buffer-len must be in [0, max_new_tokens={args.max_new_tokens}], "
                          f"got {args.overlong_buffer_len}")
    _validate_distillation(args)
    _validate_recompute(args)
    _validate_lora(args)
    _validate_sleep_level(args)
    _validate_engine_kwargs(args)


# Options that name files or directories: `~` and $VARIABLES in them are expanded (YAML has no shell).
PATH_OPTIONS = ("model", "tokenizer", "rollout_model", "ref_model", "critic_model", "teacher_model",
                "standalone_teacher_model", "reward_model", "train_data", "save_dir", "save_hf_dir", "log_dir",
                "rollout_save_dir", "resume", "external_plugins")


def _expand_paths(args) -> None:
    from megarl.config_formats.common import expand_path

    for name in PATH_OPTIONS:
        value = getattr(args, name, None)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, list):
            setattr(args, name, [expand_path(item, flag) for item in value])
        elif value is not None:
            setattr(args, name, expand_path(value, flag))
    args.eval_dataset = [f"{name}={expand_path(path, '--eval-dataset')}" if sep else name
                         for name, sep, path in (item.partition("=") for item in args.eval_dataset)]


def _resolve_schedule(args) -> None:
    """--train-epochs / --train-steps, --min-lr-ratio and --lr-warmup-ratio; the warm-up ratio needs the run's
    length, which with --train-epochs is known once the data set is read (resolve_epochs)."""
    if args.train_epochs is not None:
        if args.train_steps is not None:
            raise ConfigError(f"--train-epochs {args.train_epochs} and --train-steps {args.train_steps} both set the "
                              f"run's length; keep one")
        if args.train_epochs < 1:
            raise ConfigError(f"--train-epochs must be >= 1, got {args.train_epochs}")
        if not args.train_data:
            raise ConfigError("--train-epochs counts passes over --train-data; the built-in task has no end "
                              "(use --train-steps)")
    elif args.train_steps is None:
        args.train_steps = 10
    if args.min_lr_ratio is not None:
        if not 0.0 <= args.min_lr_ratio <= 1.0:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
        if args.min_lr:
            raise ConfigError(f"--min-lr {args.min_lr} and --min-lr-ratio {args.min_lr_ratio} both set the final "
                              f"learning rate; keep one")
        args.min_lr = args.min_lr_ratio * args.lr
    if args.lr_warmup_ratio is not None:
        if not 0.0 <= args.lr_warmup_ratio <= 1.0:
            raise ConfigError(f"--lr-warmup-ratio must be in [0, 1], got {args.lr_warmup_ratio}")
        if args.lr_warmup_steps:
            raise ConfigError(f"--lr-warmup-steps {args.lr_warmup_steps} and --lr-warmup-ratio "
                              f"{args.lr_warmup_ratio} both set the warm-up; keep one")


def resolve_epochs(args, num_rows: int) -> None:
    """With --train-epochs, the run's steps from the data set's size (rows // prompts_per_step per epoch);
    then --lr-warmup-ratio in optimizer steps. Called once the rows are read (run.load_inputs); before
    that, with --train-steps, validate_args calls it without rows."""
    if args.train_epochs is not None:
        per_epoch = num_rows // args.prompts_per_step
        if per_epoch < 1:
            raise ConfigError(f"--train-epochs: the training set has {num_rows} rows, fewer than one step's "
                              f"prompts_per_step={args.prompts_per_step}")
        args.train_steps = args.train_epochs * per_epoch
    if args.lr_warmup_ratio is not None and args.train_steps is not None:
        total_updates = args.train_steps * args.steps_per_generation * args.ppo_epochs
        args.lr_warmup_steps = int(args.lr_warmup_ratio * total_updates)


def _resolve_precision(args) -> None:
    """--bf16 / --fp16 (Megatron-LM's flags) set --params-dtype; they cannot contradict it or each other."""
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are both set; choose one")
    wanted = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
    if wanted is not None:
        if args.params_dtype not in ("float32", wanted):
            raise ConfigError(f"--{'bf16' if args.bf16 else 'fp16'} contradicts --params-dtype {args.params_dtype}; "
                              f"drop one of them")
        args.params_dtype = wanted
    args.bf16, args.fp16 = args.params_dtype == "bfloat16", args.params_dtype == "float16"
    if not args.fp16 and args.loss_scale is not None:
        raise ConfigError("--loss-scale needs --fp16 (bf16 and fp32 train without loss scaling)")
    if args.loss_scale is not None and args.loss_scale <= 0 or args.initial_loss_scale <= 0:
        raise ConfigError(f"--loss-scale and --initial-loss-scale must be > 0, got {args.loss_scale} and "
                          f"{args.initial_loss_scale}")


def _validate_recompute(args) -> None:
    """Megatron's rules (its arguments.py and TransformerConfig): full needs a method and a layer count,
    selective (the core attention of every layer) takes neither."""
    granularity, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    given = [flag for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers))
             if value is not None]
    if granularity is None and given:
        raise ConfigError(f"{' and '.join(given)} need --recompute-granularity full")
    if granularity == "selective" and given:
        raise ConfigError(f"--recompute-granularity selective takes no {' or '.join(given)} (it recomputes the "
                          f"core attention of every layer); drop it, or use --recompute-granularity full")
    if granularity == "full" and (method is None or layers is None):
        raise ConfigError(f"--recompute-granularity full needs --recompute-method uniform|block and "
                          f"--recompute-num-layers N, got {method} and {layers}")
    if layers is not None and layers < 1:
        raise ConfigError(f"--recompute-num-layers must be >= 1, got {layers}")
    if granularity == "full":
        from megarl.models.families import load_hf_config

        try:
            num_layers = load_hf_config(args.model).num_hidden_layers
        except (OSError, ValueError, AttributeError):
            return  # the model check at start-up (run.load_inputs) names the problem
        per_stage = num_layers // args.pipeline_model_parallel_size
        if layers > per_stage or (method == "uniform" and per_stage % layers):
            raise ConfigError(f"--recompute-num-layers {layers} with --recompute-method {method}: each pipeline "
                              f"stage has {per_stage} layers (num_hidden_layers={num_layers} / pipeline_model_"
                              f"parallel_size={args.pipeline_model_parallel_size}); it must be at most that"
                              f"{', and divide it (uniform)' if method == 'uniform' else ''}")


def _validate_rollout_backend(args) -> None:
    """--rollout-backend hf runs one whole transformers model per rollout rank and imports no vLLM: what
    needs vLLM is refused (before anything would import it)."""
    if args.rollout_backend != "hf":
        return
    refused = [(args.hf_rollout_batch_tokens < 1,
                f"--hf-rollout-batch-tokens {args.hf_rollout_batch_tokens}: give a positive number of tokens"),
               (args.rollout_tensor_parallel_size != 1,
                f"--rollout-tensor-parallel-size {args.rollout_tensor_parallel_size}: the HF backend runs one whole "
                f"model per rank; use 1"),
               (bool(args.rollout_engine_kwargs), "--rollout-engine-kwargs (rollout.engine_kwargs) are vLLM's"),
               (bool(args.teacher_gpus or args.standalone_teacher_model),
                "a standalone teacher (teacher.gpus / --teacher-gpus, teacher.model) runs vLLM engines; use a "
                "colocated --teacher-model")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"--rollout-backend hf: {why}")


def _validate_tools(args) -> None:
    """--tools: the names as a list (args.tools), each registered; the limits positive; what episodes do
    not run with refused. --gym-env NAME becomes the interaction gym:NAME (its reward, by default, gym)."""
    from megarl.tools import TOOLS
    from megarl.tools.environments import ENVIRONMENTS

    if args.gym_env:
        if args.gym_env not in ENVIRONMENTS:
            raise ConfigError(f"--gym-env: {args.gym_env} not registered{_closest(args.gym_env, ENVIRONMENTS)}; "
                              f"known: {', '.join(sorted(ENVIRONMENTS))}")
        if args.interaction not in ("", f"gym:{args.gym_env}"):
            raise ConfigError(f"--gym-env {args.gym_env} answers every turn; --interaction {args.interaction} "
                              f"would too: keep one")
        if not args.train_data:
            raise ConfigError(f"--gym-env {args.gym_env} opens each episode from a --train-data row's env_config; "
                              f"the built-in arithmetic task has none")
        args.interaction = f"gym:{args.gym_env}"
        if args.reward == "arithmetic":  # the parser's default: the task's, not the environment's
            args.reward = "gym"

    args.tools = [name.strip() for name in args.tools.split(",") if name.strip()] \
        if isinstance(args.tools, str) else list(args.tools)
    unknown = [name for name in args.tools if name not in TOOLS]
    if unknown:
        raise ConfigError(f"--tools: {', '.join(unknown)} not registered{_closest(unknown[0], TOOLS)}; known: "
                          f"{', '.join(sorted(TOOLS))}")
    from megarl.tools.interactions import INTERACTIONS

    if args.interaction and args.interaction not in INTERACTIONS:
        raise ConfigError(f"--interaction: {args.interaction} not registered{_closest(args.interaction, INTERACTIONS)}; "
                          f"known: {', '.join(sorted(INTERACTIONS))}")
    if args.max_turns < 1 or args.tool_workers < 1 or args.tool_timeout <= 0:
        raise ConfigError(f"--max-turns and --tool-workers must be >= 1 and --tool-timeout > 0, got "
                          f"{args.max_turns}, {args.tool_workers} and {args.tool_timeout}")
    if not args.tools and not args.interaction:
        return
    what = "--tools" if args.tools else "--interaction"
    refused = [(args.rollout_backend != "vllm", f"--rollout-backend {args.rollout_backend}: episodes run on "
                                                "the vLLM engine's request loop"),
               (args.seq_kd or bool(args.teacher_model and args.gkd_lmbda < 1.0),
                "--seq-kd / --gkd-lmbda < 1 train on responses the teacher or the dataset wrote in one turn")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"{what}: {why}")


LORA_DEFAULT_ALPHA = 32.0  # ms-swift's lora_alpha default


def _validate_sleep_level(args) -> None:
    """--rollout-sleep-level 2 discards the engine's weights while it sleeps; the next weight sync brings them
    back and rebuilds what vLLM derived from them (megarl/rollout.py, _discard_derived_state). Refused where a
    sync does not send the whole model."""
    if args.rollout_sleep_level != 2:
        return
    if args.rollout_backend == "hf":
        raise ConfigError("--rollout-sleep-level 2 is vLLM's; --rollout-backend hf offloads its weights to host "
                          "(level 1's behaviour): use level 1")
    if args.lora_rank and args.lora_sync == "adapter":
        raise ConfigError("--rollout-sleep-level 2 with --lora-sync adapter: the sync sends only the adapters, "
                          "and the engine's base weights, discarded while it sleeps, would never come back; use "
                          "--lora-sync merged or level 1")


def _validate_lora(args) -> None:
    """--lora-*: their values, the target names against the model's family, then what LoRA does not serve yet
    (megarl/models/lora.py)."""
    targets = [name for item in args.lora_target_modules for name in item.split(",") if name]
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}")
    if args.lora_load:
        targets = _options_of_lora_load(args, targets)
    if not args.lora_rank:
        given = [flag for flag, unset in (("--lora-alpha", args.lora_alpha is None),
                                          ("--lora-dropout", args.lora_dropout == 0.0),
                                          ("--lora-target-modules", targets == ["all-linear"]),
                                          ("--lora-export", args.lora_export is None),
                                          ("--lora-sync", args.lora_sync is None)) if not unset]
        if given:
            raise ConfigError(f"{' and '.join(given)} need --lora-rank > 0 (LoRA is off at rank 0)")
        return
    args.lora_target_modules = targets
    if args.lora_alpha is None:
        args.lora_alpha = LORA_DEFAULT_ALPHA
    if args.lora_export is None:
        args.lora_export = "adapter"
    if args.lora_sync is None:
        args.lora_sync = "merged"
    if args.lora_sync == "adapter":
        from megarl.models.lora import VLLM_LORA_RANKS

        for refused, why in ((args.rollout_backend == "hf", "--rollout-backend hf (vLLM's LoRA serves the adapters)"),
                             (args.lora_rank > VLLM_LORA_RANKS[-1], f"--lora-rank above {VLLM_LORA_RANKS[-1]}, "
                                                                     f"vLLM's largest LoRA rank"),
                             (bool(args.teacher_model), "a colocated --teacher-model (the rollout engines serve "
                                                        "its whole weights for --seq-kd and its evaluation)")):
            if refused:
                raise ConfigError(f"--lora-sync adapter does not work with {why}: use --lora-sync merged")
    if args.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    if not 0.0 <= args.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    from megarl.models.families import family_of, load_hf_config
    from megarl.models.lora import resolve_targets

    try:
        hf_config = load_hf_config(args.model)
        family = family_of(hf_config)
    except (OSError, ValueError, AttributeError):
        family = None  # the model check at start-up (run.load_inputs) names the problem
    if family is not None:
        try:
            resolved = resolve_targets(targets, hf_config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        experts = [module for module in resolved if module.startswith("experts.")]
        if experts and family.block_types:
            raise ConfigError(f"--lora-target-modules with adapters on Nemotron-H's routed experts ({', '.join(experts)}):"
                              f" megarl's PEFT adapter export writes gated experts, its are not; target its attention, "
                              f"Mamba-2 in_proj and MLP linears (q_proj,k_proj,v_proj,o_proj,in_proj,up_proj,down_proj)")
        if family.block_types and "out_proj" in resolved:
            raise ConfigError("--lora-target-modules with out_proj on a Nemotron-H model: peft refuses adapters on a "
                              "Mamba model's out_proj (its export could not be loaded); target in_proj and the "
                              "attention and MLP linears")
        if family.block_types and args.lora_sync == "adapter":
            raise ConfigError("--lora-sync adapter with a Nemotron-H model: vLLM's LoRA on its Mamba-2 mixers is not "
                              "wired up here; use --lora-sync merged")
        if experts and family.gpt_oss:
            raise ConfigError(f"--lora-target-modules with adapters on gpt-oss's routed experts ({', '.join(experts)}): "
                              f"its checkpoint interleaves gate and up in one fused tensor, which megarl's PEFT "
                              f"adapter export does not write; target its attention (q_proj,k_proj,v_proj,o_proj)")
        if experts and args.lora_sync == "adapter":
            raise ConfigError(f"--lora-sync adapter with adapters on the routed experts ({', '.join(experts)}): "
                              f"vLLM's MoE LoRA is not wired up here; use --lora-sync merged, or leave the "
                              f"experts out of --lora-target-modules")
        from megarl import accelerator

        if family.moe and args.lora_sync == "adapter" and not accelerator.ON_CUDA:
            raise ConfigError("--lora-sync adapter with a mixture-of-experts model on CPU ranks: vLLM's engine with "
                              "LoRA on runs its fused experts through its Triton MoE-LoRA kernels, which need a GPU; "
                              "use --lora-sync merged")
    if args.lora_load:
        from megarl.models.lora import check_peft_adapter

        try:
            check_peft_adapter(args.lora_load, args.model, args.lora_rank)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error)) from None
    if args.ref_model != args.model:
        raise ConfigError(f"--ref-model {args.ref_model} with --lora-rank: the reference of a LoRA run is the "
                          f"policy's base (--model {args.model}) with its adapters off; drop --ref-model")


def _options_of_lora_load(args, targets: list[str]) -> list[str]:
    """--lora-load DIR: its adapter_config.json's r, lora_alpha, lora_dropout and target_modules as the LoRA
    options the command line left unset; one line naming both values where a given one differs. Returns
    the target modules."""
    from megarl.models.lora import ALL_LINEAR, read_peft_config

    try:
        config = read_peft_config(args.lora_load)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    from megarl.models.lora import peft_targets

    theirs = peft_targets(config)
    where = f"--lora-load {args.lora_load} (adapter_config.json)"
    for flag, mine, unset, value in (("--lora-rank", args.lora_rank, 0, config["r"]),
                                     ("--lora-alpha", args.lora_alpha, None, float(config.get("lora_alpha", 8))),
                                     ("--lora-target-modules", targets, [ALL_LINEAR], theirs)):
        if mine != unset and (sorted(mine) != sorted(value) if isinstance(mine, list) else mine != value):
            shown = " ".join(value) if isinstance(value, list) else value
            raise ConfigError(f"{where} holds adapters with {flag} {shown}, this run {flag} "
                              f"{' '.join(mine) if isinstance(mine, list) else mine}: drop {flag} or give {shown}")
    args.lora_rank, args.lora_alpha = config["r"], float(config.get("lora_alpha", 8))
    if args.lora_dropout == 0.0:
        args.lora_dropout = float(config.get("lora_dropout", 0.0))
    return list(theirs)


def _validate_moe(args) -> None:
    """MoE options need an MoE policy (--model), and EP must divide its experts (the placement checked the
    ranks). The model's config is read here when it can be; a missing or unsupported one is named at
    start-up (run.load_inputs)."""
    for flag, value in (("--moe-aux-loss-coeff", args.moe_aux_loss_coeff), ("--moe-z-loss-coeff", args.moe_z_loss_coeff)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor must be > 0, got {args.moe_expert_capacity_factor} "
                          f"(leave it out for no capacity)")
    asked = [f"{flag} {value}" for flag, value, off in (
        ("--expert-model-parallel-size", args.expert_model_parallel_size, 1),
        ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 0.0), ("--moe-z-loss-coeff", args.moe_z_loss_coeff, 0.0),
        ("--moe-expert-capacity-factor", args.moe_expert_capacity_factor, None))
        if value != off]
    if not asked and not args.lora_rank:
        return
    from megarl.models.families import num_experts

    hf_config, family = _policy_family(args)
    if family is None:
        return
    if asked and not family.moe:
        raise ConfigError(f"{asked[0]} needs a mixture-of-experts model; --model {args.model} is {family.name} "
                          f"(dense)")
    if family.moe and num_experts(hf_config) % args.expert_model_parallel_size:
        raise ConfigError(f"--expert-model-parallel-size {args.expert_model_parallel_size} must divide the "
                          f"model's num_experts={num_experts(hf_config)}")


def _validate_model_layout(args) -> None:
    """The policy's heads, layers and experts split over its TP, PP and EP sizes, and its layers take its CP
    (a Gated DeltaNet's recurrent state is not split over CP ranks): models/megatron_gpt.check_parallel_sizes,
    here before any rank builds anything."""
    from megarl.models.megatron_gpt import check_parallel_sizes

    hf_config, family = _policy_family(args)
    if family is None:
        return
    try:
        check_parallel_sizes(hf_config, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                             args.expert_model_parallel_size, args.context_parallel_size)
    except ValueError as error:
        raise ConfigError(f"--model {args.model}: {error}") from None


def _policy_family(args):
    """(HF config, megarl family) of --model, or (None, None) where its config cannot be read here or its
    family is unsupported (named at start-up: run.load_inputs, which also refuses anything but a directory:
    so no hub look-up here)."""
    from megarl.models.families import family_of, load_hf_config

    if not os.path.isdir(args.model):
        return None, None
    try:
        hf_config = load_hf_config(args.model)
        return hf_config, family_of(hf_config)
    except (OSError, ValueError, AttributeError):
        return None, None


def _validate_routing_replay(args) -> None:
    """--routing-replay resolved to on or off: auto is on where the rollout engine can record routes for an
    MoE policy; on is refused, in one line, where it cannot."""
    if args.routing_replay == "off":
        return
    _, family = _policy_family(args)
    cannot = [(family is not None and not family.moe,
               f"needs a mixture-of-experts model; --model {args.model} is {family and family.name} (dense)"),
              (args.rollout_backend != "vllm",
               f"--rollout-backend {args.rollout_backend} cannot record the experts each token was routed to "
               f"(only the vLLM engine does); use --rollout-backend vllm or --routing-replay off"),
              (bool(args.tools), "--tools: the routes of multi-turn episodes are not recorded yet; use "
                                 "--routing-replay off"),
              (args.max_staleness is not None and args.partial_rollout,
               "--partial-rollout: a response resubmitted across a sync has its prefix re-read by the new "
               "weights, whose routes are not those its tokens were sampled with; use --routing-replay off or "
               "leave --partial-rollout out"),
              (args.max_staleness is not None and bool(args.stop),
               "--stop with --max-staleness: streaming matches stop strings itself and aborts the request, whose "
               "routes vLLM then does not return; use --routing-replay off or leave --stop out")]
    reason = next((why for bad, why in cannot if bad), None)
    if args.routing_replay == "on":
        if reason is not None:
            raise ConfigError(f"--routing-replay on {reason}")
        return
    args.routing_replay = "on" if reason is None and family is not None else "off"


def _validate_teacher_group(args) -> None:
    """Which teacher: `teacher_model` on the train ranks, or a `teacher:` group of vLLM ranks (before the
    placement, whose rank counts follow from it). --self-distill is a teacher on the train ranks read from
    --model (run.build_teacher shares the policy's base or the reference's weights where it can)."""
    standalone = args.teacher_gpus or args.standalone_teacher_model
    if args.teacher_server and (args.teacher_model or standalone):
        other = f"teacher_model={args.teacher_model}" if args.teacher_model else "the teacher: group (teacher.gpus)"
        raise ConfigError(f"--teacher-server {args.teacher_server} and {other} are both set; keep one teacher")
    if args.self_distill:
        other = next((f"{flag} {value}" for flag, value in (("--teacher-model", args.teacher_model),
                                                            ("teacher.model", args.standalone_teacher_model),
                                                            ("teacher.gpus", args.teacher_gpus),
                                                            ("--teacher-server", args.teacher_server)) if value),
                     None)
        if other:
            raise ConfigError(f"--self-distill (the teacher is the initial policy, --model) and {other} are both "
                              f"set; keep one")
        if args.seq_kd:
            raise ConfigError("--seq-kd with --self-distill: the teacher's responses would be the initial policy's "
                              "own samples on the student's prompt; drop --seq-kd")
        args.teacher_model = args.model
    if args.teacher_model and standalone:
        raise ConfigError(f"teacher_model={args.teacher_model} (a teacher colocated on the train ranks) and the "
                          f"teacher: group (teacher.gpus={args.teacher_gpus}, teacher.model="
                          f"{args.standalone_teacher_model}: standalone ranks) are both set; keep one")
    if args.teacher_gpus and not args.standalone_teacher_model:
        raise ConfigError(f"teacher.gpus={args.teacher_gpus} needs teacher.model (--standalone-teacher-model), "
                          f"the checkpoint its vLLM engines serve")
    if args.standalone_teacher_model and not args.teacher_gpus:
        raise ConfigError(f"teacher.model={args.standalone_teacher_model} needs teacher.gpus (--teacher-gpus), "
                          f"the ranks of its vLLM engines; for a teacher on the train ranks set teacher_model")


def _validate_pipeline(args) -> None:
    """Context parallelism cuts packed sequences only (megarl/context_parallel.py). Sequence parallelism
    needs a TP group: off at TP 1, as Megatron-LM's own arguments turn it off there. Full-vocabulary
    companions (--kl-estimator full, a colocated teacher's full-vocabulary distillation) run at any PP
    and CP (model_runner.forward_backward)."""
    cp = args.context_parallel_size
    # Megatron-LM turns sequence parallelism off at TP 1 (there is no TP group to split over); so does megarl.
    args.sequence_parallel = args.sequence_parallel and args.tensor_model_parallel_size > 1
    if cp > 1 and not args.padding_free:
        raise ConfigError(f"--context-parallel-size {cp} needs --padding-free: megarl splits each packed sequence "
                          f"over the context-parallel ranks")


def _validate_engine_kwargs(args) -> None:
    """Every engine_kwargs key is an argument of vLLM's LLM / EngineArgs: a misspelt one would otherwise fail
    only when the engine starts (a minute in), or with some vLLM versions be ignored. vLLM is imported only
    when there are keys to check."""
    given = [(role, key) for role in ("rollout", "teacher") for key in getattr(args, f"{role}_engine_kwargs")]
    if not given:
        return
    import dataclasses
    import inspect

    try:
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as error:
        role, key = given[0]
        raise ConfigError(f"{role}.engine_kwargs (--{role}-engine-kwargs) {key!r}: vLLM's engine arguments, but vLLM "
                          f"does not import here ({error})") from None

    known = {field.name for field in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    known -= {"self", "kwargs"}
    for role, key in given:
        if key not in known:
            raise ConfigError(f"{role}.engine_kwargs (--{role}-engine-kwargs): {key!r} is not an argument of vLLM's "
                              f"engine{_closest(key, known)}")


def _validate_swift_extras(args) -> None:
    """The cispo and sapo losses, --sft-alpha, --repetition-penalty and ms-swift's reward parameters."""
    if args.policy_loss in ("cispo", "sapo") and args.dual_clip_c is not None:
        raise ConfigError(f"--dual-clip-c clips PPO's ratio; --policy-loss {args.policy_loss} has no such clip")
    if args.policy_loss == "cispo" and args.clip_eps_high <= -1.0:
        raise ConfigError(f"--policy-loss cispo caps the weight at 1 + --clip-eps-high, which must be > 0; got "
                          f"--clip-eps-high {args.clip_eps_high}")
    if args.sapo_tau_pos <= 0 or args.sapo_tau_neg <= 0:
        raise ConfigError(f"--sapo-tau-pos and --sapo-tau-neg must be > 0, got {args.sapo_tau_pos} and "
                          f"{args.sapo_tau_neg}")
    if args.sft_alpha < 0:
        raise ConfigError(f"--sft-alpha must be >= 0, got {args.sft_alpha}")
    if args.sft_alpha > 0 and args.gkd_lmbda >= 1.0:
        raise ConfigError("--sft-alpha applies on the steps that train on the dataset's (or --seq-kd teacher's) "
                          "responses; with --gkd-lmbda 1 every step trains on the student's own: set --gkd-lmbda < 1")
    if args.repetition_penalty <= 0:
        raise ConfigError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.repetition_penalty != 1.0 and args.rollout_backend != "vllm":
        raise ConfigError(f"--repetition-penalty: --rollout-backend {args.rollout_backend} does not apply it; "
                          f"use --rollout-backend vllm")
    if args.repetition_penalty != 1.0 and args.tis_level == "none":
        raise ConfigError("--repetition-penalty != 1 samples from penalised logits the trainer's policy does not "
                          "have (off-policy); set --tis-level (token, sequence or geometric) to correct for it "
                          "with the engine's penalised logprobs")
    if args.repetition_n_grams < 1 or args.repetition_max_penalty > 0:
        raise ConfigError(f"--repetition-n-grams must be >= 1 and --repetition-max-penalty <= 0, got "
                          f"{args.repetition_n_grams} and {args.repetition_max_penalty}")
    if args.cosine_max_len is not None and args.cosine_max_len < 1:
        raise ConfigError(f"--cosine-max-len must be >= 1, got {args.cosine_max_len}")


def _validate_distillation(args) -> None:
    if not 0.0 <= args.gkd_beta <= 1.0 or args.gkd_temperature <= 0 or args.gkd_logits_topk < 0:
        raise ConfigError(f"--gkd-beta must be in [0, 1], --gkd-temperature > 0 and --gkd-logits-topk >= 0; got "
                          f"{args.gkd_beta}, {args.gkd_temperature}, {args.gkd_logits_topk}")
    if min(args.distill_coef, args.policy_loss_coef, args.distill_reward_coef) < 0:
        raise ConfigError(f"--distill-coef, --policy-loss-coef and --distill-reward-coef must be >= 0, got "
                          f"{args.distill_coef}, {args.policy_loss_coef} and {args.distill_reward_coef}")
    if not 0.0 <= args.gkd_lmbda <= 1.0:
        raise ConfigError(f"--gkd-lmbda must be in [0, 1], got {args.gkd_lmbda}")
    if args.teacher_server:
        _validate_teacher_server(args)
        return
    teacher_path = args.teacher_model or args.standalone_teacher_model
    if not teacher_path:
        needs_teacher = [flag for flag, used in (("--gkd-logits-topk", args.gkd_logits_topk),
                                                 ("--policy-loss-coef 0", args.policy_loss_coef == 0),
                                                 ("--distill-reward-coef", args.distill_reward_coef),
                                                 ("--gkd-lmbda", args.gkd_lmbda < 1.0),
                                                 ("--seq-kd", args.seq_kd)) if used]
        if needs_teacher:
            flag = needs_teacher[0]
            raise ConfigError(f"{flag} needs a teacher: set --teacher-model, a teacher: group "
                              f"(teacher.gpus and teacher.model) or --teacher-server")
        return
    if args.teacher_gpus:
        _validate_standalone_teacher(args)
    from megarl.models.families import load_hf_config

    try:
        student, teacher = (load_hf_config(path) for path in (args.model, teacher_path))
    except (OSError, ValueError) as error:
        raise ConfigError(f"teacher model {teacher_path} / --model {args.model}: cannot read the config "
                          f"({str(error).splitlines()[0]})") from None
    if student.vocab_size != teacher.vocab_size:
        raise ConfigError(f"teacher model {teacher_path} has vocab_size={teacher.vocab_size} but the "
                          f"student --model {args.model} has {student.vocab_size}; distillation needs one vocabulary")
    from megarl.models.families import shape_difference

    differ = shape_difference(teacher, student)
    if args.seq_kd and args.teacher_model and differ:
        raise ConfigError(f"--seq-kd with teacher_model={args.teacher_model}: a teacher on the train ranks generates "
                          f"through the rollout engines, which needs the student's shapes, but its {differ} differs; "
                          f"use standalone teacher ranks (teacher.gpus, teacher.model)")


def _validate_standalone_teacher(args) -> None:
    k = args.gkd_logits_topk
    _validate_vllm_teacher(args, f"teacher.gpus={args.teacher_gpus} (standalone vLLM teacher)", "a standalone teacher")
    max_logprobs = args.teacher_engine_kwargs.setdefault("max_logprobs", k)
    if not isinstance(max_logprobs, int) or max_logprobs < k:
        raise ConfigError(f"teacher.engine_kwargs.max_logprobs={max_logprobs} < gkd_logits_topk={k}: the "
                          f"teacher's vLLM engines would refuse to return the top {k}")


def _validate_teacher_server(args) -> None:
    """--teacher-server: a vLLM teacher too; what it serves (max_logprobs, vocabulary, length) is checked
    against the server at start (teacher_server.connect), the options here."""
    url = args.teacher_server
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--teacher-server {url}: expected an http:// or https:// URL")
    if args.teacher_timeout <= 0 or args.teacher_server_batch < 1 or args.teacher_server_concurrency < 1:
        raise ConfigError(f"--teacher-timeout must be > 0 and --teacher-server-batch and --teacher-server-concurrency "
                          f">= 1, got {args.teacher_timeout}, {args.teacher_server_batch} and "
                          f"{args.teacher_server_concurrency}")
    if args.teacher_timeout >= args.distributed_timeout_minutes * 60:  # the others wait for rank 0's answer
        raise ConfigError(f"--teacher-timeout {args.teacher_timeout:g} must be below --distributed-timeout-minutes "
                          f"{args.distributed_timeout_minutes:g} (in seconds): the other ranks wait in a collective "
                          f"while rank 0 asks the server, and should hear its error, not time out")
    _validate_vllm_teacher(args, f"--teacher-server {url}", "--teacher-server")
    if args.seq_kd:
        raise ConfigError(f"--seq-kd with --teacher-server {url}: the server scores the student's samples but does "
                          f"not write the teacher's responses here; use teacher ranks (teacher.gpus, teacher.model)")


def _validate_vllm_teacher(args, which: str, short: str) -> None:
    """vLLM's prompt_logprobs are of the raw logits (T = 1) and list the top K: what that allows."""
    if not args.gkd_logits_topk:
        raise ConfigError(f"{which} needs gkd_logits_topk K (--gkd-logits-topk): vLLM returns the teacher's top-K "
                          f"logprobs, not its full vocabulary, so full-vocabulary distillation is not possible")
    if args.gkd_temperature != 1.0 and args.gkd_topk_mode != "renorm":
        raise ConfigError(f"gkd_temperature={args.gkd_temperature} with gkd_topk_mode={args.gkd_topk_mode} and "
                          f"{short}: vLLM's prompt logprobs are at T=1, and only the renormalised "
                          f"top-k (gkd_topk_mode renorm) can be rescaled exactly")
    if args.temperature != 1.0 and args.distill_reward_coef:
        raise ConfigError(f"distill_reward_coef with temperature={args.temperature} and {short}: "
                          f"vLLM's prompt logprobs are at T=1, so the teacher's logprob of a sampled token at "
                          f"T={args.temperature} is not available; use temperature 1 or a teacher_model")


def _validate_async_generation(args, placement) -> None:
    _validate_streaming(args, placement)
    if not args.async_generation:
        return
    if placement.colocated:
        raise ConfigError("--async-generation needs the separate placement (colocate_groups: []): colocated, the "
                          "roles share the devices and take turns, so there is nothing to overlap")
    unsupported = [flag for flag, used in (("--dynamic-sampling", args.dynamic_sampling is not None and
                                            args.max_staleness is None),
                                           ("--gkd-lmbda < 1", args.gkd_lmbda < 1.0 and args.max_staleness is None),
                                           ("--seq-kd", args.seq_kd and args.max_staleness is None),
                                           ("teacher.gpus", bool(args.teacher_gpus) and args.max_staleness is None))
                   if used]
    if unsupported:
        flag = f"--max-staleness {args.max_staleness}" if args.max_staleness is not None else "--async-generation"
        raise ConfigError(f"{flag} does not support {', '.join(unsupported)} yet: those steps choose "
                          f"or score their samples with every rank (drop one of them)")


def _validate_streaming(args, placement) -> None:
    """--max-staleness (megarl/streaming.py): what it needs, and what it does not combine with yet, in one line."""
    streaming_only = [flag for flag, used in (("--partial-rollout", args.partial_rollout),
                                              ("--stale-groups drop", args.stale_groups != "restart"),
                                              ("--stream-groups", args.stream_groups is not None)) if used]
    if args.max_staleness is None:
        if streaming_only:
            raise ConfigError(f"{streaming_only[0]} is an option of streaming generation: set --max-staleness K")
        return
    if args.max_staleness < 1:
        raise ConfigError(f"--max-staleness {args.max_staleness}: give K >= 1 weight versions (1: each batch sampled "
                          f"by the policy one sync before the trainer's)")
    if placement.colocated:
        raise ConfigError(f"--max-staleness {args.max_staleness} needs the separate placement (colocate_groups: []): "
                          f"colocated, the roles take turns on the devices, so generation cannot stream beside "
                          f"training")
    if args.stream_groups is not None and args.stream_groups < 1:
        raise ConfigError(f"--stream-groups {args.stream_groups}: give at least 1 group in flight per engine")
    engines = placement.rollout.num_engines
    if args.prompts_per_step % engines:
        raise ConfigError(f"--max-staleness: prompts_per_step={args.prompts_per_step} must split evenly over the "
                          f"{engines} rollout engines (each cuts its share of every batch)")
    unsupported = [flag for flag, used in (
        ("--rollout-backend hf", args.rollout_backend == "hf"),) if used]
    if unsupported:
        raise ConfigError(f"--max-staleness does not support {', '.join(unsupported)} yet (streaming generation "
                          f"resubmits responses across syncs; that path is not built for them)")
    args.async_generation = True


def _validate_batch_geometry(args, data_parallel: int) -> None:
    """generated batch = prompts_per_step * num_generations samples
                       = steps_per_generation * global_batch_size,
    global_batch_size  = data_parallel * (micro-batches per rank) * micro_batch_size."""
    samples = args.prompts_per_step * args.num_generations
    where = f"prompts_per_step * num_generations = {args.prompts_per_step} * {args.num_generations} = {samples}"
    for name in ("steps_per_generation", "global_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.global_batch_size is None:
        args.steps_per_generation = args.steps_per_generation or 1
        if samples % args.steps_per_generation:
            raise ConfigError(f"{where} samples do not split into steps_per_generation="
                              f"{args.steps_per_generation} equal mini-batches")
        args.global_batch_size = samples // args.steps_per_generation
    else:
        if samples % args.global_batch_size:
            raise ConfigError(f"global_batch_size={args.global_batch_size} does not divide the generated batch "
                              f"({where} samples)")
        implied = samples // args.global_batch_size
        if args.steps_per_generation not in (None, implied):
            raise ConfigError(f"steps_per_generation={args.steps_per_generation} contradicts global_batch_size="
                              f"{args.global_batch_size}: {where} samples make {implied} mini-batches; set one of them")
        args.steps_per_generation = implied
    if args.global_batch_size % data_parallel:
        raise ConfigError(f"global_batch_size={args.global_batch_size} is not divisible by the {data_parallel} "
                          f"data-parallel ranks (train.gpus / (TP * PP * CP))")
    per_rank = args.global_batch_size // data_parallel
    if args.max_tokens_per_micro_batch is None and per_rank % args.micro_batch_size:
        raise ConfigError(f"micro_batch_size={args.micro_batch_size} does not divide the {per_rank} samples each "
                          f"data-parallel rank gets per mini-batch (global_batch_size={args.global_batch_size} / "
                          f"{data_parallel} ranks)")


def _validate_kl_and_critic(args) -> None:
    if args.kl_coef < 0:
        raise ConfigError(f"--kl-coef must be >= 0, got {args.kl_coef}")
    if args.kl_coef == 0 and (args.kl_placement == "reward" or args.kl_controller == "adaptive"):
        raise ConfigError(f"--kl-placement {args.kl_placement} / --kl-controller {args.kl_controller} need "
                          f"--kl-coef > 0 (the initial coefficient); with 0 no reference model is built")
    if args.kl_controller == "adaptive" and (args.kl_target <= 0 or args.kl_horizon <= 0):
        raise ConfigError(f"--kl-controller adaptive needs --kl-target > 0 and --kl-horizon > 0, "
                          f"got {args.kl_target} and {args.kl_horizon}")
    if not 0.0 <= args.lam <= 1.0 or not 0.0 <= args.gamma <= 1.0:
        raise ConfigError(f"--gamma and --lam must be in [0, 1], got {args.gamma} and {args.lam}")
    if args.critic_model is None:
        args.critic_model = args.model
    if args.advantage_estimator != "gae":
        critic_flags = [f"--{name.replace('_', '-')}" for name in ("critic_warmup",) if getattr(args, name)]
        if critic_flags:
            raise ConfigError(f"{critic_flags[0]} needs a critic: set --advantage-estimator gae")
    if args.advantage_estimator == "real":  # its advantages are REAL's gradient where s_i = 0 (algorithms.real)
        reasons = [(args.real_tau <= 0, f"--real-tau must be > 0, got {args.real_tau}"),
                   (args.ppo_epochs != 1 or args.steps_per_generation != 1,
                    f"--ppo-epochs {args.ppo_epochs} / --steps-per-generation {args.steps_per_generation}: REAL's "
                    f"weights are its gradient on-policy only: one optimizer step per generated batch"),
                   (args.loss_agg != "sample_level", f"--loss-agg {args.loss_agg}: REAL averages over groups; its "
                                                     f"advantages are scaled for sample_level"),
                   (args.policy_loss != "ppo_clip", f"--policy-loss {args.policy_loss}: REAL's gradient is the "
                                                    f"plain policy gradient of its weights (ppo_clip at ratio 1)"),
                   (args.tis_level != "none", f"--tis-level {args.tis_level}: REAL applies no importance weights"),
                   (args.num_generations < 2, "--num-generations 1: REAL compares the samples of a group")]
        reason = next((why for applies, why in reasons if applies), None)
        if reason:
            raise ConfigError(f"--advantage-estimator real: {reason}")
    if args.critic_warmup < 0 or args.value_clip <= 0 or args.critic_lr <= 0:
        raise ConfigError(f"--critic-warmup must be >= 0, --value-clip and --critic-lr > 0; got "
                          f"{args.critic_warmup}, {args.value_clip}, {args.critic_lr}")


def _validate_data_and_eval(args) -> None:
    datasets = {}
    for item in args.eval_dataset:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--eval-dataset {item!r}: expected NAME=PATH")
        if name in datasets:
            raise ConfigError(f"--eval-dataset: the name {name!r} is given twice")
        builtin, _, count = path.partition(":")
        if builtin == "builtin" and count and not (count.isdigit() and int(count) > 0):
            raise ConfigError(f"--eval-dataset {item!r}: builtin:N needs a positive number of problems")
        datasets[name] = path
    args.eval_datasets = datasets
    if args.chat_template is not None and args.chat_template.startswith("@"):
        try:
            with open(os.path.expanduser(args.chat_template[1:]), encoding="utf-8") as handle:
                args.chat_template = handle.read()
        except OSError as error:
            raise ConfigError(f"--chat-template {args.chat_template}: cannot read the template file "
                              f"({error.strerror})") from None
    if args.chat_template is not None and not args.chat_template.strip():
        raise ConfigError("--chat-template is empty: give a Jinja template or @FILE (leave it out for the "
                          "tokenizer's own)")
    for flag, value in (("--train-max-samples", args.train_max_samples), ("--eval-max-samples", args.eval_max_samples)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0 (0: every row), got {value}")
    if args.eval_interval < 0 or args.eval_samples < 1:
        raise ConfigError(f"--eval-interval must be >= 0 and --eval-samples >= 1, got {args.eval_interval} "
                          f"and {args.eval_samples}")
    if args.eval_temperature == 0 and args.eval_samples > 1:
        raise ConfigError(f"--eval-samples {args.eval_samples} with --eval-temperature 0: greedy decoding gives "
                          f"one answer per prompt; set a temperature > 0 for mean@k")
    if args.eval_interval and not datasets:
        raise ConfigError("--eval-interval needs --eval-dataset NAME=PATH")
    if args.preprocessor is not None and not args.train_data and not datasets:
        raise ConfigError("--preprocessor applies to --train-data / --eval-dataset rows; neither is given")
    from megarl.rewards.combine import parse_reward_weights

    try:
        parts = parse_reward_weights(args.reward)
    except ValueError as error:
        raise ConfigError(f"--reward: {error}") from None
    if any(name == "rm" for name, _ in parts) and not args.reward_model:
        raise ConfigError(f"--reward {args.reward!r} uses 'rm' but no --reward-model checkpoint is given")
    for name in ("reward_model_micro_batch_size", "reward_model_max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.reward_model_max_length is not None and not args.reward_model:
        raise ConfigError("--reward-model-max-length needs --reward-model")
    if args.reward_model and not any(name == "rm" for name, _ in parts):
        raise ConfigError(f"--reward-model is set but --reward {args.reward!r} does not use it; "
                          f"add rm, e.g. --reward {parts[0][0]}:1.0,rm:1.0")
    from megarl.rewards import REWARDS, _load_builtin_rewards

    _load_builtin_rewards()
    for name, _ in parts:
        if name != "rm" and name not in REWARDS:
            raise ConfigError(f"--reward {name!r} is not registered{_closest(name, REWARDS)}; "
                              f"known: {', '.join(sorted(REWARDS))}")


def _validate_checkpointing(args) -> None:
    for name in ("save_keep", "save_hf_interval"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.save_interval < -1:
        raise ConfigError(f"--save-interval must be >= -1 (-1: never save), got {args.save_interval}")
    if args.save_interval > 0 and not args.save_dir:
        raise ConfigError("--save-interval needs --save-dir")
    if args.resume == "auto" and not args.save_dir:
        raise ConfigError("--resume auto looks in --save-dir; set --save-dir")
    if args.resume not in ("auto", "none") and not os.path.isfile(os.path.join(args.resume, "state.json")):
        raise ConfigError(f"--resume {args.resume}: not a complete megarl checkpoint (no state.json)")
    if args.save_hf_interval and not args.save_hf_dir:
        raise ConfigError("--save-hf-interval needs --save-hf-dir")
    if args.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project: wandb is not installed (pip install wandb)")
