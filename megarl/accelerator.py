"""The one place that knows whether megarl runs on CUDA or on CPU ranks.

Everything device- or backend-dependent is decided here: the torch device, the
collective backend, whether Transformer Engine and Triton run, and -- only when CUDA
is absent -- the shims that let Megatron-core 0.16 run on CPU. Megatron-core hard-codes CUDA in
a handful of places (docs/platform.md, "Megatron-core on CPU", lists them); rather than fork it, we rebind those
names to CPU equivalents once, at start-up, before any Megatron object exists.
With CUDA present `apply_megatron_shims()` only fixes Megatron's distributed optimizer over torch's Adam
(without Apex or Transformer Engine; see `_fix_distributed_optimizer_over_torch_adam`).

GPU-only code paths in megarl (all of them live here or are selected here):
  * NCCL process groups (`backend()`, `store_group`) and `cuda:<local_rank>` devices;
  * the Transformer Engine layer spec, when transformer_engine is importable
    (`transformer_engine_available`; megarl.models.megatron_gpt builds the spec), and with it
    Transformer Engine's varlen attention for --padding-free rows (elsewhere the local spec's
    core attention is megarl.models.attention's per-sequence one);
  * pinned host memory for offloaded tensors and handing freed memory back
    (`host_buffer`, `release_cached_memory`; the offload bookkeeping itself,
    megarl/offload.py, runs the same on CPU);
  * vLLM sleep/wake (see megarl.rollout) -- a logged no-op on CPU;
  * the reward model (--reward-model) on the rollout rank's GPU, and its moves to host memory between
    scoring calls when colocated (`module_to_host`, `module_to_device`; no-ops on CPU);
  * the Triton kernels of megarl/kernels (`triton_available`, `default_kernels`, `check_supported`):
    on CPU only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use; TF32 for the fp32
    matmul of the fused kernels' weight gradient (`tf32_matmuls`);
  * the precision check at start: fp32 parameters with packed rows or context parallelism under
    Transformer Engine are refused, other fp32 GPU runs warned about (`check_supported`,
    `precision_warning`; both take the device kind, so the tests check a GPU host's answers on CPU).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings

import torch
import torch.distributed as dist

from megarl import cpu_gemm

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


def transformer_engine_available(on_cuda: bool | None = None) -> bool:
    """Whether models get Transformer Engine's layer spec: a CUDA host (`on_cuda`, default this one)
    where transformer_engine imports."""
    return (ON_CUDA if on_cuda is None else on_cuda) and importlib.util.find_spec("transformer_engine") is not None


def packed_sequence_params(lengths: list[int]):
    """Megatron's PackedSeqParams (THD format) for one row of sequences of these lengths laid end to end:
    Transformer Engine's varlen attention on GPU, megarl.models.attention's per-sequence local
    attention elsewhere. With context parallelism the lengths are the whole slots
    (megarl/context_parallel.py), which TE and Megatron's THD RoPE read from the `_padded` boundaries;
    a slot's padding is attended as tokens after the sequence's end, so the two kinds of boundaries
    are the same."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.packing import offsets

    bounds = offsets(lengths)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device())
    # The same boundaries as Python ints, made once per micro-batch and carried by the tensor every layer is
    # handed: the paths without TE (packed attention, Gated DeltaNet, Megatron's THD RoPE as
    # elementwise.install routes it) cut the row with them, where reading cu_seqlens back would be a host sync
    # in every layer (and one per sequence in Megatron's RoPE).
    cu_seqlens.megarl_bounds = tuple(bounds)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def packed_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """A packed row's boundaries as Python ints: the host copy `packed_sequence_params` keeps on the tensor,
    or, for a tensor made elsewhere (Megatron's, a test's), its values read back (one host sync)."""
    bounds = getattr(cu_seqlens, "megarl_bounds", None)
    return list(bounds) if bounds is not None else cu_seqlens.tolist()


@contextlib.contextmanager
def tf32_matmuls(device_kind: str):
    """fp32 matmuls inside run as TF32 on tensor cores when `device_kind` is "cuda" (torch's default is
    full fp32, without tensor cores), and as before elsewhere; the setting is restored after. Through
    torch's new API (`fp32_precision`), set and restored to its value: torch 2.13 raises on a read of the
    legacy `allow_tf32` once the two APIs have left different values (measured on the CPU build)."""
    if device_kind != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def host_buffer(nbytes: int) -> torch.Tensor:
    """Host bytes for an offloaded tensor, exactly `nbytes`: pinned on GPU hosts (the copies are DMAs and can
    be non-blocking). Pinned by registering plain host memory (cudaHostRegister, as vLLM's KV offload does),
    not with pin_memory=True: torch's caching host allocator rounds each size up to a power of two
    (ATen/core/CachingHostAllocator.h, `PowerOf2Ceil`), up to twice the bytes. Registered for the life of
    the tensor (unregistered when it is freed)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if ON_CUDA and nbytes:
        import weakref

        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if error:
            raise RuntimeError(f"offload: pinning {nbytes} bytes of host memory failed (cudaHostRegister error "
                               f"{error})")
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def synchronize() -> None:
    """Wait for this rank's device work (non-blocking copies); a no-op on CPU, where copies are synchronous."""
    if ON_CUDA:
        torch.cuda.current_stream().synchronize()


def release_cached_memory() -> None:
    """Hand freed device memory back (GPU: the caching allocator keeps it otherwise)."""
    if ON_CUDA:
        torch.cuda.empty_cache()


def module_to_host(module: torch.nn.Module, on: torch.device) -> None:
    """Move a module's weights from accelerator device `on` to host memory and hand the device memory back
    (a colocated reward model between scoring calls); a no-op when `on` is the CPU."""
    if on.type != "cpu":
        module.to("cpu")
        release_cached_memory()


def module_to_device(module: torch.nn.Module, on: torch.device) -> None:
    """Back onto device `on` (the module's own, given by its owner: not necessarily `device()`); a no-op on
    the CPU."""
    if on.type != "cpu":
        module.to(on)


def device_context(on: torch.device):
    """Make `on` this thread's current CUDA device for a block; nothing for other devices. The current
    device is per thread: a thread the rank starts later (a reward pool's) begins on cuda:0, whatever
    set_device did in the main thread, so device work there (moves, the allocator's empty_cache, library
    handles) would otherwise run with GPU 0 current."""
    return torch.cuda.device(on) if on.type == "cuda" else contextlib.nullcontext()


def store_group(store, rank: int, size: int, timeout, carries_device_tensors: bool, name: str):
    """A process group built directly on a store, outside the default world (it may span roles
    that live in different worlds). NCCL when it carries GPU tensors (weights), gloo for CPU
    tensors and pickled objects. Use its own collectives (`group.broadcast(t, root).wait()`).

    Named `name` (NCCL's log lines and flight recorder show it). Warmed up before it is returned: one
    all-reduce of a one-element tensor on the group's device, so that NCCL's communicator is created
    here, on this rank's device (NCCL creates it lazily, at the first collective: without this, inside
    the first weight sync), and a member that never joins fails the build, naming the group."""
    if ON_CUDA and carries_device_tensors:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.group_name = name
        group, on = dist.ProcessGroupNCCL(store, rank, size, options), device()
        # The communicator on this rank's device now (what torch's new_group(device_id=...) does).
        group.eager_connect_single_device(on)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options.group_name = name
        group, on = dist.ProcessGroupGloo(store, rank, size, options), torch.device("cpu")
    ones = torch.ones(1, device=on)
    try:
        group.allreduce([ones]).wait()
    except RuntimeError as error:
        raise RuntimeError(f"process group {name!r} ({size} members): the warm-up collective at its build "
                           f"failed: {str(error).strip().splitlines()[0]}") from error
    if int(ones.item()) != size:
        raise RuntimeError(f"process group {name!r}: the warm-up all-reduce counted {int(ones.item())} "
                           f"members, expected {size}")
    return group


def vllm_engine_kwargs(kv_cache_gb: float, gpu_memory_utilization: float, sleep_mode: bool) -> dict:
    """Memory and execution settings for an in-rank vLLM engine."""
    if ON_CUDA:
        # Sleep mode lets a colocated trainer have the memory back between rollouts; only an engine that
        # sleeps asks for it (it routes every allocation through vLLM's CuMem allocator).
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


def triton_available(on_cuda: bool | None = None) -> bool:
    """Whether the Triton kernels can run here: Triton installed, and a CUDA device (`on_cuda`, default
    this host) or the Triton interpreter (TRITON_INTERPRET=1, which runs the kernels on CPU tensors, for
    tests)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return (ON_CUDA if on_cuda is None else on_cuda) or os.environ.get("TRITON_INTERPRET") == "1"


def default_kernels() -> str:
    """--kernels auto: Triton's fused kernels on a GPU host that has Triton, the chunked torch ones otherwise."""
    return "triton" if ON_CUDA and triton_available() else "chunked"


def check_supported(args, on_cuda: bool | None = None, transformer_engine: bool | None = None) -> str | None:
    """Why this host cannot run `args`, or None. (Called by arguments.validate_args.) `on_cuda` and
    `transformer_engine` (whether models get TE's layer spec) default to this host's; the tests pass
    them to check a GPU host's answers on CPU."""
    on_cuda = ON_CUDA if on_cuda is None else on_cuda
    te = transformer_engine_available(on_cuda) if transformer_engine is None else transformer_engine
    if not on_cuda and args.params_dtype == "float16":
        return ("--fp16 (--params-dtype float16) needs a GPU host: vLLM's CPU backend does not run float16 "
                "(CPU ranks train in fp32 or bf16; tests build the fp16 optimizer directly); use --bf16 on CPU ranks")
    if args.kernels == "triton" and not triton_available(on_cuda):
        return ("--kernels triton needs Triton and a GPU (or Triton's interpreter, TRITON_INTERPRET=1, "
                "for tests); use --kernels chunked on this host")
    # Transformer Engine's attention backends (transformer_engine/pytorch/attention/dot_product_attention/
    # utils.py, get_attention_backend): FlashAttention and FusedAttention take only fp16/bf16 q/k/v
    # ("Filter: Data type"), the unfused backend neither packed THD rows ("Filter: QKV layout") nor context
    # parallelism ("Filter: Context parallelism"). fp32 with either leaves no backend: the first forward
    # would raise "No dot product attention backend is available".
    if on_cuda and te and args.params_dtype == "float32":
        packed = [flag for flag, on in (("--padding-free", args.padding_free),
                                        (f"--context-parallel-size {args.context_parallel_size}",
                                         args.context_parallel_size > 1)) if on]
        if packed:
            return (f"{' with '.join(packed)} needs --bf16 (or --fp16) with Transformer Engine: its fused and flash "
                    f"attention take only 16-bit q/k/v and its unfused attention takes neither packed (THD) "
                    f"sequences nor context parallelism (--params-dtype is float32)")
    return None


def precision_warning(args, on_cuda: bool | None = None, transformer_engine: bool | None = None) -> str | None:
    """A line to print at start when a GPU run keeps fp32 parameters (that check_supported lets through):
    every matmul in fp32, and with Transformer Engine its unfused attention (the [s, s] scores in fp32
    memory) because its fused and flash attention take only 16-bit q/k/v; None otherwise."""
    on_cuda = ON_CUDA if on_cuda is None else on_cuda
    if not on_cuda or args.params_dtype != "float32":
        return None
    te = transformer_engine_available(on_cuda) if transformer_engine is None else transformer_engine
    attention = ("Transformer Engine's unfused attention (its fused and flash attention take only 16-bit q/k/v)"
                 if te else "Megatron's local attention")
    return f"--params-dtype float32 on a GPU: fp32 matmuls and {attention}; --bf16 is the fast setting"


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def fuse_torch_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside a Megatron optimizer to torch's fused kernel where its parameters
    are on CPU; returns how many parameter groups were switched.

    Without Apex or Transformer Engine Megatron builds plain torch.optim.AdamW with neither `fused` nor
    `foreach` (optimizer/__init__.py), and on CPU torch then picks its per-parameter loop: about eight
    element-wise passes per tensor (the step's 4-6% of the update on the bench job, issue 28). The fused
    CPU kernel (torch >= 2.4) makes one pass; the formula is the same, rounded in another order (fp32
    noise). On CUDA torch already picks its multi-tensor path by default, so those groups are left alone.
    Set before the first step, so torch creates each parameter's `step` as the fused path keeps it."""
    switched = 0
    for _, group in _torch_adam_groups(optimizer):
        params = group["params"]
        if params and all(p.device.type == "cpu" and p.dtype.is_floating_point for p in params) \
                and not group.get("differentiable"):
            group["fused"], group["foreach"] = True, False
            switched += 1
    return switched


def _torch_adam_groups(optimizer):
    """(torch Adam(W), parameter group) for each group of the torch Adams inside a Megatron optimizer (or
    a chain of them); Apex's or Transformer Engine's fused Adam and other optimizers are skipped."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                yield inner, group


def allocate_adam_states_on_host(optimizer) -> int:
    """Create the Adam moments of CPU parameter groups now, as torch's Adam(W) would at its first step
    (zeros, and a zero step counter of the dtype and device that step keeps); returns how many parameters
    got them. Nothing an update computes changes: the first step finds them and skips its own creation.

    Why: on CPU ranks, states created inside the first step take heap space the second step's activations
    then find occupied, so that step grows the heap and faults ~100 MB of fresh pages in (bench job,
    forced 128-token responses: the second update 7.04 s against 5.9-6.2 s for the later ones, 27-29k minor
    faults against 0; with the states made here 6.34 s, 10k faults). Made at start-up, the memory an
    update needs is also taken before the first rollout rather than after it. Left lazy on CUDA, where the
    caching allocator reuses blocks and a colocated vLLM engine sizes its memory after the trainer is built."""
    created = 0
    for inner, group in _torch_adam_groups(optimizer):
        if not all(p.device.type == "cpu" for p in group["params"]):
            continue
        for param in group["params"]:
            if not inner.state[param]:  # else loaded or stepped already
                inner.state[param] = _initial_adam_state(param, group)
                created += 1
    return created


def _initial_adam_state(param: torch.Tensor, group: dict) -> dict:
    """torch.optim.Adam._init_group's state for a parameter it has not seen (torch 2.13; tests/test_fast_paths.py
    compares it with the state torch makes itself)."""
    on_param_device = group["capturable"] or group["fused"]
    step_dtype = torch.float32 if group["fused"] or torch.get_default_dtype() != torch.float64 else torch.float64
    state = {"step": torch.zeros((), dtype=step_dtype, device=param.device if on_param_device else "cpu"),
             "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


class _CpuWeightGradientAccumulation:
    """Apex's `fused_weight_gradient_mlp_cuda` (the two entry points Megatron's linear layers call under
    gradient_accumulation_fusion, tensor_parallel/layers.py) on CPU: the weight gradient of a micro-batch
    added into DDP's main_grad by the GEMM itself (beta = 1), instead of a fresh gradient tensor that DDP's
    hook then adds in a second pass. 2-D inputs [tokens, in] and grad_output [tokens, out]."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == main_grad.dtype:  # through oneDNN where --cpu-gemm chose it
            cpu_gemm.accumulate(main_grad, grad_output.t(), total_input)
        else:  # a 16-bit model's fp32 main_grad: the GEMM in 16 bits, as the unfused path computes it
            main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _reporting_cuda_tensor_types(init):
    """`init` of a Megatron optimizer that sorts parameters by `param.type()` against CUDA names only
    ('torch.cuda.FloatTensor', ...; a CPU parameter raises TypeError): while it runs, a CPU float
    tensor's type() answers the CUDA name of its dtype. Only the constructors look (the steps use dtypes)."""
    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def type_(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[self.dtype]
            return original(self, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapped


def _state_dict_of_a_fresh_optimizer(state_dict):
    """DistributedOptimizer.state_dict without Apex or Transformer Engine reads Adam's per-parameter 'step'
    and asserts one value: a fresh optimizer (no step taken yet, as when a checkpoint is about to be loaded
    into it) has none. Give it zero moments and step 0 first, as a first step would; the load overwrites them."""
    @functools.wraps(state_dict)
    def wrapped(self):
        if not self.optimizer.state and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
        return state_dict(self)

    return wrapped


def _set_states_besides_step(set_states):
    """DistributedOptimizer._set_main_param_and_optimizer_states copies every key of the inner optimizer's
    state from the loaded tensors; torch's Adam (used without Apex or Transformer Engine) also keeps a
    'step' there, which the loaded tensors lack (load_state_dict sets it from the param groups). Leave it."""
    @functools.wraps(set_states)
    def wrapped(self, model_param, tensors):
        state = None
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if state is not None else None
        try:
            return set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return wrapped


def _dtoh_without_streams(self, point, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without its side stream: at the point where
    it copies the split sizes to the host, give them the types that copy gives (numpy arrays for the
    splits, which the all-to-all reads as lists); the tensors are on the host already."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _load_state_dict_with_a_step_per_parameter(load_state_dict):
    """DistributedOptimizer.load_state_dict without Apex or Transformer Engine hands every parameter's Adam
    state one shared 'step' tensor (Megatron-core 0.16.1, distrib_optimizer.py:817-825). torch's Adam adds 1
    to each parameter's step in place, so after a resume every optimizer step advanced the shared counter
    once per parameter (saved after step 2, the tiny model's 9 parameters read step 11 after step 3) and every
    later update had the wrong bias correction: the resumed run left the uninterrupted one. Give each
    parameter its own copy, as a run that never resumed has."""
    @functools.wraps(load_state_dict)
    def wrapped(self, state_dict):
        result = load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return result

    return wrapped


def _fix_distributed_optimizer_over_torch_adam() -> None:
    """Without Apex or Transformer Engine (CPU hosts, and CUDA hosts running the local layer spec) Megatron's
    distributed optimizer drives torch's Adam, whose per-parameter 'step' state three of its methods get
    wrong; on a CUDA host with either library it uses their fused Adam and none of this applies."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    optimizer_class = distrib_optimizer.DistributedOptimizer
    optimizer_class.state_dict = _state_dict_of_a_fresh_optimizer(optimizer_class.state_dict)
    optimizer_class._set_main_param_and_optimizer_states = _set_states_besides_step(
        optimizer_class._set_main_param_and_optimizer_states)
    optimizer_class.load_state_dict = _load_state_dict_with_a_step_per_parameter(optimizer_class.load_state_dict)


@functools.cache
def apply_megatron_shims() -> None:
    """Rebind Megatron-core's CUDA-only call sites to CPU versions (on CUDA only the torch-Adam fixes and,
    without Transformer Engine, the MoE router's name).

    Idempotent. Must run before Megatron models, optimizers or RNG trackers are
    built. Each shim names the site it replaces, so removing one when Megatron
    gains CPU support is a one-line change.
    """
    _fix_distributed_optimizer_over_torch_adam()
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        # On any host without Transformer Engine: the MoE router's gating GEMM (moe_utils.py:
        # RouterGatingLinearFunction) tests `te_general_gemm is not None`, a name bound only when TE imports
        # (a NameError otherwise); None selects its torch.mm path.
        moe_utils.te_general_gemm = None
        # Multi-latent attention (DeepSeek-V3) tests `HAVE_TE and isinstance(linear_proj, TELinear)` at
        # construction (multi_latent_attention.py: MultiLatentAttention.__init__); without TE its import of
        # megatron.core.extensions.transformer_engine succeeds with TELinear a MagicMock placeholder, so
        # HAVE_TE is True there and isinstance raises a TypeError. The flag as this host has it:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
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
    # So every fork draws from the CPU generator, and the tracker's check that the CPU state is untouched
    # inside a fork (restored on exit) logs "CPU RNG state changed within GPU RNG context" on each of them
    # (one line per adapter per forward with --lora-dropout): expected here, not a warning.
    import logging

    logging.getLogger(mp_random.__name__).setLevel(logging.ERROR)

    # Default causal mask is built with device="cuda" (transformer/utils.py).
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask

    # So is a sliding-window layer's (transformer/utils.py: get_sliding_window_causal_mask, which the local
    # attention's softmax calls for every forward of such a layer): the same mask on the host. True = masked:
    # outside skv - sq - left <= k - q <= skv - sq + right.
    def sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        visible = torch.ones(sq, skv, dtype=torch.bool).triu_(skv - sq - window_size[0])
        return ~visible.tril_(skv - sq + window_size[1])

    transformer_utils.get_sliding_window_causal_mask = sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask

    # Literal device="cuda" scalars and buffers: the fp32 optimizer's loss scale,
    # grad-norm reductions (and the local multi-tensor L2 norm in utils.py), the
    # schedules' token counter, the fp16 optimizer's loss scaler (its scale and factors:
    # the fp16 tests build it on CPU ranks).
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads, grad_scaler
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules

    cpu_torch = _TorchWithCpuFactories()
    for module in (clip_grads, grad_scaler, megatron_optimizer, schedules, megatron_utils):
        module.torch = cpu_torch
    # Grad clipping asserts param.grad.type() == 'torch.cuda.FloatTensor'.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # Gradient-accumulation fusion for the trained models (megatron_gpt.trainer_config_overrides turns it
    # on for them on CPU): the linear layers' Apex extension, and the check that refuses the option without it.
    from megatron.core.tensor_parallel import layers as tensor_parallel_layers

    tensor_parallel_layers.fused_weight_gradient_mlp_cuda = _CpuWeightGradientAccumulation
    tensor_parallel_layers._grad_accum_fusion_available = True

    # The distributed optimizer (--use-distributed-optimizer) and the mixed-precision one (bf16/fp16
    # parameters with fp32 main copies) sort parameters by `param.type()` against CUDA type names.
    from megatron.core.optimizer import distrib_optimizer

    for cls in (distrib_optimizer.DistributedOptimizer, megatron_optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _reporting_cuda_tensor_types(cls.__init__)

    # MoE's all-to-all token dispatcher (transformer/moe/token_dispatcher.py) creates a CUDA stream at its
    # first construction and copies its split sizes to the host on it: on CPU they are already there.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU ranks"  # not None: none is created
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_without_streams
