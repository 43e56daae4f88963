"""Benchmark: the same GRPO job in megarl and in TRL's GRPOTrainer, side by side, in one run.

    python bench/e2e.py [--steps 5 --warmup 1 --trl-python .venv-trl/bin/python --no-trl]
                        [--megarl colocate "colocate padded" "separate async"]

The job: a 34M-parameter Qwen2 built here (offline, seeded: hidden 512, 12 layers, the built-in
tokenizer, random weights) on the built-in arithmetic prompts, 8 prompts x 4 samples per step, up
to 128 new tokens at temperature 1, fp32, one optimizer step per generation, no KL. megarl runs on
2 ranks (torchrun, one thread each) in each of `MEGARL_RUNS`: colocated (examples/quickstart_grpo.yaml
with the job's overrides) padding-free, colocated padded (micro-batches of 16 right-padded rows), and
the separate placement (rank 0 trains, rank 1 generates) with --async-generation and token TIS; the
first run named is the one compared with TRL and the compute floor. TRL runs in one process with both cores (bench/trl_grpo.py), with transformers
generation and with colocated vLLM, when its environment exists. TRL is not a megarl dependency;
its environment reuses megarl's packages and adds TRL's:

    python3.11 -m venv .venv-trl && echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > .venv-trl/lib/python3.11/site-packages/megarl_venv.pth && \\
        .venv-trl/bin/pip install --no-deps trl==1.16.0 && .venv-trl/bin/pip install accelerate datasets

Printed: per-step seconds (median over the steps after --warmup), generated tokens per second,
megarl's seconds per phase, the padding share of megarl's trained tokens when it logs it, the
ratios of the frameworks' step times, and the step's compute floor: 6 x parameters x trained tokens
at this machine's fp32 matmul rate (measured here, 2 threads) plus bare vLLM's time to generate
the same samples (measured here, the same engine settings, no trainer). It prints; it asserts nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=512)
JOB = dict(prompts=8, generations=4, max_new_tokens=128)
PHASES = ("generate", "generate_ahead", "score", "prepare", "teacher", "advantages", "update", "sync")


def build_model(out: str) -> int:
    """The job's model (seeded; rebuilt only when missing); its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_tiny_model import build_tokenizer

    marker = os.path.join(out, "bench_e2e.json")
    if not os.path.exists(marker):
        tokenizer = build_tokenizer()
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             rope_theta=10000.0, dtype="float32", **MODEL)
        model = Qwen2ForCausalLM(config)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        with open(marker, "w") as f:
            json.dump({"parameters": sum(p.numel() for p in model.parameters()), **MODEL}, f)
    with open(marker) as f:
        return json.load(f)["parameters"]


def run_megarl(model: str, steps: int, log_dir: str, flags: list[str]) -> dict:
    """Per-step TensorBoard scalars of a megarl run on 2 ranks (colocated unless `flags` choose another
    config): {tag: [value per step]}."""
    from tests.helpers import scalars  # the test suite's TensorBoard reader

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.join(ROOT, "megarl/train.py"), "--config", "examples/quickstart_grpo.yaml", *flags, "--model", model,
               "--prompts-per-step", str(JOB["prompts"]), "--num-generations", str(JOB["generations"]),
               "--max-new-tokens", str(JOB["max_new_tokens"]), "--micro-batch-size", "16", "--lr", "1e-6",
               "--rollout-kv-cache-gb", "2", "--train-steps", str(steps), "--log-dir", log_dir]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    tags = [f"{phase}_seconds" for phase in PHASES] + ["step_seconds", "response_length_mean", "tokens_per_second",
                                                       "padding_fraction"]
    series = scalars(log_dir, tags)
    return {tag: [values[step] for step in sorted(values)] for tag, values in series.items()}


def run_trl(python: str, model: str, mode: str, steps: int, workdir: str) -> dict:
    out = os.path.join(workdir, f"trl_{mode}.json")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    result = subprocess.run([python, os.path.join(ROOT, "bench/trl_grpo.py"), "--model", model, "--mode", mode,
                             "--steps", str(steps), "--out", out], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:  # the exception's own line, not the progress bar's last frame
        lines = (result.stdout + result.stderr).strip().splitlines()
        return {"error": next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")}
    with open(out) as f:
        return json.load(f)


def bare_vllm_seconds(model: str, repeats: int = 3) -> float:
    """Median seconds of vLLM alone generating one step's samples (a subprocess: its own engine)."""
    code = f"""
import json, time, sys
sys.path.insert(0, {ROOT!r})
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megarl.data.tasks import arithmetic
tok = AutoTokenizer.from_pretrained({model!r})
llm = LLM(model={model!r}, dtype="float32", seed=0, max_model_len=512, enforce_eager=True)
problems = arithmetic.make_problems({JOB['prompts']}, 0)
prompts = [tok.apply_chat_template([{{"role": "user", "content": p["prompt"]}}], add_generation_prompt=True,
                                   tokenize=False) for p in problems]
params = SamplingParams(n={JOB['generations']}, temperature=1.0, max_tokens={JOB['max_new_tokens']}, seed=0)
llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
times = []
for _ in range({repeats}):
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
print("BARE", json.dumps(sorted(times)[len(times) // 2]))
"""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True)
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("BARE")][0].split(" ", 1)[1])


def matmul_flops_per_second(size: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(2)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def median_after(values: list, warmup: int) -> float:
    return statistics.median(values[warmup:] or values)


# megarl's runs: a name and its flags (a later --config replaces the colocated quickstart's layout).
MEGARL_RUNS = {
    "colocate": ["--padding-free"],
    "colocate padded": [],
    "separate async": ["--config", "examples/quickstart_grpo_separate.yaml", "--padding-free", "--async-generation",
                       "--tis-level", "token"],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--model-dir", default=os.path.join(ROOT, "artifacts/bench-e2e-qwen2"))
    parser.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl/bin/python"))
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--megarl", nargs="+", default=list(MEGARL_RUNS), choices=list(MEGARL_RUNS),
                        help="megarl's runs, the first is the one compared with TRL and the floor (default: all)")
    args = parser.parse_args()
    parameters = build_model(args.model_dir)
    samples = JOB["prompts"] * JOB["generations"]
    print(f"model: Qwen2 {parameters / 1e6:.1f}M parameters ({args.model_dir}); job: {JOB['prompts']} prompts x "
          f"{JOB['generations']} samples, <= {JOB['max_new_tokens']} new tokens, fp32, {args.steps} steps "
          f"(median over steps after {args.warmup})", flush=True)
    megarl = {}
    with tempfile.TemporaryDirectory() as workdir:
        for index, name in enumerate(args.megarl):
            started = time.perf_counter()
            megarl[name] = run_megarl(args.model_dir, args.steps, os.path.join(workdir, f"megarl{index}"),
                                      MEGARL_RUNS[name])
            print(f"megarl {name} ({' '.join(MEGARL_RUNS[name]) or 'defaults'}): ran in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        trl = {}
        if args.no_trl or not os.path.exists(args.trl_python):
            print(f"TRL: skipped ({'--no-trl' if args.no_trl else args.trl_python + ' missing; see the docstring'})")
        else:
            for mode in ("transformers", "vllm"):
                started = time.perf_counter()
                trl[mode] = run_trl(args.trl_python, args.model_dir, mode, args.steps, workdir)
                print(f"TRL {mode}: ran in {time.perf_counter() - started:.0f} s"
                      f"{'; failed: ' + trl[mode]['error'] if 'error' in trl[mode] else ''}", flush=True)
        bare = bare_vllm_seconds(args.model_dir)
        rate = matmul_flops_per_second()

    def median(run, tag):
        return median_after(run[tag], args.warmup)

    main_name = args.megarl[0]
    step = median(megarl[main_name], "step_seconds")
    print(f"\n{'run':26} {'s/step':>8} {'gen tok/s':>10} {'padding':>8} {'vs ' + main_name:>16}")
    for name, run in megarl.items():
        generated = median_after([length * samples for length in run["response_length_mean"]], args.warmup)
        seconds = median(run, "step_seconds")
        padding = f"{median(run, 'padding_fraction'):.1%}" if "padding_fraction" in run else "-"
        # --async-generation generates the next step's samples beside the update (generate_ahead)
        generating = median(run, "generate_ahead_seconds" if "generate_ahead_seconds" in run else "generate_seconds")
        print(f"{'megarl ' + name:26} {seconds:8.2f} {generated / generating:10.0f} "
              f"{padding:>8} {seconds / step:16.2f}  (gen tok/s over generate)")
    best = None
    for mode, result in trl.items():
        if "error" in result:
            continue
        trl_step = median_after(result["step_seconds"], args.warmup)
        tokens = median_after(result["generated_tokens"], args.warmup) if result["generated_tokens"] else float("nan")
        print(f"{'TRL ' + mode:26} {trl_step:8.2f} {tokens / trl_step:10.0f} {'-':>8} {trl_step / step:16.2f}"
              f"  (gen tok/s over the whole step)")
        best = trl_step if best is None else min(best, trl_step)
    for name, run in megarl.items():
        print(f"megarl {name} phases (median s): " + ", ".join(
            f"{phase} {median(run, f'{phase}_seconds'):.2f}" for phase in PHASES if f"{phase}_seconds" in run))
    run = megarl[main_name]
    trained = median_after([tps * s for tps, s in zip(run["tokens_per_second"], run["step_seconds"])], args.warmup)
    floor = 6 * parameters * trained / rate + bare
    print(f"compute floor: 6 x {parameters / 1e6:.1f}M x {trained:.0f} trained tokens at {rate / 1e9:.1f} GFLOP/s "
          f"= {floor - bare:.2f} s + bare vLLM generation {bare:.2f} s = {floor:.2f} s; megarl {main_name} / floor = "
          f"{step / floor:.2f} (goal <= 1.25)")
    if best is not None:
        print(f"TRL's best mode / megarl {main_name} = {best / step:.2f} (goal >= 1.5)")
    if "separate async" in megarl and "colocate" in megarl:
        ratio = median(megarl["separate async"], "step_seconds") / median(megarl["colocate"], "step_seconds")
        print(f"separate async / colocate on the same 2 ranks = {ratio:.2f} (goal < 1)")


if __name__ == "__main__":
    main()
