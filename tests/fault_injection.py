"""Fault-injection suite: kill a rank at many points of a step, fill the disk while saving, run long.

    python tests/fault_injection.py --all              # every case below, then the table
    python tests/fault_injection.py --kills            # only the SIGKILL cases (both placements)
    python tests/fault_injection.py --ci               # the CI subset (tests/test_faults.py runs the same)
    python tests/fault_injection.py --case sync:3:1:colocated --case full_disk:colocated
    python tests/fault_injection.py --long-run --long-steps 500

Each case prints one row: what was tried and what happened. The pytest file tests/test_faults.py runs
a subset (`CI_CHAINS` and the full disk) through the same functions, in CI; tests/test_fault_suite_full.py
runs all of --all (`run_suite`) in the soak lane, `bash run_tests.sh -m soak`.

SIGKILL cases (`kill_case`): tests/workers/fault_worker.py SIGKILLs one rank (MEGARL_FAULT=point:step:rank)
in a small job (4 steps, a checkpoint after every step, a held-out evaluation after steps 2 and 4, the
separate old-logprob pass on). Checked:
  - every rank exits, within EXIT_LIMIT seconds of the kill (torchrun's exit);
  - megarl prints a line naming the rank that died (`megarl: rank N died ...`);
  - the newest complete checkpoint is the last one published before the kill (a partial one is
    never published);
  - `--resume auto` resumes from it, and every logged scalar of the killed run before the kill and of
    the resumed run after it equals the uninterrupted run's, bit for bit (CPU).
Full disk (`full_disk_case`): RLIMIT_FSIZE on every rank from the second save on (writes past 1 MiB
fail: the Megatron shards of the tiny model are 2 MiB); or, with --tmpfs as root, a real 6 MiB tmpfs
(ENOSPC). Checked: a one-line error naming the checkpoint path, the previous checkpoint intact and
chosen by --resume auto, no traceback.
Long run (`long_run`): the quickstart job, at its own LR, for --long-steps steps with --min-new-tokens equal to
its --max-new-tokens, so that every step generates the same number of tokens whatever the policy learns; the RSS
of every rank (from /proc, sampled by this script) and the CPU time per step do not grow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "fault_worker.py"
# This checkout's megarl, as the launched ranks get (PYTHONPATH), even where another checkout is installed.
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PLACEMENTS = {"colocated": "examples/quickstart_grpo.yaml", "separate": "examples/quickstart_grpo_separate.yaml"}
STEPS = 4
JOB = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "8",
       "--lr", "1e-3", "--train-steps", str(STEPS), "--save-interval", "1", "--save-keep", "0",
       "--no-on-policy-shortcut", "--eval-dataset", "held=builtin:8", "--eval-interval", "2"]
EXIT_LIMIT = 60.0  # seconds from the kill to the exit of every rank
RUN_LIMIT = 600  # seconds any one run may take before it counts as a hang
COMPARED = ("reward_mean", "loss", "grad_norm", "entropy", "mismatch", "response_length_mean", "kl_old_new",
            "advantage_mean", "eval/held/pass@1")

# Points and the ranks that reach them: colocated, both ranks train and generate; separate, rank 0
# trains and rank 1 generates. The kill step: during step 3 (for save points: saving after step 3;
# eval: the evaluation after step 2).
POINTS = {
    "generate": {"colocated": (0, 1), "separate": (1,)},
    "reward": {"colocated": (0, 1), "separate": (1,)},
    "old_logprobs": {"colocated": (0, 1), "separate": (0,)},
    "advantages": {"colocated": (0, 1), "separate": (0, 1)},
    "backward": {"colocated": (0, 1), "separate": (0,)},
    "optimizer": {"colocated": (0, 1), "separate": (0,)},
    "metric_allreduce": {"colocated": (0, 1), "separate": (0,)},
    "sync": {"colocated": (0, 1), "separate": (0, 1)},
    "eval": {"colocated": (0, 1), "separate": (0, 1)},
    "preempt_check": {"colocated": (0, 1), "separate": (0, 1)},
    "save": {"colocated": (0, 1), "separate": (0, 1)},
    "save_publish": {"colocated": (0,), "separate": (0,)},
}
KILL_STEP = {"eval": 2}  # default 3


def kill_step(point: str) -> int:
    return KILL_STEP.get(point, 3)


# The CI subset (tests/test_faults.py), one chain per placement: a kill during the weight sync of step 2,
# resume, a kill while saving after step 3, resume. Separate: the trainer dies in the sync, the rollout rank
# in the save.
CI_CHAINS = {"colocated": [("sync", 2, 1), ("save", 3, 0)], "separate": [("sync", 2, 0), ("save", 3, 1)]}


@dataclass
class Run:
    returncode: int
    output: str
    started: float
    ended: float
    kill_time: float | None = None
    usage: dict = field(default_factory=dict)  # sampled at each step line: {step: {rank: (RSS MB, CPU s)}}
    hung: bool = False  # still running at the launch's limit: killed by the hang guard

    @property
    def exit_seconds(self) -> float | None:
        return None if self.kill_time is None else self.ended - self.kill_time


@dataclass
class Result:
    case: str
    placement: str
    rank: str
    exit_s: str
    message: str
    resumed: str
    ok: bool
    notes: list = field(default_factory=list)  # what went wrong
    detail: str = ""  # what happened, below the table


def launch(placement: str, out: Path, name: str, *extra, env: dict | None = None, limit: float = RUN_LIMIT,
           sample_rss: bool = False) -> Run:
    """One torchrun job of 2 ranks through the fault worker; its output goes to out/<name>.log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               "--config", PLACEMENTS[placement], "--log-dir", str(out / f"tb_{name}"), *map(str, extra)]
    fault_log = out / f"{name}.fault"
    fault_log.unlink(missing_ok=True)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MEGARL_FAULT_LOG": str(fault_log),
                **(env or {})}
    started = time.time()
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines, rss = [], {}
    hung = threading.Event()

    def hang_guard():
        hung.set()
        os.killpg(process.pid, signal.SIGKILL)

    timer = threading.Timer(limit, hang_guard)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            match = re.match(r"step (\d+)/", line)
            if match and sample_rss:
                rss[int(match.group(1))] = ranks_usage(process.pid)
        process.wait()
    finally:
        timer.cancel()
    ended = time.time()
    try:  # anything the job left behind (it should leave nothing)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    output = "".join(lines)
    (out / f"{name}.log").write_text(output)
    kill_time = float(fault_log.read_text().split()[0]) if fault_log.exists() else None
    return Run(process.returncode, output, started, ended, kill_time, rss, hung.is_set())


def ranks_usage(launcher_pid: int) -> dict[int, tuple[float, float]]:
    """(RSS MB, CPU seconds so far) of each rank: the launcher's children, by their RANK variable."""
    result, tick = {}, os.sysconf("SC_CLK_TCK")
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = next(int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK="))
            status = Path(f"/proc/{child}/status").read_text()
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            result[rank] = (int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024,
                            (int(stat[11]) + int(stat[12])) / tick)  # utime + stime
        except (OSError, StopIteration, AttributeError):
            pass
    return result


def complete_checkpoints(save_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in save_dir.glob("step_*") if (p / "state.json").exists())


def reference(placement: str, out: Path) -> Path:
    """The uninterrupted job's TensorBoard dir (run once per out dir)."""
    tb = out / "tb_reference"
    if not (out / "reference.done").exists():
        shutil.rmtree(tb, ignore_errors=True)
        run = launch(placement, out, "reference", *JOB, "--save-dir", out / "reference_ckpt")
        if run.returncode != 0:
            raise RuntimeError(f"the uninterrupted {placement} run failed:\n{run.output[-4000:]}")
        (out / "reference.done").write_text("")
    return tb


def _scalars(tb: Path) -> dict:
    from helpers import scalars

    return scalars(tb, COMPARED)


def compare(reference_tb: Path, tbs: list[Path]) -> list[str]:
    """Every scalar (COMPARED) any of these runs logged against the uninterrupted run's at the same step, bit
    for bit, and whether together they logged every step: the differences, empty when none."""
    want = _scalars(reference_tb)
    differences, seen = [], {}
    for tb in tbs:
        for tag, series in _scalars(tb).items():
            seen.setdefault(tag, set()).update(series)
            differences += [f"{tb.name}: {tag}@{step}: {value!r} != {want.get(tag, {}).get(step)!r}"
                            for step, value in sorted(series.items()) if want.get(tag, {}).get(step) != value]
    differences += [f"{tag}: steps {sorted(set(series) - seen.get(tag, set()))} were never logged after the kill"
                    for tag, series in want.items() if set(series) - seen.get(tag, set())]
    return differences


def names_dead_rank(output: str, rank: int) -> str | None:
    """megarl's line naming the rank that died, or None."""
    match = re.search(rf"^megarl: rank {rank} died\b.*$", output, re.M)
    return match.group(0) if match else None


def kill_case(point: str, step: int, rank: int, placement: str, out: Path) -> Result:
    return kill_chain([(point, step, rank)], placement, out)[0]


def kill_chain(faults: list[tuple[str, int, int]], placement: str, out: Path,
               exit_limit: float | None = EXIT_LIMIT) -> list[Result]:
    """SIGKILL launch rank `rank` at `point` of step `step`, for each fault in turn (each run after the
    first resumes with --resume auto), then a last run resumes and finishes; see the module docstring.
    One Result per fault; its `resumed` says how the next run resumed from its last checkpoint. Every killed
    run must exit by itself (not by the launch's hang guard); `exit_limit` also bounds the seconds from the
    kill to the exit (the soak lane's check: CI passes None, a time on a loaded machine being no verdict)."""
    out.mkdir(parents=True, exist_ok=True)
    reference_tb = reference(placement, out.parent / f"reference_{placement}")
    save_dir = out / "ckpt"
    shutil.rmtree(save_dir, ignore_errors=True)
    for tb in out.glob("tb_*"):
        shutil.rmtree(tb)
    results, runs = [], []
    for index, (point, step, rank) in enumerate(faults + [(None, None, None)]):
        name = f"killed{index}" if index < len(faults) else "resumed"
        resume = ["--resume", "auto"] if index else []
        env = {"MEGARL_FAULT": f"{point}:{step}:{rank}"} if index < len(faults) else {}
        run = launch(placement, out, name, *JOB, "--save-dir", save_dir, *resume, env=env)
        runs.append(out / f"tb_{name}")
        if index:  # it resumed from the previous fault's last complete checkpoint
            expected = faults[index - 1][1] - 1
            want = f"resumed from {save_dir / f'step_{expected:08d}'} after step {expected}"
            resumed = want in run.output or (expected == 0 and "resumed from" not in run.output)
            results[-1].resumed = f"from step {expected}" if resumed else "FAILED"
            if not resumed:
                results[-1].notes.append(f"expected {want!r}")
        if index == len(faults):
            if run.returncode != 0:
                results[-1].notes.append(f"the last resumed run failed (exit code {run.returncode})")
            break
        result = Result(f"SIGKILL {point}:{step}", placement, str(rank), "-", "-", "-", False)
        results.append(result)
        if run.kill_time is None:
            result.notes.append(f"the fault was not reached (exit code {run.returncode})")
            return results
        result.exit_s = f"{run.exit_seconds:.1f}"
        if run.returncode == 0:
            result.notes.append("the killed run exited 0")
        if run.hung:
            result.notes.append(f"the killed run did not exit: the hang guard killed it after {RUN_LIMIT} s")
        elif exit_limit is not None and run.exit_seconds > exit_limit:
            result.notes.append(f"exit took {run.exit_seconds:.0f} s > {exit_limit:.0f} s")
        line = names_dead_rank(run.output, rank)
        result.message = "yes" if line else "no"
        if not line:
            result.notes.append("no line naming the dead rank")
        # A checkpoint after every step; the one being written at the kill is never published.
        complete = complete_checkpoints(save_dir)
        if (complete[-1] if complete else 0) != step - 1:
            result.notes.append(f"complete checkpoints {complete}, expected the newest to be {step - 1}")
    differences = compare(reference_tb, runs)
    results[-1].resumed += ", bit-exact" if not differences else f", {len(differences)} scalars differ"
    results[-1].notes += differences[:5]
    for result in results:
        result.ok = not result.notes
    return results


def full_disk_case(placement: str, out: Path, tmpfs: bool = False) -> Result:
    """Writes fail during the second checkpoint save (RLIMIT_FSIZE, or a full tmpfs): a one-line error
    naming the checkpoint, the first checkpoint intact, `--resume auto` picks it."""
    out.mkdir(parents=True, exist_ok=True)
    save_dir, env = out / "ckpt", {}
    shutil.rmtree(save_dir, ignore_errors=True)
    if tmpfs:
        save_dir.mkdir()
        # One checkpoint of the tiny model is 4.2 MB: the second does not fit.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(save_dir)], check=True)
    else:
        env = {"MEGARL_FAULT_FSIZE": str(1 << 20), "MEGARL_FAULT_FSIZE_AFTER": "1"}
    name = "full disk (tmpfs, ENOSPC)" if tmpfs else "full disk (RLIMIT_FSIZE, EFBIG)"
    result = Result(name, placement, "all", "-", "-", "-", False)
    try:
        run = launch(placement, out, "full", *JOB, "--save-dir", save_dir, env=env)
        errors = re.findall(r"^megarl: .*error.*checkpoint.*$", run.output, re.M | re.I)
        partial = f".partial_step_{2:08d}"
        if run.returncode == 0:
            result.notes.append("the run exited 0")
        if not errors or not any(partial in line for line in errors):
            result.notes.append("no one-line error naming the checkpoint path")
        if re.search(r"Traceback \(most recent call last\):\n(\s+.*\n)*?\s+File \".*/megarl/", run.output):
            result.notes.append("a traceback was printed")  # torchrun prints its own, outside megarl
        result.message = "one line" if errors else "no"
        result.detail = f"run ended after {run.ended - run.started:.0f} s: " + (errors[0] if errors else "")
        complete = complete_checkpoints(save_dir)
        if complete != [1]:
            result.notes.append(f"complete checkpoints {complete}, expected [1]")
        if tmpfs:  # room for the resumed run's checkpoints
            subprocess.run(["mount", "-o", "remount,size=64m", str(save_dir)], check=True)
        resumed = launch(placement, out, "resumed", *JOB, "--save-dir", save_dir, "--resume", "auto",
                         "--train-steps", "2")
        want = f"resumed from {save_dir / 'step_00000001'} after step 1"
        result.resumed = "from step 1" if resumed.returncode == 0 and want in resumed.output else "FAILED"
        if result.resumed == "FAILED":
            result.notes.append(f"resume: exit code {resumed.returncode}; expected {want!r}")
    finally:
        if tmpfs:
            subprocess.run(["umount", str(save_dir)], check=False)
    result.ok = not result.notes
    return result


def fixed_length(placement: str, extra: tuple = ()) -> list[str]:
    """--min-new-tokens equal to the job's --max-new-tokens (its config's, or one in `extra`). Left to stop where
    it likes, the quickstart's policy learns to answer longer (the separate placement: from 10.9 to the full 16
    tokens after step ~390) and each step then does more work, which the bounds below would count as growth."""
    from megarl.arguments import parse_args

    args = parse_args(["--config", str(ROOT / PLACEMENTS[placement]), *extra], world_size=2)
    return ["--min-new-tokens", str(args.max_new_tokens)]


def long_run(placement: str, out: Path, steps: int = 500, extra: tuple = ()) -> Result:
    """The quickstart job for `steps` steps, every response at the full --max-new-tokens (`fixed_length`; `extra`
    comes after, so it may say otherwise). Every rank's RSS at the end (median over its last 20 steps) within
    5% of its RSS at step 50 (median over steps 41-60): /proc read as each step line appears, medians since
    RSS moves within a step. Step time: the median of the last 50 steps within 10% of that of steps 51-100,
    measured as CPU seconds per step (every rank's utime + stime) since on a shared host the wall clock
    follows the neighbours' load; the wall-clock medians are reported beside it."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "tb_long", ignore_errors=True)
    run = launch(placement, out, "long", "--train-steps", steps, "--log-interval", "1",
                 *fixed_length(placement, extra), *extra, limit=3 * 3600, sample_rss=True)
    result = Result(f"long run ({steps} steps)", placement, "-", "-", "-", "-", False)
    if run.returncode != 0:
        result.notes.append(f"exit code {run.returncode}")
        return result
    from helpers import scalars

    usage = run.usage
    ranks = sorted(usage.get(50, {}))
    complete = [s for s in sorted(usage) if all(r in usage[s] for r in ranks)]  # the last lines may miss a rank
    early_window = [s for s in complete if 41 <= s <= 60]
    late_window = complete[-20:]
    lines = []
    for rank in ranks:
        early = statistics.median(usage[s][rank][0] for s in early_window)
        late = statistics.median(usage[s][rank][0] for s in late_window)
        lines.append(f"rank {rank} RSS {early:.0f} -> {late:.0f} MB ({late / early - 1:+.1%})")
        if late > early * 1.05:
            result.notes.append(f"rank {rank}: RSS grew {late / early - 1:.1%}")

    def cpu_per_step(first: int, last: int) -> float:
        first, last = min(complete, key=lambda s: abs(s - first)), min(complete, key=lambda s: abs(s - last))
        return sum(usage[last][r][1] - usage[first][r][1] for r in ranks) / (last - first)

    cpu_early, cpu_late = cpu_per_step(50, 100), cpu_per_step(complete[-1] - 50, complete[-1])
    series = scalars(out / "tb_long", ("step_seconds", "response_length_mean"))
    seconds, lengths = series["step_seconds"], series["response_length_mean"]
    wall_early = statistics.median(seconds[s] for s in range(50, 100))
    wall_late = statistics.median(seconds[s] for s in range(steps - 50, steps))
    lines.append(f"CPU per step {cpu_early:.3f} -> {cpu_late:.3f} s ({cpu_late / cpu_early - 1:+.1%})")
    lines.append(f"wall-clock median step {wall_early:.3f} -> {wall_late:.3f} s ({wall_late / wall_early - 1:+.1%})")
    # The work of a step follows the response length (the policy may learn to answer longer).
    lines.append(f"response length {statistics.mean(lengths[s] for s in range(50, 100)):.1f} -> "
                 f"{statistics.mean(lengths[s] for s in range(steps - 50, steps)):.1f} tokens")
    if cpu_late > cpu_early * 1.10:
        result.notes.append(f"CPU time per step grew {cpu_late / cpu_early - 1:.1%}")
    logged = scalars(out / "tb_long", ("rss_mb",)).get("rss_mb")
    if logged:
        lines.append(f"rss_mb metric (rank 0) {statistics.median(logged[s] for s in range(40, 60)):.0f} -> "
                     f"{statistics.median(logged[s] for s in range(steps - 20, steps)):.0f} MB")
    else:
        result.notes.append("no rss_mb metric")
    if len(ranks) != 2:
        result.notes.append(f"RSS sampled for ranks {ranks} only")
    result.detail = "; ".join(lines)
    result.message = "RSS " + ", ".join(line.split("(")[1].rstrip(")") for line in lines[:len(ranks)])
    result.resumed = "CPU/step " + lines[len(ranks)].split("(")[1].rstrip(")")
    result.ok = not result.notes
    return result


def table(results: list[Result]) -> str:
    head = ("case", "placement", "killed rank", "exit s after kill", "dead rank named", "resume", "ok")
    rows = [(r.case, r.placement, r.rank, r.exit_s, r.message, r.resumed, "yes" if r.ok else "NO") for r in results]
    widths = [max(len(str(row[i])) for row in [head] + rows) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    notes = [f"  {r.case} ({r.placement}, rank {r.rank}): {n}" for r in results for n in [r.detail] + r.notes if n]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def all_kill_cases() -> list[str]:
    return [f"{point}:{kill_step(point)}:{rank}:{placement}"
            for placement in PLACEMENTS for point, ranks in POINTS.items() for rank in ranks[placement]]


def run_case(spec: str, out: Path) -> list[Result]:
    parts = spec.split(":")
    if parts[0] == "chain":
        return kill_chain(CI_CHAINS[parts[1]], parts[1], out / f"chain_{parts[1]}")
    if parts[0] == "full_disk":
        return [full_disk_case(parts[1], out / f"full_disk_{parts[1]}")]
    if parts[0] == "full_disk_tmpfs":
        return [full_disk_case(parts[1], out / f"full_disk_tmpfs_{parts[1]}", tmpfs=True)]
    point, step, rank, placement = parts
    return [kill_case(point, int(step), int(rank), placement, out / placement / f"{point}_{step}_{rank}")]


def options(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every kill case, full disk and the long run")
    parser.add_argument("--kills", action="store_true", help="every kill case")
    parser.add_argument("--ci", action="store_true", help="the CI subset (as tests/test_faults.py)")
    parser.add_argument("--case", action="append", default=[],
                        help="POINT:STEP:RANK:PLACEMENT, full_disk:PLACEMENT or full_disk_tmpfs:PLACEMENT")
    parser.add_argument("--long-run", action="store_true")
    parser.add_argument("--long-steps", type=int, default=500)
    parser.add_argument("--long-placement", choices=sorted(PLACEMENTS), action="append",
                        help="the long run's placements (default: both)")
    parser.add_argument("--long-args", default="", help="extra megarl options for the long run")
    parser.add_argument("--tmpfs", action="store_true", help="also the full disk on a real tmpfs (needs root)")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one, removed)")
    return parser.parse_args(argv)


def run_suite(args: argparse.Namespace) -> list[Result]:
    """The cases `args` (`options`) name, then the long runs: one progress line as each result comes, and the
    results in that order (tests/test_fault_suite_full.py asserts on them)."""
    cases = list(args.case)
    if args.ci:
        cases += [f"chain:{placement}" for placement in CI_CHAINS] + ["full_disk:colocated"]
    if args.all or args.kills:
        cases += all_kill_cases()
    if args.all:
        cases += [f"full_disk:{p}" for p in PLACEMENTS]
        if args.tmpfs:
            cases += ["full_disk_tmpfs:colocated"]
    out = Path(args.out or tempfile.mkdtemp(prefix="megarl_faults_"))
    results = []
    started = time.time()
    try:
        for spec in cases:
            for result in run_case(spec, out):
                results.append(result)
                print(f"[{time.time() - started:6.0f}s] {spec}: {result.case} rank {result.rank}: "
                      f"{'ok' if result.ok else 'FAILED ' + '; '.join(result.notes)}", flush=True)
        if args.all or args.long_run:
            for placement in args.long_placement or PLACEMENTS:
                results.append(long_run(placement, out / f"long_{placement}", args.long_steps,
                                        tuple(args.long_args.split())))
                print(f"[{time.time() - started:6.0f}s] long run {placement}: {results[-1].detail} "
                      f"{'ok' if results[-1].ok else 'FAILED ' + '; '.join(results[-1].notes)}", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    return results


def main(argv=None) -> int:
    started = time.time()
    results = run_suite(options(argv))
    print(table(results))
    print(json.dumps({"cases": len(results), "failed": sum(not r.ok for r in results),
                      "minutes": round((time.time() - started) / 60, 1)}))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
