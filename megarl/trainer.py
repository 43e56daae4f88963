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
    tokens: torch.Tensor  # [b, L]
    labels: torch.Tensor  # [b, L], tokens shifted left
    loss_mask: torch.Tensor  # [b, L], 1 on positions scoring a response token
    old_logprobs: torch.Tensor | None = None  # [b, L]
    advantages: torch.Tensor | None = None  # [b, L]
    rollout_logprobs: torch.Tensor | None = None  # [b, L]
    ref_logprobs: torch.Tensor | None = None  # [b, L], when a KL term is used
    is_weights: torch.Tensor | None = None  # [b, L], rollout -> trainer importance weights


def make_micro_batches(samples, micro_batch_size: int, pad_id: int, advantages=None, keep=None) -> list[MicroBatch]:
    """Right-padded micro-batches of `samples`.

    advantages: [N, R] response-aligned (column j = response token j) or None;
    keep: [N] bool, samples to leave in the loss (False: mask zeroed), or None.
    """
    device = platform.device()
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start: start + micro_batch_size]
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
        tokens = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        labels = torch.full_like(tokens, pad_id)
        mask = torch.zeros(len(chunk), length)
        rollout = torch.zeros(len(chunk), length)
        adv = torch.zeros(len(chunk), length)
        for row, sample in enumerate(chunk):
            sequence = torch.tensor(sample.prompt_ids + sample.response_ids)
            p, r = len(sample.prompt_ids), len(sample.response_ids)
            tokens[row, : p + r] = sequence
            labels[row, : p + r - 1] = sequence[1:]
            if keep is None or keep[start + row]:
                mask[row, p - 1: p + r - 1] = 1.0
            rollout[row, p - 1: p + r - 1] = torch.tensor(sample.logprobs, dtype=torch.float32)
            if advantages is not None:
                adv[row, p - 1: p + r - 1] = advantages[start + row, :r]
        batches.append(MicroBatch(tokens.to(device), labels.to(device), mask.to(device),
                                  advantages=adv.to(device), rollout_logprobs=rollout.to(device)))
    return batches


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


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, [b, L], from this TP rank's vocabulary shard.

    H = log Z - sum_v p_v z_v with Z and the sum all-reduced over TP (identity
    backward, so every rank's shard gets its own gradient).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = _scaled_logits(logits, vocab_size, temperature)
    z_max = z.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp = torch.exp(z - z_max)
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    # exp is exactly 0 on padding columns, whose z (finite min) must not meet it as 0 * -inf.
    sum_exp_z = reduce_from_tensor_model_parallel_region((exp * torch.where(exp > 0, z, 0.0)).sum(dim=-1))
    return torch.log(sum_exp) + z_max.squeeze(-1) - sum_exp_z / sum_exp


class Trainer:
    def __init__(self, args, hf_config):
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("pipeline_model_parallel_size > 1 is supported by HF<->Megatron "
                                      "conversion but not yet by the RL trainer; use tensor parallelism")
        self.args = args
        self.hf_config = hf_config
        dtype = DTYPES[args.params_dtype]
        model = build_gpt_model(hf_config, dtype, args.make_vocab_size_divisible_by,
                                calculate_per_token_loss=True)
        load_hf_weights(model, args.model, hf_config)
        config = model.config
        self.model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=False),
            module=model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype),
            [self.model])
        total_updates = max(args.train_steps * args.steps_per_generation, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_steps else args.lr, max_lr=args.lr,
            min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
            lr_decay_steps=max(total_updates, args.lr_warmup_steps + 1), lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=total_updates,
            wd_incr_style="constant")
        self.policy_loss = POLICY_LOSSES[args.policy_loss]
        self.aggregate = LOSS_AGGREGATIONS[args.loss_agg]
        self.kl_estimator = KL_ESTIMATORS[args.kl_estimator]
        # A frozen reference policy only when a KL term needs one.
        self.ref_model = None
        if args.kl_coef > 0:
            self.ref_model = build_gpt_model(hf_config, dtype, args.make_vocab_size_divisible_by)
            load_hf_weights(self.ref_model, args.ref_model, hf_config)
            self.ref_model.requires_grad_(False).eval()
            platform.offload(self.ref_model)

    # ------------------------------------------------------------ forward ----
    def _run(self, micro_batches: list[MicroBatch], loss_fn, forward_only: bool, model=None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).expand_as(batch.tokens)
            logits = model(batch.tokens, positions, attention_mask=None)
            return logits, partial(loss_fn, batch)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model or self.model],
            num_microbatches=len(micro_batches), seq_length=max(b.tokens.shape[1] for b in micro_batches),
            micro_batch_size=self.args.micro_batch_size, forward_only=forward_only)

    def _logprobs(self, batch: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(logits, batch.labels, self.hf_config.vocab_size, self.args.temperature)

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: list[MicroBatch]) -> None:
        """Fill `old_logprobs` (and `ref_logprobs` with a KL term) of each micro-batch."""
        self.model.eval()

        def keep(field, batch, logits):
            setattr(batch, field, self._logprobs(batch, logits).detach() * batch.loss_mask)
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        self._run(micro_batches, partial(keep, "old_logprobs"), forward_only=True)
        if self.ref_model is not None:
            platform.onload(self.ref_model)
            self._run(micro_batches, partial(keep, "ref_logprobs"), forward_only=True, model=self.ref_model)
            platform.offload(self.ref_model)

    # -------------------------------------------------------------- train ----
    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """One optimizer step over these micro-batches (this rank's share of a mini-batch)."""
        args = self.args
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss(batch, logits):
            logprobs = self._logprobs(batch, logits)
            mask = batch.loss_mask
            token_loss, loss_metrics = self.policy_loss(
                logprobs, batch.old_logprobs, batch.advantages, args.clip_eps_low, args.clip_eps_high,
                mask=mask, clip_ratio_c=args.dual_clip_c, skip_threshold=args.skip_threshold)
            if batch.is_weights is not None:
                token_loss = token_loss * batch.is_weights
            kl = torch.zeros_like(token_loss)
            if self.ref_model is not None:
                kl = self.kl_estimator(logprobs, batch.ref_logprobs)
                token_loss = token_loss + args.kl_coef * kl
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
                    (kl * mask).sum(),
                    (entropy * mask).sum(),
                    mask.sum(),
                ])
            return numerator, torch.as_tensor(units).round().to(torch.int), {"sums": sums}

        outputs = self._run(micro_batches, loss, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        sums = torch.stack([o["sums"] for o in outputs]).sum(dim=0)
        dist.all_reduce(sums, group=_data_parallel_group())
        tokens = max(sums[6].item(), 1.0)
        return {
            "loss": sums[0].item() / max(sums[1].item(), 1.0),
            "clip_fraction": sums[2].item() / tokens,
            "kl_old_new": sums[3].item() / tokens,
            "kl_ref": sums[4].item() / tokens,
            "entropy": sums[5].item() / tokens,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": self.optimizer.param_groups[0]["lr"],
        }


def _data_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()
