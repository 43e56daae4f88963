"""The phases of one RL step, as calls on the roles this rank plays.

`train.py` runs them in order; this module owns who does what and how data
moves between roles:

  generate   rollout ranks: each engine takes a contiguous shard of the step's
             prompts, samples n responses per prompt and scores them; every
             rank then receives all samples (ordered by prompt).
  train      train ranks: group advantages over the whole batch, then each
             data-parallel rank takes its share of every mini-batch, computes
             old logprobs before any update, and takes one optimizer step per
             mini-batch.
  sync       trainer -> rollout weights (colocated or broadcast strategy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl import distributed
from megarl.algorithms import (ADVANTAGE_ESTIMATORS, dynamic_sampling_keep, sequence_rewards_to_tokens,
                               soft_overlong_penalty, truncated_importance_weights, truncation_keep)
from megarl.data import prompt_source
from megarl.rewards import as_output, get_reward
from megarl.rollout import RolloutEngine, Sample
from megarl.weight_sync import BroadcastSync, ColocatedSync


class RLRun:
    def __init__(self, args, context: distributed.DistContext):
        from transformers import AutoConfig, AutoTokenizer

        self.args, self.context = args, context
        self.hf_config = AutoConfig.from_pretrained(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.prompts = prompt_source(args, self.tokenizer)
        self.reward_fn = get_reward(args.reward).fn
        self.engine = self.trainer = None
        bucket_bytes = int(args.sync_bucket_mb * 2**20)

        # Engines before Megatron's parallel state (DESIGN.md: the measured order).
        if context.is_rollout:
            rollout_ranks = context.layout.rollout_ranks
            self.engine = RolloutEngine(args, rollout_ranks.index(context.env.rank), len(rollout_ranks))
        distributed.init_megatron_parallel(context, args.seed)
        if context.is_train:
            from megarl.trainer import Trainer

            self.trainer = Trainer(args, self.hf_config)
        if context.layout.colocated:
            self.sync_strategy = ColocatedSync(bucket_bytes)
        else:
            members = (context.layout.train_ranks[0],) + context.layout.rollout_ranks
            group = distributed.new_store_group("weight-sync", context, members) \
                if context.env.rank in members else None
            self.sync_strategy = BroadcastSync(bucket_bytes, group, context.env.rank == members[0])

    # ------------------------------------------------------------ generate ----
    def generate(self, step: int) -> tuple[list[Sample], dict]:
        """This step's samples (ordered by prompt), with DAPO dynamic sampling when enabled.

        Dynamic sampling generates up to --max-num-gen-batches batches and keeps
        the groups whose success rate lies strictly inside the range, until
        prompts_per_step groups are kept; if the batches run out first it tops up
        with dropped groups (advantage 0 under grpo) and says so in the metrics.
        """
        args = self.args
        if args.dynamic_sampling is None:
            return self._generate_batch(step, 0), {}
        kept, dropped, generated, all_rewards = [], [], 0, []
        for attempt in range(args.max_num_gen_batches):
            samples = self._generate_batch(step, attempt)
            generated += 1
            all_rewards += [s.reward for s in samples]
            groups = [samples[i: i + args.num_generations] for i in range(0, len(samples), args.num_generations)]
            scores = torch.tensor([[s.reward for s in group] for group in groups])
            keep = dynamic_sampling_keep(scores, *args.dynamic_sampling)
            for group, keep_group in zip(groups, keep.tolist()):
                (kept if keep_group else dropped).append(group)
            if len(kept) >= args.prompts_per_step:
                break
        topped_up = max(args.prompts_per_step - len(kept), 0)
        groups = kept[: args.prompts_per_step] + dropped[:topped_up]
        samples = [s for group in groups for s in group]
        return samples, {"dapo_gen_batches": generated, "dapo_groups_kept": min(len(kept), args.prompts_per_step),
                         "dapo_groups_dropped": len(dropped), "dapo_groups_topped_up": topped_up,
                         "dapo_reward_all_mean": sum(all_rewards) / len(all_rewards)}

    def _generate_batch(self, step: int, attempt: int) -> list[Sample]:
        prompts = self.prompts.batch(step, attempt)
        mine = []
        if self.engine is not None:
            shard = _contiguous_shard(prompts, self.engine.engine_index, self.engine.num_engines)
            samples = self.engine.generate([p.ids for p in shard], [p.index for p in shard], step)
            by_index = {p.index: p for p in shard}
            for sample in samples:
                sample.metadata = by_index[sample.prompt_index].metadata
                sample.reward = as_output(self.reward_fn(sample.response_text, sample.metadata)).score
            # The ranks of one TP engine hold identical samples: only its first rank contributes.
            if self.context.layout.rollout_ranks.index(self.context.env.rank) % self.engine.tp == 0:
                mine = samples
        gathered = distributed.all_gather_objects(mine, self.context)
        samples = sorted((s for part in gathered for s in part), key=lambda s: s.prompt_index)
        expected = len(prompts) * self.args.num_generations
        if len(samples) != expected:
            raise RuntimeError(f"step {step}: expected {expected} samples, got {len(samples)}")
        return samples

    # --------------------------------------------------------------- train ----
    def advantages(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Response-aligned advantages [N, R] over the whole batch, the samples kept in the loss, metrics."""
        args = self.args
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        mask = (torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]).float()
        scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        metrics = {}
        if args.overlong_buffer_len:
            penalty = soft_overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer_len)
            scores = scores + penalty
            metrics["overlong_penalty_mean"] = penalty.mean().item()
        keep = truncation_keep(lengths, args.max_new_tokens) if args.filter_truncated else None
        if keep is not None:
            metrics["truncated_filtered"] = 1.0 - keep.float().mean().item()
        token_rewards = sequence_rewards_to_tokens(scores, mask)
        advantages, _ = ADVANTAGE_ESTIMATORS[args.advantage_estimator](
            token_rewards, mask, args.num_generations, scale_rewards=args.scale_rewards, gamma=args.gamma)
        return advantages, keep, metrics

    def train(self, samples: list[Sample]) -> dict:
        if self.trainer is None:
            return {}
        from megarl.trainer import make_micro_batches
        from megatron.core import parallel_state

        args = self.args
        advantages, keep, metrics = self.advantages(samples)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        mini_size = len(samples) // args.steps_per_generation
        mini_batches = []
        for m in range(args.steps_per_generation):
            start = m * mini_size + dp_rank * (mini_size // dp)
            mine = slice(start, start + mini_size // dp)
            mini_batches.append(make_micro_batches(samples[mine], args.micro_batch_size,
                                                   self.tokenizer.pad_token_id or 0, advantages[mine],
                                                   None if keep is None else keep[mine]))
        for micro_batches in mini_batches:
            self.trainer.compute_logprobs(micro_batches)
        metrics.update(_mismatch(mini_batches))
        if args.tis_level != "none":
            metrics.update(_apply_importance_weights(mini_batches, args))
        updates = [self.trainer.train_step(micro_batches) for micro_batches in mini_batches]
        metrics.update({key: updates[0][key] for key in ("kl_old_new", "clip_fraction")})  # first update: on-policy
        metrics.update({key: updates[-1][key] for key in ("loss", "grad_norm", "lr", "kl_ref", "entropy")})
        metrics["advantage_mean"] = advantages.sum().item() / max(sum(len(s.response_ids) for s in samples), 1)
        return metrics

    # ---------------------------------------------------------------- sync ----
    def sync_weights(self) -> dict:
        strategy = self.sync_strategy
        if isinstance(strategy, ColocatedSync):
            self.engine.wake_up(tags=["weights"])
            stats = strategy.sync(self.trainer.model, self.hf_config, self.engine)
            self.engine.wake_up(tags=["kv_cache"])
        elif self.trainer is not None:
            stats = strategy.send(self.trainer.model, self.hf_config)
        elif strategy.group is not None:
            stats = strategy.receive_into(self.engine)
        return {"sync_seconds": stats.seconds, "sync_bytes": stats.bytes}

    def save_hf(self, out_dir: str) -> None:
        """The current policy as an HF checkpoint, written by train rank 0."""
        if self.trainer is not None:
            from megarl.models.convert import save_hf_checkpoint

            save_hf_checkpoint(self.trainer.model, self.hf_config, out_dir, tokenizer=self.tokenizer,
                               is_writer=dist.get_rank() == 0, source_dir=self.args.model)

    def sleep_rollout(self) -> None:
        if self.engine is not None and self.context.layout.colocated:
            self.engine.sleep(level=self.args.rollout_sleep_level)


def _contiguous_shard(items: list, index: int, count: int) -> list:
    per, extra = divmod(len(items), count)
    start = index * per + min(index, extra)
    return items[start: start + per + (1 if index < extra else 0)]


def _mismatch(mini_batches) -> dict:
    """Rollout vs trainer logprobs of the sampled tokens, over all data-parallel ranks.

    mismatch: mean |rollout - trainer|; ratio_dev_max: max |exp(trainer - rollout) - 1|,
    the rollout-to-trainer importance ratio's distance from 1.
    """
    from megatron.core import parallel_state

    totals, worst = torch.zeros(2), torch.zeros(2)
    for batch in (b for micro_batches in mini_batches for b in micro_batches):
        mask = batch.loss_mask
        diff = (batch.old_logprobs - batch.rollout_logprobs) * mask
        totals += torch.stack([diff.abs().sum(), mask.sum()]).cpu()
        worst = torch.maximum(worst, torch.stack([diff.abs().max(), ((diff.exp() - 1) * mask).abs().max()]).cpu())
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(totals, group=group)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return {"mismatch": totals[0].item() / max(totals[1].item(), 1.0), "mismatch_max": worst[0].item(),
            "ratio_dev_max": worst[1].item()}


def _apply_importance_weights(mini_batches, args) -> dict:
    """Rollout -> trainer importance weights on every micro-batch (TIS / masking), and their metrics."""
    from megatron.core import parallel_state

    totals = torch.zeros(3)
    for batch in (b for micro_batches in mini_batches for b in micro_batches):
        weights, stats = truncated_importance_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                                      level=args.tis_level, mode=args.tis_mode,
                                                      threshold=args.tis_threshold)
        totals += torch.stack([stats["clipped"].sum(), stats["masked"].sum(), batch.loss_mask.sum()]).cpu()
        batch.is_weights = weights
        if args.tis_mode == "mask":  # rejected tokens leave the aggregation's units too
            batch.loss_mask = batch.loss_mask * (1.0 - stats["masked"])
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    tokens = max(totals[2].item(), 1.0)
    return {"tis_clipped_fraction": totals[0].item() / tokens, "tis_masked_fraction": totals[1].item() / tokens}
