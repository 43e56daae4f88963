"""Offload/onload: storages released and restored bit for bit; the next update unchanged."""

import pytest
import torch

from helpers import WORKERS, load_script, read_json, torchrun

from megarl.offload import Offloader


def test_offloader_releases_storages_and_restores_them_exactly():
    weight = torch.randn(4, 3)
    view = weight[1:3]  # a view shares the storage: moved once, and still valid after onload
    grads = torch.randn(12)
    state = {"exp_avg": torch.randn(5)}
    expected = (weight.clone(), state["exp_avg"].clone())
    offloader = Offloader(lambda: ([weight, view, state["exp_avg"]], [grads]))
    offloader.offload()
    assert offloader.offloaded and len(offloader.tensors()) == 4
    assert all(t.untyped_storage().nbytes() == 0 for t in offloader.tensors())
    offloader.offload()  # a second offload is a no-op, not a copy of empty storages
    offloader.onload()
    assert not offloader.offloaded
    assert torch.equal(weight, expected[0]) and torch.equal(state["exp_avg"], expected[1])
    assert torch.equal(view, expected[0][1:3])
    assert torch.equal(grads, torch.zeros(12))  # scratch (gradient buffers) come back zeroed
    weight.add_(1.0)  # the tensors are live again
    assert torch.equal(view, expected[0][1:3] + 1.0)


def test_offloader_collects_again_at_each_offload():
    tensors = [torch.ones(3)]
    offloader = Offloader(lambda: (list(tensors), []))
    offloader.offload()
    offloader.onload()
    tensors.append(torch.full((2,), 7.0))  # e.g. optimizer states created by the first step
    offloader.offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    offloader.onload()
    assert torch.equal(tensors[1], torch.full((2,), 7.0))


def test_offloader_keeps_its_host_buffers_across_cycles():
    """The second offload copies into the first one's host buffers (no new allocation per cycle: pinned
    allocations are rounded up to a power of two by torch's caching host allocator), bit for bit each time;
    a storage that changed size gets a new buffer, one no longer collected lets its buffer go."""
    weight, state = torch.randn(4, 3), torch.randn(5)
    grow = [torch.randn(6)]
    offloader = Offloader(lambda: ([weight, state, grow[0]], [torch.zeros(0)]))
    offloader.offload()
    # Held here too, so that a fresh allocation could not land at a freed buffer's address.
    first_buffers = offloader.host_buffers()
    first = [host.data_ptr() for host in first_buffers]
    assert len(first) == 3 and sorted(host.numel() for host in offloader.host_buffers()) == [20, 24, 48]
    offloader.onload()
    weight.mul_(3.0)  # an update between cycles: the next offload must copy the new values
    state.add_(1.0)
    expected = (weight.clone(), state.clone())
    offloader.offload()
    assert [host.data_ptr() for host in offloader.host_buffers()] == first
    offloader.onload()
    assert torch.equal(weight, expected[0]) and torch.equal(state, expected[1])
    grow[0] = torch.randn(10)  # another tensor now: a buffer of its size
    offloader.offload()
    hosts = offloader.host_buffers()
    assert [host.data_ptr() for host in hosts[:2]] == first[:2] and hosts[2].numel() == 40
    assert len(offloader._host) == 3  # the 6-element tensor's buffer was let go
    offloader.onload()
    assert torch.equal(weight, expected[0])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [["--tensor-model-parallel-size", "1"], ["--tensor-model-parallel-size", "2"],
                                      # DP=2: each rank holds its shard of Adam's states and of the fp32 main copies
                                      ["--use-distributed-optimizer", "--bf16"]],
                         ids=["tp1", "tp2", "distributed-optimizer-bf16"])
def test_actor_and_critic_round_trip_on_megatron_ranks(parallel, tiny_model, tmp_path):
    out = tmp_path / "offload"
    torchrun("offload_worker.py", out, "--model", tiny_model, "--offload-model", "--offload-optimizer",
             "--advantage-estimator", "gae", "--micro-batch-size", "2", "--lr", "1e-3", "--critic-lr", "1e-3",
             *parallel, timeout=600)
    report = read_json(f"{out}.json")
    problems = load_script(WORKERS / "offload_worker.py").problems(report, on_cuda=False)
    assert not problems, problems
    assert all(report[role]["offloaded"]["host_buffers"] > 0 for role in ("actor", "critic"))
