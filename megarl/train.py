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
    from megarl.rl import RLRun

    context = init_distributed(args)
    rl = RLRun(args, context)
    logger = MetricsLogger(args, is_main=context.env.rank == 0)
    if rl.should_evaluate(0):
        logger.log_eval(0, rl.evaluate(0))
    for step in range(args.train_steps):
        start = time.perf_counter()
        samples, metrics = rl.generate(step)
        rl.sleep_rollout()
        generated = time.perf_counter()
        metrics.update(rl.train(samples, step))
        trained = time.perf_counter()
        metrics.update(rl.sync_weights())
        metrics.update(rollout_seconds=generated - start, train_seconds=trained - generated,
                       step_seconds=time.perf_counter() - start)
        logger.log_step(step, samples, metrics)
        if rl.should_evaluate(step + 1):
            logger.log_eval(step + 1, rl.evaluate(step + 1))
    logger.finish()
    if args.save_hf_dir:
        rl.save_hf(args.save_hf_dir)


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
