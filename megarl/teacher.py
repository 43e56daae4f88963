"""Teacher role, colocated: a frozen Megatron GPTModel on the train ranks for distillation (GKD).

Built from --teacher-model with the trainer's TP (the teacher may be larger than
the student; it must share the student's vocabulary, checked at start), loaded
by the same HF -> Megatron conversion as the policy, kept in host memory between
its forwards with --offload-teacher-model, not checkpointed (rebuilt from its
checkpoint).

Verbs: `score` (the sampled tokens' logprobs and, for top-k distillation, the
teacher's top-K token ids and logprobs per response position at
--gkd-temperature, taken over the vocabulary shards without gathering the
vocabulary on a rank), computed once per step before the update; `logits` (this rank's vocabulary shard) for
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

    def score(self, micro_batches: list[MicroBatch], width: int, k: int) -> dict[str, torch.Tensor]:
        """One teacher forward over the student's sequences, response-aligned: `teacher_logprobs`
        [n, width], the sampled tokens' logprobs at the sampling --temperature (the teacher-student
        KL and the policy-gradient form of distillation); with k > 0 also `teacher_topk_ids`
        [n, width, k] (long) and `teacher_topk_logprobs` [n, width, k], the teacher's top-k next
        tokens at --gkd-temperature."""
        args, vocab_size = self.args, self.hf_config.vocab_size

        def score_of(batch, logits, _):
            sampled = vocab_parallel.logprobs(logits, batch.labels, vocab_size, args.temperature)
            return (sampled,) + (vocab_parallel.topk_logprobs(logits, k, vocab_size, args.gkd_temperature) if k else ())

        outputs = self.forward_only(micro_batches, score_of)
        names = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")[: len(outputs[0])]
        return {name: response_aligned(micro_batches, [output[i] for output in outputs], width)
                for i, name in enumerate(names)}
