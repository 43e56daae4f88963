"""Quiet vLLM's expected per-sync warnings; keep every other vLLM log record.

After every weight sync (`RolloutEngine.load_weights` -> vLLM's `reload_weights`),
vLLM's layerwise reload warns, once per layer and engine, about each layer that
had loadable tensors before but received none from the new weights:

    WARNING ... [layerwise.py:...] RotaryEmbedding: Failed to load weights
    WARNING ... [layerwise.py:...] ParallelLMHead: Failed to load weights

For megarl's syncs both are expected, not faults: a rotary embedding's cos/sin
cache is computed, never a checkpoint tensor, and a tied LM head shares the input
embedding's weight, which the sync sends as `embed_tokens` only (megarl then
re-derives the head's CPU kernel copy, see `rollout._refresh_tied_output_layer`).
vLLM falls back to the layer's current tensors, which is what megarl wants. Left
alone they are two lines per engine and step (hundreds in a 200-step quickstart)
that bury the step lines and any real warning.

The filter below sits on the one logger that emits them
(`vllm.model_executor.model_loader.reload.layerwise`) and drops a record only if
it is exactly that warning for a rotary-embedding class or `ParallelLMHead`.
Every other record of that logger (the same message at another level, or for any
other layer: an attention or MLP layer that really received no weights) and
every other vLLM logger pass through untouched. One limit: the record names only
the layer's class, so an *untied* head that failed to load would be silenced
too; megarl's converters always send an untied `lm_head.weight`, and a stale
head would show as rollout/trainer logprob mismatch (tests/test_families_vllm.py
syncs an untied Llama and compares the engine's logprobs with transformers').
"""

from __future__ import annotations

import logging

# Where vLLM 0.x logs it: vllm/model_executor/model_loader/reload/layerwise.py,
# `logger.warning("%s: Failed to load weights", layer.__class__.__name__)`.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MESSAGE = "%s: Failed to load weights"
# Layer classes that have no tensor of their own in a (tied) checkpoint.
NO_CHECKPOINT_TENSORS = ("ParallelLMHead",)
NO_CHECKPOINT_SUFFIX = "RotaryEmbedding"  # RotaryEmbedding, Llama3RotaryEmbedding, MRotaryEmbedding, ...


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers that have no checkpoint tensors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.levelno != logging.WARNING or record.msg != RELOAD_MESSAGE
                or not isinstance(record.args, tuple) or len(record.args) != 1):
            return True
        layer = str(record.args[0])
        return not (layer in NO_CHECKPOINT_TENSORS or layer.endswith(NO_CHECKPOINT_SUFFIX))


def quiet_expected_reload_warnings() -> logging.Filter:
    """Install the filter on vLLM's layerwise-reload logger, once per process; returns it.

    Safe before or after vLLM is imported (vLLM configures its loggers with
    `disable_existing_loggers=False`, so the filter survives its setup).
    """
    logger = logging.getLogger(RELOAD_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, ExpectedReloadWarnings):
            return existing
    quiet = ExpectedReloadWarnings()
    logger.addFilter(quiet)
    return quiet
