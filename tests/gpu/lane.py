"""The GPU lane: megarl's CUDA paths on one GPU in a few minutes. tests/gpu/run.sh drives it:

    bash tests/gpu/run.sh LOGDIR             # a machine with one CUDA GPU; one line and exit 0 without one
    bash tests/gpu/run.sh LOGDIR --dry-run   # anywhere: checks what the lane needs; nothing runs on a GPU

Made for a machine that has Python 3.12, its own torch, Triton and transformers and no network: what it
lacks (MODULES) travels as wheels in gpu_wheels/ (git-ignored; tests/gpu/fetch_wheels.sh fills it here) and
is installed offline into WORK/site. vLLM and Transformer Engine are not there (nor carried: too large), so
the trainer runs Megatron's local layer spec and generates with the HF rollout backend.

run.sh runs each part as `python tests/gpu/lane.py part NAME --work WORK`, its output in LOGDIR/NAME.log, and
reads its verdict from the last line that starts with PASS, FAIL or SKIP:
  setup         install what is missing from the carried wheels; build artifacts/tiny-qwen2 if absent
  kernels       (a) every Triton kernel of megarl/kernels/triton_ops.py against the chunked torch path
                (kernels/torch_ops.py) compiled on the GPU at V = 151,936, fp32 and bf16 (the CPU test's
                cases, tests/workers/triton_kernels_worker.py, at GPU sizes): each per-chunk function, then
                the public API with gradients (impl "triton" against "chunked"), then the row statistics and
                a gradient of a [16384, 151936] tensor, whose last rows lie past 2^31 elements
  offload       (c) tests/workers/offload_worker.py on one NCCL rank with the distributed optimizer in bf16:
                offload/onload bit for bit, host copies pinned, device memory handed back
  train_bf16    (c) torchrun --nproc_per_node 1 megarl/train.py: GRPO steps on the tiny model, bf16, the
                distributed optimizer, --offload-model/--offload-optimizer, packed rows, the HF rollout
                backend on the same GPU, a one-rank NCCL world: every step's loss and grad norm finite
  train_fp16    (c) the same in fp16 with dynamic loss scaling: every loss finite, at least one step taken
  train_lora    (c) the bf16 run with rank-8 LoRA adapters and a KL term: every step's loss and grad norm finite
  reward_model  (d) tests/test_reward_model.py on the GPU (the reward model's device is the rank's GPU)
  bench         (b) bench/kernels.py at 8192 tokens: time and memory of naive, chunked and triton
  sleep_level2  (c) tests/workers/sleep_level_worker.py on one rank with vLLM (the default rollout backend):
                --rollout-sleep-level 2's real discard of the weights pool, then the sync: samples, greedy ids
                and the trainer-vs-rollout mismatch equal a level-1 engine's, and a turn with no sync before it
                gets the weights back; SKIP (not a failure) where vLLM is not installed, as on the lane's machine

Tolerances are tests/helpers.py's: fp32 results within FP32_PATHS_ULPS of the other path, bf16 ones within
BF16_PATHS_ULPS bf16 ulps, the TF32 weight gradient within TF32_PATHS_ULPS TF32 ulps (all of the compared
tensor's scale). Every case's error is printed, so a first run shows the measured margins.

Only the standard library is imported at the top: `wheel-specs` (fetch_wheels.sh) and `setup` run before
torch or the carried packages are importable.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WHEELS = ROOT / "gpu_wheels"
TINY_MODEL = ROOT / "artifacts" / "tiny-qwen2"
WHEELS_LIMIT = 64 * 2**20  # what the device tool carries in all (the working tree included)

# What the lane imports: (module, the distribution of a carried wheel, its version). No distribution: the
# GPU machine must have it (its image lists these). Carried: megatron-core, pinned exactly (megarl relies on
# its internals), and math-verify with its two pure-Python dependencies (tests/test_reward_model.py scores
# with --reward boxed; the trainer's arithmetic task needs none of them): any installed version of those
# will do.
MODULES = [
    ("torch", None, None), ("triton", None, None), ("transformers", None, None), ("tokenizers", None, None),
    ("safetensors", None, None), ("yaml", None, None), ("tensorboard", None, None), ("numpy", None, None),
    ("pytest", None, None),
    ("megatron.core", "megatron-core", "0.16.1"),
    ("math_verify", "math-verify", "0.9.0"),
    ("latex2sympy2_extended", "latex2sympy2_extended", "1.11.0"),
    ("antlr4", "antlr4-python3-runtime", "4.13.2"),
]
PINNED = {"megatron-core"}

PARTS = ("setup", "kernels", "offload", "train_bf16", "train_fp16", "train_lora", "reward_model", "bench",
         "sleep_level2")

# --------------------------------------------------------------- command lines ----
# The runs' command lines, defined once: the parts run them, the dry run parses them.
VOCAB = 151_936  # Qwen2's vocabulary, the size the kernels are tuned for
BENCH_ARGS = ["--tokens", "8192", "--device", "cuda"]
TINY_BUILD_ARGS = ["--out", str(TINY_MODEL), "--quiet"]
OFFLOAD_ARGS = ["--model", str(TINY_MODEL), "--offload-model", "--offload-optimizer", "--advantage-estimator", "gae",
                "--micro-batch-size", "2", "--lr", "1e-3", "--critic-lr", "1e-3", "--use-distributed-optimizer",
                "--bf16"]
SLEEP_LEVEL_ARGS = ["--model", str(TINY_MODEL), "--prompts-per-step", "2", "--num-generations", "2",
                    "--max-new-tokens", "8", "--micro-batch-size", "4", "--global-batch-size", "4",
                    "--rollout-gpu-memory-utilization", "0.3", "--log-dir", ""]
TRAIN_STEPS = 3
_TRAIN_COMMON = ["--model", str(TINY_MODEL), "--rollout-backend", "hf", "--prompts-per-step", "8",
                 "--num-generations", "4", "--max-new-tokens", "16", "--micro-batch-size", "16", "--lr", "2e-4",
                 "--train-steps", str(TRAIN_STEPS)]
TRAIN_ARGS = {
    "train_bf16": _TRAIN_COMMON + ["--bf16", "--use-distributed-optimizer", "--offload-model", "--offload-optimizer",
                                   "--padding-free"],
    # 2^16, not Megatron's 2^32: a few steps must include taken ones (each overflow halves the scale and skips).
    "train_fp16": _TRAIN_COMMON + ["--fp16", "--initial-loss-scale", "65536"],
    # LoRA's adapters on CUDA (the local spec a LoRA policy takes on every host), their merged sync to the HF
    # engine, the KL to the base with the adapters off
    "train_lora": _TRAIN_COMMON + ["--bf16", "--lora-rank", "8", "--lr", "2e-3", "--kl-coef", "0.05", "--padding-free"],
}

# A first run on one node of 8 GPUs (not part of the lane: docs/testing.md prints them, `lane.py
# eight-gpu-commands` too, the dry run parses them at world size 8): the tiny model, so that only the parallel
# layouts are new; vLLM's rollout (the default backend), Transformer Engine where installed.
_EIGHT_COMMON = ["--config", "examples/quickstart_grpo.yaml", "--micro-batch-size", "8", "--train-steps", "5",
                 "--bf16", "--use-distributed-optimizer"]
EIGHT_GPU_RUNS = {
    "colocated, TP=1 x DP=8, offload": _EIGHT_COMMON + ["--train-gpus", "8", "--rollout-gpus", "8", "--offload-model",
                                                        "--offload-optimizer", "--log-dir", "runs/gpu8_colocate"],
    "colocated, TP=2, rollout TP=2, packed": _EIGHT_COMMON + [
        "--train-gpus", "8", "--rollout-gpus", "8", "--tensor-model-parallel-size", "2",
        "--rollout-tensor-parallel-size", "2", "--padding-free", "--sequence-parallel", "--log-dir", "runs/gpu8_tp2"],
    "colocated, PP=2": _EIGHT_COMMON + ["--train-gpus", "8", "--rollout-gpus", "8", "--pipeline-model-parallel-size", "2",
                                        "--log-dir", "runs/gpu8_pp2"],
    "colocated, CP=2, packed": _EIGHT_COMMON + ["--train-gpus", "8", "--rollout-gpus", "8", "--context-parallel-size",
                                                "2", "--padding-free", "--log-dir", "runs/gpu8_cp2"],
    "separate, 4 train + 4 rollout ranks": _EIGHT_COMMON + ["--colocate-groups", "none", "--train-gpus", "4",
                                                            "--rollout-gpus", "4", "--log-dir", "runs/gpu8_separate"],
}


def torchrun_command(script: Path, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
            *map(str, args)]


def first_error(output: str) -> str:
    """The run's own error line, for the summary: megarl's ("megarl: error: ...", "megarl: rank N failed: ..."),
    else the last exception line; empty when there is none."""
    lines = [line.strip() for line in output.splitlines()]
    for line in lines:
        if line.startswith("megarl: error") or (line.startswith("megarl: rank") and "failed" in line):
            return line[:300]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return errors[-1][:300] if errors else ""


def run_streaming(command: list[str]) -> tuple[int, str]:
    """Run `command` from the repository root, its output echoed as it comes (into the part's log);
    (exit status, the output)."""
    print("$ " + " ".join(command), flush=True)
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return proc.returncode, "".join(lines)


# ------------------------------------------------------------------- packages ----
def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(distribution: str, version: str) -> Path | None:
    """The carried wheel of distribution==version in gpu_wheels/, if any."""
    for path in sorted(WHEELS.glob("*.whl")):
        name, found_version = (path.name.split("-") + [""])[:2]
        if _normalized(name) == _normalized(distribution) and found_version == version:
            return path
    return None


def missing_modules() -> list[tuple[str, str | None, str | None, str]]:
    """(module, distribution, version, why) of every MODULES entry this Python lacks (or, pinned, has in
    another version)."""
    missing = []
    for module, distribution, version in MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            missing.append((module, distribution, version, "not installed"))
            continue
        if distribution in PINNED:
            installed = importlib.metadata.version(distribution)
            if installed != version:
                missing.append((module, distribution, version, f"version {installed} installed"))
    return missing


def wheel_problems() -> list[str]:
    """What is wrong with gpu_wheels/ for a CPython 3.12 x86-64 machine (nothing when it is absent)."""
    if not WHEELS.is_dir():
        return []
    problems, seen = [], {}
    wheels = sorted(WHEELS.glob("*.whl"))
    others = [path.name for path in WHEELS.iterdir() if path.suffix != ".whl"]
    if others:
        problems.append(f"gpu_wheels/ holds files that are not wheels: {', '.join(others)}")
    total = sum(path.stat().st_size for path in wheels)
    if total > WHEELS_LIMIT:
        problems.append(f"gpu_wheels/ holds {total / 2**20:.1f} MiB, over the {WHEELS_LIMIT / 2**20:.0f} MiB "
                        f"the device tool carries")
    for path in wheels:
        parts = path.stem.split("-")
        if len(parts) < 5:
            problems.append(f"{path.name}: not a wheel file name")
            continue
        python, platform = parts[-3], parts[-1]
        if not ({"py3", "cp312"} & set(python.split("."))):
            problems.append(f"{path.name}: not for CPython 3.12 ({python})")
        if platform != "any" and not all(p.endswith("x86_64") and p.startswith("manylinux")
                                         for p in platform.split(".")):
            problems.append(f"{path.name}: not for manylinux x86-64 ({platform})")
        name = _normalized(parts[0])
        if name in seen:
            problems.append(f"gpu_wheels/ holds two versions of {parts[0]} ({seen[name]}, {path.name}): pip would "
                            f"refuse to install both")
        seen[name] = path.name
    return problems


def setup(work: Path) -> bool:
    """Install the carried wheels of what is missing into WORK/site (on PYTHONPATH through run.sh), then
    build the tiny model if absent."""
    ok = True
    missing = missing_modules()
    needed, uncovered = [], []
    for module, distribution, version, why in missing:
        wheel = wheel_for(distribution, version) if distribution else None
        (needed if wheel else uncovered).append((module, why, wheel))
    for module, why, _ in uncovered:
        print(f"FAIL-ITEM {module}: {why}, and no wheel of it in gpu_wheels/ (tests/gpu/fetch_wheels.sh)")
        ok = False
    if needed:
        site = work / "site"
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *(str(wheel) for _, _, wheel in needed)]
        print(f"installing {', '.join(f'{module} ({why})' for module, why, _ in needed)} into {site}", flush=True)
        if subprocess.run(command).returncode != 0:
            print("FAIL-ITEM pip install of the carried wheels failed")
            return False
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        still = [module for module, *_ in missing_modules() if module in {m for m, _, _ in needed}]
        if still:
            print(f"FAIL-ITEM still missing after the install: {', '.join(still)} (is {site} on PYTHONPATH?)")
            ok = False
    import torch  # noqa: E402 - after the install

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
          + ", ".join(f"{d} {importlib.metadata.version(d)}" for d in ("triton", "transformers", "megatron-core")
                      if _installed(d)), flush=True)
    if not (TINY_MODEL / "megarl_tiny.json").exists():
        print(f"building {TINY_MODEL} (not carried)", flush=True)
        rc, _ = run_streaming([sys.executable, "tools/make_tiny_model.py", *TINY_BUILD_ARGS])
        if rc != 0:
            print(f"FAIL-ITEM tools/make_tiny_model.py exited {rc}")
            ok = False
    return ok


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# -------------------------------------------------------------------- kernels ----
# (rows, real columns, K, temperature, x dtype, out dtype), as the worker's SHAPES: the whole vocabulary in
# fp32, bf16 with bf16 gradients (from logits) and with fp32 ones (from hidden states), a TP=2 shard, an odd
# width (a partial last block), and no rows at all. (No fp16: each dtype is another set of compilations, and
# the CPU test covers fp16 logits.)
def _kernel_shapes():
    import torch

    f32, bf16 = torch.float32, torch.bfloat16
    return [(128, VOCAB, 20, 0.7, f32, f32), (128, VOCAB, 64, 1.3, bf16, bf16), (128, VOCAB, 20, 1.0, bf16, f32),
            (128, VOCAB // 2, 20, 1.0, f32, f32), (64, VOCAB - 37, 3, 1.3, bf16, bf16), (0, VOCAB, 20, 0.7, f32, f32)]


DEVICE = "cuda"  # the kernels part's device ("cpu" under TRITON_INTERPRET=1 runs its code at small sizes)
API_TOKENS = 1024
API_SETTINGS = [(0.7, 300), (1.0, None)]  # (temperature, chunk_tokens): 300 does not divide 1024; None: CUDA's
OVERFLOW_ROWS = 16384


class Verdicts:
    """Errors against their limits, printed one a line; `failed` counts those over."""

    def __init__(self):
        self.failed, self.count, self.worst = 0, 0, {}

    def add(self, name: str, error: float, limit: float, unit: str = "fp32 ulps") -> None:
        self.count += 1
        ok = error <= limit  # NaN fails
        self.failed += not ok
        group, share = name.split("/")[0], error / limit if limit else (0.0 if error == 0 else math.inf)
        current = self.worst.get(group, (-1.0, ""))[0]
        if not math.isnan(current) and not share <= current:  # the closest to its limit (NaN: the worst)
            self.worst[group] = (share, f"{error:.3g} {unit} (limit {limit:g}) at {name}")
        print(f"{'ok  ' if ok else 'OVER'} {name}: {error:.3g} {unit} (limit {limit:g})", flush=True)

    def check(self, name: str, ok: bool) -> None:
        self.add(name, 0.0 if ok else math.inf, 0.0, "(exact check)")


def _value_limit(name: str, got, expected):
    """(error, limit, unit) of a compared pair by what it is: bf16, the TF32 weight gradient, or fp32."""
    import torch
    from helpers import BF16_EPS, BF16_PATHS_ULPS, FP32_PATHS_ULPS, TF32_EPS, TF32_PATHS_ULPS, ulps

    if torch.bfloat16 in (got.dtype, expected.dtype):
        return ulps(got, expected, eps=BF16_EPS), BF16_PATHS_ULPS, "bf16 ulps"
    if name.endswith("grad_weight") and got.is_cuda:
        return ulps(got, expected, eps=TF32_EPS), TF32_PATHS_ULPS, "tf32 ulps"
    return ulps(got, expected), FP32_PATHS_ULPS, "fp32 ulps"


def kernels() -> bool:
    import torch
    from helpers import FP32_PATHS_ULPS, load_script, ulps

    from megarl import distributed

    worker = load_script(TESTS / "workers" / "triton_kernels_worker.py")
    verdicts = Verdicts()
    started = time.perf_counter()
    shapes = _kernel_shapes()
    ops = worker.check_ops(shapes, device=DEVICE)
    for name, error in sorted(ops.items()):
        verdicts.add(f"ops/{name}", error, FP32_PATHS_ULPS)
    for shape in shapes:
        verdicts.check(f"ops/ran/{worker.shape_name(shape)}", any(worker.shape_name(shape) in c for c in ops))
    print(f"per-function checks: {time.perf_counter() - started:.0f} s", flush=True)

    distributed.init_single_process_world()
    for dtype in (torch.float32, torch.bfloat16):
        started = time.perf_counter()
        for kind, name, *values in worker.api_comparisons(
                settings=API_SETTINGS, impls=("chunked", "triton"), vocab=VOCAB, width=VOCAB, shape=(1, API_TOKENS),
                k=20, hidden=896, dtype=dtype, device=DEVICE):
            name = f"api/{str(dtype)[6:]}/{name}"
            if kind == "value":
                verdicts.add(name, *_value_limit(name, *values))
            elif kind == "masked":
                got, scale = values
                verdicts.add(name, ulps(got, 0 * got, scale), FP32_PATHS_ULPS)
            else:
                verdicts.check(name, values[0])
        print(f"API checks in {str(dtype)[6:]}: {time.perf_counter() - started:.0f} s", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    distributed.destroy_single_process_world()
    assert (OVERFLOW_ROWS - 1) * VOCAB > 2**31, "the last row must start past 2^31 elements"
    overflow(worker, verdicts, OVERFLOW_ROWS, VOCAB, DEVICE)
    for group, (_, text) in sorted(verdicts.worst.items()):
        print(f"worst {group}: {text}")
    return _verdict(verdicts)


def overflow(worker, verdicts: Verdicts, n: int, v: int, device: str) -> None:
    """The row statistics and the label gradient of [16384, 151936] bf16 logits in one launch each: the last
    rows start past 2^31 elements (int32 offsets would wrap there), compared on the first and last 64 rows
    with the torch path on those rows alone (whose offsets are small)."""
    import torch
    from helpers import FP32_PATHS_ULPS

    from megarl.kernels import torch_ops as ref
    from megarl.kernels import triton_ops as tri

    k, temp = 20, 0.7
    started = time.perf_counter()
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(n, v, generator=g, device=device, dtype=torch.bfloat16).mul_(3)
    labels = torch.randint(-3, v + 3, (n,), generator=g, device=device)
    # k distinct ids per row (steps of v // k apart), some past the shard's end
    ids = (torch.randint(0, v, (n, 1), generator=g, device=device) + v // k * torch.arange(k, device=device)) % (v + 9)
    rows = torch.cat([torch.arange(64), torch.arange(n - 64, n)]).to(device)
    for name, full, part in (
            ("token_stats", lambda: tri.token_stats(x, labels, temp), lambda: ref.token_stats(x[rows], labels[rows],
                                                                                             temp)),
            ("lse_stats", lambda: tri.lse_stats(x, temp), lambda: ref.lse_stats(x[rows], temp)),
            ("topk_stats", lambda: tri.topk_stats(x, ids, temp), lambda: ref.topk_stats(x[rows], ids[rows], temp))):
        verdicts.add(f"overflow/{name}", worker.error(full()[rows], part()), FP32_PATHS_ULPS)
    stats = tri.token_stats(x, labels, temp)
    m, log_sum, expected = stats[:, 0], stats[:, 1].log(), stats[:, 2] / stats[:, 1]
    g_lp, g_h = (torch.randn(n, generator=g, device=device) for _ in range(2))
    out = torch.empty_like(x)
    tri.token_grad(x, labels, temp, m, log_sum, expected, g_lp, g_h, out)
    wanted = torch.zeros(len(rows), v, device=device)
    ref.token_grad(x[rows], labels[rows], temp, m[rows], log_sum[rows], expected[rows], g_lp[rows], g_h[rows], wanted)
    verdicts.add("overflow/token_grad", worker.error(out[rows], wanted, bf16=True), FP32_PATHS_ULPS)
    del x, out
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"[{n}, {v}] overflow checks: {time.perf_counter() - started:.0f} s", flush=True)


def _verdict(verdicts: Verdicts) -> bool:
    if verdicts.failed:
        print(f"FAIL {verdicts.failed} of {verdicts.count} comparisons over their limits (lines marked OVER)")
        return False
    print(f"PASS {verdicts.count} comparisons within their limits")
    return True


# ------------------------------------------------------------------ the runs ----
def offload(work: Path) -> bool:
    from helpers import load_script, read_json

    out = work / "offload"
    rc, output = run_streaming(torchrun_command(TESTS / "workers" / "offload_worker.py", out, *OFFLOAD_ARGS))
    if rc != 0:
        print(f"FAIL offload_worker.py exited {rc}: {first_error(output)}")
        return False
    report = read_json(f"{out}.json")
    print(json.dumps(report, indent=1))
    problems = load_script(TESTS / "workers" / "offload_worker.py").problems(report, on_cuda=True)
    if problems:
        print("FAIL " + "; ".join(problems))
        return False
    sizes = {role: report[role]["offloaded"]["device_bytes_released"] / 2**20 for role in ("actor", "critic")}
    print(f"PASS actor and critic round trips exact, host copies pinned, "
          f"{sizes['actor']:.1f} / {sizes['critic']:.1f} MiB handed back")
    return True


def train(name: str, work: Path) -> bool:
    from helpers import scalars

    tb = work / f"tb_{name}"
    rc, output = run_streaming(torchrun_command(ROOT / "megarl" / "train.py", *TRAIN_ARGS[name], "--log-dir", tb))
    if rc != 0:
        print(f"FAIL megarl/train.py exited {rc}: {first_error(output)}")
        return False
    steps = [line for line in output.splitlines() if re.match(rf"step \d+/{TRAIN_STEPS} \|", line)]
    series = scalars(tb, ("loss", "grad_norm", "reward_mean", "mismatch"))
    for step in range(TRAIN_STEPS):
        print(f"step {step}: " + ", ".join(f"{tag} {values[step]:.4g}" for tag, values in sorted(series.items())
                                           if step in values))
    problems = []
    if len(steps) != TRAIN_STEPS:
        problems.append(f"{len(steps)} step lines, expected {TRAIN_STEPS}")
    # Non-finite metrics are not written (metrics.py): a missing step is a NaN or inf loss.
    losses = series.get("loss", {})
    if sorted(losses) != list(range(TRAIN_STEPS)) or not all(math.isfinite(v) for v in losses.values()):
        problems.append(f"finite losses at steps {sorted(losses)}, expected all of 0..{TRAIN_STEPS - 1}")
    taken = sorted(series.get("grad_norm", {}))  # a skipped step (fp16 overflow) has no finite grad norm
    if name == "train_fp16" and not taken:
        problems.append("no optimizer step taken (every step overflowed the fp16 loss scale)")
    if name != "train_fp16" and taken != list(range(TRAIN_STEPS)):
        problems.append(f"finite grad norms at steps {taken}, expected all")
    if problems:
        print("FAIL " + "; ".join(problems))
        return False
    print(f"PASS {TRAIN_STEPS} steps, losses finite, optimizer steps taken at {taken}")
    return True


def sleep_level2(work: Path) -> bool:
    from helpers import load_script, read_json

    if importlib.util.find_spec("vllm") is None:
        print("SKIP vLLM is not installed here (the part needs a machine with vLLM's CUDA build)")
        return True
    out = work / "sleep_level2"
    rc, output = run_streaming(torchrun_command(TESTS / "workers" / "sleep_level_worker.py", out, *SLEEP_LEVEL_ARGS))
    if rc != 0:
        print(f"FAIL sleep_level_worker.py exited {rc}: {first_error(output)}")
        return False
    report = read_json(f"{out}.json")
    problems = load_script(TESTS / "workers" / "sleep_level_worker.py").problems(report, on_cuda=True)
    if problems:
        print("FAIL " + "; ".join(problems))
        return False
    print(f"PASS level 2 samples as level 1 does after the sync (mismatch {report['level2']['mismatch']:.2e})")
    return True


def reward_model() -> bool:
    test = "test_on_cuda_the_reward_model_scores_on_the_gpu_and_waits_in_host_memory"
    rc, output = run_streaming([sys.executable, "-m", "pytest", "tests/test_reward_model.py", "-v"])
    if rc != 0:
        failed = [line.split(" - ")[0] for line in output.splitlines() if line.startswith("FAILED ")]
        print(f"FAIL pytest exited {rc}: {'; '.join(failed) or first_error(output)}")
        return False
    if f"{test} PASSED" not in output:
        print(f"FAIL {test} did not pass (skipped: no CUDA device seen?)")
        return False
    print("PASS tests/test_reward_model.py on the GPU")
    return True


def bench() -> bool:
    rc, output = run_streaming([sys.executable, "bench/kernels.py", *BENCH_ARGS])
    if rc != 0:
        print(f"FAIL bench/kernels.py exited {rc}: {first_error(output)}")
        return False
    rows = {tuple(line.split()[:2]) for line in output.splitlines() if line.split()[:1]
            and "/" in line.split()[0]}
    load_ops = _load_bench().OPERATIONS
    absent = [f"{op} {impl}" for op in load_ops for impl in ("naive", "chunked", "triton") if (op, impl) not in rows]
    if absent:
        print(f"FAIL no result for {', '.join(absent)}")
        return False
    print(f"PASS {len(load_ops)} operations x naive, chunked, triton at {BENCH_ARGS[1]} tokens")
    return True


def _load_bench():
    from helpers import load_script

    return load_script(ROOT / "bench" / "kernels.py")


def run_part(name: str, work: Path) -> bool:
    sys.path.insert(0, str(TESTS))  # helpers
    if name == "setup":
        ok = setup(work)
        print("PASS packages and tiny model ready" if ok else "FAIL setup (lines FAIL-ITEM above)")
        return ok
    if name == "kernels":
        return kernels()
    if name == "offload":
        return offload(work)
    if name in TRAIN_ARGS:
        return train(name, work)
    if name == "reward_model":
        return reward_model()
    if name == "sleep_level2":
        return sleep_level2(work)
    return bench()


# -------------------------------------------------------------------- dry run ----
@contextlib.contextmanager
def as_gpu_host():
    """megarl's host checks answer as on a CUDA host while a command line is parsed (a stand-in for the GPU
    machine in this bookkeeping check): the dry run parses the lane's command lines as the GPU machine will
    (a CPU host refuses --fp16). Transformer Engine's presence stays this host's (the GPU machine has none)."""
    from megarl import accelerator

    before = accelerator.ON_CUDA
    accelerator.ON_CUDA = True
    try:
        yield
    finally:
        accelerator.ON_CUDA = before


def dry_run() -> bool:
    """What the lane needs, checked without a GPU: imports (or carried wheels for them), paths, every entry
    point's arguments, and the trainer's command lines through megarl's own parser."""
    sys.path.insert(0, str(TESTS))
    failures = []

    def report(what: str, problem: str | None) -> None:
        print(f"{'ok  ' if problem is None else 'FAIL'} {what}{'' if problem is None else ': ' + problem}",
              flush=True)
        if problem is not None:
            failures.append(what)

    for module, distribution, version, why in missing_modules():
        wheel = wheel_for(distribution, version) if distribution else None
        report(f"import {module}", None if wheel else
               f"{why}; {'no wheel of ' + distribution + '==' + version + ' in gpu_wheels/ (run tests/gpu/fetch_wheels.sh)' if distribution else 'the GPU machine must have it'}")
        if wheel:
            print(f"     (carried: gpu_wheels/{wheel.name})")
    if not missing_modules():
        report(f"imports: {', '.join(module for module, _, _ in MODULES)}", None)
    report("gpu_wheels/", "; ".join(wheel_problems()) or None)
    if WHEELS.is_dir():
        wheels = sorted(WHEELS.glob("*.whl"))
        print(f"     {len(wheels)} wheels, {sum(p.stat().st_size for p in wheels) / 2**20:.1f} MiB: "
              + ", ".join(p.name for p in wheels))
        absent = [f"{d}=={v}" for _, d, v in MODULES if d and wheel_for(d, v) is None]
        report("gpu_wheels/ covers every carried package", f"lacks {', '.join(absent)}" if absent else None)
    else:
        print("     gpu_wheels/ absent: nothing carried (tests/gpu/fetch_wheels.sh fills it)")
    for path in ("tests/gpu/run.sh", "tests/gpu/fetch_wheels.sh", "megarl/train.py", "bench/kernels.py",
                 "tools/make_tiny_model.py", "tests/workers/offload_worker.py", "tests/workers/triton_kernels_worker.py",
                 "tests/test_reward_model.py", "tools/make_tiny_reward_model.py",
                 "tests/workers/sleep_level_worker.py"):
        report(f"path {path}", None if (ROOT / path).is_file() else "missing")
    print(f"     tiny model: {'present' if (TINY_MODEL / 'megarl_tiny.json').exists() else 'absent (setup builds it)'}"
          f" at {TINY_MODEL.relative_to(ROOT)}")

    from helpers import load_script

    entry_points = [("bench/kernels.py", lambda: _load_bench().build_parser(), BENCH_ARGS),
                    ("tools/make_tiny_model.py", lambda: load_script(ROOT / "tools" / "make_tiny_model.py")
                     .build_parser(), TINY_BUILD_ARGS),
                    *((f"tests/gpu/lane.py part {part}", build_parser, ["part", part, "--work", "/tmp/w"])
                      for part in PARTS)]
    for what, parser, argv in entry_points:
        report(f"{what} {' '.join(argv)}", _parse_problem(lambda: parser().parse_args(argv)))
    worker = load_script(TESTS / "workers" / "triton_kernels_worker.py")
    report("triton_kernels_worker has check_ops and api_comparisons",
           None if callable(getattr(worker, "check_ops", None)) and callable(getattr(worker, "api_comparisons", None))
           else "missing")
    report("triton_ops imports", _parse_problem(lambda: importlib.import_module("megarl.kernels.triton_ops")))

    from megarl.arguments import parse_args

    runs = [(name, argv, 1) for name, argv in [("offload", OFFLOAD_ARGS), *TRAIN_ARGS.items(),
                                                ("sleep_level2", SLEEP_LEVEL_ARGS + ["--rollout-sleep-level", "2"])]]
    runs += [(f"8 GPUs, {name}", argv, 8) for name, argv in EIGHT_GPU_RUNS.items()]
    for name, argv, world_size in runs:
        def parse(argv=argv, world_size=world_size):
            with as_gpu_host():
                parse_args(list(argv), world_size=world_size)

        print(f"     {name}: megarl/train.py {' '.join(argv)}")
        report(f"{name} command line (megarl's parser, as on a GPU host)", _parse_problem(parse))
    if failures:
        print(f"dry run: FAIL ({len(failures)}: {'; '.join(failures)})")
        return False
    print("dry run: PASS")
    return True


def _parse_problem(parse) -> str | None:
    try:
        parse()
    except SystemExit as error:  # argparse's own parsers exit on bad arguments
        return f"exits {error.code}"
    except Exception as error:  # noqa: BLE001 - reported as one line
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    part = sub.add_parser("part", help="run one part of the lane (run.sh does, each under its time limit)")
    part.add_argument("name", choices=PARTS)
    part.add_argument("--work", type=Path, required=True, help="scratch folder (installed packages, runs' output)")
    sub.add_parser("dry-run", help="check what the lane needs, without a GPU")
    sub.add_parser("wheel-specs", help="print NAME==VERSION of every carried package (tests/gpu/fetch_wheels.sh)")
    sub.add_parser("eight-gpu-commands", help="print the command lines of a first run on one node of 8 GPUs")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    os.chdir(ROOT)
    if args.command == "wheel-specs":
        print(" ".join(f"{distribution}=={version}" for _, distribution, version in MODULES if distribution))
        return 0
    if args.command == "eight-gpu-commands":
        for name, argv in EIGHT_GPU_RUNS.items():
            print(f"# {name}\ntorchrun --nproc_per_node 8 megarl/train.py {' '.join(argv)}")
        return 0
    if args.command == "dry-run":
        return 0 if dry_run() else 1
    args.work.mkdir(parents=True, exist_ok=True)
    return 0 if run_part(args.name, args.work) else 1


if __name__ == "__main__":
    sys.exit(main())
