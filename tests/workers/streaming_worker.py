"""torchrun worker (2 ranks, separate placement: a train rank and a rollout rank) of tests/test_streaming.py:
streaming generation (--max-staleness, megarl/streaming.py) step by step as train.py's loop runs it, with the
trainer's policy kept at every weight version, so that each batch's tokens can be checked against the version
that sampled them.

Per step the report has the batch's trained version, each sample's token versions, and, for every version v
present in the batch, the trainer's logprobs of the batch recomputed under version v's weights: against the
engine's (rollout) logprobs of the tokens tagged v (`tagged`: mean and max |difference|) and of the tokens tagged
another version (`untagged`: the same, what a wrong tag would read). Rank 0 writes the report (JSON) to argv[1].
"""

from megarl import startup_gc

startup_gc.defer_full_collections()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from megarl import distributed, generation, phases  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402
from megarl.streaming import GenerationStream  # noqa: E402


def parameters(run):
    model = run.actor.model
    return [p for chunk in (model if isinstance(model, list) else [model]) for p in chunk.parameters()]


def versions_of(batch):
    """[N, R] the version of each response token (-1 on padding), in the batch's layout."""
    out = torch.full(batch.rollout_logprobs.shape, -1, dtype=torch.long)
    for i, sample in enumerate(batch.samples):
        tags = sample.token_versions or [sample.weight_version] * len(sample.response_ids)
        out[i, :len(tags)] = torch.tensor(tags)
    return out


def check_versions(run, batch, snapshots):
    """For each version in the batch: its weights into the actor, the old logprobs recomputed, compared."""
    tags = versions_of(batch)
    mask = batch.response_mask.bool()
    current = [p.detach().clone() for p in parameters(run)]
    result = {}
    for version in sorted({int(v) for v in tags[mask].tolist()}):
        with torch.no_grad():
            for p, saved in zip(parameters(run), snapshots[version]):
                p.copy_(saved)
        recomputed, _ = phases.prepare(run, batch)
        gap = (recomputed.old_logprobs - batch.rollout_logprobs).abs()
        mine, others = mask & (tags == version), mask & (tags != version)
        result[version] = {"tagged": [gap[mine].mean().item(), gap[mine].max().item(), int(mine.sum())],
                           "untagged": [gap[others].mean().item() if others.any() else None, int(others.sum())]}
    with torch.no_grad():
        for p, saved in zip(parameters(run), current):
            p.copy_(saved)
    return result


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    if run.rollout is not None:
        run.stream = GenerationStream(run)
    snapshots, report = {}, []
    ahead = generation.generate_ahead(run, 0, trained_at=run.weight_version)
    for step in range(args.train_steps):
        samples, _ = phases.generate(run, step, ahead)
        ahead = generation.generate_ahead(run, step + 1, trained_at=run.weight_version + 1) \
            if step + 1 < args.train_steps else None
        batch, _ = phases.score_and_filter(run, samples)
        batch, _ = phases.prepare(run, batch)
        batch, _ = phases.compute_advantages(run, batch)
        entry = {"step": step, "trained_at": run.weight_version,
                 "token_versions": [s.token_versions for s in batch.samples],
                 "policy_masks": [s.policy_mask for s in batch.samples],
                 "texts": [[s.response_ids, s.response_text, s.min_tokens] for s in batch.samples],
                 "routed": [s.routes is not None and s.routes.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
                            for s in batch.samples]}
        if run.actor is not None:
            snapshots[run.weight_version] = [p.detach().clone() for p in parameters(run)]
            entry["versions"] = check_versions(run, batch, snapshots)
        phases.update(run, batch, step)
        phases.sync(run)
        report.append(entry)
    if context.env.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    distributed.all_gather_objects(None, context)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)
