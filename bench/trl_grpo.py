"""TRL's GRPOTrainer on bench/e2e.py's job, for the side-by-side comparison. Run by bench/e2e.py with
the Python of a separate environment that has TRL (see bench/e2e.py's docstring); not a megarl module.

    python bench/trl_grpo.py --model DIR --mode transformers|vllm --steps N --out result.json

One process with every core (TRL's single-process CPU path). The same job as megarl's side: the
built-in arithmetic prompts (megarl.data.tasks.arithmetic, the same seed and chat template), 8 prompts x
4 samples per step, up to 128 new tokens at temperature 1, fp32, one optimizer step per generation
(32 samples per step, steps_per_generation 1, num_iterations 1), no KL (beta 0), the same exact-match
reward. Writes {"step_seconds": [...], "generated_tokens": [...]} from a callback's wall clock (the
Trainer calls on_step_begin / on_step_end once per optimizer step, gradient accumulation included), and
as the steps go `<out>.progress` (bench/e2e.py's --trl-timeout reads it when it stops a run).

bench/e2e.py's --response-lengths sweep adds --min-new-tokens L (every response exactly L tokens with
--max-new-tokens L: GRPOConfig.generation_kwargs, which TRL 1.16 passes to transformers' GenerationConfig
as min_new_tokens and to vLLM's SamplingParams as min_tokens), --micro-batches k (per_device_train_batch_size
= samples / k, gradient_accumulation_steps = steps_per_generation = k: TRL generates samples / k x k = all
32 samples at once and slices them into k micro-batches of one optimizer step) and --max-model-length.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["transformers", "vllm"], required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-new-tokens", type=int, default=0,
                        help="every response at least this long (generation_kwargs: transformers' min_new_tokens, "
                             "vLLM's min_tokens)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="k: micro-batches of samples / k per optimizer step (gradient_accumulation_steps = "
                             "steps_per_generation = k: still one generation and one optimizer step per step)")
    parser.add_argument("--max-model-length", type=int, default=512, help="vllm_max_model_length")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.data.tasks import arithmetic

    problems = arithmetic.make_problems(args.prompts * args.steps * 2, seed=0)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"]}
                                 for p in problems])

    def reward(completions, answer, **_):
        return [arithmetic.score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        """Each optimizer step's seconds; also written to `<out>.progress` as the steps go (the finished steps
        and when the running one started), for a caller that stops a run at its time limit."""

        def __init__(self):
            self.seconds, self.started = [], None

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()
            self._progress(running_since=time.time())

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.started)
            self._progress(running_since=None)

        def _progress(self, running_since):
            with open(args.out + ".progress.tmp", "w") as f:
                json.dump({"step_seconds": self.seconds, "running_since": running_since}, f)
            os.replace(args.out + ".progress.tmp", args.out + ".progress")

    samples = args.prompts * args.generations
    if samples % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches} does not divide the {samples} samples of a step")
    generation_kwargs = None
    if args.min_new_tokens:
        generation_kwargs = {"min_tokens" if args.mode == "vllm" else "min_new_tokens": args.min_new_tokens}
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(args.out), f"trl_{args.mode}"), max_steps=args.steps,
        per_device_train_batch_size=samples // args.micro_batches, gradient_accumulation_steps=args.micro_batches,
        steps_per_generation=args.micro_batches, generation_kwargs=generation_kwargs,
        num_iterations=1, num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=1.0, learning_rate=1e-6, beta=0.0, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0,
        use_vllm=args.mode == "vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=args.max_model_length, vllm_enable_sleep_mode=False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    lengths = [entry.get("completions/mean_length") for entry in trainer.state.log_history
               if "completions/mean_length" in entry]
    with open(args.out, "w") as f:
        json.dump({"step_seconds": clock.seconds,
                   "generated_tokens": [float(length) * samples for length in lengths]}, f)


if __name__ == "__main__":
    main()
