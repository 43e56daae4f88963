"""The one place that knows whether megarl runs on CUDA or on CPU ranks.

Everything device- or backend-dependent is decided here: the torch device, the
collective backend, the Megatron layer spec, and -- only when CUDA is absent --
the shims that let Megatron-core 0.16 run on CPU. Megatron-core hard-codes CUDA in
a handful of places (DESIGN.md lists them); rather than fork it, we rebind those
names to CPU equivalents once, at start-up, before any Megatron object exists.
With CUDA present `apply_megatron_shims()` does nothing.

GPU-only code paths in megarl (all of them live here or are selected here):
  * NCCL process groups and `cuda:<local_rank>` devices;
  * the Transformer Engine layer spec, when transformer_engine is importable;
  * vLLM sleep/wake (see megarl.rollout) -- a logged no-op on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ON_CUDA = torch.cuda.is_available()


def device_type() -> str:
    return "cuda" if ON_CUDA else "cpu"


def backend() -> str:
    """Backend for process groups that carry tensors of `device()`."""
    return "nccl" if ON_CUDA else "gloo"


def device(local_rank: int | None = None) -> torch.device:
    if not ON_CUDA:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def set_device(local_rank: int) -> None:
    if ON_CUDA:
        torch.cuda.set_device(local_rank)


def transformer_engine_available() -> bool:
    return ON_CUDA and importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(qk_layernorm: bool = False):
    """Transformer Engine spec on GPU hosts that have TE, the local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")


@functools.cache
def apply_megatron_shims() -> None:
    """Rebind Megatron-core's CUDA-only call sites to CPU versions (no-op on CUDA).

    Idempotent. Must run before Megatron models, optimizers or RNG trackers are
    built. Each shim names the site it replaces, so removing one when Megatron
    gains CPU support is a one-line change.
    """
    if ON_CUDA:
        return
    cpu = torch.device("cpu")

    # ~175 sites allocate with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: cpu
    # Checkpoint saving, DDP buffer (de)allocation.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # Megatron's RNG tracker forks "the CUDA generator": on CPU there is only one.
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    # Default causal mask is built with device="cuda" (transformer/utils.py).
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask
