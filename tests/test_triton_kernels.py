"""megarl/kernels/triton_ops.py on CPU under the Triton interpreter: each of the eight per-chunk
functions against torch_ops.py (its contract), and impl="triton" against impl="naive" through the
public API at TP=1, values and gradients within tests/helpers.py's rule for two fp32 paths.

The checks run in one subprocess (tests/workers/triton_kernels_worker.py) started with
TRITON_INTERPRET=1: Triton reads the variable when its jit functions, its own standard library's
included, are defined at import, and Megatron's parallel state imports Triton, so this process
(which may already have imported both) cannot switch the interpreter on; setting it here would
also leak into every later test's subprocesses. The interpreter runs each program in numpy (80 s on
two quiet cores), so the module is in the slow lane.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers import FP32_PATHS_ULPS, FP32_ULPS, ROOT, WORKERS, load_script, read_json

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow  # the interpreter subprocess takes over a minute


worker = load_script(WORKERS / "triton_kernels_worker.py")  # its case list; it imports torch, not Triton

FUNCTIONS = ["token_stats", "token_grad", "topk_stats", "topk_grad", "lse_stats", "full_terms", "full_direct_sum",
             "full_grad"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("triton") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(WORKERS / "triton_kernels_worker.py"), "--out", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return read_json(out)


def _cases(section: dict, what: str) -> dict:
    return {case: error for case, error in section.items() if case.split("/")[0] == what}


def _assert_close(cases: dict, limit: float = FP32_PATHS_ULPS):
    """Every error (in ulps, the worker's docstring) within `limit`; NaN fails too."""
    assert cases, "no case ran"
    over = {case: error for case, error in cases.items() if not error <= limit}
    assert not over, over


@pytest.mark.parametrize("function", FUNCTIONS)
def test_function_matches_torch_ops(report, function):
    """Rows 0, 1, 7; shards of 0 (padding only), 5, 37 and 130 columns in blocks of 16, strided views;
    fp32, bf16 and fp16 logits; a bf16 gradient buffer; labels and ids partly outside the shard;
    T = 0.7, 1, 1.3; every g_* None variant; a floored tail (log_rest = +inf); beta 0, 0.3, 1 with
    -inf and floored log-probs. Gradients leave the buffer's margin columns untouched."""
    cases = _cases(report["ops"], function)
    _assert_close(cases)
    for shape in worker.SHAPES:  # every shape ran
        assert any(worker.shape_name(shape) in case for case in cases), worker.shape_name(shape)


def test_inputs_untouched(report):
    _assert_close(_cases(report["ops"], "inputs_untouched"))


@pytest.mark.parametrize("op", list(worker.API_OPS))
def test_api_matches_naive(report, op):
    """impl="triton" against impl="naive" in a one-rank world: 7 tokens in chunks of 3 (not a divisor),
    7 and the default; T = 0.7, 1, 1.3; an unowned label; a floored top-k tail; masked tokens (zero
    upstream gradient) get exactly zero gradient; the inputs are left unchanged."""
    cases = _cases(report["api"], op)
    _assert_close(cases)
    assert any(case.endswith("/masked_grad") for case in cases)
    for temperature, chunk in worker.API_SETTINGS:  # every setting ran
        assert any(f"/T{temperature:g}_chunk{chunk}/" in case for case in cases), (temperature, chunk)


def test_triton_at_tp2_under_torchrun(tmp_path):
    """Every case of tests/workers/kernels_worker.py (logprob + entropy from logits and from hidden states,
    top-k GKD in both modes, full-vocabulary divergences and the KL to a reference, the teacher's top-k
    selection) on a real TP=2 group
    with the interpreter on: impl="triton" against a float64 reference, values and gradients within
    tests/helpers.py's fp32 rule, where the
    second shard is partly or entirely Megatron padding."""
    from helpers import torchrun

    out = tmp_path / "kernels.json"
    # One chunk size (5 rows of 14: a partial last chunk): the interpreter runs every Triton program in numpy,
    # and the chunk sizes' own cases run at TP=1 in test_api_matches_naive; what TP=2 adds is the sharded
    # vocabulary (a last shard partly, or entirely, Megatron padding), which every case here has.
    torchrun("kernels_worker.py", "--out", out, "--chunks", "5", nproc=2, timeout=900, env={"TRITON_INTERPRET": "1"})
    cases = read_json(out)["cases"]
    triton = {f"{case}/{metric}": value for case, metrics in cases.items() for metric, value in metrics.items()
              if metric.startswith("triton_")}
    assert {case.split("_")[0] for case in cases} == {"logits", "hidden", "topk", "full", "select"}
    assert all(sum(metric.startswith("triton_") for metric in metrics) >= 2 for metrics in cases.values())
    _assert_close(triton, FP32_ULPS)  # each implementation against float64 there
