"""torchrun worker (colocated; the test runs two ranks, one engine at rollout TP = 2) of tests/test_multiturn.py:
multi-turn episodes on the real engine.

Runs with --external-plugins tests/plugins/probe_tools.py --tools probe --tool-parser always_probe: every
assistant turn calls `probe` (the tiny model writes no tool calls of its own), --max-turns turns per episode.

  scheduling  prompts 0..3, 2 samples each; prompt 0's row makes its first-turn probe "slow": it returns
              only when every other prompt's episodes have ended (on_prompt_done sets the plugin's
              RELEASE; 50 s at most, below --tool-timeout). Prompt 1's probe raises.
              Report: the engine's request log, each episode's turns, policy_mask and logprobs.
  mismatch    one training step's generate -> prepare (two-pass: --kl-coef) on episodes: the rollout vs
              trainer mismatch over the policy's tokens (batch.response_mask); the trainer's logprobs of the
              tool tokens, unmasked, against the 0 the rollout records there (what the mismatch would read
              if they entered it); then update + sync and the same on fresh episodes.
  dump        the step's rollout dump (--rollout-save-dir), read back.
  ranks       every rank's request log and episodes of the scheduling call, compared (`ranks_agree`).
  interaction episodes without tools whose user answers (the plugin's `probe_user`: the built-in `retry`
              on the arithmetic reward, or per row a user who hangs past a 2 s timeout, raises, or ends),
              up to 3 assistant turns; report: the episodes, their rows, the request log, tool metrics.
  tip         ms-swift's math_tip_trick (an interaction that continues the assistant's own turn): the episodes.
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
from megarl.run import build_run  # noqa: E402


def episodes_report(samples):
    return [{"prompt": s.prompt_index, "policy_mask": s.policy_mask, "logprobs": s.logprobs,
             "response_ids": s.response_ids, "turns": s.turns, "truncated": s.truncated,
             "text": s.response_text} for s in samples]


def measure(run, step):
    samples, report = phases.generate(run, step)
    batch, _ = phases.score_and_filter(run, samples)
    batch, _ = phases.prepare(run, batch)
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    tool = (torch.arange(batch.width)[None, :] < lengths[:, None]).float() - batch.response_mask
    raw, _ = run.actor.logprobs(phases._micro_batches(run, batch), batch.width)  # unmasked, every token
    return batch, {"policy": mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask),
                   "tool_tokens_unmasked": mismatch_metrics(raw, batch.rollout_logprobs, tool),
                   "policy_tokens": batch.response_mask.sum().item(), "tool_tokens": tool.sum().item(),
                   "metrics": report.metrics}


def interaction(run, plugin):
    from megarl.multiturn import EpisodeSettings
    from megarl.tools import ToolRunner, tool_metrics
    from megarl.tools.interactions import INTERACTIONS

    plugin.RELEASE.clear()  # the hanging user waits on it: past the 2 s timeout
    # A thread per episode (20): the 4 abandoned hanging replies hold theirs until RELEASE, and no other
    # episode's reply may queue behind them.
    settings = EpisodeSettings(ToolRunner([], 20, timeout=2.0), run.tokenizer, 3, "hermes",
                               INTERACTIONS["probe_user"](run.reward))
    texts = ["What is 12 + 30?", "What is 7 + 88?", "What is 45 + 45?", "What is 3 + 9?", "What is 5 + 6?"]
    rows = [{"answer": "42"}, {"answer": "95"}, {"answer": "90", "user": "hang"}, {"answer": "12", "user": "raise"},
            {"answer": "11", "user": "end"}]
    samples = run.rollout.generate([render_chat(run.tokenizer, t) for t in texts], list(range(5)), 7, n=4,
                                   seed_key=("interaction",), rows=rows, episodes=settings)
    plugin.RELEASE.set()
    return {"episodes": episodes_report(samples), "rows": rows, "log": run.rollout.last_episode_log,
            "metrics": tool_metrics(samples)}


def tip(run):
    """ms-swift's math_tip_trick on 2 prompts x 2 samples: the tiny model writes no \\boxed answer, so every
    first turn is judged wrong and continued after the tip, once."""
    from megarl.multiturn import EpisodeSettings
    from megarl.tools import ToolRunner
    from megarl.tools.interactions import INTERACTIONS

    settings = EpisodeSettings(ToolRunner([], 4, timeout=30.0), run.tokenizer, 3, "hermes",
                               INTERACTIONS["math_tip_trick"](run.reward))
    texts, rows = ["What is 12 + 30?", "What is 7 + 88?"], [{"gt_answer": "42"}, {"gt_answer": "95"}]
    samples = run.rollout.generate([render_chat(run.tokenizer, t) for t in texts], [0, 1], 9, n=2,
                                   seed_key=("tip",), rows=rows, episodes=settings)
    return {"episodes": episodes_report(samples)}


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    plugin = sys.modules[next(name for name, m in sys.modules.items() if hasattr(m, "RELEASE")
                              and name.startswith("megarl_plugin"))]
    texts = ["What is 12 + 30?", "What is 7 + 88?", "What is 45 + 45?", "What is 3 + 9?"]
    rows = [{"probe": "slow"}, {"probe": "raise"}, {}, {}]
    done_order = []

    def on_prompt_done(i, samples):
        done_order.append(i)
        if set(done_order) >= {1, 2, 3}:
            plugin.RELEASE.set()

    samples = run.rollout.generate([render_chat(run.tokenizer, t) for t in texts], [0, 1, 2, 3], 0, n=2,
                                   seed_key=("test",), on_prompt_done=on_prompt_done, rows=rows,
                                   episodes=run.episodes)
    report = {"log": run.rollout.last_episode_log, "done_order": done_order, "episodes": episodes_report(samples),
              "released_by_others": plugin.RELEASE.is_set()}
    # With --rollout-tensor-parallel-size 2 both ranks are one engine: the same requests at the same engine
    # steps, the same tokens and tool messages (the leader ran the tools, the other rank received them).
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (report["log"], report["episodes"]))
    report["ranks_agree"] = all(other == every[0] for other in every)
    report["ranks"] = len(every)
    run.rollout.tool_wait_seconds = 0.0
    batch, report["mismatch_before"] = measure(run, 0)
    batch, _ = phases.compute_advantages(run, batch)
    phases.update(run, batch, 0)
    phases.sync(run)
    _, report["mismatch_after"] = measure(run, 1)
    report["interaction"] = interaction(run, plugin)
    report["tip"] = tip(run)
    dump = os.path.join(args.rollout_save_dir, "train_step2.jsonl")
    with open(dump) as f:
        report["dump"] = [json.loads(line) for line in f]
    if context.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
    os._exit(0)
