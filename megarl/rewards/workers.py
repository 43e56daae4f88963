"""Reward calls in worker processes, each under a deadline (--reward-timeout).

Why processes: a Python thread cannot be killed, so a reward that never returns (a plugin that
sleeps for ever, C code that never yields) would hold a thread, and the step, for ever. A worker
process can be killed. `RewardProcessPool` keeps `workers` of them; `submit(response, row)` scores
one sample in the next free one and returns a Future that is always resolved within `timeout`
plus a grace (KILL_GRACE_S) of the worker taking the call:
  - the call returns             -> its outputs (a reward that raises: 0, "error: ...", as ever);
  - it overruns `timeout`        -> the worker's process group is SIGKILLed and a new worker started;
                                    the sample scores 0 with reason TIMEOUT_REASON ("timeout: ...");
  - the worker dies during it    -> (os._exit, a segfault, the OOM killer) a new worker is started;
                                    0 with reason "error: reward worker died (exit code N)".
One call is one sample, so a slow sample holds one worker while the others go on.

What a worker runs: the reward's parts by name (`--reward boxed:1.0,code:0.5` -> "boxed", "code"),
rebuilt in the worker from the registry after importing the run's plugin files again
(`--external-plugins`), so the worker is a fresh interpreter (`python -c`, not a fork of the
multi-threaded trainer: vLLM, gloo and torch threads may hold locks a fork would copy locked).
A plugin therefore runs in the worker, with the worker's module state, not the trainer's.
The reward model (`rm`) stays in the trainer: it holds a torch model (and a GPU) that a worker
would have to load again; `megarl.rewards.scoring` scores it in-process, beside the workers.

Lifetime: workers start with the pool (in parallel; about a second each, the imports), exit when
the pool closes or the trainer's end of their pipe closes (the trainer died), and ask the kernel
for SIGKILL when the trainer dies in the middle of a call (PR_SET_PDEATHSIG). Each runs in its
own session and is killed with its process group, so what a reward started dies with it (sandbox
runs die with their launcher, which has its own PDEATHSIG).
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from megarl.rewards import SCORER_TIMEOUT, RewardOutput, swift_rules

KILL_GRACE_S = 5.0
"""How long killing an overrunning worker may take before the pool gives up waiting for it."""
START_TIMEOUT_S = 120.0
"""How long a new worker may take to import megarl, the rewards and the plugins."""
TIMEOUT_MARK = f"{SCORER_TIMEOUT}reward call"
"""The start of TIMEOUT_REASON (a SCORER_TIMEOUT reason, counted in reward_timeouts)."""
_ROOT = str(Path(__file__).resolve().parents[2])
_WORKER_MAIN = f"import sys; sys.path.insert(0, {_ROOT!r}); from megarl.rewards.workers import _serve; _serve()"


def timeout_reason(seconds: float) -> str:
    return f"{TIMEOUT_MARK} over {seconds:g} s"


class RewardWorkerError(RuntimeError):
    """A worker could not be started (its plugins fail to import, ...): a setup error, not a sample's."""


class _Worker:
    """One worker process and the two pipe ends the trainer talks to it through."""

    def __init__(self, setup: dict):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(to_child_r), str(from_child_w)],
                                         pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.send_conn, self.recv_conn = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
        self.send_conn.send({**setup, "parent": os.getpid()})

    def wait_ready(self) -> None:
        reply = self._receive(START_TIMEOUT_S)
        if reply != "ready":
            self.kill()
            why = "did not start in time" if reply is None else f"failed to start: {reply}"
            raise RewardWorkerError(f"reward worker process {why}")

    def _receive(self, timeout: float):
        """The next message; None after `timeout` seconds; EOFError if the worker died."""
        if not self.recv_conn.poll(timeout):
            return None
        return self.recv_conn.recv()

    def call(self, response: str, row: dict, timeout: float) -> list[RewardOutput]:
        """Score one sample; raises _Overran or _Died, after which this worker is dead."""
        try:
            self.send_conn.send((response, row))
            reply = self._receive(timeout)
        except (EOFError, OSError):
            self.kill()
            raise _Died(self.proc.returncode) from None
        if reply is None:
            self.kill()
            raise _Overran()
        return [RewardOutput(score, reason) for score, reason in reply]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group is its pid
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:  # uninterruptible sleep (D state): leave it to the kernel
            pass
        for conn in (self.send_conn, self.recv_conn):
            conn.close()


class _Overran(Exception):
    pass


class _Died(Exception):
    def __init__(self, returncode):
        super().__init__(returncode)
        self.returncode = returncode


class RewardProcessPool:
    """`workers` reward worker processes scoring the named reward `parts` under `timeout` seconds a call.

    parts: the registered reward names the workers score, each sample getting one RewardOutput per
           part (the caller combines them; see megarl.rewards.scoring).
    plugins: plugin files the workers import first (those the trainer imported, in order).
    sys_path: the workers' sys.path (default: the trainer's).
    sandbox_memory_budget_mb: this pool's share of the sandbox memory budget, split between its
           workers (megarl.rewards.code.configure_pool), or None for the code reward's default.
    """

    def __init__(self, parts: list[str], workers: int, timeout: float, plugins: list[str] = (),
                 sys_path: list[str] | None = None, sandbox_memory_budget_mb: int | None = None):
        if workers < 1 or timeout <= 0:
            raise ValueError(f"a reward process pool needs workers >= 1 and timeout > 0, got {workers}, {timeout}")
        self.parts, self.timeout = list(parts), float(timeout)
        budget = None if sandbox_memory_budget_mb is None else sandbox_memory_budget_mb // workers
        self.setup = {"parts": self.parts, "plugins": list(plugins), "sys_path": list(sys_path or sys.path),
                      "sandbox_memory_budget_mb": budget, "swift_rules": swift_rules.current_settings()}
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.replaced = 0  # workers killed or dead and started again
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._broken: BaseException | None = None  # a worker could not be replaced: every call fails
        try:
            self.workers = [_Worker(self.setup) for _ in range(workers)]  # start together, then wait
            for worker in self.workers:
                worker.wait_ready()
        except BaseException:
            self.close()
            raise
        self.threads = [threading.Thread(target=self._dispatch, args=(i,), name=f"megarl-reward-proc{i}",
                                         daemon=True) for i in range(workers)]
        for thread in self.threads:
            thread.start()
        _POOLS.add(self)

    def submit(self, response: str, row: dict) -> Future:
        """A Future of one RewardOutput per part for this sample (never raises for the sample's sake)."""
        future = Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if self._closed:
                raise RuntimeError("the reward process pool is closed")
            self.tasks.put((future, response, row))
        return future

    def _dispatch(self, index: int) -> None:
        """Thread `index`: feed worker `index` one task at a time; replace it when it overran or died."""
        while True:
            task = self.tasks.get()
            if task is None:
                return
            future, response, row = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self.workers[index].proc.poll() is not None:  # it died while idle: not this sample's doing
                    self.workers[index].kill()
                    self._replace(index)
                worker = self.workers[index]
                try:
                    outputs = worker.call(response, row, self.timeout)
                except _Overran:
                    outputs = [RewardOutput(0.0, timeout_reason(self.timeout)) for _ in self.parts]
                    future.set_result(outputs)  # before the replacement starts: the sample is done
                    self._replace(index)
                    continue
                except _Died as died:
                    outputs = [RewardOutput(0.0, f"error: reward worker died (exit code {died.returncode})")
                               for _ in self.parts]
                    future.set_result(outputs)
                    self._replace(index)
                    continue
                future.set_result(outputs)
            except BaseException as error:  # noqa: BLE001 - a replacement that cannot start: the caller raises
                if not future.done():
                    future.set_exception(error)
                self._fail_pending(error)
                return

    def _replace(self, index: int) -> None:
        with self._lock:
            if self._closed:
                return
            self.replaced += 1
            worker = _Worker(self.setup)
            self.workers[index] = worker
        worker.wait_ready()

    def _fail_pending(self, error: BaseException) -> None:
        """A worker could not be replaced: the pool is broken (submit raises), and what is queued fails
        rather than wait for ever."""
        with self._lock:
            self._broken = error
            stops = 0
            while True:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    break
                if task is None:
                    stops += 1
                elif task[0].set_running_or_notify_cancel():
                    task[0].set_exception(error)
            for _ in range(stops):
                self.tasks.put(None)

    def close(self) -> None:
        """Stop the dispatch threads and kill every worker (a call in flight is abandoned)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in getattr(self, "threads", []):
            self.tasks.put(None)
        for worker in self.workers:
            worker.kill()
        _POOLS.discard(self)

    def pids(self) -> list[int]:
        return [worker.proc.pid for worker in self.workers]


_POOLS: set[RewardProcessPool] = set()


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS):
        pool.close()


# ------------------------------------------------------------ the worker ----

def _die_with_parent(parent: int) -> None:
    """SIGKILL when the trainer dies (PR_SET_PDEATHSIG); exit at once if it already has."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _serve() -> None:
    """A worker's main loop (its main thread, so the math reward's SIGALRM timer works)."""
    recv_conn = Connection(int(sys.argv[1]), writable=False)
    send_conn = Connection(int(sys.argv[2]), readable=False)
    setup = recv_conn.recv()
    _die_with_parent(setup["parent"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer; it stops us
    try:
        sys.path[:] = setup["sys_path"]
        from megarl.plugins import load_plugins
        from megarl.rewards import get_reward, score_all

        load_plugins(setup["plugins"])
        specs = [get_reward(name) for name in setup["parts"]]
        from megarl.rewards import swift_rules

        swift_rules.configure(**setup["swift_rules"])  # the trainer's --cosine-* / --repetition-* settings
        if setup["sandbox_memory_budget_mb"] is not None:
            from megarl.rewards import code

            code.configure_pool(memory_budget_mb=setup["sandbox_memory_budget_mb"])
    except BaseException as error:  # noqa: BLE001 - reported to the trainer, which raises it
        send_conn.send(f"{type(error).__name__}: {error}")
        return
    send_conn.send("ready")
    while True:
        try:
            task = recv_conn.recv()
        except EOFError:  # the trainer closed the pool, or died
            return
        response, row = task
        outputs = [score_all(spec, [response], [row])[0] for spec in specs]
        send_conn.send([(float(out.score), out.reason) for out in outputs])

