"""Benchmark: the HF rollout backend's decoding (megarl/hf_rollout.py) against its loop before issue 54
(tests/hf_rollout_reference.py), side by side in one process, on the same engine and weights.

    python bench/hf_rollout.py [--rounds 3 --prompts 8 --generations 4 --max-new-tokens 128 --threads 1
                                [--cpu-gemm auto|onednn|torch]]

The job is bench/e2e.py's generate phase on one engine: its 34M-parameter Qwen2 (built there, `build_model`),
the built-in arithmetic prompts rendered with the chat template, 8 prompts x 4 samples at temperature 1, up to
128 new tokens, fp32, one thread (as each of e2e's two ranks). Each round generates the same step with the old
loop and the new one, alternating which goes first (other load on the host hits both alike), and checks that the
two give the same tokens, and the same logprobs (bit for bit, or their largest difference). The GEMM library is
chosen as a colocated rank's trainer chooses it (megarl/cpu_gemm.py, --cpu-gemm; auto takes the choice kept for
this machine): with oneDNN the new loop's linear layers take it, the old loop keeps torch's as it did, and the
logprobs differ at fp32 rounding. Printed: each round's wall and CPU seconds (the
process's CPU time: on a shared host other jobs stretch the wall time far more than the single thread's own),
the medians of each side and the medians of the per-round ratios old / new; greedy rounds the same way.

It prints; it asserts nothing.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", default=os.path.join(ROOT, "artifacts/bench-e2e-qwen2"))
    parser.add_argument("--cpu-gemm", default="auto", choices=["auto", "onednn", "torch"])
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from e2e import build_model
    from hf_rollout_reference import old_engine

    from megarl import cpu_gemm
    from megarl.arguments import parse_args
    from megarl.data.prompts import render_chat
    from megarl.data.tasks.arithmetic import make_problems
    from megarl.hf_rollout import HfRolloutEngine
    from megarl.placement import Placement

    build_model(args.model_dir)
    engine_args = parse_args(["--model", args.model_dir, "--rollout-backend", "hf", "--temperature", "1.0",
                              "--num-generations", str(args.generations),
                              "--max-new-tokens", str(args.max_new_tokens), "--cpu-gemm", args.cpu_gemm],
                             world_size=1)
    gemm = cpu_gemm.choose(args.cpu_gemm)
    engine = HfRolloutEngine(engine_args, Placement.from_args(engine_args, 1).rollout, 0, colocated=True)
    problems = make_problems(args.prompts, seed=1234)
    prompts = [render_chat(engine.tokenizer, problem["prompt"]) for problem in problems]
    print(f"{args.prompts} prompts x {args.generations} samples, up to {args.max_new_tokens} new tokens, "
          f"{args.threads} thread(s), model {args.model_dir}, new loop's GEMMs through "
          f"{'oneDNN' if gemm == 'onednn' else 'torch'} ({cpu_gemm.decided_by()})")

    def run(old: bool, step: int, greedy: bool):
        start, cpu = time.perf_counter(), time.process_time()
        if old:
            with old_engine(engine):
                samples = engine.generate(prompts, list(range(len(prompts))), step=step, greedy=greedy)
        else:
            samples = engine.generate(prompts, list(range(len(prompts))), step=step, greedy=greedy)
        return ((time.perf_counter() - start, time.process_time() - cpu),
                [(s.response_ids, s.logprobs) for s in samples])

    for greedy in (False, True):
        run(False, 0, greedy)  # first calls (allocations, kernels) out of the figures
        run(True, 0, greedy)
        seconds = {True: [], False: []}  # (wall, CPU) per round
        ratios, same_tokens, logprob_diff = [], True, 0.0
        for round_ in range(args.rounds):
            step = 1 + round_
            order = (True, False) if round_ % 2 == 0 else (False, True)
            outputs = {}
            for old in order:
                elapsed, outputs[old] = run(old, step, greedy)
                seconds[old].append(elapsed)
            same_tokens &= [ids for ids, _ in outputs[True]] == [ids for ids, _ in outputs[False]]
            if same_tokens:
                logprob_diff = max([logprob_diff] + [abs(a - b) for (_, old_logprobs), (_, new_logprobs)
                                                     in zip(outputs[True], outputs[False])
                                                     for a, b in zip(old_logprobs, new_logprobs)])
            ratios.append(tuple(o / n for o, n in zip(seconds[True][-1], seconds[False][-1])))
            tokens = sum(len(ids) for ids, _ in outputs[False])
            print(f"{'greedy' if greedy else 'sampled'} round {round_}: old {seconds[True][-1][0]:.2f} s wall "
                  f"{seconds[True][-1][1]:.2f} s CPU, new {seconds[False][-1][0]:.2f} s wall "
                  f"{seconds[False][-1][1]:.2f} s CPU, old / new {ratios[-1][0]:.2f}x wall {ratios[-1][1]:.2f}x CPU, "
                  f"{tokens} tokens")

        def median(values, i):
            return statistics.median(v[i] for v in values)

        print(f"{'greedy' if greedy else 'sampled'} (medians): old {median(seconds[True], 0):.2f} s wall "
              f"{median(seconds[True], 1):.2f} s CPU, new {median(seconds[False], 0):.2f} s wall "
              f"{median(seconds[False], 1):.2f} s CPU; old / new {median(ratios, 0):.2f}x wall, "
              f"{median(ratios, 1):.2f}x CPU; tokens {'identical' if same_tokens else 'DIFFER'}"
              + (f", logprobs {f'within {logprob_diff:.2g}' if logprob_diff else 'identical'}" if same_tokens else ""))

if __name__ == "__main__":
    main()
