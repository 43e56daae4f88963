"""Trainer -> rollout weight sync, after every optimizer step: strategies behind one verb.

    strategy.sync(actor, engine) -> SyncStats

`actor` is this rank's Actor (None on rollout-only ranks), `engine` its
RolloutEngine (None on train-only ranks). Every launched rank calls it; the
strategy decides who does what. `build_weight_sync` picks the strategy the
placement needs from `WEIGHT_SYNC_STRATEGIES`:

  colocated  every rank trains and generates: the train world streams the model
             out of Megatron (`Actor.hf_weights`: TP all-gather per bucket, PP
             broadcast) and each rank loads the stream into its own engine. On
             GPU only the engine's weights wake for it (`load_weights`): the
             trainer's parameters and optimizer are still on the device, and the
             KV cache wakes when the rollout's turn starts, after they have left
             (`Run.rollout_turn`).
  broadcast  separate ranks: the train ranks stream the model the same way and
             train rank 0 packs it into flat buckets of `--sync-bucket-mb`,
             broadcast over a group of {train rank 0} + rollout ranks (NCCL on
             GPU hosts, gloo on CPU: accelerator.store_group, which names it
             "megarl/weight-sync" and warms it up when the strategy is built, so
             NCCL's communicator is not created inside the first sync), packing the next
             bucket while one is on the wire; each rollout rank streams views
             of the received buckets into its engine. Rollout engines of
             a separate placement never sleep, so there is nothing to wake.

What streams is `Actor.hf_weights`: the whole model (with LoRA its merged weights), or with
--lora-sync adapter only the LoRA adapters, which the engine serves with vLLM's LoRA
(megarl/models/lora.py); the strategies move either alike.

The broadcast strategy keeps its bucket plan (names, shapes, dtypes, offsets)
and two flat buffers from the first sync on; the metadata travels once. vLLM shards what it receives for its own TP size,
so train TP and rollout TP are independent.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch

from megarl import accelerator, distributed
from megarl.registry import Registry, register

WEIGHT_SYNC_STRATEGIES = Registry("weight-sync strategy")


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


@register(WEIGHT_SYNC_STRATEGIES, "colocated")
class ColocatedSync:
    def __init__(self, context: distributed.DistContext, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def sync(self, actor, engine) -> SyncStats:
        if actor is None:  # a standalone teacher's rank: no policy here
            return SyncStats()
        start = time.perf_counter()
        stream = _Counted(actor.hf_weights(self.bucket_bytes))
        engine.load_weights(iter(stream))  # wakes the engine's weights, not its KV cache
        return SyncStats(time.perf_counter() - start, stream.bytes)


@register(WEIGHT_SYNC_STRATEGIES, "broadcast")
class BroadcastSync:
    """Separate placement. The group spans train rank 0 (member 0, the sender) and every rollout rank.

    The first sync sends each bucket's metadata (names, shapes, dtypes, byte
    offsets) before its bytes; every member keeps that plan, and later syncs send
    the bytes alone (the sender checks that the stream still matches the plan).
    Two flat byte buffers of the largest bucket, allocated once, alternate: the
    sender packs the next bucket while the previous one is on the wire, and a
    receiver loads one bucket while the next arrives.
    """

    ALIGN = distributed.TENSOR_ALIGN  # byte offset of every tensor in a bucket: any dtype can view it

    def __init__(self, context: distributed.DistContext, bucket_bytes: int):
        members = context.placement.weight_sync_members
        self.bucket_bytes = bucket_bytes
        self.group = distributed.new_store_group("weight-sync", context, members, carries_device_tensors=True) \
            if context.rank in members else None
        self.is_sender = context.rank == members[0]
        self.device = accelerator.device()
        self.plan = None  # [[(name, shape, dtype, byte offset), ...] per bucket], fixed after the first sync
        self.buffers = []

    def sync(self, actor, engine) -> SyncStats:
        if actor is not None:
            return self._send(actor)
        if self.group is not None:
            return self._receive_into(engine)
        return SyncStats()

    # ----------------------------------------------------------- sender ---

    def _send(self, actor) -> SyncStats:
        """Every train rank takes part in the gathers; train rank 0 sends."""
        start, sent = time.perf_counter(), 0
        stream = actor.hf_weights(self.bucket_bytes)
        if not self.is_sender:
            for _ in stream:
                pass
            return SyncStats(time.perf_counter() - start, 0)
        first = self.plan is None
        buckets = self._plan_buckets(stream) if first else self._follow_plan(stream)
        pending = None
        for index, (meta, tensors) in enumerate(buckets):
            if first:
                self._broadcast_object(meta)
            size = distributed.layout_nbytes(meta)
            buffer = self._buffer(index % 2, size)
            if pending is not None and pending[0] is buffer:
                pending[1].wait()  # the buffer is still on the wire from two buckets ago
            for (_, shape, dtype, offset), tensor in zip(meta, tensors):
                distributed.byte_view(buffer, shape, dtype, offset).copy_(tensor)
            work = self.group.broadcast(buffer[:size], 0)
            if pending is not None and pending[0] is not buffer:
                pending[1].wait()
            pending = (buffer, work)
            sent += size
        if pending is not None:
            pending[1].wait()
        if first:
            self._broadcast_object([])  # end of stream
        return SyncStats(time.perf_counter() - start, sent)

    def _plan_buckets(self, stream):
        """First sync: cut the stream into buckets of about bucket_bytes, recording the plan."""
        self.plan = []
        meta, tensors, size = [], [], 0
        for name, tensor in stream:
            offset = distributed.align(size, self.ALIGN)
            meta.append((name, tuple(tensor.shape), tensor.dtype, offset))
            tensors.append(tensor)
            size = offset + tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                self.plan.append(meta)
                yield meta, tensors
                meta, tensors, size = [], [], 0
        if meta:
            self.plan.append(meta)
            yield meta, tensors

    def _follow_plan(self, stream):
        """Later syncs: the same buckets; the stream must still match the plan."""
        stream = iter(stream)
        for meta in self.plan:
            tensors = []
            for name, shape, dtype, _ in meta:
                got_name, tensor = next(stream, (None, None))
                if got_name != name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                    raise RuntimeError(f"weight sync: the stream changed since the first sync: expected {name} "
                                       f"{shape} {dtype}, got {got_name} "
                                       f"{None if tensor is None else (tuple(tensor.shape), tensor.dtype)}")
                tensors.append(tensor)
            yield meta, tensors
        if next(stream, None) is not None:
            raise RuntimeError("weight sync: the stream has more tensors than at the first sync")

    # --------------------------------------------------------- receiver ---

    def _receive_into(self, engine) -> SyncStats:
        start = time.perf_counter()
        stream = _Counted(self._receive_stream())
        engine.load_weights(iter(stream))
        return SyncStats(time.perf_counter() - start, stream.bytes)

    def _receive_stream(self):
        """Yield (name, view of the bucket buffer); the next bucket arrives while this one is consumed."""
        if self.plan is None:  # first sync: the plan arrives bucket by bucket
            self.plan = []
            while True:
                meta = self._broadcast_object(None)
                if not meta:
                    break
                self.plan.append(meta)
                buffer = self._receive_bucket(0, meta).wait_for()
                yield from _unpack(buffer, meta)
            return
        incoming = self._receive_bucket(0, self.plan[0]) if self.plan else None
        for index, meta in enumerate(self.plan):
            buffer = incoming.wait_for()
            incoming = self._receive_bucket((index + 1) % 2, self.plan[index + 1]) \
                if index + 1 < len(self.plan) else None
            yield from _unpack(buffer, meta)

    def _receive_bucket(self, slot: int, meta) -> "_Incoming":
        size = distributed.layout_nbytes(meta)
        buffer = self._buffer(slot, size)[:size]
        return _Incoming(buffer, self.group.broadcast(buffer, 0))

    # ----------------------------------------------------------- shared ---

    def _buffer(self, slot: int, size: int) -> torch.Tensor:
        """Flat byte buffer `slot` (0 or 1), at least `size` bytes, kept across syncs."""
        while len(self.buffers) <= slot:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self.buffers[slot].numel() < size:
            self.buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.buffers[slot]

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


@dataclass
class _Incoming:
    buffer: torch.Tensor
    work: object

    def wait_for(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


def _unpack(buffer: torch.Tensor, meta):
    for name, shape, dtype, offset in meta:
        yield name, distributed.byte_view(buffer, shape, dtype, offset)
