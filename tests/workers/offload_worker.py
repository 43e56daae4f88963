"""torchrun worker: offload/onload round trip of the actor and the critic on real Megatron ranks.

For each role, two fresh copies from the same checkpoint take the same two
optimizer steps on the same fixed batch; the second copy is offloaded and
onloaded between them. Rank 0 writes <out>.json: whether every offloaded
storage was released, whether parameters and optimizer states came back
bit-identical, and both copies' per-step metrics.
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.batch import score_and_filter  # noqa: E402
from megarl.model_runner import make_micro_batches  # noqa: E402
from megarl.offload import optimizer_tensors  # noqa: E402
from megarl.samples import Sample  # noqa: E402


def fixed_batch(vocab_size: int, count: int = 8):
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(count):
        prompt = torch.randint(3, vocab_size, (5 + i % 3,), generator=generator).tolist()
        response = torch.randint(3, vocab_size, (2 + i % 4,), generator=generator).tolist()
        samples.append(Sample(i // 2, prompt, response, "", [-1.0] * len(response), False, reward=float(i % 2)))
    batch, _ = score_and_filter(samples, max_new_tokens=8)
    batch.old_logprobs = batch.rollout_logprobs - 0.05 * batch.response_mask
    batch.advantages = (batch.scores - 0.5)[:, None] * batch.response_mask
    batch.returns = batch.scores[:, None] * batch.response_mask
    batch.old_values = torch.zeros_like(batch.returns)
    return batch


def snapshot(role) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(role.model.parameters()) + optimizer_tensors(role.optimizer)]


def round_trip(make_role, micro_batches, offload: bool) -> dict:
    role = make_role()
    report = {"steps": [role.train_step(micro_batches)]}
    if offload:
        before = snapshot(role)
        allocated = _device_bytes()
        role.offload()
        moved = [t for offloader in role.offloaders for t in offloader.tensors()]
        report["offloaded_tensors"] = len(moved)
        report["all_released"] = all(t.untyped_storage().nbytes() == 0 for t in moved)
        report["device_bytes_released"] = allocated - _device_bytes()
        hosts = [host for offloader in role.offloaders for host in offloader.host_buffers()]
        report["host_buffers"] = len(hosts)
        report["host_pinned"] = bool(hosts) and all(host.is_pinned() for host in hosts)
        role.onload()
        after = snapshot(role)
        report["bit_identical"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    report["steps"].append(role.train_step(micro_batches))
    return report


def _device_bytes() -> int:
    """Bytes the CUDA caching allocator has handed out on this rank's device (0 on CPU ranks)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def problems(report: dict, on_cuda: bool) -> list[str]:
    """What is wrong with main()'s report (empty: the round trip is exact); tests/test_offload.py and the
    GPU lane (tests/gpu/lane.py, `on_cuda`: the host copies must also be pinned and the device memory
    handed back) judge it here."""
    found = []
    for role in ("actor", "critic"):
        plain, offloaded = report[role]["plain"], report[role]["offloaded"]
        if not (offloaded["offloaded_tensors"] > 0 and offloaded["all_released"]):
            found.append(f"{role}: storages not released ({offloaded})")
        if not offloaded["bit_identical"]:
            found.append(f"{role}: parameters or optimizer states changed over the round trip")
        # The update after an offload round trip is the update without one.
        if offloaded["steps"] != plain["steps"]:
            found.append(f"{role}: the steps after the round trip differ: {offloaded['steps']} vs {plain['steps']}")
        loss_key = "loss" if role == "actor" else "value_loss"
        if plain["steps"][1][loss_key] == plain["steps"][0][loss_key]:
            found.append(f"{role}: the first step did not move the model ({loss_key} unchanged)")
        if on_cuda and not offloaded["host_pinned"]:
            found.append(f"{role}: host copies not pinned ({offloaded['host_buffers']} buffers)")
        if on_cuda and not offloaded["device_bytes_released"] > 0:
            found.append(f"{role}: no device memory handed back ({offloaded['device_bytes_released']} bytes)")
    return found


def write_report(path: str, report: dict) -> None:
    """Rank 0 writes the report; every rank waits for it."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(report, f)
    dist.barrier()


def train_ranks(argv: list[str], count: int = 8):
    """(args, context, hf_config, the fixed batch of `count` samples, this rank's data-parallel share of it)
    on train ranks started from the command line `argv`, Megatron's parallel state built."""
    from megarl.models.families import load_hf_config

    args = parse_args(argv)
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)
    hf_config = load_hf_config(args.model)
    batch = fixed_batch(hf_config.vocab_size, count)
    share = len(batch) // context.placement.dp
    return args, context, hf_config, batch, torch.arange(share) + context.placement.data_parallel_rank(
        context.rank) * share


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    args, context, hf_config, batch, share = train_ranks(argv)
    from megarl.actor import Actor
    from megarl.critic import Critic

    mine = batch.select(share)
    micro_batches = make_micro_batches(mine, args.micro_batch_size, 0)
    report = {}
    for name, make_role in (("actor", lambda: Actor(args, hf_config)), ("critic", lambda: Critic(args, hf_config))):
        report[name] = {"plain": round_trip(make_role, micro_batches, offload=False),
                        "offloaded": round_trip(make_role, micro_batches, offload=True)}
    write_report(f"{out}.json", report)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
