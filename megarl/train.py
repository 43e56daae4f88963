"""megarl's one entry point: `torchrun --nproc_per_node N megarl/train.py --config x.yaml [flags]`.

One step is the phases of megarl/phases.py, one call each (its docstring describes
the step); evaluation (megarl/evaluation.py) before the first step, every
--eval-interval steps and after the last; checkpoints and preemption after a step.
"""

from megarl import startup_gc

if __name__ == "__main__":  # a rank (not an import): before the imports below, whose objects it would rescan
    startup_gc.defer_full_collections()

import faulthandler  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

from megarl.arguments import parse_args  # noqa: E402
from megarl import cpu_affinity, host_memory  # noqa: E402
from megarl.errors import ConfigError, TeacherServerError  # noqa: E402
from megarl.checkpoint import CheckpointError  # noqa: E402
from megarl.distributed import init_distributed, launch_env  # noqa: E402
from megarl.metrics import MetricsLogger  # noqa: E402
from megarl.rewards.scoring import check_sandbox  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import Activity, load_inputs  # noqa: E402


def train(args, inputs=None, activity: Activity | None = None) -> None:
    """The run; `inputs`: run.load_inputs(args), the files already read and checked; `activity`: where
    the run is, kept up to date for the caller's failure report."""
    from megarl import accelerator, batch as batching, checkpoint, distributed, evaluation, generation, phases
    from megarl.preemption import Preemption
    from megarl.profiling import profiled_update
    from megarl.run import build_run

    context = init_distributed(args)
    activity = activity if activity is not None else Activity()
    from megarl.models.megatron_gpt import capacity_warning

    for warning in (accelerator.precision_warning(args), capacity_warning(args)):
        if warning and context.rank == 0:
            print(f"megarl: warning: {warning}", flush=True)
    # A stop signal after a peer's death ends this rank at once, naming the dead rank (not a preemption).
    preemption = Preemption(context.rank,
                            on_peer_death=lambda dead: _stop_for_dead_peer(context.rank, dead, activity))
    run = build_run(args, context, inputs, activity)
    if args.max_staleness is not None and run.rollout is not None:
        from megarl.streaming import GenerationStream

        run.stream = GenerationStream(run)
    logger = MetricsLogger(args, is_main=run.is_main)
    start, ahead = _resume(run)
    if run.is_main and run.actor is not None:
        print(f"megarl: {batching.describe_old_logprobs_path(args)}", flush=True)
    if start == 0 and evaluation.should_evaluate(run, 0):
        logger.log_eval(0, evaluation.evaluate(run, 0))
    # --async-generation: the rollout ranks generate step k+1's samples while the train ranks train on
    # step k's (generation.generate_ahead; the sync of step k's weights follows), one weight version behind.
    # `ahead` is what is in flight: a checkpoint keeps it, so a resumed run takes it from there.
    if ahead is None and args.async_generation and start < args.train_steps:
        ahead = generation.generate_ahead(run, start, trained_at=run.weight_version)
    for step in range(start, args.train_steps):
        run.activity.step = step + 1
        shortcut = batching.on_policy_update(args, step)  # no separate old-logprob pass
        samples, generated = phases.generate(run, step, ahead)
        # (before this step's sync: the batch trains under the version after it)
        ahead = generation.generate_ahead(run, step + 1, trained_at=run.weight_version + 1) \
            if ahead is not None and step + 1 < args.train_steps else None
        batch, scored = phases.score_and_filter(run, samples)
        batch, prepared = phases.prepare(run, batch, shortcut)
        batch, taught = phases.teach(run, batch)
        batch, advantaged = phases.compute_advantages(run, batch)
        with profiled_update(args, step, context.rank):  # --profile-step: where the update's time goes
            updated = phases.update(run, batch, step, shortcut)
        synced = phases.sync(run)
        logger.log_step(step, batch, {"generate": generated, "score": scored, "prepare": prepared,
                                      "teacher": taught, "advantages": advantaged, "update": updated,
                                      "sync": synced})
        completed = step + 1
        if evaluation.should_evaluate(run, completed):
            logger.log_eval(completed, evaluation.evaluate(run, completed))
        run.activity.phase = "preemption check"
        stop = preemption.requested(context)
        saving = bool(args.save_dir) and args.save_interval >= 0  # -1: never (verl's save_freq -1)
        if saving and (stop or completed == args.train_steps
                       or (args.save_interval > 0 and completed % args.save_interval == 0)):
            run.activity.phase = "checkpoint save"
            path = checkpoint.save(run, completed, args.save_dir, args.save_keep, in_flight=ahead)
            if run.is_main:
                print(f"megarl: saved {path}", flush=True)
        if args.save_hf_interval and completed % args.save_hf_interval == 0:
            # Beside the final export, not inside it: that one replaces its directory.
            checkpoint.save_hf(run, f"{args.save_hf_dir.rstrip('/')}_step_{completed}")
        if stop:
            if run.is_main:
                where = (f"checkpoint saved in {args.save_dir}; resume with --resume auto" if saving
                         else "--save-interval -1, so nothing was saved" if args.save_dir
                         else "no --save-dir, so nothing was saved")
                print(f"megarl: {stop} received: stopped after step {completed}; {where}", flush=True)
            distributed.all_gather_objects(None, context)
            return
    logger.finish()
    if args.save_hf_dir:
        checkpoint.save_hf(run, args.save_hf_dir)


def _resume(run):
    """Load the checkpoint --resume names (rank 0 decides which, so every rank loads the same)
    and give the rollout engines the loaded policy (without a checkpoint, the adapters of --lora-load on
    --model); the number of steps already done, and
    --async-generation's samples of the next step when the checkpoint holds them (else None)."""
    from megarl import checkpoint, distributed

    args = run.args
    path = checkpoint.resolve_resume(args.resume, args.save_dir) if run.is_main else None
    path = distributed.all_gather_objects(path, run.context)[0]
    if path is None:
        if args.lora_load:  # the engines started from --model; the policy is --model with the loaded adapters
            run.weight_sync.sync(run.actor, run.rollout)
        return 0, None
    completed = checkpoint.load(run, path)
    in_flight = checkpoint.load_in_flight(run, path, completed)
    # The engines get the weights they held when the checkpoint was written: the saved weight version, not a
    # new one (phases.sync counts one), so staleness continues as in the uninterrupted run.
    run.weight_sync.sync(run.actor, run.rollout)
    if run.is_main:
        print(f"megarl: resumed from {path} after step {completed}", flush=True)
    return completed, in_flight


def main(argv=None) -> None:
    host_memory.configure()  # before torch's first host allocation, which fixes its huge-page setting
    # Bad options and bad input files (model, tokenizer, datasets) end here, with one line and nothing
    # written: before any process group, engine, log or checkpoint directory.
    try:
        args = parse_args(argv, world_size=launch_env().world_size)
        cpus = cpu_affinity.bind(args.cpu_affinity, launch_env().local_rank)  # before groups' and engines' threads
        if cpus is not None and launch_env().rank == 0:
            print(f"megarl: each local rank bound to its own CPUs (rank 0: {cpus}; --cpu-affinity none: "
                  f"the OS places them)", flush=True)
        if launch_env().rank == 0:  # how another framework's config was read, and what it ignored
            for note in args.config_notes:
                print(f"megarl: {note}", flush=True)
        inputs = load_inputs(args)
        check_sandbox(args)  # a code reward: stop here if the sandbox cannot run, not score every program 0
    except ConfigError as error:
        print(f"megarl: error: {error}", file=sys.stderr)
        sys.exit(2)
    rank = launch_env().rank  # now: a rollout engine later rewrites RANK to its role rank
    activity = Activity()
    # A rank killed from C code (NCCL's watchdog aborts the process when a collective outlives
    # --distributed-timeout-minutes; a segfault in a kernel) never reaches the failure report below:
    # Python's stacks of every thread, printed on SIGABRT/SIGSEGV/SIGBUS/SIGFPE, name the phase
    # (megarl/phases.py's function) and the collective's call site instead.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        train(args, inputs, activity)
    except BaseException as error:  # noqa: BLE001 - any failure must end this rank, not hang it
        if isinstance(error, SystemExit) and not error.code:
            raise
        _report_failure(rank, error, activity)
        release_shared_memory()
        # Hard exit: vLLM and gloo threads must not keep this rank alive, so the
        # launcher sees the failure at once and stops the other ranks.
        os._exit(1)
    release_shared_memory()
    sys.stdout.flush()
    # vLLM's in-process engine holds threads that can stall interpreter shutdown.
    os._exit(0)


_REPORTING = threading.Lock()  # one failure line per rank: the main thread's or the stop-signal watcher's
_REPORT_SECONDS = 10.0  # the most either waits for the other's line (each reads /proc and the store, bounded)


def _stop_for_dead_peer(rank: int, dead: list[str], activity: Activity) -> None:
    """The launcher's SIGTERM after a peer's death (preemption.Preemption's watcher thread): one line naming
    the dead rank and what this rank was doing, then this rank ends now, whether or not its main thread is
    stuck in a collective with the dead rank (on NCCL it may not fail before the launcher's grace runs out)."""
    # The main thread may be writing its own line about the same death: let it finish (it ends the process);
    # should it be stuck, say it here after all.
    _REPORTING.acquire(timeout=_REPORT_SECONDS)
    print(f"megarl: {'; '.join(dead)}; rank {rank} stops ({activity}: stop signal from the launcher, "
          f"no checkpoint)", file=sys.stderr, flush=True)
    release_shared_memory()
    os._exit(1)


def _report_failure(rank: int, error: BaseException, activity: Activity) -> None:
    """One line when another rank died (this rank's collective then fails: that rank is the news, not this
    traceback) or when a checkpoint could not be written or resumed; else the error and its traceback, and
    the failure is published in the store for the ranks of other hosts (distributed.publish_failure)."""
    from megarl import distributed

    if not _REPORTING.acquire(blocking=False):
        time.sleep(_REPORT_SECONDS)  # the stop-signal watcher is reporting and ends this rank meanwhile
        return
    doing = str(activity)
    message = (str(error).strip().splitlines() or [""])[0][:300]
    # Every rank raises these alike (a checkpoint written or read by all, the teacher server's answer shared
    # by rank 0: phases._score_on_teacher_server); one prints.
    if isinstance(error, (CheckpointError, TeacherServerError)):
        if rank == 0:
            print(f"megarl: error: {error}", file=sys.stderr, flush=True)
        return
    # A peer's death reaches a collective as an error (gloo: "Connection reset by peer", a RuntimeError).
    dead = distributed.dead_peers(rank, wait_seconds=3.0 if isinstance(error, RuntimeError) else 0.0)
    if isinstance(error, distributed.StartupTimeout) and not dead:  # every waiting rank says it alike
        print(f"megarl: rank {rank}: {error}", file=sys.stderr, flush=True)
    elif dead:
        # A failure of its own (not the lost connection) keeps its traceback.
        own = "" if "peer" in str(error) or "Connection" in str(error) else f"\n{traceback.format_exc()}"
        print(f"megarl: {'; '.join(dead)}; rank {rank} stops ({doing}: {type(error).__name__}: {message}){own}",
              file=sys.stderr, flush=True)
    else:
        print(f"megarl: rank {rank} failed: {type(error).__name__}: {error}\n(during {doing})\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        distributed.publish_failure(rank, f"during {doing}: {type(error).__name__}: {message}")


if __name__ == "__main__":
    main()
