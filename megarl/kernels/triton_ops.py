"""Per-chunk math of the fused operations in Triton: the "triton" backend. Same eight functions,
arguments and outputs as torch_ops.py (the contract; read its docstring for the shapes).

Design. One program per token row (grid = (n,)) walks the row's r columns in blocks of BLOCK_V
and keeps a few fp32 scalars per row between blocks:

  * statistics (token_stats, topk_stats, lse_stats) are one online pass, as flash-attention's
    softmax or Liger-Kernel's cross-entropy: a running max m and sums of exp(z - m), rescaled by
    exp(m_old - m_new) whenever a block raises the max (the entropy's sum of exp(z - m)(z - m)
    shifts by (m_old - m_new) times the plain sum as well);
  * gradients (token_grad, topk_grad, full_grad) get the row's normalisers from the forward,
    so they are one pass that reads a block of x and writes the same block of `out`;
  * the full-vocabulary divergence is one pass per function (terms, the sum of the direct
    derivatives, the gradient), all three one kernel with a constexpr choosing what it produces.

Never materialised: z = x / T, the probabilities, the one-hot / top-k masks, or any other
[n, r] fp32 temporary (torch_ops builds several per chunk); the only [n, r] write is the
gradient into `out`, converted there to out's dtype. Inputs are read in their own dtype (fp32,
bf16, fp16) and converted to fp32 in registers; everything is computed in fp32 (no tl.dot, no
tf32). `x` and `out` are strided views (rows of a wider tensor), their strides go to the kernel.

The same kernels run compiled on a GPU and, for tests on CPU tensors, under the Triton
interpreter (TRITON_INTERPRET=1, which Triton reads when this module is imported).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from megarl.algorithms import LOGPROB_FLOOR
from megarl.kernels.torch_ops import _empty_stats  # a shard of padding only: the same statistics

# Columns per block: as wide as useful on a GPU (a row of a 150k vocabulary is ~37 blocks); under
# the interpreter each block is a numpy step, so narrow blocks keep tests fast and still cover the
# online rescaling across several blocks.
MAX_BLOCK_V = 4096
INTERPRETER_BLOCK_V = 64
# Teacher ids compared with a block of columns at a time: a [BLOCK_V, K_BLOCK] comparison, bounded
# so that K in the hundreds does not blow up a program's registers.
MAX_K_BLOCK = 16
# The top-k kernels hold that [BLOCK_V, K_BLOCK] tile (the comparisons, and in the gradient the g values
# gathered through them) besides the per-column vectors: at 4096 x 16 that is 512 values per thread of
# a 4-warp program, far past the registers, so it would spill to local memory. Their tile is kept to
# TOPK_TILE values, 32 per thread at TOPK_NUM_WARPS warps (`topk_blocks`: BLOCK_V 256 at K_BLOCK 16);
# the online softmax only needs more, narrower blocks for that.
TOPK_TILE = 4096
TOPK_NUM_WARPS = 4
# Warps per program of the other kernels, by block width (`num_warps`). Triton spreads a block's BLOCK_V columns
# over num_warps x 32 threads, so every fp32 vector a kernel keeps live across a block costs BLOCK_V / (32 x
# num_warps) registers per thread; the gradient kernels keep about six (z, z - m, p, the coefficient, the gradient,
# the column indices). At a fixed 4 warps a 4096-wide block is 32 registers per vector, ~190 for six, near the
# 255 a thread may have (estimated, not measured): likely spills to local memory. VALUES_PER_THREAD values per
# vector per thread instead: 4 warps (Triton's default) up to 1024 columns, 8 at 2048, 16 at 4096. Unsloth's and
# Liger-Kernel's row kernels (calculate_settings) take 8 warps from 2048 columns and 16 from 8192; these hold
# more live vectors per column, hence 16 one step earlier. The GPU lane prints each kernel's n_regs and n_spills.
VALUES_PER_THREAD = 8
MIN_NUM_WARPS, MAX_NUM_WARPS = 4, 32  # 32 warps: CUDA's 1,024 threads per block

# The running max starts here, not at -inf (see _token_stats_kernel); also torch_ops' max of a shard
# of padding only.
_FLOAT32_MIN = torch.finfo(torch.float32).min

# What _full_kernel produces (constexpr OUTPUT).
_TERMS, _DIRECT_SUM, _GRAD = 0, 1, 2


def block_v(r: int) -> int:
    """BLOCK_V for rows of r columns: a power of two, no wider than the row needs."""
    cap = INTERPRETER_BLOCK_V if os.environ.get("TRITON_INTERPRET") == "1" else MAX_BLOCK_V
    return max(16, min(cap, triton.next_power_of_2(max(r, 1))))


def num_warps(block: int) -> int:
    """Warps per program for blocks of `block` columns: VALUES_PER_THREAD per thread, within Triton's 4 and
    CUDA's 32 (4 up to 1024, 8 at 2048, 16 at 4096)."""
    return max(MIN_NUM_WARPS, min(MAX_NUM_WARPS, block // (32 * VALUES_PER_THREAD)))


def _k_block(k: int) -> int:
    return max(2, min(MAX_K_BLOCK, triton.next_power_of_2(max(k, 1))))


def topk_blocks(r: int, k: int) -> tuple[int, int]:
    """(BLOCK_V, K_BLOCK) of the top-k kernels for rows of r columns and k ids: block_v(r) narrowed
    until the [BLOCK_V, K_BLOCK] tile holds at most TOPK_TILE values (both stay powers of two)."""
    k_block = _k_block(k)
    return min(block_v(r), TOPK_TILE // k_block), k_block


# ------------------------------------------------------------------ shared jit helpers ----
@triton.jit
def _load_z(x_row, cols, r, stride_v, temperature, other):
    """z = x / T at this block's columns, fp32; `other` where the column is past the row's end."""
    mask = cols < r
    x = tl.load(x_row + cols * stride_v, mask=mask, other=other).to(tl.float32)
    return x / temperature, mask


@triton.jit
def _online(m, s, z):
    """One block into a row's running max m and sum s of exp(z - m). z is -inf past the row's end
    (exp gives 0). Returns (new max, new sum, the rescale factor of older sums, exp(z - new max))."""
    m_new = tl.maximum(m, tl.max(z, 0))
    alpha = tl.exp(m - m_new)
    e = tl.exp(z - m_new)
    return m_new, s * alpha + tl.sum(e, 0), alpha, e


@triton.jit
def _id_hits(cols, ids_row, stride_k, g_row, stride_gk, K, K_BLOCK: tl.constexpr, WITH_G: tl.constexpr):
    """(whether each column of the block is one of the row's K ids, the sum of g at the matching id:
    the one-hot scatter of g, done as a gather). Ids are distinct; ids of other shards (< 0 or
    >= r) never match a real column."""
    hits = tl.zeros_like(cols)
    g_sum = tl.zeros_like(cols).to(tl.float32)
    for k0 in range(0, K, K_BLOCK):
        ks = k0 + tl.arange(0, K_BLOCK)
        ids = tl.load(ids_row + ks * stride_k, mask=ks < K, other=-1)
        match = cols[:, None] == ids[None, :]
        hits += tl.sum(match.to(tl.int32), 1)
        if WITH_G:
            g = tl.load(g_row + ks * stride_gk, mask=ks < K, other=0.0)
            g_sum += tl.sum(tl.where(match, g[None, :], 0.0), 1)
    return hits > 0, g_sum


# ------------------------------------------------------------------------- kernels ----
@triton.jit
def _token_stats_kernel(x_ptr, stride_xn, stride_xv, labels_ptr, stride_l, stats_ptr, r, temperature,
                        FLOAT32_MIN: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    # Starting at the dtype's min, not -inf: the first rescale is then exp(-huge) * 0 = 0, not NaN.
    m = FLOAT32_MIN
    s = 0.0
    w = 0.0  # sum exp(z - m)(z - m)
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z, mask = _load_z(x_row, cols, r, stride_xv, temperature, float("-inf"))
        m_new, s_new, alpha, e = _online(m, s, z)
        # Shifting the reference from m to m_new: sum e'(z - m_new) = alpha (w + (m - m_new) s). Where
        # e = 0 (past the row's end, or a -inf logit, where torch_ops gets 0 * -inf = NaN) it adds 0.
        w = alpha * (w + (m - m_new) * s) + tl.sum(e * tl.where(e > 0, z - m_new, 0.0), 0)
        m, s = m_new, s_new
    label = tl.load(labels_ptr + row * stride_l)
    owned = (label >= 0) & (label < r)
    picked = tl.load(x_row + label * stride_xv, mask=owned, other=0.0).to(tl.float32) / temperature
    out = stats_ptr + row * 5
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, w)
    tl.store(out + 3, tl.where(owned, picked, 0.0))
    tl.store(out + 4, owned.to(tl.float32))


@triton.jit
def _token_grad_kernel(x_ptr, stride_xn, stride_xv, labels_ptr, stride_l, m_ptr, log_sum_ptr, expected_ptr,
                       g_lp_ptr, g_h_ptr, out_ptr, stride_on, stride_ov, r, temperature,
                       HAS_LP: tl.constexpr, HAS_H: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    out_row = out_ptr + row * stride_on
    m = tl.load(m_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    if HAS_LP:
        g_lp = tl.load(g_lp_ptr + row)
        label = tl.load(labels_ptr + row * stride_l)
    if HAS_H:
        expected = tl.load(expected_ptr + row)
        g_h = tl.load(g_h_ptr + row)
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z, mask = _load_z(x_row, cols, r, stride_xv, temperature, 0.0)
        shifted = z - m
        p = tl.exp(shifted - log_sum)
        # d/dz = g_lp (onehot - p) - g_h p (z - M - E)
        if HAS_H:
            coef = (shifted - expected) * g_h
            if HAS_LP:
                coef += g_lp
        else:
            coef = g_lp
        grad = -(p * coef)
        if HAS_LP:
            grad += tl.where(cols == label, g_lp, 0.0)  # an unowned label matches no column
        grad = grad / temperature
        tl.store(out_row + cols * stride_ov, grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _topk_stats_kernel(x_ptr, stride_xn, stride_xv, ids_ptr, stride_in, stride_ik, stats_ptr, stride_sn, r, K,
                       temperature, FLOAT32_MIN: tl.constexpr, BLOCK_V: tl.constexpr, K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    ids_row = ids_ptr + row * stride_in
    m = FLOAT32_MIN
    s = 0.0
    rest = 0.0
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z, mask = _load_z(x_row, cols, r, stride_xv, temperature, float("-inf"))
        m_new, s_new, alpha, e = _online(m, s, z)
        member, _ = _id_hits(cols, ids_row, stride_ik, ids_row, stride_ik, K, K_BLOCK, False)
        # The rest is summed directly (not sum - top-k): the tail mass is often tiny next to the total.
        rest = rest * alpha + tl.sum(tl.where(member, 0.0, e), 0)
        m, s = m_new, s_new
    out = stats_ptr + row * stride_sn
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, rest)
    for k0 in range(0, K, K_BLOCK):
        ks = k0 + tl.arange(0, K_BLOCK)
        ids = tl.load(ids_row + ks * stride_ik, mask=ks < K, other=-1)
        owned = (ks < K) & (ids >= 0) & (ids < r)
        picked = tl.load(x_row + ids * stride_xv, mask=owned, other=0.0).to(tl.float32) / temperature
        tl.store(out + 3 + ks, tl.where(owned, picked, 0.0), mask=ks < K)


@triton.jit
def _topk_grad_kernel(x_ptr, stride_xn, stride_xv, ids_ptr, stride_in, stride_ik, m_ptr, log_sum_ptr, log_rest_ptr,
                      g_ids_ptr, stride_gn, stride_gk, g_tail_ptr, out_ptr, stride_on, stride_ov, r, K, temperature,
                      HAS_TAIL: tl.constexpr, BLOCK_V: tl.constexpr, K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    out_row = out_ptr + row * stride_on
    ids_row = ids_ptr + row * stride_in
    g_row = g_ids_ptr + row * stride_gn
    m = tl.load(m_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    total = 0.0
    for k0 in range(0, K, K_BLOCK):
        ks = k0 + tl.arange(0, K_BLOCK)
        total += tl.sum(tl.load(g_row + ks * stride_gk, mask=ks < K, other=0.0), 0)
    if HAS_TAIL:
        g_tail = tl.load(g_tail_ptr + row)
        # log_rest = +inf where the tail mass was floored: exp(-inf) = 0, no tail gradient.
        log_rest = tl.load(log_rest_ptr + row)
        total += g_tail
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z, mask = _load_z(x_row, cols, r, stride_xv, temperature, 0.0)
        shifted = z - m
        # d/dz_v = sum_k g_k [v = id_k] - p_v (sum_k g_k + g_tail) + g_tail [v not in ids] exp(z_v - M - log_rest)
        grad = tl.exp(shifted - log_sum) * -total
        member, onehot = _id_hits(cols, ids_row, stride_ik, g_row, stride_gk, K, K_BLOCK, True)
        if HAS_TAIL:
            grad += tl.where(member, 0.0, tl.exp(shifted - log_rest) * g_tail)
        grad = (grad + onehot) / temperature
        tl.store(out_row + cols * stride_ov, grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lse_stats_kernel(x_ptr, stride_xn, stride_xv, stats_ptr, r, temperature,
                      FLOAT32_MIN: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    m = FLOAT32_MIN
    s = 0.0
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z, mask = _load_z(x_row, cols, r, stride_xv, temperature, float("-inf"))
        m, s, alpha, e = _online(m, s, z)
    tl.store(stats_ptr + row * 2, m)
    tl.store(stats_ptr + row * 2 + 1, s)


@triton.jit
def _jsd(ls, lt, beta, log_1m_beta, log_beta, FLOOR: tl.constexpr, MODE: tl.constexpr):
    """(algorithms.generalized_jsd_terms, its derivative in ls at fixed normalisers) per column.
    Both log-probs are floored at FLOOR in value; the student's floor is straight-through (the
    derivative is taken at the floored value, and is 0 where ls is not finite). MODE: 0 for
    beta == 0 (KL(teacher || student)), 1 for beta == 1 (KL(student || teacher)), 2 mixed."""
    lsf = tl.maximum(ls, FLOOR)
    ltf = tl.maximum(lt, FLOOR)
    if MODE == 0:
        pt = tl.exp(ltf)
        term = pt * (ltf - lsf)
        direct = -pt
    elif MODE == 1:
        ps = tl.exp(lsf)
        term = ps * (lsf - ltf)
        direct = ps * (lsf - ltf + 1.0)
    else:
        # lm = logaddexp(ls + log(1 - beta), lt + log(beta)), the mixture's log-prob; d lm / d ls
        # cancels against the mixture's own terms, leaving (1 - beta) p_s (ls - lm).
        a = lsf + log_1m_beta
        b = ltf + log_beta
        hi = tl.maximum(a, b)
        lm = hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))
        ps = tl.exp(lsf)
        term = beta * tl.exp(ltf) * (ltf - lm) + (1.0 - beta) * (ps * (lsf - lm))
        direct = (1.0 - beta) * (ps * (lsf - lm))
    direct = tl.where(tl.abs(ls) < float("inf"), direct, 0.0)
    return term, direct


@triton.jit
def _full_kernel(xs_ptr, stride_sn, stride_sv, xt_ptr, stride_tn, stride_tv, log_zs_ptr, log_zt_ptr, g_ptr,
                 direct_sum_ptr, result_ptr, stride_on, stride_ov, r, temperature, beta, log_1m_beta, log_beta,
                 FLOOR: tl.constexpr, MODE: tl.constexpr, OUTPUT: tl.constexpr, BLOCK_V: tl.constexpr):
    """OUTPUT 0: result[row] = sum of the terms; 1: result[row] = sum of g d term/d ls; 2: result row
    = (g d term/d ls - p_s direct_sum) / T, the gradient in xs (direct_sum over the whole vocabulary)."""
    row = tl.program_id(0).to(tl.int64)
    xs_row = xs_ptr + row * stride_sn
    xt_row = xt_ptr + row * stride_tn
    log_zs = tl.load(log_zs_ptr + row)
    log_zt = tl.load(log_zt_ptr + row)
    if OUTPUT != 0:
        g = tl.load(g_ptr + row)
    if OUTPUT == 2:
        direct_sum = tl.load(direct_sum_ptr + row)
    acc = 0.0
    for start in range(0, r, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        zs, mask = _load_z(xs_row, cols, r, stride_sv, temperature, 0.0)
        zt, _ = _load_z(xt_row, cols, r, stride_tv, temperature, 0.0)
        ls = zs - log_zs
        term, direct = _jsd(ls, zt - log_zt, beta, log_1m_beta, log_beta, FLOOR, MODE)
        if OUTPUT == 0:
            acc += tl.sum(tl.where(mask, term, 0.0), 0)
        elif OUTPUT == 1:
            acc += tl.sum(tl.where(mask, g * direct, 0.0), 0)
        else:
            # Every column's log-prob depends on log Zs: d ls_u / d zs_v = [u = v] - p_v.
            grad = (g * direct - tl.exp(ls) * direct_sum) / temperature
            tl.store(result_ptr + row * stride_on + cols * stride_ov, grad.to(result_ptr.dtype.element_ty),
                     mask=mask)
    if OUTPUT != 2:
        tl.store(result_ptr + row, acc)


# ---------------------------------------------------------------- the contract ----
def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-row vector [n] as contiguous fp32 (a few floats per row; the kernels index it by row)."""
    return None if t is None else t.float().contiguous()


def token_stats(x: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 5]: max m, sum exp(z - m), sum exp(z - m)(z - m), z at the label (0 if not owned), owned."""
    n, r = x.shape
    stats = _empty_stats(x, 5)
    if n and r:
        _token_stats_kernel[(n,)](x, x.stride(0), x.stride(1), labels, labels.stride(0), stats, r, float(temperature),
                                  FLOAT32_MIN=_FLOAT32_MIN, BLOCK_V=block_v(r), num_warps=num_warps(block_v(r)))
    return stats


def token_grad(x, labels, temperature, m, log_sum, expected, g_lp, g_h, out) -> None:
    """out = d(g_lp logprob + g_h entropy)/dx (see torch_ops.token_grad)."""
    n, r = x.shape
    if not (n and r) or (g_lp is None and g_h is None):
        return
    m, log_sum, expected, g_lp, g_h = map(_rows, (m, log_sum, expected, g_lp, g_h))
    _token_grad_kernel[(n,)](x, x.stride(0), x.stride(1), labels, labels.stride(0), m, log_sum,
                             m if expected is None else expected, m if g_lp is None else g_lp,
                             m if g_h is None else g_h, out, out.stride(0), out.stride(1), r, float(temperature),
                             HAS_LP=g_lp is not None, HAS_H=g_h is not None, BLOCK_V=block_v(r),
                             num_warps=num_warps(block_v(r)))


def topk_stats(x: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 3 + K]: max m, sum exp(z - m), the same sum over the columns not in ids, z at each id
    (0 where not owned)."""
    n, r = x.shape
    k = ids.shape[-1]
    stats = _empty_stats(x, 3 + k)
    if n and r:
        blocks, k_block = topk_blocks(r, k)
        _topk_stats_kernel[(n,)](x, x.stride(0), x.stride(1), ids, ids.stride(0), ids.stride(1), stats,
                                 stats.stride(0), r, k, float(temperature), FLOAT32_MIN=_FLOAT32_MIN,
                                 BLOCK_V=blocks, K_BLOCK=k_block, num_warps=TOPK_NUM_WARPS)
    return stats


def topk_grad(x, ids, temperature, m, log_sum, log_rest, g_ids, g_tail, out) -> None:
    """out = d(sum_k g_ids[k] logprob_k + g_tail tail)/dx (see torch_ops.topk_grad)."""
    n, r = x.shape
    k = ids.shape[-1]
    if not (n and r):
        return
    m, log_sum, log_rest, g_tail = map(_rows, (m, log_sum, log_rest, g_tail))
    g_ids = g_ids.float()
    blocks, k_block = topk_blocks(r, k)
    _topk_grad_kernel[(n,)](x, x.stride(0), x.stride(1), ids, ids.stride(0), ids.stride(1), m, log_sum, log_rest,
                            g_ids, g_ids.stride(0), g_ids.stride(1), m if g_tail is None else g_tail, out,
                            out.stride(0), out.stride(1), r, k, float(temperature), HAS_TAIL=g_tail is not None,
                            BLOCK_V=blocks, K_BLOCK=k_block, num_warps=TOPK_NUM_WARPS)


def lse_stats(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, 2]: max m and sum exp(z - m)."""
    n, r = x.shape
    stats = _empty_stats(x, 2)
    if n and r:
        _lse_stats_kernel[(n,)](x, x.stride(0), x.stride(1), stats, r, float(temperature),
                                FLOAT32_MIN=_FLOAT32_MIN, BLOCK_V=block_v(r), num_warps=num_warps(block_v(r)))
    return stats


def _mode(beta: float) -> int:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"gkd beta must be in [0, 1], got {beta}")
    return 0 if beta == 0 else 1 if beta == 1 else 2


def _full(output: int, xs, xt, temperature, log_zs, log_zt, beta, g=None, direct_sum=None, result=None):
    n, r = xs.shape
    mode = _mode(beta)
    if result is None:
        result = torch.zeros(n, dtype=torch.float32, device=xs.device)
    if not (n and r):
        return result
    log_zs, log_zt, g, direct_sum = map(_rows, (log_zs, log_zt, g, direct_sum))
    stride_on, stride_ov = (result.stride(0), result.stride(1)) if output == _GRAD else (1, 1)
    # The logs of the mixture weights only matter in the mixed mode (they are -inf at the ends).
    log_1m_beta, log_beta = (math.log1p(-beta), math.log(beta)) if mode == 2 else (0.0, 0.0)
    _full_kernel[(n,)](xs, xs.stride(0), xs.stride(1), xt, xt.stride(0), xt.stride(1), log_zs, log_zt,
                       log_zs if g is None else g, log_zs if direct_sum is None else direct_sum, result,
                       stride_on, stride_ov, r, float(temperature), float(beta), log_1m_beta, log_beta,
                       FLOOR=LOGPROB_FLOOR, MODE=mode, OUTPUT=output, BLOCK_V=block_v(r),
                       num_warps=num_warps(block_v(r)))
    return result


def full_terms(xs, xt, temperature, log_zs, log_zt, beta) -> torch.Tensor:
    """[n]: this shard's sum of algorithms.generalized_jsd_terms(ls, lt, beta) (see torch_ops.full_terms)."""
    return _full(_TERMS, xs, xt, temperature, log_zs, log_zt, beta)


def full_direct_sum(xs, xt, temperature, log_zs, log_zt, beta, g) -> torch.Tensor:
    """[n]: this shard's sum over v of d(g terms)/d ls_v (the normaliser's share of the gradient)."""
    return _full(_DIRECT_SUM, xs, xt, temperature, log_zs, log_zt, beta, g=g)


def full_grad(xs, xt, temperature, log_zs, log_zt, beta, g, direct_sum, out) -> None:
    """out = d(g loss)/dxs = (d/dls - p_s * direct_sum) / T, direct_sum all-reduced over the shards."""
    _full(_GRAD, xs, xt, temperature, log_zs, log_zt, beta, g=g, direct_sum=direct_sum, result=out)
