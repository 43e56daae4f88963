"""torchrun worker: a model family in vLLM (CPU), loaded from a checkpoint and through the weight sync.

Two ranks, colocated: one rollout engine at TP=2 over both ranks, Megatron at TP=2.
  1. fresh: the engine is built from checkpoint A; its prompt logprobs of fixed random
     prompts against transformers', and its greedy continuations against transformers'
     argmax (teacher-forced on vLLM's tokens, so a near-tie cannot flip the check);
  2. sync: Megatron loads checkpoint B (same config, other weights) and the colocated
     sync (`iter_hf_weights` -> `reload_weights`) streams it into the same engine: the
     same checks against B;
  3. back: Megatron loads A again and syncs it, each decoder block's last tensor moved to the stream's end (the
     engine then processes every block twice, as a stream that comes back to a block makes it): every tensor
     of the engine (parameters, buffers, and what post-load processing derived from them: packed experts,
     MLA's W_UK_T / W_UV) against the fresh engine's copy from step 1, so what a sync rebuilds must follow a
     change of weights (B, then A) and a block's second processing must not redo the first's work on its output.
With RoPE scaling, each stage also reports how far transformers' logprobs move
without the scaling, so the comparison cannot pass with the scaling ignored.
Rank 0 writes the JSON report.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine (external launcher)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megarl.models.families import load_hf_config  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.models.megatron_gpt import rope_parameters  # noqa: E402
from megarl.rollout import RolloutEngine, release_shared_memory  # noqa: E402
from parity_worker import load_hf_model  # noqa: E402  (it also puts tests/ on the path, for helpers)
from helpers import ulps  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 96, 8


def hf_logprobs(path: str, tokens: torch.Tensor, without_rope_scaling: bool = False,
                without_sliding_window: bool = False):
    """Under transformers (float64, the reference): log p(token t | tokens < t) for t >= 1 [batch, len - 1],
    and the whole distributions [batch, len - 1, vocab]."""
    with torch.no_grad():
        logits = load_hf_model(path, without_rope_scaling, without_sliding_window)(tokens).logits
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, tokens[:, 1:, None])[..., 0], logprobs


def check_engine(engine, path: str, prompts: list[list[int]]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    scored = engine.llm.generate(inputs, SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0,
                                                        detokenize=False), use_tqdm=False)
    vllm_logprobs = torch.tensor([[position[token].logprob for token, position in zip(p[1:], out.prompt_logprobs[1:])]
                                  for p, out in zip(prompts, scored)])
    expected, _ = hf_logprobs(path, torch.tensor(prompts))
    report = {"prompt_logprob_ulps": ulps(vllm_logprobs, expected)}  # tests/helpers.py: the fp32 rule

    greedy = engine.llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, detokenize=False),
                                 use_tqdm=False)
    continued = torch.tensor([p + list(out.outputs[0].token_ids) for p, out in zip(prompts, greedy)])
    chosen, every = hf_logprobs(path, continued)
    chosen, every = chosen[:, -NEW_TOKENS:], every[:, -NEW_TOKENS:]
    # How far below transformers' best token each of vLLM's greedy tokens is (0 = its argmax), in ulps
    # of the log-probs' scale: only a near-tie within rounding may pick another token.
    report["greedy_tokens"] = continued[:, -NEW_TOKENS:].tolist()
    report["greedy_gap_ulps"] = ulps(chosen, every.max(-1).values, every.max(-1).values.abs().max().item())

    if rope_parameters(load_hf_config(path))["rope_type"] != "default":
        unscaled, _ = hf_logprobs(path, torch.tensor(prompts), without_rope_scaling=True)
        report["rope_scaling_effect"] = (unscaled - expected).abs().max().item()
        report["rope_scaling_effect_ulps"] = ulps(unscaled, expected)  # in the units of prompt_logprob_ulps
    if getattr(load_hf_config(path), "use_sliding_window", False):  # the window matters at this prompt length
        unwindowed, _ = hf_logprobs(path, torch.tensor(prompts), without_sliding_window=True)
        report["sliding_window_effect_ulps"] = ulps(unwindowed, expected)
    return report


def engine_tensors(worker) -> dict:
    """This engine worker's tensors by name (parameters and buffers, as post-load processing left them)."""
    model = worker.model_runner.model
    return {name: tensor.detach().clone() for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


def compare_with_fresh(worker) -> dict:
    """This worker's tensors against `engine_tensors` at the fresh load (kept on the worker): the largest
    difference, its tensor, how many were compared, and the names that are not in both alike."""
    fresh, now = worker._fresh_tensors, engine_tensors(worker)
    mismatched = sorted(name for name in fresh.keys() | now.keys()
                        if name not in fresh or name not in now or fresh[name].shape != now[name].shape)
    diffs = {name: (fresh[name].double() - now[name].double()).abs().max().item() if now[name].numel() else 0.0
             for name in fresh.keys() & now.keys() if name not in mismatched}
    worst = max(diffs, key=diffs.get)
    return {"max_diff": diffs[worst], "worst": worst, "compared": sorted(diffs), "mismatched": mismatched}


def keep_fresh_tensors(worker) -> None:
    worker._fresh_tensors = engine_tensors(worker)


def revisiting(weights):
    """`weights` with each decoder block's last tensor moved to the end (copies: the stream's tensors may be
    views of buffers it reuses)."""
    from megarl.rollout import _block_of

    held, deferred = None, []
    for name, tensor in weights:
        if held is not None:
            block = _block_of(held[0])
            if block is not None and block != _block_of(name):
                deferred.append(held)  # its block's last tensor
            else:
                yield held
        held = name, tensor.clone()
    if held is not None:
        yield held
    yield from deferred


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--fresh", required=True, help="checkpoint the engine is built from")
    own.add_argument("--synced", required=True, help="checkpoint Megatron loads and syncs into the engine")
    own.add_argument("--out", required=True)
    own.add_argument("--tp", default="2", help="Megatron's TP size")
    own.add_argument("--ep", default="1", help="Megatron's EP size (MoE)")
    mine = own.parse_args()
    args = parse_args(["--model", mine.fresh, "--tensor-model-parallel-size", mine.tp,
                       "--expert-model-parallel-size", mine.ep,
                       "--rollout-tensor-parallel-size", "2", "--rollout-kv-cache-gb", "0.25",
                       "--max-prompt-length", str(PROMPT_LEN), "--max-new-tokens", str(NEW_TOKENS),
                       # Random checkpoints have no tokenizer; prompts are token ids.
                       "--rollout-engine-kwargs", json.dumps({"skip_tokenizer_init": True})])
    context = distributed.init_distributed(args)
    engine = RolloutEngine(args, context.placement.rollout, context.rank, colocated=context.placement.colocated)
    distributed.init_megatron_parallel(context, args.seed)  # after the engine (colocated order)

    from types import SimpleNamespace

    from megarl.models.convert import iter_hf_weights, load_hf_weights
    from megarl.models.megatron_gpt import build_gpt_model
    from megarl.weight_sync import ColocatedSync

    hf_config = load_hf_config(mine.synced)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, hf_config.vocab_size, (2, PROMPT_LEN), generator=generator).tolist()
    report = {"fresh": check_engine(engine, mine.fresh, prompts)}
    engine.llm.collective_rpc(keep_fresh_tensors)
    from megarl.rollout import kv_cache_bytes_per_token

    report["kv_cache"] = engine.llm.collective_rpc(kv_cache_bytes_per_token)[0]
    if dist.get_rank() == 0:
        print(f"engine KV cache per token: {report['kv_cache']}", flush=True)

    model = build_gpt_model(hf_config)
    load_hf_weights(model, mine.synced, hf_config)
    startup_gc.resume_full_collections()  # both models built (build_run's end in a run)
    # A bare GPTModel stands in for the Actor: the sync only asks it for its HF weights.
    actor = SimpleNamespace(hf_weights=lambda bucket_bytes: iter_hf_weights(model, hf_config, bucket_bytes))
    stats = ColocatedSync(context, bucket_bytes=64 * 2**10).sync(actor, engine)
    report["synced"] = {**check_engine(engine, mine.synced, prompts), "sync_bytes": stats.bytes}

    load_hf_weights(model, mine.fresh, hf_config)
    back_actor = SimpleNamespace(hf_weights=lambda bucket_bytes: revisiting(actor.hf_weights(bucket_bytes)))
    ColocatedSync(context, bucket_bytes=64 * 2**10).sync(back_actor, engine)
    back = [None] * dist.get_world_size()  # each TP rank's shards
    dist.all_gather_object(back, engine.llm.collective_rpc(compare_with_fresh)[0])
    report["back"] = back
    if dist.get_rank() == 0:
        with open(mine.out, "w") as f:
            json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine must not stall interpreter shutdown
