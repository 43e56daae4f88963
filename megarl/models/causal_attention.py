"""megarl's own causal attention for one sequence on a CPU rank, beside torch's flash kernel: whole-sequence GEMMs
with the softmax kept (`_ShortCausalAttention`) and blocks of query rows (`_BlockedCausalAttention`, recomputing or
keeping each block's probabilities), multiplied through megarl/cpu_gemm.py; `run_path` runs any of the four paths.
Which length takes which is measured per machine in megarl/models/attention_paths.py; megarl/models/attention.py
runs the chosen path on each sequence of a packed row. Kept apart from both so that neither imports the other's
user (attention_paths times these paths; attention takes its choice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl import cpu_gemm


def gemm_library() -> str:
    """The rank's GEMM library as the pieces and ATTENTION_BLOCK name it: "onednn" or "torch"."""
    return "onednn" if cpu_gemm.using_onednn() else "torch"


# query positions per block of the blocked paths, by GEMM library: one thread, 8 heads of 64 in 2 groups,
# forward + backward with the probabilities kept, the Zen 4-class host, one run of each block size: torch's
# (MKL's) GEMMs at 64 / 128 17.3-17.5 / 18.5-19.9 ms at 512 tokens, 58-62 / 59-63 ms at 1024; oneDNN's
# 19.4-21.2 / 18.6-20.6 ms and 62 / 58-61 ms (oneDNN builds a kernel per GEMM shape: smaller blocks, more)
ATTENTION_BLOCK = {"onednn": 128, "torch": 64}


def run_path(path: str, query, key, value, scale):
    """One sequence's causal attention on `path` (megarl/models/attention_paths.py: which length takes which):
    query [s, heads, dim], key and value [s, groups, dim] -> [s, heads, dim]."""
    if path in ("blocked", "kept"):
        block = ATTENTION_BLOCK[gemm_library()]
        return _BlockedCausalAttention.apply(query, key, value, scale, block, path == "kept")
    if path == "short":
        return _ShortCausalAttention.apply(query, key, value, scale)
    # 4-D [1, heads, s, dim]: torch picks its CPU flash kernel for 4-D inputs only (3-D falls back to the
    # math path, which keeps the scores); query head groups share their key/value heads (enable_gqa)
    return F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                          value.transpose(0, 1)[None], is_causal=True, scale=scale,
                                          enable_gqa=query.shape[1] > key.shape[1])[0].transpose(0, 1)


class _ShortCausalAttention(torch.autograd.Function):
    """One sequence's causal attention as GEMMs through megarl/cpu_gemm.py (oneDNN, or torch's BLAS where it
    is the rank's library) and a softmax, for the short sequences of packed rows on CPU ranks. torch's CPU
    flash kernel multiplies its blocks with MKL's sgemm, which runs its AVX2 code on AMD CPUs, and pays a
    fixed cost per call that dominates at a hundred tokens; here each query group's scores are one GEMM
    [s * heads_per_group, dim] x [dim, s] and the softmax is kept for the backward ([heads, s, s] per
    sequence: 0.6 MB at s = 142, 8 heads; 4.7 MB at 384). The formulas are the flash kernel's:
    P = softmax(scale Q K^T + causal mask), O = P V; dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q.

    query [s, heads, dim], key and value [s, groups, dim] (Megatron's THD pieces); output [s, heads, dim]."""

    @staticmethod
    def forward(ctx, query, key, value, scale):
        length, heads, dim = query.shape
        groups = key.shape[1]
        per_group = heads // groups
        # rows (position, head) of each group's queries, contiguous: [groups, s * per_group, dim]
        queries = query.reshape(length, groups, per_group, dim).transpose(0, 1).reshape(groups, -1, dim)
        future_bias = causal_bias(length, query)
        # each group's keys and values contiguous: cpu_gemm routes only a dense matrix or a dense one
        # transposed (with the strided ones through oneDNN's reference kernel, a 142-token sequence took
        # 834 ms instead of 1.27)
        keys, values = key.transpose(0, 1).contiguous(), value.transpose(0, 1).contiguous()  # [groups, s, dim]
        output = query.new_empty(length, groups, per_group, dim)
        probabilities = []
        for group in range(groups):
            scores = cpu_gemm.matmul(queries[group], keys[group].t()).mul_(scale)
            scores.view(length, per_group, length).add_(future_bias[:, None, :])
            weights = torch.softmax(scores, dim=-1)
            output[:, group] = cpu_gemm.matmul(weights, values[group]).view(length, per_group, dim)
            probabilities.append(weights)
        ctx.scale = scale
        ctx.save_for_backward(queries, keys, values, output, *probabilities)
        return output.view(length, heads, dim)

    @staticmethod
    def backward(ctx, grad_output):
        queries, keys, values, output, *probabilities = ctx.saved_tensors
        length, groups, per_group, dim = output.shape
        grad_output = grad_output.reshape(length, groups, per_group, dim)
        grad_query = torch.empty_like(output)
        grad_key, grad_value = keys.new_empty(length, groups, dim), values.new_empty(length, groups, dim)
        for group, weights in enumerate(probabilities):
            grad_rows = grad_output[:, group].reshape(-1, dim)  # [s * per_group, dim]
            output_rows = output[:, group].reshape(-1, dim)
            # dV^T = dO^T P and dK^T = Q^T dS: the transposed left operands are [dim, rows] (small) where
            # dV = P^T dO would copy the [rows, s] probabilities transposed
            grad_value[:, group] = cpu_gemm.matmul(grad_rows.t().contiguous(), weights).t()
            grad_scores = cpu_gemm.matmul(grad_rows, values[group].t())
            grad_scores.sub_(torch.linalg.vecdot(grad_rows, output_rows).unsqueeze(-1)).mul_(weights).mul_(ctx.scale)
            grad_query[:, group] = cpu_gemm.matmul(grad_scores, keys[group]).view(length, per_group, dim)
            grad_key[:, group] = cpu_gemm.matmul(queries[group].t().contiguous(), grad_scores).t()
        return grad_query.view(length, groups * per_group, dim), grad_key, grad_value, None


class _BlockedCausalAttention(torch.autograd.Function):
    """One long sequence's causal attention as blocks of query rows through megarl/cpu_gemm.py (oneDNN or
    torch's BLAS), the flash algorithm's order: per block of `block` positions only the keys up to the
    block's end (the causal half of the work). With `keep` the blocks' probabilities (torch's fused
    softmax) are kept for the backward (heads x ~s^2 / 2 x 4 bytes per sequence: what Megatron keeps
    without selective recompute), else per query row the softmax's log-sum-exp, from which the backward
    recomputes them (the flash kernel's memory: one GEMM and an exponential more per block); there the
    softmax's division goes into the [rows, dim] output, not the [rows, s] scores. The scale goes into the
    queries (one pass fewer over the scores each way). Formulas as in `_ShortCausalAttention` (P = exp(Q' K^T - lse) under the
    causal mask, Q' = scale Q; dQ = scale dS K, dK = dS^T Q'). query [s, heads, dim], key and value
    [s, groups, dim]; output [s, heads, dim]."""

    @staticmethod
    def forward(ctx, query, key, value, scale, block, keep):
        length, heads, dim = query.shape
        groups = key.shape[1]
        per_group = heads // groups
        # rows (position, head) of each group's scaled queries, contiguous: [groups, s * per_group, dim]
        queries = (query * scale).reshape(length, groups, per_group, dim).transpose(0, 1).reshape(groups, -1, dim)
        keys, values = key.transpose(0, 1).contiguous(), value.transpose(0, 1).contiguous()  # [groups, s, dim]
        future_bias = causal_bias(block, query)
        output = query.new_empty(groups, length * per_group, dim)
        log_sum_exp = query.new_empty(groups, length * per_group, 1)
        keep = keep and any(ctx.needs_input_grad[:3])  # a forward without a backward (logprobs) keeps nothing
        probabilities = []
        for group in range(groups):
            for start in range(0, length, block):
                end = min(start + block, length)
                rows = slice(start * per_group, end * per_group)
                scores = _block_scores(queries[group, rows], keys[group, :end], future_bias, start, end, per_group)
                if keep:  # torch's softmax: one fused kernel where the steps below are five passes
                    weights = torch.softmax(scores, dim=-1)
                    output[group, rows] = cpu_gemm.matmul(weights, values[group, :end])
                    probabilities.append(weights)
                    continue
                row_max = scores.amax(-1, keepdim=True)
                weights = scores.sub_(row_max).exp_()  # unnormalised
                total = weights.sum(-1, keepdim=True)
                output[group, rows] = cpu_gemm.matmul(weights, values[group, :end]).div_(total)
                log_sum_exp[group, rows] = total.log_().add_(row_max)
        ctx.scale, ctx.block = scale, block
        ctx.save_for_backward(queries, keys, values, output, log_sum_exp, *probabilities)
        # [groups, s * per_group, dim] -> [s, heads, dim]
        return output.view(groups, length, per_group, dim).transpose(0, 1).reshape(length, heads, dim)

    @staticmethod
    def backward(ctx, grad_output):
        queries, keys, values, output, log_sum_exp, *probabilities = ctx.saved_tensors
        groups, rows_total, dim = output.shape
        length = keys.shape[1]
        per_group = rows_total // length
        block = ctx.block
        grad_rows_all = grad_output.reshape(length, groups, per_group, dim).transpose(0, 1).reshape(groups, -1, dim)
        # D = rowsum(dO * O), the softmax backward's per-row term
        row_terms = torch.linalg.vecdot(grad_rows_all, output).unsqueeze(-1)
        future_bias = causal_bias(block, keys)
        grad_queries = torch.empty_like(queries)
        # dK^T and dV^T [groups, dim, s]: each block adds into the columns of its keys
        grad_keys_t = keys.new_zeros(groups, dim, length)
        grad_values_t = values.new_zeros(groups, dim, length)
        kept = iter(probabilities)
        for group in range(groups):
            for start in range(0, length, block):
                end = min(start + block, length)
                rows = slice(start * per_group, end * per_group)
                query_rows, grad_rows = queries[group, rows], grad_rows_all[group, rows]
                if probabilities:
                    weights = next(kept)
                else:
                    weights = _block_scores(query_rows, keys[group, :end], future_bias, start, end, per_group)
                    weights.sub_(log_sum_exp[group, rows]).exp_()
                grad_values_t[group, :, :end].add_(cpu_gemm.matmul(grad_rows.t().contiguous(), weights))
                grad_scores = cpu_gemm.matmul(grad_rows, values[group, :end].t())
                grad_scores.sub_(row_terms[group, rows]).mul_(weights)
                grad_queries[group, rows] = cpu_gemm.matmul(grad_scores, keys[group, :end])
                grad_keys_t[group, :, :end].add_(cpu_gemm.matmul(query_rows.t().contiguous(), grad_scores))
        heads = groups * per_group
        grad_query = grad_queries.mul_(ctx.scale).view(groups, length, per_group, dim).transpose(0, 1)
        return (grad_query.reshape(length, heads, dim), grad_keys_t.permute(2, 0, 1), grad_values_t.permute(2, 0, 1),
                None, None, None)


def _block_scores(query_rows, keys, future_bias, start, end, per_group):
    """Q' K^T of a block of (scaled) query rows (positions start..end, heads_per_group rows each) against the
    keys up to `end`, the future keys of the block's own positions at -inf: [(end - start) * per_group, end]."""
    scores = cpu_gemm.matmul(query_rows, keys.t())
    size = end - start
    scores.view(size, per_group, end)[:, :, start:].add_(future_bias[:size, None, :size])
    return scores


def causal_bias(size: int, like: torch.Tensor) -> torch.Tensor:
    """[size, size]: 0 where a query position (row) may see the key (column), -inf for the keys after it. Added
    to the scores rather than a boolean mask filled in: the same result for finite scores (x + 0 = x, x - inf =
    -inf), and a broadcast add over a block's [positions, heads, keys] view vectorises where masked_fill_
    does not (one thread, a 128-position block of 4 heads: 22 against 132 us)."""
    return torch.full((size, size), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)
