"""Which causal-attention path each sequence length takes on a CPU rank (fp32), measured per machine and
GEMM library (megarl/cpu_gemm.py: oneDNN's or torch's, which on x86 is MKL's).

Four paths compute the same attention (megarl/models/attention.py): torch's flash kernel, which multiplies
its blocks with MKL and pays a fixed cost per call; `_ShortCausalAttention`, whole-sequence GEMMs with the
softmax kept for the backward; `_BlockedCausalAttention`, blocks of query rows (the causal half of the
work), either recomputing each block's probabilities in the backward ("blocked", the flash kernel's
memory) or keeping them ("kept"). The last three multiply through cpu_gemm.matmul: oneDNN where it is
the rank's library, else torch's. Which is fastest at a length depends on the CPU and the library.
Forward + backward of one sequence, 8 query heads of 64 in 2 groups, one thread, ms:

- Zen 5-class EPYC, oneDNN (2.2x MKL on GEMMs), flash / short / blocked: 100 tokens 1.06 / 0.88 / 1.39,
  256: 5.15 / 2.98 / 4.48, 512: 20.6 / 11.9 / 11.4, 1024: 59.5 / 47.0 / 35.8;
- Zen 4-class EPYC, flash / short / blocked / kept (every value seen over 2-4 runs): oneDNN (1.2x MKL) at
  128 tokens 1.7-2.5 / 2.2-2.3 / 3.3-4.7 / 3.2-3.5, 256: 6.3-8.7 / 6.6-6.9 / 7.8-8.1 / 6.5, 512: 25.0-25.4
  / 30.5-31.2 / 21.7-22.9 / 18.6-20.6, 1024: 72-74 / - / 69-74 / 58-61; torch's GEMMs at 128: 1.7-1.8 / not
  measured / 2.5-2.8 / 2.0-2.1, 256: 6.0-6.5 / 6.5 / 6.2-6.9 / 5.2-5.6, 512: 24.5-25.6 / 30.3-34.0 /
  18.8-20.3 / 15.6-17.5, 1024: 72-75 / - / 64-70 / 54-62 (the blocked paths at each library's
  ATTENTION_BLOCK). The head size of 64 keeps every attention GEMM at about 100 GFLOP/s per core with either
  library, about a 1024^3 oneDNN GEMM's rate on one core of this host (99-107), so the recomputation the
  kept path saves (a GEMM, a mask and an exponential per block) is 10-20% of the blocked path's time at
  512-1024 tokens;
- Intel Xeon family 6 model 207 (MKL runs its AVX-512 code), torch's GEMMs, flash / short / blocked / kept
  (one run at 128, 256 and 1024 tokens, three at 512; a VM whose speed drifts): 128 tokens 1.8 / 2.1 / 2.7 /
  2.1, 256: 4.7 / 5.5 / 6.2 / 4.9, 512: 16.8-17.4 / 20.5-30.1 / 15.5-27.3 / 13.3-26.1, 1024: 50 / - / 51 / 44.

So the lengths each path takes are measured, as cpu_gemm's `auto` measures the GEMM library, and kept per
machine, GEMM library and attention shape (heads, groups, head size per rank) in the same file: every
rank times the paths at `PROBE_LENGTHS` (the blocks that recompute only past the kept blocks' bound:
`_probed`), the ranks add their times up, and each length takes the
fastest (another path than flash only when `MARGIN` faster: the flash kernel keeps no [s, s] tensors). A
length between two probed ones takes the nearer's path (on a log scale). The paths that keep
probabilities are never taken above their `LONGEST` (the short path's heads x s^2 x 4 bytes per sequence
and layer, the kept blocks' about half: at 1024 tokens and 8 heads 18 MB, against ~36 MB of the
bench model's other activations of that sequence and layer); the blocks that recompute take over there. A train
rank measures each shape it runs: the policy's (the critic's and the reference's) and a colocated
teacher's (megarl/run.py: `trained_attention_shapes`). Without a measurement (a process that only called
`cpu_gemm.use`) the library's `DEFAULT_PATHS` apply. Measuring takes 0.5-5 s once per machine, library
and shape (8 heads of 64 on the Zen 4-class host: 2.5 s with oneDNN, 5.0 s with torch's GEMMs); lengths
past the last probe take its path.
"""

from __future__ import annotations

import math
import time

import torch

from megarl.models.causal_attention import gemm_library, run_path

PATHS = ("flash", "short", "blocked", "kept")
# Without a measurement (a process that only called cpu_gemm.use): (the longest length, path) pieces in
# increasing order per GEMM library, None: no upper bound. With oneDNN the Zen 5-class host's measured
# windows; with torch's GEMMs the flash kernel, as before paths were measured for that library.
DEFAULT_PATHS = {"onednn": ((99, "flash"), (511, "short"), (None, "blocked")), "torch": ((None, "flash"),)}
PROBE_LENGTHS = (64, 96, 128, 192, 256, 384, 512, 768, 1024)
# The paths that keep [s, s]-sized probabilities for the backward end here (memory per sequence and layer:
# heads x s^2 x 4 bytes for the short path, about half that for the kept blocks), the blocks beyond
SHORT_MAX_TOKENS = 640
KEPT_MAX_TOKENS = 1024
LONGEST = {"short": SHORT_MAX_TOKENS, "kept": KEPT_MAX_TOKENS}
MARGIN = 0.95  # another path than flash only when at most this fraction of flash's time
PROBE_BUDGET_S = 0.5  # stop probing longer lengths once flash's forward + backward takes this long (big heads)

_measured: dict[tuple[str, int, int, int], tuple] = {}  # (GEMM library, heads, groups, head size) -> pieces




def path_for(length: int, heads: int, groups: int, dim: int) -> str:
    """The path of a sequence of `length` tokens for this attention shape and the GEMM library in use (the
    measured pieces, else the library's defaults)."""
    library = gemm_library()
    for longest, path in _measured.get((library, heads, groups, dim), DEFAULT_PATHS[library]):
        if longest is None or length <= longest:
            return path
    raise AssertionError("the last piece has no upper bound")


def pieces_from_choices(lengths, choices) -> tuple:
    """Pieces from each probed length's path: a length takes the path of the nearest probed length on a log
    scale (the bound between two is their geometric mean); neighbours with one path merge; a short or kept
    piece ends at its LONGEST at most, blocked beyond."""
    pieces = []
    for index, (length, path) in enumerate(zip(lengths, choices)):
        longest = math.isqrt(length * lengths[index + 1]) if index + 1 < len(lengths) else None
        bound = LONGEST.get(path)
        if bound is not None and (longest is None or longest > bound):
            pieces += [(bound, path), (longest, "blocked")]
        else:
            pieces.append((longest, path))
    merged = []
    for longest, path in pieces:
        if merged and merged[-1][1] == path:
            merged[-1] = (longest, path)
        else:
            merged.append((longest, path))
    return tuple(merged)


def choose(heads: int, groups: int, dim: int, group=None) -> tuple[tuple, str]:
    """This shape's pieces with the GEMM library in use, put in use, and how they were decided: the pieces
    every rank of `group` has kept for this machine, library and shape, or measured on every rank (a
    collective per probed length), agreed and kept."""
    from megarl import cpu_gemm

    library = gemm_library()
    entry = f"{cpu_gemm.machine_key()} | attention with {library} GEMMs: {heads} heads in {groups} groups of {dim}"
    pieces = _valid(cpu_gemm.kept(entry, group))
    decided_by = f"measured on this machine before, kept in {cpu_gemm.cache_path()}"
    if pieces is None:
        pieces, decided_by = measure(heads, groups, dim, group), "measured at start-up"
        cpu_gemm.keep(entry, [list(piece) for piece in pieces])
    _measured[(library, heads, groups, dim)] = pieces
    return pieces, decided_by


def describe(pieces) -> str:
    """'flash up to 443, blocked above 443 tokens', for the run's log line."""
    if pieces[0][0] is None:
        return f"{pieces[0][1]} at every length"
    parts, shortest = [], 1
    for longest, path in pieces:
        parts.append(f"{path} above {shortest - 1}" if longest is None else
                     f"{path} {shortest}-{longest}" if shortest > 1 else f"{path} up to {longest}")
        shortest = (longest or 0) + 1
    return ", ".join(parts) + " tokens"


def measure(heads: int, groups: int, dim: int, group=None) -> tuple:
    """Each probed length's fastest path on every rank of `group` (times added up over the ranks) with the
    GEMM library in use."""
    lengths, choices = [], []
    for length in PROBE_LENGTHS:
        seconds = torch.tensor([_probe_seconds(path, length, heads, groups, dim) if _probed(path, length) else math.inf
                                for path in PATHS], dtype=torch.float64)
        ranks = 1
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(seconds, group=group)
            ranks = torch.distributed.get_world_size(group)
        flash, *others = seconds.tolist()
        best = min([(flash, "flash")] + [(took / MARGIN, path) for took, path in zip(others, PATHS[1:])])[1]
        lengths.append(length)
        choices.append(best)
        if flash / ranks > PROBE_BUDGET_S:  # every rank stops at the same length: the times are the sum
            break
    return pieces_from_choices(lengths, choices)


def _probed(path: str, length: int) -> bool:
    """Whether `measure` times `path` at `length`: every path but the blocks that recompute where the kept
    blocks apply. The kept blocks do their GEMMs and passes less one GEMM and one exponential per block, and
    were the faster in 23 of 24 comparisons (two hosts, both GEMM libraries, 128-1024 tokens; the one, 26.1
    against 17.5 ms at 512 tokens, not seen again in the two timings after it: docs/benchmarks.md). A probe
    of best-of-3 tries on a host whose speed drifts can still pick the slower: on the Intel host one did at
    512 tokens, and its updates there were 5-11% slower than with the kept blocks, alternated."""
    return path != "blocked" or length > KEPT_MAX_TOKENS


def _valid(kept) -> tuple | None:
    """A kept value as pieces, or None where it is not a list of [longest, path] ending unbounded."""
    try:
        pieces = tuple((longest, path) for longest, path in kept)
    except (TypeError, ValueError):
        return None
    ok = (pieces and pieces[-1][0] is None and all(path in PATHS for _, path in pieces)
          and all(isinstance(longest, int) for longest, _ in pieces[:-1]))
    return pieces if ok else None


def _probe_seconds(path: str, length: int, heads: int, groups: int, dim: int, tries: int = 3) -> float:
    """Best of `tries` of one sequence's forward and backward on `path` (after one call that builds
    oneDNN's kernels); inf for a path past its LONGEST."""
    if length > LONGEST.get(path, length):
        return math.inf
    # a generator of its own: the run's random state is the same whether it measured or took kept pieces
    numbers = torch.Generator().manual_seed(0)
    query = torch.randn(length, heads, dim, generator=numbers).requires_grad_()
    key, value = (torch.randn(length, groups, dim, generator=numbers).requires_grad_() for _ in range(2))
    grad = torch.randn(length, heads, dim, generator=numbers)
    best = math.inf
    for attempt in range(tries + 1):
        start = time.perf_counter()
        run_path(path, query, key, value, dim ** -0.5).backward(grad)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best
