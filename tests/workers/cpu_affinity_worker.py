"""Each rank binds itself as train.py does (--cpu-affinity MODE) and prints its threads' CPUs as JSON."""

import json
import os
import sys
import threading

from megarl import cpu_affinity

mode = sys.argv[1]
started_before = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
started_before.start()  # a thread that exists before the binding, as torch's and tokenizers' may
bound = cpu_affinity.bind(mode, int(os.environ["LOCAL_RANK"]), on_cuda=False)
started_after = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
started_after.start()
threads = {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
print("AFFINITY " + json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "bound": bound,
                                "threads": sorted(set(map(tuple, threads.values())))}), flush=True)
