"""Benchmark: trainer -> rollout weight sync of a >= 100M-parameter model, on 2 ranks.

    python bench/weight_sync.py [--hidden 1024 --layers 12 --repeats 3] [--only colocate|separate] [--profile]
                                [--lora-rank 16 [--modes full merged adapter]] [--models dense moe]

Runs two torchrun launches and prints, measured side by side in each run:
  colocated  sync (TP gather + HF conversion + in-place vLLM load) vs a plain copy of
             the same bytes into a preallocated buffer (ratio, bytes/s);
  separate   broadcast sync from the train rank to the rollout rank vs a raw
             gloo broadcast of the same bytes (ratio, bytes/s).
Each also prints how much of the sync is the rollout engine's own post-load
processing (on CPU vLLM repacks every linear weight into a oneDNN GEMM handle,
which a fresh engine pays as well; on GPU it is a no-op for unquantized models),
and the ratio without it. It prints; it asserts nothing. Timings are medians of
--repeats, taken interleaved (sync, baseline, repack, sync, ...), both ranks
starting each together, after one first sync (which also builds the broadcast
plan and buffers; printed apart). The repack is timed on its own, so on a busy
host "ratio without it" is indicative only.
--profile adds one more sync per rank under cProfile and prints each
rank's top functions (cumulative time) after each placement's line.

--lora-rank R adds LoRA runs (adapters of rank R on every linear, an MoE's experts included, B random):
`merged` syncs the whole model with W + scale * B A (--lora-sync merged), `adapter` the adapters
only, into an engine serving them with vLLM's LoRA (--lora-sync adapter; on the MoE attention's
adapters only, megarl does not sync expert adapters to vLLM's MoE LoRA, and only on a GPU: vLLM's
CPU engine runs an MoE with LoRA through Triton kernels); each placement
runs --modes (default: full, merged, adapter), one launch each, and prints each mode's
bytes and sync seconds, and the seconds one greedy generation of 16 prompts x 32 tokens
takes on the synced engine (vLLM's LoRA adds its kernels to every forward).

--models (default: dense moe) runs each placement on a dense Qwen2 and on a Qwen3-MoE of the same
trunk (8 routed experts, top 2, each a quarter of the dense MLP's width, so the experts hold twice
the dense MLP's parameters): the MoE's colocated sync gathers the experts from expert-parallel
ranks (EP=2 over the 2 train ranks) and both placements load them into vLLM's fused expert layout.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_checkpoint(path, hidden, layers, vocab, moe=False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=max(1, hidden // 256), max_position_embeddings=256, tie_word_embeddings=False)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=hidden * 11 // 16, norm_topk_prob=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, intermediate_size=hidden * 11 // 4))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(model_dir, placement, repeats, out, profile=False, mode="full", lora_rank=0):
    import torch

    from types import SimpleNamespace

    from megarl import distributed
    from megarl.actor import policy_weights
    from megarl.arguments import parse_args
    from megarl.models.convert import load_hf_weights
    from megarl.models.megatron_gpt import build_gpt_model
    from megarl.rollout import RolloutEngine, release_shared_memory
    from megarl.weight_sync import build_weight_sync
    from transformers import AutoConfig

    flags = ["--model", model_dir, "--rollout-kv-cache-gb", "1", "--max-new-tokens", "32", "--log-dir", "",
             "--rollout-engine-kwargs", json.dumps({"skip_tokenizer_init": True})]
    if placement == "separate":
        flags += ["--colocate-groups", "none", "--train-gpus", "1", "--rollout-gpus", "1"]
    moe = bool(getattr(AutoConfig.from_pretrained(model_dir), "num_experts", None))
    if mode != "full":
        flags += ["--lora-rank", str(lora_rank), "--lora-sync", mode]
        if moe and mode == "adapter":  # vLLM's MoE LoRA is not wired up: the adapter sync adapts attention only
            flags += ["--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj"]
    if moe and placement == "colocate":
        flags += ["--expert-model-parallel-size", "2"]  # the experts' gather from their EP ranks is part of the sync
    args = parse_args(flags)
    context = distributed.init_distributed(args)
    hf_config = AutoConfig.from_pretrained(model_dir)
    engine = None
    if context.is_rollout:
        engine = RolloutEngine(args, context.placement.rollout, context.rank, colocated=context.placement.colocated)
    distributed.init_megatron_parallel(context, args.seed)
    model = actor = None
    if context.is_train:
        model = build_gpt_model(hf_config, lora=mode != "full")
        load_hf_weights(model, model_dir, hf_config)
        if mode != "full":  # trained-looking adapters: B random (fresh ones are 0)
            from megarl.models.lora import apply_lora, lora_config

            for adapter in apply_lora(model, hf_config, lora_config(args, hf_config), args.seed):
                for b in adapter.B.values():
                    torch.nn.init.normal_(b, std=1e-3)
        # A bare GPTModel stands in for the Actor: the sync only asks it for what Actor.hf_weights sends.
        actor = SimpleNamespace(hf_weights=lambda bucket_bytes: policy_weights(model, hf_config, args, bucket_bytes))
    bucket = int(args.sync_bucket_mb * 2**20)
    sync = build_weight_sync(context, bucket)  # the strategy the placement picks, as in train.py
    start = time.perf_counter()
    nbytes = sync.sync(actor, engine).bytes  # the first sync also builds what later syncs reuse
    result = {"first_sync_s": time.perf_counter() - start}
    group = distributed.new_store_group("bench", context, (0, 1))
    token = torch.zeros(1)
    if placement == "colocate":
        params = [p.detach() for p in model.parameters()]
        buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)

        def baseline():
            offset = 0
            for p in params:
                buffer[offset: offset + p.numel()].copy_(p.reshape(-1))
                offset += p.numel()

        result["baseline"] = "plain copy of the model's bytes"
    else:
        sizes = [torch.tensor([nbytes], dtype=torch.int64)]
        group.broadcast(sizes[0], 0).wait()
        nbytes = int(sizes[0].item())
        flat = torch.empty(nbytes // 4, dtype=torch.float32)

        def baseline():
            group.broadcast(flat, 0).wait()

        result["baseline"] = "raw gloo broadcast of the same bytes"
    # Interleaved, so that the host's load drifts over all three alike; both ranks start each one together.
    measured = {"sync_s": lambda: sync.sync(actor, engine), "baseline_s": baseline,
                # the part of a sync that is the engine's own post-load processing (CPU: GEMM repacking)
                "repack_s": lambda: engine.llm.collective_rpc(_reprocess) if engine is not None else None}
    times = {key: [] for key in measured}
    for _ in range(repeats):
        for key, fn in measured.items():
            group.broadcast(token, 0).wait()
            times[key].append(median_seconds(fn, 1))
    result.update({key: statistics.median(values) for key, values in times.items()})
    result["bytes"] = nbytes
    if engine is None:
        del result["repack_s"]
    if profile:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.runcall(sync.sync, actor, engine)
        result["profile_s"] = time.perf_counter() - start
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        result["profile"] = text.getvalue()
    if engine is not None:
        prompts = [[(7 * i + j) % 500 + 10 for j in range(16)] for i in range(16)]
        result["generate_s"] = median_seconds(lambda: engine.generate(prompts, list(range(16)), 0, greedy=True),
                                              repeats)
    gathered = distributed.all_gather_objects(result, context)
    if context.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    release_shared_memory()


def _reprocess(worker):
    """Rerun the post-load processing `_load_in_place` runs after loading (no load)."""
    from megarl.rollout import _in_place_layers, process_after_load

    for layer, kept, _ in _in_place_layers(worker) or []:
        for name, weight in (kept or {}).items():
            setattr(layer, name, weight)
        process_after_load(layer, kept)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("colocate", "separate"), help="run one placement")
    parser.add_argument("--profile", action="store_true", help="cProfile one more sync per rank")
    parser.add_argument("--lora-rank", type=int, default=0, help="also time LoRA syncs with adapters of this rank")
    parser.add_argument("--modes", nargs="+", choices=("full", "merged", "adapter"), default=None,
                        help="with --lora-rank: which syncs to time (default: all three)")
    parser.add_argument("--models", nargs="+", choices=("dense", "moe"), default=["dense", "moe"],
                        help="which models to sync (default both)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker[0], options.worker[1], options.repeats, options.worker[2], options.profile,
               options.worker[3], options.lora_rank)
        sys.stdout.flush()
        os._exit(0)
    modes = options.modes or (["full", "merged", "adapter"] if options.lora_rank else ["full"])
    if set(modes) - {"full"} and not options.lora_rank:
        parser.error("--modes merged/adapter need --lora-rank")

    with tempfile.TemporaryDirectory() as tmp:
        for model in options.models:
            model_dir = os.path.join(tmp, model)
            params = make_checkpoint(model_dir, options.hidden, options.layers, options.vocab, moe=model == "moe")
            kind = "Qwen3-MoE (8 experts, top 2; colocated at EP=2)" if model == "moe" else "Qwen2"
            print(f"model: random {kind}, {params / 1e6:.0f}M parameters (fp32), 2 ranks, median of {options.repeats}")
            run_placements(options, model_dir, modes, tmp)


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_placements(options, model_dir, modes, tmp):
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    if options.lora_rank and modes != ["full"]:
        print(f"LoRA: rank {options.lora_rank} on every linear (an MoE's experts included; its adapter sync: "
              f"attention's only, vLLM's MoE LoRA is not wired up)")
    for placement, mode in [(p, m) for p in ([options.only] if options.only else ("colocate", "separate"))
                            for m in modes]:
        if mode == "adapter" and model_dir.endswith("moe") and not torch_cuda():
            print(f"{placement:9s} adapter not run: vLLM's CPU engine with LoRA on an MoE model runs its fused "
                  f"experts through Triton MoE-LoRA kernels (GPU only); megarl refuses it in one line")
            continue
        out = os.path.join(tmp, f"{os.path.basename(model_dir)}_{placement}_{mode}.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.abspath(__file__), "--repeats", str(options.repeats),
                        "--lora-rank", str(options.lora_rank), *(["--profile"] if options.profile else []),
                        "--worker", model_dir, placement, out, mode], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            ranks = json.load(f)
        result = max(ranks, key=lambda r: r["sync_s"])  # the slowest rank bounds a step
        gib = result["bytes"] / 2**30
        generate = max(r.get("generate_s", 0.0) for r in ranks)
        print(f"{placement:9s} {mode:7s} sync {result['sync_s']:.3f}s of {result['bytes'] / 2**20:.1f} MiB | "
              f"first sync {result['first_sync_s']:.3f}s | generation (16 x 32 tokens) {generate:.3f}s")
        if mode != "full":
            continue
        print(f"{placement:9s} sync {result['sync_s']:.3f}s ({gib / result['sync_s']:.2f} GiB/s) | "
              f"{result['baseline']} {result['baseline_s']:.3f}s ({gib / result['baseline_s']:.2f} GiB/s) | "
              f"ratio sync/baseline {result['sync_s'] / result['baseline_s']:.1f}x | {gib:.2f} GiB")
        repack = max(r.get("repack_s", 0.0) for r in ranks)
        print(f"{'':9s} first sync {result['first_sync_s']:.3f}s | the engine's post-load processing alone "
              f"(CPU GEMM repack) {repack:.3f}s | ratio without it "
              f"{(result['sync_s'] - repack) / result['baseline_s']:.1f}x")
        for rank, ranked in enumerate(ranks if options.profile else []):
            print(f"rank {rank}: profiled sync {ranked['profile_s']:.3f}s\n{ranked['profile']}")


if __name__ == "__main__":
    main()
