"""The element-wise parts of a decoder layer (RMSNorm, SwiGLU, rotary embeddings, the residual add) done in fewer
passes over memory than torch's composites, for hosts without Transformer Engine.

On CPU ranks nothing fuses these ops (Megatron's fusions are CUDA kernels or torch.compile'd, megarl turns
them off there; docs/platform.md): torch's RMSNorm runs pow, mean, add, rsqrt and two multiplications, each
a pass over the activations, and autograd differentiates each one (about 25 passes forward and backward);
Megatron's rotary embedding builds `rotate_half` with a negation and a concatenation and concatenates
again with the empty unrotated part. On the bench job (issue 28) those element-wise passes were a quarter
of the update. The functions here compute the same formulas with the derivatives written out, so the
backward is a few passes and saves only the input (and one value per token). Results agree with the
composites within fp32 rounding (tests/test_fast_paths.py). torch.compile would fuse them too, but pays
seconds of compilation in every process, which the test suite's hundreds of short launches cannot afford.
"""

from __future__ import annotations

import functools

import torch


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """16-bit activations are normalised in fp32, as torch's rms_norm does."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _RMSNormFunction(torch.autograd.Function):
    """y = x * r * w with r = (mean(x^2) + eps)^-1/2 over the last dimension.

    dx = r * (g w) - x * r^3 / H * <g w, x>, dw = sum over tokens of g * x * r."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _opmath(x)
        # the mean square as one fused dot per token (x.pow(2).mean() is two passes and a temporary)
        rstd = torch.rsqrt(torch.linalg.vecdot(xf, xf, dim=-1).unsqueeze(-1).div_(x.shape[-1]).add_(eps))
        y = xf * rstd
        if weight is not None:
            y.mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf = _opmath(x)
        scaled = _opmath(grad) * rstd  # g r
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            hidden = x.shape[-1]  # sum over every leading dimension of g r x
            grad_weight = torch.linalg.vecdot(scaled.reshape(-1, hidden), xf.reshape(-1, hidden), dim=0)
            grad_weight = grad_weight.to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            if weight is not None:
                scaled = scaled.mul_(weight)  # g w r
            # r g w - x r^3 / H <g w, x>, with <g w r, x> = r <g w, x>
            coefficient = torch.linalg.vecdot(scaled, xf, dim=-1).unsqueeze(-1).mul_(rstd.square()).div_(x.shape[-1])
            grad_x = scaled.addcmul_(xf, coefficient, value=-1).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-1/2 * weight over the last dimension (`_RMSNormFunction`)."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same parameters and state dict) whose forward is `_RMSNormFunction`, over the last
    dimension; other shapes fall back to torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return torch.nn.functional.rms_norm(x, self.normalized_shape, self.gain(), self.eps)
        eps = self.eps if self.eps is not None else torch.finfo(_opmath(x).dtype).eps
        return _RMSNormFunction.apply(x, self.gain(), eps)

    def gain(self) -> torch.Tensor | None:
        return self.weight


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm that scales by (1 + weight) (Megatron's layernorm_zero_centered_gamma; Qwen3.5's norms, whose
    checkpoints store weights around 0). The sum is formed in fp32, as transformers' Qwen3_5RMSNorm does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            self.weight.zero_()

    def gain(self) -> torch.Tensor:
        return self.weight.float() + 1.0


class _SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up for the halves [gate, up] of the last dimension (Megatron's gated linear unit: fc1's
    output, chunked in two). The backward writes both halves' gradients into one tensor, where autograd
    through `chunk` concatenates them: d gate = silu'(gate) g up, d up = g silu(gate)."""

    @staticmethod
    def forward(ctx, y):
        gate, up = y.chunk(2, dim=-1)
        activated = torch.nn.functional.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, activated = ctx.saved_tensors
        grad_y = grad.new_empty(*grad.shape[:-1], 2 * grad.shape[-1])
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, activated, out=grad_up)
        return grad_y


class SwiGLU(torch.nn.Module):
    """The gated linear unit with SiLU as a module, for MLPSubmodules.activation_func (Megatron's MLP takes its
    activation from the spec under `use_te_activation_func`; megatron_gpt sets both for the local spec's dense
    MLP on CPU hosts). Megatron's own glu also adds `glu_linear_offset` (0 for every megarl model) to the up
    half, one more pass; this module refuses a non-zero offset or a clamp, which it does not implement."""

    def __init__(self, config=None):
        super().__init__()
        if config is not None and (getattr(config, "glu_linear_offset", 0.0) or
                                   getattr(config, "activation_func_clamp_value", None) is not None):
            raise ValueError("SwiGLU: glu_linear_offset and activation_func_clamp_value are not supported")

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFunction.apply(y)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing to checkpoint (Megatron's MLP asks each child for its sharded state)."""
        return {}


class _RotaryFunction(torch.autograd.Function):
    """out = t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1] for the halves t1, t2 of the last
    dimension: out1 = t1 c1 - t2 s1, out2 = t2 c2 + t1 s2 (c, s split the same way). The derivative is the
    transposed rotation: dt1 = g1 c1 + g2 s2, dt2 = g2 c2 - g1 s1."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, sign=1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, sign=-1.0), None, None


def _rotate(t, cos, sin, sign: float):
    """[t1 c1 - sign t2 s1, t2 c2 + sign t1 s2], written into one output without temporaries of t's size
    beyond it (sign -1: the transposed rotation, with s1 and s2 swapped)."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if sign < 0:
        s1, s2 = s2, s1
    out = torch.empty_like(t)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(t1, c1, out=out1).addcmul_(t2, s1, value=-sign)
    torch.mul(t2, c2, out=out2).addcmul_(t1, s2, value=sign)
    return out


def rotary_bshd(original):
    """Megatron's `_apply_rotary_pos_emb_bshd` (rope_utils.py; the THD path calls it too) by `_RotaryFunction`
    for the plain layout: halves, not interleaved, not multi-latent attention, the whole head rotated;
    every other case goes to `original`."""
    @functools.wraps(original)
    def apply(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != t.shape[-1] or t.shape[-1] % 2:
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        cos = (torch.cos(freqs) * mscale).to(t.dtype)
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _RotaryFunction.apply(t, cos, sin)

    apply.megarl_original = original
    return apply


def rotary_thd(original):
    """Megatron's `_apply_rotary_pos_emb_thd` (rope_utils.py, the unfused packed-row RoPE) with the row's
    boundaries from the host copy megarl's micro-batches carry (accelerator.packed_bounds): Megatron reads
    cu_seqlens back in every layer, and once per sequence where the frequencies span the whole row. The same
    steps as Megatron's on the same values (its per-sequence frequencies, one rotation of the whole row);
    a cu_seqlens without the host copy goes to `original`."""
    from megatron.core.models.common.embeddings import rope_utils

    @functools.wraps(original)
    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
              cp_group=None):
        bounds = getattr(cu_seqlens, "megarl_bounds", None)
        if bounds is None or cp_group is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        seqlens = [(end - start) // cp_size for start, end in zip(bounds[:-1], bounds[1:])]
        # Megatron's two cases: frequencies for every position of the row (offset by each sequence's start),
        # or for the longest sequence only (each sequence from position 0)
        offsets = bounds[:-1] if freqs.dim() >= 1 and freqs.size(0) == bounds[-1] else [0] * len(seqlens)
        freqs_packed = torch.cat([rope_utils._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs, offset)
                                  for x, offset in zip(torch.split(t, seqlens), offsets)], dim=0)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    apply.megarl_original = original
    return apply


def bias_dropout_add(training: bool, fused: bool):
    """Megatron's `get_bias_dropout_add` (a layer spec's residual step, fused_bias_dropout.py) that adds the
    residual directly when there is no bias and no dropout: torch's dropout at p = 0 in training mode still
    copies its input forward and its gradient backward (two passes per residual, 24 per forward of a
    12-layer model). Any other case is Megatron's. The same sum (residual + x) either way."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    megatrons = get_bias_dropout_add(training, fused)

    def apply(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if bias is None and prob == 0 and residual.dtype == x.dtype:
            return residual + x
        return megatrons(x_with_bias, residual, prob)

    return apply


@functools.cache
def install() -> None:
    """Route Megatron's unfused rotary embedding through `rotary_bshd` and its packed rows' through `rotary_thd`
    (idempotent). The norms are megarl's own spec entries (megatron_gpt.SequenceParallelRMSNorm builds
    `RMSNorm`)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_bshd = rotary_bshd(rope_utils._apply_rotary_pos_emb_bshd)
    rope_utils._apply_rotary_pos_emb_thd = rotary_thd(rope_utils._apply_rotary_pos_emb_thd)
