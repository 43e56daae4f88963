"""torchrun worker (one rank, colocated) of tests/test_hf_rollout.py: the HF rollout backend against the vLLM one
and against the trainer.

Both engines are built on the rank (the run's vLLM RolloutEngine, and an HfRolloutEngine beside it) from the
same checkpoint, and every comparison feeds them the same prompts, indices, step and seed key:
  greedy             both engines, greedy: tokens, logprobs, texts, truncation
  greedy_min_stop    greedy with min_tokens 6 and the stop string "}": the held-back ids and the same
  mismatch_before    the HF engine samples the step's prompts at --temperature (0.7): its logprobs against the
                     trainer's recomputed ones (phases.prepare), and with --min-new-tokens 16 = max
  mismatch_stale     one GRPO step (update), the HF engine not yet synced: the same (what a missed sync reads)
  mismatch_after     then the weight sync into both engines (the run's strategy), then the same;
                     greedy_after: both engines greedy again (the synced weights agree)
  offload_roundtrip  the HF weights after offload/onload are bit-identical
With --rollout-backend hf in the arguments the run's own engine is the HF one and no vLLM engine is built: only
the comparisons with the trainer (mismatch_*), the sync and the offload round trip (the families whose vLLM parity
tests/test_families_vllm.py holds, on random weights, where greedy tokens of two engines may part at a near-tie).
Rank 0 writes the report (JSON) to argv[1].
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from megarl import distributed, phases  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.batch import mismatch_metrics  # noqa: E402
from megarl.data.prompts import render_chat  # noqa: E402
from megarl.hf_rollout import HfRolloutEngine  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402

TEXTS = ["What is 12 + 30?", "What is 7 + 88?", "What is 45 + 45?", "What is 3 + 9?", "Compute 19 + 17."]


def both(run, hf, prompts, **options):
    indices = list(range(len(prompts)))
    return [[{"ids": s.response_ids, "logprobs": s.logprobs, "text": s.response_text, "truncated": s.truncated,
              "min_tokens": s.min_tokens, "held_back_ids": list(s.held_back_ids)}
             for s in engine.generate(prompts, indices, 0, **options)] for engine in (run.rollout, hf)]


def measure(run, step, min_new_tokens=0):
    run.args.min_new_tokens = min_new_tokens
    samples, _ = phases.generate(run, step)
    batch, _ = phases.score_and_filter(run, samples)
    batch, _ = phases.prepare(run, batch)
    run.args.min_new_tokens = 0
    lengths = [len(s.response_ids) for s in samples]
    return batch, {**mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask),
                   "lengths": lengths}


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    with_vllm = args.rollout_backend != "hf"
    report = {}
    if with_vllm:
        vllm_engine = run.rollout
        hf = HfRolloutEngine(args, context.placement.rollout, context.rank, colocated=True)
        prompts = [render_chat(run.tokenizer, text) for text in TEXTS]
        report["greedy"] = both(run, hf, prompts, greedy=True)
        args.stop = ["}"]
        report["greedy_min_stop"] = both(run, hf, prompts, greedy=True, min_tokens=6)
        args.stop = []
    else:
        hf = run.rollout

    run.rollout = hf  # the run's rollout is the HF engine from here on (the phases and the sync use it)
    report["mismatch_before"] = measure(run, 0)[1]
    report["mismatch_before_min_tokens"] = measure(run, 0, min_new_tokens=args.max_new_tokens)[1]
    batch, _ = measure(run, 1)
    batch, _ = phases.compute_advantages(run, batch)
    phases.update(run, batch, 1)
    report["mismatch_stale"] = measure(run, 2)[1]  # the HF engine still holds the weights before the update
    report["sync_bytes"] = phases.sync(run).metrics["sync_bytes"]  # the run's strategy, into the HF engine
    if with_vllm:
        run.weight_sync.sync(run.actor, vllm_engine)  # and into the vLLM engine
    report["mismatch_after"] = measure(run, 3)[1]
    hf.onload()  # the last rollout turn ended with the HF engine offloaded (colocated)
    if with_vllm:
        run.rollout = vllm_engine
        report["greedy_after"] = both(run, hf, prompts, greedy=True)

    before = [p.detach().clone() for p in hf.model.parameters()]
    hf.offload()
    emptied = all(p.untyped_storage().nbytes() == 0 for p in hf.model.parameters())
    hf.onload()
    report["offload_roundtrip"] = {"emptied": emptied, "asleep_after": sorted(hf.asleep),
                                   "equal": all(torch.equal(a, p) for a, p in zip(before, hf.model.parameters()))}
    if context.env.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # as train.py: vLLM's in-process engine must not stall interpreter shutdown
