"""Check a config's layout for a cluster shape without starting anything, and estimate memory per GPU.

    python tools/check_layout.py --config examples/qwen7b_2x8.yaml --nodes 2 --gpus-per-node 8 [train.py flags]

Runs megarl's own argument checks (`arguments.parse_args`) for nodes x GPUs ranks: the placement arithmetic
(ranks divisible by TP x PP x CP, colocated roles of one size, rollout engines), the batch geometry, the
recompute and precision rules. Then prints the rank counts, TP x PP x CP x DP, the rollout engines, and a
rough memory estimate per GPU of a train rank: parameters, gradients, optimizer states (with and without
--use-distributed-optimizer), activations, and, colocated, what the vLLM engine takes while it generates.
The model's shapes come from its config.json (--model's, or --hf-config). Exit status 0 when the layout is
valid and the estimate fits --gpu-memory-gb, 1 when it does not fit, 2 for an invalid layout.

The estimate is rough and meant for choosing a layout, not for promising one:
  * parameters in the parameter dtype; gradients in fp32 (megarl reduces them in fp32, as Megatron's
    grad_reduce_in_fp32); optimizer: Adam's two moments in fp32, plus fp32 main parameters when the
    parameters are bf16/fp16, divided by DP with the distributed optimizer;
  * activations of one micro-batch per layer, with flash attention (no seq x seq scores: Transformer
    Engine's attention on GPU) and without sequence parallelism: the layer input, norms, QKV, attention
    output, and the MLP's gate/up/activation, in the parameter dtype; full recompute keeps each recompute
    group's input and one group's activations; with PP the first stage holds PP micro-batches (1F1B);
  * a fixed 2 GiB for the CUDA context and allocator fragmentation; vLLM asleep (level 1) holds ~0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.arguments import parse_args  # noqa: E402
from megarl.errors import ConfigError  # noqa: E402
from megarl.models.megatron_gpt import padded_vocab_size  # noqa: E402

GIB = 2**30
OVERHEAD_GIB = 2.0
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_shapes(hf: dict) -> dict:
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    return dict(hidden=hf["hidden_size"], ffn=hf["intermediate_size"], layers=hf["num_hidden_layers"],
                heads=heads, kv_heads=kv, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                vocab=hf["vocab_size"], tied=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=hf.get("model_type") == "qwen2", qk_norm=hf.get("model_type") == "qwen3")


def parameters(m: dict, tp: int, pp: int, divisible_by: int) -> dict:
    """Parameter counts: the whole model, and the most any one GPU of a TP x PP grid holds."""
    h, hd = m["hidden"], m["head_dim"]
    qkv = (m["heads"] + 2 * m["kv_heads"]) * hd
    sharded_layer = h * qkv + (qkv if m["qkv_bias"] else 0) + m["heads"] * hd * h + 3 * h * m["ffn"]
    replicated_layer = 2 * h + (2 * hd if m["qk_norm"] else 0)
    vocab = padded_vocab_size(m["vocab"], divisible_by, tp)
    embedding = vocab * h
    total = (m["layers"] * (sharded_layer + replicated_layer) + m["vocab"] * h * (1 if m["tied"] else 2) + h)
    layers = m["layers"] // pp * (sharded_layer / tp + replicated_layer)
    # The last stage: the final norm and the output layer (a copy of the embeddings when tied and PP > 1).
    last_extras = h + (embedding / tp if not m["tied"] or pp > 1 else 0)
    per_gpu = layers + embedding / tp + last_extras if pp == 1 else layers + max(embedding / tp, last_extras)
    return {"total": total, "per_gpu": per_gpu}


def activation_bytes(m: dict, args, tp: int, pp: int, cp: int = 1) -> tuple[float, str]:
    """One train rank's activations at the peak of the backward, and how they were counted (with context
    parallelism a rank keeps its 1/CP of each sequence's tokens)."""
    dtype = BYTES[args.params_dtype]
    tokens = (args.max_tokens_per_micro_batch or
              args.micro_batch_size * (args.max_prompt_length + args.max_new_tokens)) / cp
    h, hd = m["hidden"], m["head_dim"]
    per_token_layer = dtype * (5 * h + (m["heads"] + 2 * m["kv_heads"]) * hd / tp + m["heads"] * hd / tp
                               + 3 * m["ffn"] / tp)
    layer = tokens * per_token_layer
    layer_input = tokens * h * dtype
    stage_layers = m["layers"] // pp
    if args.recompute_granularity == "full":
        n = args.recompute_num_layers
        if args.recompute_method == "uniform":
            kept = stage_layers / n * layer_input + n * layer
        else:  # block: the first n layers recomputed, the rest kept
            kept = n * layer_input + (stage_layers - n) * layer + layer
        how = f"full recompute ({args.recompute_method}, {n})"
    else:
        kept = stage_layers * layer
        how = "selective recompute (~ none with flash attention)" if args.recompute_granularity else "no recompute"
    kept += tokens * h * 4 * 2  # the final hidden states and their gradient into the fused loss kernels
    if args.kernels == "naive":
        kept += 3 * tokens * padded_vocab_size(m["vocab"], args.make_vocab_size_divisible_by, tp) / tp * 4
    in_flight = pp  # 1F1B: the first stage holds PP micro-batches' activations
    return kept * in_flight, f"{how}, micro-batch {tokens:.0f} tokens per rank x {in_flight} in flight"


def estimate(args, hf: dict, gpu_gib: float) -> dict:
    """Bytes per GPU of a train rank, by part and by phase (GiB)."""
    m = model_shapes(hf)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = args.train_gpus // (tp * pp * cp)
    counts = parameters(m, tp, pp, args.make_vocab_size_divisible_by)
    n = counts["per_gpu"]
    low_precision = args.params_dtype != "float32"
    optimizer_bytes = n * (8 + (4 if low_precision else 0))
    parts = {
        "parameters": n * BYTES[args.params_dtype] / GIB,
        "gradients": n * 4 / GIB,
        "optimizer_plain": optimizer_bytes / GIB,
        "optimizer_distributed": optimizer_bytes / dp / GIB,
    }
    parts["optimizer"] = parts["optimizer_distributed" if args.use_distributed_optimizer else "optimizer_plain"]
    activations, how = activation_bytes(m, args, tp, pp, cp)
    parts["activations"] = activations / GIB
    states = parts["parameters"] + parts["gradients"] + parts["optimizer"]
    extra_models = (1 if args.kl_coef > 0 else 0) + (1 if args.teacher_model else 0)  # onloaded for their forward
    phases = {"train": states + parts["activations"] + OVERHEAD_GIB,
              "prepare": states + extra_models * parts["parameters"] + OVERHEAD_GIB}
    colocated = args.colocate_groups and any("rollout" in g and "train" in g for g in args.colocate_groups)
    if colocated:
        resident = (0 if args.offload_model else parts["parameters"] + parts["gradients"]) + \
                   (0 if args.offload_optimizer else parts["optimizer"])
        parts["vllm"] = args.rollout_gpu_memory_utilization * gpu_gib
        parts["trainer_resident"] = resident
        phases["generate"] = parts["vllm"] + resident + OVERHEAD_GIB
    return {"model": m, "params_total": counts["total"], "params_per_gpu": n, "dp": dp, "parts": parts,
            "phases": phases, "peak": max(phases.values()), "activations_how": how, "colocated": colocated}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GB (10^9 bytes)")
    parser.add_argument("--hf-config", default=None, help="the model's config.json (default: <model>/config.json)")
    own, train_flags = parser.parse_known_args(argv)
    world = own.nodes * own.gpus_per_node
    try:
        args = parse_args(["--config", own.config, *train_flags], world_size=world)
    except ConfigError as error:
        print(f"check_layout: invalid for {own.nodes} x {own.gpus_per_node} = {world} ranks: {error}")
        return 2
    path = own.hf_config or os.path.join(args.model, "config.json")
    if not os.path.isfile(path):
        print(f"check_layout: no model config at {path}; pass --hf-config PATH/config.json")
        return 2
    with open(path) as f:
        hf = json.load(f)
    # The estimate counts a dense MLP of intermediate_size per layer. (transformers 5 writes Qwen-MoE's
    # num_experts as num_local_experts.)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        print(f"check_layout: {path} is a mixture-of-experts model ({experts} experts); its memory is not "
              f"estimated yet (the layout itself is valid)")
        return 2
    gpu_gib = own.gpu_memory_gb * 1e9 / GIB
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    e = estimate(args, hf, gpu_gib)
    m, parts = e["model"], e["parts"]
    rollout_tp = args.rollout_tensor_parallel_size
    print(f"layout: {own.nodes} nodes x {own.gpus_per_node} GPUs = {world} ranks, "
          f"{'colocated (train and rollout on every rank)' if e['colocated'] else 'separate placement'}")
    print(f"  train   {args.train_gpus} ranks: TP={tp} x PP={pp} x CP={cp} x DP={e['dp']}")
    print(f"  rollout {args.rollout_gpus} ranks: {args.rollout_gpus // rollout_tp} vLLM engines x TP={rollout_tp}")
    for name, size in (("train TP", tp), ("rollout TP", rollout_tp)):
        if own.gpus_per_node % size:
            print(f"  note: {name}={size} does not divide {own.gpus_per_node} GPUs per node: groups span nodes")
    print(f"model: {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / {m['kv_heads']} KV, "
          f"ffn {m['ffn']}, vocab {m['vocab']}: {e['params_total'] / 1e9:.2f}B parameters, "
          f"{e['params_per_gpu'] / 1e9:.2f}B per train GPU")
    print(f"memory per GPU, rough (GiB; {own.gpu_memory_gb:g} GB = {gpu_gib:.1f} GiB), params {args.params_dtype}:")
    print(f"  parameters                        {parts['parameters']:7.2f}")
    print(f"  gradients (fp32)                  {parts['gradients']:7.2f}")
    print(f"  optimizer, distributed (DP={e['dp']})     {parts['optimizer_distributed']:7.2f}"
          f"{'   <- used' if args.use_distributed_optimizer else ''}")
    print(f"  optimizer, not distributed        {parts['optimizer_plain']:7.2f}"
          f"{'' if args.use_distributed_optimizer else '   <- used'}")
    print(f"  activations                       {parts['activations']:7.2f}   ({e['activations_how']})")
    print(f"  overhead (CUDA context, fragments) {OVERHEAD_GIB:6.2f}")
    if e["colocated"]:
        print(f"  vLLM while generating             {parts['vllm']:7.2f}   (rollout gpu_memory_utilization "
              f"{args.rollout_gpu_memory_utilization}), beside {parts['trainer_resident']:.2f} of trainer state "
              f"left on the GPU")
    for phase, gib in e["phases"].items():
        print(f"  peak while {phase:<9}              {gib:7.2f}")
    fits = e["peak"] <= gpu_gib
    print(f"peak {e['peak']:.1f} GiB of {gpu_gib:.1f} GiB: {'fits' if fits else 'DOES NOT FIT'}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
