import os
import subprocess
import sys

import pytest

from helpers import ROOT, make_random_qwen2

TINY_MODEL = ROOT / "artifacts" / "tiny-qwen2"


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The built-in tiny model; built once if this checkout has none yet."""
    if not (TINY_MODEL / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(TINY_MODEL)], cwd=ROOT,
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(TINY_MODEL)


@pytest.fixture(scope="session")
def random_qwen2_untied(tmp_path_factory) -> str:
    return make_random_qwen2(tmp_path_factory.mktemp("qwen2_untied"), tied=False, seed=1)


@pytest.fixture(scope="session")
def random_qwen2_tied(tmp_path_factory) -> str:
    return make_random_qwen2(tmp_path_factory.mktemp("qwen2_tied"), tied=True, seed=2)
