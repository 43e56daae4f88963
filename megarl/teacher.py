"""Teacher role, colocated: a frozen Megatron GPTModel on the train ranks for distillation (GKD).

Built from --teacher-model with the trainer's TP (the teacher may be larger than
the student; it must share the student's vocabulary, checked at start), loaded
by the same HF -> Megatron conversion as the policy, kept in host memory between
its forwards with --offload-teacher-model, not checkpointed (rebuilt from its
checkpoint).

Verbs: `topk` (the teacher's top-K token ids and logprobs per response
position, at --gkd-temperature, taken over the vocabulary shards without
gathering the vocabulary on a rank) for top-k distillation, computed once per
step before the update; `logits` (this rank's vocabulary shard) for
full-vocabulary distillation, run beside each student micro-batch so that only
one micro-batch of teacher logits exists at a time.
"""

from __future__ import annotations

import torch

from megarl import vocab_parallel
from megarl.model_runner import FrozenModel, MicroBatch, response_aligned


class Teacher(FrozenModel):
    def __init__(self, args):
        from transformers import AutoConfig

        super().__init__(args, AutoConfig.from_pretrained(args.teacher_model), args.teacher_model,
                         offload=args.offload_teacher_model)

    def topk(self, micro_batches: list[MicroBatch], width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-aligned (ids [n, width, k] long, logprobs [n, width, k]) of the teacher's top-k
        next tokens at each position that scores a response token."""
        def topk_of(batch, logits, _):
            return vocab_parallel.topk_logprobs(logits, k, self.hf_config.vocab_size, self.args.gkd_temperature)

        outputs = self.forward_only(micro_batches, topk_of)
        return (response_aligned(micro_batches, [ids for ids, _ in outputs], width),
                response_aligned(micro_batches, [logprobs for _, logprobs in outputs], width))
