"""Reference role: the frozen policy a KL term measures against (built only when --kl-coef > 0).

A Megatron GPTModel on the train ranks with the trainer's TP, loaded from
--ref-model, without DDP or optimizer. It waits in host memory between its
forwards (megarl/offload.py) and is not checkpointed: it is rebuilt exactly from
--ref-model.
"""

from __future__ import annotations

import contextlib

import torch

from megarl import vocab_parallel
from megarl.model_runner import MicroBatch, forward_backward, keep_output, response_aligned
from megarl.models.convert import load_hf_weights
from megarl.models.megatron_gpt import DTYPES, build_gpt_model
from megarl.offload import Offloader, model_tensors


class Reference:
    def __init__(self, args, hf_config):
        self.args, self.hf_config = args, hf_config
        self.model = build_gpt_model(hf_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by)
        load_hf_weights(self.model, args.ref_model, hf_config)
        self.model.requires_grad_(False).eval()
        self.offloader = Offloader(lambda: model_tensors(self.model))
        self.offload()

    def offload(self) -> None:
        self.offloader.offload()

    def onload(self) -> None:
        self.offloader.onload()

    @contextlib.contextmanager
    def resident(self):
        """On the device for the duration, back in host memory after."""
        self.onload()
        try:
            yield self
        finally:
            self.offload()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocabulary shard of the logits (call while resident)."""
        return self.model(tokens, positions, attention_mask=None)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """Response-aligned [n, width] logprobs of the sampled tokens under the reference."""
        def logprobs_of(batch, logits):
            return vocab_parallel.logprobs(logits, batch.labels, self.hf_config.vocab_size, self.args.temperature)

        with self.resident():
            outputs = forward_backward(self.model, micro_batches, keep_output(logprobs_of), True,
                                       self.args.micro_batch_size)
        return response_aligned(micro_batches, [o["kept"] for o in outputs], width)
