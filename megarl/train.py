"""megarl's one entry point: `torchrun --nproc_per_node N megarl/train.py --config x.yaml [flags]`.

One step:  generate (rollout + reward) -> train (logprobs, advantages, PPO
updates) -> sync weights (trainer -> rollout) -> log; evaluation before the
first step, every --eval-interval steps and after the last.
"""

import os
import sys
import time
import traceback

if __package__ in (None, ""):
    # Run as a script, Python puts megarl/ itself first on sys.path, where our
    # platform.py would shadow the standard library's; put the checkout there instead.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from megarl.arguments import ConfigError, parse_args  # noqa: E402
from megarl.distributed import init_distributed, launch_env  # noqa: E402
from megarl.metrics import MetricsLogger  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402


def run(args) -> None:
    from megarl import checkpoint, distributed
    from megarl.preemption import Preemption
    from megarl.rl import RLRun

    context = init_distributed(args)
    preemption = Preemption()
    rl = RLRun(args, context)
    is_main = context.env.rank == 0
    logger = MetricsLogger(args, is_main=is_main)
    start = _resume(rl, args, context, is_main)
    if start == 0 and rl.should_evaluate(0):
        logger.log_eval(0, rl.evaluate(0))
    for step in range(start, args.train_steps):
        start_time = time.perf_counter()
        samples, metrics = rl.generate(step)
        rl.sleep_rollout()
        generated = time.perf_counter()
        metrics.update(rl.train(samples, step))
        trained = time.perf_counter()
        metrics.update(rl.sync_weights())
        metrics.update(rollout_seconds=generated - start_time - metrics["reward_seconds"],
                       train_seconds=trained - generated - metrics.get("logprobs_seconds", 0.0),
                       step_seconds=time.perf_counter() - start_time)
        logger.log_step(step, samples, metrics)
        completed = step + 1
        if rl.should_evaluate(completed):
            logger.log_eval(completed, rl.evaluate(completed))
        stop = preemption.requested(context)
        if args.save_dir and (stop or completed == args.train_steps
                              or (args.save_interval and completed % args.save_interval == 0)):
            path = checkpoint.save(rl, completed, args.save_dir, args.save_keep)
            if is_main:
                print(f"megarl: saved {path}", flush=True)
        if args.save_hf_interval and completed % args.save_hf_interval == 0:
            # Beside the final export, not inside it: that one replaces its directory.
            rl.save_hf(f"{args.save_hf_dir.rstrip('/')}_step_{completed}")
        if stop:
            if is_main:
                where = (f"checkpoint saved in {args.save_dir}; resume with --resume auto" if args.save_dir
                         else "no --save-dir, so nothing was saved")
                print(f"megarl: {stop} received: stopped after step {completed}; {where}", flush=True)
            distributed.all_gather_objects(None, context)
            return
    logger.finish()
    if args.save_hf_dir:
        rl.save_hf(args.save_hf_dir)


def _resume(rl, args, context, is_main: bool) -> int:
    """Load the checkpoint --resume names (rank 0 decides which, so every rank loads the same)
    and give the rollout engines the loaded policy; the number of steps already done."""
    from megarl import checkpoint, distributed

    path = checkpoint.resolve_resume(args.resume, args.save_dir) if is_main else None
    path = distributed.all_gather_objects(path, context)[0]
    if path is None:
        return 0
    completed = checkpoint.load(rl, path)
    rl.sync_weights()
    if is_main:
        print(f"megarl: resumed from {path} after step {completed}", flush=True)
    return completed


def main(argv=None) -> None:
    try:
        args = parse_args(argv, world_size=launch_env().world_size)
    except ConfigError as error:
        print(f"megarl: error: {error}", file=sys.stderr)
        sys.exit(2)
    rank = launch_env().rank  # now: a rollout engine later rewrites RANK to its role rank
    try:
        run(args)
    except BaseException as error:  # noqa: BLE001 - any failure must end this rank, not hang it
        if isinstance(error, SystemExit) and not error.code:
            raise
        print(f"megarl: rank {rank} failed: {type(error).__name__}: {error}\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        release_shared_memory()
        # Hard exit: vLLM and gloo threads must not keep this rank alive, so the
        # launcher sees the failure at once and stops the other ranks.
        os._exit(1)
    release_shared_memory()
    sys.stdout.flush()
    # vLLM's in-process engine holds threads that can stall interpreter shutdown.
    os._exit(0)


if __name__ == "__main__":
    main()
