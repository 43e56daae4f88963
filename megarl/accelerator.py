"""The one place that knows whether megarl runs on CUDA or on CPU ranks.

Everything device- or backend-dependent is decided here: the torch device, the
collective backend, the Megatron layer spec, and -- only when CUDA is absent --
the shims that let Megatron-core 0.16 run on CPU. Megatron-core hard-codes CUDA in
a handful of places (docs/design.md lists them); rather than fork it, we rebind those
names to CPU equivalents once, at start-up, before any Megatron object exists.
With CUDA present `apply_megatron_shims()` does nothing.

GPU-only code paths in megarl (all of them live here or are selected here):
  * NCCL process groups (`backend()`, `store_group`) and `cuda:<local_rank>` devices;
  * the Transformer Engine layer spec, when transformer_engine is importable, and with it
    Transformer Engine's varlen attention for --padding-free rows (elsewhere the local spec's
    core attention is megarl.models.attention's per-sequence one);
  * pinned host memory for offloaded tensors and handing freed memory back
    (`host_buffer`, `release_cached_memory`; the offload bookkeeping itself,
    megarl/offload.py, runs the same on CPU);
  * vLLM sleep/wake (see megarl.rollout) -- a logged no-op on CPU;
  * the Triton kernels of megarl/kernels (`default_kernels`, `check_supported`): on CPU only
    under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch
import torch.distributed as dist

ON_CUDA = torch.cuda.is_available()


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
    from megarl.models.attention import PackedDotProductAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention  # takes --padding-free rows
    return spec


def packed_sequence_params(lengths: list[int]):
    """Megatron's PackedSeqParams (THD format) for one row of sequences of these lengths laid end to end:
    Transformer Engine's varlen attention on GPU, megarl.models.attention's per-sequence local
    attention elsewhere."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.packing import offsets

    cu_seqlens = torch.tensor(offsets(lengths), dtype=torch.int32, device=device())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def host_buffer(nbytes: int) -> torch.Tensor:
    """Host bytes for an offloaded tensor: pinned on GPU hosts (the copy back is a DMA)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=ON_CUDA)


def release_cached_memory() -> None:
    """Hand freed device memory back (GPU: the caching allocator keeps it otherwise)."""
    if ON_CUDA:
        torch.cuda.empty_cache()


def store_group(store, rank: int, size: int, timeout, carries_device_tensors: bool):
    """A process group built directly on a store, outside the default world (it may span roles
    that live in different worlds). NCCL when it carries GPU tensors (weights), gloo for CPU
    tensors and pickled objects. Use its own collectives (`group.broadcast(t, root).wait()`)."""
    if ON_CUDA and carries_device_tensors:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def vllm_engine_kwargs(kv_cache_gb: float, gpu_memory_utilization: float, sleep_mode: bool) -> dict:
    """Memory and execution settings for an in-rank vLLM engine."""
    if ON_CUDA:
        # Sleep mode lets a colocated trainer have the memory back between rollouts.
        return dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
    # CPU: the KV cache must be sized explicitly (the default fails at start-up);
    # there is no CUDA graph to capture, and no sleep mode.
    return dict(kv_cache_memory_bytes=int(kv_cache_gb * 2**30), enforce_eager=True)


class _TorchWithCpuFactories:
    """`torch`, except that tensor factories asked for device="cuda" allocate on the CPU.

    Installed as the module-level `torch` of the few Megatron modules that
    create scalars and buffers with a literal device="cuda".
    """

    _FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange"})

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_factory_on_cpu, attr)
        return attr


def _factory_on_cpu(factory, *args, **kwargs):
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "cpu"
    return factory(*args, **kwargs)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip_grads.clip_grad_by_total_norm_fp32 without its CUDA type assert and kernel."""
    from megatron.core.utils import to_local_if_dtensor

    parameters = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def default_kernels() -> str:
    """--kernels auto: Triton's fused kernels on a GPU host that has Triton, the chunked torch ones otherwise."""
    from megarl import kernels

    return "triton" if ON_CUDA and kernels.triton_available() else "chunked"


def check_supported(args) -> str | None:
    """Why this host cannot run `args`, or None. (Called by arguments.validate_args.)"""
    if not ON_CUDA and args.params_dtype != "float32":
        return (f"--params-dtype {args.params_dtype} needs a GPU host: Megatron's mixed-precision "
                f"optimizer is CUDA-only; use float32 on CPU ranks")
    if args.kernels == "triton":
        from megarl import kernels

        if not kernels.triton_available():
            return ("--kernels triton needs Triton and a GPU (or Triton's interpreter, TRITON_INTERPRET=1, "
                    "for tests); use --kernels chunked on this host")
    return None


@functools.cache
def apply_megatron_shims() -> None:
    """Rebind Megatron-core's CUDA-only call sites to CPU versions (no-op on CUDA).

    Idempotent. Must run before Megatron models, optimizers or RNG trackers are
    built. Each shim names the site it replaces, so removing one when Megatron
    gains CPU support is a one-line change.
    """
    if ON_CUDA:
        return
    # Apex and Transformer Engine are GPU libraries: their absence is expected here.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    cpu = torch.device("cpu")

    # ~175 sites allocate with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: cpu
    # `.cuda()` moves (tied-embedding setup in language_module.py, a dozen more):
    # on a CPU host the tensor is already where it should be.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
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

    # Literal device="cuda" scalars and buffers: the fp32 optimizer's loss scale,
    # grad-norm reductions (and the local multi-tensor L2 norm in utils.py), the
    # schedules' token counter.
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    cpu_torch = _TorchWithCpuFactories()
    for module in (clip_grads, megatron_optimizer, schedules, megatron_utils):
        module.torch = cpu_torch
    # Grad clipping asserts param.grad.type() == 'torch.cuda.FloatTensor'.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
