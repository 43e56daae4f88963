"""TRL's GRPOTrainer on bench/e2e.py's job, for the side-by-side comparison. Run by bench/e2e.py with
the Python of a separate environment that has TRL (see bench/e2e.py's docstring); not a megarl module.

    python bench/trl_grpo.py --model DIR --mode transformers|vllm --steps N --out result.json

One process with every core (TRL's single-process CPU path). The same job as megarl's side: the
built-in arithmetic prompts (megarl.data.tasks.arithmetic, the same seed and chat template), 8 prompts x
4 samples per step, up to 128 new tokens at temperature 1, fp32, one optimizer step per generation
(32 samples per step, steps_per_generation 1, num_iterations 1), no KL (beta 0), the same exact-match
reward. Writes {"step_seconds": [...], "generated_tokens": [...]} from a callback's wall clock.
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
        def __init__(self):
            self.seconds, self.started = [], None

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.started)

    samples = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(args.out), f"trl_{args.mode}"), max_steps=args.steps,
        per_device_train_batch_size=samples, gradient_accumulation_steps=1, steps_per_generation=1,
        num_iterations=1, num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=1.0, learning_rate=1e-6, beta=0.0, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0,
        use_vllm=args.mode == "vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=512, vllm_enable_sleep_mode=False)
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
