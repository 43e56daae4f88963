"""The phases of one RL step, in the order `train.py` calls them, one call each.

  generate          rollout ranks: each engine takes a contiguous shard of the step's
                    prompts, samples n responses per prompt and scores them where they
                    were generated (a reward model lives on the rollout ranks); every
                    rank receives all samples, ordered by prompt (megarl/generation.py).
                    DAPO's dynamic sampling belongs here, since it decides how much to
                    generate, and so does GKD's choice of whose responses a step trains
                    on (--gkd-lmbda: the student's, else the dataset's or, with --seq-kd,
                    the teacher's).
  score_and_filter  every rank: the typed Batch, with sequence scores (overlong penalty)
                    and the masks of what stays in the loss (truncation filter).
  prepare           train ranks, before any update: old logprobs, reference logprobs /
                    KL and critic values, each data-parallel rank its contiguous shard,
                    then gathered so every rank holds the whole batch; the rollout vs
                    trainer mismatch and, with TIS, importance weights. An exactly
                    on-policy update (batch.two_pass_reason) skips the old-logprob pass:
                    the update's training forward gives them, and those metrics.
  teach             distillation: the teacher's logprobs of the sampled tokens and its
                    top-k per response position, from the colocated teacher (each
                    data-parallel rank its shard), the standalone teacher ranks (each
                    engine its shard, sent to the train ranks over the cross-role group)
                    or a teacher server (--teacher-server: rank 0 asks for all of it and
                    every rank receives it).
  compute_advantages  train ranks: advantages and returns over the whole batch (the KL
                    penalty enters the token rewards first when placed there).
  update            train ranks: --ppo-epochs passes over mini-batches of
                    --global-batch-size samples, each data-parallel rank its share; one
                    critic and one policy optimizer step per mini-batch.
  sync              every rank: trainer -> rollout weights (a weight_sync strategy).

Each phase returns a PhaseReport (its own seconds and metrics), after its output
when it has one. No phase reads another's metrics. While a phase runs, the run's
`activity` names it (a failing rank says where it was).

Around the step, not phases of it: evaluation (megarl/evaluation.py), checkpoints
and the HF export (megarl/checkpoint.py), preemption (megarl/preemption.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl import accelerator, batch as batching, distributed, generation
from megarl.algorithms import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, distill_token_rewards, kl_penalty_in_reward,
                               sequence_rewards_to_tokens)
from megarl.batch import Batch
from megarl.data.dumps import write_samples
from megarl.errors import TeacherServerError
from megarl.generation import ShardSamples
from megarl.model_runner import make_micro_batches, sequence_multiple
from megarl.run import Run
from megarl.tools import tool_metrics


@dataclass
class PhaseReport:
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def phase(fn):
    """Time a phase. It returns its metrics dict, or (output, metrics); the caller gets
    a PhaseReport in the metrics' place. The run's `activity` names it while it runs."""
    @functools.wraps(fn)
    def timed(run: Run, *args, **kwargs):
        run.activity.phase = fn.__name__
        start = time.perf_counter()
        result = fn(run, *args, **kwargs)
        if isinstance(result, tuple):
            output, metrics = result
            return output, PhaseReport(time.perf_counter() - start, metrics)
        return PhaseReport(time.perf_counter() - start, result)

    return timed


def staleness_metrics(samples, version: int, bound: int) -> dict:
    """--max-staleness K = `bound`: how far behind `version` (the policy about to train) the samples' tokens were
    sampled: per sample by its oldest token (the mean; the max is `staleness`), per token (the mean, and the
    histogram: the share of tokens d versions behind, d = 0..K), and the share of samples whose tokens span more
    than one version (partial rollouts); sampled tokens only (not a tool's)."""
    token_lags = [version - v for s in samples for v in _sampled(s)]
    total = max(len(token_lags), 1)
    return {"staleness_mean": sum(version - s.weight_version for s in samples) / len(samples),
            "token_staleness_mean": sum(token_lags) / total,
            **{f"token_staleness_share/{lag}": token_lags.count(lag) / total for lag in range(bound + 1)},
            "partial_fraction": sum(len(set(_sampled(s))) > 1 for s in samples) / len(samples)}


def _sampled(sample) -> list[int]:
    """The versions of a sample's sampled tokens (a tool's tokens, policy mask 0, are not samples of any)."""
    if sample.token_versions is None:
        return [sample.weight_version]
    mask = sample.policy_mask or [1] * len(sample.token_versions)
    return [v for v, sampled in zip(sample.token_versions, mask) if sampled]


# ------------------------------------------------------------------ generate ----
@phase
def generate(run: Run, step: int, ahead: ShardSamples | None = None):
    """This step's samples (ordered by prompt), with DAPO dynamic sampling when enabled. With
    `ahead` (--async-generation) they were generated during the previous step (`generation.generate_ahead`,
    one weight version behind: the `staleness` metric) and are only gathered here.

    Dynamic sampling generates up to --max-num-gen-batches batches and keeps the
    groups whose success rate lies strictly inside the range, until prompts_per_step
    groups are kept; if the batches run out first it tops up with dropped groups
    (advantage 0 under grpo) and says so in the metrics.
    With --gkd-lmbda < 1 some steps train on the dataset's (or, with --seq-kd, the
    teacher's) responses instead of the student's samples (`response_source`).
    """
    args = run.args
    source = generation.response_source(args.gkd_lmbda, args.seq_kd, args.seed, step)
    # Streaming reads the prompt stream ahead of the steps (megarl/streaming.py): a step only looks at its batch.
    prompts = run.prompts.peek(step) if args.max_staleness is not None else run.prompts.batch(step, 0)
    # --seq-kd with a colocated teacher: the rollout engines serve its weights for this generation.
    with generation.serving(run, "teacher" if source == "teacher" else "student"), run.rollout_turn():
        metrics = {}
        if ahead is not None and not ahead.deferred:
            samples, reward_seconds = generation.collect(run, ahead)
            gathered = distributed.all_gather_objects((ahead.seconds, ahead.stats), run.context)
            metrics["generate_ahead_seconds"] = max(seconds for seconds, _ in gathered)
            for _, stats in gathered:  # --max-staleness: each engine's stream counts (its leader's)
                for name, count in stats.items():
                    metrics[name] = metrics.get(name, 0) + count
            scored = metrics.pop("stream_samples_scored", 0)
            reward_sum = metrics.pop("stream_reward_sum", 0.0)
            if args.dynamic_sampling is not None and scored:  # every sample scored, the given-up groups' too
                metrics["dapo_reward_all_mean"] = reward_sum / scored
        elif source == "teacher" and run.teacher_engine_placed:
            samples, reward_seconds = generation.teacher_rollout(run, prompts, step)
        elif source == "teacher":
            samples, reward_seconds = generation.rollout(run, prompts, step, seed_key=("seq-kd",), policy="teacher")
        elif source == "dataset" or args.dynamic_sampling is None:
            samples, reward_seconds = generation.rollout(run, prompts, step, seed_key=("train", 0),
                                                         from_dataset=source == "dataset",
                                                         min_tokens=args.min_new_tokens)
        else:
            samples, reward_seconds, metrics = generation.dynamic_sampling(run, step)
    if args.gkd_lmbda < 1.0:
        metrics["on_policy"] = float(source == "student")
    # Weight versions between the policy that sampled and the one about to train (0: on-policy).
    metrics["staleness"] = run.weight_version - min(s.weight_version for s in samples)
    if args.max_staleness is not None:
        metrics.update(staleness_metrics(samples, run.weight_version, args.max_staleness))
    metrics.update(generation.reward_errors(samples, f"step {step + 1}", run.is_main))
    metrics.update(tool_metrics(samples))
    tool_wait = 0.0
    if run.episodes is not None:  # the engine idle, only tools left to wait for (megarl/multiturn.py)
        tool_wait, run.rollout.tool_wait_seconds = run.rollout.tool_wait_seconds, 0.0
    # Rollout ranks score their own samples; the slowest one bounds the step.
    seconds = distributed.all_gather_objects((reward_seconds, tool_wait), run.context)
    metrics["reward_seconds"] = max(reward for reward, _ in seconds)
    if args.tools or args.interaction:
        metrics["tool_wait_seconds"] = max(wait for _, wait in seconds)
    if args.rollout_save_dir and run.is_main:
        write_samples(args.rollout_save_dir, f"train_step{step + 1}.jsonl", samples, run.tokenizer, step + 1)
    return samples, metrics


# ---------------------------------------------------------- score and filter ----
@phase
def score_and_filter(run: Run, samples):
    args = run.args
    return batching.score_and_filter(samples, args.max_new_tokens, args.overlong_buffer_len, args.filter_truncated,
                                     args.overlong_penalty_factor)


# ------------------------------------------------------------------- prepare ----
@phase
def prepare(run: Run, batch: Batch, shortcut: bool = False):
    """Old logprobs (reference logprobs / KL, critic values when used) of every sample. With
    `shortcut` (batch.on_policy_update) no old logprobs: the update's own forward gives them, and the
    mismatch metrics and TIS weights with them; the critic's values are still computed here."""
    if run.actor is None:
        return batch, {}
    args, placement = run.args, run.context.placement
    mine = batch.select(torch.arange(len(batch))[batching.data_parallel_shard(
        len(batch), placement.dp, placement.data_parallel_rank(run.context.rank))])
    micro_batches = _micro_batches(run, mine)
    computed = {} if shortcut else _old_logprobs_and_reference(run, micro_batches, batch.width)
    routing = {} if shortcut else run.actor.routing_metrics()  # the update reports it in the shortcut
    if run.critic is not None:
        computed["old_values"] = run.critic.values(micro_batches, batch.width)
    for name, value in _gather_over_data_parallel(computed).items():
        setattr(batch, name, value * batch.response_mask)
    if shortcut:
        if not all(s.logprobs is not None for s in batch.samples):
            raise RuntimeError("the on-policy shortcut needs the rollout's logprobs of every sample")
        return batch, {"on_policy_shortcut": 1.0}
    return batch, {**_rollout_correction(args, batch), "on_policy_shortcut": 0.0, **routing}


def _old_logprobs_and_reference(run: Run, micro_batches, width: int) -> dict[str, torch.Tensor]:
    """This rank's old logprobs and, with a reference, its logprobs and the per-token KL to it."""
    args = run.args
    full_kl_to = run.reference if run.reference is not None and args.kl_estimator == "full" else None
    old_logprobs, ref_kl = run.actor.logprobs(micro_batches, width, full_kl_to=full_kl_to)
    computed = {"old_logprobs": old_logprobs}
    if run.reference is not None and full_kl_to is None:
        computed["ref_logprobs"] = run.reference.logprobs(micro_batches, width)
        ref_kl = KL_ESTIMATORS[args.kl_estimator](old_logprobs, computed["ref_logprobs"])
    if ref_kl is not None:
        computed["ref_kl"] = ref_kl
    return computed


def _rollout_correction(args, batch: Batch) -> dict:
    """Rollout vs trainer on the whole batch: the mismatch metrics and, with TIS, the importance
    weights (set on the batch)."""
    metrics = {}
    on_policy = torch.tensor([s.logprobs is not None for s in batch.samples])
    if not on_policy.all():  # dataset or teacher responses: no rollout logprobs, importance ratio 1
        batch.rollout_logprobs = torch.where(on_policy[:, None], batch.rollout_logprobs, batch.old_logprobs)
    if on_policy.any():
        metrics.update(batching.mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs,
                                                 batch.response_mask * on_policy[:, None]))
    if args.tis_level != "none":
        metrics.update(batching.importance_weights(batch, args.tis_level, args.tis_mode, args.tis_threshold))
    return metrics


# ------------------------------------------------------------------- teacher ----
@phase
def teach(run: Run, batch: Batch):
    """The teacher's view of the student's samples on every train rank (distillation): the sampled
    tokens' logprobs `teacher_logprobs` and, for top-k distillation, `teacher_topk_ids` and
    `teacher_topk_logprobs` per response position (OPSD rows: after their teacher prompt);
    also teacher_kl, a k1 estimate of KL(student || teacher) per token on these samples."""
    args, placement = run.args, run.context.placement
    if run.teacher_engine_placed:
        scored = _score_on_teacher_ranks(run, batch)
    elif args.teacher_server:
        scored = _score_on_teacher_server(run, batch)
    elif run.teacher is not None:
        mine = batch.select(torch.arange(len(batch))[batching.data_parallel_shard(
            len(batch), placement.dp, placement.data_parallel_rank(run.context.rank))])
        scored = _gather_over_data_parallel(run.teacher.score(
            _micro_batches(run, mine), batch.width, args.gkd_logits_topk))
    else:
        return batch, {}
    if run.actor is None:
        return batch, {}
    for name, value in scored.items():
        setattr(batch, name, value)
    if batch.teacher_logprobs is None:  # a vLLM teacher (ranks or server) at --temperature != 1
        return batch, {}
    batch.teacher_logprobs = batch.teacher_logprobs * batch.response_mask
    gap = (batch.old_logprobs - batch.teacher_logprobs) * batch.response_mask
    return batch, {"teacher_kl": (gap.sum() / batch.response_mask.sum().clamp(min=1)).item()}


def _score_on_teacher_ranks(run: Run, batch: Batch) -> dict[str, torch.Tensor]:
    """Standalone teacher: each engine scores its contiguous shard of the batch; every rank receives
    the whole batch's fields over the cross-role group (engines in launch-rank order = shard order)."""
    engine, mine = run.teacher_engine, None
    if engine is not None:
        shard = batching.contiguous_shard(len(batch), engine.engine_index, engine.num_engines)
        scored = engine.score_samples(batch.samples[shard], batch.width, run.args.gkd_logits_topk)
        # Token ids travel as int32 (any vocabulary fits): half the bytes of [N, R, K] longs.
        mine = {name: value.to(torch.int32) if name == "teacher_topk_ids" else value
                for name, value in scored.items()} if engine.is_leader else None
    # As tensors, not pickles: at 512 samples x 4k tokens x K = 64 the top-k fields are about 1.6 GB.
    parts = [part for part in distributed.gather_tensor_dicts(mine, run.context) if part is not None]
    whole = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    if "teacher_topk_ids" in whole:
        whole["teacher_topk_ids"] = whole["teacher_topk_ids"].long()
    return whole


def _score_on_teacher_server(run: Run, batch: Batch) -> dict[str, torch.Tensor]:
    """--teacher-server: launch rank 0 asks the server for the whole batch (megarl/teacher_server.py: its
    requests batched and bounded in number) and every rank receives the fields from it. A server that does
    not answer is a TeacherServerError on every rank alike, here, before the update: nothing is half-written."""
    scored, failure = None, None
    if run.teacher_server is not None:
        try:
            scored = run.teacher_server.score_samples(batch.samples, batch.width)
        except TeacherServerError as error:
            failure = str(error)
    failure = distributed.all_gather_objects(failure, run.context)[0]
    if failure is not None:
        raise TeacherServerError(failure)
    if scored is not None:  # as the standalone teacher's: ids as int32, half the bytes
        scored["teacher_topk_ids"] = scored["teacher_topk_ids"].to(torch.int32)
    whole = dict(distributed.gather_tensor_dicts(scored, run.context)[0])
    whole["teacher_topk_ids"] = whole["teacher_topk_ids"].long()
    return whole


def _gather_over_data_parallel(computed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each data-parallel rank's contiguous shard [share, R, ...] of each field -> the whole batch
    [N, R, ...] on every rank (on the accelerator: NCCL gathers device tensors only), back in
    host memory."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    gathered = {}
    for name, value in computed.items():
        local = value.to(accelerator.device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        gathered[name] = torch.cat(parts).cpu()
    return gathered


def _micro_batches(run: Run, batch: Batch):
    args = run.args
    return make_micro_batches(batch, args.micro_batch_size, run.tokenizer.pad_token_id or 0,
                              max_tokens=args.max_tokens_per_micro_batch, packed=args.padding_free,
                              sequence_multiple=sequence_multiple(args))


def _padding_fraction(padding: torch.Tensor) -> float:
    """(padding, computed) token counts of this rank's micro-batches -> the padding's share of the tokens
    computed, over the data-parallel ranks."""
    from megatron.core import parallel_state

    padding = padding.to(accelerator.device())
    dist.all_reduce(padding, group=parallel_state.get_data_parallel_group())
    return (padding[0] / padding[1].clamp(min=1)).item()


# ---------------------------------------------------------------- advantages ----
@phase
def compute_advantages(run: Run, batch: Batch):
    """Advantages and returns [N, R] over the whole batch; with a reference, the KL to it is
    measured and adapts the controller, and enters the token rewards when placed there; with
    --distill-reward-coef, -(log pi_student - log pi_teacher) of each sampled token joins them."""
    if run.actor is None:
        return batch, {}
    args, mask = run.args, batch.response_mask
    token_rewards = sequence_rewards_to_tokens(batch.scores, mask)
    metrics = {}
    if batch.ref_kl is not None:
        kl = batch.ref_kl * mask
        per_sample = kl.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        metrics["kl_ref"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        if args.kl_placement == "reward":
            token_rewards = kl_penalty_in_reward(token_rewards, kl, run.kl_controller.value, mask)
        # verl: current KL = batch mean of each sample's token-mean KL, n_steps = batch size.
        run.kl_controller.update(per_sample.mean().item(), n_steps=len(batch))
        metrics["kl_coef"] = run.kl_controller.value
    if args.distill_reward_coef:  # on-policy distillation in policy-gradient form
        token_rewards = token_rewards + args.distill_reward_coef * distill_token_rewards(
            batch.old_logprobs, batch.teacher_logprobs, mask)
    values = batch.old_values if batch.old_values is not None else torch.zeros_like(token_rewards)
    options = {"real_tau": args.real_tau} if args.advantage_estimator == "real" else {}
    batch.advantages, batch.returns = ADVANTAGE_ESTIMATORS[args.advantage_estimator](
        token_rewards, mask, args.num_generations, scale_rewards=args.scale_rewards, gamma=args.gamma,
        lam=args.lam, values=values * mask, **options)
    loss_mask = batch.loss_mask
    tokens = loss_mask.sum().clamp(min=1)
    metrics["advantage_mean"] = ((batch.advantages * loss_mask).sum() / tokens).item()
    # 0 exactly when no sample carries a learning signal (every group's rewards equal, GRPO): what a test
    # comparing two runs checks first, and a user's sign that a step trained on nothing (verl logs max/min).
    metrics["advantage_abs_mean"] = ((batch.advantages.abs() * loss_mask).sum() / tokens).item()
    return batch, metrics


# -------------------------------------------------------------------- update ----
@phase
def update(run: Run, batch: Batch, step: int, shortcut: bool = False) -> dict:
    """--ppo-epochs passes of optimizer steps over mini-batches of --global-batch-size samples.
    Metrics are means over the optimizer steps (verl's convention); with one step,
    kl_old_new and clip_fraction are 0: the ratio starts at 1 (exactly, with `shortcut`:
    batch.on_policy_update, the old logprobs are the training forward's own, and so are the
    mismatch metrics and TIS weights)."""
    if run.actor is None:
        return {}
    args, placement = run.args, run.context.placement
    dp, dp_rank = placement.dp, placement.data_parallel_rank(run.context.rank)
    update_actor = step >= args.critic_warmup
    kl_coef = run.kl_controller.value if run.kl_controller is not None and args.kl_placement == "loss" else 0.0
    policy_updates, critic_updates, padding = [], [], torch.zeros(2)
    # --sft-alpha (ms-swift's GKD): the step trains on the dataset's (or --seq-kd teacher's) responses, which
    # carry no rollout logprobs; a step's samples all come from one source (generation.response_source).
    sft = args.sft_alpha > 0 and any(s.logprobs is None for s in batch.samples)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch.samples] if args.balance_batch else None
    for epoch in range(args.ppo_epochs):
        seed = batching.shuffle_seed(args.seed, step, epoch) if args.shuffle else None
        for mine in batching.mini_batch_indices(len(batch), args.global_batch_size, dp, dp_rank, seed, lengths):
            micro_batches = _micro_batches(run, batch.select(mine))
            padding += torch.tensor([[b.padding_tokens(), b.tokens.numel()] for b in micro_batches]).sum(dim=0)
            if run.critic is not None:
                critic_updates.append(run.critic.train_step(micro_batches))
            if update_actor:
                policy_updates.append(run.actor.train_step(micro_batches, kl_coef, run.reference, run.teacher,
                                                           on_policy=shortcut, sft=sft))
    metrics = {"padding_fraction": _padding_fraction(padding)}
    for updates in (policy_updates, critic_updates):
        if updates:
            metrics.update({key: sum(u[key] for u in updates) / len(updates) for key in updates[0]})
    return metrics


# ---------------------------------------------------------------------- sync ----
@phase
def sync(run: Run) -> dict:
    stats = run.weight_sync.sync(run.actor, run.rollout)
    run.weight_version += 1
    return {"sync_bytes": stats.bytes}
