"""ColossalChat's distributed GRPO/DAPO command line (`python rl_example.py -t 4 -i 4 -ibs 2 ...`, short and
long flags), read as rl_example.py and its producer/consumer launcher mean them.

Semantics that differ from megarl's own and are applied here:
  * placement: `-t` trainer (consumer) ranks and `-i` inferencer (producer) engines of `-ptp` ranks each,
    on disjoint ranks (megarl's separate placement);
  * batch sizes count prompts: `-ibs` prompts per producer per generation round (megarl's prompts per step
    = num_inferencer * ibs); `-tbs` prompts per *data-parallel group* per optimizer step (megarl's
    global_batch_size = tbs * g * dp samples, dp = num_trainers / (tp * pp)); `-tmbs` samples per forward
    per data-parallel group (divided by pp under pipeline parallelism, as rl_example.py does);
  * `-e/--num-episodes` passes over the data set; `-ed` is JSON {name: path};
  * `-a GRPO|DAPO` selects rl_example.py's grpo_config: GRPO = sample-level loss, KL `-kl` (k3),
    clip 0.2; DAPO = token-level loss, no KL, clip-higher 0.28, dynamic sampling (0.01, 0.99), soft overlong
    punishment over min(1024, max_new_tokens / 4) tokens, truncated responses masked;
  * the consumer's optimizer: HybridAdam without weight decay, gradient norm 1.0, cosine decay to 0.1 * lr;
  * top_k unset is -1 with vLLM and 50 with the transformers backend; evaluation samples at temperature 0.6.
"""

from __future__ import annotations

import argparse
import json
import os

from megarl.config_formats.common import (
    DEFAULT, Context, Translation, apply_table, custom, expand_path, ignore, informs, shell_command, to,
)
from megarl.errors import ConfigError

# (short, long, type, default) as rl_example.py declares them.
FLAGS = [
    ("-m", "--model", str, "Qwen/Qwen2.5-7B"), ("-d", "--dataset", str, "data.jsonl"),
    ("-ed", "--eval-dataset", str, None), ("-p", "--project", str, "GRPO"), ("-e", "--num-episodes", int, 1),
    ("-t", "--num-trainers", int, 2), ("-i", "--num-inferencer", int, 2), ("-g", "--num-generations", int, 8),
    ("-ibs", "--inference-batch-size", int, 64), ("-imbs", "--inference-microbatch-size", int, 8),
    ("-tbs", "--train-batch-size", int, 32), ("-tMbs", "--train-minibatch-size", int, 8),
    ("-tmbs", "--train-microbatch-size", int, 2), (None, "--ray_dir", str, None),
    (None, "--master_address", str, None), (None, "--master_port", int, 29506),
    ("-b", "--backend", str, "transformers"), ("-temp", "--temperature", float, 1.0),
    ("-topk", "--top-k", int, None), ("-topp", "--top-p", float, 1.0), ("-s", "--system-prompt", str, None),
    ("-mnt", "--max-new-tokens", int, 1024 * 4 - 512), ("-mpt", "--max-prompt-tokens", int, 512),
    ("-a", "--algo", str, "GRPO"), ("-lr", "--learning-rate", float, 1e-6), ("-kl", "--kl-coeff", float, 0.01),
    ("-rt", "--reward-type", str, "think_answer_tags"), ("-ei", "--eval-interval", int, 100),
    ("-si", "--save-interval", int, 100), ("-sd", "--save-dir", str, "./model"),
    ("-esd", "--eval-save-dir", str, "./eval"), ("-rsd", "--rollout-save-dir", str, "./rollouts"),
    ("-tp", "--tensor-parallel-size", int, 1), ("-pp", "--pipeline-parallel-size", int, 1),
    ("-zero", "--zero-stage", int, 0), ("-ptp", "--producer-tensor-parallel-size", int, 1),
]
CHOICES = {"backend": ("transformers", "vllm"), "algo": ("DAPO", "GRPO"),
           "reward_type": ("think_answer_tags", "boxed", "code")}
INF = informs()


def _dest(long: str) -> str:
    return long.lstrip("-").replace("-", "_")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"ColossalChat rl_example.py flags: {message}")


def parser() -> argparse.ArgumentParser:
    # No abbreviations: `-t` must not be read as a prefix of `-tbs` or `-temp`.
    p = _Parser(prog="rl_example.py", add_help=False, allow_abbrev=False)
    for short, long, kind, _ in FLAGS:
        names = [n for n in (short, long) if n]
        p.add_argument(*names, dest=_dest(long), type=kind, default=argparse.SUPPRESS,
                       choices=CHOICES.get(_dest(long)))
    return p


def parse_flags(tokens: list[str], where: str) -> tuple[dict, list[str], dict[str, int]]:
    """({dest: value} of the flags given, the tokens that are not ColossalChat's, times each flag was given)."""
    given, rest = parser().parse_known_args(tokens)
    names = {name: _dest(long) for short, long, _, _ in FLAGS for name in (short, long) if name}
    counts: dict[str, int] = {}
    for token in tokens:
        dest = names.get(token.split("=", 1)[0])
        if dest:
            counts[dest] = counts.get(dest, 0) + 1
    return vars(given), rest, counts


def command_tokens(text: str, where: str) -> list[str]:
    """The flags of the `rl_example.py` command in a shell snippet (common.shell_command)."""
    return shell_command(text, where, "rl_example.py")


def _eval_dataset(value, ctx):
    try:
        sets = json.loads(value)
    except json.JSONDecodeError as error:
        ctx.fail("--eval-dataset", f"not JSON {{name: path}} ({error.msg}): {value!r}")
    if not isinstance(sets, dict):
        ctx.fail("--eval-dataset", f"expected a JSON object {{name: path}}, got {value!r}")
    return {"eval_dataset": [f"{name}={expand_path(str(path), '--eval-dataset')}" for name, path in sets.items()]}


TABLE = {
    "model": to("model", expand_path),
    "dataset": to("train_data", lambda v: [expand_path(v, "--dataset")]),
    "eval_dataset": custom(_eval_dataset),
    "project": to("log_dir", lambda v: os.path.join("runs", v.replace(" ", "_")),
                  "ColossalChat names its run and output directories after the project"),
    "num_episodes": to("train_epochs", note="passes over the data set"),
    "num_trainers": INF, "num_inferencer": INF, "producer_tensor_parallel_size": INF,
    "num_generations": to("num_generations"),
    "inference_batch_size": INF, "train_batch_size": INF, "train_microbatch_size": INF,
    "inference_microbatch_size": ignore("vLLM batches its requests itself"),
    "train_minibatch_size": ignore("how many prompts the consumer gathers before a forward (accumulation "
                                   "granularity); the per-forward size is -tmbs"),
    "ray_dir": ignore("Ray orchestration: megarl runs every role under torchrun"),
    "master_address": ignore("Ray orchestration: megarl runs every role under torchrun"),
    "master_port": ignore("the rendezvous port is torchrun's --master-port"),
    "backend": custom(lambda v, ctx: {"rollout_backend": "hf" if v == "transformers" else "vllm"},
                      "transformers (its default): megarl's HF backend; vllm: vLLM"),
    "temperature": to("temperature"),
    "top_k": INF,
    "top_p": to("top_p"),
    "system_prompt": to("system_prompt"),
    "max_new_tokens": to("max_new_tokens"),
    "max_prompt_tokens": to("max_prompt_length"),
    "algo": INF, "kl_coeff": INF,
    "learning_rate": to("lr"),
    "reward_type": to("reward", note="ColossalChat's vLLM backend stops think_answer_tags responses at "
                                     "</answer> and ignores EOS; megarl stops at EOS"),
    "eval_interval": INF,
    "save_interval": INF, "save_dir": INF,
    "eval_save_dir": INF,
    "rollout_save_dir": to("rollout_save_dir", expand_path),
    "tensor_parallel_size": to("tensor_model_parallel_size"),
    "pipeline_parallel_size": to("pipeline_model_parallel_size"),
    "zero_stage": custom(lambda v, ctx: {"use_distributed_optimizer": True} if v in (1, 2) else {},
                         "ZeRO-1/2: Megatron's distributed optimizer", refuse_if=lambda v: v not in (0, 1, 2),
                         refusal="ZeRO-3 (sharded parameters) has no megarl counterpart; use 1 or 2"),
}


def translate(tokens: list[str], where: str, megarl_options) -> tuple[Translation, list[str]]:
    flags, rest, counts = parse_flags(tokens, where)
    out = Translation("colossalchat", where, how="ColossalChat rl_example.py flags")
    ctx = Context(flags, where)
    apply_table(out, TABLE, flags, ctx)
    for row in out.rows:
        if counts.get(row.key, 0) > 1:
            row.note = "; ".join(filter(None, [row.note, f"given {counts[row.key]} times, the last wins"]))
    _semantics(out, flags, ctx, megarl_options)
    return out, rest


def _semantics(out: Translation, flags: dict, ctx: Context, megarl_options) -> None:
    defaults = {_dest(long): default for _, long, _, default in FLAGS}

    def get(key):
        return flags.get(key, defaults[key])

    def put(key, targets, note=""):
        out.set(key if key in flags else f"({key} default)", get(key), "mapped" if key in flags else DEFAULT,
                targets, note)

    trainers, producers, ptp = get("num_trainers"), get("num_inferencer"), get("producer_tensor_parallel_size")
    tp, pp, g = get("tensor_parallel_size"), get("pipeline_parallel_size"), get("num_generations")
    put("num_trainers", {"colocate_groups": [], "train_gpus": trainers}, "consumers: the train ranks")
    put("num_inferencer", {"rollout_gpus": producers * ptp}, f"producers x {ptp} ranks each")
    put("producer_tensor_parallel_size", {"rollout_tensor_parallel_size": ptp})
    if trainers % (tp * pp):
        ctx.fail("--num-trainers", f"{trainers} is not divisible by tp * pp = {tp * pp}")
    dp = trainers // (tp * pp)
    per_round, per_step = producers * get("inference_batch_size"), get("train_batch_size") * dp
    if per_round % per_step:
        ctx.fail("--inference-batch-size", f"-i {producers} x -ibs {get('inference_batch_size')} = {per_round} prompts "
                                           f"per generation round is not a multiple of -tbs "
                                           f"{get('train_batch_size')} x {dp} data-parallel groups = {per_step} "
                                           f"prompts per optimizer step (rl_example.py's rule: (num_inferencer * "
                                           f"inference_batch_size) % (num_trainers * train_batch_size / tp / pp) "
                                           f"== 0); megarl generates at least one step's prompts per round")
    put("inference_batch_size", {"prompts_per_step": producers * get("inference_batch_size")},
        f"per producer: x {producers} producers")
    put("train_batch_size", {"global_batch_size": get("train_batch_size") * g * dp},
        f"prompts per data-parallel group: x {g} generations x {dp} groups = samples")
    put("train_microbatch_size", {"micro_batch_size": max(1, get("train_microbatch_size") // pp)},
        "samples per forward" + (f", / pp {pp} as rl_example.py does" if pp > 1 else ""))
    top_k = flags.get("top_k")
    if top_k is None:
        top_k = 50 if get("backend") == "transformers" else -1
    put("top_k", {"top_k": top_k}, "unset: -1 with vLLM, 50 with transformers")
    algo = get("algo")
    max_new = get("max_new_tokens")
    if algo == "GRPO":
        preset = {"loss_agg": "sample_level", "kl_coef": get("kl_coeff"), "kl_estimator": "k3",
                  "clip_eps_low": 0.2, "clip_eps_high": 0.2, "policy_loss": "skip_threshold", "skip_threshold": 20.0}
    else:
        preset = {"loss_agg": "token_level", "kl_coef": 0.0, "clip_eps_low": 0.2, "clip_eps_high": 0.28,
                  "policy_loss": "skip_threshold", "skip_threshold": 20.0, "dynamic_sampling": [0.01, 0.99],
                  "overlong_buffer_len": min(1024, int(max_new / 4)), "filter_truncated": True}
        if "kl_coeff" in flags:
            out.set("kl_coeff", flags["kl_coeff"], "ignored", {}, "DAPO runs without KL (rl_example.py)")
    put("algo", {"advantage_estimator": "grpo", "scale_rewards": "group", **preset}, f"rl_example.py's {algo} "
        f"grpo_config")
    if algo == "GRPO" and "kl_coeff" in flags:
        out.set("kl_coeff", flags["kl_coeff"], "mapped", {"kl_coef": flags["kl_coeff"]}, "k3, in the loss")
    if flags.get("eval_dataset"):
        put("eval_interval", {"eval_interval": get("eval_interval")})
        out.set("(evaluation default)", 0.6, DEFAULT, {"eval_temperature": 0.6}, "rl_example.py evaluates at 0.6")
    elif "eval_interval" in flags:
        out.set("eval_interval", flags["eval_interval"], "ignored", {}, "no --eval-dataset")
    if "save_dir" in flags or "save_interval" in flags:
        directory = os.path.join(expand_path(get("save_dir")), get("project").replace(" ", "_"))
        put("save_dir", {"save_hf_dir": directory, "save_hf_interval": get("save_interval")},
            "HF weights every save_interval steps, under <save_dir>/<project>")
        if "save_interval" in flags and "save_dir" in flags:
            out.set("save_interval", flags["save_interval"], "mapped", {}, "with save_dir")
    if "eval_save_dir" in flags:
        if "rollout_save_dir" in flags:
            out.set("eval_save_dir", flags["eval_save_dir"], "ignored", {},
                    "megarl writes evaluation dumps to --rollout-save-dir")
        else:
            put("eval_save_dir", {"rollout_save_dir": expand_path(flags["eval_save_dir"])},
                "megarl writes evaluation dumps to --rollout-save-dir")
    if tp > 1:  # plugin_config enables sequence parallelism (split_gather) with TP
        if "sequence_parallel" in megarl_options:
            out.set("(sequence parallelism)", True, DEFAULT, {"sequence_parallel": True}, "on with TP in rl_example.py")
    for dest, value, why in (("lr_decay_style", "cosine", "consumer: cosine decay"),
                             ("min_lr_ratio", 0.1, "consumer: to 0.1 * lr"), ("weight_decay", 0.0, "HybridAdam"),
                             ("clip_grad", 1.0, "plugin max_norm"), ("lr", 1e-6, "--learning-rate default"),
                             ("max_new_tokens", 3584, "default"), ("max_prompt_length", 512, "default"),
                             ("reward", "think_answer_tags", "--reward-type default"),
                             ("train_epochs", 1, "--num-episodes default"), ("num_generations", 8, "default")):
        if dest not in out.values:
            out.set(f"({why})", value, DEFAULT, {dest: value})


# Where the flags that are read together with others end up (docs/migrating.md's table).
SEMANTICS = {
    "num_trainers": "`train.gpus`, `colocate_groups` [] (separate)",
    "num_inferencer": "`rollout.gpus` = num_inferencer x producer_tensor_parallel_size",
    "producer_tensor_parallel_size": "`rollout.tensor_parallel_size`",
    "inference_batch_size": "`prompts_per_step` = num_inferencer x inference_batch_size",
    "train_batch_size": "`global_batch_size` = train_batch_size x num_generations x data-parallel groups",
    "train_microbatch_size": "`micro_batch_size` = it / pipeline_parallel_size",
    "top_k": "`top_k` (unset: -1 with vLLM, 50 with transformers)",
    "algo": "GRPO: `loss_agg` sample_level, `kl_coef` -kl (k3), clip 0.2; DAPO: `loss_agg` token_level, no KL, "
            "`clip_eps_high` 0.28, `dynamic_sampling` [0.01, 0.99], `overlong_buffer_len` min(1024, mnt / 4), "
            "`filter_truncated`; both: `policy_loss` skip_threshold (20)",
    "kl_coeff": "`kl_coef` (GRPO)",
    "eval_interval": "`eval_interval` (with --eval-dataset)",
    "save_interval": "`save_hf_interval`",
    "save_dir": "`save_hf_dir` = save_dir/project",
    "eval_save_dir": "`rollout_save_dir` (megarl writes evaluation dumps there)",
}


def reference_table() -> dict:
    """TABLE keyed by the flags as written (`-t, --num-trainers`)."""
    flags = {_dest(long): ", ".join(n for n in (short, long) if n) for short, long, _, _ in FLAGS}
    return {flags[key]: rule for key, rule in TABLE.items()}, {flags[key]: text for key, text in SEMANTICS.items()}
