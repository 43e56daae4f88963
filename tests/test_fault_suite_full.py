"""The whole fault-injection suite, in its own lane: `bash run_tests.sh -m soak` (about 45 minutes on 2 cores).

The same run as `python tests/fault_injection.py --all` (every kill point in both placements, the full disk in
both, the 500-step long run in both), plus the full disk on a real tmpfs where this process may mount one. Its
progress lines and the table go to the terminal as they come (pytest's capture is off for them); every row
must be ok. Marked `soak`, which tests/conftest.py leaves out of every run whose -m does not name it: CI (unit
+ slow, 48-51 minutes with the install against a 90-minute limit) has no room for it. tests/test_faults.py is the CI subset.
"""

import os
import subprocess

import pytest

import fault_injection

pytestmark = pytest.mark.soak


def can_mount_tmpfs(where) -> bool:
    """Root alone is not enough: a container without CAP_SYS_ADMIN refuses mount(2)."""
    if os.geteuid() != 0:
        return False
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(where)], check=True)
    return True


def test_the_whole_fault_injection_suite(tiny_model, tmp_path, capsys):
    tmpfs = can_mount_tmpfs(tmp_path / "probe")
    args = fault_injection.options(["--all", "--out", str(tmp_path / "suite")] + (["--tmpfs"] if tmpfs else []))
    with capsys.disabled():
        print(f"\nthe whole fault-injection suite ({'with' if tmpfs else 'without'} the tmpfs case), "
              f"about 45 minutes:", flush=True)
        results = fault_injection.run_suite(args)
        print(fault_injection.table(results), flush=True)
    # Per placement a full disk and a long run besides the kills: a case that never reported fails too.
    expected = len(fault_injection.all_kill_cases()) + 2 * len(fault_injection.PLACEMENTS) + tmpfs
    assert len(results) == expected, fault_injection.table(results)
    failed = [f"{r.case} ({r.placement}, rank {r.rank}): {'; '.join(r.notes)}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
