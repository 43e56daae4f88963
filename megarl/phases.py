"""The phases of one RL step, in the order `train.py` calls them, one call each.

  generate          rollout ranks: each engine takes a contiguous shard of the step's
                    prompts, samples n responses per prompt and scores them where they
                    were generated (a reward model lives on the rollout ranks); every
                    rank receives all samples, ordered by prompt. DAPO's dynamic
                    sampling lives here, since it decides how much to generate, and
                    so does GKD's choice of whose responses a step trains on
                    (--gkd-lmbda: the student's, else the dataset's or, with --seq-kd,
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
                    data-parallel rank its shard) or the standalone teacher ranks (each
                    engine its shard, sent to the train ranks over the cross-role group).
  compute_advantages  train ranks: advantages and returns over the whole batch (the KL
                    penalty enters the token rewards first when placed there).
  update            train ranks: --ppo-epochs passes over mini-batches of
                    --global-batch-size samples, each data-parallel rank its share; one
                    critic and one policy optimizer step per mini-batch.
  sync              every rank: trainer -> rollout weights (a weight_sync strategy).

Each phase returns a PhaseReport (its own seconds and metrics), after its output
when it has one. No phase reads another's metrics.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megarl import accelerator, batch as batching, distributed
from megarl.algorithms import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, distill_token_rewards, dynamic_sampling_keep,
                               kl_penalty_in_reward, sequence_rewards_to_tokens)
from megarl.batch import Batch
from megarl.dumps import write_samples
from megarl.model_runner import make_micro_batches
from megarl.rewards import SCORER_TIMEOUT
from megarl.scoring import OverlappedScoring
from megarl.prompts import reference_response_ids
from megarl.rollout import Sample, stable_seed
from megarl.run import Run


@dataclass
class PhaseReport:
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


# What this rank is doing: the phase (or "evaluate", "checkpoint save", ...) of the 1-based step; a rank
# that stops because another died says it (train.main).
activity = {"step": 0, "phase": "start-up"}


def phase(fn):
    """Time a phase. It returns its metrics dict, or (output, metrics); the caller gets
    a PhaseReport in the metrics' place."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        activity["phase"] = fn.__name__
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if isinstance(result, tuple):
            output, metrics = result
            return output, PhaseReport(time.perf_counter() - start, metrics)
        return PhaseReport(time.perf_counter() - start, result)

    return timed


# ------------------------------------------------------------------ generate ----
@dataclass
class ShardSamples:
    """What this rank's engine generated of a step, before the samples are gathered to every rank."""

    step: int
    expected: int  # samples the whole step must have
    mine: list = field(default_factory=list)  # this engine's samples (its leader's; [] elsewhere)
    reward_seconds: float = 0.0
    seconds: float = 0.0  # generating and scoring

    def state_dict(self) -> dict:
        """Plain values (the samples as dicts), for a checkpoint of what is in flight (checkpoint.save)."""
        return {"step": self.step, "expected": self.expected, "samples": [asdict(s) for s in self.mine],
                "reward_seconds": self.reward_seconds, "seconds": self.seconds}

    @classmethod
    def from_state_dict(cls, state: dict) -> ShardSamples:
        return cls(state["step"], state["expected"], [Sample(**s) for s in state["samples"]],
                   state["reward_seconds"], state["seconds"])


def generate_ahead(run: Run, step: int) -> ShardSamples:
    """--async-generation: the rollout ranks generate and score step `step`'s samples now, with the
    weights they hold, while the train ranks (which return at once) train on the previous step's;
    `generate(run, step, ahead)` gathers them. No collective runs here, so the roles overlap."""
    started = time.perf_counter()
    shard = _generate_shard(run, run.prompts.batch(step, 0), step, seed_key=("train", 0),
                            min_tokens=run.args.min_new_tokens)
    shard.seconds = time.perf_counter() - started
    return shard


@phase
def generate(run: Run, step: int, ahead: ShardSamples | None = None):
    """This step's samples (ordered by prompt), with DAPO dynamic sampling when enabled. With
    `ahead` (--async-generation) they were generated during the previous step (`generate_ahead`,
    one weight version behind: the `staleness` metric) and are only gathered here.

    Dynamic sampling generates up to --max-num-gen-batches batches and keeps the
    groups whose success rate lies strictly inside the range, until prompts_per_step
    groups are kept; if the batches run out first it tops up with dropped groups
    (advantage 0 under grpo) and says so in the metrics.
    With --gkd-lmbda < 1 some steps train on the dataset's (or, with --seq-kd, the
    teacher's) responses instead of the student's samples (`response_source`).
    """
    args = run.args
    source = response_source(args.gkd_lmbda, args.seq_kd, args.seed, step)
    # --seq-kd with a colocated teacher: the rollout engines serve its weights for this generation.
    with _serving(run, "teacher" if source == "teacher" else "student"), run.train_roles_offloaded():
        metrics = {}
        if ahead is not None:
            samples, reward_seconds = _collect(run, ahead)
            metrics["generate_ahead_seconds"] = max(distributed.all_gather_objects(ahead.seconds, run.context))
        elif source == "teacher" and run.context.placement.teacher is not None:
            samples, reward_seconds = _teacher_rollout(run, run.prompts.batch(step, 0), step)
        elif source == "teacher":
            samples, reward_seconds = _rollout(run, run.prompts.batch(step, 0), step, seed_key=("seq-kd",))
            for sample in samples:
                sample.logprobs = None  # the teacher's sample, not the student's
        elif source == "dataset" or args.dynamic_sampling is None:
            samples, reward_seconds = _rollout(run, run.prompts.batch(step, 0), step, seed_key=("train", 0),
                                               from_dataset=source == "dataset", min_tokens=args.min_new_tokens)
        else:
            samples, reward_seconds, metrics = _dynamic_sampling(run, step)
        _sleep_colocated_rollout(run)
    if args.gkd_lmbda < 1.0:
        metrics["on_policy"] = float(source == "student")
    # Weight versions between the policy that sampled and the one about to train (0: on-policy).
    metrics["staleness"] = run.weight_version - min(s.weight_version for s in samples)
    metrics.update(_reward_errors(samples, f"step {step + 1}", run.is_main))
    # Rollout ranks score their own samples; the slowest one bounds the step.
    metrics["reward_seconds"] = max(distributed.all_gather_objects(reward_seconds, run.context))
    if args.rollout_save_dir and run.is_main:
        write_samples(args.rollout_save_dir, f"train_step{step + 1}.jsonl", samples, run.tokenizer, step + 1)
    return samples, metrics


def response_source(lmbda: float, seq_kd: bool, seed: int, step: int) -> str:
    """Whose responses step `step` trains on: "student" (its own samples) with probability `lmbda`,
    else "teacher" (generated by the teacher) with `seq_kd`, else "dataset" (the rows' reference
    responses), as TRL's and ms-swift's GKD. Drawn from (seed, step) alone, so a resumed run
    makes the same choices."""
    if stable_seed(seed, step, "gkd-lmbda") / 2**63 < lmbda:
        return "student"
    return "teacher" if seq_kd else "dataset"


def _dynamic_sampling(run: Run, step: int):
    args = run.args
    kept, dropped, generated, all_rewards, reward_seconds = [], [], 0, [], 0.0
    for attempt in range(args.max_num_gen_batches):
        samples, seconds = _rollout(run, run.prompts.batch(step, attempt), step, seed_key=("train", attempt),
                                    min_tokens=args.min_new_tokens)
        reward_seconds += seconds
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
    return samples, reward_seconds, {
        "dapo_gen_batches": generated, "dapo_groups_kept": min(len(kept), args.prompts_per_step),
        "dapo_groups_dropped": len(dropped), "dapo_groups_topped_up": topped_up,
        "dapo_reward_all_mean": sum(all_rewards) / len(all_rewards)}


def _rollout(run: Run, prompts, step: int, n: int | None = None, temperature: float | None = None,
             seed_key: tuple = (), from_dataset: bool = False, min_tokens: int = 0):
    """n samples for each prompt, scored, gathered to every rank in prompt order; and the
    seconds this rank waited for the scoring. Each engine takes a contiguous shard of the prompts;
    rewards are scored on the rollout rank that generated them (one batch call per engine).
    `from_dataset`: the samples are n copies of each prompt's reference response instead.
    `min_tokens`: --min-new-tokens for the student's training samples, 0 for the rest (evaluation,
    --seq-kd's teacher) so that they stop where the model stops."""
    return _collect(run, _generate_shard(run, prompts, step, n, temperature, seed_key, from_dataset, min_tokens))


def _generate_shard(run: Run, prompts, step: int, n: int | None = None, temperature: float | None = None,
                    seed_key: tuple = (), from_dataset: bool = False, min_tokens: int = 0) -> ShardSamples:
    """`_rollout`'s part on this rank's engine (nothing elsewhere), without the gather."""
    n = n or run.args.num_generations
    result = ShardSamples(step, len(prompts) * (1 if temperature == 0 else n))
    engine = run.rollout
    if engine is not None:
        shard = prompts[batching.contiguous_shard(len(prompts), engine.engine_index, engine.num_engines)]
        scoring = OverlappedScoring(run.reward, run.args.reward_workers, run.timed_rewards)

        def score_prompt(i, samples):  # as each prompt's request finishes, while the rest generate
            _attach_prompt_rows(samples, [shard[i]])
            if engine.is_leader:  # the other ranks of a TP engine hold the same samples, which are dropped
                scoring.submit(samples)

        if from_dataset:
            samples = []
            for i, prompt in enumerate(shard):
                samples += _reference_samples(run, prompt, n)
                score_prompt(i, samples[-n:])
        else:
            samples = engine.generate([p.ids for p in shard], [p.index for p in shard], step, n=n,
                                      temperature=temperature, seed_key=seed_key, on_prompt_done=score_prompt,
                                      min_tokens=min_tokens)
        scoring.finish()
        scoring.close()
        result.reward_seconds = scoring.wait_seconds
        for sample in samples:
            sample.weight_version = run.weight_version
        if engine.is_leader:  # the ranks of one TP engine hold identical samples
            result.mine = samples
    return result


def _collect(run: Run, shard: ShardSamples):
    """The step's samples on every rank, in prompt order, and this rank's scoring seconds."""
    samples = _gather_in_prompt_order(run, shard.mine)
    if len(samples) != shard.expected:
        raise RuntimeError(f"step {shard.step}: expected {shard.expected} samples, got {len(samples)}")
    return samples, shard.reward_seconds


def _teacher_rollout(run: Run, prompts, step: int, n: int | None = None, temperature: float | None = None,
                     seed_key: tuple = ("seq-kd",)):
    """The standalone teacher's engines sample the responses (--seq-kd, and the teacher's evaluation),
    each engine a contiguous shard of the prompts; then the rollout ranks score them, each engine
    its shard."""
    n = n or run.args.num_generations
    engine, mine = run.teacher if run.context.placement.teacher is not None else None, []
    if engine is not None:
        shard = prompts[batching.contiguous_shard(len(prompts), engine.engine_index, engine.num_engines)]
        samples = engine.generate([p.ids for p in shard], [p.index for p in shard], step, n=n,
                                  temperature=temperature, seed_key=seed_key)
        for sample in samples:
            sample.logprobs = None  # the teacher's sample, not the student's
            sample.weight_version = run.weight_version  # off-policy by design, not stale
        _attach_prompt_rows(samples, shard)
        if engine.is_leader:
            mine = samples
    samples, reward_seconds = _gather_in_prompt_order(run, mine), 0.0
    engine = run.rollout
    scored = []
    if engine is not None:
        scored = samples[batching.contiguous_shard(len(samples), engine.engine_index, engine.num_engines)]
        reward_seconds = _score(run, scored)
        scored = scored if engine.is_leader else []
    samples = _gather_in_prompt_order(run, scored)
    expected = len(prompts) * (1 if temperature == 0 else n)
    if len(samples) != expected:
        raise RuntimeError(f"step {step}: expected {expected} teacher samples, got {len(samples)}")
    return samples, reward_seconds


def _reference_samples(run: Run, prompt, n: int) -> list[Sample]:
    """n copies of the prompt's reference response (its row's final assistant message or `response`
    field), as the chat template renders the assistant's turn, cut at --max-new-tokens."""
    text = prompt.metadata.get("reference_solution") or prompt.metadata.get("response")
    if not text:
        raise ValueError(f"{prompt.metadata.get('origin') or f'prompt {prompt.index}'}: --gkd-lmbda "
                         f"{run.args.gkd_lmbda} trains some steps on the dataset's responses, but this row has "
                         f"none (a final assistant message or a 'response' field)")
    ids = reference_response_ids(run.tokenizer, prompt.metadata["messages"], text)
    limit = run.args.max_new_tokens
    return [Sample(prompt.index, list(prompt.ids), ids[:limit], text, None, truncated=len(ids) > limit)
            for _ in range(n)]


def _attach_prompt_rows(samples, prompts) -> None:
    """Give each sample its prompt's row (what the reward reads) and OPSD teacher prompt."""
    by_index = {p.index: p for p in prompts}
    for sample in samples:
        prompt = by_index[sample.prompt_index]
        sample.metadata, sample.teacher_prompt_ids = prompt.metadata, prompt.teacher_ids


def _score(run: Run, samples) -> float:
    """Reward each sample in place (one batch call, in this thread); the seconds it took."""
    scoring = OverlappedScoring(run.reward, workers=0, timed=run.timed_rewards)
    scoring.submit(samples)
    scoring.finish()
    return scoring.wait_seconds


def _gather_in_prompt_order(run: Run, mine: list) -> list:
    """Every rank's contribution, on every rank, ordered by prompt (a prompt's samples keep their order)."""
    gathered = distributed.all_gather_objects(mine, run.context)
    return sorted((s for part in gathered for s in part), key=lambda s: s.prompt_index)


def _sleep_colocated_rollout(run: Run) -> None:
    """Colocated: the engine gives its memory back to the trainer until the next sync wakes it."""
    if run.rollout is not None and run.context.placement.colocated:
        run.rollout.offload()


def _reward_errors(samples, where: str, report: bool) -> dict:
    """Count samples whose reward raised (or whose reward worker died) and those whose reward call ran
    past --reward-timeout (they scored 0), and warn once for the batch."""
    failed = [s for s in samples if "error:" in s.reason]
    timed_out = [s for s in samples if s.reason.startswith(SCORER_TIMEOUT)]
    if (failed or timed_out) and report:
        what = [f"the reward raised on {len(failed)}" if failed else "",
                f"ran past --reward-timeout on {len(timed_out)}" if timed_out else ""]
        first = (failed or timed_out)[0].reason
        print(f"megarl: warning: {where}: {' and '.join(w for w in what if w)} of {len(samples)} samples, "
              f"which score 0 (first: {first})", flush=True)
    return {"reward_errors": len(failed), "reward_timeouts": len(timed_out)}


# ---------------------------------------------------------- score and filter ----
@phase
def score_and_filter(run: Run, samples):
    args = run.args
    return batching.score_and_filter(samples, args.max_new_tokens, args.overlong_buffer_len, args.filter_truncated)


# ------------------------------------------------------------------- prepare ----
def report_old_logprobs_path(run: Run) -> None:
    """Rank 0 says once, at the start, where the old logprobs come from (batch.two_pass_reason)."""
    if not run.is_main or run.actor is None:
        return
    args, first = run.args, run.args.critic_warmup
    reason = batching.two_pass_reason(args, first)
    if reason is not None:
        print(f"megarl: old logprobs: a separate forward pass before each update ({reason})", flush=True)
        return
    warmup = f" (from step {first + 1}; a separate pass during the critic warm-up)" if first else ""
    print(f"megarl: old logprobs: from the update's own forward, on-policy, no separate pass{warmup}", flush=True)


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
    if run.critic is not None:
        computed["old_values"] = run.critic.values(micro_batches, batch.width)
    for name, value in _gather_over_data_parallel(computed).items():
        setattr(batch, name, value * batch.response_mask)
    if shortcut:
        if not all(s.logprobs is not None for s in batch.samples):
            raise RuntimeError("the on-policy shortcut needs the rollout's logprobs of every sample")
        return batch, {"on_policy_shortcut": 1.0}
    return batch, {**_rollout_correction(args, batch), "on_policy_shortcut": 0.0}


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
    if placement.teacher is not None:
        scored = _score_on_teacher_ranks(run, batch)
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
    if batch.teacher_logprobs is None:  # a standalone teacher at --temperature != 1
        return batch, {}
    batch.teacher_logprobs = batch.teacher_logprobs * batch.response_mask
    gap = (batch.old_logprobs - batch.teacher_logprobs) * batch.response_mask
    return batch, {"teacher_kl": (gap.sum() / batch.response_mask.sum().clamp(min=1)).item()}


def _score_on_teacher_ranks(run: Run, batch: Batch) -> dict[str, torch.Tensor]:
    """Standalone teacher: each engine scores its contiguous shard of the batch; every rank receives
    the whole batch's fields over the cross-role group (engines in launch-rank order = shard order)."""
    engine, mine = run.teacher, None
    if engine is not None:
        shard = batching.contiguous_shard(len(batch), engine.engine_index, engine.num_engines)
        scored = engine.score(batch.samples[shard], batch.width, run.args.gkd_logits_topk)
        mine = scored if engine.is_leader else None
    parts = [part for part in distributed.all_gather_objects(mine, run.context) if part is not None]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


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
                              max_tokens=args.max_tokens_per_micro_batch, packed=args.padding_free)


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
    batch.advantages, batch.returns = ADVANTAGE_ESTIMATORS[args.advantage_estimator](
        token_rewards, mask, args.num_generations, scale_rewards=args.scale_rewards, gamma=args.gamma,
        lam=args.lam, values=values * mask)
    loss_mask = batch.loss_mask
    metrics["advantage_mean"] = ((batch.advantages * loss_mask).sum() / loss_mask.sum().clamp(min=1)).item()
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
    for epoch in range(args.ppo_epochs):
        seed = batching.shuffle_seed(args.seed, step, epoch) if args.shuffle else None
        for mine in batching.mini_batch_indices(len(batch), args.global_batch_size, dp, dp_rank, seed):
            micro_batches = _micro_batches(run, batch.select(mine))
            padding += torch.tensor([[b.padding_tokens(), b.tokens.numel()] for b in micro_batches]).sum(dim=0)
            if run.critic is not None:
                critic_updates.append(run.critic.train_step(micro_batches))
            if update_actor:
                policy_updates.append(run.actor.train_step(micro_batches, kl_coef, run.reference, run.teacher,
                                                           on_policy=shortcut))
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


# ------------------------------------------------------------------ evaluate ----
def should_evaluate(run: Run, completed_steps: int) -> bool:
    """Before the first step (0), every --eval-interval steps and after the last, with eval sets."""
    args = run.args
    if not run.eval_sets:
        return False
    return completed_steps in (0, args.train_steps) or bool(
        args.eval_interval and completed_steps % args.eval_interval == 0)


def evaluate(run: Run, completed_steps: int) -> dict:
    """Each eval set at --eval-temperature with --eval-samples k per prompt:
    pass@1 = fraction of samples scoring >= 1 (the unbiased pass@1 estimate from k samples),
    mean@k = mean score, and with k > 1 pass@k = fraction of prompts with a sample scoring >= 1.
    Before the first step, with a distillation teacher, the same for the teacher (teacher_pass@1, ...):
    the mark the student is distilled towards."""
    metrics = _evaluate(run, completed_steps, policy="student")
    if completed_steps == 0 and _teacher_can_generate(run):
        metrics.update(_evaluate(run, completed_steps, policy="teacher"))
    return metrics


def _evaluate(run: Run, completed_steps: int, policy: str) -> dict:
    args = run.args
    k = 1 if args.eval_temperature == 0 else args.eval_samples
    prefix = "" if policy == "student" else "teacher_"
    metrics = {}
    with _serving(run, policy):
        for name, prompts in run.eval_sets.items():
            with run.train_roles_offloaded():
                options = dict(n=k, temperature=args.eval_temperature, seed_key=("eval", name))
                if policy == "teacher" and run.context.placement.teacher is not None:
                    samples, _ = _teacher_rollout(run, prompts, completed_steps, **options)
                else:
                    samples, _ = _rollout(run, prompts, completed_steps, **options)
            scores = torch.tensor([s.reward for s in samples]).view(len(prompts), k)
            correct = scores >= 1.0
            metrics[f"eval/{name}/{prefix}pass@1"] = correct.float().mean().item()
            metrics[f"eval/{name}/{prefix}mean@{k}"] = scores.mean().item()
            if k > 1:
                metrics[f"eval/{name}/{prefix}pass@{k}"] = correct.any(dim=1).float().mean().item()
            metrics.update({f"eval/{name}/{prefix}{key}": value for key, value in
                            _reward_errors(samples, f"eval {name} ({policy})", run.is_main).items()})
            if args.rollout_save_dir and run.is_main:
                write_samples(args.rollout_save_dir, f"eval_{name}_{prefix}step{completed_steps}.jsonl", samples,
                              run.tokenizer, completed_steps)
    return metrics


def _teacher_can_generate(run: Run) -> bool:
    """Whether the teacher's pass@1 can be measured: its standalone vLLM engines generate; a colocated
    teacher's weights are served by the rollout engines for the evaluation, which needs the student's
    architecture (same shapes). Otherwise rank 0 says why it is skipped."""
    args = run.args
    if run.context.placement.teacher is not None:
        return True
    if not args.teacher_model:
        return False
    from transformers import AutoConfig

    from megarl.models.families import shape_difference

    differ = shape_difference(AutoConfig.from_pretrained(args.teacher_model), run.hf_config)
    if differ and run.is_main:
        print(f"megarl: the teacher's pass@1 is not measured: its {differ} differs from the student's, so the "
              f"rollout engines cannot serve it (standalone teacher ranks can)", flush=True)
    return differ is None


@contextlib.contextmanager
def _serving(run: Run, policy: str):
    """With policy "teacher" and a colocated teacher, the rollout engines serve the teacher's weights
    (read from --teacher-model; it has the student's shapes) for the duration, then get the
    student's back by a weight sync. Nothing to do otherwise."""
    if policy == "student" or run.context.placement.teacher is not None:
        yield
        return
    if run.rollout is not None:
        from megarl.models.convert import HFCheckpoint

        checkpoint = HFCheckpoint(run.args.teacher_model)
        run.rollout.load_weights((name, checkpoint.get(name)) for name in checkpoint.weight_map)
    try:
        yield
    finally:
        sync(run)


def save_hf(run: Run, out_dir: str) -> None:
    """The current policy as an HF checkpoint, written by train rank 0."""
    if run.actor is not None:
        from megarl.models.convert import save_hf_checkpoint

        save_hf_checkpoint(run.actor.model, run.hf_config, out_dir, tokenizer=run.tokenizer,
                           is_writer=run.is_main, source_dir=run.args.model)
