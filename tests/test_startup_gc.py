"""megarl/startup_gc.py in a fresh interpreter (it changes the collector of the whole process): while a rank
starts no automatic full collection runs however many objects it makes, the freeze before an engine frees
a dead cycle first and freezes the rest, resuming restores the thresholds, and a process that only imports
megarl.train (a test, a tool) keeps Python's collector as it was."""

import json
import os
import subprocess
import sys

from helpers import ROOT

PROBE = r"""
import gc, json, weakref

import megarl.train  # imported, not run as a rank's main script
from megarl import startup_gc

report = {"imported": gc.get_threshold()}
startup_gc.freeze_what_lives_for_the_run()  # not deferred: nothing frozen
report["frozen_undeferred"] = gc.get_freeze_count()

full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)


def full_collections_while_making(objects):
    full.clear()
    kept = [[index] for index in range(objects)]  # containers that live on, as a start-up's imports do
    return len(full)


report["full_by_default"] = full_collections_while_making(1_000_000)
startup_gc.defer_full_collections()
report["deferred"] = gc.get_threshold()
report["full_deferred"] = full_collections_while_making(1_000_000)


class Node:
    pass


alive, dead = Node(), Node()
alive.me, dead.me = alive, dead  # two cycles; both survive the young collections into the oldest generation
gc.collect(0)
gc.collect(1)
dead_ref = weakref.ref(dead)
del dead
gc.collect(1)  # young collections do not free a dead cycle in the oldest generation
report["dead_after_young"] = dead_ref() is None
startup_gc.freeze_what_lives_for_the_run()
report["dead_after_freeze"] = dead_ref() is None
report["alive_frozen"] = not any(obj is alive for obj in gc.get_objects(generation=2))  # frozen: in no generation
startup_gc.resume_full_collections()
report["resumed"] = gc.get_threshold()
print(json.dumps(report))
"""


def test_full_collections_wait_for_the_run_and_the_freeze_frees_dead_cycles_first():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    default = report["imported"]
    assert default[2] < 1000, report  # importing megarl.train left the collector as it was
    assert report["frozen_undeferred"] == 0, report
    assert report["full_by_default"] > 0, report  # the probe's objects are enough to start full collections
    assert report["deferred"] == [default[0], default[1], 1_000_000] and report["full_deferred"] == 0, report
    assert not report["dead_after_young"] and report["dead_after_freeze"] and report["alive_frozen"], report
    assert report["resumed"] == default, report
