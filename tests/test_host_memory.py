"""megarl/host_memory.py in a fresh interpreter (the settings only take before torch's first host allocation):
huge pages advised for torch's large tensors (not while a vLLM engine is built), glibc's heap serving blocks
up to 32 MiB, and a user's own settings left as they are."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory settings")

# After the entry point's imports (they allocate nothing on the host), what main() does first; then where a
# 64 MiB tensor lives and whether a 24 MiB block came from a new mapping (glibc's mallinfo2: hblkhd, the
# bytes in mapped blocks). VmFlags "hg": the region was advised MADV_HUGEPAGE (whether the kernel then gave
# huge pages depends on its settings and free memory; the advice is what torch was told to give).
PROBE = r"""
import ctypes, json
import megarl.train
from megarl import host_memory
applied = host_memory.configure()
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
if hasattr(libc, "mallinfo2"):
    libc.mallinfo2.restype = MallInfo2
big = torch.empty(64 * 2**20 // 4)
big.fill_(1.0)
address, advised = big.data_ptr(), None
region = None
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
        start, end = (int(part, 16) for part in head[0].split("-"))
        region = start <= address < end
    elif line.startswith("VmFlags:") and region:
        advised = "hg" in line.split()
mapped_block = None  # glibc before 2.33 has no mallinfo2
if hasattr(libc, "mallinfo2"):
    mapped_before = libc.mallinfo2().hblkhd
    block = torch.empty(24 * 2**20 // 4)
    mapped_block = libc.mallinfo2().hblkhd - mapped_before >= 24 * 2**20
# an engine's build (megarl/rollout.py): the process's THP switch (prctl PR_GET_THP_DISABLE; -1 without it)
thp_disabled = lambda: ctypes.CDLL(None).prctl(host_memory.PR_GET_THP_DISABLE, 0, 0, 0, 0)
with host_memory.small_pages():
    inside = thp_disabled()
print(json.dumps({"applied": applied, "huge_page_advice": advised, "mapped_block": mapped_block,
                  "small_pages": [inside, thp_disabled()]}))
"""


def _probe(**env) -> dict:
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                  "GLIBC_TUNABLES")}
    environment.update(PYTHONPATH=str(ROOT), **env)
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_large_tensors_are_advised_huge_pages_and_blocks_come_from_the_heap():
    probe = _probe()
    assert probe["applied"] == {"THP_MEM_ALLOC_ENABLE": "1", "mmap_threshold": 32 * 2**20,
                                "trim_threshold": 2**31 - 1}, probe
    if os.path.exists("/sys/kernel/mm/transparent_hugepage"):  # a kernel without THP refuses the advice
        assert probe["huge_page_advice"] is True, probe
    if probe["mapped_block"] is None:
        pytest.skip("no mallinfo2 (glibc < 2.33): the heap's blocks cannot be read")
    assert probe["mapped_block"] is False, probe  # glibc's default maps a 24 MiB block of its own


def test_an_engine_is_built_in_small_pages_and_huge_pages_return_after():
    """host_memory.small_pages turns transparent huge pages off for the process while a vLLM engine is built
    (its KV cache, touched whole at once) and back on after, only where configure() turned them on."""
    inside, after = _probe()["small_pages"]
    if after == -1:
        pytest.skip("a kernel without PR_GET_THP_DISABLE (Linux < 3.15)")
    if after == 1 and inside == 1:
        pytest.skip("huge pages already off for this process (inherited): nothing for small_pages to switch")
    assert (inside, after) == (1, 0)
    assert _probe(THP_MEM_ALLOC_ENABLE="1")["small_pages"] == [0, 0]  # the user's own huge pages stay on


def test_the_users_own_settings_are_kept():
    probe = _probe(THP_MEM_ALLOC_ENABLE="0", MALLOC_TRIM_THRESHOLD_="131072")
    assert probe["applied"] == {}, probe
    assert probe["huge_page_advice"] is False, probe
    if probe["mapped_block"] is None:
        pytest.skip("no mallinfo2 (glibc < 2.33): the heap's blocks cannot be read")
    assert probe["mapped_block"] is True, probe  # glibc as the user left it
