"""Fault injection, the CI subset of tests/fault_injection.py (the whole suite: `python tests/fault_injection.py
--all`, or the soak lane, `bash run_tests.sh -m soak`): in each placement a rank is SIGKILLed during the weight sync, the run resumes, another rank is
SIGKILLed while saving a checkpoint, the run resumes again; every rank exits after each kill (by itself: not by
the launch's hang guard; the soak lane also bounds the time to 60 s) with a line naming the dead rank, each resume starts from the last complete checkpoint and the logged scalars equal
the uninterrupted run's bit for bit. And a full disk while saving: one line naming the checkpoint, the
previous one intact and resumed from."""

import pytest

from fault_injection import CI_CHAINS, full_disk_case, kill_chain, table

pytestmark = pytest.mark.slow  # real torchrun ranks with vLLM and Megatron-core


# CI runs the colocated chain; the separate one and the full disk run with the soak lane (-m soak), which has
# every kill point in both placements.
@pytest.mark.parametrize("placement", [pytest.param(p, marks=pytest.mark.soak) if p == "separate" else p
                                       for p in sorted(CI_CHAINS)])
def test_sigkill_in_weight_sync_and_checkpoint_save_then_resume(tiny_model, tmp_path, placement):
    results = kill_chain(CI_CHAINS[placement], placement, tmp_path / placement, exit_limit=None)
    assert all(result.ok for result in results), table(results)


@pytest.mark.soak
def test_full_disk_while_saving(tiny_model, tmp_path):
    result = full_disk_case("colocated", tmp_path)
    assert result.ok, table([result])
