"""torchrun worker: the standalone vLLM teacher's top-k against the colocated Megatron teacher's.

Rank 0 trains and generates (and also builds a colocated Megatron teacher from the same
checkpoint, for the comparison); the other ranks are the standalone teacher (vLLM engines). The
step-0 samples are scored by both; every other sample carries an OPSD teacher prompt that is
longer than its student prompt. Rank 0 writes the comparison to <out>.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from megarl import distributed, phases  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.model_runner import make_micro_batches  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers (also under torchrun)
from helpers import fp32_paths_ulps, opsd_step_batch  # noqa: E402


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    batch = opsd_step_batch(run)
    batch, _ = phases.teach(run, batch)  # the standalone teacher ranks
    if run.actor is not None:
        from megarl.teacher import Teacher

        args.teacher_model = args.standalone_teacher_model
        teacher = Teacher(args)
        colocated = teacher.score(make_micro_batches(batch, args.micro_batch_size, 0), batch.width,
                                  args.gkd_logits_topk)
        mask = batch.response_mask.bool()
        ranked = colocated["teacher_topk_logprobs"]
        # Megatron's and vLLM's logits differ by ~1e-6: ids may swap only where two ranks are that close.
        clear = ((ranked[..., :-1] - ranked[..., 1:]).min(dim=-1).values > 1e-4) & mask
        ids_differ = (colocated["teacher_topk_ids"] != batch.teacher_topk_ids).any(dim=-1)
        opsd = torch.tensor([s.teacher_prompt_ids is not None for s in batch.samples])
        report = {
            "positions": int(mask.sum()), "clear_positions": int(clear.sum()), "opsd_rows": int(opsd.sum()),
            "opsd_prompt_longer": all(len(s.teacher_prompt_ids) > len(s.prompt_ids)
                                      for s in batch.samples if s.teacher_prompt_ids),
            "ids_differ_where_clear": int((ids_differ & clear).sum()),
            "opsd_clear_positions": int((clear & opsd[:, None]).sum()),
            # Two fp32 paths (tests/helpers.py): Megatron's and vLLM's forward of the same weights.
            "topk_logprob_ulps": fp32_paths_ulps(ranked[mask], batch.teacher_topk_logprobs[mask]),
            "sampled_logprob_ulps": fp32_paths_ulps(colocated["teacher_logprobs"][mask],
                                                    batch.teacher_logprobs[mask]),
        }
        # The privileged prompt is what changes the teacher's view of the same responses.
        for sample in batch.samples:
            sample.teacher_prompt_ids = None
        plain = teacher.score(make_micro_batches(batch, args.micro_batch_size, 0), batch.width, args.gkd_logits_topk)
        changed = (plain["teacher_logprobs"] - colocated["teacher_logprobs"])[opsd]
        report["opsd_vs_plain_max_diff"] = changed.abs().max().item()
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    distributed.all_gather_objects(None, context)
    release_shared_memory()


if __name__ == "__main__":
    main()
