"""torchrun worker (one rank): a teacher server's top-k against the colocated Megatron teacher's.

usage: teacher_server_worker.py OUT SERVER_URL DEAD_URL train.py-flags (with --teacher-model, the server's
checkpoint). The step-0 samples (every other one an OPSD row with a longer teacher prompt) are scored by the
colocated teacher, then through the teach phase by SERVER_URL; then once more by DEAD_URL (nothing listens
there), whose error is recorded. Writes the comparison to OUT.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from megarl import distributed, phases  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.errors import TeacherServerError  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402
from megarl.teacher_server import TeacherServer, connect  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers (also under torchrun)
from helpers import fp32_paths_ulps, opsd_step_batch  # noqa: E402

FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_logprobs")


def main():
    out, url, dead_url, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    batch = opsd_step_batch(run)
    batch, _ = phases.teach(run, batch)  # the colocated Megatron teacher
    colocated = {name: getattr(batch, name).clone() for name in FIELDS}
    # The same batch through the teach phase's server path (rank 0 asks, every rank receives).
    args.teacher_server = url
    run.teacher_server = connect(args, run.tokenizer, run.hf_config.vocab_size)
    start = time.perf_counter()
    batch, metrics = phases.teach(run, batch)
    seconds = time.perf_counter() - start
    mask = batch.response_mask.bool()
    ranked = colocated["teacher_topk_logprobs"]
    # Megatron's and vLLM's logits differ by ~1e-6: ids may swap only where two ranks are that close.
    clear = ((ranked[..., :-1] - ranked[..., 1:]).min(dim=-1).values > 1e-4) & mask
    ids_differ = (colocated["teacher_topk_ids"] != batch.teacher_topk_ids).any(dim=-1)
    opsd = torch.tensor([s.teacher_prompt_ids is not None for s in batch.samples])
    report = {
        "positions": int(mask.sum()), "clear_positions": int(clear.sum()), "opsd_rows": int(opsd.sum()),
        "opsd_clear_positions": int((clear & opsd[:, None]).sum()),
        "ids_differ_where_clear": int((ids_differ & clear).sum()),
        # Two fp32 paths (tests/helpers.py): Megatron's and the server's vLLM forward of the same weights.
        "topk_logprob_ulps": fp32_paths_ulps(ranked[mask], batch.teacher_topk_logprobs[mask]),
        "sampled_logprob_ulps": fp32_paths_ulps(colocated["teacher_logprobs"][mask], batch.teacher_logprobs[mask]),
        "teacher_kl": metrics.metrics.get("teacher_kl"), "server_seconds": seconds,
    }
    # Nothing listens at dead_url: the teach phase's error, and how long it took.
    run.teacher_server = TeacherServer(dead_url, run.teacher_server.model, args.gkd_logits_topk, 5.0, 4, 2,
                                       run.hf_config.vocab_size, args.gkd_temperature, args.temperature)
    start = time.perf_counter()
    try:
        phases.teach(run, batch)
        report["dead_error"] = None
    except TeacherServerError as error:
        report["dead_error"] = str(error)
    report["dead_seconds"] = time.perf_counter() - start
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    release_shared_memory()


if __name__ == "__main__":
    main()
