"""Which causal-attention path each sequence length of a packed row takes on a CPU rank whose GEMMs go
through oneDNN (megarl/cpu_gemm.py), measured per machine.

Three paths compute the same attention (megarl/models/attention.py): torch's flash kernel, which multiplies
its blocks with MKL and pays a fixed cost per call; `_ShortCausalAttention`, whole-sequence GEMMs through
oneDNN with the softmax kept for the backward; `_BlockedCausalAttention`, blocks of query rows through
oneDNN. Which is fastest at a length depends on the CPU. Forward + backward of one sequence, 8 query heads
of 64 in 2 groups, one thread, flash / short / blocked, ms:

- Zen 5-class EPYC (oneDNN 2.2x MKL on GEMMs): 100 tokens 1.06 / 0.88 / 1.39, 256: 5.15 / 2.98 / 4.48,
  512: 20.6 / 11.9 / 11.4, 1024: 59.5 / 47.0 / 35.8;
- Zen 4-class EPYC (oneDNN 1.2x MKL): 128 tokens 1.74 / 2.17 / 3.16, 256: 6.41 / 6.52 / 8.24, 512: 25.2 /
  29.7 / 22.3, 1024: 72.0 / 115.8 / 68.2.

So the lengths each path takes are measured, as cpu_gemm's `auto` measures the GEMM library, and kept per
machine and attention shape (heads, groups, head size per rank) in the same file: every rank times the
three paths at `PROBE_LENGTHS`, the ranks add their times up, and each length takes the fastest (another
path than flash only when `MARGIN` faster: the flash kernel keeps no [s, s] tensors). A length between two
probed ones takes the nearer's path (on a log scale). The short path is never taken above
`SHORT_MAX_TOKENS` (its kept softmax: heads x s^2 x 4 bytes per sequence and layer). A train rank measures
each shape it runs: the policy's (the critic's and the reference's) and a colocated teacher's
(megarl/run.py: `trained_attention_shapes`). Without a measurement (a process that only called
`cpu_gemm.use`) the Zen 5-class host's windows apply: `DEFAULT_PATHS`. Measuring
takes 0.3-1.6 s once per machine and shape (8 heads of 64: 1.6 s); lengths past the last probe take its path.
"""

from __future__ import annotations

import math
import time

import torch

PATHS = ("flash", "short", "blocked")
# (the longest length, path) pieces in increasing order; None: no upper bound
DEFAULT_PATHS = ((99, "flash"), (511, "short"), (None, "blocked"))
PROBE_LENGTHS = (64, 96, 128, 192, 256, 384, 512, 768, 1024)
SHORT_MAX_TOKENS = 640
MARGIN = 0.95  # short or blocked instead of flash only when at most this fraction of flash's time
PROBE_BUDGET_S = 0.5  # stop probing longer lengths once flash's forward + backward takes this long (big heads)

_measured: dict[tuple[int, int, int], tuple] = {}  # (heads, groups, head size) -> pieces


def path_for(length: int, heads: int, groups: int, dim: int) -> str:
    """The path of a sequence of `length` tokens for this attention shape (the measured pieces, else the
    defaults)."""
    for longest, path in _measured.get((heads, groups, dim), DEFAULT_PATHS):
        if longest is None or length <= longest:
            return path
    raise AssertionError("the last piece has no upper bound")


def pieces_from_choices(lengths, choices) -> tuple:
    """Pieces from each probed length's path: a length takes the path of the nearest probed length on a log
    scale (the bound between two is their geometric mean); neighbours with one path merge; a short piece
    ends at SHORT_MAX_TOKENS at most, blocked beyond."""
    pieces = []
    for index, (length, path) in enumerate(zip(lengths, choices)):
        longest = math.isqrt(length * lengths[index + 1]) if index + 1 < len(lengths) else None
        if path == "short" and (longest is None or longest > SHORT_MAX_TOKENS):
            pieces += [(SHORT_MAX_TOKENS, "short"), (longest, "blocked")]
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
    """This shape's pieces, put in use, and how they were decided: the pieces every rank of `group` has kept
    for this machine and shape, or measured on every rank (a collective per probed length), agreed and kept."""
    from megarl import cpu_gemm

    entry = f"{cpu_gemm.machine_key()} | attention: {heads} heads in {groups} groups of {dim}"
    pieces = _valid(cpu_gemm.kept(entry, group))
    decided_by = f"measured on this machine before, kept in {cpu_gemm.cache_path()}"
    if pieces is None:
        pieces, decided_by = measure(heads, groups, dim, group), "measured at start-up"
        cpu_gemm.keep(entry, [list(piece) for piece in pieces])
    _measured[(heads, groups, dim)] = pieces
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
    """Each probed length's fastest path on every rank of `group` (times added up over the ranks)."""
    lengths, choices = [], []
    for length in PROBE_LENGTHS:
        seconds = torch.tensor([_probe_seconds(path, length, heads, groups, dim) for path in PATHS],
                               dtype=torch.float64)
        ranks = 1
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(seconds, group=group)
            ranks = torch.distributed.get_world_size(group)
        flash, short, blocked = seconds.tolist()
        best = min((flash, "flash"), (short / MARGIN, "short"), (blocked / MARGIN, "blocked"))[1]
        lengths.append(length)
        choices.append(best)
        if flash / ranks > PROBE_BUDGET_S:  # every rank stops at the same length: the times are the sum
            break
    return pieces_from_choices(lengths, choices)


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
    oneDNN's kernels); inf for the short path above SHORT_MAX_TOKENS."""
    if path == "short" and length > SHORT_MAX_TOKENS:
        return math.inf
    from megarl.models.attention import run_path

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
