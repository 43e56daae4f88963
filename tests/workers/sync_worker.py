"""torchrun worker: weight-sync correctness on real ranks.

1. before any update: rollout vs trainer logprobs of step-0 samples;
2. perturb the trainer's weights (the same noise on every rank), sync, generate
   again: mismatch and the rollout/trainer importance ratio right after a sync;
3. greedy generations of fixed prompts from the synced engine, and the perturbed
   model exported as an HF checkpoint, for a fresh engine to compare against.
Rank 0 writes <out>.json; the checkpoint goes to <out>_hf/.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from megarl import distributed
from megarl.arguments import parse_args
from megarl.models.convert import save_hf_checkpoint
from megarl.rl import RLRun, _mismatch
from megarl.rollout import release_shared_memory
from megarl.trainer import make_micro_batches

GREEDY_PROMPTS = ["What is 12 + 30?", "What is 7 + 88?", "What is 45 + 45?", "What is 3 + 9?"]


def measure(rl, step):
    samples, _ = rl.generate(step)
    micro_batches = make_micro_batches(samples, 32, 0) if rl.trainer else []
    if rl.trainer is None:
        return None
    rl.trainer.compute_logprobs(micro_batches)
    width = max(len(s.response_ids) for s in samples)
    old, rollout, mask = (torch.cat([b.response_aligned(getattr(b, name), width) for b in micro_batches])
                          for name in ("old_logprobs", "rollout_logprobs", "loss_mask"))
    return _mismatch(old, rollout, mask)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    rl = RLRun(args, context)
    report = {"before": measure(rl, 0)}

    if rl.trainer is not None:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in rl.trainer.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    report["sync"] = rl.sync_weights()
    report["after"] = measure(rl, 1)

    if rl.engine is not None:
        from megarl.data import render_chat

        prompts = [render_chat(rl.tokenizer, text) for text in GREEDY_PROMPTS]
        greedy = rl.engine.generate(prompts, list(range(len(prompts))), step=0, greedy=True)
        report["greedy"] = [s.response_ids for s in greedy]
    if rl.trainer is not None:
        save_hf_checkpoint(rl.trainer.model, rl.hf_config, f"{out}_hf", tokenizer=rl.tokenizer,
                           is_writer=dist.get_rank() == 0, source_dir=args.model)
    reports = distributed.all_gather_objects(report, context)
    if context.env.rank == 0:
        with open(f"{out}.json", "w") as f:
            json.dump(reports, f)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # as train.py: vLLM's in-process engine must not stall interpreter shutdown
