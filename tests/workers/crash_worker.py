"""torchrun worker: megarl/train.py with generation failing on one rank at step 2."""

import os
import sys

from megarl import rollout, train

FAIL_RANK = int(os.environ["MEGARL_TEST_FAIL_RANK"])
LAUNCH_RANK = int(os.environ["RANK"])  # read now: a rollout engine rewrites RANK to its role rank
original_generate = rollout.RolloutEngine.generate


def failing_generate(self, prompts, prompt_indices, step, **options):
    if LAUNCH_RANK == FAIL_RANK and step == 1:
        raise RuntimeError("injected generation failure")
    return original_generate(self, prompts, prompt_indices, step, **options)


rollout.RolloutEngine.generate = failing_generate
train.main(sys.argv[1:])
