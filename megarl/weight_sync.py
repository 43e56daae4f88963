"""Trainer -> rollout weight sync, after every optimizer step.

Two strategies, chosen by placement:

  colocated  every rank trains and generates: the train world streams the model
             out of Megatron (`iter_hf_weights`: TP all-gather per bucket, PP
             broadcast) and each rank loads the stream into its own engine.
  broadcast  separate ranks: the train ranks stream the model the same way and
             train rank 0 packs it into flat buckets of `--sync-bucket-mb`,
             broadcast over a group of {train rank 0} + rollout ranks; each
             rollout rank unpacks and streams the tensors into its engine.

Nothing about names, shapes or buckets is cached between syncs: the metadata
travels with every bucket. vLLM shards what it receives for its own TP size,
so train TP and rollout TP are independent.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch

from megarl.models.convert import iter_hf_weights


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


class ColocatedSync:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def sync(self, model, hf_config, engine) -> SyncStats:
        start = time.perf_counter()
        stream = _Counted(iter_hf_weights(model, hf_config, self.bucket_bytes))
        engine.load_weights(iter(stream))
        return SyncStats(time.perf_counter() - start, stream.bytes)


class BroadcastSync:
    """Separate placement. `group` spans train rank 0 (member 0) and every rollout rank."""

    def __init__(self, bucket_bytes: int, group, is_sender: bool):
        self.bucket_bytes = bucket_bytes
        self.group = group
        self.is_sender = is_sender

    def send(self, model, hf_config) -> SyncStats:
        """Called on every train rank (they all take part in the gathers); rank 0 sends."""
        start, sent = time.perf_counter(), 0
        bucket, size = [], 0
        for name, tensor in iter_hf_weights(model, hf_config, self.bucket_bytes):
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

    def receive_into(self, engine) -> SyncStats:
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
        flat = torch.cat([t.reshape(-1).to(dtype) for _, t in bucket])
        self.group.broadcast(flat, 0).wait()
        return flat.numel() * flat.element_size()

    def _receive_stream(self):
        while True:
            meta = self._broadcast_object(None)
            if not meta:
                return
            total = sum(torch.Size(shape).numel() for _, shape, _ in meta)
            flat = torch.empty(total, dtype=meta[0][2])
            self.group.broadcast(flat, 0).wait()
            offset = 0
            for name, shape, dtype in meta:
                numel = torch.Size(shape).numel()
                yield name, flat[offset: offset + numel].view(shape).to(dtype)
                offset += numel

    def _broadcast_object(self, obj):
        """Pickled object from member 0: a length, then the bytes."""
        if self.is_sender:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(length, 0).wait()
        if not self.is_sender:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.group.broadcast(payload, 0).wait()
        return obj if self.is_sender else pickle.loads(payload.numpy().tobytes())
