"""megarl/vllm_logging.py: vLLM's expected per-sync reload warnings are silenced, every other warning kept.

The unit test emits records through vLLM's own layerwise-reload logger (no torchrun); the
end-to-end test runs the quickstart config for 2 and for 4 steps and checks that the
console carries no reload warning and no more vLLM warnings after 4 steps than after 2.
"""

import logging
import re

import pytest

from helpers import torchrun

from megarl.vllm_logging import ExpectedReloadWarnings, quiet_expected_reload_warnings

# vLLM's console format: "(MainProcess pid=1) WARNING 11-23 09:39:23 [layerwise.py:266] message"
VLLM_WARNING = re.compile(r"\bWARNING \d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \[")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_only_the_expected_reload_warnings_are_dropped():
    import inspect

    from vllm.model_executor.model_loader.reload import layerwise

    # The filter targets the logger and the message format vLLM really uses.
    assert 'logger.warning("%s: Failed to load weights", layer.__class__.__name__)' in inspect.getsource(layerwise)
    quiet = quiet_expected_reload_warnings()
    assert quiet_expected_reload_warnings() is quiet  # idempotent: one filter however often it is called
    assert [f for f in layerwise.logger.filters if isinstance(f, ExpectedReloadWarnings)] == [quiet]

    records = _Records()
    layerwise.logger.addHandler(records)
    try:
        for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "ParallelLMHead"):  # no checkpoint tensors
            layerwise.logger.warning("%s: Failed to load weights", layer)
        for layer in ("QKVParallelLinear", "VocabParallelEmbedding", "RMSNorm"):  # should have had weights
            layerwise.logger.warning("%s: Failed to load weights", layer)
        layerwise.logger.warning("RotaryEmbedding: something else went wrong")
        layerwise.logger.warning("%s: Failed to load weights (%d tensors)", "ParallelLMHead", 2)
        layerwise.logger.error("%s: Failed to load weights", "RotaryEmbedding")  # only the warning is expected
    finally:
        layerwise.logger.removeHandler(records)
    assert records.messages == [
        "QKVParallelLinear: Failed to load weights",
        "VocabParallelEmbedding: Failed to load weights",
        "RMSNorm: Failed to load weights",
        "RotaryEmbedding: something else went wrong",
        "ParallelLMHead: Failed to load weights (2 tensors)",
        "RotaryEmbedding: Failed to load weights",
    ]
    # Other vLLM loggers are untouched.
    assert not any(isinstance(f, ExpectedReloadWarnings) for f in logging.getLogger("vllm").filters)


def _console(tiny_model, tmp_path, steps):
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                      "--train-steps", str(steps), "--log-dir", tmp_path / f"tb{steps}", timeout=900)
    lines = (result.stdout + result.stderr).splitlines()
    assert len([line for line in lines if line.startswith("step ")]) == steps, result.stdout[-3000:]
    return lines


@pytest.mark.slow
def test_a_quickstart_run_prints_no_vllm_warning_per_step(tiny_model, tmp_path):
    """Before the filter every weight sync printed two reload warnings per engine (228 in 200 steps)."""
    two, four = (_console(tiny_model, tmp_path, steps) for steps in (2, 4))
    reload_warnings = [line for line in two + four if "WARNING" in line and "Failed to load weights" in line]
    assert not reload_warnings, reload_warnings
    warnings_two, warnings_four = ([line for line in lines if VLLM_WARNING.search(line)] for lines in (two, four))
    # vLLM's start-up warnings (eager mode, no tcmalloc, ...) come once; none may come per step.
    assert len(warnings_four) == len(warnings_two), "\n".join(warnings_four)
