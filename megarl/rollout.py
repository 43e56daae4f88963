"""Rollout role: a vLLM engine inside this rank (`distributed_executor_backend="external_launcher"`).

`VllmEngine` is one in-rank engine of a vLLM role (start-up, seeded generation);
`RolloutEngine` adds what the rollout needs (weight loading, offload/onload). The
standalone teacher's engine (megarl/teacher.py) is the other kind. --rollout-backend hf
replaces `RolloutEngine` by megarl/hf_rollout.py's `HfRolloutEngine` (transformers, no vLLM),
which keeps this module's contract: `Sample`, `request_seeds`, `EngineMemory`'s verbs. Nothing
here imports vLLM at module level, so that path can import this module without it.

Every rank of one engine's tensor-parallel group must call `generate` with the
same prompts and seeds (vLLM runs SPMD over them). Samples carry what training
needs: prompt and response token ids, the sampled tokens' logprobs, the text and
whether the response hit the length limit.

Logprobs are vLLM's `processed_logprobs`: after temperature (and top-k/top-p)
processing, i.e. of the distribution actually sampled. The trainer divides its
logits by the same temperature, so with top_p=1 and top_k=-1 both sides compute
the same quantity and their difference after a weight sync is numerical noise.

Memory (colocated): on GPU, `offload()` puts vLLM to sleep (level 1: the KV cache is freed and
the weights go to host memory) while the trainer works; `onload(tags)` wakes what is asleep
of `tags`. The weight sync wakes only the weights (`load_weights` does); the KV cache wakes
when the rollout's turn starts (`Run.rollout_turn`), after the trainer has offloaded,
so an --offload-* configuration never holds the trainer and the KV cache at once. The engine
keeps which parts sleep (`asleep`) on every host; on CPU vLLM has no sleep mode, so only the
vLLM calls are skipped. --rollout-sleep-level 2 discards the weights while the engine sleeps and the
next full weight sync rebuilds it (`RolloutEngine._sleep`, `_discard_derived_state`).
"""

from __future__ import annotations

import functools
import logging
import os
import re

import torch

from megarl import accelerator, host_memory, startup_gc, vllm_cpu
from megarl.samples import Sample, request_seeds, stable_seed  # noqa: F401  (the rollout's records and seeds)

log = logging.getLogger("megarl.rollout")


# vLLM's two sleep pools (vllm.v1.executor.abstract.SLEEP_TAGS), named here so that the CPU build,
# which has no sleep mode, keeps the same bookkeeping.
SLEEP_TAGS = ("weights", "kv_cache")


class VllmEngine:
    """One in-rank vLLM engine of a vLLM role (rollout, or standalone teacher ranks)."""

    def __init__(self, args, engines, rank: int, model: str, seed: int, max_model_len: int, engine_kwargs: dict):
        """Engine `engines.engine_index(rank)` of the role whose ranks are `engines`
        (placement.EngineGroup), on launch rank `rank`, serving `model`."""
        from vllm import LLM

        if not accelerator.ON_CUDA and check_cpu_engine(model, args.params_dtype):
            vllm_cpu.install()  # what vLLM's CPU build lacks for Qwen3.5, DeepSeek-V3, Nemotron-H (vllm_cpu.py)

        # vLLM's external launcher reads the torch world from the environment:
        # in separate placement that is this role's world, not the launch's.
        os.environ.update(RANK=str(engines.role_rank(rank)), WORLD_SIZE=str(len(engines.ranks)))
        # A run that ended hard (SIGKILL, os._exit) leaves vLLM's CPU shared-memory
        # segments behind under fixed names, and the next engine then fails with
        # "create shm in SHMManager failed. errno: 17". Clear them while no engine
        # of this launch exists yet: every rank first, then all wait.
        release_shared_memory()
        torch.distributed.barrier()
        self.args = args
        self.tp = engines.tp
        self.engine_index = engines.engine_index(rank)
        self.num_engines = engines.num_engines
        self.is_leader = engines.is_engine_leader(rank)  # contributes this engine's outputs
        kwargs = dict(model=model, tokenizer=args.tokenizer, distributed_executor_backend="external_launcher",
                      tensor_parallel_size=self.tp, dtype=args.params_dtype, seed=seed + self.engine_index,
                      max_model_len=max_model_len, logprobs_mode="processed_logprobs")
        kwargs.update(engine_kwargs)
        if is_multimodal(model):  # its language model alone: vLLM then builds no vision tower
            kwargs.setdefault("limit_mm_per_prompt", {"image": 0, "video": 0})
        overrides = {**router_overrides(model), **window_overrides(model)}
        if overrides:
            kwargs["hf_overrides"] = {**overrides, **kwargs.get("hf_overrides", {})}
        from megarl.vllm_logging import quiet_expected_reload_warnings
        quiet_expected_reload_warnings()
        startup_gc.freeze_what_lives_for_the_run()  # vLLM's full collections while it loads then skip it
        with host_memory.small_pages():  # its KV cache touched whole at once: megarl/host_memory.py
            self.llm = LLM(**kwargs)
        # Model Runner V2 (vLLM's default on CUDA) seeds a request without a seed from numpy's global
        # state (vllm/v1/worker/gpu/sample/states.py, SamplingStates.add_request), which the reseed in
        # `generate` does not touch: there every request carries its seed (`request_seeds`). V1 (the CPU
        # build, and CUDA where V2 is unsupported, e.g. pipeline parallelism under the external launcher)
        # draws unseeded requests from torch's generator, which `generate` reseeds; seeded requests would
        # fail on CPU (V1 rewinds a seeded request's generator after a chunked prefill, "CPU Generator
        # does not use offset") and cost one generator call per request per step on CUDA.
        self.seeds_per_request = bool(self.llm.llm_engine.vllm_config.use_v2_model_runner)
        self.tool_wait_seconds = 0.0  # idle, waiting on tools only, since the generate phase last reported it
        self.last_episode_log: list = []
        self.lora_request = None  # the LoRA adapter every request runs with (--lora-sync adapter), once synced
        self.routes = None  # routing_replay.EngineRoutes where the samples carry routes (--routing-replay)

    def generate(self, prompts: list[list[int]], prompt_indices: list[int], step: int,
                 greedy: bool = False, n: int | None = None, temperature: float | None = None,
                 seed_key: tuple = (), on_prompt_done=None, min_tokens: int | list[int] = 0,
                 rows: list[dict] | None = None,
                 episodes=None) -> list[Sample]:
        """n samples per prompt (default --num-generations; 1 when greedy) at `temperature`
        (default --temperature; 0 is greedy), each at least `min_tokens` long (or a list: one per prompt,
        --min-new-tokens-tail; vLLM's min_tokens;
        the caller passes --min-new-tokens for training samples only, so an evaluation measures
        where the policy itself stops). `on_prompt_done(i, samples)` is called with prompt i's
        samples as soon as its request finishes (the rewards overlap the rest: megarl/rewards/scoring.py);
        the engine runs the same steps either way, so the samples do not depend on it.

        Randomness: a call's samples depend only on its inputs and the weights, not on what
        the engine sampled before, and are the same on every TP rank of an engine: a resumed
        run samples exactly what the uninterrupted run did. On Model Runner V2 (CUDA's
        default) each request carries its seed (`request_seeds`: from --seed, step, seed_key
        and the prompt's index); on V1 (CPU) requests carry none and the process RNG, which
        V1's sampler draws from, is reseeded before each call from (--seed, engine index,
        step, seed_key) (why not seeds on V1: `seeds_per_request` in __init__).

        `episodes` (multiturn.EpisodeSettings, with --tools): each sample is a multi-turn episode with
        tool calls, `rows[i]` prompt i's dataset row (the tools it may call, what a tool reads); the
        engine's request log of the call is kept as `last_episode_log`, the seconds it stood idle
        waiting on tools added to `tool_wait_seconds` (megarl/multiturn.py; the generate phase reports
        and resets it).
        """
        from vllm.inputs import TokensPrompt

        if getattr(self, "weights_discarded", False):
            raise RuntimeError("rollout engine: generate after a level-2 sleep and before a weight sync (its "
                               "weights were discarded; Run.rollout_turn re-sends them)")
        args = self.args
        temperature = 0.0 if greedy else (args.temperature if temperature is None else temperature)
        n = 1 if temperature == 0.0 else (args.num_generations if n is None else n)
        # vLLM's own text only where it needs it: a --stop string is matched on it, a tool call is parsed
        # from each turn's. Otherwise the engine returns ids only and the text is decoded here
        # (`response_text`): vLLM would otherwise also decode every sampled token's logprob entry, one
        # token at a time in Python (convert_ids_list_to_tokens): 4-5% of bare engines' generation on the bench
        # job, 1-5% of megarl's generate phase (docs/benchmarks.md).
        detokenize = bool(args.stop) or episodes is not None
        per_prompt = list(min_tokens) if isinstance(min_tokens, (list, tuple)) else None  # --min-new-tokens-tail
        params = sampling_params(args, prompt_indices, step, seed_key, n, temperature,
                                 0 if per_prompt is not None else min_tokens, self.seeds_per_request, detokenize)
        if per_prompt is not None:
            for request, forced in zip(params, per_prompt, strict=True):
                request.min_tokens = forced
        # (an engine started without a tokenizer, skip_tokenizer_init, as bench/weight_sync.py's: no text at all)
        text_of = None if detokenize or self.llm.llm_engine.model_config.skip_tokenizer_init else \
            functools.partial(response_text, self.llm.get_tokenizer())
        constraints = [(request.min_tokens, self.held_back_ids(request)) if request.min_tokens else (0, ())
                       for request in params]
        torch.manual_seed(stable_seed(args.seed, self.engine_index, step, *seed_key))
        if episodes is not None:
            from megarl.multiturn import run_episodes

            # One request per episode and turn: a prompt's samples each get the seed vLLM would give them.
            seeds = [[None if p.seed is None else p.seed + j for j in range(n)] for p in params]
            samples, self.last_episode_log, waited = run_episodes(
                self, prompts, prompt_indices, rows or [{} for _ in prompts], params, n, episodes, min_tokens,
                on_prompt_done, seeds)
            self.tool_wait_seconds += waited
            return samples
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        if self.routes is not None:
            self.routes.start()
        if on_prompt_done is None:
            outputs = self.llm.generate(requests, params, lora_request=self.lora_request, use_tqdm=False)
            return [s for index, prompt, output, constraint in zip(prompt_indices, prompts, outputs, constraints)
                    for s in _samples_of(index, prompt, output, *constraint, routes=self.routes, text_of=text_of)]
        # LLM.generate is enqueue + this loop (vLLM's _run_engine), with each finished request handed on.
        # Outputs carry LLM's own request numbers, consecutive from its counter (_run_engine sorts by them).
        first = self.llm.request_counter.counter
        self.llm.enqueue(requests, params, lora_request=self.lora_request, use_tqdm=False)
        per_prompt = [None] * len(prompts)
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    i = int(output.request_id) - first
                    if not 0 <= i < len(prompts) or per_prompt[i] is not None:
                        raise RuntimeError(f"vLLM returned request {output.request_id!r}, not one of the "
                                           f"{len(prompts)} just enqueued from {first}: its request numbering changed")
                    per_prompt[i] = _samples_of(prompt_indices[i], prompts[i], output, *constraints[i],
                                                routes=self.routes, text_of=text_of)
                    on_prompt_done(i, per_prompt[i])
        return [s for samples in per_prompt for s in samples]

    def held_back_ids(self, params) -> tuple[int, ...]:
        """The token ids vLLM's min_tokens holds back (logit -inf) before a request's min_tokens-th token:
        the request's all_stop_token_ids once the engine has added the tokenizer's EOS and the
        generation config's (what InputProcessor.process_inputs does to each request's own copy of
        `params`, through vLLM's own method; the MinTokensLogitsProcessor masks exactly these). A
        --stop string masks nothing: it only stops the text after the min_tokens-th token."""
        processor = self.llm.llm_engine.input_processor
        resolved = params.clone()
        resolved.update_from_generation_config(processor.generation_config_fields,
                                               processor.renderer.get_eos_token_id())
        return tuple(sorted(resolved.all_stop_token_ids))


def sampling_params(args, prompt_indices: list[int], step: int, seed_key: tuple, n: int, temperature: float,
                    min_tokens: int, seeded: bool, detokenize: bool = True) -> list:
    """vLLM's SamplingParams of each prompt of a `VllmEngine.generate` call; `seeded`: each carries its
    `request_seeds` seed (Model Runner V2), else none (V1: the process RNG); `detokenize`: vLLM makes the
    completions' text (else ids only, and `response_text` decodes them)."""
    from vllm import SamplingParams

    seeds = request_seeds(args.seed, step, seed_key, prompt_indices) if seeded else [None] * len(prompt_indices)
    # --repetition-penalty: the logits are penalised before sampling, and the engine's logprobs
    # (logprobs_mode processed_logprobs) are the penalised ones, what --tis-level corrects with.
    # vLLM matches --stop on its own text: without it, the caller matches them (streaming.py).
    return [SamplingParams(n=n, temperature=temperature, top_p=args.top_p, top_k=args.top_k,
                           repetition_penalty=getattr(args, "repetition_penalty", 1.0),
                           max_tokens=args.max_new_tokens, min_tokens=min_tokens,
                           stop=(args.stop or None) if detokenize else None,
                           logprobs=0, seed=seed, detokenize=detokenize)
            for seed in seeds]


def response_text(tokenizer, token_ids: list[int], ended_by_stop_token: bool) -> str:
    """A response's text, the one convention of every rollout backend (and of TRL's and verl's rewards):
    the tokenizer's decode of its ids with special tokens skipped, the stop token (EOS or a stop token
    id) that ended it left out, as vLLM leaves it out of its own text. vLLM's incremental text is the same
    for valid UTF-8; a byte-level model that emits an incomplete byte sequence gets the tokenizer's
    replacement character here where vLLM's text may differ."""
    return tokenizer.decode(token_ids[:-1] if ended_by_stop_token else token_ids, skip_special_tokens=True)


def _samples_of(index: int, prompt: list[int], output, min_tokens: int = 0,
                held_back_ids: tuple[int, ...] = (), routes=None, text_of=None) -> list[Sample]:
    """A finished vLLM request's completions as Samples (with the sampled tokens' logprobs, the
    min_tokens constraint they were sampled under and, with `routes` (routing_replay.EngineRoutes), the
    experts each token was routed to). `text_of(token_ids, ended_by_stop_token)` makes the text where the
    request did not ask vLLM for it (`response_text`)."""
    samples = []
    for completion in output.outputs:
        token_ids = list(completion.token_ids)
        logprobs = [step_logprobs[token].logprob for token, step_logprobs in zip(token_ids, completion.logprobs)]
        # Without --stop strings a "stop" finish is always a stop token: EOS or the generation config's.
        text = completion.text if text_of is None else text_of(token_ids, completion.finish_reason == "stop")
        samples.append(Sample(index, list(prompt), token_ids, text, logprobs,
                              truncated=completion.finish_reason == "length", min_tokens=min_tokens,
                              held_back_ids=held_back_ids,
                              routes=None if routes is None else routes.of(prompt, token_ids, completion)))
    return samples


class EngineMemory:
    """The offload/onload verbs of a rollout engine (either backend): which of SLEEP_TAGS sleep (`asleep`),
    kept the same on every host; the subclass's `_sleep()` / `_wake(tags)` move the memory (vLLM's sleep
    mode; the HF backend's weights, megarl/hf_rollout.py)."""

    asleep: set[str]

    def offload(self) -> None:
        """Give the device back to the colocated trainer. vLLM sleeps only a fully awake engine
        (Executor.sleep), so a partly awake one is woken first."""
        if self.asleep == set(SLEEP_TAGS):
            return
        self.onload()
        self.asleep = set(SLEEP_TAGS)
        self._sleep()

    def onload(self, tags: list[str] | None = None) -> None:
        """Take the device back: all that sleeps, or only `tags` (a weight sync wakes `weights`; the
        rollout's turn the rest, after the trainer offloaded: Run.rollout_turn). Parts already
        awake are not woken again (vLLM refuses a tag that is not asleep)."""
        waking = [tag for tag in (tags or SLEEP_TAGS) if tag in self.asleep]
        if not waking:
            return
        self.asleep -= set(waking)
        self._wake(waking)

    def _sleep(self) -> None:
        raise NotImplementedError

    def _wake(self, tags: list[str]) -> None:
        raise NotImplementedError


class RolloutEngine(EngineMemory, VllmEngine):
    """The rollout role: generates the student's samples and takes the trainer's weights."""

    adapter = None  # --lora-sync adapter: the adapters' LoraConfig (the engine takes adapters, not weights)

    def __init__(self, args, engines, rank: int, colocated: bool):
        """`colocated`: the engine shares its devices with the trainer and sleeps while it trains; an
        engine of the separate placement never sleeps, so it is built without vLLM's sleep mode (whose
        allocator it would otherwise pay for)."""
        super().__init__(args, engines, rank, args.rollout_model, args.seed,
                         args.max_prompt_length + args.max_new_tokens, rollout_engine_kwargs(args, colocated))
        self.asleep: set[str] = set()  # the SLEEP_TAGS now asleep: vLLM's sleep_mode wakes one part at a time
        self.weights_discarded = False  # slept at level 2 and no full load since: the weights are gone
        if args.lora_rank and args.lora_sync == "adapter":
            from megarl.models.families import load_hf_config
            from megarl.models.lora import lora_config

            self.adapter = lora_config(args, load_hf_config(args.model))
        if args.routing_replay == "on":
            from megarl.models.families import load_hf_config
            from megarl.routing_replay import EngineRoutes

            self.routes = EngineRoutes(self.llm, load_hf_config(args.rollout_model))

    def load_weights(self, weights) -> None:
        """Stream (hf_name, tensor) pairs into the engine (any TP: vLLM shards them itself).

        The engine runs in this process, so `weights` may be a generator: tensors
        are consumed one at a time and never held all at once, and each is copied
        before the next is drawn (callers may reuse their buffers). Unquantized
        models load in place (`_load_in_place`); others go through vLLM's
        `reload_weights`. Asleep, the engine first wakes its weights (they must be
        resident to be written), not its KV cache.
        """
        self.onload(tags=["weights"])
        if self.adapter is not None:
            self._load_adapter(weights)
        else:
            self.llm.collective_rpc(_load_in_place, kwargs=dict(weights=weights))
        self.weights_discarded = False  # every parameter written, and what derives from them rebuilt
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

    def _load_adapter(self, weights) -> None:
        """--lora-sync adapter: `weights` are the policy's adapters (Actor.hf_weights: PEFT's names, whole),
        and the engine serves them on its unchanged base with vLLM's LoRA (the punica kernels; on CPU their
        torch ops). vLLM loads an adapter from a PEFT directory: it is written to a temporary one, loaded
        under one adapter id in place of the previous version (`load_inplace`), and removed: vLLM keeps the
        one adapter in memory (max_loras = max_cpu_loras = 1, never evicted) and does not read it again."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        from megarl.models.lora import write_peft_adapter

        directory = tempfile.mkdtemp(prefix="megarl-lora-")
        try:
            write_peft_adapter({name: tensor.detach().to("cpu", copy=True) for name, tensor in weights},
                               self.adapter, directory, self.args.model)
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, directory, load_inplace=True))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        # The requests' own copy does not reload: vLLM loads a request's adapter in place on every engine step
        # when it says load_inplace (lora/worker_manager.py, add_adapter).
        self.lora_request = LoRARequest("policy", 1, directory)

    # The verbs every role uses for its device memory: EngineMemory's bookkeeping, vLLM's sleep and wake-up
    # underneath (skipped on CPU, where vLLM has no sleep mode).
    def _sleep(self) -> None:
        """vLLM sleep at --rollout-sleep-level (EngineMemory.offload hands over a fully awake engine).

        Level 2 discards the weights: what the weight sync does not rewrite is kept first
        (`_discard_derived_state`), and until the next full load (`load_weights`, every parameter, then
        every layer's post-load processing: `_load_in_place`) the engine has no weights
        (`weights_discarded`; `Run.rollout_turn` re-sends them before a turn that finds them so)."""
        level = self.args.rollout_sleep_level
        if level == 2:
            self.llm.collective_rpc(_discard_derived_state)
            self.weights_discarded = True
        if not accelerator.ON_CUDA:
            log.debug("vLLM sleep is not supported on CPU: no-op")
            return
        self.llm.sleep(level=level)

    def _wake(self, tags: list[str]) -> None:
        if not accelerator.ON_CUDA:
            log.debug("vLLM wake_up is not supported on CPU: no-op")
            return
        self.llm.wake_up(tags=tags)


def rollout_engine_kwargs(args, colocated: bool) -> dict:
    """The rollout engine's memory settings (vLLM's sleep mode only when `colocated`), then
    --rollout-engine-kwargs over them, then what --routing-replay needs of the engine (routing_replay.engine_kwargs:
    without it the samples' routes would be incomplete)."""
    from megarl.models.lora import vllm_lora_kwargs

    lora = vllm_lora_kwargs(args.lora_rank) if args.lora_rank and args.lora_sync == "adapter" else {}
    replay = {}
    if args.routing_replay == "on":
        from megarl.routing_replay import engine_kwargs

        replay = engine_kwargs()
    return {**accelerator.vllm_engine_kwargs(args.rollout_kv_cache_gb, args.rollout_gpu_memory_utilization,
                                             sleep_mode=colocated),
            **lora, **args.rollout_engine_kwargs, **replay}


def is_multimodal(model: str) -> bool:
    """Whether the checkpoint is a multimodal one whose language model megarl serves (Qwen3.5's
    ...ForConditionalGeneration)."""
    from megarl.models.families import hf_name_prefix, load_hf_config

    return hf_name_prefix(load_hf_config(model)) == "model.language_model."


def router_overrides(model: str) -> dict:
    """The config fields vLLM needs to route a DeepSeek-V3 model as transformers and Megatron do, where its
    config.json lacks them: vLLM's deepseek_v2 model builds the expert bias (e_score_correction_bias) only when
    `topk_method` is "noaux_tc" and scores by `scoring_func` with "softmax" as its default, while transformers'
    DeepseekV3 always scores by sigmoid plus the bias (and writes neither field: its tiny models lack them; the
    released configs carry both, and any other value is refused at start, megatron_gpt.SIGMOID_ROUTER)."""
    from megarl.models.families import family_of, load_hf_config
    from megarl.models.megatron_gpt import SIGMOID_ROUTER

    config = load_hf_config(model)
    if not family_of(config).sigmoid_router or family_of(config).block_types:  # (vLLM's nemotron_h reads neither)
        return {}
    return {field: allowed[0] for field, allowed in SIGMOID_ROUTER.items() if getattr(config, field, None) is None}


def window_overrides(model: str) -> dict:
    """The config fields vLLM needs to window a Qwen2/3 or Qwen-MoE model's layers as transformers and Megatron do
    (gpt-oss: none, its layer_types checked against vLLM's fixed pattern)
    (megatron_gpt.sliding_window_pattern). vLLM 0.32's models of these families give every layer the config's
    sliding_window (model_executor/layers/attention/attention.py: cache_config.sliding_window, no per-layer
    window; its qwen2.py asserts layer_types are all one kind). So: every layer windowed, nothing to change; none
    windowed while sliding_window is set (use_sliding_window with max_window_layers >= num_hidden_layers; Qwen2-MoE
    whose rule leaves no layer windowed), sliding_window None, else vLLM would window every layer; some windowed,
    refused in one line (vLLM would window all or fail)."""
    from megarl.models.families import family_of, load_hf_config
    from megarl.models.megatron_gpt import sliding_window_pattern

    config = load_hf_config(model)
    family = family_of(config)
    if not family.sliding_window_layers:
        return {}
    pattern = sliding_window_pattern(config, family)
    if family.gpt_oss:  # vLLM's gpt_oss model windows the even layers, whatever layer_types says
        even = [layer % 2 == 0 for layer in range(len(pattern))]
        if getattr(config, "sliding_window", None) and pattern != even:
            raise ValueError(f"{model}: layer_types windows layers {[i for i, w in enumerate(pattern) if w]}; vLLM "
                             f"0.32's gpt_oss model windows the even layers (sliding first, then full, in turn), "
                             f"as the released models do (--rollout-backend hf serves it)")
        return {}
    if all(pattern):
        return {}
    if not any(pattern):
        return {"sliding_window": None} if getattr(config, "sliding_window", None) else {}
    windowed = [layer for layer, is_windowed in enumerate(pattern) if is_windowed]
    raise ValueError(f"{model}: sliding-window attention in layers {windowed} of {len(pattern)} only: vLLM 0.32's "
                     f"{family.name} model windows every layer or none; a vLLM engine cannot serve it as transformers "
                     f"computes it (--rollout-backend hf serves it)")


def check_cpu_engine(model: str, params_dtype: str) -> bool:
    """Whether a CPU engine of `model` needs megarl/vllm_cpu.py (a Gated DeltaNet model: Qwen3.5; a multi-latent
    attention model: DeepSeek-V3; non-gated experts: Nemotron-H); the other models' engines start as before, vLLM
    untouched. Refuses, in one
    line, a bf16 CPU engine of a Gated DeltaNet model:
    vLLM's bf16 CPU kernels pack each conv1d weight in place after loading (a [channels, width] copy the kernel
    reads), which the weight sync's reload does not redo, so every sync after the first would leave the engine
    computing with stale weights. fp32 (megarl's CPU runs) takes megarl's own core on unpacked weights; GPUs are
    unaffected."""
    from megarl.models.families import family_of, load_hf_config

    family = family_of(load_hf_config(model))
    if family.multi_latent_attention or family.block_types:
        return True
    if not family.hybrid_linear_attention:
        return False
    if params_dtype != "float32":
        raise ValueError(f"{model}: a {params_dtype} vLLM engine of a Gated DeltaNet model (Qwen3.5) on CPU ranks "
                         f"would serve stale weights after the second weight sync; use --params-dtype float32 on CPU")
    return True


def kv_cache_bytes_per_token(worker) -> dict:
    """This engine worker's KV cache per token, from vLLM's own cache specs (what it allocates its blocks by):
    {"bytes": summed over its attention layers, "per_layer": each layer's (the first's), "head_size": the width a
    layer caches per token and KV head, "kv_heads": those heads, "spec": vLLM's spec class}. A multi-latent
    attention model (DeepSeek-V3) caches one latent per token and layer, kv_lora_rank + qk_rope_head_dim wide
    (vLLM's MLAAttentionSpec: one KV head), not keys and values of every head. A hybrid model's other layers
    (Qwen3.5's Gated DeltaNet: a fixed state per sequence, not per token) are left out."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    specs = {name: spec for name, spec in worker.model_runner.get_kv_cache_spec().items()
             if isinstance(spec, AttentionSpec)}
    first = next(iter(specs.values()))
    per_token = [spec.page_size_bytes / spec.block_size for spec in specs.values()]
    return {"bytes": sum(per_token), "per_layer": per_token[0], "layers": len(specs),
            "head_size": getattr(first, "head_size", None), "kv_heads": getattr(first, "num_kv_heads", None),
            "dtype_bytes": first.dtype.itemsize, "spec": type(first).__name__}


def _load_in_place(worker, weights) -> None:
    """The model's own weight loaders, straight into the engine's parameters.

    vLLM's `reload_weights` restores every layer onto the meta device, buffers
    the incoming tensors, allocates fresh parameters for each layer, loads, runs
    the post-load processing and copies the result back into the old storage:
    an allocation and two copies per tensor, every sync. Without quantization
    the only post-load step that matters is the CPU GEMM dispatch, which packs
    each linear weight into a oneDNN handle and drops the parameter. So here
    the parameters stay: a dropped linear weight is materialized once from
    vLLM's recorded metadata and kept (`_kept_weights`), each sync copies into
    it through the model's `load_weights` (the same loaders as the first load:
    fused qkv / gate_up, TP shards, tied embeddings, routed experts into the fused
    w13 / w2 by vLLM's expert_params_mapping) and then reruns the layer's
    post-load processing (a repack on CPU, a no-op on GPU for these methods). The
    routed experts likewise: on CPU their kernel pads and packs w13 / w2 into a
    layout of its own, so the sync loads into kept copies in the checkpoint's
    layout and packs again; on GPU they load in place and vLLM's processing of a
    weight update reruns (what vLLM's RL updates do).
    Anything else (quantization, LoRA) takes `reload_weights`.
    """
    model = worker.model_runner.model
    layers = _in_place_layers(worker)
    if layers is None:  # it may hold a tensor until the end of the stream: copies, not the callers' buffers
        worker.model_runner.reload_weights(weights_iterator=((name, tensor.clone()) for name, tensor in weights),
                                           is_checkpoint_format=True)
        _refresh_tied_output_layer(worker)
        return
    by_block = {}
    for layer, kept, block in layers:
        _bind_kept(layer, kept)
        by_block.setdefault(block, []).append((layer, kept))
    pending = set(by_block)

    latent = _latent_attention_layers(worker)

    def process(block):
        for layer, kept in by_block.get(block, ()):
            process_after_load(layer, kept)
        for attention in latent.get(block, ()):  # after its kv_b_proj's own processing, as vLLM's loader orders it
            attention.process_weights_after_loading(worker.model_runner.vllm_config.model_config.dtype)
        pending.discard(block)

    def stream():
        """Process a decoder block's layers once the stream has moved past it: the loaders
        pull the next tensor only after copying the last one, and the repack of one block
        then overlaps the transfer of the next (broadcast sync)."""
        current = None
        for name, tensor in weights:
            block = _block_of(name)
            if block != current:
                if current is not None:
                    process(current)
                # A block seen again is loaded and processed again: into and from its kept copies, not what
                # the last processing left bound (an emptied linear weight; the CPU experts' packed w13 / w2,
                # packed twice, were garbage: a DeepSeek-V3 stream whose expert biases came after every parameter).
                for layer, kept in by_block.get(block, ()):
                    _bind_kept(layer, kept)
                pending.add(block)
                current = block
            yield name, tensor

    with torch.no_grad():
        loaded = model.load_weights(stream())
    expected = worker._megarl_param_names
    if loaded is not None and set(loaded) != expected:
        raise RuntimeError(f"weight sync: the stream left vLLM parameters unloaded: "
                           f"{sorted(expected - set(loaded))[:8]}, or loaded unknown ones: "
                           f"{sorted(set(loaded) - expected)[:8]}")
    for block in list(pending):
        process(block)


def _discard_derived_state(worker) -> None:
    """--rollout-sleep-level 2, before vLLM's sleep: let go of what the next weight sync rebuilds.

    vLLM's level 2 (GPU) discards its "weights" pool: every allocation made while the model loaded (the
    parameters, what post-load processing derived from them, Model Runner V2's state: v1/worker/gpu/
    model_runner.py, load_model), and at wake restores only the model's buffers (gpu_worker.py, wake_up).
    The weight sync rewrites every parameter and reruns every layer's post-load processing
    (`_load_in_place`), which is the whole rebuild; all else must survive. So on GPU each allocation of
    that pool that holds anything besides parameters (`_keep_allocations_beyond_parameters`) is moved to
    a pool vLLM offloads at level 2 (host memory, as level 1 offloads the weights), and only allocations
    of parameters alone are discarded. On CPU vLLM's sleep is a no-op (cpu_worker.py), so megarl drops the
    derived state itself: each layer's packed GEMM handle (`cpu_linear`, vLLM's CPU dispatch; its own copy
    of the weight) and the experts' packed w13 / w2 (the kept copies in the checkpoint's layout are what the
    sync loads into). A model that takes vLLM's `reload_weights` (quantized, LoRA) rebuilds every layer from
    the stream at each sync: nothing to do on CPU; on GPU its pool is kept the same way."""
    layers = _in_place_layers(worker)
    if accelerator.ON_CUDA:
        _keep_allocations_beyond_parameters(worker, layers or [])
        return
    for layer, kept, _ in layers or ():
        layer.__dict__.pop("cpu_linear", None)
        if kept and _is_fused_moe(layer):
            for name in kept:
                weight = getattr(layer, name)
                setattr(layer, name, torch.nn.Parameter(weight.new_empty(0), requires_grad=False))


def _keep_allocations_beyond_parameters(worker, layers) -> None:
    """GPU, level 2: re-tag each allocation of vLLM's "weights" pool (CuMemAllocator, one per segment of
    torch's allocator) that holds a live block besides the parameters' and kept weights' storage (which the
    sync rewrites whole) as "runtime", a pool vLLM offloads to host and restores at every level (sleep_mode_backend.py,
    CuMemBackend.suspend). An allocation torch's snapshot does not describe is kept too: only what is
    known to be parameters alone is discarded."""
    from vllm.device_allocator.cumem import CuMemAllocator

    storages = [param for _, param in worker.model_runner.model.named_parameters()]
    storages += [weight for _, kept, _ in layers for weight in (kept or {}).values()]
    rewritten = {t.untyped_storage().data_ptr() for t in storages}  # a storage starts its allocator block
    allocations = CuMemAllocator.get_instance().pointer_to_data
    kept_bytes = freed_bytes = 0
    segments = {segment["address"]: segment for segment in torch.cuda.memory_snapshot()}
    for address, data in allocations.items():
        if data.tag != "weights" or data.is_asleep:
            continue
        segment = segments.get(address)
        live = None if segment is None else [block["address"] for block in segment["blocks"]
                                             if block["state"] == "active_allocated"]
        if live is not None and set(live) <= rewritten:
            freed_bytes += data.handle[1]
            continue
        data.tag = "runtime"
        kept_bytes += data.handle[1]
    log.info("level-2 sleep: %.2f GiB of the weights pool to discard, %.2f GiB kept (not parameters alone)",
             freed_bytes / 2**30, kept_bytes / 2**30)


def _bind_kept(layer, kept: dict | None) -> None:
    """Bind a layer's kept weights (`_kept_weights`) as its parameters: what the loaders write and the
    post-load processing reads."""
    for name, weight in (kept or {}).items():
        setattr(layer, name, weight)


def process_after_load(layer, kept: dict | None) -> None:
    """A layer's post-load processing once a sync has loaded its (kept) weights: a repack on CPU."""
    if kept and _is_fused_moe(layer):
        # The experts' CPU kernel packed w13/w2 into its own layout at the first load, and vLLM's
        # processing of a weight update skips that packing (unquantized_fused_moe_method.py,
        # _setup_kernel: `is_weight_update` runs only the shuffle): pack the loaded copies again.
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    else:
        layer.quant_method.process_weights_after_loading(layer)


_BLOCK = re.compile(r"(.*?\.layers\.\d+)\.")


def _block_of(name: str) -> str | None:
    """'model.layers.3' for 'model.layers.3.mlp.down_proj.weight' (the same in HF and vLLM names); None outside blocks."""
    match = _BLOCK.match(name)
    return match.group(1) if match else None


def _in_place_layers(worker):
    """[(layer, kept weight or None, block)] for every layer whose weights `_load_in_place` reprocesses;
    None when the model must take `reload_weights`. Built on the first call and cached on the worker."""
    if hasattr(worker, "_megarl_in_place"):
        return worker._megarl_in_place
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    model = worker.model_runner.model
    config = worker.model_runner.vllm_config
    layers = None
    if config.model_config.quantization is None and config.lora_config is None:
        layers = []
        head = getattr(model, "lm_head", None)
        for module_name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if method is not None and _is_fused_moe(layer):  # routed experts: w13_weight, w2_weight
                layers.append((layer, _kept_weights(layer, ("w13_weight", "w2_weight"), _packs_experts(layer)),
                               _block_of(module_name + ".")))
                continue
            if method is None or not isinstance(getattr(layer, "weight", None), torch.Tensor):
                continue
            if type(layer) is VocabParallelEmbedding and isinstance(head, ParallelLMHead) and head is not layer:
                # An input embedding is only looked up (F.embedding on the live weight): its post-load
                # processing packs a CPU GEMM handle that the model's separate head makes unused.
                continue
            if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
                layers = None  # some other post-load processing: leave it to vLLM
                break
            layers.append((layer, _kept_weights(layer, ("weight",)), _block_of(module_name + ".")))
    worker._megarl_in_place = layers
    # Every parameter a sync must load: not the ones multi-latent attention derives from kv_b_proj after
    # loading (`_latent_attention_layers`), which no checkpoint has.
    derived = {f"{name}.{param}" for name, attention in _named_latent_attention(model)
               for param, _ in attention.named_parameters(recurse=False)}
    worker._megarl_param_names = {name for name, _ in model.named_parameters()} - derived
    return layers


def _named_latent_attention(model):
    from vllm.model_executor.layers.attention import MLAAttention

    return [(name, module) for name, module in model.named_modules() if isinstance(module, MLAAttention)]


def _latent_attention_layers(worker) -> dict:
    """{block: [its MLAAttention modules]} (DeepSeek-V3 in vLLM): after loading, each splits kv_b_proj's weight
    into the absorbed decode's own parameters (mla_attention.py, process_weights_after_loading: W_UK_T, W_UV;
    on AMX CPUs packed copies), which vLLM's loader derives once. A sync that loads kv_b_proj must derive them
    again, or the engine's decode would keep the previous weights' (its prefill reads kv_b_proj itself)."""
    if not hasattr(worker, "_megarl_latent_attention"):
        by_block = {}
        for name, module in _named_latent_attention(worker.model_runner.model):
            by_block.setdefault(_block_of(name + "."), []).append(module)
        worker._megarl_latent_attention = by_block
    return worker._megarl_latent_attention


def _is_fused_moe(layer) -> bool:
    """Whether `layer` holds routed experts with vLLM's unquantized fused-MoE method."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return type(getattr(layer, "quant_method", None)) is UnquantizedFusedMoEMethod


def _packs_experts(layer) -> bool:
    """Whether the layer's experts kernel packs w13 / w2 into a layout of its own after loading (vLLM's CPU
    kernels: experts/cpu_moe.py, CPUUnquantizedExperts.process_weights_after_loading, cpu_prepack_moe_weight;
    the packed tensor can keep the loaded shape, so the shape does not tell)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(layer.quant_method, "moe_kernel", None)
    return isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts)


def _kept_weights(layer, names: tuple[str, ...], repacked: bool = False) -> dict | None:
    """{name: a parameter in the checkpoint's layout} for each of the layer's weights that post-load
    processing dropped (CPU GEMM dispatch: an empty weight), reshaped, or (`repacked`) packed into a layout
    of its own (CPU fused MoE); None when every one is still as loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = get_layerwise_info(layer)
    kept = {}
    for name in names:
        meta = info.restore_metadata[0].get(name)
        weight = getattr(layer, name)
        if not repacked and weight.numel() > 0 and (meta is None or weight.shape == meta.shape):
            continue
        if meta is None or meta.numel() == 0:
            raise RuntimeError(f"weight sync: {type(layer).__name__} changed its {name} and vLLM recorded no shape")
        with info.restore_device:
            kept[name] = restore_layer_refs(materialize_meta_tensor(meta), layer)
    return kept or None


def _refresh_tied_output_layer(worker) -> None:
    """Re-derive the tied LM head's kernel weights after a reload.

    With tied embeddings the checkpoint has no lm_head tensor, so vLLM's reload
    never touches the head's layer; on CPU that layer keeps a prepacked GEMM copy
    of the *old* embedding (dispatch_cpu_unquantized_gemm), and logits go stale.
    Rerunning the head's post-load processing rebuilds that copy; elsewhere it is
    a no-op.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return
    head.quant_method.process_weights_after_loading(head)


def release_shared_memory() -> None:
    """Unlink vLLM's CPU tensor-parallel shared-memory segments (no-op on GPU).

    With the external launcher vLLM names them `-<group>-[<ranks>]-cpushm_<rank>`
    (its instance identifier is empty), the same in every run, and nothing
    unlinks them when a process exits hard.
    """
    if accelerator.ON_CUDA or not os.path.isdir("/dev/shm"):
        return
    for name in os.listdir("/dev/shm"):
        if name.startswith("-") and "-cpushm" in name:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:  # another rank got there first
                pass
