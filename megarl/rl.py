"""The phases of one RL step, as calls on the roles this rank plays.

`train.py` runs them in order; this module owns who does what and how data
moves between roles:

  generate   rollout ranks: each engine takes a contiguous shard of the step's
             prompts, samples n responses per prompt and scores them; every
             rank then receives all samples (ordered by prompt).
  train      train ranks: before any update, each data-parallel rank computes
             old logprobs (reference logprobs / KL and critic values when
             used) for its shard and the shards are gathered; advantages are
             computed over the whole batch (the KL penalty enters the rewards
             first when placed there); then ppo_epochs passes over mini-batches
             of --global-batch-size samples, each data-parallel rank taking its
             share, one critic and one policy optimizer step per mini-batch.
  sync       trainer -> rollout weights (colocated or broadcast strategy).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl import distributed
from megarl.algorithms import (ADVANTAGE_ESTIMATORS, KL_CONTROLLERS, dynamic_sampling_keep, kl_penalty_in_reward,
                               sequence_rewards_to_tokens, soft_overlong_penalty, truncated_importance_weights,
                               truncation_keep)
from megarl.data import eval_prompts, prompt_source
from megarl.dumps import write_samples
from megarl.rewards import build_reward, default_system_prompt, score_all
from megarl.rollout import RolloutEngine, Sample
from megarl.weight_sync import BroadcastSync, ColocatedSync


class RLRun:
    def __init__(self, args, context: distributed.DistContext):
        from transformers import AutoConfig, AutoTokenizer

        self.args, self.context = args, context
        self.hf_config = AutoConfig.from_pretrained(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        system_prompt = args.system_prompt if args.system_prompt is not None else default_system_prompt(args.reward)
        self.prompts = prompt_source(args, self.tokenizer, system_prompt or None)
        self.eval_sets = eval_prompts(args, self.tokenizer, system_prompt or None) if args.eval_datasets else {}
        # Rewards are scored where samples are generated: a reward model lives on rollout ranks only.
        self.reward = build_reward(args.reward, args.reward_model) if context.is_rollout else None
        self.engine = self.trainer = self.critic = None
        self.reward_seconds = 0.0
        bucket_bytes = int(args.sync_bucket_mb * 2**20)

        # Engines before Megatron's parallel state (DESIGN.md: the measured order).
        if context.is_rollout:
            rollout_ranks = context.layout.rollout_ranks
            self.engine = RolloutEngine(args, rollout_ranks.index(context.env.rank), len(rollout_ranks))
        distributed.init_megatron_parallel(context, args.seed)
        if context.is_train:
            from megarl.trainer import Trainer

            self.trainer = Trainer(args, self.hf_config)
            if args.advantage_estimator == "gae":
                from megarl.critic import Critic

                self.critic = Critic(args, self.hf_config)
        self.kl_controller = None
        if args.kl_coef > 0:
            self.kl_controller = KL_CONTROLLERS["fixed"](args.kl_coef) if args.kl_controller == "fixed" else \
                KL_CONTROLLERS["adaptive"](args.kl_coef, args.kl_target, args.kl_horizon)
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
        self.reward_seconds = 0.0
        if args.dynamic_sampling is None:
            samples, metrics = self._rollout(self.prompts.batch(step, 0), step, seed_key=("train", 0)), {}
        else:
            samples, metrics = self._dynamic_sampling(step)
        metrics.update(_reward_errors(samples, f"step {step + 1}", self.context.env.rank == 0))
        # Rollout ranks score their own samples; the slowest one bounds the step.
        metrics["reward_seconds"] = max(distributed.all_gather_objects(self.reward_seconds, self.context))
        if args.rollout_save_dir and self.context.env.rank == 0:
            write_samples(args.rollout_save_dir, f"train_step{step + 1}.jsonl", samples, self.tokenizer, step + 1)
        return samples, metrics

    def _dynamic_sampling(self, step: int) -> tuple[list[Sample], dict]:
        args = self.args
        kept, dropped, generated, all_rewards = [], [], 0, []
        for attempt in range(args.max_num_gen_batches):
            samples = self._rollout(self.prompts.batch(step, attempt), step, seed_key=("train", attempt))
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

    def _rollout(self, prompts, step: int, n: int | None = None, temperature: float | None = None,
                 seed_key: tuple = ()) -> list[Sample]:
        """n samples for each prompt, scored, gathered to every rank in prompt order.

        Each engine takes a contiguous shard of the prompts; rewards are scored on the
        rollout rank that generated them (one batch call per engine).
        """
        n = n or self.args.num_generations
        mine = []
        if self.engine is not None:
            shard = _contiguous_shard(prompts, self.engine.engine_index, self.engine.num_engines)
            samples = self.engine.generate([p.ids for p in shard], [p.index for p in shard], step,
                                           n=n, temperature=temperature, seed_key=seed_key)
            by_index = {p.index: p for p in shard}
            for sample in samples:
                sample.metadata = by_index[sample.prompt_index].metadata
            scoring = time.perf_counter()
            outputs = score_all(self.reward, [s.response_text for s in samples], [s.metadata for s in samples])
            self.reward_seconds += time.perf_counter() - scoring
            for sample, output in zip(samples, outputs):
                sample.reward, sample.reason = output.score, output.reason
            # The ranks of one TP engine hold identical samples: only its first rank contributes.
            if self.context.layout.rollout_ranks.index(self.context.env.rank) % self.engine.tp == 0:
                mine = samples
        gathered = distributed.all_gather_objects(mine, self.context)
        samples = sorted((s for part in gathered for s in part), key=lambda s: s.prompt_index)
        expected = len(prompts) * (1 if temperature == 0 else n)
        if len(samples) != expected:
            raise RuntimeError(f"step {step}: expected {expected} samples, got {len(samples)}")
        return samples

    # ------------------------------------------------------------ evaluate ----
    def should_evaluate(self, completed_steps: int) -> bool:
        """Before the first step (0), every --eval-interval steps and after the last, with eval sets."""
        args = self.args
        if not self.eval_sets:
            return False
        return completed_steps in (0, args.train_steps) or bool(
            args.eval_interval and completed_steps % args.eval_interval == 0)

    def evaluate(self, completed_steps: int) -> dict:
        """Each eval set at --eval-temperature with --eval-samples k per prompt:
        pass@1 = fraction of samples scoring >= 1 (the unbiased pass@1 estimate from k samples),
        mean@k = mean score, and with k > 1 pass@k = fraction of prompts with a sample scoring >= 1."""
        args = self.args
        k = 1 if args.eval_temperature == 0 else args.eval_samples
        metrics = {}
        for name, prompts in self.eval_sets.items():
            samples = self._rollout(prompts, completed_steps, n=k, temperature=args.eval_temperature,
                                    seed_key=("eval", name))
            scores = torch.tensor([s.reward for s in samples]).view(len(prompts), k)
            correct = scores >= 1.0
            metrics[f"eval/{name}/pass@1"] = correct.float().mean().item()
            metrics[f"eval/{name}/mean@{k}"] = scores.mean().item()
            if k > 1:
                metrics[f"eval/{name}/pass@{k}"] = correct.any(dim=1).float().mean().item()
            metrics.update({f"eval/{name}/{key}": value for key, value in
                            _reward_errors(samples, f"eval {name}", self.context.env.rank == 0).items()})
            if args.rollout_save_dir and self.context.env.rank == 0:
                write_samples(args.rollout_save_dir, f"eval_{name}_step{completed_steps}.jsonl", samples,
                              self.tokenizer, completed_steps)
        return metrics

    # --------------------------------------------------------------- train ----
    def train(self, samples: list[Sample], step: int) -> dict:
        """Logprobs (and values) before any update, advantages over the whole batch, then
        ppo_epochs passes of optimizer steps over mini-batches of --global-batch-size samples."""
        if self.trainer is None:
            return {}
        from megatron.core import parallel_state

        args = self.args
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        scores, response_mask, token_mask, metrics = self._scores_and_mask(samples)
        started = time.perf_counter()
        before = self._before_update(samples, dp, dp_rank)
        metrics["logprobs_seconds"] = time.perf_counter() - started
        rollout = _response_aligned_rollout(samples, token_mask.shape[1])
        metrics.update(_mismatch(before["old_logprobs"], rollout, response_mask))
        fields = {name: before[name] for name in ("old_logprobs", "ref_logprobs", "old_values") if name in before}
        if args.tis_level != "none":
            weights, tis_metrics = _importance_weights(before["old_logprobs"], rollout, response_mask, args)
            fields["is_weights"] = weights
            metrics.update(tis_metrics)
            if args.tis_mode == "mask":  # rejected tokens leave the aggregation's units too
                token_mask = token_mask * (1.0 - tis_metrics.pop("_masked"))
        advantages, returns, adv_metrics = self.advantages(scores, response_mask, token_mask, before)
        fields.update(advantages=advantages, returns=returns)
        metrics.update(adv_metrics)

        update_actor = step >= args.critic_warmup
        policy_updates, critic_updates = [], []
        for epoch in range(args.ppo_epochs):
            for mine in self._mini_batch_indices(len(samples), step, epoch, dp, dp_rank):
                batches = self._micro_batches([samples[i] for i in mine],
                                              {name: value[mine] for name, value in fields.items()}, token_mask[mine])
                if self.critic is not None:
                    critic_updates.append(self.critic.train_step(batches))
                if update_actor:
                    policy_updates.append(self.trainer.train_step(batches, self.kl_coef_in_loss()))
        # Mean over the optimizer steps of this generation (verl's convention); with one step,
        # kl_old_new and clip_fraction are exactly 0: the ratio starts at 1.
        for updates in (policy_updates, critic_updates):
            if updates:
                metrics.update({key: sum(u[key] for u in updates) / len(updates) for key in updates[0]})
        if self.kl_controller is not None:
            metrics["kl_coef"] = self.kl_controller.value
        return metrics

    def kl_coef_in_loss(self) -> float:
        return self.kl_controller.value if self.kl_controller is not None and self.args.kl_placement == "loss" else 0.0

    def _scores_and_mask(self, samples):
        """Sequence scores (with the overlong penalty), the response tokens [N, R], and those of them
        left in the loss (filtered samples keep their reward in the group statistics)."""
        args = self.args
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        response_mask = (torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]).float()
        token_mask = response_mask
        scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        metrics = {}
        if args.overlong_buffer_len:
            penalty = soft_overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer_len)
            scores = scores + penalty
            metrics["overlong_penalty_mean"] = penalty.mean().item()
        if args.filter_truncated:
            keep = truncation_keep(lengths, args.max_new_tokens)
            token_mask = token_mask * keep[:, None].float()
            metrics["truncated_filtered"] = 1.0 - keep.float().mean().item()
        return scores, response_mask, token_mask, metrics

    def _micro_batches(self, samples, fields, token_mask):
        from megarl.trainer import make_micro_batches

        return make_micro_batches(samples, self.args.micro_batch_size, self.tokenizer.pad_token_id or 0,
                                  fields, token_mask)

    def _before_update(self, samples, dp: int, dp_rank: int) -> dict:
        """Old logprobs, and reference logprobs / KL and critic values when used, for every sample,
        response-aligned [N, R]: each data-parallel rank computes its contiguous shard, then
        the shards are gathered so every rank sees the whole batch."""
        from megatron.core import parallel_state

        share = len(samples) // dp
        batches = self._micro_batches(samples[dp_rank * share: (dp_rank + 1) * share], None, None)
        self.trainer.compute_logprobs(batches)
        if self.critic is not None:
            self.critic.compute_values(batches)
        width = max(len(s.response_ids) for s in samples)
        names = [name for name in ("old_logprobs", "ref_logprobs", "kl", "old_values")
                 if getattr(batches[0], name) is not None]
        local = torch.stack([torch.cat([b.response_aligned(getattr(b, name), width).cpu() for b in batches])
                             for name in names])  # [fields, share, R]
        parts = [torch.empty_like(local) for _ in range(dp)]
        dist.all_gather(parts, local, group=parallel_state.get_data_parallel_group())
        gathered = torch.cat(parts, dim=1)
        return {name: gathered[i] for i, name in enumerate(names)}

    def advantages(self, scores, response_mask, token_mask, before: dict):
        """Advantages and returns [N, R] over the whole batch, and metrics; the KL penalty enters
        the token rewards first when it is placed in the reward (and the controller adapts)."""
        args = self.args
        token_rewards = sequence_rewards_to_tokens(scores, response_mask)
        metrics = {}
        if "kl" in before:
            kl = before["kl"] * response_mask
            per_sample = (kl.sum(dim=1) / response_mask.sum(dim=1).clamp(min=1))
            metrics["kl_ref"] = (kl.sum() / response_mask.sum().clamp(min=1)).item()
            if args.kl_placement == "reward":
                token_rewards = kl_penalty_in_reward(token_rewards, kl, self.kl_controller.value, response_mask)
            # verl: current KL = batch mean of each sample's token-mean KL, n_steps = batch size.
            self.kl_controller.update(per_sample.mean().item(), n_steps=len(scores))
        advantages, returns = ADVANTAGE_ESTIMATORS[args.advantage_estimator](
            token_rewards, response_mask, args.num_generations, scale_rewards=args.scale_rewards, gamma=args.gamma,
            lam=args.lam, values=before.get("old_values", torch.zeros_like(token_rewards)) * response_mask)
        metrics["advantage_mean"] = ((advantages * token_mask).sum() / token_mask.sum().clamp(min=1)).item()
        return advantages, returns, metrics

    def _mini_batch_indices(self, num_samples: int, step: int, epoch: int, dp: int, dp_rank: int):
        """This data-parallel rank's sample indices of each mini-batch of one epoch.

        --shuffle permutes the samples per (seed, step, epoch), the same on every rank.
        """
        args = self.args
        order = torch.arange(num_samples)
        if args.shuffle:
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1_009 + epoch)
            order = torch.randperm(num_samples, generator=generator)
        size = args.global_batch_size
        share = size // dp
        return [order[start + dp_rank * share: start + (dp_rank + 1) * share]
                for start in range(0, num_samples, size)]

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


def _response_aligned_rollout(samples, width: int) -> torch.Tensor:
    """The engines' logprobs of the sampled tokens, [N, width]."""
    out = torch.zeros(len(samples), width)
    for row, sample in enumerate(samples):
        out[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return out


def _mismatch(old_logprobs, rollout_logprobs, mask) -> dict:
    """Rollout vs trainer logprobs of the sampled tokens, over the whole batch.

    mismatch: mean |trainer - rollout|; mismatch_kl: mean k3 estimate of
    KL(rollout || trainer) from the rollout's samples; ratio_dev_max: max
    |exp(trainer - rollout) - 1|, the importance ratio's distance from 1.
    """
    diff = (old_logprobs - rollout_logprobs) * mask
    tokens = mask.sum().clamp(min=1)
    return {"mismatch": (diff.abs().sum() / tokens).item(), "mismatch_max": diff.abs().max().item(),
            "mismatch_kl": ((torch.exp(diff) - diff - 1.0) * mask).sum().item() / tokens.item(),
            "ratio_dev_max": ((diff.exp() - 1) * mask).abs().max().item()}


def _importance_weights(old_logprobs, rollout_logprobs, mask, args) -> tuple[torch.Tensor, dict]:
    """Rollout -> trainer importance weights [N, R] (TIS / masking) and their metrics; "_masked" is
    the per-token rejection mask for the caller to drop from the loss."""
    weights, stats = truncated_importance_weights(old_logprobs, rollout_logprobs, mask, level=args.tis_level,
                                                  mode=args.tis_mode, threshold=args.tis_threshold)
    tokens = mask.sum().clamp(min=1).item()
    return weights, {"tis_clipped_fraction": stats["clipped"].sum().item() / tokens,
                     "tis_masked_fraction": stats["masked"].sum().item() / tokens, "_masked": stats["masked"]}


def _reward_errors(samples, where: str, report: bool) -> dict:
    """Count samples whose reward raised (they scored 0) and warn once for the batch."""
    failed = [s for s in samples if "error:" in s.reason]
    if failed and report:
        print(f"megarl: warning: {where}: the reward raised on {len(failed)} of {len(samples)} samples, "
              f"which score 0 (first: {failed[0].reason})", flush=True)
    return {"reward_errors": len(failed)}
