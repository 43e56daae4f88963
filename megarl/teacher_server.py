"""A distillation teacher behind an OpenAI-compatible vLLM server (--teacher-server URL; ms-swift's
`teacher_model_server`), for top-k distillation (GKD, OPSD).

Each sample's prompt + response (the teacher prompt for OPSD rows) goes to the server's
/v1/completions as token ids, with `max_tokens` 1 and `prompt_logprobs` K: vLLM answers every
position's top K (plus the token itself), which `teacher.response_topk` aligns to the response
exactly as the standalone teacher's engine (`TeacherEngine`) does, temperature rules included.

Who asks: launch rank 0 scores the whole batch, --teacher-server-batch sequences per request and up to
--teacher-server-concurrency requests in flight (the server batches them itself), and every rank
receives the fields from it (phases._score_on_teacher_server). One client keeps the server's load
bounded, whatever the number of ranks, and a failure is decided in one place.

Failures: every request is answered within --teacher-timeout seconds, retried (at most RETRIES more
times, while that time lasts) when the connection fails or the server answers 5xx; a 4xx answer is the
request's fault and is not retried. What does not succeed is a TeacherServerError naming the URL, raised
on every rank, in the teacher phase: before the update, so no checkpoint or weight is written half-way.

Checked at start (`connect`, before any process group): the server answers /v1/models within the
timeout, its max_model_len holds the longest sequence, a request for K prompt logprobs is accepted (vLLM
refuses K above its --max-logprobs, default 20; /v1/models does not publish it), and its tokenizer
splits a probe text as the student's does (/tokenize; a server without it is not checked, and then the
ids it returns are still checked against the student's vocabulary at every step).

Standard library only (urllib, json, concurrent.futures): nothing new to install on the train ranks.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from megarl.errors import ConfigError, TeacherServerError

RETRIES = 2
# Text whose split covers digits, punctuation, spaces, letters and multi-byte characters: two tokenizers
# that agree on it are very likely the same vocabulary (the cheap check; sharing one is the user's part).
PROBE_TEXT = "Hello world! 12 + 30 = 42; x_1 <= y.\n\tÜber naïve café 你好 🙂"


class TeacherServer:
    def __init__(self, url: str, model: str, k: int, timeout: float, batch: int, concurrency: int,
                 vocab_size: int, gkd_temperature: float, temperature: float):
        self.url, self.model, self.k, self.timeout = url.rstrip("/"), model, k, timeout
        self.batch, self.concurrency, self.vocab_size = batch, concurrency, vocab_size
        self.gkd_temperature, self.temperature = gkd_temperature, temperature

    # ------------------------------------------------------------------ HTTP ----
    def request(self, path: str, body: dict | None = None) -> dict:
        """The server's JSON answer to GET `path` (POST `body` when given) within --teacher-timeout,
        retried on connection failures and 5xx answers while that time lasts."""
        deadline = time.monotonic() + self.timeout
        for attempt in range(RETRIES + 1):
            left = deadline - time.monotonic()
            try:
                return _http(self.url + path, body, max(left, 0.1))
            except urllib.error.HTTPError as error:
                failure = f"{path} answered HTTP {error.code}: {_server_message(error)}"
                if error.code < 500:  # the request's fault: asking again gets the same answer
                    raise TeacherServerError(f"--teacher-server {self.url}: {failure}") from None
            except (OSError, ValueError) as error:  # refused, reset, timed out, not JSON
                failure = f"{path}: {_reason(error)}"
            pause = min(2.0 ** attempt, deadline - time.monotonic())
            if attempt == RETRIES or pause <= 0:
                break
            time.sleep(pause)
        raise TeacherServerError(f"--teacher-server {self.url}: {failure} ({attempt + 1} attempt"
                                 f"{'s' * bool(attempt)} within --teacher-timeout {self.timeout:g}s)")

    # --------------------------------------------------------------- scoring ----
    def score_samples(self, samples, width: int) -> dict[str, torch.Tensor]:
        """As TeacherEngine.score_samples: response-aligned top-k ids and logprobs (and the sampled tokens'
        logprobs at --temperature 1) of `samples`, from the server's prompt logprobs."""
        from megarl.teacher import response_topk

        sequences = [(s.teacher_prompt_ids or s.prompt_ids) + s.response_ids for s in samples]
        chunks = [sequences[i:i + self.batch] for i in range(0, len(sequences), self.batch)]
        pool = ThreadPoolExecutor(max(1, min(self.concurrency, len(chunks))), thread_name_prefix="teacher-server")
        try:
            futures = [pool.submit(self._prompt_logprobs, chunk) for chunk in chunks]
            answers = [entry for future in futures for entry in future.result()]
        finally:  # after a failure the requests not yet sent are not sent, and none is waited for
            pool.shutdown(wait=False, cancel_futures=True)
        positions = [[self._candidates(entry) for entry in answer[len(sequence) - len(sample.response_ids):]]
                     for sample, sequence, answer in zip(samples, sequences, answers)]
        return response_topk(samples, positions, width, self.k, self.gkd_temperature, self.temperature)

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list]:
        """Each sequence's prompt_logprobs entries (position t: the distribution of token t), one request."""
        answer = self.request("/v1/completions", {
            "model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": self.k})
        choices = sorted(answer.get("choices", []), key=lambda choice: choice["index"])
        if len(choices) != len(sequences) or any(len(c.get("prompt_logprobs") or ()) != len(s)
                                                 for c, s in zip(choices, sequences)):
            raise TeacherServerError(f"--teacher-server {self.url}: /v1/completions did not return the prompt "
                                     f"logprobs of every position of {len(sequences)} prompts (is it vLLM's "
                                     f"OpenAI server?)")
        return [choice["prompt_logprobs"] for choice in choices]

    def _candidates(self, entry: dict) -> dict[int, tuple[float, int]]:
        """One position's {token id: (logprob, rank)} from vLLM's JSON (ids are its keys, as strings)."""
        candidates = {int(token): (value["logprob"], value["rank"]) for token, value in entry.items()}
        if max(candidates) >= self.vocab_size:
            raise TeacherServerError(f"--teacher-server {self.url}: token id {max(candidates)} is outside the "
                                     f"student's vocabulary ({self.vocab_size}): the server's model does not "
                                     f"share it")
        return candidates


def connect(args, tokenizer, vocab_size: int) -> TeacherServer:
    """A client of --teacher-server after the start-up checks (module docstring), or a ConfigError naming
    the URL: the run has not started, so nothing is written."""
    url = args.teacher_server.rstrip("/")
    probe = TeacherServer(url, None, args.gkd_logits_topk, args.teacher_timeout, args.teacher_server_batch,
                          args.teacher_server_concurrency, vocab_size, args.gkd_temperature, args.temperature)
    try:
        models = probe.request("/v1/models").get("data") or []
        if not models:
            raise TeacherServerError(f"--teacher-server {url}: /v1/models lists no model")
        served = models[0]
        probe.model = served["id"]
        longest = args.max_prompt_length + args.max_new_tokens + 1  # prompt + response + the one token asked
        if served.get("max_model_len") and served["max_model_len"] < longest:
            raise ConfigError(f"--teacher-server {url}: its max_model_len {served['max_model_len']} is below "
                              f"max_prompt_length + max_new_tokens + 1 = {longest}; start it with "
                              f"--max-model-len {longest} or more")
        _check_tokenizer(probe, tokenizer)
        _check_max_logprobs(probe, tokenizer)
    except TeacherServerError as error:
        raise ConfigError(str(error)) from None
    return probe


def _check_max_logprobs(server: TeacherServer, tokenizer) -> None:
    """One request for K prompt logprobs: vLLM refuses K above its --max-logprobs (a 400 naming it)."""
    try:
        server.request("/v1/completions", {"model": server.model, "prompt": [tokenizer.encode(PROBE_TEXT)[:4]],
                                           "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": server.k})
    except TeacherServerError as error:
        if "HTTP 4" in str(error) and "logprobs" in str(error):
            raise ConfigError(f"--teacher-server {server.url}: the server refuses {server.k} prompt logprobs "
                              f"(--gkd-logits-topk {server.k}); start it with --max-logprobs {server.k} or more "
                              f"({str(error).split(': ', 1)[-1]})") from None
        raise


def _check_tokenizer(server: TeacherServer, tokenizer) -> None:
    try:
        answer = server.request("/tokenize", {"model": server.model, "prompt": PROBE_TEXT})
    except TeacherServerError as error:
        if "HTTP 404" in str(error):  # not vLLM's server: the vocabulary is checked per returned id only
            return
        raise
    ours = tokenizer.encode(PROBE_TEXT)
    if answer.get("tokens") != ours:
        raise ConfigError(f"--teacher-server {server.url}: its tokenizer splits a probe text into "
                          f"{answer.get('tokens')} but the student's (--tokenizer) into {ours}: distillation needs "
                          f"one vocabulary")


def _http(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _server_message(error: urllib.error.HTTPError) -> str:
    """vLLM's error message ({"error": {"message": ...}}), else the body's first line."""
    try:
        body = error.read().decode(errors="replace")
    except OSError:
        return error.reason or ""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return (body.strip().splitlines() or [str(error.reason)])[0][:200]


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
