"""--cpu-gemm auto's kept choice across 2 gloo ranks: each rank has its own cache directory (as nodes with
their own disks do), primed per case from argv; writes each case's outcome on this rank to
<out>/rank<r>.json (a file each: two ranks' prints can interleave on one line of torchrun's output)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from megarl import cpu_gemm

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
results = {}
for case in sys.argv[2:]:  # "<rank 0's kept choice>,<rank 1's>", "none" for no file; or "lean:<rank 0's
    # leaning>,<rank 1's>": no file, both libraries timed alike, so only the CPUs' leanings decide
    directory = out / case.replace(",", "-").replace(":", "-") / f"rank{rank}"
    directory.mkdir(parents=True)
    os.environ["MEGARL_CACHE_DIR"] = str(directory)
    kept = case.removeprefix("lean:").split(",")[rank]
    if case.startswith("lean:"):
        cpu_gemm.leaning = lambda fields=None, kept=kept: kept
        cpu_gemm._probe_seconds = lambda gemm, tries=3: 0.01
    elif kept != "none":
        cpu_gemm.keep_choice(kept)
    backend = cpu_gemm.choose("auto")
    results[case] = {"backend": backend, "decided_by": cpu_gemm.decided_by(),
                     "file": json.loads(cpu_gemm.cache_path().read_text())}
    cpu_gemm.use("torch")
(out / f"rank{rank}.json").write_text(json.dumps(results))
# as train.py ends: a hard exit once every rank is done. Interpreter teardown with gloo's and
# the CPU libraries' threads alive aborted once in CI ("terminate called without an active
# exception", SIGABRT) after the work was written
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
