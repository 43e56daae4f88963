"""Reference role: the frozen policy a KL term measures against (built only when --kl-coef > 0).

A Megatron GPTModel on the train ranks with the trainer's TP, loaded from
--ref-model, without DDP or optimizer. It waits in host memory between its
forwards (megarl/offload.py) and is not checkpointed: it is rebuilt exactly from
--ref-model.
"""

from __future__ import annotations

import torch

from megarl.model_runner import FrozenModel, MicroBatch


class Reference(FrozenModel):
    def __init__(self, args, hf_config):
        super().__init__(args, hf_config, args.ref_model, offload=True)

    def logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """Response-aligned [n, width] logprobs of the sampled tokens under the reference."""
        return self.sampled_logprobs(micro_batches, width)
