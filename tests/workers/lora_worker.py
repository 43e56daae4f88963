"""torchrun worker (2 ranks): the tiny model with LoRA adapters on every linear, the same adapters
(A as initialised, B drawn whole from a seed per adapter, then sharded as the layer shards it) through the
actor (Megatron DDP, its schedule and finalize_model_grads, the base frozen) at TP=2 (with and without
sequence parallelism), PP=2, CP=2 and then on one rank's layout (TP=1, the ranks data-parallel copies),
in the same launch (on 4 ranks, argv[3] names the layouts: sequence parallelism with PP=2 and CP=2): one packed
micro-batch of two sequences, a loss on fixed random weights of the real vocabulary, backward.
Rank 0 writes a JSON report: each layout's logits (the last stage's, whole over TP and CP) and every
adapter's gradient (gathered whole over TP, from every stage) against the one-rank layout's, in ulps
(tests/helpers.py: two fp32 paths), and the gradients' scale; the weight syncs' and exports' two streams
(merged weights, PEFT adapters: every stage's on every rank, whole) against the one-rank layout's; from a TP=2 pass with the adapters'
dropout on, how far the replicated A's gradients of the two TP ranks are apart (0: the same masks);
and the checkpoint at PP=2 (adapters and Adam's moments, whole over TP; Megatron's layer offsets): a fresh PP=2 actor
resumed from it takes the next step bit for bit as the saved one did, and the one-rank layout loads it
with every adapter and moment bit for bit as saved."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import fp32_paths_ulps  # noqa: E402

# 2 ranks by default; on 4 (argv[3]: the layouts) sequence parallelism with PP and with CP as well
LAYOUTS = {"tp2": dict(tp=2), "tp2sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "cp2": dict(cp=2),
           "tp2sp_pp2": dict(tp=2, sp=True, pp=2), "tp2sp_cp2": dict(tp=2, sp=True, cp=2), "ep2": dict(ep=2),
           "one": {}}
TWO_RANKS = ("tp2", "tp2sp", "pp2", "cp2", "one")
LENGTHS = (12, 8)  # the packed row's sequences: slots of a multiple of 2 x CP as they are


def micro_batch(vocab: int):
    from megarl.model_runner import MicroBatch

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (1, sum(LENGTHS)), generator=generator)
    labels, positions, spans, offset = torch.zeros_like(tokens), torch.zeros_like(tokens), [], 0
    for length in LENGTHS:
        labels[0, offset: offset + length - 1] = tokens[0, offset + 1: offset + length]
        positions[0, offset: offset + length] = torch.arange(length)
        spans.append((0, offset, 4, length - 4))
        offset += length
    return MicroBatch(tokens, labels, torch.ones(tokens.shape), spans, {}, positions, [0, 1], list(LENGTHS))


def adapter_params(model) -> dict[str, torch.nn.Parameter]:
    """This stage's adapters by global name (HF module path, A or B)."""
    return {key: param for key, (_, _, param) in adapter_entries(model).items()}


def adapter_entries(model) -> dict[str, tuple]:
    """{global name: (its LoraAdapter, HF module, parameter)} of this stage's adapters."""
    from megarl.models.lora import adapters_of

    return {f"{adapter.hf_paths[module]}{'' if adapter.expert is None else f'.{adapter.expert}'}.{kind}":
            (adapter, module, param) for adapter in adapters_of(model)
            for kind, params in (("A", adapter.A), ("B", adapter.B)) for module, param in params.items()}


def whole_over_tp(entry, tensor, tp: int, group) -> torch.Tensor:
    """The whole of an adapter tensor split over TP, in HF's order (a column base's B: `whole_rows`); a routed
    expert's adapters are whole (their TP group, the expert-TP one, is one rank)."""
    adapter, module, param = entry
    dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
    if dim is None or tp == 1 or adapter.tp_group.size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return adapter.whole_rows(module, parts) if dim == 0 else torch.cat(parts, dim=dim)


def everyone(local: dict) -> dict:
    """The union of every rank's dict (tensor-, context- and data-parallel peers hold the same entries)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {name: value for part in gathered for name, value in part.items()}


def optimizer_moments(actor) -> dict[str, torch.Tensor]:
    named = {id(param): name for name, param in adapter_params(actor.model).items()}
    moments = {}
    for part in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for param, state in part.optimizer.state.items():
            for moment in ("exp_avg", "exp_avg_sq"):
                moments[f"{named[id(param)]}.{moment}"] = state[moment].clone()
    return moments


def whole_state(actor, tp: int, group) -> dict[str, torch.Tensor]:
    """Every adapter and its Adam moments, whole over TP, from every stage."""
    entries = adapter_entries(actor.model)
    state = {key: whole_over_tp(entry, entry[2].detach().clone(), tp, group) for key, entry in entries.items()}
    for key, moment in optimizer_moments(actor).items():  # '<adapter>.<exp_avg|exp_avg_sq>'
        state[key] = whole_over_tp(entries[key.rsplit(".", 1)[0]], moment, tp, group)
    return everyone(state)


def run(model_dir: str, name: str, ckpt: Path, saved: dict | None):
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megarl.models.families import load_hf_config

    from megarl.actor import Actor
    from megarl.arguments import parse_args
    from megarl.checkpoint import _use_in_process_results_queue
    from megarl.kernels import naive
    from megarl.model_runner import forward_backward
    from megarl.models.convert import iter_hf_weights
    from megarl.models.lora import adapters_of, iter_peft_weights

    layout = LAYOUTS[name]
    tp, pp, cp, ep = (layout.get(key, 1) for key in ("tp", "pp", "cp", "ep"))
    args = parse_args(["--model", model_dir, "--lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "1", "--lr", "1e-3",
                       "--padding-free", "--tensor-model-parallel-size", str(tp),
                       "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
                       "--expert-model-parallel-size", str(ep),
                       *(["--sequence-parallel"] if layout.get("sp") else [])], world_size=dist.get_world_size())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)  # as megarl/distributed.py
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tp_rank, tp_group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    hf_config = load_hf_config(model_dir)
    batch = micro_batch(hf_config.vocab_size)
    weights = torch.randn(*batch.tokens.shape, hf_config.vocab_size, generator=torch.Generator().manual_seed(1))

    def loss_fn(part, logits, companion_outputs):
        whole = part.gather(logits)  # [1, L, V/TP]: every CP rank's positions
        width = whole.shape[-1]
        shard = torch.zeros(*whole.shape[:-1], width)
        real = weights[..., tp_rank * width: (tp_rank + 1) * width]
        shard[..., : real.shape[-1]] = real
        loss = (whole * shard).sum()  # the TP ranks' parts sum to the whole loss
        logits = naive._all_gather_last_dim(whole.detach(), tp_group)[..., : hf_config.vocab_size]
        return loss, torch.tensor(1, dtype=torch.int), {"sums": {"loss": loss.detach()}, "logits": logits}

    def actor_with_adapters():
        actor = Actor(args, hf_config)
        with torch.no_grad():  # B as trained adapters have it: drawn whole, sharded as the layer's output rows
            for key, (adapter, module, param) in adapter_entries(actor.model).items():
                if key.endswith(".B"):
                    # a column base's B: on its rows over the base's TP group (a routed expert's: one rank)
                    group = adapter.tp_group
                    split = getattr(param, "tensor_model_parallel", False) and group.size() > 1
                    whole = torch.randn(param.shape[0] * (group.size() if split else 1), param.shape[1],
                                        generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))) * 0.1
                    param.copy_(adapter.rank_rows(module, whole, group.rank(), group.size()) if split else whole)
        return actor

    actor = actor_with_adapters()
    # The syncs' streams (every stage's tensors on every rank, gathered over TP; small buckets: several):
    # the merged weights (--lora-sync merged, --lora-export merged) and the adapters (--lora-sync adapter, the
    # PEFT export), each whole.
    streams = {"merged": iter_hf_weights(actor.model, hf_config, 2**16), "peft": iter_peft_weights(actor.model, 2**16)}
    streams = {kind: {key: tensor.detach().clone() for key, tensor in stream} for kind, stream in streams.items()}
    actor.model.zero_grad_buffer()
    outputs = forward_backward(actor.model, [batch], loss_fn, False, 1)  # DDP's reduction over DP x CP included
    params, entries = adapter_params(actor.model), adapter_entries(actor.model)
    grads = everyone({key: whole_over_tp(entries[key], param.main_grad, tp, tp_group) for key, param in params.items()})
    result = {"logits": outputs[0]["logits"], "grads": grads, **streams}
    if tp > 1 and not layout.get("sp"):  # with dropout, a replicated A must see the same mask (so the same
        # gradient) on every TP rank (under sequence parallelism each rank's tokens take their own masks)
        actor.model.zero_grad_buffer()
        actor.model.train()
        for adapter in adapters_of(actor.model):
            adapter.dropout = 0.5
        forward_backward(actor.model, [batch], loss_fn, False, 1)
        replicated = torch.cat([param.main_grad.flatten() for key, param in params.items()
                                if key.endswith(".A") and not getattr(param, "tensor_model_parallel", False)])
        copies = [torch.empty_like(replicated) for _ in range(tp)]
        dist.all_gather(copies, replicated, group=tp_group)
        result["dropout_replicated_A_rank_difference"] = (copies[1] - copies[0]).abs().max().item()
        result["dropout_replicated_A_max"] = replicated.abs().max().item()
    _use_in_process_results_queue()
    if pp > 1:  # a step, the checkpoint, a step; a fresh actor resumed from it takes the same step
        actor.optimizer_step([batch], loss_fn)
        if dist.get_rank() == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(actor.sharded_state_dict("policy", is_loading=False), str(ckpt))
        schedule = actor.state_dict()
        result["saved"] = whole_state(actor, tp, tp_group)
        before = {key: param.detach().clone() for key, param in params.items()}
        actor.optimizer_step([batch], loss_fn)
        straight = {key: param.detach().clone() for key, param in params.items()}
        resumed = Actor(args, hf_config)
        loaded = dist_checkpointing.load(resumed.sharded_state_dict("policy", is_loading=True), str(ckpt))
        resumed.load_sharded_state_dict(loaded, "policy")
        resumed.load_state_dict(schedule)
        resumed.optimizer_step([batch], loss_fn)
        again = adapter_params(resumed.model)
        exact = torch.tensor(int(again.keys() == straight.keys() and
                                 all(torch.equal(again[key], straight[key]) for key in straight)))
        dist.all_reduce(exact, op=dist.ReduceOp.MIN)
        result["resumed_step_bit_exact"] = bool(exact)
        result["resumed_step_moved"] = max((straight[key] - before[key]).abs().max().item() for key in straight)
    if saved is not None:  # the PP=2 checkpoint on this layout
        other = Actor(args, hf_config)
        loaded = dist_checkpointing.load(other.sharded_state_dict("policy", is_loading=True), str(ckpt))
        other.load_sharded_state_dict(loaded, "policy")
        mine = whole_state(other, tp, tp_group)
        result["pp2_checkpoint_loaded"] = {"keys": mine.keys() == saved.keys(), "count": len(mine),
                                           "bit_exact": all(torch.equal(mine[key], saved[key]) for key in saved)}
    parallel_state.destroy_model_parallel()
    return result


def main():
    from megarl import accelerator
    from megarl.models.families import family_of, load_hf_config

    model_dir, out = sys.argv[1], sys.argv[2]
    ckpt = Path(out).parent / "lora_pp2_checkpoint"
    dist.init_process_group("gloo")
    accelerator.apply_megatron_shims()
    results = {}
    hybrid = family_of(load_hf_config(model_dir)).hybrid_linear_attention
    names = sys.argv[3].split(",") + ["one"] if len(sys.argv) > 3 else TWO_RANKS
    for name in names:
        if LAYOUTS[name].get("cp", 1) > 1 and hybrid:  # Gated DeltaNet layers take no CP (refused in one line)
            continue
        # the one-rank layout loads the (first) PP=2 layout's checkpoint
        saved = next((result.pop("saved") for result in results.values() if "saved" in result), None) \
            if name == "one" else None
        results[name] = run(model_dir, name, ckpt, saved)
    if dist.get_rank() == 0:
        one = results.pop("one")
        report = {"grad_max": {key: grad.abs().max().item() for key, grad in one["grads"].items()},
                  "streamed": {kind: len(one[kind]) for kind in ("merged", "peft")},
                  "pp2_checkpoint_loaded": one.get("pp2_checkpoint_loaded")}
        for name, result in results.items():
            assert result["grads"].keys() == one["grads"].keys(), (name, sorted(result["grads"]), sorted(one["grads"]))
            report[name] = {"logits_ulps": fp32_paths_ulps(result["logits"], one["logits"]),
                            "grad_ulps": {key: fp32_paths_ulps(result["grads"][key], one["grads"][key])
                                          for key in one["grads"]},
                            "merged_ulps": max(fp32_paths_ulps(result["merged"][key], one["merged"][key])
                                               for key in one["merged"]) if result["merged"].keys() == one["merged"].keys()
                            else sorted(result["merged"].keys() ^ one["merged"].keys()),
                            "peft_bit_exact": result["peft"].keys() == one["peft"].keys() and
                            all(torch.equal(result["peft"][key], one["peft"][key]) for key in one["peft"]),
                            **{key: value for key, value in result.items()
                               if key not in ("logits", "grads", "merged", "peft")}}
        Path(out).write_text(json.dumps(report, indent=1))
    # as train.py ends: a hard exit once every rank is done. Interpreter teardown with gloo's and
    # the CPU libraries' threads alive aborted once in CI ("terminate called without an active
    # exception", SIGABRT) after the work was written
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
