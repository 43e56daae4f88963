"""Trainer -> rollout weight sync, after every optimizer step: strategies behind one verb.

    strategy.sync(actor, engine) -> SyncStats

`actor` is this rank's Actor (None on rollout-only ranks), `engine` its
RolloutEngine (None on train-only ranks). Every launched rank calls it; the
strategy decides who does what. `build_weight_sync` picks the strategy the
placement needs from `WEIGHT_SYNC_STRATEGIES`:

  colocated  every rank trains and generates: the train world streams the model
             out of Megatron (`Actor.hf_weights`: TP all-gather per bucket, PP
             broadcast) and each rank loads the stream into its own engine. It
             owns the engine's wake order on GPU: weights, then the load, then
             the KV cache (the KV cache must not take the memory first).
  broadcast  separate ranks: the train ranks stream the model the same way and
             train rank 0 packs it into flat buckets of `--sync-bucket-mb`,
             broadcast over a group of {train rank 0} + rollout ranks (NCCL on
             GPU hosts, gloo on CPU: accelerator.store_group); each rollout rank
             unpacks and streams the tensors into its engine. Rollout engines of
             a separate placement never sleep, so there is nothing to wake.

Nothing about names, shapes or buckets is cached between syncs: the metadata
travels with every bucket. vLLM shards what it receives for its own TP size,
so train TP and rollout TP are independent.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch

from megarl import accelerator, distributed

WEIGHT_SYNC_STRATEGIES = {}


def register_strategy(name: str):
    def wrap(cls):
        WEIGHT_SYNC_STRATEGIES[name] = cls
        return cls
    return wrap


@dataclass
class SyncStats:
    seconds: float = 0.0
    bytes: int = 0


class _Counted:
    """Wrap a (name, tensor) stream, counting bytes as they pass."""

    def __init__(self, stream):
        self.stream, self.bytes = stream, 0

    def __iter__(self):
        for name, tensor in self.stream:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def build_weight_sync(context: distributed.DistContext, bucket_bytes: int):
    """The strategy this placement needs; collective: call on every launched rank."""
    name = "colocated" if context.placement.colocated else "broadcast"
    return WEIGHT_SYNC_STRATEGIES[name](context, bucket_bytes)


@register_strategy("colocated")
class ColocatedSync:
    def __init__(self, context: distributed.DistContext, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def sync(self, actor, engine) -> SyncStats:
        if actor is None:  # a standalone teacher's rank: no policy here
            return SyncStats()
        start = time.perf_counter()
        engine.wake_up(tags=["weights"])
        stream = _Counted(actor.hf_weights(self.bucket_bytes))
        engine.load_weights(iter(stream))
        engine.wake_up(tags=["kv_cache"])
        return SyncStats(time.perf_counter() - start, stream.bytes)


@register_strategy("broadcast")
class BroadcastSync:
    """Separate placement. The group spans train rank 0 (member 0, the sender) and every rollout rank."""

    def __init__(self, context: distributed.DistContext, bucket_bytes: int):
        members = context.placement.weight_sync_members
        self.bucket_bytes = bucket_bytes
        self.group = distributed.new_store_group("weight-sync", context, members, carries_device_tensors=True) \
            if context.rank in members else None
        self.is_sender = context.rank == members[0]
        self.device = accelerator.device()

    def sync(self, actor, engine) -> SyncStats:
        if actor is not None:
            return self._send(actor)
        if self.group is not None:
            return self._receive_into(engine)
        return SyncStats()

    def _send(self, actor) -> SyncStats:
        """Every train rank takes part in the gathers; train rank 0 sends."""
        start, sent = time.perf_counter(), 0
        bucket, size = [], 0
        for name, tensor in actor.hf_weights(self.bucket_bytes):
            if not self.is_sender:
                continue
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                sent += self._send_bucket(bucket)
                bucket, size = [], 0
        if self.is_sender:
            if bucket:
                sent += self._send_bucket(bucket)
            self._send_bucket([])  # end of stream
        return SyncStats(time.perf_counter() - start, sent)

    def _receive_into(self, engine) -> SyncStats:
        start = time.perf_counter()
        stream = _Counted(self._receive_stream())
        engine.load_weights(iter(stream))
        return SyncStats(time.perf_counter() - start, stream.bytes)

    def _send_bucket(self, bucket) -> int:
        meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
        self._broadcast_object(meta)
        if not bucket:
            return 0
        dtype = bucket[0][1].dtype
        flat = torch.cat([t.reshape(-1).to(device=self.device, dtype=dtype) for _, t in bucket])
        self.group.broadcast(flat, 0).wait()
        return flat.numel() * flat.element_size()

    def _receive_stream(self):
        while True:
            meta = self._broadcast_object(None)
            if not meta:
                return
            total = sum(torch.Size(shape).numel() for _, shape, _ in meta)
            flat = torch.empty(total, dtype=meta[0][2], device=self.device)
            self.group.broadcast(flat, 0).wait()
            offset = 0
            for name, shape, dtype in meta:
                numel = torch.Size(shape).numel()
                yield name, flat[offset: offset + numel].view(shape).to(dtype)
                offset += numel

    def _broadcast_object(self, obj):
        """Pickled object from member 0: a length, then the bytes (on the group's device)."""
        if self.is_sender:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.group.broadcast(length, 0).wait()
        if not self.is_sender:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.group.broadcast(payload, 0).wait()
        return obj if self.is_sender else pickle.loads(payload.cpu().numpy().tobytes())
