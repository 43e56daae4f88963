"""torchrun worker: the actor's logprobs, the critic's values and two train steps of each on a fixed
batch, at whatever TP/PP/CP/DP the command line gives (packed with --padding-free). Rank 0 writes <out>.json with the whole batch's
response-aligned outputs (gathered over data-parallel ranks) and the per-step metrics.

With --teacher-model (`companions`): the full-vocabulary companions instead, a reference (--ref-model) for
--kl-estimator full and a colocated teacher for full-vocabulary distillation, every other sample an OPSD
row (a longer teacher prompt): the exact per-token KL and two actor steps with both."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from offload_worker import train_ranks, write_report  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.model_runner import make_micro_batches, sequence_multiple  # noqa: E402


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args, context, hf_config, batch, share = train_ranks(argv, count=8)
    if args.teacher_model:
        return companions(out, args, context, hf_config, batch, share)
    from megarl.actor import Actor
    from megarl.critic import Critic

    batch.ref_logprobs = batch.old_logprobs + 0.01 * batch.response_mask
    mine = batch.select(share)
    micro_batches = make_micro_batches(mine, args.micro_batch_size, 0, packed=args.padding_free,
                                       sequence_multiple=sequence_multiple(args))
    actor, critic = Actor(args, hf_config), Critic(args, hf_config)
    logprobs = actor.logprobs(micro_batches, batch.width)[0]
    values = critic.values(micro_batches, batch.width)
    gathered = distributed.all_gather_objects((share.tolist(), logprobs.tolist(), values.tolist()), context)
    rows = {}
    for indices, lp, v in gathered:  # tensor-/pipeline-/context-parallel peers hold the same rows: any copy will do
        rows.update({i: (a, b) for i, a, b in zip(indices, lp, v)})
    report = {"logprobs": [rows[i][0] for i in sorted(rows)], "values": [rows[i][1] for i in sorted(rows)],
              "actor": [actor.train_step(micro_batches, kl_coef=0.1, reference=actor) for _ in range(2)],
              "critic": [critic.train_step(micro_batches) for _ in range(2)],
              # every rank's rows, as "logprobs" (this rank's alone would be another set of rows at another DP)
              "logprobs_after": _whole(share, actor.logprobs(micro_batches, batch.width)[0], context)}
    write_report(f"{out}.json", report)


def _whole(share, rows_of_share, context):
    rows = {}
    for indices, values in distributed.all_gather_objects((share.tolist(), rows_of_share.tolist()), context):
        rows.update(zip(indices, values))  # tensor-/pipeline-/context-parallel peers hold the same rows
    return [rows[i] for i in sorted(rows)]


def companions(out, args, context, hf_config, batch, share):
    from megarl.actor import Actor
    from megarl.reference import Reference
    from megarl.teacher import Teacher

    for i, sample in enumerate(batch.samples):  # OPSD rows: a longer privileged prompt before the same response
        if i % 2 == 0:
            sample.teacher_prompt_ids = [7, 8, 9, 10] + sample.prompt_ids
    micro_batches = make_micro_batches(batch.select(share), args.micro_batch_size, 0, packed=args.padding_free,
                                       sequence_multiple=sequence_multiple(args))
    actor, reference, teacher = Actor(args, hf_config), Reference(args, hf_config), Teacher(args)
    logprobs, kl = actor.logprobs(micro_batches, batch.width, full_kl_to=reference)
    report = {"kl": _whole(share, kl, context), "logprobs": _whole(share, logprobs, context),
              "actor": [actor.train_step(micro_batches, kl_coef=0.1, reference=reference, teacher=teacher)
                        for _ in range(2)]}
    report["logprobs_after"] = _whole(share, actor.logprobs(micro_batches, batch.width)[0], context)
    write_report(f"{out}.json", report)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
