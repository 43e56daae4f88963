"""torchrun worker: the actor's and the critic's outputs and losses on a fixed batch of samples of
different lengths, under each micro-batch layout (--micro-batch-size right-padded, a token budget,
packed, both; at TP > 1 also right-padded and packed under sequence parallelism, whatever
--sequence-parallel says). Every layout starts from the same checkpoint. Rank 0 writes <out>.json: per
layout, the response-aligned logprobs and values before the update, the actor's and critic's train_step
metrics, the micro-batch counts of every rank and the padding tokens."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import os  # noqa: E402
import sys  # noqa: E402


sys.path.insert(0, os.path.dirname(__file__))
from offload_worker import train_ranks, write_report  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.model_runner import make_micro_batches, sequence_multiple  # noqa: E402
from megarl.models.convert import unwrap  # noqa: E402

BUDGET = 19  # rank 0 (lengths 7..11) needs 3 micro-batches, rank 1 (8..12) 4
LAYOUTS = {"padded": dict(), "budget": dict(max_tokens=BUDGET), "packed": dict(packed=True),
           "budget_packed": dict(max_tokens=BUDGET, packed=True)}
SEQUENCE_PARALLEL = {"padded_sp": dict(sequence_parallel=True), "packed_sp": dict(packed=True, sequence_parallel=True)}


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args, context, hf_config, batch, share = train_ranks(argv, count=12)
    from megarl.actor import Actor
    from megarl.critic import Critic

    batch.ref_logprobs = batch.old_logprobs + 0.01 * batch.response_mask
    # Rank 1 holds the longer samples: its token budget needs more micro-batches than rank 0's.
    mine = batch.select(share)
    report = {}
    layouts = {**LAYOUTS, **(SEQUENCE_PARALLEL if args.tensor_model_parallel_size > 1 else {})}
    for name, layout in layouts.items():
        args.sequence_parallel = layout.get("sequence_parallel", False)
        micro_batches = make_micro_batches(mine, args.micro_batch_size, 0, max_tokens=layout.get("max_tokens"),
                                           packed=layout.get("packed", False),
                                           sequence_multiple=sequence_multiple(args))
        actor, critic = Actor(args, hf_config), Critic(args, hf_config)
        counts = distributed.all_gather_objects(
            [(len(b.spans), sum(p + r for *_, p, r in b.spans)) for b in micro_batches], context)
        report[name] = {
            "logprobs": actor.logprobs(micro_batches, batch.width)[0].tolist(),
            "values": critic.values(micro_batches, batch.width).tolist(),
            "actor": [actor.train_step(micro_batches, kl_coef=0.1, reference=actor) for _ in range(2)],
            "critic": [critic.train_step(micro_batches) for _ in range(2)],
            "micro_batches": counts,
            "padding": sum(b.padding_tokens() for b in micro_batches),
            "lengths": [b.tokens.shape[1] for b in micro_batches],
            "sequence_parallel": unwrap(actor.model).config.sequence_parallel}
    write_report(f"{out}.json", report)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
