"""torchrun worker: megarl/train.py with generation (or a standalone teacher's scoring) failing on one
rank at step 2."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import os  # noqa: E402
import sys  # noqa: E402

from megarl import rollout, teacher, train  # noqa: E402

FAIL_RANK = int(os.environ["MEGARL_TEST_FAIL_RANK"])
LAUNCH_RANK = int(os.environ["RANK"])  # read now: a rollout engine rewrites RANK to its role rank
original_generate = rollout.RolloutEngine.generate


def failing_generate(self, prompts, prompt_indices, step, **options):
    if LAUNCH_RANK == FAIL_RANK and step == 1:
        raise RuntimeError("injected generation failure")
    return original_generate(self, prompts, prompt_indices, step, **options)


original_score = teacher.TeacherEngine.score_samples
scoring_calls = []


def failing_score(self, samples, width, k):
    scoring_calls.append(len(samples))
    if LAUNCH_RANK == FAIL_RANK and len(scoring_calls) == 2:  # the teacher phase of step 2
        raise RuntimeError("injected teacher failure")
    return original_score(self, samples, width, k)


rollout.RolloutEngine.generate = failing_generate
teacher.TeacherEngine.score_samples = failing_score
train.main(sys.argv[1:])
