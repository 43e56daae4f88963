"""Where a rank's CPU tensors get their memory on Linux: huge pages, and freed memory kept for reuse.

On a CPU rank every activation, gradient and temporary of the update is a fresh host allocation. glibc
hands large blocks out as new mappings and gives freed memory back to the kernel (munmap, and trimming the
heap's top), so the next step touches fresh pages again, each a page fault that zeroes 4 KiB. Profiled on
the bench job (bench/e2e.py, AMD EPYC with AVX-512, one thread per rank), an element-wise pass that
writes a fresh 26 MB gradient took 63-72 ms instead of 2 ms, and the faults cost 4-6% of every update
and a fifth of the first one. Two settings, the way a GPU's caching allocator behaves:

- `THP_MEM_ALLOC_ENABLE=1`: torch's own switch (c10/core/impl/alloc_cpu.cpp) that aligns allocations of
  2 MiB and more to 2 MiB and advises transparent huge pages for them (the kernel's `madvise` mode, the
  common default, gives huge pages only where advised): one fault per 2 MiB. torch reads it once, at its
  first host allocation, so `configure()` runs before any.
- glibc's `mallopt`: blocks up to 32 MiB (its largest mmap threshold) come from the heap instead of
  new mappings, and up to 2 GiB (mallopt's largest) of free heap top stays mapped instead of being trimmed,
  so the next step reuses the same pages. The peak is unchanged; only the handing back is.

A vLLM engine is built in 4 KiB pages (`small_pages`, megarl/rollout.py): its KV cache is one zero-filled
allocation touched whole at once, and on a VM whose host backs each huge page on its first touch that took
2.3-11.8 s per 2 GiB in huge pages against 0.6-0.8 s in small ones (the Zen 4-class VM, 2026-12-02): a
quickstart run 26-32 s -> 16 s. The trainer's tensors, allocated and freed step after step, keep the huge
pages (an AVX-512 host's first step 1.8 s faster with them); on that VM the bench job's first update then
pays the huge pages' first touch that the KV cache had paid (23-25 against 18 s), later ones unchanged.

Each is left alone when the user set it (`THP_MEM_ALLOC_ENABLE`, or glibc's `MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_` or `GLIBC_TUNABLES`), and the glibc part is skipped without glibc (musl, macOS).
No library provides this: jemalloc or tcmalloc would, preloaded before the interpreter starts, which a
`torchrun` command line does not do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: HEAP_MAX_SIZE / 2 on 64-bit hosts
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
GLIBC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
PR_SET_THP_DISABLE, PR_GET_THP_DISABLE = 41, 42  # linux/prctl.h (Linux 3.15+)
_state = {"huge_pages": False}  # whether configure() advised huge pages (the user had not set it)


def configure() -> dict:
    """Apply both settings where they apply (Linux; the user's own settings win); what was set, by name.
    Call before torch's first host allocation (importing torch makes none)."""
    if not sys.platform.startswith("linux"):
        return {}
    applied = {}
    if "THP_MEM_ALLOC_ENABLE" not in os.environ:
        os.environ["THP_MEM_ALLOC_ENABLE"] = applied["THP_MEM_ALLOC_ENABLE"] = "1"
        _state["huge_pages"] = True
    if not any(name in os.environ for name in GLIBC_SETTINGS):
        libc = ctypes.CDLL(None)
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None and hasattr(libc, "gnu_get_libc_version"):  # glibc's mallopt, not a stub
            for option, value, name in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD, "mmap_threshold"),
                                        (M_TRIM_THRESHOLD, TRIM_THRESHOLD, "trim_threshold")):
                if mallopt(option, value) == 1:  # 1: accepted
                    applied[name] = value
    return applied


@contextlib.contextmanager
def small_pages():
    """No transparent huge pages for what the process touches first inside (prctl PR_SET_THP_DISABLE, restored
    after; pages touched inside stay small), where `configure` turned them on: a user's own setting, another
    OS or a kernel without the prctl is left as it is."""
    libc = ctypes.CDLL(None, use_errno=True) if _state["huge_pages"] else None
    before = libc.prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) if libc is not None else -1
    changed = before == 0 and libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        if changed:
            libc.prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0)
