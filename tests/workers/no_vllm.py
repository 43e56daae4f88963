"""Run a script (argv[1], with the rest of argv as its own) in a process where `import vllm` fails, as on a
machine without vLLM: tests/test_hf_rollout.py runs megarl/train.py --rollout-backend hf under it (torchrun)
and a short script that parses the arguments and builds the engine."""

import runpy
import sys


class BlockVllm:
    """A meta-path finder ahead of every other: vllm and its submodules raise ImportError."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"{name}: vLLM is blocked in this process (tests/workers/no_vllm.py)")
        return None


if __name__ == "__main__":
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules), "vllm already imported"
    sys.meta_path.insert(0, BlockVllm())
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
