"""Fused vocabulary-parallel operations of the loss: one signature per operation, three
implementations selected by name (--kernels; the platform layer picks the default,
accelerator.default_kernels):

    "naive"    the unfused math of megarl/kernels/naive.py on full fp32 [tokens, V/TP] tensors:
               the reference the others are tested against.
    "chunked"  plain torch over chunks of token rows (kernels/torch_ops.py): besides the gradient
               it returns, nothing of size [tokens, V/TP] is held beyond one chunk; from hidden
               states the logits never exist beyond one chunk.
    "triton"   the same chunk loop with the per-chunk math in Triton kernels
               (kernels/triton_ops.py): one pass over each row's vocabulary, no [chunk, V/TP]
               fp32 temporaries. GPU (or the Triton interpreter, TRITON_INTERPRET=1, for tests).

Operations (every one correct at TP > 1; the outputs are the same on every TP rank):
    logprobs_and_entropy[_from_hidden]   the label token's log-prob and the entropy
    topk_logprobs[_from_hidden]          log-probs at the teacher's top-k ids and the tail log-mass
    select_topk                          the top-k ids and log-probs themselves (a teacher's, no gradient)
    distill_topk                         the top-k GKD loss (algorithms.topk_divergence) on those
    full_divergence / full_kl            full-vocabulary generalized JSD / KL(pi || ref) to logits
All take z = logits / T: a temperature scales the logits before every softmax. The sampled-token
operations and the KL to a reference also take a `HeldBack` (token ids the sampler held back at some
positions, --min-new-tokens): there those logits take no part in the softmax, as in the sampler's.
"""

from __future__ import annotations

import importlib

import torch

from megarl.kernels import fused
from megarl.kernels.fused import HeldBack  # the sampler constraint the operations take
from megarl.registry import Registry

# The fused implementations: the module of each one's per-chunk math, imported on first use (Triton's
# fails in one line without Triton). "naive" has no chunks: kernels/naive.py, called by each operation.
BACKENDS = Registry("kernel implementation")
BACKENDS.add("chunked", "megarl.kernels.torch_ops")
BACKENDS.add("triton", "megarl.kernels.triton_ops")
IMPLS = ("naive", *BACKENDS)

# Tokens per chunk, when not given: `default_chunk_tokens`, by the device kind of the tensors.
# CPU: as many as keep one fp32 [tokens, shard width] temporary within a budget, so the peak follows
# the shard width (vocabulary / TP), not a fixed count. From logits, 16 MiB (27 tokens of Qwen2's
# 151,936-entry vocabulary at TP=1): smaller chunks only cost more loop steps. From hidden states,
# 64 MiB (110 tokens): every chunk's weight gradient is a rank-`tokens` update of the whole [V/TP, H]
# fp32 buffer, memory-bound when the chunk is thin (bench/kernels.py: 27-token chunks made the
# hidden-state path 2.1x naive's time, 110 about 1.3x).
CHUNK_BYTES = 16 * 2**20
HIDDEN_CHUNK_BYTES = 64 * 2**20
# CUDA: a chunk of CPU size would be a few dozen Triton programs (one per token row) on a GPU's 100+
# SMs and hundreds of launches per micro-batch. There a chunk's temporaries get 2 GiB, and never fewer
# than CUDA_MIN_ROWS rows: 8 programs per SM of a 132-SM H100, and from hidden states a weight-gradient
# GEMM ([V/TP, rows] x [rows, H] added into the [V/TP, H] fp32 buffer, which it reads and writes once per
# chunk) of rows / 4 flops per byte of that buffer, 256 at 1024 rows: past an H100's TF32 ridge point
# (about 150). Rows are a multiple of CUDA_ROW_MULTIPLE (whole tensor-core tiles).
CUDA_CHUNK_BYTES = 2 * 2**30
CUDA_MIN_ROWS = 1024
CUDA_ROW_MULTIPLE = 128


def default_chunk_tokens(device: str, shard_width: int, hidden_size: int | None = None,
                         budget: int | None = None) -> int:
    """Token rows per chunk on a `device` kind ("cpu", "cuda", ...) for a vocabulary shard `shard_width`
    columns wide, from logits (`hidden_size` None) or from hidden states of `hidden_size`; `budget` (bytes)
    replaces the device's default. CPU (and any non-CUDA kind): one fp32 [rows, shard_width] temporary
    within the budget. CUDA: what a row costs from hidden states, its logits, their fp32 gradient and a
    copy of that in the hidden's dtype (4 bytes each at most) plus an fp32 copy of its hidden state (one
    fp32 row of temporaries from logits), within the budget, at least CUDA_MIN_ROWS."""
    width = max(shard_width, 1)
    if device != "cuda":
        budget = budget or (CHUNK_BYTES if hidden_size is None else HIDDEN_CHUNK_BYTES)
        return max(1, budget // (4 * width))
    per_row = 4 * width if hidden_size is None else 12 * width + 4 * hidden_size
    rows = max(CUDA_MIN_ROWS, (budget or CUDA_CHUNK_BYTES) // per_row)
    return rows - rows % CUDA_ROW_MULTIPLE


def backend(impl: str):
    """The per-chunk math module of a fused implementation."""
    if impl not in BACKENDS:
        raise ValueError(f"unknown kernel implementation {impl!r} ({', '.join(IMPLS)})")
    return importlib.import_module(BACKENDS[impl])


def _chunk(chunk_tokens: int | None, x: torch.Tensor, weight_shard: torch.Tensor | None = None) -> int:
    """`chunk_tokens`, or the default for the device of `x` (logits, or hidden states with `weight_shard`)."""
    if chunk_tokens:
        return chunk_tokens
    if weight_shard is None:
        return default_chunk_tokens(x.device.type, x.shape[-1])
    return default_chunk_tokens(x.device.type, weight_shard.shape[0], hidden_size=weight_shard.shape[-1])


def _copy_to_tp(hidden: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(hidden)


def logits_from_hidden(hidden: torch.Tensor, weight_shard: torch.Tensor) -> torch.Tensor:
    """Megatron's column-parallel output layer (no bias, no sequence parallelism): this shard's logits."""
    return torch.matmul(_copy_to_tp(hidden), weight_shard.t())


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float,
                         impl: str, chunk_tokens: int | None = None, weight_shard: torch.Tensor | None = None,
                         held_back: HeldBack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(z)[label], entropy of softmax(z)), each [b, L], from this TP rank's shard logits
    [b, L, V/TP]; differentiable in `logits` through both. A label no shard owns (e.g. -100) gives
    log p = M - log Z (M the largest z), as Megatron's vocab_parallel_cross_entropy. With
    `weight_shard`, `logits` are the hidden states (`logprobs_and_entropy_from_hidden`). With
    `held_back`, its ids are left out of the softmax at its positions (and get no gradient there)."""
    if weight_shard is not None:
        return logprobs_and_entropy_from_hidden(logits, weight_shard, labels, vocab_size, temperature, impl,
                                                chunk_tokens, held_back)
    if impl == "naive":
        from megarl.kernels import naive

        return (naive.logprobs(logits, labels, vocab_size, temperature, held_back),
                naive.entropy(logits, vocab_size, temperature, held_back))
    return fused.TokenLogprobEntropy.apply(backend(impl), fused.LogitsSource, vocab_size, temperature,
                                           _chunk(chunk_tokens, logits), held_back, labels, logits)


def logprobs_and_entropy_from_hidden(hidden: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                     vocab_size: int, temperature: float, impl: str, chunk_tokens: int | None = None,
                                     held_back: HeldBack | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_and_entropy` of the logits hidden @ weight_shard.T (Megatron's column-parallel output
    layer), differentiable in `hidden` [b, L, H] (replicated over the TP ranks) and `weight_shard`
    [V/TP, H]."""
    if impl == "naive":
        return logprobs_and_entropy(logits_from_hidden(hidden, weight_shard), labels, vocab_size, temperature, impl,
                                    held_back=held_back)
    return fused.TokenLogprobEntropy.apply(backend(impl), fused.HiddenSource, vocab_size, temperature,
                                           _chunk(chunk_tokens, hidden, weight_shard), held_back, labels,
                                           hidden, weight_shard)


def token_logprobs(output: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float, impl: str,
                   weight_shard: torch.Tensor | None = None, held_back: HeldBack | None = None) -> torch.Tensor:
    """The labels' log softmax(z) [b, L] alone, from logits or (with `weight_shard`) hidden states."""
    if impl == "naive" and weight_shard is None:
        from megarl.kernels import naive

        return naive.logprobs(output, labels, vocab_size, temperature, held_back)
    return logprobs_and_entropy(output, labels, vocab_size, temperature, impl, weight_shard=weight_shard,
                                held_back=held_back)[0]


def topk_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float, impl: str,
                  weight_shard: torch.Tensor | None = None,
                  chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(z) at the global vocabulary ids [..., K], log of the mass outside them [...], None
    when K == V), differentiable in the student. With `weight_shard`, `logits` are the hidden states
    [..., H] and the logits are hidden @ weight_shard.T, formed one chunk at a time."""
    tail_wanted = ids.shape[-1] < vocab_size
    if impl == "naive":
        from megarl.kernels import naive

        if weight_shard is not None:
            logits = logits_from_hidden(logits, weight_shard)
        tail = naive._tail_logprob(logits, ids, vocab_size, temperature)[..., 0] if tail_wanted else None
        return naive.gather_logprobs(logits, ids, vocab_size, temperature), tail
    if weight_shard is None:
        args = (fused.LogitsSource, vocab_size, temperature, _chunk(chunk_tokens, logits), ids, logits)
    else:
        args = (fused.HiddenSource, vocab_size, temperature, _chunk(chunk_tokens, logits, weight_shard), ids,
                logits, weight_shard)
    logprobs, tail = fused.TopkLogprobs.apply(backend(impl), *args)
    return logprobs, tail if tail_wanted else None


def select_topk(output: torch.Tensor, k: int, vocab_size: int, temperature: float, impl: str,
                weight_shard: torch.Tensor | None = None,
                chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of log softmax(z) over the whole sharded vocabulary: (global ids (long), logprobs), each
    [..., k], best first; no gradient (the colocated teacher's top-k). From this shard's logits, or with
    `weight_shard` from hidden states [..., H], the logits formed one chunk at a time; only the k candidates
    of each row cross the TP group. "naive": kernels/naive.py on the full logits."""
    if impl == "naive":
        from megarl.kernels import naive

        logits = output if weight_shard is None else logits_from_hidden(output, weight_shard)
        return naive.topk_logprobs(logits, k, vocab_size, temperature)
    if weight_shard is None:
        args = (fused.LogitsSource, vocab_size, temperature, _chunk(chunk_tokens, output), k, output)
    else:
        args = (fused.HiddenSource, vocab_size, temperature, _chunk(chunk_tokens, output, weight_shard), k, output,
                weight_shard)
    ids, logprobs = fused.select_topk(backend(impl), *args)
    return ids.view(*output.shape[:-1], k), logprobs.view(*output.shape[:-1], k)


def distill_topk(student: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vocab_size: int,
                 beta: float, temperature: float, mode: str, impl: str, weight_shard: torch.Tensor | None = None,
                 chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(algorithms.GKD_TOPK_MODES[mode]'s loss per position, the student's probability mass on the
    teacher's ids (a metric, detached)) from the student's logits, or hidden states with `weight_shard`."""
    from megarl.algorithms import topk_divergence

    logprobs, tail = topk_logprobs(student, teacher_ids, vocab_size, temperature, impl, weight_shard, chunk_tokens)
    return (topk_divergence(logprobs, tail, teacher_logprobs, beta, mode),
            logprobs.detach().exp().sum(dim=-1))


def full_divergence(logits: torch.Tensor, teacher_logits: torch.Tensor, vocab_size: int, beta: float,
                    temperature: float, impl: str, chunk_tokens: int | None = None) -> torch.Tensor:
    """algorithms.distill_full per position (the generalized JSD with beta over the whole vocabulary)
    from both models' shard logits; differentiable in the student's, the teacher's are constants."""
    if impl == "naive":
        from megarl.kernels import naive

        return naive.distill_full(logits, teacher_logits, vocab_size, beta, temperature)
    return _full_divergence(logits, teacher_logits, vocab_size, beta, temperature, impl, chunk_tokens)


def _full_divergence(logits, other_logits, vocab_size, beta, temperature, impl, chunk_tokens, held_back=None):
    return fused.FullDivergence.apply(backend(impl), vocab_size, temperature, beta,
                                      _chunk(chunk_tokens, logits), held_back, logits, other_logits.detach())


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, vocab_size: int, temperature: float, impl: str,
            chunk_tokens: int | None = None, held_back: HeldBack | None = None) -> torch.Tensor:
    """Exact KL(pi || ref) per position over the whole vocabulary (the reverse KL: beta = 1); with
    `held_back`, between both distributions without its ids at its positions."""
    if impl == "naive":
        from megarl.kernels import naive

        return naive.full_kl(logits, ref_logits, vocab_size, temperature, held_back)
    return _full_divergence(logits, ref_logits, vocab_size, 1.0, temperature, impl, chunk_tokens, held_back)

