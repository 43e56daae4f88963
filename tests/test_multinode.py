"""Multi-node launches, tested here with two "nodes" on one machine.

* torchrun: two agents (`--nnodes 2 --nproc_per_node 1`, one per "node") meeting
  through a c10d rendezvous, as run_slurm.sh's LAUNCHER=torchrun starts them.
* srun: two plain processes with only the variables `srun --nodes 2
  --ntasks-per-node 1` gives its tasks (SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID, SLURM_JOB_NODELIST, SLURM_JOB_ID) and none of torchrun's, as
  LAUNCHER=srun starts them; rank 0 serves the store.

One rank per node means LOCAL_RANK 0 on both ranks, and (separate placement) the
trainer and the rollout engine on different nodes, so the weights cross nodes:
what breaks code that takes the local rank for the global one, the node's size
for the world's, or expects one launcher's variables.

run_slurm.sh: its header and syntax, the srun/torchrun/sbatch command lines it
builds (stand-ins record them), its requeue rule, and one real job on one node
that gets the time-limit signal, saves, stops, and resumes when started again.
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import ROOT

CONFIGS = {"colocate": "examples/quickstart_grpo.yaml", "separate": "examples/quickstart_grpo_separate.yaml"}
SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "8",
         "--train-steps", "3"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def free_port(low: int = 20000, high: int = 35000) -> int:
    """A port in [low, high) nothing listens on now (srun derives its port from the job id: 15000 + id)."""
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def clean_env() -> dict:
    """This process's environment without any launcher's variables, plus what the workers need."""
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCH_VARS and not key.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_nodes(commands: list[tuple[list[str], dict]], logs, timeout: float = 600) -> list[tuple[int, str, str]]:
    """Start one process per "node" at once; (exit code, stdout, stderr) of each.

    When one node fails, the others are stopped after a short grace: a peer of a
    dead rank would otherwise wait in a collective for the distributed timeout.
    """
    procs, files = [], []
    for node, (command, env) in enumerate(commands):
        out, err = open(logs / f"node{node}.out", "w+"), open(logs / f"node{node}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True))
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 20):
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)  # the agent and its workers (their own session)
            break
        time.sleep(1)
    results = []
    for p, (out, err) in zip(procs, files):
        p.wait()
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def torchrun_nodes(config: str, model: str, tmp_path) -> list[tuple[list[str], dict]]:
    endpoint = f"127.0.0.1:{free_port()}"
    return [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
              "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
              "--rdzv-id", "multinode-test", "megarl/train.py", "--config", config, "--model", model, *SMALL,
              "--log-dir", str(tmp_path / "tb")], clean_env()) for node in range(2)]


def srun_nodes(config: str, model: str, tmp_path) -> list[tuple[list[str], dict]]:
    job_id = free_port(15000, 35000) - 15000  # megarl's plain-srun store port is 15000 + job id mod 20000
    slurm = dict(SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_LOCALID="0", SLURM_JOB_NODELIST="localhost",
                 SLURM_JOB_ID=str(job_id))
    return [([sys.executable, "megarl/train.py", "--config", config, "--model", model, *SMALL,
              "--log-dir", str(tmp_path / "tb")],
             {**clean_env(), **slurm, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node)}) for node in range(2)]


@pytest.mark.slow
# CI: each launcher once and each placement once (srun colocated, torchrun separate); the other two: -m variants
@pytest.mark.parametrize("launcher,placement", [
    pytest.param(launcher, placement, id=f"{placement}-{launcher}",
                 marks=[] if (launcher, placement) in {("srun", "colocate"), ("torchrun", "separate")}
                 else [pytest.mark.variants])
    for launcher in ("torchrun", "srun") for placement in CONFIGS])
def test_two_nodes_train(launcher, placement, tiny_model, tmp_path):
    build = torchrun_nodes if launcher == "torchrun" else srun_nodes
    results = run_nodes(build(CONFIGS[placement], tiny_model, tmp_path), tmp_path)
    report = "\n".join(f"--- node {n}: exit {rc}\n{out[-2000:]}\n{err[-4000:]}" for n, (rc, out, err) in
                       enumerate(results))
    assert all(rc == 0 for rc, _, _ in results), report
    # Rank 0 prints; with a c10d rendezvous either agent may be the one that hosts it.
    main = [out for _, out, _ in results if "[megarl] placement" in out]
    assert len(main) == 1, report
    assert f"placement: {placement}, 2 ranks" in main[0], report
    steps = [line for line in main[0].splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "reward:" in main[0], report
    # Rollout logprobs match the trainer's: the weights reached the other node's engine.
    assert max(float(line.split("mismatch ")[1].split()[0]) for line in steps) <= 1e-3, steps
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_plain_srun_exports_torchrun_variables():
    """vLLM's external launcher reads LOCAL_RANK, and platform.device() picks cuda:$LOCAL_RANK:
    under plain srun megarl sets them from SLURM's; values a launcher set are kept."""
    from megarl.distributed import export_launch_env, launch_env

    slurm = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[003-004]",
             "SLURM_JOB_ID": "4242"}
    environ = dict(slurm)
    export_launch_env(launch_env(environ), environ)
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == dict(
        RANK="9", WORLD_SIZE="16", LOCAL_RANK="1", MASTER_ADDR="gpu003", MASTER_PORT=str(15000 + 4242))
    assert launch_env(environ) == launch_env(slurm)  # later readers see the same launch
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "29400",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    environ = dict(torchrun)
    export_launch_env(launch_env(environ), environ)
    assert environ == torchrun


# ---- run_slurm.sh, with stand-ins for sbatch/srun/scontrol/squeue that record their arguments ----

SLURM_SCRIPT = ROOT / "run_slurm.sh"
STUBS = {
    "srun": 'printf "%s\\n" "$@" > "$STUB_LOG/srun"; exit "${SRUN_EXIT:-0}"',
    "sbatch": 'printf "%s\\n" "$@" > "$STUB_LOG/sbatch"',
    "scontrol": 'if [ "$1" = show ]; then printf "gpu003\\ngpu004\\n"; '
                'else printf "%s\\n" "$@" > "$STUB_LOG/scontrol"; fi',
    "squeue": 'date -d "@$(( $(date +%s) + STUB_END_IN ))" +%Y-%m-%dT%H:%M:%S',
}


def run_slurm_script(tmp_path, *args, **env):
    """Run run_slurm.sh as a batch job on 2 nodes (unless SLURM_JOB_ID is given as None); the stubs' logs."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir(parents=True, exist_ok=True), log.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    job = dict(SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[003-004]", SLURM_CPUS_ON_NODE="64",
               CONFIG="examples/grpo.yaml", STUB_END_IN="3600")
    job.update(env)
    full_env = {**clean_env(), **{k: v for k, v in job.items() if v is not None}, "STUB_LOG": str(log),
                "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(SLURM_SCRIPT), *args], cwd=ROOT, env=full_env, capture_output=True,
                            text=True, timeout=60)
    calls = {path.name: path.read_text().splitlines() for path in log.iterdir()}
    return result, calls


def test_slurm_script_header_and_syntax():
    subprocess.run(["bash", "-n", str(SLURM_SCRIPT)], check=True)
    header = [line.split(None, 1)[1] for line in SLURM_SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    for directive in ("--nodes=", "--gpus-per-node=", "--ntasks-per-node=", "--time=", "--requeue",
                      "--signal=USR1@120"):
        assert any(line.startswith(directive) for line in header), (directive, header)
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        result = subprocess.run([shellcheck, str(SLURM_SCRIPT)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_slurm_torchrun_launch(tmp_path):
    result, calls = run_slurm_script(tmp_path, "--lr", "1e-6", EXTRA_ARGS="--seed 3 --train-steps 5")
    assert result.returncode == 0, result.stderr
    srun = calls["srun"]
    agent = srun.index("agent")  # bash -c '<ignore SIGUSR1>' agent <torchrun ...>
    assert srun[:agent - 3] == ["--nodes", "2", "--kill-on-bad-exit=1", "--ntasks-per-node", "1",
                                "--cpus-per-task", "64"]
    assert srun[agent + 2:] == [
        "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu003:29500", "--rdzv-id", "77", "megarl/train.py", "--config", "examples/grpo.yaml",
        "--save-dir", "runs/grpo/checkpoints", "--resume", "auto", "--seed", "3", "--train-steps", "5", "--lr", "1e-6"]
    assert "scontrol" not in calls  # far from the time limit: no requeue
    # The wrapper leaves the agent ignoring SIGUSR1 (its default action would end the step).
    probe = subprocess.run([*srun[agent - 3:agent + 1], sys.executable, "-c",
                            "import signal; print(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)"],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "True", probe


def test_slurm_srun_launch_in_a_container(tmp_path):
    result, calls = run_slurm_script(tmp_path, LAUNCHER="srun", GPUS_PER_NODE="4", CONTAINER="/images/megarl.sqsh",
                                     CONTAINER_MOUNTS="/data:/data", SAVE_DIR="/ckpt/x")
    assert result.returncode == 0, result.stderr
    assert calls["srun"] == [
        "--nodes", "2", "--kill-on-bad-exit=1", "--container-image", "/images/megarl.sqsh", "--container-mounts",
        f"{ROOT}:{ROOT},/data:/data", "--container-workdir", str(ROOT), "--ntasks-per-node", "4",
        "--cpus-per-task", "16", "python", "megarl/train.py", "--config", "examples/grpo.yaml", "--save-dir",
        "/ckpt/x", "--resume", "auto"]


def test_slurm_requeues_after_the_time_limit_only(tmp_path):
    result, calls = run_slurm_script(tmp_path, STUB_END_IN="100")  # inside the SIGUSR1 window
    assert result.returncode == 0 and calls["scontrol"] == ["requeue", "77"], (result.stdout, result.stderr)
    result, calls = run_slurm_script(tmp_path / "a", STUB_END_IN="100", SLURM_RESTART_COUNT="20")
    assert result.returncode == 0 and "scontrol" not in calls, result.stderr
    result, calls = run_slurm_script(tmp_path / "b", SRUN_EXIT="3")  # a failure, not a time limit
    assert result.returncode == 3 and "scontrol" not in calls


def test_slurm_script_submits_itself_and_checks_its_settings(tmp_path):
    result, calls = run_slurm_script(tmp_path, "--lr", "1e-6", SLURM_JOB_ID=None, NODES="4", GPUS_PER_NODE="4")
    assert result.returncode == 0, result.stderr
    assert calls["sbatch"] == ["--nodes", "4", "--gpus-per-node", "4", "--ntasks-per-node", "4", "--chdir", str(ROOT),
                               str(SLURM_SCRIPT), "--lr", "1e-6"]
    result, _ = run_slurm_script(tmp_path / "a", CONFIG=None)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "CONFIG" in result.stderr
    result, _ = run_slurm_script(tmp_path / "b", LAUNCHER="mpirun")
    assert result.returncode == 2 and "LAUNCHER" in result.stderr


def run_job_until(env: dict, log, marker: str) -> tuple[int, str]:
    """Run run_slurm.sh; once `marker` is in its output, SIGUSR1 to every process of the step
    (not the batch shell), as slurmstepd sends it 120 s before the time limit; (exit code, output)."""
    import psutil

    with open(log, "w") as out:
        job = subprocess.Popen(["bash", str(SLURM_SCRIPT)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while marker not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        for process in psutil.Process(job.pid).children(recursive=True):
            try:
                process.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    return job.returncode, log.read_text()


@pytest.mark.slow
def test_slurm_script_stops_on_the_time_limit_signal_and_resumes(tiny_model, tmp_path):
    """run_slurm.sh's torchrun line for real, on one node (an srun stand-in runs the task here).
    At SIGUSR1 the agent survives, the ranks save and stop, the job ends with 0; the same job
    started again (a requeue) resumes from that checkpoint."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {  # srun: drop its own flags (--x value, --x=value), run the task in place
        "srun": 'while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do case "$1" in *=*) shift ;; *) shift 2 ;; esac; done\n'
                'exec "$@"',
        "scontrol": 'if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$STUB_LOG"; fi',
        "squeue": 'date -d "@$(( $(date +%s) + 3600 ))" +%Y-%m-%dT%H:%M:%S',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    save_dir = tmp_path / "ckpt"
    env = {**clean_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "scontrol"),
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_ON_NODE": "2",
           "CONFIG": "examples/quickstart_grpo.yaml", "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port()),
           "SAVE_DIR": str(save_dir),
           "EXTRA_ARGS": " ".join(["--model", tiny_model, *SMALL[:-2], "--train-steps", "200", "--log-dir",
                                   str(tmp_path / "tb")])}
    returncode, output = run_job_until(env, tmp_path / "job1.out", "step 2/200")
    assert returncode == 0, output[-4000:]
    stopped = [line for line in output.splitlines() if line.startswith("megarl: SIGUSR1 received: stopped after step")]
    assert stopped, output[-4000:]
    done = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 2 <= done < 200 and (save_dir / f"step_{done:08d}" / "state.json").exists(), list(save_dir.iterdir())

    env["RDZV_PORT"] = str(free_port())
    returncode, output = run_job_until(env, tmp_path / "job2.out", f"step {done + 1}/200")
    assert returncode == 0, output[-4000:]
    assert f"megarl: resumed from {save_dir / f'step_{done:08d}'} after step {done}" in output, output[-4000:]
    first = next(line for line in output.splitlines() if line.startswith("step "))
    assert first.startswith(f"step {done + 1}/200"), first
    assert not (tmp_path / "scontrol").exists()  # far from the time limit: never requeued by the script
