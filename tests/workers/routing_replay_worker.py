"""torchrun worker of tests/test_routing_replay.py: routing replay (R3) with the real rollout engine and
trainer roles of one run (build_run: vLLM records, Megatron replays).

1. One step's samples from the engine (they carry routes), the old logprobs with replay (the unperturbed
   run: `mismatch`, `routing_replay_flip`).
2. The perturbation (below) on the policy's and the reference's routers, then routing equality: every
   micro-batch, padded (several rows: Megatron's [s, b] token order) and packed, through both; per layer,
   the experts each router used at the recorded positions against the samples' routes.
3. The perturbation on the policy only: a trainer-only selection bias (a large per-expert offset added to
   the router's logits for the top-k choice only, probabilities from the unbiased logits, as DeepSeek-V3's
   bias-based balancing does), so that the trainer's own routes differ from the engine's. The old logprobs
   again with replay, then without (the samples' routes dropped), then unperturbed without replay.
Rank 0 writes the report (JSON) to argv[1].
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from megarl import distributed, phases, routing_replay  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.models.families import moe_layer_pattern, num_experts  # noqa: E402
from megarl.model_runner import make_micro_batches, run_model  # noqa: E402
from megarl.rollout import release_shared_memory  # noqa: E402
from megarl.run import build_run  # noqa: E402

BIAS = 100.0  # far above any router logit spread: the biased trainer always picks experts 0 .. k-1


class BiasedSelection:
    """A router's replay object with a selection bias: the top-k is chosen on scores + bias, the
    probabilities gathered from the unbiased scores; `inner` (the installed LayerReplay) decides whether the
    recorded routes replace that choice (and counts how often they differ from it)."""

    def __init__(self, inner, bias: torch.Tensor):
        self.inner, self.bias = inner, bias

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        def biased(values, k, num_groups=None, group_topk=None):
            indices = torch.topk(values + self.bias.to(values.device), k=k, dim=1).indices
            return values.gather(1, indices), indices

        return self.inner.get_replay_topk(scores, topk, num_groups, group_topk, biased)


def routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def least_used_experts(samples, num_experts: int, top_k: int) -> torch.Tensor:
    """The `top_k` experts the engine routed the fewest (token, layer) pairs to: what the bias moves every token
    to, so that it flips the routes of most tokens however the model's own routing leans (DeepSeek-V3's expert
    bias may favour the same experts for most tokens)."""
    routes = torch.cat([s.routes.reshape(-1).long() for s in samples])
    return torch.bincount(routes[routes >= 0], minlength=num_experts).argsort()[:top_k]


def set_bias(model, on: bool, experts: torch.Tensor, num_experts: int) -> None:
    bias = torch.zeros(num_experts)
    bias[experts] = BIAS
    for router in routers(model):
        replay = router.router_replay
        inner = replay.inner if isinstance(replay, BiasedSelection) else replay
        router.router_replay = BiasedSelection(inner, bias) if on else inner


def old_logprobs(run, samples):
    batch, _ = phases.score_and_filter(run, samples)
    batch, report = phases.prepare(run, batch)
    metrics = report.metrics
    return {key: metrics[key] for key in ("mismatch", "mismatch_max", "routing_replay_flip") if key in metrics}


def routing_equality(run, samples, packed: bool) -> dict:
    """Per layer of the policy and the reference: recorded positions whose used experts differ from the
    samples' routes (as sets), and the recorded positions compared."""
    batch, _ = phases.score_and_filter(run, samples)
    micro_batches = make_micro_batches(batch, 4, run.tokenizer.pad_token_id or 0, packed=packed)
    assert packed or micro_batches[0].tokens.shape[0] > 1  # several rows: the [s, b] order is exercised
    result = {}
    for name, role in (("policy", run.actor), ("reference", run.reference)):
        differ = compared = 0
        with role.resident() if name == "reference" else torch.no_grad():
            for micro_batch in micro_batches:
                with torch.no_grad():
                    run_model(role.model, micro_batch)
                for replay in routing_replay.layer_replays(role.model):
                    expected = routing_replay.router_targets(micro_batch.routes, replay.layer)
                    recorded = expected[:, 0] >= 0
                    used = replay.recorded_topk_idx
                    differ += int((used[recorded].sort(1).values != expected[recorded].sort(1).values).any(1).sum())
                    compared += int(recorded.sum())
        result[name] = {"differ": differ, "compared": compared}
    return result


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args = parse_args(argv)
    context = distributed.init_distributed(args)
    run = build_run(args, context)
    hf_config = run.hf_config
    samples, _ = phases.generate(run, 0)
    report = {"samples": len(samples), "with_routes": sum(s.routes is not None for s in samples),
              "routes_shape_ok": all(tuple(s.routes.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1,
                                                               hf_config.num_hidden_layers,
                                                               hf_config.num_experts_per_tok) for s in samples),
              "unperturbed_replay": old_logprobs(run, samples)}
    # How much the routes depend on the token: the share of (token, layer) pairs of MoE layers whose experts are
    # not their layer's most common set (a model that routes every token alike would hide position errors).
    sets = torch.cat([s.routes.sort(dim=-1).values for s in samples]).transpose(0, 1)  # [layers, tokens, k]
    # dense layers (DeepSeek-V3's first ones, mlp_only_layers) have no routes of their own
    moe = [layer for layer, is_moe in zip(sets, moe_layer_pattern(hf_config)) if is_moe]
    report["route_spread"] = sum((layer != layer.mode(dim=0).values).any(dim=-1).float().mean().item()
                                 for layer in moe) / len(moe)
    experts = least_used_experts(samples, num_experts(hf_config), hf_config.num_experts_per_tok)
    for model in (run.actor.model, run.reference.model):
        set_bias(model, True, experts, num_experts(hf_config))
    # Under the bias, so that a router's own choice cannot pass for the replayed one.
    report.update(equality_padded=routing_equality(run, samples, packed=False),
                  equality_packed=routing_equality(run, samples, packed=True))
    set_bias(run.reference.model, False, experts, num_experts(hf_config))
    report["biased_replay"] = old_logprobs(run, samples)
    routes = [s.routes for s in samples]
    for s in samples:
        s.routes = None
    report["biased_no_replay"] = old_logprobs(run, samples)
    set_bias(run.actor.model, False, experts, num_experts(hf_config))
    report["unperturbed_no_replay"] = old_logprobs(run, samples)
    for s, r in zip(samples, routes):
        s.routes = r
    if context.env.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
    release_shared_memory()
    sys.stdout.flush()
    os._exit(0)  # as train.py: vLLM's in-process engine must not stall interpreter shutdown
