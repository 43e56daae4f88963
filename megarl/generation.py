"""The step's samples, from the engines to every rank: rollout orchestration below the phases.

One skeleton serves every generation (`_generate_shard` -> `collect`): each engine
takes a contiguous shard of the prompts and generates n samples per prompt; the
rollout ranks score what they generated, while the rest of the shard generates
(a reward model lives there); then every rank receives all samples, ordered by
prompt, and the count is checked. The engine is the rollout role's (the student),
or the standalone teacher's (--seq-kd and the teacher's evaluation), whose samples
are then scored by the rollout ranks.

Also here because they decide what is generated: DAPO's dynamic sampling (how
many batches), GKD's choice of whose responses a step trains on (`response_source`),
and a colocated teacher served by the rollout engines (`serving`).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from megarl import batch as batching, distributed
from megarl.algorithms import dynamic_sampling_keep
from megarl.data.prompts import reference_response_ids
from megarl.rewards import SCORER_TIMEOUT
from megarl.rewards.scoring import OverlappedScoring
from megarl.samples import Sample, stable_seed
from megarl.run import Run


@dataclass
class ShardSamples:
    """What this rank's engine generated of a step, before the samples are gathered to every rank."""

    step: int
    expected: int  # samples the whole step must have
    mine: list = field(default_factory=list)  # this engine's samples (its leader's; [] elsewhere)
    reward_seconds: float = 0.0
    seconds: float = 0.0  # generating and scoring
    what: str = "samples"  # named in the count check's error
    stats: dict = field(default_factory=dict)  # --max-staleness: the stream's counts over this generation
    deferred: bool = False  # --max-staleness: nothing generated ahead; the step makes its (non-student) responses

    def state_dict(self) -> dict:
        """Plain values (the samples as dicts), for a checkpoint of what is in flight (checkpoint.save)."""
        return {"step": self.step, "expected": self.expected, "samples": [asdict(s) for s in self.mine],
                "reward_seconds": self.reward_seconds, "seconds": self.seconds, "stats": dict(self.stats),
                "deferred": self.deferred}

    @classmethod
    def from_state_dict(cls, state: dict) -> ShardSamples:
        return cls(state["step"], state["expected"], [Sample(**s) for s in state["samples"]],
                   state["reward_seconds"], state["seconds"], stats=dict(state.get("stats", {})),
                   deferred=state.get("deferred", False))


def generate_ahead(run: Run, step: int, trained_at: int) -> ShardSamples:
    """--async-generation: the rollout ranks generate and score step `step`'s samples now, with the
    weights they hold, while the train ranks (which return at once) train on the previous step's;
    `collect` (in phases.generate) gathers them. No collective runs here, so the roles overlap.
    With --max-staleness the rollout engines' streams advance instead (megarl/streaming.py); the batch
    trains under weight version `trained_at`."""
    if run.args.max_staleness is not None and run.args.gkd_lmbda < 1.0 and \
            response_source(run.args.gkd_lmbda, run.args.seq_kd, run.args.seed, step) != "student":
        # a GKD step on the dataset's or the teacher's responses (--gkd-lmbda, --seq-kd): phases.generate makes
        # them in its step, with every rank; the stream waits
        return ShardSamples(step, run.args.prompts_per_step * run.args.num_generations, deferred=True)
    if run.stream is not None:
        return run.stream.advance(run, step, trained_at)
    if run.args.max_staleness is not None:  # a train rank: nothing generated here
        return ShardSamples(step, run.args.prompts_per_step * run.args.num_generations)
    started = time.perf_counter()
    shard = _generate_shard(run, run.rollout, run.prompts.batch(step, 0), step, seed_key=("train", 0),
                            min_tokens=run.args.min_new_tokens)
    shard.seconds = time.perf_counter() - started
    return shard


def forced_min_tokens(args, step: int, position: int) -> int:
    """The min_tokens of the training samples of step `step`'s prompt at `position`: --min-new-tokens, or with
    --min-new-tokens-tail LOW HIGH the prompt's own, drawn log-normally (median LOW * (HIGH / LOW)^(1/4), a
    quarter of the log range per standard deviation) and clipped to [LOW, HIGH]: the long-tailed response
    lengths of reasoning RL on any model (bench/async.py). Keyed by the prompt's place in the prompt stream, so
    every generation mode forces the same prompt to the same length."""
    if not args.min_new_tokens_tail:
        return args.min_new_tokens
    low, high = args.min_new_tokens_tail
    spread = (math.log(high) - math.log(low)) / 4
    draw = random.Random(stable_seed("min-new-tokens-tail", args.seed, step, position)).gauss(math.log(low) + spread,
                                                                                             spread)
    return int(min(max(round(math.exp(draw)), low), high))


def rollout(run: Run, prompts, step: int, n: int | None = None, temperature: float | None = None,
            seed_key: tuple = (), from_dataset: bool = False, min_tokens: int = 0, policy: str = "student"):
    """n samples for each prompt from the rollout engines, scored, on every rank in prompt order; and
    the seconds this rank waited for the scoring. `from_dataset`: the samples are n copies of each
    prompt's reference response instead. `min_tokens`: --min-new-tokens for the student's training
    samples, 0 for the rest (evaluation, --seq-kd's teacher) so that they stop where the model stops.
    `policy` "teacher": the engines serve a colocated teacher's weights (`serving`): the samples are
    not the student's, so they carry no rollout logprobs."""
    return collect(run, _generate_shard(run, run.rollout, prompts, step, n, temperature, seed_key, from_dataset,
                                        min_tokens, policy=policy))


def teacher_rollout(run: Run, prompts, step: int, n: int | None = None, temperature: float | None = None,
                    seed_key: tuple = ("seq-kd",)):
    """The standalone teacher's engines sample the responses (--seq-kd, and the teacher's evaluation),
    each engine a contiguous shard of the prompts; then the rollout ranks score them, each engine its
    shard. (samples on every rank in prompt order, this rank's scoring seconds)"""
    generated, _ = collect(run, _generate_shard(run, run.teacher_engine, prompts, step, n, temperature, seed_key,
                                                policy="teacher", score=False))
    scored = ShardSamples(step, len(generated), what="scored teacher samples")
    engine = run.rollout
    if engine is not None and engine.is_leader:  # the other ranks of a TP engine would score duplicates
        scored.mine = generated[batching.contiguous_shard(len(generated), engine.engine_index, engine.num_engines)]
        scored.reward_seconds = _score(run, scored.mine)
    return collect(run, scored)


def _generate_shard(run: Run, engine, prompts, step: int, n: int | None = None, temperature: float | None = None,
                    seed_key: tuple = (), from_dataset: bool = False, min_tokens: int = 0, policy: str = "student",
                    score: bool = True) -> ShardSamples:
    """This rank's engine's part (nothing on ranks without `engine`): its contiguous shard of the prompts,
    generated (with `score`, scored as each prompt finishes, while the rest generate), not yet gathered."""
    n = n or run.args.num_generations
    result = ShardSamples(step, len(prompts) * (1 if temperature == 0 else n),
                          what="samples" if policy == "student" else "teacher samples")
    if engine is None:
        return result
    shard = prompts[batching.contiguous_shard(len(prompts), engine.engine_index, engine.num_engines)]
    if min_tokens and run.args.min_new_tokens_tail:  # the training samples, each prompt its own length
        min_tokens = [forced_min_tokens(run.args, step, p.index) for p in shard]
    scoring = OverlappedScoring(run.reward, run.args.reward_workers, run.timed_rewards) if score else None

    def on_prompt_done(i, samples):
        _attach_prompt_rows(samples, [shard[i]])
        if scoring is not None and engine.is_leader:  # the other ranks of a TP engine hold the same samples
            scoring.submit(samples)

    if from_dataset:
        samples = []
        for i, prompt in enumerate(shard):
            samples += _reference_samples(run, prompt, n)
            on_prompt_done(i, samples[-n:])
    else:  # without scoring to overlap, vLLM's own generate loop: no callback
        # The student's samples are multi-turn episodes with --tools (megarl/multiturn.py); a teacher's are not.
        episodes = {"episodes": run.episodes, "rows": [p.metadata for p in shard]} \
            if run.episodes is not None and engine is run.rollout and policy == "student" else {}
        samples = engine.generate([p.ids for p in shard], [p.index for p in shard], step, n=n,
                                  temperature=temperature, seed_key=seed_key,
                                  on_prompt_done=on_prompt_done if scoring is not None else None,
                                  min_tokens=min_tokens, **episodes)
        if scoring is None:
            _attach_prompt_rows(samples, shard)
    if scoring is not None:
        scoring.finish()
        scoring.close()
        result.reward_seconds = scoring.wait_seconds
    for sample in samples:
        # A teacher's sample is off-policy by design, not stale: it takes the current version too.
        sample.weight_version = run.weight_version
        if policy != "student":
            sample.logprobs = None  # not the student's: no rollout logprobs, importance ratio 1
            sample.routes = None  # nor the student's routes: the trainer routes them itself
    if engine.is_leader:  # the ranks of one engine hold identical samples
        result.mine = samples
    return result


def collect(run: Run, shard: ShardSamples):
    """The step's samples on every rank, in prompt order (a prompt's samples keep their order), checked
    against the count the step must have; and this rank's scoring seconds."""
    gathered = distributed.all_gather_objects(shard.mine, run.context)
    samples = sorted((s for part in gathered for s in part), key=lambda s: s.prompt_index)
    if len(samples) != shard.expected:
        raise RuntimeError(f"step {shard.step}: expected {shard.expected} {shard.what}, got {len(samples)}")
    return samples, shard.reward_seconds


def response_source(lmbda: float, seq_kd: bool, seed: int, step: int) -> str:
    """Whose responses step `step` trains on: "student" (its own samples) with probability `lmbda`,
    else "teacher" (generated by the teacher) with `seq_kd`, else "dataset" (the rows' reference
    responses), as TRL's and ms-swift's GKD. Drawn from (seed, step) alone, so a resumed run
    makes the same choices."""
    if stable_seed(seed, step, "gkd-lmbda") / 2**63 < lmbda:
        return "student"
    return "teacher" if seq_kd else "dataset"


def dynamic_sampling(run: Run, step: int):
    """DAPO: up to --max-num-gen-batches batches, keeping the groups whose success rate lies strictly
    inside the range until prompts_per_step groups are kept; when the batches run out first, topped up
    with dropped groups (advantage 0 under grpo), as the metrics say."""
    args = run.args
    kept, dropped, generated, all_rewards, reward_seconds = [], [], 0, [], 0.0
    for attempt in range(args.max_num_gen_batches):
        samples, seconds = rollout(run, run.prompts.batch(step, attempt), step, seed_key=("train", attempt),
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


def reward_errors(samples, where: str, report: bool) -> dict:
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


@contextlib.contextmanager
def serving(run: Run, policy: str):
    """With policy "teacher" and a colocated teacher, the rollout engines serve the teacher's weights
    (read from --teacher-model; it has the student's shapes) for the duration, then get the student's
    back from the trainer. Nothing to do otherwise. Getting them back is the sync strategy's transfer
    but not a new weight version: the student's weights did not change, so samples stay as fresh as
    they were."""
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
        run.weight_sync.sync(run.actor, run.rollout)
