"""Routing replay (R3, megarl/routing_replay.py): the engine's per-request route bookkeeping, the micro-batch
layout, Megatron's router taking the replayed experts (and the recompute queue), the flag's checks; and one
torchrun launch (one rank) where vLLM records and Megatron replays, with a perturbation that flips the
trainer's routes."""

import pytest
import torch

from helpers import FP32_ULPS, read_json, torchrun, ulps
from megarl.routing_replay import NO_ROUTE, RouteRecorder, micro_batch_routes, router_targets, sample_routes


# ---------------------------------------------------------------- engine bookkeeping --
def _rows(tokens, layers=2, k=2):
    """Routes that name their token: layer l's experts of token t are (t + l, t + l + 1), mod 8."""
    t = torch.as_tensor(tokens)[:, None, None]
    return (t + torch.arange(layers)[None, :, None] + torch.arange(k)[None, None, :]) % 8


def test_recorder_maps_each_steps_rows_to_requests_and_positions():
    """Two requests, a chunked prefill and then decode steps, interleaved in the input batch's order; a
    third request preempted and recomputed from the start (its positions written again)."""
    a, b, c = [5, 6, 7, 8, 9], [3, 1, 4], [2, 7]
    recorder = RouteRecorder(num_layers=2, top_k=2)
    steps = [  # (request ids, starts, counts, tokens) of one forward step, laid end to end
        (["a", "b"], [0, 0], [3, 3], a[:3] + b),         # a's first chunk, b's whole prompt
        (["b", "a"], [3, 3], [1, 2], [11] + a[3:]),      # b decodes (its first sampled token), a's second chunk
        (["a", "b", "c"], [5, 4, 0], [1, 1, 2], [21, 12] + c),
        (["c"], [0], [3], c + [30]),                     # c preempted: recomputed from position 0, one more token
        (["a", "b"], [6, 5], [1, 0], [22]),              # b not scheduled this step
    ]
    for ids, starts, counts, tokens in steps:
        recorder.step(ids, starts, counts, torch.tensor(tokens), _rows(tokens))
    # A finished completion is found by the tokens it fed (prompt + response[:-1]).
    for prompt, response in ((a, [21, 22, 23]), (b, [11, 12, 13]), (c, [30, 31])):
        routes = sample_routes(recorder.take(prompt, response), prompt, response)
        fed = prompt + response[:-1]
        assert routes.shape == (len(fed), 2, 2)
        assert torch.equal(routes.long(), _rows(fed))
    assert recorder.requests == {}
    # A completion cut after a --stop string fed fewer tokens than its request: the request's first ones.
    recorder.step(["d"], [0], [4], torch.tensor([1, 2, 3, 4]), _rows([1, 2, 3, 4]))
    assert torch.equal(recorder.take([1, 2], [3, 9]).long(), _rows([1, 2, 3]))
    with pytest.raises(RuntimeError, match="no request of the engine fed this sample's 5 tokens"):
        recorder.take(a, [21])


def test_sample_routes_refuses_a_wrong_length():
    with pytest.raises(RuntimeError, match=r"shape \(5, 2, 2\) for a sequence of 6 fed tokens"):
        sample_routes(torch.zeros(5, 2, 2), [1, 2, 3], [4, 5, 6, 7])


# ---------------------------------------------------------------- micro-batch layout --
class _Sample:
    def __init__(self, length, first):
        self.routes = _rows(list(range(first, first + length))).to(torch.int16)


def test_routes_in_the_routers_token_order():
    """Padded rows: token (row j, position t) is router row t * b + j (Megatron's [s, b, h] flattened);
    positions without a route (padding, each sequence's last token) are NO_ROUTE. Packed: one row, each
    sample at its offset. Sequence parallelism: each TP rank its contiguous part of the sequence."""
    samples = [_Sample(4, 0), _Sample(2, 10), _Sample(3, 20)]  # sequences of 5, 3 and 4 tokens
    padded = micro_batch_routes(samples, [(0, 0), (1, 0), (2, 0)], (3, 6))
    targets = router_targets(padded, layer=1)
    assert targets.shape == (18, 2)
    for j, (start, length) in enumerate(((0, 4), (10, 2), (20, 3))):
        for t in range(6):
            expected = _rows([start + t])[0, 1] if t < length else torch.full((2,), NO_ROUTE)
            assert torch.equal(targets[t * 3 + j], expected), (j, t)
    packed = micro_batch_routes(samples, [(0, 0), (0, 5), (0, 8)], (1, 12))
    flat = router_targets(packed, layer=0)
    assert torch.equal(flat[5:7], _rows([10, 11])[:, 0]) and (flat[7] == NO_ROUTE).all()
    halves = [router_targets(padded, 1, sequence_shard=(rank, 2)) for rank in range(2)]
    assert torch.equal(torch.cat(halves), targets)
    assert micro_batch_routes([type("S", (), {"routes": None})()], [(0, 0)], (1, 4)) is None


# ------------------------------------------------------------- Megatron's router --
def _route(replay, logits, pre_softmax=False):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, router_replay=replay)


@pytest.mark.parametrize("pre_softmax", [False, True], ids=["qwen3-renormalised", "qwen2-pre-softmax"])
def test_replayed_experts_with_the_trainers_probabilities(pre_softmax):
    """The router (Megatron's topk_routing_with_score_function) takes the replayed experts where a route was
    recorded and its own elsewhere; the probabilities are its own scores at those experts (softmax over the
    k, or the full softmax's values), differentiable; the flip count compares its own top-k with the
    recorded one."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megarl.routing_replay import layer_replay

    torch.manual_seed(0)
    logits = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    own = logits.detach().topk(2, dim=1).indices
    other = next(e for e in range(8) if e not in own[3].tolist())  # row 3 keeps one of its own experts
    targets = torch.tensor([[6, 7], own[1].tolist(), [NO_ROUTE, NO_ROUTE], [own[3, 1].item(), other]])
    assert set(targets[0].tolist()) != set(own[0].tolist())
    replay = layer_replay(0, recompute=False)
    replay.set_target_indices(targets)
    replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
    replay.measure = True
    probs, routing_map = _route(replay, logits, pre_softmax)
    used = torch.stack([targets[0], targets[1], own[2], targets[3]])
    assert torch.equal(routing_map, torch.zeros(4, 8, dtype=torch.bool).scatter(1, used, True))
    scores = torch.softmax(logits, -1) if pre_softmax else logits
    chosen = scores.gather(1, used)
    expected = chosen if pre_softmax else torch.softmax(chosen, -1)
    # Megatron's softmax runs in fp32 (moe_utils: dtype=torch.float32): the fp32 rule against float64.
    assert ulps(probs.gather(1, used).detach(), expected.detach()) <= FP32_ULPS
    (probs * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    assert logits.grad[0].abs().sum() > 0  # the router learns at replayed experts too
    assert replay.counts.tolist() == [2.0, 3.0]  # rows 0 and 3 differ from its own top-k; row 2 has no route


def test_recomputed_forward_takes_its_own_micro_batchs_routes():
    """Activation recompute under 1F1B: the forwards of micro-batches A, one without routes and B run, then
    A's backward reruns A's forward: it must take A's routes (Megatron's REPLAY_BACKWARD queue), not B's, the
    latest set; the micro-batch without routes its own top-k."""
    from torch.utils.checkpoint import checkpoint

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megarl.routing_replay import layer_replay

    replay = layer_replay(0, recompute=True)
    replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
    weights = torch.arange(8.0, dtype=torch.float64)

    def layer(logits):
        probs, _ = _route(replay, logits)
        return (probs * weights).sum()

    routes = {"A": torch.tensor([[0, 1], [2, 3]]), "none": None, "B": torch.tensor([[4, 5], [6, 7]])}
    logits = {name: torch.randn(2, 8, dtype=torch.float64, requires_grad=True) for name in routes}
    outputs = {}
    for name in routes:
        replay.set_target_indices(routes[name])
        outputs[name] = checkpoint(layer, logits[name], use_reentrant=True)
    for name in routes:
        outputs[name].backward()
        expected = routes[name] if routes[name] is not None else logits[name].detach().topk(2, dim=1).indices
        assert torch.equal(replay.recorded_topk_idx, expected), name
        touched = (logits[name].grad != 0).nonzero()[:, 1].view(2, 2)
        assert torch.equal(touched.sort(1).values, expected.sort(1).values), name
    assert replay.replay_backward_list == []


# ----------------------------------------------------------------------- bad input --
def _parse(model, *flags):
    from megarl.arguments import parse_args

    return parse_args(["--config", "examples/quickstart_grpo.yaml", "--model", model, *map(str, flags)], world_size=2)


@pytest.mark.parametrize("flags,expected", [
    (["--rollout-backend", "hf"], "--routing-replay on --rollout-backend hf cannot record the experts"),
    (["--tools", "calculator"], "--routing-replay on --tools: the routes of multi-turn episodes are not recorded"),
], ids=["hf-backend", "tools"])
def test_replay_where_the_engine_cannot_record_routes_is_one_line(flags, expected, random_qwen3_moe_untied):
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        _parse(random_qwen3_moe_untied, "--routing-replay", "on", *flags)
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert _parse(random_qwen3_moe_untied, *flags).routing_replay == "off"  # auto: off there


def test_replay_on_a_dense_model_is_one_line_and_auto_follows_the_model(tiny_model, random_qwen3_moe_untied):
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        _parse(tiny_model, "--routing-replay", "on")
    assert "--routing-replay on needs a mixture-of-experts model" in str(error.value), str(error.value)
    assert "\n" not in str(error.value)
    assert _parse(tiny_model).routing_replay == "off"
    assert _parse(random_qwen3_moe_untied).routing_replay == "on"
    assert _parse(random_qwen3_moe_untied, "--routing-replay", "off").routing_replay == "off"


def test_yaml_on_and_off_read_as_the_switch(tmp_path, random_qwen3_moe_untied):
    """YAML reads a bare off / on as a boolean: the option takes it as the word."""
    from megarl.arguments import parse_args

    for word, expected in (("off", "off"), ("on", "on")):
        config = tmp_path / f"{word}.yaml"
        config.write_text(f"model: {random_qwen3_moe_untied}\nrouting_replay: {word}\n")
        assert parse_args(["--config", str(config)], world_size=1).routing_replay == expected


# ------------------------------------------------------------------ vLLM -> Megatron --
@pytest.mark.slow
@pytest.mark.parametrize("model", ["random_moe_policy", "random_qwen3_5_moe_policy", "random_deepseek_v3_policy",
                                   "random_glm4_moe_policy", "random_gpt_oss_policy", "random_nemotron_h_policy"])
def test_trainer_replays_the_engines_routes_and_a_flipped_router_keeps_the_dense_mismatch(model, request, tmp_path):
    """One rank, colocated: the engine's samples carry their routes, and the policy's and the reference's
    routers use exactly those experts (every layer, padded and packed micro-batches), with a trainer-only
    selection bias in place that would otherwise route every token elsewhere.

    The bookkeeping is right only if the trainer's own routing of the same weights agrees with the recorded
    one at (nearly) every (token, layer): a position or order error would disagree at most of them
    (random routes agree on both experts 1 time in 28). The bias flips the trainer's own routes; with replay
    the mismatch stays at the unperturbed (dense) level (the same experts, the trainer's own probabilities
    at them), without replay it does not. Ratios to the unperturbed run, not magnitudes. Qwen3.5-MoE: the
    same through its Gated DeltaNet and gated-attention layers (vLLM's qwen3_5 model records the routes).
    DeepSeek-V3: its sigmoid router, whose choice adds the expert bias and keeps the best groups, replays the
    engine's routes (its first layer is dense: no routes there). The bias sends every token to the experts
    the engine used least, and the routes must depend on the token (`route_spread`). GLM-4.5: the same router
    under grouped-query attention. gpt-oss: a router with a bias, softmax over the top k. Nemotron-H: the sigmoid
    router in its MoE mixers among Mamba-2, attention and MLP ones (routes only where a layer has experts)."""
    out = tmp_path / "report.json"
    torchrun("routing_replay_worker.py", out, "--model", request.getfixturevalue(model), "--prompts-per-step", 4,
             "--num-generations", 4, "--max-new-tokens", 16, "--micro-batch-size", 16, "--kl-coef", 0.1,
             "--rollout-kv-cache-gb", 0.25, "--train-steps", 1, "--routing-replay", "on", nproc=1, timeout=600)
    report = read_json(out)
    assert report["with_routes"] == report["samples"] == 16 and report["routes_shape_ok"], report
    for layout in ("equality_padded", "equality_packed"):
        for role in ("policy", "reference"):
            assert report[layout][role]["compared"] > 0 and report[layout][role]["differ"] == 0, (layout, role, report)
    unperturbed = report["unperturbed_replay"]
    assert unperturbed["routing_replay_flip"] <= 0.01, report
    # Routes that depend on the token (measured 0.17 for DeepSeek-V3, of its 6 pairs of groups): a route misplaced
    # by a position would differ at hundreds of the ~1500 (token, layer) pairs compared above.
    assert report["route_spread"] >= 0.1, report
    assert report["biased_replay"]["routing_replay_flip"] >= 0.5, report  # the bias does flip the routes
    dense = unperturbed["mismatch"]
    assert report["biased_replay"]["mismatch"] <= 2 * dense, report
    assert report["unperturbed_no_replay"]["mismatch"] <= 2 * dense, report
    # Every family's dense mismatch is fp32 rounding (DeepSeek-V3's was 6e-5, 23x below flipped routes, before
    # megarl/vllm_cpu.py's fix of vLLM's CPU RoPE on multi-latent attention's 3-D inputs).
    assert report["biased_no_replay"]["mismatch"] >= 1000 * dense, report
