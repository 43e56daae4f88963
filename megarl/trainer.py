"""Train role: a Megatron GPTModel with Megatron DDP, optimizer and LR schedule.

Samples arrive as token ids; a micro-batch is right-padded to its longest
sequence, so causal attention needs no mask. Position t's logits score token
t+1: the response tokens of a sample with prompt length p and response length r
are scored at positions p-1 .. p+r-2 (`loss_mask`).

Logprobs are computed vocab-parallel: each TP rank holds V/TP logits and
Megatron's `vocab_parallel_cross_entropy` reduces across ranks, so the full
vocabulary is never gathered on one rank. Megatron's vocabulary padding rows are
masked out of the softmax.

Loss normalisation: each micro-batch returns (sum of token losses, token count)
with `calculate_per_token_loss`, and Megatron divides the accumulated gradients
by the token count summed over micro-batches and data-parallel ranks, which is
the exact token mean over the mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megarl import platform
from megarl.algorithms import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from megarl.models.convert import load_hf_weights
from megarl.models.megatron_gpt import DTYPES, build_gpt_model


@dataclass
class MicroBatch:
    """Right-padded sequences; every per-token field is position-aligned [b, L]:
    position t scores token t+1, so a sample's response tokens sit at p-1 .. p+r-2."""

    tokens: torch.Tensor  # [b, L]
    labels: torch.Tensor  # [b, L], tokens shifted left
    loss_mask: torch.Tensor  # [b, L], 1 on positions scoring a response token left in the loss
    spans: list[tuple[int, int]]  # (prompt length, response length) per row
    rollout_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # when a KL term is used
    kl: torch.Tensor | None = None  # per-token KL(old policy || ref), when a KL term is used
    advantages: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # rollout -> trainer importance weights
    returns: torch.Tensor | None = None  # critic targets (gae)
    old_values: torch.Tensor | None = None  # critic values before the update (gae)

    def response_aligned(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width] with column j = response token j of each row (0 past the response)."""
        out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        for row, (p, r) in enumerate(self.spans):
            out[row, :r] = x[row, p - 1: p + r - 1]
        return out


# Per-token fields make_micro_batches fills from response-aligned [N, R] tensors.
TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "kl", "advantages", "is_weights", "returns", "old_values")


def make_micro_batches(samples, micro_batch_size: int, pad_id: int, fields: dict | None = None,
                       token_mask=None) -> list[MicroBatch]:
    """Right-padded micro-batches of `samples`.

    fields: name (one of TOKEN_FIELDS) -> [N, R] response-aligned tensor (column j =
    response token j of sample i); token_mask: [N, R] 1/0, response tokens to leave
    in the loss (None: all of them).
    """
    fields = fields or {}
    unknown = set(fields) - set(TOKEN_FIELDS)
    if unknown:
        raise ValueError(f"unknown micro-batch fields {sorted(unknown)}")
    device = platform.device()
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start: start + micro_batch_size]
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        tokens = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        labels = torch.full_like(tokens, pad_id)
        per_token = {name: torch.zeros(len(chunk), length) for name in ("loss_mask", "rollout_logprobs", *fields)}
        spans = []
        for row, sample in enumerate(chunk):
            p, r = len(sample.prompt_ids), len(sample.response_ids)
            spans.append((p, r))
            sequence = torch.tensor(sample.prompt_ids + sample.response_ids)
            tokens[row, : p + r] = sequence
            labels[row, : p + r - 1] = sequence[1:]
            response = slice(p - 1, p + r - 1)
            per_token["loss_mask"][row, response] = 1.0 if token_mask is None else token_mask[start + row, :r].float()
            per_token["rollout_logprobs"][row, response] = torch.tensor(sample.logprobs, dtype=torch.float32)
            for name, values in fields.items():
                per_token[name][row, response] = values[start + row, :r].float()
        batches.append(MicroBatch(tokens.to(device), labels.to(device), spans=spans,
                                  **{name: value.to(device) for name, value in per_token.items()}))
    return batches


def forward_backward(model, micro_batches: list[MicroBatch], loss_fn, forward_only: bool,
                     micro_batch_size: int, ref_model=None) -> list[dict]:
    """Megatron's forward-backward schedule over the micro-batches.

    loss_fn(batch, output, ref_logits=None) -> (numerator, units, metrics); with
    ref_model set, the reference's logits of the same batch are computed under
    no_grad and passed as ref_logits (full-vocabulary KL).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).expand_as(batch.tokens)
        output = model(batch.tokens, positions, attention_mask=None)
        ref_logits = None
        if ref_model is not None:
            with torch.no_grad():
                ref_logits = ref_model(batch.tokens, positions, attention_mask=None)
        return output, partial(loss_fn, batch, ref_logits=ref_logits)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=max(b.tokens.shape[1] for b in micro_batches),
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def build_trainable(module, args, lr: float, weight_decay: float):
    """Megatron DDP, Adam and the LR schedule around `module` (policy or critic)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = DTYPES[args.params_dtype]
    config = module.config
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False),
        module=module)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, min_lr=min(args.min_lr, lr), weight_decay=weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype),
        [model])
    total_updates = max(args.train_steps * args.steps_per_generation * args.ppo_epochs, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_steps else lr, max_lr=lr,
        min_lr=min(args.min_lr, lr), lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=max(total_updates, args.lr_warmup_steps + 1), lr_decay_style=args.lr_decay_style,
        start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=total_updates, wd_incr_style="constant")
    return model, optimizer, scheduler


def optimizer_step(optimizer, scheduler) -> float:
    """Step, advance the schedule when the step was taken; the gradient norm."""
    updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    return float(grad_norm) if grad_norm is not None else math.nan


def _scaled_logits(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """logits / T in fp32, with Megatron's vocabulary-padding columns of this shard set to -inf (finite min)."""
    from megatron.core import parallel_state

    z = logits.float() / temperature
    shard = z.shape[-1]
    first_padded = vocab_size - parallel_state.get_tensor_model_parallel_rank() * shard
    if first_padded < shard:
        z[..., max(first_padded, 0):] = torch.finfo(z.dtype).min
    return z


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[label] from this TP rank's vocabulary shard, [b, L]."""
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(_scaled_logits(logits, vocab_size, temperature), labels)


def _shifted_exp_sum(z: torch.Tensor):
    """(exp(z - m), m, sum_v exp(z_v - m) over the whole TP-sharded vocabulary), m the global max.

    The sum is all-reduced with an identity backward: every rank then combines the
    global sums into the same loss, so each shard's share of the gradient is exact.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z_max = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp = torch.exp(z - z_max)
    return exp, z_max.squeeze(-1), reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))


def _weighted_vocab_sum(exp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_v exp_v x_v over the whole vocabulary; padding columns (exp exactly 0, x possibly
    huge) contribute 0 and no NaN."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region((exp * torch.where(exp > 0, x, 0.0)).sum(dim=-1))


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, [b, L], from this TP rank's vocabulary shard:
    H = log Z - sum_v p_v z_v, from global sums."""
    z = _scaled_logits(logits, vocab_size, temperature)
    exp, z_max, sum_exp = _shifted_exp_sum(z)
    return torch.log(sum_exp) + z_max - _weighted_vocab_sum(exp, z) / sum_exp


def vocab_parallel_full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, vocab_size: int,
                           temperature: float) -> torch.Tensor:
    """Exact KL(pi || ref) per position over the full vocabulary, [b, L], shard by shard.

    The formula of algorithms.kl_full, sum_v p (log p - log q), rewritten over global sums:
    KL = sum_v p_v (z_v - z'_v) - log Z + log Z' with z, z' the scaled logits of the
    policy and the reference. Differentiable in `logits`; ref_logits are constants.
    """
    z = _scaled_logits(logits, vocab_size, temperature)
    z_ref = _scaled_logits(ref_logits.detach(), vocab_size, temperature)
    exp, z_max, sum_exp = _shifted_exp_sum(z)
    _, ref_max, ref_sum_exp = _shifted_exp_sum(z_ref)
    cross = _weighted_vocab_sum(exp, z - z_ref) / sum_exp
    return cross - (torch.log(sum_exp) + z_max) + (torch.log(ref_sum_exp) + ref_max)


class Trainer:
    """The policy: Megatron GPTModel + DDP + Adam, and the frozen reference when a KL term needs one."""

    def __init__(self, args, hf_config):
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("pipeline_model_parallel_size > 1 is supported by HF<->Megatron "
                                      "conversion but not yet by the RL trainer; use tensor parallelism")
        self.args = args
        self.hf_config = hf_config
        dtype = DTYPES[args.params_dtype]
        module = build_gpt_model(hf_config, dtype, args.make_vocab_size_divisible_by, calculate_per_token_loss=True)
        load_hf_weights(module, args.model, hf_config)
        self.model, self.optimizer, self.scheduler = build_trainable(module, args, args.lr, args.weight_decay)
        self.policy_loss = POLICY_LOSSES[args.policy_loss]
        self.aggregate = LOSS_AGGREGATIONS[args.loss_agg]
        self.full_kl = args.kl_estimator == "full"
        self.kl_estimator = None if self.full_kl else KL_ESTIMATORS[args.kl_estimator]
        # A frozen reference policy only when a KL term needs one.
        self.ref_model = None
        if args.kl_coef > 0:
            self.ref_model = build_gpt_model(hf_config, dtype, args.make_vocab_size_divisible_by)
            load_hf_weights(self.ref_model, args.ref_model, hf_config)
            self.ref_model.requires_grad_(False).eval()
            platform.offload(self.ref_model)

    def _run(self, micro_batches, loss_fn, forward_only: bool, model=None, with_ref_logits: bool = False):
        ref_model = self.ref_model if with_ref_logits else None
        if ref_model is not None:
            platform.onload(ref_model)
        try:
            return forward_backward(model or self.model, micro_batches, loss_fn, forward_only,
                                    self.args.micro_batch_size, ref_model=ref_model)
        finally:
            if ref_model is not None:
                platform.offload(ref_model)

    def _logprobs(self, batch: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(logits, batch.labels, self.hf_config.vocab_size, self.args.temperature)

    def _full_kl(self, logits, ref_logits) -> torch.Tensor:
        return vocab_parallel_full_kl(logits, ref_logits, self.hf_config.vocab_size, self.args.temperature)

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[MicroBatch]) -> None:
        """Fill `old_logprobs` of each micro-batch, and with a reference `ref_logprobs` and the
        per-token `kl` of the current (old) policy to it."""
        self.model.eval()

        def keep(field, batch, logits, ref_logits=None):
            setattr(batch, field, self._logprobs(batch, logits).detach() * batch.loss_mask)
            if ref_logits is not None:
                batch.kl = self._full_kl(logits, ref_logits) * batch.loss_mask
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        self._run(micro_batches, partial(keep, "old_logprobs"), forward_only=True, with_ref_logits=self.full_kl)
        if self.ref_model is not None and not self.full_kl:
            platform.onload(self.ref_model)
            self._run(micro_batches, partial(keep, "ref_logprobs"), forward_only=True, model=self.ref_model)
            platform.offload(self.ref_model)
            for batch in micro_batches:
                batch.kl = self.kl_estimator(batch.old_logprobs, batch.ref_logprobs) * batch.loss_mask

    def train_step(self, micro_batches: list[MicroBatch], kl_loss_coef: float = 0.0) -> dict:
        """One optimizer step over these micro-batches (this rank's share of a mini-batch).

        kl_loss_coef > 0 adds coef * KL(pi || ref) per token to the loss (GRPO style).
        """
        args = self.args
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        kl_in_loss = kl_loss_coef > 0 and self.ref_model is not None

        def loss(batch, logits, ref_logits=None):
            logprobs = self._logprobs(batch, logits)
            mask = batch.loss_mask
            token_loss, loss_metrics = self.policy_loss(
                logprobs, batch.old_logprobs, batch.advantages, args.clip_eps_low, args.clip_eps_high,
                mask=mask, clip_ratio_c=args.dual_clip_c, skip_threshold=args.skip_threshold)
            if batch.is_weights is not None:
                token_loss = token_loss * batch.is_weights
            kl = torch.zeros_like(token_loss)
            if kl_in_loss:
                kl = self._full_kl(logits, ref_logits) if self.full_kl else \
                    self.kl_estimator(logprobs, batch.ref_logprobs)
                token_loss = token_loss + kl_loss_coef * kl
            if args.entropy_coef:
                entropy = vocab_parallel_entropy(logits, self.hf_config.vocab_size, args.temperature)
                token_loss = token_loss - args.entropy_coef * entropy
            else:
                with torch.no_grad():
                    entropy = vocab_parallel_entropy(logits, self.hf_config.vocab_size, args.temperature)
            numerator, units = self.aggregate(token_loss, mask, max_len=args.max_new_tokens)
            with torch.no_grad():
                sums = torch.stack([
                    numerator.detach(),
                    units.float() if torch.is_tensor(units) else torch.tensor(float(units)),
                    (loss_metrics["clipped"] * mask).sum(),
                    ((batch.old_logprobs - logprobs) * mask).sum(),  # k1 KL(old || new) estimate
                    (kl.detach() * mask).sum(),
                    (entropy * mask).sum(),
                    mask.sum(),
                ])
            return numerator, torch.as_tensor(units).round().to(torch.int), {"sums": sums}

        outputs = self._run(micro_batches, loss, forward_only=False, with_ref_logits=kl_in_loss and self.full_kl)
        grad_norm = optimizer_step(self.optimizer, self.scheduler)
        sums = torch.stack([o["sums"] for o in outputs]).sum(dim=0)
        dist.all_reduce(sums, group=_data_parallel_group())
        tokens = max(sums[6].item(), 1.0)
        metrics = {
            "loss": sums[0].item() / max(sums[1].item(), 1.0),
            "clip_fraction": sums[2].item() / tokens,
            "kl_old_new": sums[3].item() / tokens,
            "entropy": sums[5].item() / tokens,
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if kl_in_loss:
            metrics["kl_loss"] = sums[4].item() / tokens
        return metrics


def _data_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()
