"""torchrun worker (one rank, colocated): --rollout-sleep-level 2's rebuild on a real CPU engine.

vLLM's CPU sleep is a no-op, so the engine's weights are discarded here by hand to stand for a GPU's level 2:
after the level-2 sleep (megarl's own part: the derived state dropped) every parameter and kept weight is
filled with NaN and the derived state is rebuilt from them (packed GEMM handles, packed experts: garbage, as
a GPU's discarded pool would hold). The trainer's weights are perturbed once, then:

  level1     sleep at level 1, sync, sample (step 1) and greedy: the reference;
  level2     sleep at level 2 (dropped state checked, then the poison), sync, the same samples and greedy;
  resent     sleep at level 2, poison, and a turn with no sync before it (Run.rollout_turn re-sends the weights);
  stale      as level2 with the post-load processing skipped in the sync: must differ (so the test can fail).

On CUDA (tests/gpu/lane.py's sleep_level2 part) vLLM's own level 2 discards the weights: no poison (the
memory is unmapped while the engine sleeps) and no stale case (an unquantized GPU layer's post-load
processing derives nothing). Rank 0 writes <out>.json: per case the trainer-vs-rollout mismatch of its
samples, the samples (ids, logprobs) and the greedy ids; and what the level-2 sleep dropped. `problems`
checks it (tests/test_sleep_level.py, the lane).
"""

from megarl import startup_gc

startup_gc.defer_full_collections()

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from megarl import accelerator, distributed, phases, rollout  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.batch import mismatch_metrics  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402

GREEDY_PROMPTS = ["What is 12 + 30?", "What is 7 + 88?"]


def poison(worker) -> None:
    """What a GPU's level 2 leaves in the weights pool: garbage. Every parameter and kept weight NaN, and the
    derived state rebuilt from them (so a sync that skipped the rebuild would compute with it)."""
    model = worker.model_runner.model
    with torch.no_grad():
        for layer, kept, _ in rollout._in_place_layers(worker):
            for name, weight in (kept or {}).items():
                setattr(layer, name, weight)
                weight.fill_(math.nan)
            if not kept:
                layer.weight.fill_(math.nan)
            rollout.process_after_load(layer, kept)
        for _, param in model.named_parameters():
            if param.is_floating_point():
                param.fill_(math.nan)


def dropped(worker) -> dict:
    """What the in-place layers hold after the level-2 sleep's discard (before the poison)."""
    layers = rollout._in_place_layers(worker)
    experts = [layer for layer, kept, _ in layers if kept and rollout._is_fused_moe(layer)]
    return {"layers": len(layers), "with_gemm_handle": sum(hasattr(layer, "cpu_linear") for layer, _, _ in layers),
            "expert_layers": len(experts),
            "expert_weight_elements": sum(layer.w13_weight.numel() + layer.w2_weight.numel() for layer in experts)}


def case(run, step=1) -> dict:
    """A rollout turn's samples at `step` (the trainer's logprobs of them: the mismatch) and greedy ids."""
    samples, _ = phases.generate(run, step)
    batch, _ = phases.score_and_filter(run, samples)
    batch, _ = phases.prepare(run, batch)
    metrics = mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    from megarl.data.prompts import render_chat

    prompts = [render_chat(run.tokenizer, text) for text in GREEDY_PROMPTS]
    with run.rollout_turn():
        greedy = run.rollout.generate(prompts, list(range(len(prompts))), step=0, greedy=True)
    return {"mismatch": metrics["mismatch"], "samples": [(s.response_ids, s.logprobs) for s in samples],
            "greedy": [s.response_ids for s in greedy]}


def sleep_at(run, level: int) -> None:
    """The end of a rollout turn at `level` (the engine awake before it)."""
    run.args.rollout_sleep_level = level
    run.rollout.onload()
    run.rollout.offload()


def run_cases(run) -> dict:
    engine = run.rollout
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in run.actor.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    report = {}

    sleep_at(run, 1)
    phases.sync(run)
    report["level1"] = case(run)  # its turns sleep at level 1

    sleep_at(run, 2)
    report["dropped"] = engine.llm.collective_rpc(dropped)[0]
    try:
        engine.generate([[1, 2, 3]], [0], step=0, greedy=True)
        report["generate_while_discarded"] = "ran"
    except RuntimeError as error:
        report["generate_while_discarded"] = str(error)
    if not accelerator.ON_CUDA:
        engine.llm.collective_rpc(poison)
    phases.sync(run)
    report["level2"] = case(run)  # its turns sleep at level 2: the greedy turn re-sends the weights

    sleep_at(run, 2)
    if not accelerator.ON_CUDA:
        engine.llm.collective_rpc(poison)
    report["resent"] = case(run)  # no sync: the turn re-sends the trainer's weights

    if accelerator.ON_CUDA:
        return report
    sleep_at(run, 2)
    engine.llm.collective_rpc(poison)
    run.args.rollout_sleep_level = 1
    rebuild = rollout.process_after_load
    rollout.process_after_load = lambda layer, kept: None  # the sync without the rebuild
    try:
        phases.sync(run)
        report["stale"] = case(run)
    finally:
        rollout.process_after_load = rebuild
    return report


def problems(report: dict, on_cuda: bool, moe: bool = False) -> list[str]:
    """What is wrong with a report, one line each (none: level 2 rebuilt the engine)."""
    found = []
    dropped = report["dropped"]
    if dropped["layers"] == 0:
        found.append("no layer reprocessed by the sync")
    if not on_cuda and (dropped["with_gemm_handle"] or dropped["expert_weight_elements"]
                        or (dropped["expert_layers"] > 0) != moe):
        found.append(f"the level-2 sleep kept derived state: {dropped}")
    if "before a weight sync" not in report["generate_while_discarded"]:
        found.append(f"generate with the weights discarded: {report['generate_while_discarded']}")
    reference = report["level1"]
    if not reference["mismatch"] <= (1e-4 if not on_cuda else 2e-2):
        found.append(f"level 1's mismatch {reference['mismatch']}")
    for name in ("level2", "resent"):  # after the sync; after a turn that re-sent the weights itself
        for what in ("greedy", "samples", "mismatch"):  # the samples: ids and logprobs, bit for bit
            if report[name][what] != reference[what]:
                found.append(f"{name}: its {what} differ from level 1's")
    if not on_cuda:  # the same sync without the rebuild computes with the poisoned derived state
        stale = report["stale"]
        if stale["greedy"] == reference["greedy"] and stale["samples"] == reference["samples"]:
            found.append("without the rebuild the engine still samples as level 1: the test cannot fail")
        if not (math.isnan(stale["mismatch"]) or stale["mismatch"] > 1e-2):
            found.append(f"without the rebuild the mismatch is {stale['mismatch']}")
    return found


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    report = run_cases(build_run(args, context))
    if context.env.rank == 0:
        with open(f"{out}.json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # as train.py: vLLM's in-process engine must not stall interpreter shutdown
