"""Multi-turn episodes: the policy writes, calls tools, reads their results and goes on, in one engine.

`run_episodes` drives an in-rank vLLM engine (rollout.VllmEngine) request by request, as vLLM's own
generate loop does (LLM.enqueue, then `engine.step()` until nothing is left), with every episode of the
call in flight together:

  - each episode is one request per assistant turn (n = 1: episodes diverge after their first token);
    the first turns of all episodes are enqueued at once;
  - when a turn finishes, its tool calls are parsed (--tool-parser) and started on the ToolRunner's
    worker threads, and the engine goes on stepping the other requests: continuous batching across
    episodes, so a slow tool holds back only its own episode;
  - between engine steps the loop collects the finished calls; an episode whose calls are all back gets
    its tool messages appended (rendered by the chat template, `TurnMessages`) and its next turn enqueued
    as a new request whose prompt is the whole conversation so far (vLLM's prefix cache, where enabled,
    reuses the shared prefix);
  - when nothing is left to generate but tools still run, the loop waits for them (`tool_wait_seconds`:
    the engine idle);
  - tensor parallelism: every rank of an engine must enqueue the same requests at the same engine step,
    and a tool returns when it returns on each rank; so only the engine's leader runs tools, and at each
    step where some episode waits it broadcasts (vLLM's TP group) which episodes' calls are back, with
    their results, and every rank takes them up there.

An episode ends when a turn calls no tool (unless an --interaction replies as the user: the environment
answers, megarl/tools/interactions.py, and the user's turn is appended like a tool message, policy mask 0),
at --max-turns assistant turns (a last turn's calls are not run, no interaction is asked), or when its tokens after the prompt reach the episode budget --max-new-tokens (policy and tool
tokens together: it is the response the trainer sees, and the engine's max_model_len is the prompt's
limit plus it). Each turn's request may generate at most what is left of the budget; a tool message that
does not fit is cut and the episode ends truncated.

The Sample: `response_ids` is every token after the prompt (turns and tool messages in order),
`policy_mask` marks the policy's sampled tokens (1) against the tool messages' (0), `logprobs` has the
rollout's logprob of each policy token and 0 on tool tokens; `turns` is the conversation (assistant
messages with their parsed tool calls, tool messages with their error kind and seconds); `response_text`
is the last assistant turn (the final answer, what an answer-checking reward reads). --min-new-tokens
applies to the first turn (its positions are the first response tokens, where batch.sampler_constraint
puts the constraint).

Randomness: on Model Runner V2 every turn's request carries its own seed (from the call's key, the
prompt, the sample and the turn), so an episode samples the same tokens whatever the tools' timing; on
V1 (the CPU build) requests draw from the engine's generator in the order the engine steps them, and the
moment a tool returns decides that order: with tools, a CPU run is not reproducible bit for bit.

`request_log` (the loop's record, kept on the engine as `last_episode_log`): ("add" | "finish",
engine step, prompt, sample, turn) per request and ("tool_done", step, prompt, sample, turn) when a
turn's calls are all back (("reply", ...) when an interaction's reply is), so tests read the scheduling
from what the engine did, not from clocks.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

from megarl.tools import INTERACTION, TOOL_PARSERS, CallContext, ToolResult, ToolRunner
from megarl.tools.environments import EnvStep
from megarl.tools.interactions import Continue


@dataclass
class EpisodeSettings:
    runner: ToolRunner
    tokenizer: object
    max_turns: int
    parser: str = "hermes"
    interaction: object = None  # respond(turns, context) -> the user's reply or None (--interaction)


@dataclass(kw_only=True)
class Transcript:
    """An episode's tokens after its prompt and its conversation so far: what TurnTaking reads and extends (the
    episodes of run_episodes here, a streamed group's responses in megarl/streaming.py)."""

    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False
    ended_with_stop: bool = True  # the last turn ended on a stop token (not a --stop string)
    turn_start: int = 0  # where the current (or, between turns, the last) assistant turn's tokens begin
    running: list = field(default_factory=list)  # the last turn's tool calls in flight (ToolRunner handles)
    results: list = field(default_factory=list)  # their ToolResults, in call order, as they come back

    @property
    def turn(self) -> int:
        return sum(m["role"] == "assistant" for m in self.turns)

    def extend(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append tokens: the policy's (with their logprobs, policy mask 1) or, without logprobs, a tool's or the
        user's (mask 0, logprob 0)."""
        self.response_ids += ids
        self.policy_mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs

    def cut(self, end: int) -> None:
        """Drop the tokens from `end` on (an interaction's Continue cuts the last turn)."""
        del self.response_ids[end:], self.policy_mask[end:], self.logprobs[end:]


@dataclass
class _Episode(Transcript):
    prompt: int  # position in the call's prompt list
    sample: int
    prompt_ids: list[int]
    row: dict
    done: bool = False
    result: object = None  # the rollout Sample, once the episode has ended


class TurnMessages:
    """The tokens that follow an assistant turn when tools (or the user) answer it: the end of the
    assistant's turn as the chat template writes it after the model's last token (e.g. Qwen's newline
    after <|im_end|>), the tool (or user) messages and the next assistant generation prompt. Cut out of the template's rendering of a
    fixed exchange with and without them, so whatever the family's template does is what the model
    reads (verl's way)."""

    _BASE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]

    def __init__(self, tokenizer, stop_ids: tuple[int, ...]):
        from megarl.data.prompts import chat_token_ids, template_ids

        self.tokenizer, self._chat, self._template = tokenizer, chat_token_ids, template_ids
        base = template_ids(tokenizer, self._BASE)
        # After the model's end-of-turn token (the last stop id the template writes), what the template adds.
        ends = [i for i, token in enumerate(base) if token in stop_ids]
        self.base, self.after_stop = base, (base[ends[-1] + 1:] if ends else [])
        self.end_of_turn = base[ends[-1]:] if ends else []

    def ids(self, messages: list[dict], ended_with_stop: bool) -> list[int]:
        """`messages`: chat messages ({"role": "tool" | "user", "content": ...}) after the assistant's turn."""
        full = self._chat(self.tokenizer, self._BASE + messages)
        if full[: len(self.base)] != self.base:
            raise ValueError(f"the chat template renders a {messages[0]['role']} message that changes the assistant "
                             f"turn before it; cannot cut the message's tokens out of it")
        return (self.after_stop if ended_with_stop else self.end_of_turn) + full[len(self.base):]


def continue_turn(episode: Transcript, reply: Continue, tokenizer, stop_ids: tuple[int, ...]) -> list[int]:
    """An interaction's Continue on the episode's last assistant turn: its tokens cut where its text reaches
    the first of `reply.cut_before` (whole tokens, the last one kept only if its text ends at or before the
    cut) and without its end-of-turn (stop ids), the turn's record made the kept text plus the reply's
    (marked `continued`); the reply's text as tokens, to append (policy mask 0)."""
    turn = episode.turns[-1]
    text, ids = turn["content"], episode.response_ids[episode.turn_start:]
    cut = min([text.index(marker) for marker in reply.cut_before if marker in text], default=len(text))

    def length(k: int) -> int:
        return len(tokenizer.decode(ids[:k], skip_special_tokens=True))

    low, high = 0, len(ids)  # the most tokens whose text fits within text[:cut] (decoded lengths grow with k)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if length(middle) <= cut else (low, middle - 1)
    while low and ids[low - 1] in stop_ids:
        low -= 1
    episode.cut(episode.turn_start + low)
    kept = tokenizer.decode(ids[:low], skip_special_tokens=True)
    turn.update(content=kept + reply.text, continued=True)
    return tokenizer.encode(reply.text, add_special_tokens=False)


def tool_messages(results: list[ToolResult]) -> list[dict]:
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


class TurnTaking:
    """What happens between an episode's turns, for any loop that steps a vLLM engine (run_episodes below, and
    streaming generation's, megarl/streaming.py): a finished turn's calls parsed and started (the leader), the calls
    collected as they come back and their results broadcast over the engine's TP group, the tool (or user) messages
    appended, then `submit(episode)` for its next turn or `end(episode)`. The caller appends each turn's sampled
    tokens (Transcript.extend) before `turn_ended`."""

    def __init__(self, engine, settings: EpisodeSettings, budget: int, stop_ids: tuple[int, ...], submit, end,
                 log: list | None = None):
        self.settings, self.budget, self.stop_ids = settings, budget, stop_ids
        self.messages = TurnMessages(settings.tokenizer, stop_ids)
        self.parse = TOOL_PARSERS[settings.parser]
        self.submit, self.end, self.log = submit, end, log
        # The ranks of a TP engine must submit each next turn at the same engine step: only the leader runs
        # tools, and at each step where some episode waits it sends which came back, with their results.
        self.leader = engine.is_leader
        self.group = _tensor_parallel_group() if engine.tp > 1 else None
        self.waiting: list[Transcript] = []  # episodes whose tools (or interaction) run
        self.step = 0  # the engine step, for the log
        self.tool_wait = 0.0  # seconds the engine stood idle, waiting on tools only

    def _record(self, kind: str, episode) -> None:
        if self.log is not None:
            self.log.append((kind, self.step, episode.prompt, episode.sample, episode.turn))

    def turn_ended(self, episode: Transcript, text: str, finish_reason: str | None, where: tuple) -> None:
        """The assistant turn that began at episode.turn_start has ended (its tokens appended) with `text`;
        `where`: (the dataset row, the prompt's index, the sample) a tool call reads (CallContext)."""
        token_ids = episode.response_ids[episode.turn_start:]
        calls = self.parse(text)
        episode.turns.append({"role": "assistant", "content": text,
                              "tool_calls": [vars(c) for c in calls if hasattr(c, "arguments")]})
        if finish_reason == "length" or len(episode.response_ids) >= self.budget:
            episode.truncated = finish_reason == "length" or len(episode.response_ids) > self.budget
            return self.end(episode)
        if episode.turn >= self.settings.max_turns or (not calls and self.settings.interaction is None):
            return self.end(episode)
        episode.ended_with_stop = bool(token_ids) and token_ids[-1] in self.stop_ids
        if self.leader:  # the other ranks of a TP engine receive the results (`collect`)
            context = CallContext(*where, episode.turn)
            episode.running = [self.settings.runner.start(call, context, where[0].get("tools")) for call in calls] \
                if calls else [self.settings.runner.start_reply(self.settings.interaction, episode.turns, context)]
            episode.results = [None] * len(episode.running)
        self.waiting.append(episode)

    def collect(self) -> None:
        """Every waiting episode whose calls are all back (on the leader; the same on every TP rank) answered."""
        if not self.waiting:
            return
        back = [(k, results) for k, e in enumerate(self.waiting)
                if self.leader and (results := self._back(e)) is not None]
        if self.group is not None:
            back = self.group.broadcast_object(back if self.leader else None, src=0)
        answered = [self.waiting[k] for k, _ in back]
        self.waiting = [e for k, e in enumerate(self.waiting) if k not in {k for k, _ in back}]
        for episode, (_, results) in zip(answered, back):
            episode.running, episode.results = [], []
            self._answer(episode, results)

    def wait(self) -> None:
        """Nothing is left to generate but tools run: wait for the first of them (or a timeout's deadline)."""
        started = time.perf_counter()
        if self.leader:
            futures = [h.future for e in self.waiting for h in e.running if not isinstance(h, ToolResult)]
            concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        self.tool_wait += time.perf_counter() - started

    def settle(self) -> None:
        """Wait until every call in flight is back and answered."""
        while self.waiting:
            self.collect()
            if self.waiting:
                self.wait()

    def _back(self, episode: Transcript) -> list | None:
        """The leader's poll of an episode's calls: their results once all are back, else None."""
        for k, handle in enumerate(episode.running):
            if episode.results[k] is None:
                episode.results[k] = self.settings.runner.result(handle)
        return None if any(r is None for r in episode.results) else episode.results

    def _answer(self, episode: Transcript, results: list) -> None:
        """Append the tool messages of `results` (or the user's reply) and go on to the next turn (or end: out of
        budget, or the environment has nothing to say)."""
        if len(results) == 1 and results[0].name == INTERACTION:
            reply = results[0]
            self._record("reply", episode)
            if reply.error is not None:  # raised or timed out: counted (tool_metrics), the episode ends
                episode.turns[-1]["interaction_error"] = reply.error
            if reply.error is not None or reply.content is None:
                return self.end(episode)
            if isinstance(reply.content, Continue):
                ids = continue_turn(episode, reply.content, self.settings.tokenizer, self.stop_ids)
                return self._append(episode, ids)
            content = reply.content
            if isinstance(content, EnvStep):  # a gym environment's step: its reward on the turn it answers
                episode.turns[-1]["env_reward"], content = content.reward, content.observation
                if content is None:
                    return self.end(episode)
            said = [{"role": "user", "content": content}]
            episode.turns.append({**said[0], "seconds": reply.seconds})
        else:
            self._record("tool_done", episode)
            said = tool_messages(results)
            for result in results:
                episode.turns.append({"role": "tool", "name": result.name, "content": result.content,
                                      "error": result.error, "seconds": result.seconds})
        self._append(episode, self.messages.ids(said, episode.ended_with_stop))

    def _append(self, episode: Transcript, ids: list[int]) -> None:
        """The tool's (or user's) tokens, cut at the budget: the next turn, or the end when no room is left."""
        room = self.budget - len(episode.response_ids)
        episode.extend(ids[:room])
        if len(ids) >= room:
            episode.truncated = True
            return self.end(episode)
        episode.turn_start = len(episode.response_ids)
        self.submit(episode)


def run_episodes(engine, prompts: list[list[int]], prompt_indices: list[int], rows: list[dict], params: list,
                 n: int, settings: EpisodeSettings, first_turn_min_tokens: int, on_prompt_done=None,
                 seeds: list[list[int | None]] | None = None):
    """Episodes of every prompt (n each) through `engine` (a VllmEngine) together; (episodes as rollout
    Samples in prompt order, the samples of a prompt in order, the request log, tool-wait seconds).
    `params[i]`: prompt i's SamplingParams (n = 1, max_tokens = the episode budget), cloned per turn;
    `seeds[i][j]`: the first turn's seed of sample j of prompt i (None: unseeded, V1), later turns
    derive theirs from it; `on_prompt_done(i, samples)` as soon as prompt i's episodes have all ended."""
    from vllm.inputs import TokensPrompt

    from megarl.samples import Sample, stable_seed

    llm = engine.llm
    stop_ids = engine.held_back_ids(params[0]) if params else ()
    budget = params[0].max_tokens if params else 0
    episodes = [_Episode(i, j, list(prompt), rows[i]) for i, prompt in enumerate(prompts) for j in range(n)]
    by_request: dict[str, _Episode] = {}
    log, remaining = [], [n] * len(prompts)

    def enqueue(episode: _Episode):
        turn = episode.turn + 1
        request = params[episode.prompt].clone()
        request.n = 1
        request.max_tokens = budget - len(episode.response_ids)
        request.min_tokens = first_turn_min_tokens if turn == 1 else 0
        seed = seeds[episode.prompt][episode.sample] if seeds else None
        if seed is not None:
            request.seed = seed if turn == 1 else stable_seed("turn", seed, turn) >> 8
        # Outputs carry LLM's own request number (its counter), not the engine's id that enqueue returns.
        by_request[str(llm.request_counter.counter)] = episode
        llm.enqueue([TokensPrompt(prompt_token_ids=episode.prompt_ids + episode.response_ids)], [request],
                    lora_request=engine.lora_request, use_tqdm=False)  # the policy's adapter (--lora-sync adapter)
        log.append(("add", turns.step, episode.prompt, episode.sample, turn))

    def finish(episode: _Episode):
        episode.done = True
        # Built once: the scoring (on_prompt_done) writes the reward into the very Sample returned.
        final = next((m["content"] for m in reversed(episode.turns) if m["role"] == "assistant"), "")
        episode.result = Sample(prompt_indices[episode.prompt], episode.prompt_ids, episode.response_ids, final,
                                episode.logprobs, episode.truncated, min_tokens=first_turn_min_tokens,
                                held_back_ids=stop_ids if first_turn_min_tokens else (),
                                policy_mask=episode.policy_mask, turns=episode.turns)
        remaining[episode.prompt] -= 1
        if remaining[episode.prompt] == 0 and on_prompt_done is not None:
            on_prompt_done(episode.prompt, [e.result for e in episodes[episode.prompt * n:(episode.prompt + 1) * n]])

    turns = TurnTaking(engine, settings, budget, stop_ids, enqueue, finish, log)
    for episode in episodes:
        enqueue(episode)
    core = llm.llm_engine
    while core.has_unfinished_requests() or turns.waiting:
        if core.has_unfinished_requests():
            outputs = core.step()
            turns.step += 1
        else:
            turns.wait()
            outputs = []
        for output in outputs:
            if output.finished:
                episode, completion = by_request.pop(output.request_id), output.outputs[0]
                log.append(("finish", turns.step, episode.prompt, episode.sample, episode.turn + 1))
                episode.turn_start = len(episode.response_ids)
                episode.extend(list(completion.token_ids),
                               [lp[token].logprob for token, lp in zip(completion.token_ids, completion.logprobs)])
                turns.turn_ended(episode, completion.text, completion.finish_reason,
                                 (episode.row, prompt_indices[episode.prompt], episode.sample))
        turns.collect()
    if by_request or not all(e.done for e in episodes):
        raise RuntimeError(f"multi-turn: {len(by_request)} requests were never returned by vLLM")
    return [e.result for e in episodes], log, turns.tool_wait


def _tensor_parallel_group():
    """vLLM's tensor-parallel GroupCoordinator of this rank's engine (its leader is TP rank 0)."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()
