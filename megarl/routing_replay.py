"""Routing replay (R3) for mixture-of-experts policies: the trainer routes each token to the experts the
rollout engine routed it to.

Why: an MoE router is a discontinuous function of its input (a top-k), so the tiny numerical differences
between vLLM's kernels and Megatron's flip some tokens' experts; the trainer then computes the logprob of
a different network than the one that sampled, and the importance ratio of those tokens is meaningless
(GRPO on MoE policies collapses without replay in published runs).

Rollout side (`RouteRecorder`, `sample_routes`): every sample carries `routes` [p + r - 1, layers, k],
the experts of each token the engine fed to the model (the prompt and every response token but the last,
which is sampled and never fed back, so it has no route). One code path per platform:
  * CUDA: vLLM's own capture (`enable_return_routed_experts`, Model Runner V2), returned per completion as
    `routed_experts [len, layers, k]`, prefix-cached tokens included (vLLM keeps a store keyed by the
    cache's block hashes). Untested here: no GPU.
  * CPU (Model Runner V1, which vLLM's capture refuses: "AuxOutput Connector requires Model Runner V2"):
    vLLM's own capturer (`RoutedExpertsCapturer`, bound to each MoE layer's router by
    `bind_routed_experts_capturer`) writes each forward step's [tokens_in_step, layers, k]; `install`
    wraps the model runner's `execute_model` to hand each step's rows to `RouteRecorder`, which maps them
    to requests and positions (the step's token layout is the input batch's requests in order, each
    request's scheduled tokens contiguous from its `num_computed_tokens`). Prefix caching is turned off
    while replay is on: a cached token is not computed again, so its route would be the route of whichever
    request computed it, possibly in an earlier generate call; keeping those needs a store keyed by block
    hashes that lives as long as the cache (what vLLM's V2 connector does). The cost is recomputing each
    prompt for every one of its samples.
Both end in `EngineRoutes.of` -> `sample_routes`, the one place that checks a completion's routes against
its length.

Trainer side (`layer_replay`, `install_on_model`, `set_targets`): Megatron-core's `RouterReplay`
(`transformer/moe/router_replay.py`; `topk_routing_with_score_function` asks it for the top-k), one per
router, installed by megarl rather than by `moe_enable_routing_replay` (that one registers every router of
every model of the process in one class-level list, in instantiation order: the actor's and the
reference's routers would share it). Before each forward, `run_model` gives each router this micro-batch's
recorded experts in the router's token order (`router_targets`). The router then takes exactly those
experts, with probabilities from the trainer's own logits gathered at them (softmax over the k for
Qwen3-MoE's renormalised top-k), so the router still gets gradients. Positions without a recorded route
(padding, each sequence's last token, samples that are not the engine's, e.g. dataset responses) keep the
trainer's own choice: their outputs score nothing (a last token's logits lie past the sequence) or are
not the rollout's anyway. Old logprobs, the update (and its recomputed forward under activation
recompute: `in_backward`) and the reference all replay.

Measured every step (`routing_metrics`): `routing_replay_flip`, the share of (token, layer) pairs where
the trainer's own top-k (computed beside the replay) differs, as a set, from the recorded one, in the
pass that gives the old logprobs (before the update, with the weights the rollout had).
"""

from __future__ import annotations

import torch

# A position without a recorded route (padding, a sequence's last token, a sample the engine did not
# generate): the router keeps its own choice there.
NO_ROUTE = -1


# ----------------------------------------------------------------- rollout side ----
class RouteRecorder:
    """Per-request routes from the forward steps of a vLLM V1 engine (no vLLM here: the worker hook in
    `install` feeds it). Each request keeps the tokens it fed by position (a Python list) and, per step it
    took part in, where its rows lie in that step's routes; a finished completion finds its request by its
    tokens and assembles the routes then (`take`). The per-step work is a few list operations per request:
    it runs between every two decode steps of the engine."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        # request id -> (tokens fed by position, [(step's routes, offset in the step, start position, count)])
        self.requests: dict[str, tuple[list[int], list]] = {}

    def step(self, request_ids: list[str], starts: list[int], counts: list[int], tokens, rows) -> None:
        """One forward step: request i fed `counts[i]` tokens from position `starts[i]`, laid end to end in
        request order; `tokens` [sum(counts)] are the step's input ids, `rows` [sum(counts), layers, k] the
        experts each layer routed them to (copied: the capturer reuses its buffer). A position written again
        (a preempted request recomputed from the start) takes the later step's route."""
        total = sum(counts)
        if len(tokens) < total or len(rows) < total:
            raise RuntimeError(f"routing replay: the step fed {total} tokens but {len(rows)} routes were captured")
        tokens = torch.as_tensor(tokens[:total]).tolist()
        rows = torch.as_tensor(rows[:total]).to(torch.int16, copy=True)
        offset = 0
        for request_id, start, count in zip(request_ids, starts, counts):
            if not count:
                continue
            fed, segments = self.requests.setdefault(request_id, ([], []))
            if start > len(fed):
                raise RuntimeError(f"routing replay: request {request_id} fed positions from {start}, after only "
                                   f"{len(fed)} recorded (a prefix-cached prompt? prefix caching must be off)")
            fed[start:start + count] = tokens[offset:offset + count]
            segments.append((rows, offset, start, count))
            offset += count

    def take(self, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
        """The routes [p + r - 1, layers, k] of the finished request that fed exactly prompt + response[:-1],
        removed from the recorder. Requests are found by their tokens, not by vLLM's internal ids (which
        carry a random suffix and, for n > 1, a child index): two requests that fed the same tokens were
        routed alike, so either's routes serve. Failing an exact match, a request that fed more tokens after
        the same ones serves: vLLM drops the tokens generated past a matched stop string from the
        completion (output_processor.py, _trim_surplus_tokens, e.g. several tokens accepted in one step;
        on CUDA their routes too), not from what the model was fed."""
        want = list(prompt_ids) + list(response_ids[:-1])
        n = len(want)
        match = None
        for request_id, (fed, _) in self.requests.items():
            if len(fed) >= n and fed[:n] == want:
                if len(fed) == n:
                    match = request_id
                    break
                match = match or request_id
        if match is None:
            raise RuntimeError(f"routing replay: no request of the engine fed this sample's {n} tokens (its "
                               f"routes were not recorded)")
        fed, segments = self.requests.pop(match)
        routes = torch.zeros(len(fed), self.num_layers, self.top_k, dtype=torch.int16)
        for rows, offset, start, count in segments:  # in step order: a later write wins
            routes[start:start + count] = rows[offset:offset + count]
        return routes[:n]

    def clear(self) -> None:
        """Forget every request (after a generate call: anything left was not a returned completion)."""
        self.requests.clear()


def install(worker, num_layers: int, top_k: int) -> RouteRecorder:
    """On a vLLM V1 worker (through collective_rpc; the engine runs in this process): bind vLLM's
    routed-experts capturer to the model's MoE routers and record each forward step's routes by request
    and position. Returns the recorder."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (RoutedExpertsCapturer,
                                                                                bind_routed_experts_capturer)

    runner = worker.model_runner
    capturer = RoutedExpertsCapturer(runner.max_num_tokens, runner.vllm_config)
    if capturer.shape_per_token != (num_layers, top_k):
        raise RuntimeError(f"routing replay: vLLM captures {capturer.shape_per_token} (layers, k) per token, the "
                           f"model has ({num_layers}, {top_k})")
    bind_routed_experts_capturer(runner.model, capturer)
    recorder = RouteRecorder(num_layers, top_k)
    execute_model = runner.execute_model

    def recording_execute_model(scheduler_output, *args, **kwargs):
        output = execute_model(scheduler_output, *args, **kwargs)
        total = scheduler_output.total_num_scheduled_tokens
        if total:
            # The layout of the step's tokens (GPUModelRunner._prepare_inputs): the input batch's requests
            # in order, each with its scheduled tokens, from its num_computed_tokens (the scheduler's count).
            batch = runner.input_batch
            request_ids = list(batch.req_ids[:batch.num_reqs])
            starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens))
            counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in request_ids]
            if sum(counts) != total:
                raise RuntimeError(f"routing replay: the input batch holds {sum(counts)} of the step's {total} "
                                   f"scheduled tokens: vLLM's batch layout changed")
            recorder.step(request_ids, [starts.get(r, 0) for r in request_ids], counts,
                          runner.input_ids.cpu[:total], capturer.device_buffer[:total].cpu())
        return output

    runner.execute_model = recording_execute_model
    return recorder


def engine_kwargs() -> dict:
    """What the rollout engine needs to record routes: vLLM's capture on CUDA; prefix caching off on CPU
    (cached tokens are not computed again, so the recorder would see no route for them: module docstring)."""
    from megarl import accelerator

    return {"enable_return_routed_experts": True} if accelerator.ON_CUDA else {"enable_prefix_caching": False}


class EngineRoutes:
    """A rollout engine's routes per completion (`of`), the same on either platform: vLLM's own on CUDA
    (`CompletionOutput.routed_experts`), the `RouteRecorder` installed in the engine's worker on CPU."""

    def __init__(self, llm, hf_config):
        from megarl import accelerator

        self.recorder = None
        if not accelerator.ON_CUDA:  # the engine's worker runs in this process (external launcher)
            (self.recorder,) = llm.collective_rpc(install, kwargs=dict(num_layers=hf_config.num_hidden_layers,
                                                                      top_k=hf_config.num_experts_per_tok))

    def start(self) -> None:
        """Before a generate call: nothing left of an earlier one."""
        if self.recorder is not None:
            self.recorder.clear()

    def of(self, prompt_ids: list[int], response_ids: list[int], completion) -> torch.Tensor | None:
        """The routes of a finished completion (`sample_routes`); None for an empty response (nothing to
        train on, and no token of it was fed)."""
        if not response_ids:
            return None
        routes = (completion.routed_experts if self.recorder is None
                  else self.recorder.take(prompt_ids, response_ids))
        return sample_routes(routes, prompt_ids, response_ids)


def sample_routes(routes, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """A completion's routes as a Sample carries them: int16 [p + r - 1, layers, k] (every token the engine
    fed; the last response token never was). Refuses routes of another length."""
    routes = torch.as_tensor(routes).to(torch.int16)
    expected = len(prompt_ids) + len(response_ids) - 1
    if routes.ndim != 3 or routes.shape[0] != expected:
        raise RuntimeError(f"routing replay: the engine returned routes of shape {tuple(routes.shape)} for a "
                           f"sequence of {expected} fed tokens ({len(prompt_ids)} prompt + {len(response_ids)} "
                           f"response - 1)")
    return routes


# ----------------------------------------------------------------- trainer side ----
def micro_batch_routes(samples, places: list[tuple[int, int]], shape: tuple[int, int]) -> torch.Tensor | None:
    """Position-aligned routes [rows, L, layers, k] (long) of samples laid out at `places` (row, offset) in
    a micro-batch of `shape`: sample i's position t is its token t, whose route is `routes[t]`; NO_ROUTE
    where none was recorded. None when no sample carries routes."""
    carried = [s.routes for s in samples if getattr(s, "routes", None) is not None]
    if not carried:
        return None
    out = torch.full((*shape, *carried[0].shape[1:]), NO_ROUTE, dtype=torch.long)
    for s, (row, offset) in zip(samples, places):
        if getattr(s, "routes", None) is not None:
            out[row, offset: offset + len(s.routes)] = s.routes.long()
    return out


def router_targets(routes: torch.Tensor, layer: int, sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
    """Layer `layer`'s routes of a micro-batch [b, L, layers, k] in the order its router sees the tokens:
    Megatron's hidden states are [s, b, h] and the router flattens its logits [s, b, E] to [s * b, E]
    (TopKRouter.routing), so token (row j, position t) is row t * b + j. `sequence_shard` (rank, size):
    under sequence parallelism each TP rank routes only its contiguous part of the sequence."""
    targets = routes[:, :, layer].transpose(0, 1)  # [L, b, k]
    if sequence_shard is not None:
        rank, size = sequence_shard
        part = targets.shape[0] // size
        targets = targets[rank * part:(rank + 1) * part]
    return targets.reshape(-1, targets.shape[-1])


def in_backward() -> bool:
    """Whether autograd is running a backward pass now: activation recompute (Megatron's checkpointing)
    reruns a layer's forward there, for a micro-batch whose forward ran earlier."""
    return torch._C._current_graph_task_id() != -1


_LAYER_REPLAY = None


def layer_replay(layer: int, recompute: bool):
    """A LayerReplay for the router of `layer` (0-based over the whole model); `recompute`: the model reruns
    layers' forwards in the backward (--recompute-granularity full)."""
    global _LAYER_REPLAY
    if _LAYER_REPLAY is None:  # defined on first use: importing this module must not import Megatron
        from megatron.core.transformer.moe.router_replay import RouterReplay

        class LayerReplay(RouterReplay):
            """Megatron's RouterReplay for one router of one model (not in RouterReplay's class-level list:
            see the module's docstring). Actions: None (the router's own top-k) or REPLAY_FORWARD (the
            targets of the current micro-batch). Under activation recompute the forward a backward reruns
            takes the oldest micro-batch's targets not yet rerun (`replay_backward_list`, Megatron's
            REPLAY_BACKWARD queue; 1F1B runs the backwards in the order of the forwards); the queue is
            filled only then and emptied at the start of every pass (`start_pass`), so it never grows past
            one pass's micro-batches."""

            def __init__(self, layer: int, recompute: bool):
                self.layer, self.recompute = layer, recompute
                self.target_topk_idx = None
                self.recorded_topk_idx = None  # the experts the router used last (tests read them)
                self.router_replay_action = None
                self.replay_backward_list = []
                self.measure = False
                self.counts = torch.zeros(2, dtype=torch.float64)  # (pairs whose own top-k differs, pairs)

            def set_target_indices(self, topk_indices):
                self.target_topk_idx = topk_indices
                if self.recompute:  # None too: a micro-batch without routes keeps its place in the queue
                    self.replay_backward_list.append(topk_indices)

            def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
                # The router's own choice, always: it fills the positions without a recorded route and
                # is what `measure` compares the recorded routes with.
                own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                backward = self.recompute and in_backward()
                if backward:  # the rerun forward of the oldest micro-batch not yet rerun
                    targets = self.replay_backward_list.pop(0) if self.replay_backward_list else None
                else:
                    targets = self.target_topk_idx if self.router_replay_action is not None else None
                if targets is None:
                    self.recorded_topk_idx = own
                    return own_values, own
                targets = targets.to(scores.device)
                if targets.shape != own.shape:
                    raise RuntimeError(f"routing replay: layer {self.layer} routes {tuple(own.shape)} (tokens, k), "
                                       f"the recorded routes are {tuple(targets.shape)}")
                recorded = targets[:, :1] >= 0
                chosen = torch.where(recorded, targets, own)
                if self.measure and not backward:
                    differ = (own.sort(dim=1).values != chosen.sort(dim=1).values).any(dim=1) & recorded[:, 0]
                    self.counts += torch.tensor([differ.sum().item(), recorded.sum().item()], dtype=torch.float64)
                self.recorded_topk_idx = chosen
                # Megatron's replay: the probabilities from the router's own scores at the replayed experts.
                return scores.gather(1, chosen), chosen

        _LAYER_REPLAY = LayerReplay
    return _LAYER_REPLAY(layer, recompute)


def layer_replays(model) -> list:
    """The LayerReplay of each router of `model` (any wrapper), in module order; [] when none is installed
    (`install_on_model` keeps the list on the model)."""
    from megarl.models.convert import unwrap

    return getattr(unwrap(model), "_layer_replays", [])


def install_on_model(module) -> int:
    """A LayerReplay on every MoE router of the (unwrapped) Megatron model; how many."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for m in module.modules():
        if isinstance(m, TopKRouter):
            m.router_replay = layer_replay(m.layer_number - 1, m.config.recompute_granularity == "full")
            replays.append(m.router_replay)
    module._layer_replays = replays
    return len(replays)


def start_pass(model) -> None:
    """Before a pass over micro-batches: no targets left from an earlier pass."""
    for replay in layer_replays(model):
        replay.clear_indices()


def set_targets(model, routes: torch.Tensor | None) -> None:
    """Before `model`'s forward on a micro-batch: its routers replay `routes` [b, L, layers, k] (this
    rank's part of the micro-batch; None: the routers choose, e.g. no sample carries routes)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = layer_replays(model)
    if not replays:
        return
    shard = None
    if replays and routes is not None and _sequence_parallel(model):
        from megatron.core import parallel_state

        shard = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    for replay in replays:
        if routes is None:
            replay.set_target_indices(None)
            replay.router_replay_action = None
            continue
        if replay.layer >= routes.shape[2]:
            raise RuntimeError(f"routing replay: the router of layer {replay.layer} has no recorded routes (the "
                               f"samples carry {routes.shape[2]} layers)")
        replay.set_target_indices(router_targets(routes, replay.layer, shard))
        replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD


def _sequence_parallel(model) -> bool:
    from megarl.models.convert import unwrap

    return bool(unwrap(model).config.sequence_parallel)


def measure(model, on: bool) -> None:
    """Start (zeroing the counts) or stop counting the routes the trainer's own top-k would change."""
    for replay in layer_replays(model):
        replay.measure = on
        if on:
            replay.counts.zero_()


def routing_metrics(model) -> dict[str, float]:
    """{"routing_replay_flip": share of recorded (token, layer) routes where the trainer's own top-k differs}
    since `measure(model, True)`, over every train rank (each pipeline stage counts its layers, each
    data-parallel, context-parallel and sequence-parallel rank its tokens; TP ranks without sequence
    parallelism count the same tokens alike, which leaves the share unchanged). {} without replay or
    without recorded routes.
    Collective over the train ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl import accelerator

    replays = layer_replays(model)
    if not replays:
        return {}
    counts = sum((r.counts for r in replays), torch.zeros(2, dtype=torch.float64)).to(accelerator.device())
    for group in (parallel_state.get_data_parallel_group(with_context_parallel=True),
                  parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_tensor_model_parallel_group()):
        dist.all_reduce(counts, group=group)
    differ, total = counts.tolist()
    return {"routing_replay_flip": differ / total} if total else {}  # {}: no sample carried routes
