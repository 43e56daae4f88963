"""torchrun worker: weight-sync correctness on real ranks.

1. before any update: rollout vs trainer logprobs of step-0 samples;
2. three times: perturb the trainer's weights (the same noise on every rank),
   sync, generate again: mismatch and the rollout/trainer importance ratio right
   after each sync (a second and third sync must not reuse stale state);
3. greedy generations of fixed prompts from the synced engine, and the perturbed
   model exported as an HF checkpoint, for a fresh engine to compare against.
Rank 0 writes <out>.json; the checkpoint goes to <out>_hf/.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from megarl import checkpoint, distributed, phases  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.batch import mismatch_metrics  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402

GREEDY_PROMPTS = ["What is 12 + 30?", "What is 7 + 88?", "What is 45 + 45?", "What is 3 + 9?"]


def measure(run, step):
    samples, _ = phases.generate(run, step)
    batch, _ = phases.score_and_filter(run, samples)
    batch, _ = phases.prepare(run, batch)
    if run.actor is None:
        return None
    return mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    report = {"before": measure(run, 0)}

    generator = torch.Generator().manual_seed(7)
    report["syncs"] = []
    for step in (1, 2, 3):  # the broadcast sync keeps its plan and buffers from the first sync on
        if run.actor is not None:
            with torch.no_grad():
                for param in run.actor.model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        synced = phases.sync(run)
        report["syncs"].append({"sync": {"sync_seconds": synced.seconds, **synced.metrics},
                                "after": measure(run, step)})
    report["sync"], report["after"] = report["syncs"][0]["sync"], report["syncs"][0]["after"]

    if run.rollout is not None:
        from megarl.data.prompts import render_chat

        prompts = [render_chat(run.tokenizer, text) for text in GREEDY_PROMPTS]
        greedy = run.rollout.generate(prompts, list(range(len(prompts))), step=0, greedy=True)
        report["greedy"] = [s.response_ids for s in greedy]
    checkpoint.save_hf(run, f"{out}_hf")
    reports = distributed.all_gather_objects(report, context)
    if context.env.rank == 0:
        with open(f"{out}.json", "w") as f:
            json.dump(reports, f)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # as train.py: vLLM's in-process engine must not stall interpreter shutdown
