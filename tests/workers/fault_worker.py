"""torchrun worker: megarl/train.py with one fault injected from outside megarl's code.

MEGARL_FAULT=POINT:STEP:RANK  SIGKILLs launch rank RANK at POINT of step STEP (1-based; for save,
                              save_publish and eval: after STEP completed steps). Points (FAULT_POINTS):

  generate          entering the rollout engine's generate call
  reward            scoring a group of samples (OverlappedScoring)
  old_logprobs      the separate old-logprob forward pass (needs --no-on-policy-shortcut)
  advantages        entering phases.compute_advantages
  backward          Megatron's backward_step, first micro-batch
  optimizer         the optimizer's step
  metric_allreduce  the update's metric all-reduce over data-parallel ranks (reduce_over_data_parallel)
  sync              the weight sync, mid-stream: after the first tensor left the trainer (a rank with a
                    policy) or reached the engine (a rollout-only rank)
  eval              entering evaluation.evaluate
  preempt_check     the post-step all-gather of preemption flags
  save              checkpoint save, after this rank's Megatron shards are written, before the meeting
  save_publish      checkpoint save, on rank 0 only, after every part is on disk and before state.json
                    and the rename that publishes it

MEGARL_FAULT_FSIZE=BYTES      RLIMIT_FSIZE on every rank (a full disk: writes past BYTES fail with EFBIG),
                              set just before the first checkpoint save after MEGARL_FAULT_FSIZE_AFTER
                              completed steps (default 1), so that earlier checkpoints are whole.
MEGARL_FAULT_LOG=PATH         the killed rank appends "<time> <point> <step> <rank>" here just before dying.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import os  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from megarl import actor, checkpoint, evaluation, model_runner, phases, preemption, rollout, train  # noqa: E402
from megarl.rewards import scoring  # noqa: E402

FAULT_POINTS = ("generate", "reward", "old_logprobs", "advantages", "backward", "optimizer", "metric_allreduce",
                "sync", "eval", "preempt_check", "save", "save_publish")
RANK = int(os.environ["RANK"])  # read now: a rollout engine rewrites RANK to its role rank
_fault = os.environ.get("MEGARL_FAULT")
POINT, STEP, KILL_RANK = (None, None, None)
if _fault:
    POINT, STEP, KILL_RANK = _fault.split(":")
    STEP, KILL_RANK = int(STEP), int(KILL_RANK)
    if POINT not in FAULT_POINTS:
        raise SystemExit(f"MEGARL_FAULT: unknown point {POINT!r}; one of {', '.join(FAULT_POINTS)}")
current = {"step": None}  # the 1-based step being run (set as generation starts)


def maybe_die(point: str, step: int | None = None) -> None:
    step = current["step"] if step is None else step
    if point != POINT or step != STEP or RANK != KILL_RANK:
        return
    if os.environ.get("MEGARL_FAULT_LOG"):
        with open(os.environ["MEGARL_FAULT_LOG"], "a") as f:
            f.write(f"{time.time():.3f} {point} {step} {RANK}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner, name, before=None, make=None):
    """Replace owner.name: call before(*args) first, or use make(original) as the replacement."""
    original = getattr(owner, name)
    if make is not None:
        setattr(owner, name, make(original))
        return

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def _generate(original):
    def generate(run, step, *args, **kwargs):
        current["step"] = step + 1
        return original(run, step, *args, **kwargs)
    return generate


def _stream_then_die(original, point):
    """A generator-returning method whose stream dies after its first item."""
    def method(self, *args, **kwargs):
        for index, item in enumerate(original(self, *args, **kwargs)):
            if index == 1:
                maybe_die(point)
            yield item
    return method


def _load_weights(original):
    def load_weights(self, weights):
        def stream():
            for index, item in enumerate(weights):
                if index == 1:
                    maybe_die("sync")
                yield item
        return original(self, stream())
    return load_weights


def _build_trainable(original):
    def build_trainable(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        step = optimizer.step

        def optimizer_step(*a, **k):
            maybe_die("optimizer")
            return step(*a, **k)

        optimizer.step = optimizer_step
        return model, optimizer, scheduler
    return build_trainable


def _backward_step(original):
    def backward_step(*args, **kwargs):
        maybe_die("backward")
        return original(*args, **kwargs)
    return backward_step


def _limit_file_size(completed_steps):
    limit, after = os.environ.get("MEGARL_FAULT_FSIZE"), int(os.environ.get("MEGARL_FAULT_FSIZE_AFTER", "1"))
    if limit and completed_steps > after:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def install() -> None:
    from megatron.core.pipeline_parallel import schedules

    # A write past RLIMIT_FSIZE raises EFBIG (and SIGXFSZ, whose default action would kill the rank).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    wrap(phases, "generate", make=_generate)
    wrap(rollout.RolloutEngine, "generate", lambda *a, **k: maybe_die("generate"))
    wrap(scoring.OverlappedScoring, "_score", lambda *a, **k: maybe_die("reward"))
    wrap(actor.Actor, "logprobs", lambda *a, **k: maybe_die("old_logprobs"))
    wrap(phases, "compute_advantages", lambda *a, **k: maybe_die("advantages"))
    wrap(schedules, "backward_step", make=_backward_step)
    wrap(model_runner, "build_trainable", make=_build_trainable)
    wrap(model_runner, "reduce_over_data_parallel", lambda *a, **k: maybe_die("metric_allreduce"))
    wrap(actor.Actor, "hf_weights", make=lambda original: _stream_then_die(original, "sync"))
    wrap(rollout.RolloutEngine, "load_weights", make=_load_weights)
    wrap(evaluation, "evaluate", lambda run, completed, *a, **k: maybe_die("eval", completed))
    wrap(preemption.Preemption, "requested", lambda *a, **k: maybe_die("preempt_check"))
    wrap(checkpoint, "save", lambda run, completed, *a, **k: _limit_file_size(completed))
    wrap(checkpoint, "_rng_state", lambda: maybe_die("save", current["saving"]))
    wrap(checkpoint, "_run_state", lambda run, completed, *a: maybe_die("save_publish", completed))
    original_save = checkpoint.save

    def save(run, completed, *args, **kwargs):
        current["saving"] = completed
        return original_save(run, completed, *args, **kwargs)

    checkpoint.save = save


if __name__ == "__main__":
    install()
    train.main(sys.argv[1:])
