"""Streaming generation (--max-staleness K, issue 55): the rollout engines never wait for a step's slowest response.

With --async-generation alone, the rollout ranks generate step k+1's prompts from scratch while the trainer trains
step k, and a step's batch waits for its longest response. With --max-staleness the rollout engine of each
rollout rank keeps `--stream-groups` prompt groups in flight (`GenerationStream`): whenever a group's last
response ends, the next prompt of the stream takes its place, and the next step's batch is cut as soon as the
engine's share of it (prompts_per_step / engines groups) has finished. Groups still running stay in flight.
At the weight sync the trainer's new policy arrives; what happens to a response in flight then is
--partial-rollout's choice:
  * on: it keeps its tokens and goes on under the new weights. Its request is resubmitted with the prompt and the
    tokens so far as the new prompt, so the engine's cache of the prefix is recomputed under the new weights and
    every later token is the new policy's sample given the whole prefix (what the trainer recomputes);
  * off (abort): it is restarted from its prompt.
Every response token records the weight version that sampled it (Sample.token_versions). A group may be trained
K versions after its oldest token's: the batch of step s trains under version v_s, so a group whose oldest token
would be more than K versions old when it could be cut at the earliest is restarted from its prompt (or, with
--stale-groups drop, given up for the next prompt), counted in the step's metrics. K = 1 keeps no response across
a sync: every batch is sampled by the one policy before the trainer's, as --async-generation alone.

Why cuts and syncs at these points only: the run stays deterministic. The rollout ranks take the same SPMD steps as
the trainer ranks (train.py's loop): the stream advances only inside generation.generate_ahead, until its batch
share has finished, never by wall-clock; the weights change only at the step's sync. So which responses a batch
holds, and which version sampled each token, follow from the seed alone: a resumed run continues bit for bit from
the state a checkpoint keeps (`state_dict`: the groups in flight with their tokens, logprobs and versions, the
finished ones not yet cut, the stream's position), since after every sync the requests in flight are resubmitted
from those anyway. The sampler's randomness is reseeded at each advance from (--seed, engine, step), as
VllmEngine.generate does.

DAPO's --dynamic-sampling filters each group as it finishes (`_filter`): the cut takes kept groups only.

LoRA adapter sync needs nothing more: a request resubmitted after a sync runs with the adapter just loaded.

Not built yet (refused at parse): the colocated placement (its roles take turns), the HF backend, GKD's
--gkd-lmbda < 1 / --seq-kd, --tools, --routing-replay (off), --stop strings.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from megarl.algorithms import dynamic_sampling_keep
from megarl.generation import ShardSamples, _score, forced_min_tokens
from megarl.rollout import response_text, sampling_params
from megarl.run import Run
from megarl.samples import Sample, stable_seed


@dataclass
class Response:
    """One response of a group, as far as it has been generated."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    finish: str | None = None  # vLLM's finish_reason once it ended ("stop", "length")
    restarts: int = 0  # how many times it was resubmitted (each sync it spans)


@dataclass
class Group:
    """One prompt of the stream and its --num-generations responses."""

    number: int  # the stream's prompt: prompts.batch(number // prompts_per_step)[number % prompts_per_step]
    responses: list[Response]
    restarted: int = 0  # times the whole group was restarted for staleness (or, aborting, at a sync)
    scored: list | None = None  # --dynamic-sampling: (reward, reason) of each response, scored as it finished

    @property
    def done(self) -> bool:
        return all(r.finish is not None for r in self.responses)

    def oldest_version(self) -> int | None:
        return min((r.versions[0] for r in self.responses if r.versions), default=None)


class GenerationStream:
    """The streaming state of this rank's rollout engine (module docstring); every rank of a TP engine holds the
    same, having taken the same steps."""

    def __init__(self, run: Run):
        args, engine = run.args, run.rollout
        self.engine_index, self.num_engines = engine.engine_index, engine.num_engines
        self.share = args.prompts_per_step // engine.num_engines  # groups of each batch this engine gives
        self.capacity = args.stream_groups or self.share
        self.next_number = self.engine_index  # this engine's prompts of the stream: e, e + E, e + 2E, ...
        self.running: list[Group] = []  # in flight, in the order they entered
        self.finished: list[Group] = []  # complete, in the order they finished, not cut into a batch yet
        self.requests: dict[str, tuple[Group, int]] = {}  # vLLM request id -> (group, response)
        self._batches: dict[int, list] = {}  # the prompt batches of the groups held (`_prompt`)
        self._submitted = 0  # requests submitted by this process (their ids)
        self.counts = {"stream_groups_restarted": 0, "stream_groups_dropped": 0, "stream_responses_resumed": 0,
                       "stream_groups_filtered": 0, "stream_groups_topped_up": 0, "stream_reward_sum": 0.0,
                       "stream_samples_scored": 0}

    # -------------------------------------------------------------------------------- the step ----

    def advance(self, run: Run, step: int, trained_at: int) -> ShardSamples:
        """Generate until this engine's share of step `step`'s batch has finished; that batch, scored (its groups in
        the order they finished). The batch trains under weight version `trained_at`."""
        args, engine = run.args, run.rollout
        started = time.perf_counter()
        counts_before = dict(self.counts)
        self._carry_over(run, trained_at)
        torch.manual_seed(stable_seed(args.seed, self.engine_index, step, "stream"))
        self._fill(run)
        core = engine.llm.llm_engine
        filtered = 0  # groups --dynamic-sampling gave up during this advance
        while len(self.finished) < self.share:
            if not core.has_unfinished_requests():
                raise RuntimeError(f"streaming generation: the engine has no request left, {len(self.finished)} of "
                                   f"{self.share} groups finished")
            for output in core.step():
                self._take(output, run.weight_version)
            if args.dynamic_sampling is not None:
                filtered = self._filter(run, filtered)
            self._fill(run)
        self._pause(run)
        cut, self.finished = self.finished[:self.share], self.finished[self.share:]
        shard = ShardSamples(step, args.prompts_per_step * args.num_generations)
        samples, unscored = [], []
        for position, group in enumerate(cut):
            group_samples = self._samples(run, group, self.engine_index * self.share + position)
            if group.scored is None:
                unscored += group_samples
            else:
                for sample, (reward, reason) in zip(group_samples, group.scored):
                    sample.reward, sample.reason = reward, reason
            samples += group_samples
        shard.reward_seconds = _score(run, unscored) if engine.is_leader else 0.0
        if engine.is_leader:
            shard.mine = samples
        shard.seconds = time.perf_counter() - started
        if engine.is_leader:  # one count per engine
            shard.stats = {name: self.counts[name] - counts_before[name] for name in self.counts}
        return shard

    def _filter(self, run: Run, filtered: int) -> int:
        """--dynamic-sampling (DAPO): each newly finished group scored at once, and given up when its success rate
        is not strictly inside the range (its advantages would be 0), so the cut takes kept groups only; after
        (--max-num-gen-batches - 1) x the engine's share given up in one advance, the rest are kept whatever they
        score (DAPO's top-up). Every rank of the engine scores (the same rewards), so they all cut alike. The
        groups given up so far in this advance."""
        args = run.args
        for group in [g for g in self.finished if g.scored is None]:
            samples = self._samples(run, group, 0)
            _score(run, samples)
            group.scored = [(s.reward, s.reason) for s in samples]
            self.counts["stream_reward_sum"] += sum(s.reward for s in samples)
            self.counts["stream_samples_scored"] += len(samples)
            keep = bool(dynamic_sampling_keep(torch.tensor([[s.reward for s in samples]]),
                                              *args.dynamic_sampling)[0])
            if keep:
                continue
            if filtered < (args.max_num_gen_batches - 1) * self.share:
                self.finished.remove(group)
                self.counts["stream_groups_filtered"] += 1
                filtered += 1
            else:
                self.counts["stream_groups_topped_up"] += 1
        return filtered

    def _carry_over(self, run: Run, trained_at: int) -> None:
        """Before generating under new weights: every response in flight is resubmitted, with --partial-rollout
        with its tokens so far, else from its prompt; a group that could not be trained within --max-staleness
        versions of its oldest token (cut at the earliest into this batch, trained under `trained_at`) is
        restarted, or with --stale-groups drop given up."""
        args = run.args
        keep_running, keep_finished = [], []
        for group in self.running + self.finished:
            if not args.partial_rollout:
                for j, response in enumerate(group.responses):
                    if response.finish is None and response.ids:
                        group.responses[j] = Response()
            oldest = group.oldest_version()
            if oldest is not None and trained_at - oldest > args.max_staleness:
                if args.stale_groups == "drop":
                    self.counts["stream_groups_dropped"] += 1
                    continue
                group.responses = [Response() for _ in group.responses]
                group.restarted, group.scored = group.restarted + 1, None
                self.counts["stream_groups_restarted"] += 1
            (keep_finished if group.done else keep_running).append(group)
        self.running, self.finished = keep_running, keep_finished
        for group in self.running:
            for j, response in enumerate(group.responses):
                if response.finish is None:
                    if response.ids:
                        response.restarts += 1
                        self.counts["stream_responses_resumed"] += 1
                    self._submit(run, group, j)

    def _pause(self, run: Run) -> None:
        """Take the requests in flight out of the engine, their tokens kept (`_carry_over` resubmits them): between
        advances the engine holds nothing, so an evaluation's generate runs alone and a checkpoint is the whole
        state."""
        if self.requests:
            run.rollout.llm.llm_engine.abort_request(list(self.requests))
            self.requests.clear()

    def _fill(self, run: Run) -> None:
        """Start new prompts of the stream until `capacity` groups are in flight."""
        while len(self.running) < self.capacity:
            group = Group(self.next_number, [Response() for _ in range(run.args.num_generations)])
            self.next_number += self.num_engines
            self.running.append(group)
            for j in range(len(group.responses)):
                self._submit(run, group, j)

    def _submit(self, run: Run, group: Group, j: int) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        args, engine = run.args, run.rollout
        response = group.responses[j]
        prompt = self._prompt(run, group.number)
        forced = self._forced(args, group.number)
        params = sampling_params(args, [group.number], 0, ("stream", j, response.restarts, group.restarted), 1,
                                 args.temperature, max(forced - len(response.ids), 0), engine.seeds_per_request,
                                 detokenize=False)[0]
        params.max_tokens = args.max_new_tokens - len(response.ids)
        params.output_kind = RequestOutputKind.DELTA  # each step's new tokens: a request's prefix survives an abort
        # vLLM's engine directly: LLM.enqueue would ask for the final output only (and its ids are LLM's counter's)
        self._submitted += 1
        request_id = f"stream-{self._submitted}"
        engine.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt.ids) + response.ids),
                                          params, lora_request=engine.lora_request)
        self.requests[request_id] = (group, j)

    def _take(self, output, version: int) -> None:
        """One engine step's output of a request: its new tokens, their logprobs and version."""
        group, j = self.requests[output.request_id]
        response, completion = group.responses[j], output.outputs[0]
        new = list(completion.token_ids)
        response.ids += new
        response.logprobs += [entry[token].logprob for token, entry in zip(new, completion.logprobs or [])]
        response.versions += [version] * len(new)
        if output.finished:
            response.finish = completion.finish_reason
            del self.requests[output.request_id]
            if group.done:
                self.running.remove(group)
                self.finished.append(group)

    def _prompt(self, run: Run, number: int):
        """The stream's prompt `number`: the prompts of step number // prompts_per_step, read once while any of
        them is in flight (a step's prompts are rendered and tokenized together)."""
        batch, position = divmod(number, run.args.prompts_per_step)
        if batch not in self._batches:
            oldest = min((g.number for g in self.running + self.finished), default=number) // run.args.prompts_per_step
            self._batches = {b: prompts for b, prompts in self._batches.items() if b >= oldest}
            self._batches[batch] = run.prompts.batch(batch, 0)
        return self._batches[batch][position]

    @staticmethod
    def _forced(args, number: int) -> int:
        return forced_min_tokens(args, *divmod(number, args.prompts_per_step))

    def _samples(self, run: Run, group: Group, index: int) -> list[Sample]:
        """The group's responses as the batch's samples of prompt `index`."""
        args, engine = run.args, run.rollout
        prompt = self._prompt(run, group.number)
        forced = self._forced(args, group.number)
        held_back = engine.held_back_ids(sampling_params(args, [0], 0, (), 1, args.temperature, forced, False)[0]) \
            if forced else ()
        tokenizer = engine.llm.get_tokenizer()
        samples = []
        for response in group.responses:
            sample = Sample(index, list(prompt.ids), list(response.ids),
                            response_text(tokenizer, response.ids, response.finish == "stop"),
                            list(response.logprobs), truncated=response.finish == "length",
                            min_tokens=forced if held_back else 0, held_back_ids=held_back,
                            weight_version=min(response.versions), token_versions=list(response.versions))
            sample.metadata, sample.teacher_prompt_ids = prompt.metadata, prompt.teacher_ids
            samples.append(sample)
        return samples

    # ------------------------------------------------------------------------------ checkpoint ----

    def state_dict(self) -> dict:
        return {"engine_index": self.engine_index, "num_engines": self.num_engines, "share": self.share,
                "capacity": self.capacity, "next_number": self.next_number,
                "running": [asdict(g) for g in self.running], "finished": [asdict(g) for g in self.finished],
                "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("engine_index", "num_engines", "share", "capacity"):
            if state[key] != getattr(self, key):
                raise ValueError(f"streaming state: {key} was {state[key]}, now {getattr(self, key)}")
        self.next_number, self.counts = state["next_number"], dict(state["counts"])

        def group(saved):
            return Group(saved["number"], [Response(**r) for r in saved["responses"]], saved["restarted"],
                         [tuple(pair) for pair in saved["scored"]] if saved["scored"] is not None else None)

        self.running = [group(g) for g in state["running"]]
        self.finished = [group(g) for g in state["finished"]]
