"""Offload and onload: a role's tensors leave the device while another role uses it.

Colocated roles take turns on the same devices. While vLLM generates, the
trainer's parameters, gradient buffers and optimizer states can go to host
memory (`--offload-model`, `--offload-optimizer`), and the frozen reference
model always waits there between its forwards.

Bookkeeping, the same on CPU and GPU: each distinct storage behind the role's
tensors gets a host copy (pinned on GPU, `accelerator.host_buffer`), then the
storage is resized to 0 bytes. The host buffers are allocated at the first
offload and kept: every later offload of the same storage copies into the same
buffer, so a rank's host memory stays at one copy of what it offloads, pinned at
exactly its size (`accelerator.host_buffer` registers plain host memory; torch's
pinned allocator would round each size up to a power of two), and pinning is paid
once, not per cycle. The copies are issued
non-blocking and waited for once per offload/onload (`accelerator.synchronize`).
Resizing frees the device memory while every tensor object
and view stays valid (Megatron's `param.main_grad` views into the DDP gradient
buffer, the optimizer's references to its parameters), so nothing needs
rebinding. Onload resizes each storage back and copies the bytes in:
parameters and optimizer states come back bit-identical. verl offloads its
Megatron workers the same way.

Gradient buffers hold nothing between steps (every update starts by zeroing
them), so they are released without a host copy and come back as zeros.

On CPU ranks the "device" is host memory too, so the move saves nothing there;
it runs anyway, so the bookkeeping is exercised by the tests on these machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl import accelerator


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: restored as zeros (gradient buffers)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (tensor copies can be non-blocking; storage copies cannot)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Offloader:
    """Moves a role's tensors off the device and back.

    `collect()` returns (keep, scratch): `keep` tensors are copied to host, `scratch`
    tensors (gradient buffers) are released and come back zeroed. It is called at each
    offload, since some tensors appear later (Adam's states exist after the first step).
    """

    def __init__(self, collect):
        self.collect = collect
        self._held: list[_Held] = []
        self._tensors: list[torch.Tensor] = []
        # Host copies kept across cycles, by storage (its StorageImpl's address, stable while it lives; resize_
        # keeps it). Should a freed storage's address come back for a new one of the same size, the buffer
        # serves it just as well: a host buffer is only scratch for whichever storage it holds this cycle.
        self._host: dict[int, torch.Tensor] = {}

    def host_buffers(self) -> list[torch.Tensor]:
        """The host copies of the last offload's kept storages, in the order they were copied."""
        return [held.host for held in self._held if held.host is not None]

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def tensors(self) -> list[torch.Tensor]:
        """What the last offload moved."""
        return list(self._tensors)

    def offload(self) -> None:
        if self._held:
            return
        keep, scratch = self.collect()
        self._tensors = list(keep) + list(scratch)
        seen, kept_hosts = set(), {}
        for tensors, copy in ((keep, True), (scratch, False)):
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage._cdata in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage._cdata)
                host = None
                if copy:
                    host = self._host.get(storage._cdata)
                    if host is None or host.numel() != storage.nbytes():  # new, or resized since
                        host = accelerator.host_buffer(storage.nbytes())
                    kept_hosts[storage._cdata] = host
                    host.copy_(_bytes_of(storage), non_blocking=True)
                self._held.append(_Held(storage, storage.nbytes(), host))
        self._host = kept_hosts  # storages no longer collected let their host copies go
        accelerator.synchronize()  # the host copies are complete before the device memory goes
        for held in self._held:
            held.storage.resize_(0)
        accelerator.release_cached_memory()

    def onload(self) -> None:
        for held in self._held:
            held.storage.resize_(held.nbytes)
            if held.host is None:
                _bytes_of(held.storage).zero_()
            else:
                _bytes_of(held.storage).copy_(held.host, non_blocking=True)
        # Before the next offload copies into the same host buffers, and before another stream reads the tensors.
        accelerator.synchronize()
        self._held = []


def model_tensors(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, gradient buffers) of a Megatron DDP-wrapped or plain module."""
    params = list(model.parameters())
    grads = []
    # Megatron DDP's gradient buffers (on a plain module `buffers` is nn.Module's method).
    ddp_buffers = getattr(model, "buffers", None)
    ddp_buffers = list(ddp_buffers) + list(model.expert_parallel_buffers) if isinstance(ddp_buffers, list) else []
    for buffer in ddp_buffers:
        grads.append(buffer.grad_data)
        if buffer.param_data is not None:  # distributed optimizer: parameters are views of it
            params.append(buffer.param_data)
    return params, grads


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """A Megatron optimizer's states (Adam moments, steps) and fp32 main copies of low-precision
    parameters; not the model's own parameters."""
    tensors = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
        # fp32 main copies: all of them (mixed-precision optimizer), or this rank's shards of them
        # (distributed optimizer; its shards of fp32 parameters are views of the model's own buffer)
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(part, name, []):
                tensors += [tensor for tensor in group if tensor is not None]
    return tensors
