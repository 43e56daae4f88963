"""Rollout backend without vLLM (--rollout-backend hf): a transformers model on this rank's device.

`HfRolloutEngine` has the verbs and the sample contract of the vLLM `RolloutEngine`
(megarl/rollout.py), so the rest of megarl does not know which one runs:

  generate(prompts, prompt_indices, step, greedy=False, n=None, temperature=None,
           seed_key=(), on_prompt_done=None, min_tokens=0) -> [Sample]
  load_weights(stream of (hf_name, tensor))   the weight sync's verb (both strategies)
  offload() / onload(tags=None)               the colocated turn's verbs (rollout.EngineMemory)
  engine_index, num_engines, is_leader, tp    its place among the rollout ranks (TP 1 only)

What it matches, and how:
  * logprobs are vLLM's `processed_logprobs` (what megarl asks vLLM for): the log-softmax of the
    fp32 logits after min_tokens' held-back ids (-inf), then, when sampling, temperature and the
    top-k / top-p masks in vLLM's order and tie rules (`processed_logprobs`); greedy (temperature 0)
    takes the argmax and reports the log-softmax at T = 1 with the held-back ids masked, as vLLM.
  * stopping: the tokenizer's EOS and the generation config's eos ids end a response (kept as its
    last token, left out of the text); max_new_tokens ends it as truncated; a --stop string ends it
    where it completes after the min_tokens-th token, the text cut before it (vLLM's detokenizer).
    With min_tokens those ids are held back (`held_back_ids`) before response token min_tokens.
  * randomness: every sample has its own torch.Generator, seeded with its prompt's `request_seeds`
    seed + j for sample j (vLLM's fan-out of n), so a sample depends on (--seed, step, seed_key,
    prompt index, j) and the weights, not on the other prompts of the call, the engine's shard or
    what it sampled before. The draw is vLLM's exponential race (argmax of probs / Exp(1) noise),
    so a sample is an exact draw from the reported distribution. The tokens are not vLLM's: its CPU
    sampler hashes its own noise, and a seed means a different stream in each sampler.

Why its own decoding loop rather than `model.generate`: generate draws from one process-wide
RNG for the whole batch (a sample would depend on its batch neighbours) and returns logprobs of
its own processing. The loop here (issue 54: it gives the tokens and logprobs of the loop before it,
tests/hf_rollout_reference.py, bit for bit on the Zen 4 development host with torch's GEMMs, the tokens with
oneDNN's; bench/hf_rollout.py times both):
  * the rows go in micro-batches of at most --hf-rollout-batch-tokens cache tokens (rows x (longest
    prompt + max_new_tokens)), in row order; a prompt's samples may span two;
  * each prompt is prefilled once (left-padded, positions counted from its first real token) and its
    cache and logits copied to its samples' rows;
  * the cache is preallocated for the micro-batch (`_PrefixLayer`, transformers' StaticLayer handing
    attention the filled prefix: no concatenation per step), and on CPU attention shares the key/value
    heads inside torch's kernel (`_grouped_sdpa`) instead of repeating them into a copy per layer;
  * a step is one forward, the whole batch's logit processing and draw (each row's noise from its own
    generator, drawn for several steps at once: `_Noise`), and one transfer to the host: the tokens for
    the stop checks, with their logprobs; the rows that finish leave the batch and the cache.
  * on CPU, where this process's fp32 GEMMs go through oneDNN (--cpu-gemm: the choice the trainer made on a
    colocated rank, or --cpu-gemm onednn; a rollout-only rank under auto keeps torch's), the linear layers do
    too (cpu_gemm.linear_layers_through_onednn: each weight reordered once per call, so a weight sync is seen by
    the next call). Why: on an AMD CPU with AVX-512 MKL runs its AVX2 kernels, and the layers were two thirds of
    the loop's time; the bench job's generate phase ran 1.3-1.35x faster than with MKL's on the Zen 4 host
    (docs/benchmarks.md). The tokens were the old loop's in every bench round; the logprobs differ at fp32 rounding (another order of the sums, up to 3e-6 there). They
    are then computed with the trainer's GEMM library, but that brought them no measurably nearer the trainer's:
    the quickstart's rollout-trainer `mismatch` (tiny model, 6 steps) was 1.2-2.1e-7 either way (other kernels,
    attention and norms, differ between the two as well).

Weights: one full model per rank (no tensor parallelism), loaded in --params-dtype from
--rollout-model; a weight sync copies each (hf_name, tensor) into the parameter or persistent buffer of that name
in place, a per-expert tensor into its slice of transformers' fused experts (models/in_memory_layout.py; a tied
model's lm_head.weight is its embedding, which the stream sends: lm_head.weight is skipped, as vLLM's loader
does) and checks that every one was wholly written. A model transformers' SDPA does not serve (gpt-oss: attention
sinks) keeps transformers' own attention. Memory: colocated, the
weights go to host memory while the trainer works (`offload`, megarl.offload.Offloader: pinned
buffers on GPU, kept across steps; on CPU the same copies run, so the tests exercise it). There is
no KV cache between calls: each micro-batch preallocates one and it is handed back at the end of
`generate`, so the "kv_cache" tag is bookkeeping only.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import StaticLayer

from megarl import accelerator, cpu_gemm
from megarl.models.in_memory_layout import InMemoryLayout
from megarl.offload import Offloader
from megarl.rollout import EngineMemory, response_text
from megarl.samples import Sample, request_seeds


class HfRolloutEngine(EngineMemory):
    """The rollout role on the HF backend (see the module docstring): generates the student's samples
    and takes the trainer's weights."""

    tp = 1

    def __init__(self, args, engines, rank: int, colocated: bool = True):
        """Engine `engines.engine_index(rank)` of the rollout ranks `engines` (placement.EngineGroup, TP 1:
        arguments.py refuses more), on launch rank `rank`. `colocated` is the RolloutEngine's
        argument; the offload verbs are only called when colocated (Run.rollout_turn)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megarl.models.families import family_of, hf_name_prefix, load_hf_config

        self.args = args
        self.engine_index = engines.engine_index(rank)
        self.num_engines = engines.num_engines
        self.is_leader = engines.is_engine_leader(rank)
        self.device = accelerator.device()
        # a multimodal checkpoint (Qwen3.5's ...ForConditionalGeneration) as its language model: the text
        # config makes transformers build the family's ...ForCausalLM and read model.language_model.* into it
        config = load_hf_config(args.rollout_model)
        self._prefix = hf_name_prefix(config)
        self.model = AutoModelForCausalLM.from_pretrained(args.rollout_model, config=config,
                                                          dtype=getattr(torch, args.params_dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        if family_of(config).block_types:  # Nemotron-H: dt as the trainer's and vLLM's scans take it
            from megarl.models.mamba_mixer import without_dt_floor

            without_dt_floor(self.model)
        # see _grouped_sdpa; a model transformers' SDPA does not serve (gpt-oss: attention sinks) keeps its own
        if not accelerator.ON_CUDA and type(self.model)._supports_sdpa:
            _register_attention()
            self.model.set_attn_implementation(ATTENTION_NAME)
        for tensor in [*self.model.parameters(), *self.model.buffers()]:
            # Storage of its own for every tensor: loaded on the CPU, a checkpoint's tensors may share the
            # file's mapped storage, which cannot be resized, and offloading resizes storages to 0.
            if not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer, args.rollout_model)
        self.asleep: set[str] = set()
        model = self.model
        self._offloader = Offloader(lambda: (list(model.parameters()) + list(model.buffers()), []))
        self._tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
        self._layout = InMemoryLayout(model)  # a tied head's weight appears once, as the embedding's

    # ------------------------------------------------------------------------------- generation ----

    def held_back_ids(self) -> tuple[int, ...]:
        """The ids min_tokens holds back: every id that ends a response (vLLM's all_stop_token_ids)."""
        return tuple(sorted(self.stop_ids))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], prompt_indices: list[int], step: int,
                 greedy: bool = False, n: int | None = None, temperature: float | None = None,
                 seed_key: tuple = (), on_prompt_done=None, min_tokens: int = 0) -> list[Sample]:
        """RolloutEngine.generate's contract: n samples per prompt (default --num-generations; 1 when
        greedy) at `temperature` (default --temperature; 0 is greedy), each at least `min_tokens`
        long; `on_prompt_done(i, samples)` as soon as prompt i's samples are all done. Samples in
        prompt order, a prompt's in sample order."""
        args = self.args
        temperature = 0.0 if greedy else (args.temperature if temperature is None else temperature)
        n = 1 if temperature == 0.0 else (args.num_generations if n is None else n)
        if not prompts:
            return []
        held_back = self.held_back_ids() if min_tokens else ()
        seeds = request_seeds(args.seed, step, seed_key, prompt_indices)
        rows = [_Row(i, seeds[i] + j, self.device if temperature else None) for i in range(len(prompts))
                for j in range(n)]
        left = [n] * len(prompts)  # unfinished samples per prompt
        per_prompt = [None] * len(prompts)

        def finished(row):
            left[row.prompt] -= 1
            if left[row.prompt] == 0:
                i = row.prompt
                per_prompt[i] = [Sample(prompt_indices[i], list(prompts[i]), r.ids, r.text(self.tokenizer),
                                        r.logprobs, truncated=r.truncated, min_tokens=min_tokens,
                                        held_back_ids=held_back)
                                 for r in rows[i * n:(i + 1) * n]]
                if on_prompt_done is not None:
                    on_prompt_done(i, per_prompt[i])

        self._decode(prompts, rows, temperature, min_tokens, held_back, finished)
        accelerator.release_cached_memory()  # the KV cache of this call
        return [s for samples in per_prompt for s in samples]

    def _decode(self, prompts, rows: list[_Row], temperature: float, min_tokens: int, held_back, finished) -> None:
        """The rows in micro-batches of at most --hf-rollout-batch-tokens cache tokens, in row order."""
        budget, new = self.args.hf_rollout_batch_tokens, self.args.max_new_tokens
        batch, width = [], 0
        # inference mode: no version counters or view records on the loop's many small tensors (3-4% of the bench
        # job's CPU time with oneDNN's layers, 2.7% with torch's, measured; the same kernels, so the same values). No
        # tensor made here leaves the call: the samples (and `finished`'s) hold lists
        with torch.inference_mode(), self._linear_layers():
            for row in rows:
                wider = max(width, len(prompts[row.prompt]))
                if batch and (len(batch) + 1) * (wider + new) > budget:
                    self._decode_batch(prompts, batch, temperature, min_tokens, held_back, finished)
                    batch, wider = [], len(prompts[row.prompt])
                batch.append(row)
                width = wider
            self._decode_batch(prompts, batch, temperature, min_tokens, held_back, finished)

    def _linear_layers(self):
        """The linear layers through oneDNN for this call where this process's CPU GEMMs take it (module
        docstring), else as they are."""
        if cpu_gemm.using_onednn() or self.args.cpu_gemm == "onednn":
            return cpu_gemm.linear_layers_through_onednn(self.model)
        return contextlib.nullcontext()

    def _decode_batch(self, prompts, rows: list[_Row], temperature: float, min_tokens: int, held_back,
                      finished) -> None:
        """Prefill the rows' prompts (left-padded), then one token per step for the rows still going, into a
        cache preallocated for the whole micro-batch (`_prefix_cache`). Per step: one forward, the batch's
        logit processing and draw, and one transfer to the host (the tokens, for the stop checks, with their
        logprobs). The finished rows leave the batch and the cache at the step they finish."""
        args, device = self.args, self.device
        width = max(len(prompts[row.prompt]) for row in rows)
        # each prompt is prefilled once and its cache and logits copied to its samples' rows (a row's prefill
        # does not depend on the others': the same values as prefilling every row)
        distinct = list(dict.fromkeys(row.prompt for row in rows))
        ids = torch.zeros(len(distinct), width, dtype=torch.long)
        mask = torch.zeros(len(distinct), width + args.max_new_tokens, dtype=torch.long)
        for d, i in enumerate(distinct):
            ids[d, width - len(prompts[i]):], mask[d, width - len(prompts[i]):] = torch.tensor(prompts[i]), 1
        ids, mask = ids.to(device), mask.to(device)  # every generated position is real from the start
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)  # each prompt's first token at position 0
        cache = _prefix_cache(self.model.config, width + args.max_new_tokens)
        logits = self.model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        rows_of = torch.tensor([distinct.index(row.prompt) for row in rows], device=device)
        cache.reorder_cache(rows_of)
        logits, mask, positions = logits[rows_of], mask[rows_of], positions[rows_of]
        held = torch.tensor(held_back, dtype=torch.long, device=device)
        active = list(range(len(rows)))  # rows still generating, in batch order
        noise = _Noise([row.generator for row in rows], logits.shape[-1], args.max_new_tokens,
                       device) if temperature else None
        for t in range(args.max_new_tokens):
            logits = logits.float()
            if t < min_tokens and held.numel():
                logits[:, held] = -torch.inf  # vLLM's MinTokensLogitsProcessor, before temperature
            logprobs = processed_logprobs(logits, temperature, args.top_k, args.top_p)
            if temperature == 0.0:
                tokens = logits.argmax(dim=-1)
            else:  # vLLM's random_sample with per-request generators: argmax of probs / Exp(1) noise
                tokens = (logprobs.exp() / noise.next()).argmax(dim=-1)
            chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
            # the step's one transfer: fp32 logprobs and token ids are exact in float64
            host_tokens, host_logprobs = torch.stack([tokens.double(), chosen.double()]).tolist()
            going = []
            for b, (r, token, logprob) in enumerate(zip(active, host_tokens, host_logprobs)):
                row = rows[r]
                row.add(int(token), logprob, self.stop_ids, args.max_new_tokens, min_tokens, args.stop,
                        self.tokenizer)
                if row.done:
                    finished(row)
                else:
                    going.append(b)
            if not going:
                return
            if len(going) < len(active):  # drop the finished rows from the batch, the cache and the noise
                keep = torch.tensor(going, device=device)
                cache.reorder_cache(keep)
                mask, positions, tokens = mask[keep], positions[keep], tokens[keep]
                if noise is not None:
                    noise.keep(keep, going)
                active = [active[b] for b in going]
            positions = positions[:, -1:] + 1
            logits = self.model(input_ids=tokens[:, None], attention_mask=mask[:, :width + t + 1],
                                position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]

    # ------------------------------------------------------------------------------ weights ----

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """Copy a stream of (hf_name, tensor) into the model's parameters and persistent buffers in place, one
        tensor at a time (callers may reuse their buffers), a per-expert tensor into its slice of transformers'
        fused experts (models/in_memory_layout.py); asleep, the weights are woken first. Every target must be
        wholly written, and no unknown name or shape may come (one line naming it)."""
        self.onload(tags=["weights"])
        layout = self._layout
        layout.begin()
        for name, tensor in weights:
            if name.startswith(self._prefix):  # a multimodal checkpoint's names: the text model's here
                name = "model." + name.removeprefix(self._prefix)
            if self._tied and name == "lm_head.weight":
                continue  # the embedding, sent as model.embed_tokens.weight (vLLM's loaders skip it too)
            found = layout.view(name)
            if found is None or tuple(found[1].shape) != tuple(tensor.shape):
                raise RuntimeError(f"weight sync: {name} {tuple(tensor.shape)} is not a parameter of the HF rollout "
                                   f"model{'' if found is None else f' (it has {tuple(found[1].shape)})'}")
            found[1].copy_(tensor)
            layout.wrote(found[0], tensor.numel())
        if layout.unwritten():
            raise RuntimeError(f"weight sync: the stream left HF rollout parameters unloaded: "
                               f"{layout.unwritten()[:8]}")

    def _sleep(self) -> None:
        self._offloader.offload()

    def _wake(self, tags: list[str]) -> None:
        if "weights" in tags:
            self._offloader.onload()


NOISE_BYTES = 64 << 20  # the most a micro-batch's pre-drawn sampling noise holds at once


class _Noise:
    """The Exp(1) noise of the exponential race, [rows, vocab] a step, each row's from its own generator, drawn
    for several steps at a time: `exponential_` of a generator fills a tensor from one stream in element order
    (torch's CPU kernel; checked by tests/test_hf_rollout.py), so a row's [steps, vocab] block holds exactly the
    values that one [vocab] draw per step would. One draw per row every `steps` steps instead of every step;
    `steps` keeps the block within NOISE_BYTES."""

    def __init__(self, generators, vocab: int, max_new_tokens: int, device):
        self.generators, self.vocab, self.device = list(generators), vocab, device
        self.steps = max(1, min(max_new_tokens, NOISE_BYTES // (4 * vocab * len(self.generators))))
        self.block, self.t = None, self.steps

    def next(self) -> torch.Tensor:
        if self.t == self.steps:
            self.block = torch.empty(len(self.generators), self.steps, self.vocab, device=self.device)
            for row, generator in zip(self.block, self.generators):
                row.exponential_(generator=generator)
            self.t = 0
        self.t += 1
        return self.block[:, self.t - 1]

    def keep(self, keep: torch.Tensor, going: list[int]) -> None:
        """Only the batch's rows that go on: `going`, and the same indices on the device as `keep`."""
        self.generators = [self.generators[b] for b in going]
        self.block = self.block[keep]


class _PrefixLayer(StaticLayer):
    """transformers' StaticLayer (keys and values preallocated for the micro-batch's longest sequence, written in
    place) that hands attention only the filled prefix, so each step attends over the tokens so far as a
    DynamicCache's concatenation did (the same shapes, the same masks, the same sums), without the copy."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.length = 0  # tokens written (a Python int: no sync)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length


def _prefix_cache(config, max_len: int):
    """A cache of `_PrefixLayer`s for the full-attention layers; the other kinds (linear attention's states,
    sliding windows) are transformers' own dynamic layers, as a DynamicCache of this config holds."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return Cache(layers=[_PrefixLayer(max_len) if kind == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
                         for kind, kw in zip(types, kwargs)])


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                  **kwargs):
    """transformers' sdpa attention with the key/value heads shared by their query groups inside torch's kernel
    (enable_gqa) rather than repeated into a copy of the cache per layer and step. Registered as
    ATTENTION_NAME for CPU models: there torch's flash kernel takes a mask with grouped heads and gives the
    bits of the repeated heads (checked by tests/test_hf_rollout.py); on CUDA a mask sends enable_gqa to the
    math kernel, so CUDA keeps transformers' own."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


ATTENTION_NAME = "megarl_grouped_sdpa"


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _grouped_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class _Row:
    """One sample being generated: its tokens, their logprobs, its generator and how it ended."""

    def __init__(self, prompt: int, seed: int, device):
        self.prompt, self.ids, self.logprobs = prompt, [], []
        self.generator = None if device is None else torch.Generator(device).manual_seed(seed)
        self.done = self.truncated = False
        self.stop_token = False  # ended on a stop token id (left out of the text)
        self.cut = None  # the text up to a --stop string, when one ended it
        self._text = ""

    def add(self, token: int, logprob: float, stop_ids, max_new_tokens: int, min_tokens: int, stop, tokenizer):
        """vLLM's order: a stop token id ends the response (check_stop), else the length limit; then the
        detokenizer looks for a --stop string in the new text once past min_tokens."""
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.stop_token = token in stop_ids
        self.done = self.stop_token or len(self.ids) >= max_new_tokens
        self.truncated = self.done and not self.stop_token
        if stop:
            before, self._text = self._text, response_text(tokenizer, self.ids, self.stop_token)
            new = len(self._text) - len(before)
            if len(self.ids) > min_tokens and new:
                found = [(self._text.find(s, max(len(self._text) - new - len(s) + 1, 0)), s) for s in stop]
                found = [(start + len(s), start) for start, s in found if start >= 0]
                if found:  # the stop string that completes first
                    self.cut = self._text[:min(found)[1]]
                    self.done, self.truncated = True, False

    def text(self, tokenizer) -> str:
        if self.cut is not None:
            return self.cut
        return response_text(tokenizer, self.ids, self.stop_token)


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] fp32 logits -> the logprobs vLLM reports as `processed_logprobs`: at temperature 0 the
    log-softmax of the logits; else of logits / temperature with top-k (the k largest and their ties)
    and top-p (the smallest top set whose mass reaches p, at least one token) masked to -inf, as
    vLLM's apply_top_k_top_p_pytorch (-1 / k >= V and p = 1 turn each off)."""
    if temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        logits = logits.scatter(-1, order, ascending.masked_fill(drop, -torch.inf))
    return torch.log_softmax(logits, dim=-1)


def stop_token_ids(tokenizer, model_path: str) -> set[int]:
    """The ids that end a response, as vLLM resolves them (SamplingParams.update_from_generation_config):
    the tokenizer's EOS and the generation config's eos_token_id(s), from generation_config.json or,
    without one, the model's config (vLLM's try_get_generation_config)."""
    from transformers import GenerationConfig
    from megarl.models.families import load_hf_config

    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        config = GenerationConfig.from_model_config(load_hf_config(model_path))
    ids = config.eos_token_id
    ids = set() if ids is None else {ids} if isinstance(ids, int) else set(ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
