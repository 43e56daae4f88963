"""Python's cyclic garbage collector while a rank starts: no full collection until the run is built.

A rank's start-up makes about 700,000 long-lived objects (the imports of torch, transformers, vLLM and
Megatron-core, then the engines and models). Python runs a full collection whenever the objects that
survived two younger collections have grown by a quarter, so it scans that growing heap again and again:
on the quickstart (2 ranks, the Zen 4-class host) 12 full collections took 3.3-3.5 s of each rank's start,
nine before the engine (mostly during imports), three vLLM's own explicit ones while it loads its model. Nearly all of
those objects live for the whole run, so the scans find almost nothing to free.

So a rank (megarl/train.py run as the main script, not imported) defers the full collections from its
first line; the young generations still collect, which is where short-lived cycles die. Before an
engine is built (megarl/rollout.py) one full collection frees any dead cycle and `gc.freeze()` takes
what is alive (the imports, arguments, datasets) out of later scans, as vLLM itself does with its
engine once started. When the run is built (the end of megarl/run.py's `build_run`)
`resume_full_collections` collects once more (the models: nothing start-up left in a dead cycle keeps host
or device memory) and restores the thresholds. The test suite's torchrun workers start the same way.
Measured on the quickstart's 1-step run, alternated three times: full collections 0.61-0.74 s per rank
instead of 3.26-3.53 s; the run 20.2 / 24.1 / 20.2 s against 23.2 / 23.8 / 24.8 s. The steps are
unchanged: vLLM's freeze already left their collections only the step's own objects.
"""

from __future__ import annotations

import gc

# The oldest generation's threshold while deferred: a full collection after this many collections of
# the middle one (about 700 x 10 x this many allocations), never during a start-up.
DEFERRED_THRESHOLD = 1_000_000
_saved: tuple[int, int, int] | None = None  # the thresholds before `defer_full_collections`


def defer_full_collections() -> None:
    """No automatic full collection until `resume_full_collections` (the young generations still run)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(_saved[0], _saved[1], DEFERRED_THRESHOLD)


def freeze_what_lives_for_the_run() -> None:
    """Everything alive now (collected first, so no dead cycle is kept) leaves the collector's scans; only
    while deferred (a rank of megarl/train.py starting), never in a process that builds a run otherwise."""
    if _saved is not None:
        gc.collect()
        gc.freeze()


def resume_full_collections() -> None:
    """The thresholds `defer_full_collections` found, after one full collection of the unfrozen objects."""
    global _saved
    if _saved is not None:
        gc.collect()
        gc.set_threshold(*_saved)
        _saved = None
