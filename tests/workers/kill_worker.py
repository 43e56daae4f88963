"""torchrun worker: megarl/train.py that SIGKILLs itself (rank 0) at a chosen point.

MEGARL_TEST_KILL=train:K  in the middle of step K's training (after generation);
MEGARL_TEST_KILL=save:K   while saving the checkpoint after K steps, after every
                          rank wrote its part and before it is published.
"""

import os
import signal
import sys

from megarl import checkpoint, phases, train

WHERE, AT = os.environ["MEGARL_TEST_KILL"].split(":")
AT = int(AT)
IS_RANK_0 = os.environ["RANK"] == "0"  # read now: a rollout engine rewrites RANK to its role rank


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


original_update, original_run_state = phases.update, checkpoint._run_state


def update_then_die(run, batch, step, *args, **kwargs):
    if WHERE == "train" and IS_RANK_0 and step + 1 == AT:
        die()
    return original_update(run, batch, step, *args, **kwargs)


def run_state_then_die(run, completed_steps):
    if WHERE == "save" and IS_RANK_0 and completed_steps == AT:
        die()
    return original_run_state(run, completed_steps)


phases.update = update_then_die
checkpoint._run_state = run_state_then_die
train.main(sys.argv[1:])
