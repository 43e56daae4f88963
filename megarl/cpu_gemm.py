"""--cpu-gemm: the trainer's fp32 GEMMs on CPU ranks through oneDNN where it is faster than torch's own BLAS.

torch's x86 wheels compute a CPU fp32 matmul with MKL, and MKL picks its code path by the CPU's vendor: on
AMD processors it runs its AVX2 kernels even where the CPU has AVX-512. oneDNN (torch's mkldnn, the library
vLLM's CPU backend computes its linear layers with) picks by instruction set. Measured on an AMD EPYC
development host with AVX-512 (2026-11-28, one thread): MKL 98-113 GFLOP/s per core on the bench model's
linear-layer GEMM shapes (forward, input and weight gradients), oneDNN 205-244 the way this module calls
it; a 2048^3 matmul on 2 threads 219 against 489 GFLOP/s. Where MKL runs its AVX-512 kernels (Intel CPUs) the two
are expected to be alike, so `auto` measures: each trainer rank times one GEMM both ways at start-up and
the ranks add up their times (one choice on every rank). A library is taken over the one the CPU leans to
only when at least 10% faster; the CPU leans to oneDNN where MKL's vendor check leaves AVX-512 unused (AMD
with AVX-512), to torch's elsewhere. Why a leaning: on a Zen 4 host (AVX-512 on 256-bit units) the 1024^3
probe read oneDNN at 0.85-0.96x MKL's time, either side of the margin, so auto chose either, while the
bench job's update ran 11-15% faster on oneDNN (docs/benchmarks.md); on an Intel Xeon, oneDNN faster on each
GEMM shape alone, the job's update ran 24% slower on it.

auto's choice is kept per machine (`$MEGARL_CACHE_DIR/cpu_gemm.json`, default ~/.cache/megarl), keyed by the
CPU (vendor, family, model, name, flags) and the torch version, and later runs take it without measuring, as Triton and
inductor keep their autotuning results. Why: the two libraries round differently, and where they are close
(an AVX-512 Zen 4 host: oneDNN 220 vs MKL 186 GFLOP/s on 2 threads, a ratio of 0.85 against the 0.9 margin)
the measurement went either way from run to run, so two runs of one job on one machine, or a run and its
resume, differed at fp32 rounding (seen in CI: a killed run against its reference, grad_norm 0.8294287 vs 0.8294280). Every
rank reads its own file and the ranks agree: only when all of them hold the same choice is it taken,
otherwise all measure again (a collective every rank joins) and each rank writes the result. Delete the
file to measure again; `--cpu-gemm onednn|torch` never reads or writes the GEMM choice. The same file keeps,
per attention shape, which attention path each sequence length takes (megarl/models/attention_paths.py:
`kept` and `keep` serve both).

What goes through it when oneDNN is chosen: Megatron's linear layers (forward, input gradient and the
weight gradient that gradient-accumulation fusion adds into main_grad: accelerator's CPU version of Apex's
wgrad GEMM) and the fused loss kernels' logits GEMMs (megarl/kernels/fused.py). Only where autograd does
not record (inside autograd Functions: oneDNN's op has no derivative), fp32 CPU tensors, a 2-D right operand
that is dense or a dense matrix transposed. Also the attention GEMMs of packed rows' sequences where those
paths were measured faster than torch's flash kernel (megarl/models/attention_paths.py); the other attention
(torch's own kernels), LoRA adapters and MoE experts keep torch's matmul. The HF rollout backend's linear layers
(megarl/hf_rollout.py) take oneDNN too in a process that chose it, through `linear_layers_through_onednn`.

oneDNN's results differ from MKL's by fp32 rounding (another order of the sums; tests/test_cpu_gemm.py
checks them against float64). It builds a kernel per GEMM shape and caches it
(ONEDNN_PRIMITIVE_CACHE_CAPACITY shapes); the first call of a new token count measured 3-5 ms longer than
the next (kernel creation and a freshly mapped output, not measured apart). A transposed left operand (the
weight gradient's) is copied contiguous first, or the other operand's transpose where smaller (`accumulate`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

BACKENDS = ("auto", "onednn", "torch")
AUTO_MARGIN = 0.9  # auto takes oneDNN when its time is at most this fraction of torch's
PROBE_SIZE = 1024  # auto's GEMM: PROBE_SIZE^3 (2.1 GFLOP: ~10-20 ms a try on one core)

CACHE_FILE = "cpu_gemm.json"

_state = {"onednn": False, "decided_by": "--cpu-gemm"}


def onednn_available() -> bool:
    """torch built with oneDNN and its linear op (`mkldnn::_linear_pointwise`, which inductor's CPU backend
    calls)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def using_onednn() -> bool:
    return _state["onednn"]


def use(backend: str) -> None:
    """Route the GEMMs named in the module docstring through `backend` ("onednn" or "torch") in this process."""
    if backend not in ("onednn", "torch"):
        raise ValueError(f"cpu_gemm.use: 'onednn' or 'torch', got {backend!r}")
    if backend == "onednn" and not onednn_available():
        raise RuntimeError("--cpu-gemm onednn: this torch has no oneDNN (torch.backends.mkldnn)")
    _state["onednn"] = backend == "onednn"
    if _state["onednn"]:
        _route_megatron_linear_layers()


def choose(requested: str, group=None) -> str:
    """The backend for `requested` ("auto", "onednn" or "torch"), put in use; `auto` takes the choice every
    rank of `group` (torch.distributed's default group when initialised; None in a single process) has kept
    for this machine, or times both on every rank, agrees and keeps the result (module docstring)."""
    backend, _state["decided_by"] = requested, "--cpu-gemm"
    if requested == "auto":
        backend, _state["decided_by"] = "torch", "no oneDNN in this torch"
        if onednn_available():
            backend = _kept_choice(group)
            if backend is not None:
                _state["decided_by"] = f"measured on this machine before, kept in {cache_path()}"
            else:
                backend, _state["decided_by"] = measure(group), "measured at start-up"
                keep_choice(backend)
    use(backend)
    return backend


def measure(group=None) -> str:
    """auto's measurement: one GEMM timed both ways on every rank of `group`, the times added up, `faster`'s
    rule. Puts nothing in use."""
    # the third entry counts the ranks whose CPU leans to torch's: oneDNN is leaned to only where that is
    # none, so that every rank applies the same rule to the same sums
    seconds = torch.tensor([_probe_seconds(_torch_gemm), _probe_seconds(_onednn_gemm),
                            float(leaning() != "onednn")], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(seconds, group=group)
    torch_seconds, onednn_seconds, other_leaning = seconds.tolist()
    return faster(torch_seconds, onednn_seconds, "torch" if other_leaning else "onednn")


def decided_by() -> str:
    """How the last `choose` decided, for the run's log line."""
    return _state["decided_by"]


def cache_path() -> Path:
    root = os.environ.get("MEGARL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megarl")
    return Path(root) / CACHE_FILE


def machine_key() -> str:
    """What auto's measurement depends on: the CPU (vendor, family, model and name as /proc/cpuinfo gives
    them, since a VM may name every generation "AMD EPYC"; a digest of its instruction-set flags, so a VM
    that hides AVX-512 is another machine) and the torch build, which brings its MKL and oneDNN."""
    import platform

    fields = _cpu_fields()
    cpu = " / ".join(fields.get(name, "") for name in ("vendor_id", "cpu family", "model", "model name",
                                                      "CPU implementer", "CPU part")).strip(" /")
    flags = fields.get("flags", fields.get("Features", ""))
    digest = hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]
    return f"{cpu or platform.processor()} | flags {digest} | torch {torch.__version__}"


def _cpu_fields() -> dict:
    """/proc/cpuinfo's fields of the first processor ({} where there is none: not Linux)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def leaning(fields: dict | None = None) -> str:
    """The library a close measurement keeps on this CPU: oneDNN on AMD CPUs with AVX-512, where MKL, which
    picks its code by the CPU's vendor, runs its AVX2 kernels and oneDNN its AVX-512 ones; torch's elsewhere
    (on Intel CPUs MKL runs its widest code, and torch's library is the one every other op uses)."""
    fields = _cpu_fields() if fields is None else fields
    amd_avx512 = fields.get("vendor_id") == "AuthenticAMD" and "avx512f" in fields.get("flags", "").split()
    return "onednn" if amd_avx512 else "torch"


def _read_kept() -> dict:
    try:
        kept = json.loads(cache_path().read_text())
        return kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: measure (and write a good one)
        return {}


def _kept_choice(group) -> str | None:
    """The GEMM library kept for this machine when every rank of `group` holds the same one, else None."""
    backend = kept(machine_key(), group)
    return backend if backend in ("onednn", "torch") else None


def keep_choice(backend: str) -> None:
    keep(machine_key(), backend)


def kept(entry: str, group=None):
    """The value kept under `entry` (a JSON value) when every rank of `group` holds the same one, else None:
    the ranks compare digests of their own files' values (one collective every rank joins)."""
    value = _read_kept().get(entry)
    digest = -1 if value is None else int(hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:15], 16)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)  # max of both: the largest and the smallest
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    largest, smallest = extremes[0].item(), -extremes[1].item()
    return value if largest == smallest != -1 else None


def keep(entry: str, value) -> None:
    """Write `value` under `entry` in this machine's file: every rank writes (a node's own disk may not be
    shared), through a file of its own renamed over the old one, so a reader never sees half a file."""
    path = cache_path()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**_read_kept(), entry: value}, indent=1, sort_keys=True) + "\n")
        os.replace(partial, path)
    except OSError as error:
        warnings.warn(f"megarl: could not keep {entry!r} in {path} ({error}); the next run measures again "
                      "and may choose otherwise", stacklevel=2)


def faster(torch_seconds: float, onednn_seconds: float, lean: str = "torch") -> str:
    """auto's rule: the library the CPU leans to (`lean`, from `leaning`) unless the other is clearly faster,
    so that a close measurement, which can go either way from run to run, always lands on the same side."""
    if lean == "onednn":
        return "torch" if torch_seconds <= AUTO_MARGIN * onednn_seconds else "onednn"
    return "onednn" if onednn_seconds <= AUTO_MARGIN * torch_seconds else "torch"


def _torch_gemm(a, b):
    return a @ b.t()


def _onednn_gemm(a, b):
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def _probe_seconds(gemm, tries: int = 3) -> float:
    # a generator of its own: the run's random state is the same whether auto measured or took a kept choice
    numbers = torch.Generator().manual_seed(0)
    a, b = (torch.randn(PROBE_SIZE, PROBE_SIZE, generator=numbers) for _ in range(2))
    gemm(a, b)  # the library's first call (oneDNN builds its kernel)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        gemm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def _routable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (_state["onednn"] and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            # no empty operand: oneDNN has no inner product over 0 rows (an MoE expert that got no tokens:
            # its weight gradient [out, 0] @ [0, in] raised "could not create a primitive descriptor")
            and a.numel() > 0 and b.numel() > 0
            and a.device.type == "cpu" and b.device.type == "cpu" and a.dtype == torch.float32
            and b.dtype == torch.float32 and b.dim() == 2 and a.dim() >= 2
            # b or b^T dense: oneDNN runs its reference kernel on a weight whose rows are strided apart (a
            # column block of a wider matrix): 22 ms for a 256 x 64 x 64 GEMM, measured
            and (b.is_contiguous() or b.t().is_contiguous())
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (a [..., k], b [k, n]): oneDNN's linear with weight b^T where routable, else torch's."""
    if _routable(a, b):
        return _onednn_gemm(a, b.t())
    return torch.matmul(a, b)


def accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out += a @ b (2-D): torch's addmm_ (the sum inside the GEMM), or oneDNN's product then one add.

    oneDNN's linear copies a left operand that is not row-major; the weight gradient's is a transposed
    [out, tokens] view. Where copying b's transpose instead is cheaper, it computes (b^T @ a^T)^T: b^T
    copied, a^T read in place as the weight, and the [in, out] product added transposed (a strided pass
    over the weight's size, not the tokens'). The smaller copy wins for a widening layer: one thread, 2,329
    tokens, the Zen 4-class host quiet, FC1's 512 -> 2816 weight gradient 64 against 70-71 ms, QKV's 512 ->
    768 18.5 against 19.1-19.7 ms; FC2 (1408 -> 512) keeps the old order (32.5 against 37 ms)."""
    if _routable(a, b) and a.dim() == 2 and out.dtype == torch.float32:
        if (not a.is_contiguous() and a.t().is_contiguous() and b.is_contiguous()
                and b.numel() + out.numel() < a.numel()):
            return out.add_(_onednn_gemm(b.t().contiguous(), a).t())
        return out.add_(_onednn_gemm(a, b.t()))
    return out.addmm_(a, b)


# oneDNN's batch-size hint for a reordered weight: every hint from 2 up gave the same speed at 1-32 rows and every
# hint the same values at any row count (measured, Zen 4); a hint of 1 picked a kernel twice as slow at 2-4 rows
REORDER_ROWS = 32


@contextlib.contextmanager
def linear_layers_through_onednn(module: torch.nn.Module):
    """Inside: every torch.nn.Linear of `module` with an fp32 CPU weight computes its forward with oneDNN's linear
    on a copy of its weight reordered, on entry, into oneDNN's blocked layout. Inference only: the copy is not the
    parameter, so nothing flows back to it, and weights written while inside are not seen (enter after a weight
    load). The copies, the size of those weights again, are dropped on exit.

    Why reordered once: oneDNN's linear on a plain fp32 weight reorders it at every call. On the few-row
    GEMMs of decoding (the HF rollout's: 1-32 rows, the bench model's 512 -> 1408 layer) the reordered weight
    measured 1.2-1.3x MKL's speed at 32 rows, 1.4x at 16 and 2.2x at 5 (Zen 4, one thread), the plain one
    1.0-1.1x; the results are the plain one's bit for bit. A row's result does not depend on the others of its
    batch (checked: 1, 5, 16 and 31 of 32 rows), so rows leaving a batch change no one's values; oneDNN caches
    a kernel per row count, built at that count's first call in the process."""
    linears = [layer for layer in module.modules()
               if type(layer) is torch.nn.Linear and "forward" not in vars(layer)
               and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
               and (layer.bias is None or layer.bias.dtype == torch.float32)]
    for layer in linears:
        weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), REORDER_ROWS)
        layer.forward = functools.partial(_onednn_linear, weight, layer.bias)
    try:
        yield
    finally:
        for layer in linears:
            del layer.forward


def _onednn_linear(weight, bias, x):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _MatmulsThroughOneDnn(TorchFunctionMode):
    """`torch.matmul` and `Tensor.matmul` through `matmul` while active; every other call unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.matmul or func is torch.Tensor.matmul) and len(args) == 2 and not kwargs:
            return matmul(*args)
        return func(*args, **(kwargs or {}))


def _through_onednn(function_class):
    """A subclass of Megatron's autograd Function whose forward and backward run Megatron's own under
    `_MatmulsThroughOneDnn`: its GEMMs are `torch.matmul(input, weight.t())` forward and
    `grad_output.matmul(weight)` backward (tensor_parallel/layers.py), the rest (communication, main_grad
    bookkeeping) stays Megatron's."""

    class ThroughOneDnn(function_class):
        @staticmethod
        def forward(ctx, *args):
            with _MatmulsThroughOneDnn():
                return function_class.forward(ctx, *args)

        @staticmethod
        def backward(ctx, *grads):
            with _MatmulsThroughOneDnn():
                return function_class.backward(ctx, *grads)

    ThroughOneDnn.__name__ = ThroughOneDnn.__qualname__ = function_class.__name__ + "ThroughOneDnn"
    ThroughOneDnn.megarl_original = function_class
    return ThroughOneDnn


@functools.cache
def _route_megatron_linear_layers() -> None:
    """Megatron's linear layers look their Function up by module-level name at each call
    (linear_with_grad_accumulation_and_async_allreduce, linear_with_frozen_weight)."""
    from megatron.core.tensor_parallel import layers

    for name in ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight"):
        setattr(layers, name, _through_onednn(getattr(layers, name)))
