"""The fused operations: one autograd Function per operation, a chunk loop over token rows, and
two sources of a chunk's logits (the logits themselves, or hidden states times the output-layer
weight shard, formed one chunk at a time and never kept). The per-chunk math comes from a
backend module (torch_ops or triton_ops, same contract); this module owns the TP reductions.

Saved for backward: the inputs (the caller's tensors, alive anyway) and a few floats per token;
backward recomputes each chunk's logits. The outputs are identical on every TP rank and each
rank's backward gives the gradient of those replicated outputs w.r.t. its own shard (identity
backward of the sums, as Megatron's vocab_parallel_cross_entropy), so a caller's loss needs no
TP reduction. From hidden states, the hidden's gradient sums every shard's part (all-reduced
here, Megatron's copy_to_tensor_model_parallel_region).

A `HeldBack` (token ids the sampler held back at some positions: vLLM's min_tokens) is applied
by the sources, chunk by chunk: the held-back logits of a chunk's constrained rows are set to a
huge negative value before the backend sees them, and their gradient is set to 0 after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl import accelerator, cpu_gemm


@dataclass(frozen=True)
class HeldBack:
    """Token ids the sampler held back at some positions, to score the policy under the sampler's own
    constraint: vLLM's min_tokens (--min-new-tokens) sets the logits of EOS and the stop ids to -inf
    before the N-th generated token, so the sampled tokens' logprobs there come from the softmax
    without them. At the `where` positions the `ids` take no part in any softmax of the operations
    that accept a HeldBack (probability 0, gradient 0); elsewhere nothing changes.

    ids    [K] long, global vocabulary ids (any TP shard may own them)
    where  bool, shaped like the labels (the logits without their vocabulary dimension)
    """

    ids: torch.Tensor
    where: torch.Tensor

    def on_shard(self, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the constrained positions, flattened [n], this shard's held-back columns [k], local to the
        shard of `width` columns whose first global id is `start`)."""
        local = self.ids.to(self.where.device) - start
        return self.where.reshape(-1).nonzero()[:, 0], local[(local >= 0) & (local < width)]


# z = x / T of a held-back logit in the fused path: finite (a -inf would give the backends' sums of
# p (z - m) 0 * -inf = NaN; the naive path uses the float's min, as for padding), and so far below any
# real logit that exp(z - M) is exactly 0 in fp32 and z - M stays finite.
HELD_BACK_Z = -1e30


class _Constraint:
    """A HeldBack on one source's rows and shard columns, applied one chunk of rows at a time (no
    [tokens, V/TP] mask is formed: only the constrained rows' held-back columns are written)."""

    def __init__(self, held_back: HeldBack, start: int, width: int, temperature: float):
        self.rows, self.columns = held_back.on_shard(start, width)
        self.x = HELD_BACK_Z * temperature  # the logit whose z = x / T is HELD_BACK_Z

    def _hit(self, rows: slice) -> torch.Tensor | None:
        """The constrained rows of the chunk `rows`, local to it (None: nothing to do here)."""
        if not len(self.columns):
            return None
        inside = self.rows[(self.rows >= rows.start) & (self.rows < rows.stop)] - rows.start
        return inside if len(inside) else None

    def chunk(self, x: torch.Tensor, rows: slice, fresh: bool) -> torch.Tensor:
        """The chunk's logits with the held-back ones set: an fp32 copy when any is (the value does not
        fit fp16), else `x` itself. `fresh`: `x` is the caller's own temporary (no copy needed in fp32)."""
        hit = self._hit(rows)
        if hit is None:
            return x
        x = x.float() if fresh else x.to(torch.float32, copy=True)
        x[hit[:, None], self.columns[None, :]] = self.x
        return x

    def zero_grad(self, buffer: torch.Tensor, rows: slice) -> None:
        """A held-back logit's gradient is 0 (it was replaced by a constant), whatever the backend wrote."""
        hit = self._hit(rows)
        if hit is not None:
            buffer[hit[:, None], self.columns[None, :]] = 0.0


def _constraint(held_back: HeldBack | None, start: int, width: int, temperature: float) -> _Constraint | None:
    return None if held_back is None else _Constraint(held_back, start, width, temperature)


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _tp_size(group) -> int:
    return dist.get_world_size(group)


def _real_columns(shard_width: int, vocab_size: int, group) -> tuple[int, int]:
    """(global index of this shard's first column, how many of its columns are real vocabulary).
    Padding sits at the end of the global vocabulary, hence at the end of a shard (or is all of it)."""
    start = dist.get_rank(group) * shard_width
    return start, max(0, min(shard_width, vocab_size - start))


# -------------------------------------------------------------------- sources ----
class LogitsSource:
    """Chunks of this shard's logits [*, V/TP]; the gradient goes into one [*, V/TP] buffer
    (padding columns keep 0)."""

    def __init__(self, logits: torch.Tensor, vocab_size: int, group, held_back: HeldBack | None = None,
                 temperature: float = 1.0):
        self.logits = logits
        self.x = logits.reshape(-1, logits.shape[-1])
        self.start, self.real = _real_columns(self.x.shape[-1], vocab_size, group)
        self.rows = self.x.shape[0]
        self.constraint = _constraint(held_back, self.start, self.real, temperature)

    def chunk(self, rows: slice) -> torch.Tensor:
        x = self.x[rows, :self.real]
        return x if self.constraint is None else self.constraint.chunk(x, rows, fresh=False)

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        self.grad = torch.zeros_like(self.x)

    def grad_buffer(self, rows: slice) -> torch.Tensor:
        return self.grad[rows, :self.real]

    def add_grad(self, rows: slice, buffer: torch.Tensor) -> None:
        pass  # written in place

    def grads(self, group) -> tuple:
        return (self.grad.view_as(self.logits),)


# fp16's largest finite value is 65504. Under a loss scale a logit's gradient reaches the scale times the
# per-token gradient (docs/scale.md), while the hidden state's gradient it makes, a sum over the vocabulary
# weighted by the output weights, is far smaller: a row of the fp32 logit gradient whose largest entry passes
# FP16_ROW_LIMIT is divided by a power of two before its cast to fp16 and the product multiplied back, which
# changes no mantissa (only entries over 2^28 times smaller than their row's largest fall below fp16's normal
# range and lose bits, which they would in the product's fp32 sum anyway).
FP16_ROW_LIMIT = 2.0**15


def _rows_to_fp16(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 rows [n, r] in fp16, each divided by the power of two 2^k >= 1 that brings its largest entry
    within FP16_ROW_LIMIT, 2^k per row [n, 1]), in place in `buffer` before the cast. A non-finite row stays
    non-finite (the loss scaler must see it)."""
    if buffer.shape[-1] == 0:  # a shard of padding only
        return buffer.to(torch.float16), buffer.new_ones(buffer.shape[0], 1)
    peak = buffer.abs().amax(dim=-1, keepdim=True)
    up = torch.exp2(torch.ceil(torch.log2(peak / FP16_ROW_LIMIT)).clamp_(min=0.0))
    return buffer.div_(up).to(torch.float16), up


class HiddenSource:
    """Chunks of hidden [*, H] @ weight_shard[:real].T; the gradients of both are accumulated chunk by
    chunk (the weight's in fp32: into its `main_grad`, where Megatron's DDP gave it one)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, group,
                 held_back: HeldBack | None = None, temperature: float = 1.0):
        self.hidden, self.weight = hidden, weight
        self.h = hidden.reshape(-1, hidden.shape[-1])
        self.start, self.real = _real_columns(weight.shape[0], vocab_size, group)
        self.w = weight[:self.real]  # padding rows of the output layer take no part
        self.rows = self.h.shape[0]
        self.constraint = _constraint(held_back, self.start, self.real, temperature)

    def chunk(self, rows: slice) -> torch.Tensor:
        x = cpu_gemm.matmul(self.h[rows], self.w.t())
        return x if self.constraint is None else self.constraint.chunk(x, rows, fresh=True)

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        self.want_hidden, self.want_weight = needs
        self.grad_hidden = torch.zeros_like(self.h) if self.want_hidden else None
        # Under Megatron's DDP the weight has an fp32 `main_grad` (grad_reduce_in_fp32) that its backward hook adds
        # each micro-batch's gradient into: the fp32 gradient goes straight there, as Megatron's gradient-
        # accumulation fusion does (tensor_parallel/layers.py), not rounded to the weight's 16 bits first.
        main_grad = getattr(self.weight, "main_grad", None)
        self.into_main_grad = (self.want_weight and main_grad is not None and main_grad.dtype == torch.float32
                               and hasattr(self.weight, "grad_added_to_main_grad"))
        if self.into_main_grad:
            self.grad_weight = main_grad
        else:
            self.grad_weight = (torch.zeros(self.weight.shape, dtype=torch.float32, device=self.weight.device)
                                if self.want_weight else None)

    def grad_buffer(self, rows: slice) -> torch.Tensor:
        n = len(range(*rows.indices(self.rows)))
        return torch.empty(n, self.real, dtype=torch.float32, device=self.h.device)

    def add_grad(self, rows: slice, buffer: torch.Tensor) -> None:
        if self.want_weight:
            # From the fp32 logit gradient as the backend wrote it (not rounded to a 16-bit hidden's dtype
            # first), accumulated in fp32; on CUDA in TF32 on tensor cores (accelerator.tf32_matmuls),
            # whose 10-bit mantissa still keeps more of the gradient than bf16's 7 bits Megatron's
            # 16-bit weight-gradient GEMM gets.
            with accelerator.tf32_matmuls(self.h.device.type):
                cpu_gemm.accumulate(self.grad_weight[:self.real], buffer.t(), self.h[rows].float())
        if self.want_hidden:  # in the hidden's dtype, as Megatron's input gradient (tensor cores in 16 bits)
            if self.h.dtype == torch.float16:  # after the weight's: scales `buffer` in place
                scaled, up = _rows_to_fp16(buffer)
                self.grad_hidden[rows] = cpu_gemm.matmul(scaled, self.w).float().mul_(up).to(torch.float16)
            else:
                self.grad_hidden[rows] = cpu_gemm.matmul(buffer.to(self.h.dtype), self.w)

    def grads(self, group) -> tuple:
        if self.want_hidden and _tp_size(group) > 1:  # every shard's logits depend on the hidden
            dist.all_reduce(self.grad_hidden, group=group)
        return (self.grad_hidden.view_as(self.hidden) if self.want_hidden else None, self._weight_grad())

    def _weight_grad(self) -> torch.Tensor | None:
        """The weight's gradient for autograd: the fp32 one in its dtype, or, when it went into `main_grad`,
        Megatron's placeholder (layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward): marked
        grad_added_to_main_grad, so that DDP's hook does not add it again, and zeros where the weight is also
        the embedding's on this stage (zero_out_wgrad: the hook then adds the lookup's gradient plus these)."""
        if not self.want_weight:
            return None
        if not self.into_main_grad:
            return self.grad_weight.to(self.weight.dtype)
        self.weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(self.weight, "zero_out_wgrad", False) else torch.empty
        return make(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)


def _chunks(total: int, chunk: int):
    for i in range(0, max(total, 1), chunk):  # no rows: one empty chunk, so the shapes still work out
        yield slice(i, min(i + chunk, total))


# ------------------------------------------------------------- TP combination ----
def _combine_max_and_sums(stats: torch.Tensor, group, sum_columns: list[int], exp_columns: list[int],
                          weighted: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """stats[:, 0] is each shard's max m; `exp_columns` hold sums of exp(z - m) (rescaled to the global
    max M), `weighted` = (its sum of exp(z - m)(z - m) column, the matching exp column), `sum_columns`
    plain sums (z at owned columns). Returns (M, the summed columns in the order given)."""
    m_local = stats[:, 0]
    m = m_local.clone()
    columns = exp_columns + ([weighted[0]] if weighted else []) + sum_columns
    sums = stats[:, columns].clone()
    if _tp_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        scale = (m_local - m).exp()
        n_exp = len(exp_columns)
        if weighted:
            # sum exp(z - M)(z - M) = scale (sum exp(z - m)(z - m) + (m - M) sum exp(z - m)), per shard.
            sums[:, n_exp] = scale * (sums[:, n_exp] + (m_local - m) * stats[:, weighted[1]])
        sums[:, :n_exp] *= scale[:, None]
        dist.all_reduce(sums, group=group)
    return m, sums


def _run(op_forward, source, chunk: int):
    return torch.cat([op_forward(source.chunk(rows), rows) for rows in _chunks(source.rows, chunk)])


def _statistics(tensors, source_cls, vocab_size: int, chunk: int, local_of, stats_of, **constraint):
    """The forward's chunk loop: (source, the local labels/ids local_of(source), per-row statistics
    stats_of(x, local rows) of every chunk, concatenated). `constraint`: the source's held_back and
    temperature, when it has one."""
    source = source_cls(*tensors, vocab_size, tp_group(), **constraint)
    local = local_of(source)
    return source, local, _run(lambda x, rows: stats_of(x, local[rows]), source, chunk)


def _add_grad(source, rows: slice, buffer: torch.Tensor) -> None:
    """A chunk's logit gradient into the source's inputs' gradients, 0 at its held-back logits."""
    if source.constraint is not None:
        source.constraint.zero_grad(buffer, rows)
    source.add_grad(rows, buffer)


def _gradients(needs_input_grad, tensors, source_cls, vocab_size: int, chunk: int, grad_of, **constraint) -> tuple:
    """The backward's chunk loop: grad_of(x, rows, buffer) writes each chunk's logit gradient into
    its buffer (0 at held-back logits); the source turns them into the inputs' gradients."""
    group = tp_group()
    source = source_cls(*tensors, vocab_size, group, **constraint)
    source.begin_backward(needs_input_grad)
    for rows in _chunks(source.rows, chunk):
        buffer = source.grad_buffer(rows)
        grad_of(source.chunk(rows), rows, buffer)
        _add_grad(source, rows, buffer)
    return source.grads(group)


# ------------------------------------------------------------ the operations ----
class TokenLogprobEntropy(torch.autograd.Function):
    """(log softmax(z)[label], entropy of softmax(z)) per row, z = logits / T, the held-back logits
    (a HeldBack or None) left out of the softmax at their positions."""

    @staticmethod
    def forward(ctx, backend, source_cls, vocab_size, temperature, chunk, held_back, labels, *tensors):
        ctx.set_materialize_grads(False)
        _, local, stats = _statistics(tensors, source_cls, vocab_size, chunk,
                                      lambda source: labels.reshape(-1) - source.start,
                                      lambda x, local: backend.token_stats(x, local, temperature),
                                      held_back=held_back, temperature=temperature)
        m, sums = _combine_max_and_sums(stats, tp_group(), sum_columns=[3, 4], exp_columns=[1], weighted=(2, 1))
        log_sum, expected = sums[:, 0].log(), sums[:, 1] / sums[:, 0]
        # A label no shard owns (e.g. -100) gives z = M (vocab_parallel_cross_entropy's convention).
        picked = torch.where(sums[:, 3] > 0, sums[:, 2], m)
        ctx.save_for_backward(local, m, log_sum, expected, *tensors)
        ctx.args = (backend, source_cls, vocab_size, temperature, chunk, held_back)
        return (picked - m - log_sum).view(labels.shape), (log_sum - expected).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        local, m, log_sum, expected, *tensors = ctx.saved_tensors
        backend, source_cls, vocab_size, temperature, chunk, held_back = ctx.args
        if grad_logprob is None and grad_entropy is None:
            return (None,) * (7 + len(tensors))
        g_lp, g_h = [None if g is None else g.reshape(-1).float() for g in (grad_logprob, grad_entropy)]

        def grad_of(x, rows, buffer):
            backend.token_grad(x, local[rows], temperature, m[rows], log_sum[rows], expected[rows],
                               None if g_lp is None else g_lp[rows], None if g_h is None else g_h[rows], buffer)

        return (None,) * 7 + _gradients(ctx.needs_input_grad[7:], tensors, source_cls, vocab_size, chunk, grad_of,
                                        held_back=held_back, temperature=temperature)


# A tail mass below this is floored (kernels.naive._tail_logprob clamps at the float's tiny).
_TINY = torch.finfo(torch.float32).tiny


class TopkLogprobs(torch.autograd.Function):
    """(log softmax(z) at the global ids [*, K], log of its mass outside them [*]) per row."""

    @staticmethod
    def forward(ctx, backend, source_cls, vocab_size, temperature, chunk, ids, *tensors):
        ctx.set_materialize_grads(False)
        k = ids.shape[-1]
        _, local, stats = _statistics(tensors, source_cls, vocab_size, chunk,
                                      lambda source: ids.reshape(-1, k) - source.start,
                                      lambda x, local: backend.topk_stats(x, local, temperature))
        m, sums = _combine_max_and_sums(stats, tp_group(), sum_columns=list(range(3, 3 + k)), exp_columns=[1, 2])
        log_sum = sums[:, 0].log()
        rest_ok = sums[:, 1] >= _TINY
        log_rest = sums[:, 1].clamp(min=_TINY).log()
        ctx.save_for_backward(local, m, log_sum, torch.where(rest_ok, log_rest, torch.inf), *tensors)
        ctx.args = (backend, source_cls, vocab_size, temperature, chunk)
        logprobs = sums[:, 2:] - (m + log_sum)[:, None]
        return logprobs.view(ids.shape), (log_rest - log_sum).view(ids.shape[:-1])

    @staticmethod
    def backward(ctx, grad_ids, grad_tail):
        local, m, log_sum, log_rest, *tensors = ctx.saved_tensors
        backend, source_cls, vocab_size, temperature, chunk = ctx.args
        if grad_ids is None and grad_tail is None:
            return (None,) * (6 + len(tensors))
        g_ids = (torch.zeros(local.shape, device=m.device) if grad_ids is None
                 else grad_ids.reshape(local.shape).float())
        g_tail = None if grad_tail is None else grad_tail.reshape(-1).float()

        def grad_of(x, rows, buffer):
            backend.topk_grad(x, local[rows], temperature, m[rows], log_sum[rows], log_rest[rows], g_ids[rows],
                              None if g_tail is None else g_tail[rows], buffer)

        return (None,) * 6 + _gradients(ctx.needs_input_grad[6:], tensors, source_cls, vocab_size, chunk, grad_of)


class FullDivergence(torch.autograd.Function):
    """algorithms.generalized_jsd(log softmax(zs), log softmax(zt), beta) per row over the whole
    vocabulary, differentiable in the student's logits (the teacher's are constants); a HeldBack
    leaves its logits out of both softmaxes at its positions."""

    @staticmethod
    def forward(ctx, backend, vocab_size, temperature, beta, chunk, held_back, logits, teacher_logits):
        ctx.set_materialize_grads(False)
        group = tp_group()
        student = LogitsSource(logits, vocab_size, group, held_back, temperature)
        teacher = LogitsSource(teacher_logits, vocab_size, group, held_back, temperature)
        log_z = []
        for source in (student, teacher):
            stats = _run(lambda x, rows: backend.lse_stats(x, temperature), source, chunk)
            m, sums = _combine_max_and_sums(stats, group, sum_columns=[], exp_columns=[1])
            log_z.append(m + sums[:, 0].log())
        loss = torch.cat([backend.full_terms(student.chunk(rows), teacher.chunk(rows), temperature, log_z[0][rows],
                                             log_z[1][rows], beta) for rows in _chunks(student.rows, chunk)])
        if _tp_size(group) > 1:
            dist.all_reduce(loss, group=group)
        ctx.save_for_backward(logits, teacher_logits, *log_z)
        ctx.args = (backend, vocab_size, temperature, beta, chunk, held_back)
        return loss.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 8
        logits, teacher_logits, log_zs, log_zt = ctx.saved_tensors
        backend, vocab_size, temperature, beta, chunk, held_back = ctx.args
        group = tp_group()
        student = LogitsSource(logits, vocab_size, group, held_back, temperature)
        teacher = LogitsSource(teacher_logits, vocab_size, group, held_back, temperature)
        g = grad.reshape(-1).float()
        # Every column's log-prob depends on log Zs: its share of the gradient needs the sum over the
        # whole vocabulary of the direct derivatives, one pass and one all-reduce before the second.
        direct_sum = torch.cat([backend.full_direct_sum(student.chunk(rows), teacher.chunk(rows), temperature,
                                                        log_zs[rows], log_zt[rows], beta, g[rows])
                                for rows in _chunks(student.rows, chunk)])
        if _tp_size(group) > 1:
            dist.all_reduce(direct_sum, group=group)
        student.begin_backward((True,))
        for rows in _chunks(student.rows, chunk):
            buffer = student.grad_buffer(rows)
            backend.full_grad(student.chunk(rows), teacher.chunk(rows), temperature, log_zs[rows], log_zt[rows], beta,
                              g[rows], direct_sum[rows], buffer)
            _add_grad(student, rows, buffer)
        return (None,) * 6 + (student.grads(group)[0], None)


# ---------------------------------------------------------- top-k selection ----
@torch.no_grad()
def select_topk(backend, source_cls, vocab_size: int, temperature: float, chunk: int, k: int,
                *tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(global ids, log softmax(z) at them) [rows, k], best first: the top k of the whole sharded
    vocabulary, no gradient (a teacher's), kernels.naive.topk_logprobs' result one chunk of rows at a
    time. Per chunk: the backend's log-sum-exp statistics and this shard's top k of z (one fp32 chunk);
    then the TP ranks combine the statistics and exchange only their k candidates per row."""
    group = tp_group()
    source = source_cls(*tensors, vocab_size, group)
    shard = source.x.shape[-1] if source_cls is LogitsSource else source.weight.shape[0]
    k_local = min(k, shard)  # as naive's z.topk over the (padded) shard
    stats, values, ids = [], [], []
    for rows in _chunks(source.rows, chunk):
        x = source.chunk(rows)
        stats.append(backend.lse_stats(x, temperature))
        z = x.float() / temperature
        if z.shape[-1] < k_local:  # a shard with fewer real columns than k: its padding columns, at the floor
            z = torch.cat([z, z.new_full((z.shape[0], k_local - z.shape[-1]), torch.finfo(z.dtype).min)], dim=-1)
        top = z.topk(k_local, dim=-1)
        values.append(top.values)
        ids.append(top.indices + source.start)
    m, sums = _combine_max_and_sums(torch.cat(stats), group, sum_columns=[], exp_columns=[1])
    values, ids = torch.cat(values), torch.cat(ids)
    if _tp_size(group) > 1:
        from megarl.kernels.naive import _all_gather_last_dim

        values, ids = _all_gather_last_dim(values, group), _all_gather_last_dim(ids, group)
        values, best = values.topk(k, dim=-1)
        ids = ids.gather(-1, best)
    return ids, values - (m + sums[:, 0].log())[:, None]
