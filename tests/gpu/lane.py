"""The GPU lane: megarl's CUDA paths on one GPU in a few minutes. tests/gpu/run.sh drives it:

    bash tests/gpu/fetch.sh                  # here, once: what must travel, into gpu_carry/
    bash tests/gpu/run.sh LOGDIR             # a machine with one CUDA GPU; one line and exit 0 without one
    bash tests/gpu/run.sh LOGDIR --dry-run   # anywhere: checks what the lane needs; nothing runs on a GPU

Made for a machine that has Python 3.12, its own torch, Triton and transformers and no network: what it
lacks travels in gpu_carry/ (git-ignored; tests/gpu/fetch.sh fills it here): the wheels of MODULES, installed
offline into WORK/site, and the tiny model. vLLM and Transformer Engine are not there (nor carried: too
large), so the trainer runs Megatron's local layer spec and generates with the HF rollout backend.

run.sh runs each part of `plan` as `python tests/gpu/lane.py part NAME --work WORK` under its limit (PARTS),
its output in WORK/NAME.log (appended to LOGDIR/parts.log), and reads its verdict from the last line that
starts with PASS, FAIL or SKIP. In the order they run, by what a failure would tell:
  setup         install what is missing from the carried wheels; the carried tiny model into artifacts/
  nccl          a one-rank NCCL world on the GPU and an all-reduce in NCCL_CHECK_S seconds: the parts that
                start one are not run when it fails, instead of each waiting out its limit
  train_bf16    (c) torchrun --nproc_per_node 1 megarl/train.py: GRPO steps on the tiny model, bf16, the
                distributed optimizer, --offload-model/--offload-optimizer, packed rows, the HF rollout
                backend on the same GPU, a one-rank NCCL world: every step's loss and grad norm finite
  kernels       (a) every Triton kernel of megarl/kernels/triton_ops.py against the chunked torch path
                (kernels/torch_ops.py) compiled on the GPU at V = 151,936, fp32 and bf16 (the CPU test's
                cases, tests/workers/triton_kernels_worker.py, at GPU sizes): each per-chunk function, then
                the public API with gradients (impl "triton" against "chunked"), then the row statistics and
                a gradient of a [16384, 151936] tensor, whose last rows lie past 2^31 elements
  offload       (c) tests/workers/offload_worker.py on one NCCL rank with the distributed optimizer in bf16:
                offload/onload bit for bit, host copies pinned, device memory handed back
  train_fp16    (c) the same in fp16 with dynamic loss scaling: every loss finite, at least 2 steps taken, their
                grad norms within a factor of 4 of train_bf16's
  bench         (b) bench/kernels.py at 8192 tokens: time and memory of naive, chunked and triton
  reward_model  (d) tests/test_reward_model.py on the GPU (the reward model's device is the rank's GPU)
  train_lora    (c) the bf16 run with rank-8 LoRA adapters and a KL term: every step's loss and grad norm finite
  sleep_level2  (c) tests/workers/sleep_level_worker.py on one rank with vLLM (the default rollout backend):
                --rollout-sleep-level 2's real discard of the weights pool, then the sync: samples, greedy ids
                and the trainer-vs-rollout mismatch equal a level-1 engine's, and a turn with no sync before it
                gets the weights back; SKIP (not a failure) where vLLM is not installed, as on the lane's machine.
                Not in the lane's 8 minutes (it would only SKIP there): GPU_LANE_PARTS=sleep_level2 runs it

Tolerances are tests/helpers.py's: fp32 results within FP32_PATHS_ULPS of the other path, bf16 ones within
BF16_PATHS_ULPS bf16 ulps, the TF32 weight gradient within TF32_PATHS_ULPS TF32 ulps (all of the compared
tensor's scale). Every case's error is printed, so a first run shows the measured margins.

Only the standard library is imported at the top: `wheel-specs` (fetch.sh), `plan` and `setup` run before
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
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# What travels beside the working tree (git-ignored: the device tool's `carry` names it); GPU_LANE_CARRY
# elsewhere (the CI test fetches into a temporary folder).
CARRY = Path(os.environ.get("GPU_LANE_CARRY") or ROOT / "gpu_carry")
WHEELS = CARRY / "wheels"
TINY_MODEL = ROOT / "artifacts" / "tiny-qwen2"
CARRIED_MODEL = CARRY / "tiny-qwen2"  # artifacts/ is git-ignored: the model travels in CARRY, setup puts it back
TRAVEL_LIMIT = 64 * 2**20  # what the device tool carries in all: the working tree and the carried paths
OUTPUT_FILES_LIMIT = 8  # what the device tool brings back from $OUT

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

# (part, its limit in seconds, the part it needs to have passed), in the order they run: what a failure tells
# most first (bf16 training is megarl's main CUDA path end to end). The limits, the cold start's included (setup's
# install, the first torch.compile of Megatron's fused SwiGLU and bias-dropout in train_bf16, whose caches
# run.sh keeps in WORK for the later runs, Triton's first compilations in kernels), add up to BUDGET: no part
# is cut short by the ones before it. Estimated, not yet measured on a GPU: each part prints its own times.
BUDGET = 480  # the lane's 8 minutes, inside the device tool's 10 per command (timeout's kill grace included)
# train_fp16 needs train_bf16's grad norms (its check compares them).
PARTS = [("setup", 35, None), ("nccl", 15, "setup"), ("train_bf16", 90, "nccl"), ("kernels", 120, "setup"),
         ("offload", 40, "nccl"), ("train_fp16", 55, "train_bf16"), ("bench", 40, "setup"),
         ("reward_model", 40, "setup"), ("train_lora", 45, "nccl")]
# Run only when GPU_LANE_PARTS names them: nothing to learn on the lane's machine (no vLLM there: it SKIPs).
EXTRA_PARTS = [("sleep_level2", 150, "nccl")]
PART_NAMES = tuple(name for name, _, _ in PARTS + EXTRA_PARTS)
NCCL_CHECK_S = 5

# --------------------------------------------------------------- command lines ----
# The runs' command lines, defined once: the parts run them, the dry run parses them.
VOCAB = 151_936  # Qwen2's vocabulary, the size the kernels are tuned for
BENCH_ARGS = ["--tokens", "8192", "--device", "cuda"]
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
    # megarl's default initial loss scale (2^10): the one users get
    "train_fp16": _TRAIN_COMMON + ["--fp16"],
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
    # --local-addr: the agent publishes this as the ranks' MASTER_ADDR, not the host's FQDN, which need not
    # resolve on a bare VM (--standalone's rendezvous store is on localhost already)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node=1", str(script), *map(str, args)]


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


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def wheel_for(distribution: str, version: str) -> Path | None:
    """The carried wheel of distribution==version in WHEELS, if any."""
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
    """What is wrong with WHEELS for a CPython 3.12 x86-64 machine (nothing when it is absent)."""
    if not WHEELS.is_dir():
        return []
    problems, seen = [], {}
    wheels = sorted(WHEELS.glob("*.whl"))
    others = [path.name for path in WHEELS.iterdir() if path.suffix != ".whl"]
    if others:
        problems.append(f"{_shown(WHEELS)}/ holds files that are not wheels: {', '.join(others)}")
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
            problems.append(f"{_shown(WHEELS)}/ holds two versions of {parts[0]} ({seen[name]}, {path.name}): pip would "
                            f"refuse to install both")
        seen[name] = path.name
    return problems


def setup(work: Path) -> bool:
    """Install the carried wheels of what is missing into WORK/site (on PYTHONPATH through run.sh), then put
    the carried tiny model where the runs read it (artifacts/, which does not travel) if it is not there."""
    ok = True
    missing = missing_modules()
    needed, uncovered = [], []
    for module, distribution, version, why in missing:
        wheel = wheel_for(distribution, version) if distribution else None
        (needed if wheel else uncovered).append((module, why, wheel))
    for module, why, _ in uncovered:
        print(f"FAIL-ITEM {module}: {why}, and no wheel of it in {_shown(WHEELS)}/ (tests/gpu/fetch.sh)")
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
    # megarl_tiny.json is written last: its presence marks a complete model (tools/make_tiny_model.py)
    if not (TINY_MODEL / "megarl_tiny.json").exists():
        if not (CARRIED_MODEL / "megarl_tiny.json").exists():
            # not built here: a build takes a minute of the lane's budget (tests/gpu/fetch.sh builds it at home)
            print(f"FAIL-ITEM no tiny model at {_shown(TINY_MODEL)} nor carried at {_shown(CARRIED_MODEL)} "
                  f"(tests/gpu/fetch.sh)")
            return False
        shutil.rmtree(TINY_MODEL, ignore_errors=True)
        shutil.copytree(CARRIED_MODEL, TINY_MODEL)
        print(f"tiny model: {_shown(CARRIED_MODEL)} copied to {_shown(TINY_MODEL)}", flush=True)
    return ok


def nccl() -> bool:
    """A one-rank NCCL world on the GPU and an all-reduce, given NCCL_CHECK_S seconds: a bare VM's NCCL that
    hangs in its start-up fails here in seconds, with one line, instead of in every torchrun part at its
    limit. In process, over a TCP store on 127.0.0.1 (the host's name need not resolve)."""
    import datetime
    import socket
    import threading

    import torch
    import torch.distributed as dist

    torch.zeros(1, device="cuda")  # the CUDA context first: its start is not NCCL's
    result = {}

    def check():
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=NCCL_CHECK_S),
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
            value = torch.full((1024,), 3.0, device="cuda")
            dist.all_reduce(value)
            torch.cuda.synchronize()
            result["sum"] = value.sum().item()
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - reported as one line
            result["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"

    started = time.perf_counter()
    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(NCCL_CHECK_S)
    seconds = time.perf_counter() - started
    if thread.is_alive():
        # a hung NCCL call cannot be interrupted, and its destructors could hang the exit too
        print(f"FAIL NCCL: a one-rank init and all-reduce did not finish in {NCCL_CHECK_S} s "
              f"(rerun with NCCL_DEBUG=INFO to see where it waits)", flush=True)
        os._exit(1)
    if "error" in result:
        print(f"FAIL NCCL: {result['error']}")
        return False
    if result["sum"] != 3.0 * 1024:
        print(f"FAIL NCCL: a one-rank all-reduce of 1024 threes summed to {result['sum']}, not 3072")
        return False
    print(f"PASS NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}: one-rank init and all-reduce in "
          f"{seconds:.1f} s")
    return True


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
    kernel_resources(VOCAB, DEVICE)
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


def kernel_resources(v: int, device: str, n: int = API_TOKENS) -> None:
    """Printed, not judged: the peak device memory of each per-chunk function on [n, v] bf16 logits (triton and
    chunked torch side by side: above what was allocated before the call), then every Triton kernel compiled so
    far with its warps, registers and spills per thread (spills go to local memory: triton_ops.num_warps).
    Off CUDA (the interpreter) the calls run and nothing is measured."""
    import torch
    import triton

    from megarl.kernels import torch_ops, triton_ops

    cuda = device == "cuda"
    g = torch.Generator(device).manual_seed(0)
    x, teacher = (torch.randn(n, v, generator=g, device=device, dtype=torch.bfloat16).mul_(3) for _ in range(2))
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    ids = (torch.randint(0, v, (n, 1), generator=g, device=device) + v // 20 * torch.arange(20, device=device)) % v
    stats = torch_ops.token_stats(x, labels, 1.0)
    m, log_sum, expected = stats[:, 0], stats[:, 1].log(), stats[:, 2] / stats[:, 1]
    ones, out = torch.ones(n, device=device), torch.empty(n, v, device=device)
    log_z, log_zt = ((lse[:, 0] + lse[:, 1].log()) for lse in (torch_ops.lse_stats(t, 1.0) for t in (x, teacher)))
    calls = {
        "token_stats": lambda ops: ops.token_stats(x, labels, 1.0),
        "token_grad": lambda ops: ops.token_grad(x, labels, 1.0, m, log_sum, expected, ones, ones, out),
        "topk_stats": lambda ops: ops.topk_stats(x, ids, 1.0),
        "topk_grad": lambda ops: ops.topk_grad(x, ids, 1.0, m, log_sum, torch.full_like(m, math.inf),
                                               torch.ones(n, 20, device=device), None, out),
        "lse_stats": lambda ops: ops.lse_stats(x, 1.0),
        "full_terms": lambda ops: ops.full_terms(x, teacher, 1.0, log_z, log_zt, 0.5),
        "full_grad": lambda ops: ops.full_grad(x, teacher, 1.0, log_z, log_zt, 0.5, ones, ones, out),
    }
    print(f"peak memory above the inputs per call on [{n}, {v}] bf16 (fp32 gradients: out is allocated before):")
    for name, call in calls.items():
        peaks = []
        for ops in (triton_ops, torch_ops):
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            call(ops)
            if cuda:
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
        if cuda:
            print(f"  {name:12s} triton {peaks[0]:8.1f} MiB   chunked {peaks[1]:8.1f} MiB")
    del x, teacher, out
    if cuda:
        torch.cuda.empty_cache()
    print("compiled Triton kernels (num_warps, registers and spills per thread):")
    for name, fn in sorted(vars(triton_ops).items()):
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        for device_cache in getattr(fn, "device_caches", {}).values():
            for compiled in device_cache[0].values():
                compiled._init_handles()  # loads the binary: n_regs and n_spills come from the driver
                print(f"  {name:20s} {_block_constants(fn, compiled)} num_warps {compiled.metadata.num_warps:2d}  "
                      f"n_regs {compiled.n_regs:3d}  n_spills {compiled.n_spills}")


def _block_constants(fn, compiled) -> dict:
    """BLOCK_V and K_BLOCK of a compiled kernel, from its source's constants (keyed by argument index, or by a
    1-tuple of it, or by name, depending on Triton's version); {} where this Triton keeps them elsewhere."""
    wanted = {}
    for key, value in (getattr(getattr(compiled, "src", None), "constants", None) or {}).items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = fn.arg_names[index] if isinstance(index, int) and index < len(fn.arg_names) else index
        if name in ("BLOCK_V", "K_BLOCK"):
            wanted[name] = value
    return wanted


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
    if name == "train_fp16":
        problems += fp16_problems(series.get("grad_norm", {}), work)
    elif taken != list(range(TRAIN_STEPS)):
        problems.append(f"finite grad norms at steps {taken}, expected all")
    if problems:
        print("FAIL " + "; ".join(problems))
        return False
    print(f"PASS {TRAIN_STEPS} steps, losses finite, optimizer steps taken at {taken}")
    return True


# fp16 against bf16 (train_bf16 runs first, into the same WORK): the same model, prompts and seeds, so their
# gradient norms (unscaled: the optimizer divides by the loss scale before it measures) differ only by the
# samples each dtype drew. A loss scale missing from the backward, or applied twice, puts fp16's off by the scale
# itself (2^10 by default); a step skipped on every overflow of a scale too high leaves too few steps.
FP16_GRAD_NORM_FACTOR = 4
FP16_MIN_STEPS = 2


def fp16_problems(grad_norms: dict[int, float], work: Path) -> list[str]:
    """What is wrong with the fp16 run's optimizer steps (their grad norms by step) against train_bf16's."""
    import statistics

    from helpers import scalars

    problems = []
    if len(grad_norms) < FP16_MIN_STEPS:
        problems.append(f"optimizer steps taken at {sorted(grad_norms)}, expected at least {FP16_MIN_STEPS} (every "
                        "other step overflowed the fp16 loss scale)")
    bf16 = scalars(work / "tb_train_bf16", ("grad_norm",)).get("grad_norm", {})
    if not bf16:
        problems.append("no train_bf16 grad norms to compare with (train_bf16 runs first, into the same --work)")
    elif grad_norms:
        ratio = statistics.median(grad_norms.values()) / statistics.median(bf16.values())
        print(f"grad norm median fp16 / bf16: {ratio:.3g} (fp16 {[round(v, 4) for v in grad_norms.values()]}, "
              f"bf16 {[round(v, 4) for v in bf16.values()]})")
        if not 1 / FP16_GRAD_NORM_FACTOR <= ratio <= FP16_GRAD_NORM_FACTOR:
            problems.append(f"fp16's median grad norm is {ratio:.3g} x bf16's, outside a factor of "
                            f"{FP16_GRAD_NORM_FACTOR} (is the loss scaled once in the backward?)")
    return problems


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


def run_part(name: str, work: Path, rehearse: bool = False) -> bool:
    if rehearse:  # the dry run's rehearsal of run.sh: its bookkeeping and output files, nothing run
        print("PASS rehearsal: nothing run")
        return True
    sys.path.insert(0, str(TESTS))  # helpers
    if name == "setup":
        ok = setup(work)
        print("PASS packages and tiny model ready" if ok else "FAIL setup (lines FAIL-ITEM above)")
        return ok
    if name == "nccl":
        return nccl()
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


def plan(selected: str) -> list[tuple[str, int, str | None]]:
    """The parts run.sh runs, in order: PARTS; or, `selected` naming some (GPU_LANE_PARTS, space-separated),
    those and what they need (setup, nccl, train_bf16 for train_fp16). ValueError on a name that is no part."""
    names = set(selected.split())
    unknown = sorted(names - set(PART_NAMES))
    if unknown:
        raise ValueError(f"GPU_LANE_PARTS names no part {' '.join(unknown)} (parts: {' '.join(PART_NAMES)})")
    if not names:
        return list(PARTS)
    needs = {name: need for name, _, need in PARTS + EXTRA_PARTS}
    for name in list(names):
        while needs[name]:
            name = needs[name]
            names.add(name)
    return [part for part in PARTS + EXTRA_PARTS if part[0] in names]


# -------------------------------------------------------------------- dry run ----
def budget_problem() -> str | None:
    """The lane's parts (PARTS) must fit BUDGET in sum: a part that overran into the next ones' time would
    cut them short, and the last ones would be reported as not run."""
    total = sum(limit for _, limit, _ in PARTS)
    print("     part limits: " + ", ".join(f"{name} {limit}" for name, limit, _ in PARTS)
          + f" = {total} s of the {BUDGET} s budget")
    return f"the part limits add up to {total} s, over the {BUDGET} s budget" if total > BUDGET else None


def travelling_bytes() -> tuple[int, int]:
    """(working tree, carried) bytes the device tool sends: the files git tracks or would (untracked, not
    ignored), links as links, and CARRY."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum(os.lstat(ROOT / name).st_size for name in set(listed) if name and os.path.lexists(ROOT / name))
    carried = sum(path.lstat().st_size for path in CARRY.rglob("*") if not path.is_dir()) if CARRY.is_dir() else 0
    return tree, carried


def travel_problem() -> str | None:
    try:
        tree, carried = travelling_bytes()
    except (OSError, subprocess.CalledProcessError) as error:
        return f"git ls-files failed: {error}"
    total = tree + carried
    print(f"     travelling: {total / 2**20:.1f} MiB of {TRAVEL_LIMIT / 2**20:.0f} MiB (working tree "
          f"{tree / 2**20:.1f}, {_shown(CARRY)} {carried / 2**20:.1f})")
    return f"{total / 2**20:.1f} MiB would travel, over {TRAVEL_LIMIT / 2**20:.0f} MiB" if total > TRAVEL_LIMIT else None


def carried_model_problem() -> str | None:
    info = CARRIED_MODEL / "megarl_tiny.json"
    if not info.exists():
        return f"no tiny model at {_shown(CARRIED_MODEL)} (run bash tests/gpu/fetch.sh)"
    here = TINY_MODEL / "megarl_tiny.json"
    if here.exists() and here.read_text() != info.read_text():
        return f"{_shown(CARRIED_MODEL)} is not {_shown(TINY_MODEL)} (rebuilt since? run bash tests/gpu/fetch.sh)"
    return None


def rehearsal_problem() -> str | None:
    """run.sh itself, each part a no-op that passes (GPU_LANE_REHEARSE=1): its table on stdout and at most
    OUTPUT_FILES_LIMIT files under LOGDIR (all the device tool brings back from $OUT)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        logdir = Path(tmp) / "logs"
        env = {key: value for key, value in os.environ.items() if key != "GPU_LANE_PARTS"}
        env.update(GPU_LANE_REHEARSE="1", GPU_LANE_WORK=str(Path(tmp) / "work"), PYTHON=sys.executable)
        result = subprocess.run(["bash", str(TESTS / "gpu" / "run.sh"), str(logdir)], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        files = sorted(str(path.relative_to(logdir)) for path in logdir.rglob("*") if not path.is_dir())
        summary = (logdir / "summary.txt").read_text() if (logdir / "summary.txt").exists() else ""
    print(f"     rehearsal: {len(files)} output files ({', '.join(files)}) of at most {OUTPUT_FILES_LIMIT}")
    if result.returncode != 0:
        return f"run.sh exited {result.returncode}: {(result.stdout + result.stderr).strip()[-300:]}"
    absent = [name for name, _, _ in PARTS if not re.search(rf"^{name} +PASS ", result.stdout, re.M)]
    if absent or not summary or summary not in result.stdout:
        return f"the summary on stdout lacks {', '.join(absent) or 'summary.txt'}"
    if len(files) > OUTPUT_FILES_LIMIT:
        return f"{len(files)} output files, over the {OUTPUT_FILES_LIMIT} the device tool brings back"
    return None


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
    """What the lane needs, checked without a GPU: what travels (the carried wheels and tiny model, its size),
    the parts' limits against the budget, run.sh's output files, imports, paths, every entry point's arguments,
    and the trainer's command lines through megarl's own parser."""
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
               f"{why}; {'no wheel of ' + distribution + '==' + version + ' in ' + _shown(WHEELS) + '/ (run bash tests/gpu/fetch.sh)' if distribution else 'the GPU machine must have it'}")
        if wheel:
            print(f"     (carried: {_shown(wheel)})")
    if not missing_modules():
        report(f"imports: {', '.join(module for module, _, _ in MODULES)}", None)
    # The GPU machine lacks every MODULES entry with a distribution: its wheel must travel, whatever this host has.
    wheels = sorted(WHEELS.glob("*.whl"))
    print(f"     {len(wheels)} wheels, {sum(p.stat().st_size for p in wheels) / 2**20:.1f} MiB: "
          + ", ".join(p.name for p in wheels))
    absent = [f"{d}=={v}" for _, d, v in MODULES if d and wheel_for(d, v) is None]
    report(f"{_shown(WHEELS)}/ covers every carried package", "; ".join(
        wheel_problems() + ([f"lacks {', '.join(absent)} (run bash tests/gpu/fetch.sh)"] if absent else [])) or None)
    report(f"{_shown(CARRIED_MODEL)}/ is the tiny model", carried_model_problem())
    report("what travels fits the device tool", travel_problem())
    report("the part limits fit the lane's budget", budget_problem())
    report("run.sh rehearsed: its summary on stdout, its output files", rehearsal_problem())
    for path in ("tests/gpu/run.sh", "tests/gpu/fetch.sh", "megarl/train.py", "bench/kernels.py",
                 "tests/workers/offload_worker.py", "tests/workers/triton_kernels_worker.py",
                 "tests/test_reward_model.py", "tools/make_tiny_reward_model.py",
                 "tests/workers/sleep_level_worker.py"):
        report(f"path {path}", None if (ROOT / path).is_file() else "missing")

    from helpers import load_script

    entry_points = [("bench/kernels.py", lambda: _load_bench().build_parser(), BENCH_ARGS),
                    *((f"tests/gpu/lane.py part {part}", build_parser, ["part", part, "--work", "/tmp/w"])
                      for part in PART_NAMES)]
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
    part.add_argument("name", choices=PART_NAMES)
    part.add_argument("--work", type=Path, required=True, help="scratch folder (installed packages, runs' output)")
    part.add_argument("--rehearse", action="store_true", help="run nothing, pass (the dry run's rehearsal of run.sh)")
    sub.add_parser("plan", help="print the budget and the parts run.sh runs (GPU_LANE_PARTS), as NAME:LIMIT:NEEDS")
    sub.add_parser("dry-run", help="check what the lane needs, without a GPU")
    sub.add_parser("wheel-specs", help="print NAME==VERSION of every carried package (tests/gpu/fetch.sh)")
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
    if args.command == "plan":
        try:
            parts = plan(os.environ.get("GPU_LANE_PARTS", ""))
        except ValueError as error:
            print(f"gpu lane: {error}", file=sys.stderr)
            return 2
        print(os.environ.get("GPU_LANE_BUDGET") or BUDGET,
              *(f"{name}:{limit}:{need or '-'}" for name, limit, need in parts))
        return 0
    if args.command == "dry-run":
        return 0 if dry_run() else 1
    args.work.mkdir(parents=True, exist_ok=True)
    return 0 if run_part(args.name, args.work, args.rehearse) else 1


if __name__ == "__main__":
    sys.exit(main())
