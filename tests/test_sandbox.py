"""The sandbox contains hostile programs; the test process plays the trainer.

Real runs, no mocks. Each hostile case asserts that the run failed (or was a
no-op), ended within its limit plus SLACK (the machine may be loaded), and left
the trainer as it was: alive, same cwd, checkout unchanged, nothing written,
no sandbox process left. The runs use a uid of their own (when the tests run as
root) so that leftover processes can be told from anyone else's.
"""

import dataclasses
import hashlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.rewards import sandbox
from megarl.rewards.sandbox import (
    RunResult,
    SandboxLimits,
    SandboxPool,
    run_program,
)

ROOT = Path(__file__).resolve().parents[1]
# The wall clock is a hang guard in every case but the one that tests it (SHORT_WALL): at 3 s a correct
# program's start-up (namespaces, the interpreter) timed out on two cores at load 20.
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=30.0, memory_mb=256, max_processes=8, max_file_mb=4,
                       max_output_bytes=1 << 20)
SHORT_WALL = dataclasses.replace(LIMITS, wall_seconds=3.0)
PATIENT = SandboxLimits(cpu_seconds=5, wall_seconds=60.0, memory_mb=256, max_processes=8, max_file_mb=4,
                        max_output_bytes=1 << 20)  # a wall clock no load reaches
SLACK = 30.0  # how long killed processes may take to go on a loaded machine: a hang guard, not a bound
TEST_UID = 60000 + os.getpid() % 5000


@pytest.fixture(scope="module", autouse=True)
def own_uid():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sandbox, "SANDBOX_UID", TEST_UID)
        yield


def _fingerprint() -> tuple:
    return os.getcwd(), hashlib.sha256((ROOT / "setup.py").read_bytes()).hexdigest()


TRAINER = _fingerprint()


def _sandbox_processes() -> list[int]:
    """Live (not zombie) processes of the tests' sandbox uid."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:  # it exited meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields and int(fields["Uid"].split()[0]) == TEST_UID and not fields["State"].strip().startswith("Z"):
            found.append(int(entry.name))
    return found


def assert_trainer_unaffected() -> None:
    assert _fingerprint() == TRAINER
    deadline = time.monotonic() + SLACK  # killed processes need a moment to go
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []


def run(source: str, stdin: str = "", limits: SandboxLimits = LIMITS, **kwargs) -> tuple[RunResult, float]:
    start = time.monotonic()
    result = run_program(textwrap.dedent(source), stdin, limits, **kwargs)
    return result, time.monotonic() - start


# --- the ordinary cases


def test_correct_program_gets_its_stdin():
    result, _ = run("print(sum(map(int, input().split())))", "2 3\n")
    assert (result.status, result.stdout, result.returncode) == ("ok", "5\n", 0)


def test_exit_and_quit_exist_without_site():
    assert run("exit(0)")[0].status == "ok"
    result, _ = run("quit(3)")
    assert (result.status, result.returncode) == ("runtime error", 3)


def test_raising_is_a_runtime_error_with_the_traceback():
    result, _ = run("raise ValueError('boom')")
    assert (result.status, result.returncode) == ("runtime error", 1)
    assert result.stderr_tail.rstrip().endswith("ValueError: boom")


def test_working_directory_is_private_and_removed(tmp_path):
    write = """
        import os
        print(os.getcwd(), os.listdir("."))
        with open("notes.txt", "w") as f:
            f.write("x" * 1000)
    """
    first, _ = run(write, tmp_root=str(tmp_path))
    second, _ = run(write, tmp_root=str(tmp_path))
    assert first.status == second.status == "ok"
    assert first.stdout == second.stdout == "/sandbox []\n"  # the second run does not see the first's file
    assert list(tmp_path.iterdir()) == []  # the host-side run directory is gone


def test_file_size_limit():
    result, _ = run("open('big', 'wb').write(b'x' * (8 << 20))")  # max_file_mb=4
    assert result.status == "runtime error" and "File too large" in result.stderr_tail


# --- hostile programs


def test_infinite_loop_hits_the_cpu_limit():
    result, seconds = run("while True: pass")
    assert result.status == "timeout"
    assert_trainer_unaffected()


def test_sleeping_past_the_wall_clock_is_killed():
    result, seconds = run("import time\ntime.sleep(100)", limits=SHORT_WALL)
    assert (result.status, result.returncode) == ("timeout", None)
    assert SHORT_WALL.wall_seconds <= seconds  # not killed early (how much later depends on the machine's load)
    assert_trainer_unaffected()


def test_fork_bomb_is_contained():
    result, seconds = run("import os\nwhile True: os.fork()")
    assert result.status != "ok"
    assert_trainer_unaffected()
    assert run("print('next')")[0].stdout == "next\n"  # the host's process table is fine


def test_process_limit_counts_the_program_and_its_children():
    source = """
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                children += 1
        except OSError:
            print(children)
    """
    result, _ = run(source)
    assert (result.status, result.stdout) == ("ok", f"{LIMITS.max_processes - 1}\n")
    assert_trainer_unaffected()  # the sleeping children died with the program


def test_10_gib_allocation_is_a_memory_limit():
    result, seconds = run("b = bytearray(10 * 2**30)")
    assert result.status == "memory limit"
    assert_trainer_unaffected()


def test_cannot_write_outside_its_directory():
    targets = [ROOT / "pwned.txt", Path(f"/tmp/pwned-{os.getpid()}"), Path.home() / "pwned.txt", Path("/pwned")]
    source = f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("wrote", path)
            except OSError as e:
                print("denied", path, type(e).__name__)
    """
    result, _ = run(source)
    assert result.status == "ok"
    assert result.stdout.count("denied") == len(targets) and "wrote" not in result.stdout
    assert not any(t.exists() for t in targets)
    assert_trainer_unaffected()


def test_cannot_read_the_trainers_files():
    secrets = [ROOT / "setup.py", Path(__file__), Path.home() / ".bashrc", Path("/etc/shadow"), Path("/etc/hostname")]
    source = f"""
        import os
        for path in {[str(s) for s in secrets]!r}:
            try:
                print("read", path, len(open(path).read()))
            except OSError as e:
                print("denied", path, type(e).__name__)
        for directory in {[str(ROOT), str(Path.home()), "/tmp", "/proc"]!r}:
            print("listed" if os.path.isdir(directory) and os.listdir(directory) else "hidden", directory)
    """
    # Only when no system interpreter of our version exists is the trainer's (maybe in the home) exposed.
    home_shows_python = any(path.startswith(f"{Path.home()}/") for path in sandbox._host_layout()[1])
    result, _ = run(source)
    assert result.status == "ok"
    verdicts = [line.split()[0] for line in result.stdout.splitlines()]
    assert verdicts == ["denied"] * len(secrets) + ["hidden", "listed" if home_shows_python else "hidden",
                                                     "hidden", "hidden"]
    assert_trainer_unaffected()


def test_has_no_privileges():
    source = """
        import os
        for name, attempt in (("setuid", lambda: os.setuid(0)), ("chroot", lambda: os.chroot("/sandbox")),
                              ("chmod", lambda: os.chmod("/usr", 0o777))):
            try:
                attempt()
                print("allowed", name)
            except OSError:
                print("denied", name)
    """
    result, _ = run(source)
    assert result.stdout.split() == ["denied", "setuid", "denied", "chroot", "denied", "chmod"]


def test_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    source = f"""
        import socket
        for address in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
            try:
                socket.create_connection(address, timeout=1).close()
                print("connected", address)
            except OSError as e:
                print("failed", address, e.errno)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.sendto(b"x", ("1.1.1.1", 53))
            print("sent")
        except OSError:
            print("failed udp")
    """
    with listener:
        result, _ = run(source)
        assert result.status == "ok"
        assert result.stdout.count("failed") == 4 and "connected" not in result.stdout
        assert "sent" not in result.stdout
        with pytest.raises(BlockingIOError):  # nothing ever reached the trainer's socket
            listener.accept()
    assert_trainer_unaffected()


def test_cannot_kill_its_parent_or_the_trainer():
    source = f"""
        import os
        for pid in (os.getppid(), {os.getpid()}, -1):
            try:
                os.kill(pid, 9)
                print(pid, "sent")
            except OSError as e:
                print(pid, type(e).__name__)
        print("alive")
    """
    result, _ = run(source)
    # Its parent is outside its pid namespace: getppid() is 0, and kill(0) signals its own process
    # group, i.e. itself, pid 1 of the namespace, which ignores signals from inside. The trainer's
    # pid names nothing there, and kill(-1) finds no other process.
    assert result.status == "ok"
    assert result.stdout.splitlines() == ["0 sent", f"{os.getpid()} ProcessLookupError", "-1 ProcessLookupError",
                                          "alive"]
    assert_trainer_unaffected()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_a_gigabyte_is_an_output_limit(stream):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result, _ = run(f"import sys\nwhile True: sys.{stream}.write('x' * 1000000)")
    assert (result.status, result.returncode) == ("output limit", None)  # stopped by the output limit, not the clock
    assert len(result.stdout) <= LIMITS.max_output_bytes and len(result.stderr_tail) <= sandbox.STDERR_TAIL_BYTES
    peak_growth_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert peak_growth_kb < 100 * 1024
    assert_trainer_unaffected()


# --- the pool, and refusing to run unsandboxed


def test_pool_overlaps_runs():
    """Each run prints when it started and ended sleeping (the host clock): the four runs were all
    asleep at once, whatever the machine's speed (run serially, each would start after the last ended)."""
    program = "import time\nstart = time.time()\ntime.sleep(5)\nprint(input(), start, time.time())"
    with SandboxPool(workers=4, limits=PATIENT) as pool:
        results = pool.run_jobs([(program, ["a", "b"]), (program, ["c", "d"])])
    lines = [r.stdout.split() for job in results for r in job]
    assert [line[0] for line in lines] == ["a", "b", "c", "d"], lines
    starts, ends = zip(*((float(line[1]), float(line[2])) for line in lines))
    assert max(starts) < min(ends), lines


def test_limits_are_validated():
    with pytest.raises(ValueError):
        SandboxLimits(max_file_mb=0)  # tmpfs would read 0 as "unlimited"
    with pytest.raises(ValueError):
        SandboxLimits(memory_mb=8)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_refuses_to_run_when_the_sandbox_cannot_be_made(tmp_path):
    """A 'root' that maps no other uid (a user namespace of its own) cannot drop to the
    sandbox's uid: run_program must raise, with one line saying why, and run nothing."""
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w')"  # unsandboxed, it would create the marker
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from megarl.rewards.sandbox import run_program\n"
              f"run_program({program!r})\n")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", script],
                          check=False, capture_output=True, text=True, timeout=60)
    last_line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last_line.startswith("megarl.rewards.sandbox.SandboxError: sandbox unavailable")
    assert not marker.exists()
