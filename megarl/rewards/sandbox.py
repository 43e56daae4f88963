"""Run untrusted Python programs (model-written code) in a Linux sandbox.

Why: the `code` reward executes whatever the policy wrote, thousands of times per
run. A program that loops, forks, allocates 10 GiB, prints forever, reads the
checkout, opens sockets or kills its parent must cost one failed test case and
nothing else.

Mechanism (one run = one launcher process; see `_launcher_main`, `_isolate`):
  1. The trainer writes the program and its stdin to a fresh host directory
     (`tmp_root`, default the system temp dir) and starts a launcher: a separate
     interpreter (`python -I -S -c <the _LAUNCHER_PARTS source>`), so nothing
     forks inside the multi-threaded trainer.
  2. The launcher reads the program and opens stdin with the trainer's rights.
  3. It builds the program's filesystem in a new mount namespace: a tmpfs root
     holding read-only bind mounts of /usr, /lib*, /bin (or their usr-merge
     symlinks), the interpreter's installation, /etc/ld.so.cache and
     /dev/{null,zero,random,urandom}; /program.py; and /sandbox, a writable
     tmpfs of `max_file_mb` (cwd, HOME and TMPDIR). It pivot_root()s into it and
     detaches the host's root: /work, /root, /home, the host's /tmp, /proc and
     /sys do not exist for the program; all but /sandbox is read-only.
  4. It enters new user, network, pid, ipc and uts namespaces; its uid/gid are
     mapped to 1000 inside, nothing else is mapped. The network namespace has no
     interface up, not even loopback: every connect() fails. The pid namespace
     hides every host process: the trainer's pid names nothing, getppid() is 0.
     A root trainer does 3 as root, then drops to uid/gid SANDBOX_UID (nobody;
     root is exempt from RLIMIT_NPROC) before 4, so the mount namespace belongs
     to the host's user namespace and the program can change no mount at all.
     Any other user does 4 (with the mount namespace) before 3.
  5. It forks the program as pid 1 of the new pid namespace (when it exits or
     is killed, the kernel kills every process it started), in its own session,
     with PR_SET_PDEATHSIG=SIGKILL (killing the launcher kills it), rlimits
     (CPU, AS, NPROC, FSIZE, NOFILE, core 0) and no_new_privs, and execs
     `python -I -S -B`. Being uid 1000 with no root mapped, exec leaves it no
     capability: it can mount, chroot, setuid nothing. RLIMIT_NPROC counts per
     user namespace, so concurrent runs under one uid do not share the count.
  6. The trainer reads stdout and stderr on a budget (`max_output_bytes` each:
     past it, the launcher is killed and the run is "output limit", so printing
     1 GB costs the trainer that much memory at most), kills the launcher at
     `wall_seconds`, and removes the host directory; the /sandbox tmpfs died
     with the mount namespace.

Interpreter: the system's /usr/bin/pythonX.Y when it has the trainer's X.Y
(nothing outside the system directories is exposed then), else the trainer's
base interpreter and its installation directory. It runs without site (-S):
the standard library only; `exit` and `quit` are defined for the program.

Statuses: "ok" (exit 0), "timeout" (wall clock, or RLIMIT_CPU: the kernel's
SIGKILL at the limit, as pid 1 ignores SIGXCPU), "memory limit" (non-zero exit
with MemoryError in stderr: RLIMIT_AS makes allocations fail), "output limit",
"runtime error" (any other non-zero exit or signal). A SIGKILL from the kernel's
OOM killer (a host out of memory, not this run's limit) would read "timeout":
nothing but the kernel can SIGKILL pid 1 of the run's namespace, and the two are
not told apart.

Needs: Linux (x86_64 or aarch64) where an unprivileged user may create user
namespaces (no kernel.unprivileged_userns_clone=0, no AppArmor restriction),
with mount, pid and network namespaces. When any step fails, `run_program`
raises SandboxError with the failing call in one line: it never runs code
unsandboxed.

Not protected against: kernel exploits (no seccomp filter, and user namespaces
widen the reachable syscall surface). Memory is limited per process
(RLIMIT_AS): a run may hold max_processes * memory_mb plus its tmpfs at once
(no cgroup; `SandboxLimits.run_memory_mb`). A pool's total is bounded by running
at most memory_budget_mb // run_memory_mb runs at once (`pool_concurrency`). CPU time is per process too; the wall clock bounds the rest.
Threads count as processes. The program can read the exposed system
directories, which hold nothing of the trainer's.

Cost: two interpreter start-ups per run (launcher, program) plus ~2 ms of
namespace and mount set-up: a no-op program takes 44-65 ms against 10-15 ms for
a bare `python -I -S -c pass` (2-core VM, under load); `SandboxPool` overlaps
runs.
"""

from __future__ import annotations

import inspect
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Self

SANDBOX_UID = 65534  # nobody/nogroup: the host ids a root trainer's runs use
INSIDE_UID = 1000  # the program's uid (and gid) inside its user namespace
STDERR_TAIL_BYTES = 4096
KILL_GRACE_SECONDS = 5.0  # after killing, how long the pipes may take to close
_PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41}  # glibc has no pivot_root()
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin")
_SYSTEM_FILES = ("/etc/ld.so.cache",)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
# Runs the program as __main__ without site: exit/quit come from site, so define them.
_BOOTSTRAP = (
    "import builtins as _b, sys as _s\n"
    "_b.exit = _b.quit = _s.exit\n"
    "_s.argv = ['/program.py']\n"
    "__file__ = '/program.py'\n"
    "exec(compile(open(__file__, 'rb').read(), __file__, 'exec'))\n"
)


class SandboxError(RuntimeError):
    """The sandbox could not be set up (the program did not run)."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5  # RLIMIT_CPU of each process
    wall_seconds: float = 10.0  # from launch to kill, start-up included
    memory_mb: int = 512  # RLIMIT_AS of each process
    max_processes: int = 8  # RLIMIT_NPROC: processes and threads, the program included
    max_file_mb: int = 16  # RLIMIT_FSIZE, and the size of the /sandbox tmpfs
    max_output_bytes: int = 4 << 20  # per stream (stdout, stderr)

    def __post_init__(self):
        # 0 would mean "no limit" to tmpfs (max_file_mb); the interpreter needs ~16 MB of address space.
        if min(self.cpu_seconds, self.wall_seconds, self.max_processes, self.max_file_mb,
               self.max_output_bytes) <= 0 or self.memory_mb < 32:
            raise ValueError(f"sandbox limits must be positive, memory_mb >= 32: {self}")

    @property
    def run_memory_mb(self) -> int:
        """The most memory one run may hold: each of its processes its RLIMIT_AS, plus its /sandbox
        tmpfs and the trainer's copy of its output (no cgroup bounds the run as a whole)."""
        return self.max_processes * self.memory_mb + self.max_file_mb + -(-2 * self.max_output_bytes // (1 << 20))


@dataclass
class RunResult:
    status: str  # ok | timeout | memory limit | output limit | runtime error
    stdout: str
    stderr_tail: str  # the last STDERR_TAIL_BYTES of stderr
    returncode: int | None  # exit code, -signal, or None when the trainer killed it
    seconds: float  # wall clock, sandbox start-up included


# ---------------------------------------------------------------------------
# The launcher. These definitions run in a fresh `python -I -S` interpreter
# (their source is sent with -c): they import what they use themselves and
# touch no other module global.


class _Linux:
    """Constants from <sched.h>, <sys/mount.h>, <sys/prctl.h>, <sys/syscall.h>."""

    CLONE_NEWNS = 0x00020000
    CLONE_NEWUTS = 0x04000000
    CLONE_NEWIPC = 0x08000000
    CLONE_NEWUSER = 0x10000000
    CLONE_NEWPID = 0x20000000
    CLONE_NEWNET = 0x40000000
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 32, 1024, 2048
    MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
    MNT_DETACH = 2
    PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
    PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def _call(libc, name, *args):
    """libc.name(*args) (str arguments as bytes); OSError naming the call when it fails."""
    import ctypes
    import os

    raw = [a.encode() if isinstance(a, str) else a for a in args]
    if getattr(libc, name)(*raw) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{tuple(args)}: {os.strerror(errno)}")


def _drop_root(uid):
    """As root, become uid/gid `uid`: RLIMIT_NPROC does not apply to root."""
    import os

    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        raise OSError(e.errno, f"cannot drop root to uid {uid}: {e.strerror}") from None


def _enter_user_namespace(libc, proc_fd, inside_id, more_flags):
    """A new user namespace (plus `more_flags` ones) where our uid and gid are inside_id.
    proc_fd: /proc/self, opened before the host's /proc may have left our root."""
    import os

    uid, gid = os.geteuid(), os.getegid()
    # A uid change made us non-dumpable, which makes /proc/self root's: unwritable to us.
    _call(libc, "prctl", _Linux.PR_SET_DUMPABLE, 1, 0, 0, 0)
    _call(libc, "unshare", _Linux.CLONE_NEWUSER | more_flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inside_id} {uid} 1"),
                       ("gid_map", f"{inside_id} {gid} 1")):
        fd = os.open(name, os.O_WRONLY, dir_fd=proc_fd)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _bind(libc, path, target):
    """Bind the host's `path` on target, read-only unless it is a device."""
    import os

    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _call(libc, "mount", path, target, None, _Linux.MS_BIND | _Linux.MS_REC, None)
    if path.startswith("/dev/"):
        return
    # In a user namespace a remount must keep the flags the host mount has (they are locked).
    host = os.statvfs(target).f_flag
    kept = host & (_Linux.MS_NOSUID | _Linux.MS_NODEV | _Linux.MS_NOEXEC | _Linux.MS_NOATIME
                   | _Linux.MS_NODIRATIME)
    kept |= _Linux.MS_RELATIME if host & os.ST_RELATIME else 0
    flags = _Linux.MS_REMOUNT | _Linux.MS_BIND | _Linux.MS_RDONLY | kept
    _call(libc, "mount", None, target, None, flags, None)


def _build_root(libc, root, binds, symlinks, program, workdir_options, pivot_root_nr):
    """Make the program's filesystem on a tmpfs at `root` (the exposed host paths,
    the program, the writable /sandbox), pivot into it and drop the host's root."""
    import os

    _call(libc, "mount", None, "/", None, _Linux.MS_REC | _Linux.MS_PRIVATE, None)
    safe = _Linux.MS_NOSUID | _Linux.MS_NODEV
    _call(libc, "mount", "tmpfs", root, "tmpfs", safe, f"size={len(program) + (1 << 20)},mode=755")
    for path in binds:
        _bind(libc, path, root + path)
    for path, target in symlinks.items():
        os.symlink(target, root + path)
    with open(root + "/program.py", "wb") as f:
        f.write(program)
    os.mkdir(root + "/sandbox")
    _call(libc, "mount", "tmpfs", root + "/sandbox", "tmpfs", safe, workdir_options)
    _call(libc, "mount", None, root, None, _Linux.MS_REMOUNT | _Linux.MS_BIND | _Linux.MS_RDONLY | safe, None)
    os.chdir(root)
    _call(libc, "syscall", pivot_root_nr, b".", b".")
    _call(libc, "umount2", ".", _Linux.MNT_DETACH)
    os.chdir("/")


def _isolate(libc, opts, program):
    """Namespaces, the new root, and (for root) the drop to opts["uid"]."""
    import os

    proc_fd = os.open("/proc/self", os.O_PATH | os.O_DIRECTORY)
    binds = opts["binds"].split(":")
    symlinks = dict(item.split(">", 1) for item in opts["symlinks"].split(":") if item)
    inside, others = int(opts["inside_id"]), (_Linux.CLONE_NEWNET | _Linux.CLONE_NEWPID
                                              | _Linux.CLONE_NEWIPC | _Linux.CLONE_NEWUTS)
    workdir = f"size={int(opts['max_file_mb']) << 20},nr_inodes=4096,mode=755"
    pivot = int(opts["pivot_root_nr"])
    if os.geteuid() == 0:
        # Root builds the root in a mount namespace of the host's user namespace,
        # where the program, in its own user namespace, can change no mount at all.
        uid = int(opts["uid"])
        _call(libc, "unshare", _Linux.CLONE_NEWNS)
        _build_root(libc, opts["run_dir"], binds, symlinks, program, f"{workdir},uid={uid},gid={uid}", pivot)
        _drop_root(uid)
        _enter_user_namespace(libc, proc_fd, inside, others)
    else:
        _enter_user_namespace(libc, proc_fd, inside, others | _Linux.CLONE_NEWNS)
        _build_root(libc, opts["run_dir"], binds, symlinks, program, workdir, pivot)
    os.close(proc_fd)


def _exec_program(libc, opts, stdin_fd, alive_fd):
    """In the forked child (pid 1 of the new pid namespace): limits, then exec Python."""
    import os
    import resource
    import signal

    os.setsid()
    _call(libc, "prctl", _Linux.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.set_blocking(alive_fd, False)
    try:
        if os.read(alive_fd, 1) == b"":  # the launcher died before PDEATHSIG was set
            os._exit(1)
    except BlockingIOError:
        pass
    os.dup2(stdin_fd, 0)
    os.chdir("/sandbox")
    mb = 1 << 20
    for limit, value in ((resource.RLIMIT_CPU, int(opts["cpu"])), (resource.RLIMIT_AS, int(opts["memory_mb"]) * mb),
                         # The launcher, still alive, counts as one of our user's processes.
                         (resource.RLIMIT_NPROC, int(opts["max_processes"]) + 1),
                         (resource.RLIMIT_FSIZE, int(opts["max_file_mb"]) * mb),
                         (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    _call(libc, "prctl", _Linux.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _call(libc, "prctl", _Linux.PR_CAP_AMBIENT, _Linux.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}
    python = opts["python"]
    os.execve(python, [python, "-I", "-S", "-B", "-c", opts["bootstrap"]], env)


def _start_program(libc, opts, stdin_fd, status_fd):
    """Fork the program; returns its pid (in the launcher's pid namespace)."""
    import os

    alive_r, alive_w = os.pipe()  # the child sees EOF on alive_r once the launcher is gone
    pid = os.fork()
    if pid:
        os.close(alive_r)
        os.close(stdin_fd)
        return pid
    try:
        os.close(alive_w)
        _exec_program(libc, opts, stdin_fd, alive_r)
    except BaseException as e:  # noqa: BLE001 - the child must never return into the launcher
        os.write(status_fd, f"error exec: {e}\n".encode())
    os._exit(127)


def _launcher_main():
    """argv: key=value options (see _launcher_argv). Reports on the status fd one
    line: "exit <code or -signal>" or "error <what failed>"."""
    import ctypes
    import os
    import signal
    import sys

    opts = dict(arg.split("=", 1) for arg in sys.argv[1:])
    status_fd = int(opts["status_fd"])
    os.set_inheritable(status_fd, False)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        with open(opts["run_dir"] + "/program.py", "rb") as f:
            program = f.read()
        stdin_fd = os.open(opts["run_dir"] + "/stdin", os.O_RDONLY)
        _isolate(libc, opts, program)
        # Set last: every credential change above resets it.
        _call(libc, "prctl", _Linux.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
        pid = _start_program(libc, opts, stdin_fd, status_fd)
    except OSError as e:
        os.write(status_fd, f"error {e}\n".encode())
        os._exit(1)
    _, wait_status = os.waitpid(pid, 0)
    os.write(status_fd, f"exit {os.waitstatus_to_exitcode(wait_status)}\n".encode())


_LAUNCHER_PARTS = (_Linux, _call, _drop_root, _enter_user_namespace, _bind, _build_root, _isolate,
                   _exec_program, _start_program, _launcher_main)


# ---------------------------------------------------------------------------
# The trainer's side.


@lru_cache(maxsize=1)
def _launcher_source() -> str:
    return "\n\n".join(inspect.getsource(part) for part in _LAUNCHER_PARTS) + "\n_launcher_main()\n"


def _under(path: str, dirs) -> bool:
    return any(path == d or path.startswith(d + "/") for d in dirs)


def _interpreter() -> tuple[str, str]:
    """(python, its installation directory) for the programs: the system's /usr/bin/pythonX.Y
    of the trainer's version when there is one (then no directory outside the system's is
    exposed), else the trainer's own base interpreter (a venv's is not self-contained)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if os.path.isfile(f"/usr/bin/{version}") and os.path.isdir(f"/usr/lib/{version}"):
        return os.path.realpath(f"/usr/bin/{version}"), "/usr"
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable)), os.path.realpath(sys.base_prefix)


@lru_cache(maxsize=1)
def _host_layout() -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(python, paths to bind, (path, symlink target) pairs) for the sandbox's root."""
    binds, symlinks = [], []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            symlinks.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append(path)
    python, prefix = _interpreter()
    if not _under(prefix, binds):
        binds.append(prefix)
    if not _under(python, binds):
        raise SandboxError(f"sandbox: the interpreter {python} is outside the exposed {binds}")
    binds += [p for p in _SYSTEM_FILES + _DEVICES if os.path.exists(p)]
    if any(":" in p or ">" in p for p in binds + [t for _, t in symlinks]):
        raise SandboxError(f"sandbox: a path to expose contains ':' or '>': {binds} {symlinks}")
    return python, tuple(binds), tuple(symlinks)


def _launcher_argv(run_dir: str, status_fd: int, limits: SandboxLimits) -> list[str]:
    python, binds, symlinks = _host_layout()
    machine = os.uname().machine
    if machine not in _PIVOT_ROOT_SYSCALL:
        raise SandboxError(f"sandbox: unsupported machine {machine!r} (x86_64, aarch64)")
    opts = {
        "status_fd": status_fd, "run_dir": run_dir, "uid": SANDBOX_UID, "inside_id": INSIDE_UID,
        "python": python, "binds": ":".join(binds), "symlinks": ":".join(f"{p}>{t}" for p, t in symlinks),
        "cpu": limits.cpu_seconds, "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
        "max_file_mb": limits.max_file_mb, "bootstrap": _BOOTSTRAP, "pivot_root_nr": _PIVOT_ROOT_SYSCALL[machine],
    }
    return [python, "-I", "-S", "-c", _launcher_source()] + [f"{k}={v}" for k, v in opts.items()]


class _Capture:
    """Reads the launcher's stdout, stderr and status pipes: stdout's first
    max_bytes, stderr's last STDERR_TAIL_BYTES, the whole status report."""

    def __init__(self, proc: subprocess.Popen, status_fd: int, max_bytes: int):
        self.stdout, self.stderr, self.status = bytearray(), bytearray(), bytearray()
        self.max_bytes = max_bytes
        self.streams = {proc.stdout.fileno(): self.stdout, proc.stderr.fileno(): self.stderr,
                        status_fd: self.status}
        self.totals = dict.fromkeys(self.streams, 0)
        self.selector = selectors.DefaultSelector()
        for fd in self.streams:
            self.selector.register(fd, selectors.EVENT_READ)

    def open(self) -> bool:
        return bool(self.selector.get_map())

    def read(self, timeout: float) -> bool:
        """Read what is ready; False once stdout or stderr went past max_bytes."""
        within = True
        for key, _ in self.selector.select(max(timeout, 0.0)):
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                self.selector.unregister(key.fd)
                continue
            buffer = self.streams[key.fd]
            buffer += chunk
            self.totals[key.fd] += len(chunk)
            if buffer is self.stdout:
                del buffer[self.max_bytes:]
            elif buffer is self.stderr:
                del buffer[:-STDERR_TAIL_BYTES]
            within = within and (buffer is self.status or self.totals[key.fd] <= self.max_bytes)
        return within

    def close(self) -> None:
        self.selector.close()


def _kill(proc: subprocess.Popen) -> None:
    """Kill the launcher; PR_SET_PDEATHSIG then kills the program, pid 1 of its
    namespace, and with it the kernel kills every process left there."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


def _collect(capture: _Capture, proc: subprocess.Popen, limits: SandboxLimits) -> str | None:
    """Read until every pipe closed; "timeout" or "output limit" when we killed the run."""
    deadline = time.monotonic() + limits.wall_seconds
    killed = None
    while capture.open():
        left = deadline - time.monotonic()
        if left > 0:
            if capture.read(left) or killed:  # once killed, read on (and discard) until the pipes close
                continue
        elif killed:
            raise SandboxError(f"sandbox: the program outlived its launcher by {KILL_GRACE_SECONDS} s; "
                               "its processes may still run")
        killed = "output limit" if left > 0 else "timeout"
        _kill(proc)
        deadline = time.monotonic() + KILL_GRACE_SECONDS  # for the pipes to close
    return killed


def _launch(run_dir: str, limits: SandboxLimits) -> tuple[_Capture, str | None]:
    """Start the launcher on run_dir; (what it captured, why we killed it or None)."""
    status_r, status_w = os.pipe()
    try:
        proc = subprocess.Popen(_launcher_argv(run_dir, status_w, limits), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                                start_new_session=True)
    finally:
        os.close(status_w)
    with proc:
        capture = _Capture(proc, status_r, limits.max_output_bytes)
        try:
            return capture, _collect(capture, proc, limits)
        finally:
            capture.close()
            os.close(status_r)
            _kill(proc)


def _status(killed: str | None, returncode: int | None, stderr: str) -> str:
    if killed:
        return killed
    if returncode == 0:
        return "ok"
    if returncode in (-signal.SIGKILL, -signal.SIGXCPU):  # RLIMIT_CPU: only the kernel can kill pid 1
        return "timeout"
    return "memory limit" if "MemoryError" in stderr else "runtime error"


def run_program(source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
                tmp_root: str | None = None) -> RunResult:
    """Run `source` as a Python 3 program on `stdin`, sandboxed (see the module docstring).

    tmp_root: where the run's host directory (program + stdin) is made, then removed.
    Raises SandboxError when the sandbox cannot be set up: the program did not run.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="megarl-sandbox-", dir=tmp_root) as run_dir:
        for name, text in (("program.py", source), ("stdin", stdin)):
            with open(os.path.join(run_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
        capture, killed = _launch(run_dir, limits)
    report = capture.status.decode(errors="replace").split()
    stderr = capture.stderr.decode(errors="replace")
    if report[:1] == ["error"]:
        raise SandboxError(f"sandbox unavailable: {' '.join(report[1:])}; it needs Linux user, mount, pid and "
                           "network namespaces (see megarl/rewards/sandbox.py) and will not run code without them")
    if report[:1] != ["exit"] and not killed:
        raise SandboxError(f"sandbox: the launcher died without a report; its stderr: {stderr[-500:]}")
    returncode = None if killed else int(report[1])
    return RunResult(_status(killed, returncode, stderr), capture.stdout.decode(errors="replace"), stderr,
                     returncode, time.monotonic() - start)


def probe(limits: SandboxLimits = SandboxLimits(), tmp_root: str | None = None) -> None:
    """Run a one-line program in a real sandbox: SandboxError (one line) unless it printed what it should.
    A run with a code reward calls it at start-up, so a host without user namespaces stops the run
    there instead of scoring every program 0."""
    result = run_program("print(6 * 7)", "", limits, tmp_root)
    if (result.status, result.stdout) != ("ok", "42\n"):
        tail = result.stderr_tail.strip().splitlines()[-1:] or [""]
        raise SandboxError(f"sandbox probe: a one-line program ended {result.status!r} "
                           f"(exit {result.returncode}) instead of printing 42: {tail[0][:200]}")


def pool_concurrency(limits: SandboxLimits, workers: int | None = None, memory_budget_mb: int | None = None) -> int:
    """How many runs a pool overlaps: `workers` (default os.cpu_count()), fewer when `memory_budget_mb`
    is set: at most budget // limits.run_memory_mb, so the runs together stay within the budget.
    ValueError when the budget is below one run's bound."""
    concurrency = workers or os.cpu_count() or 1
    if memory_budget_mb is not None:
        fits = memory_budget_mb // limits.run_memory_mb
        if fits < 1:
            raise ValueError(f"sandbox memory budget {memory_budget_mb} MB is below one run's bound of "
                             f"{limits.run_memory_mb} MB ({limits.max_processes} processes x {limits.memory_mb} "
                             f"MB + {limits.max_file_mb} MB tmpfs + output)")
        concurrency = min(concurrency, fits)
    return concurrency


class SandboxPool:
    """Runs sandboxed programs on `concurrency` threads (`pool_concurrency`: `workers`, default
    os.cpu_count(), fewer when `memory_budget_mb` bounds the runs' memory together); each run is its
    own sandbox process, so a batch's runs overlap (the threads only wait on pipes)."""

    def __init__(self, workers: int | None = None, limits: SandboxLimits = SandboxLimits(),
                 tmp_root: str | None = None, memory_budget_mb: int | None = None):
        self.limits = limits
        self.tmp_root = tmp_root
        self.concurrency = pool_concurrency(limits, workers, memory_budget_mb)
        self.executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="sandbox")

    def submit(self, source: str, stdin: str = "") -> Future:
        """A Future of run_program(source, stdin)'s RunResult."""
        return self.executor.submit(run_program, source, stdin, self.limits, self.tmp_root)

    def run_jobs(self, jobs: list[tuple[str, list[str]]]) -> list[list[RunResult]]:
        """For each (program, stdins) job, its RunResults in order; all runs overlap."""
        futures = [[self.submit(source, stdin) for stdin in stdins] for source, stdins in jobs]
        return [[f.result() for f in job] for job in futures]

    def close(self) -> None:
        self.executor.shutdown(cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
