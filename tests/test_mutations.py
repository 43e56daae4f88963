"""The mutation lane (`bash run_tests.sh -m mutations -s`; docs/testing.md): tools/mutations.py applies each of
its small realistic bugs (the loss and its masks, advantages, KL, TIS, clipping, the optimizer step, the
checkpoint and the LR schedule, the weight sync, the kernels, routing replay, the LoRA merge, the multi-turn
tool mask) to a copy of the working tree, one at a time, and runs the CI tests that cover it there: every
mutation must be caught. Its progress rows and the final table print as it goes (with -s); the table is
also kept at runs/mutations.md."""

import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.mutations


def test_every_mutation_fails_a_ci_test(capsys):
    table = ROOT / "runs" / "mutations.md"
    table.parent.mkdir(exist_ok=True)
    table.unlink(missing_ok=True)
    with capsys.disabled():  # the rows as each mutation finishes, not at the end
        result = subprocess.run([sys.executable, str(ROOT / "tools" / "mutations.py"), "--markdown", str(table)],
                                cwd=ROOT, timeout=3 * 3600)
    assert result.returncode == 0, (table.read_text() if table.exists() else
                                    f"tools/mutations.py exited with {result.returncode}")
