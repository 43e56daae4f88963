"""Teacher role for distillation (GKD, OPSD), in either placement.

`Teacher`, colocated: a frozen Megatron GPTModel on the train ranks, built from
--teacher-model with the trainer's TP (it may be larger than the student; it must
share the student's vocabulary, checked at start), loaded by the same HF ->
Megatron conversion as the policy, kept in host memory between its forwards with
--offload-teacher-model, not checkpointed (rebuilt from its checkpoint). Verbs:
`score` (the sampled tokens' logprobs and, for top-k distillation, the teacher's
top-K token ids and logprobs per response position at --gkd-temperature, taken
over the vocabulary shards without gathering the vocabulary on a rank), once per
step before the update; `companion_logits` (this rank's vocabulary shard) for
full-vocabulary distillation, beside each student micro-batch so that only one
micro-batch of teacher logits exists at a time.

`TeacherEngine`, standalone: a vLLM engine on the teacher ranks (the `teacher:`
group), with `score_samples` from vLLM's prompt logprobs and `generate` for --seq-kd. Its alignment
of those logprobs to the responses (`response_topk`) also serves a teacher behind a vLLM server
(megarl/teacher_server.py, --teacher-server).

OPSD rows (a teacher prompt) are scored after that prompt; every output is
response-aligned, so it lines up with the student's response token by token.

--self-distill (OPSD's fixed teacher): the teacher is the initial policy. With LoRA it is the
policy's own model with its adapters off (`PolicyBaseTeacher`, ms-swift's disable_adapter teacher);
otherwise a `Teacher` read from --model, which is also the reference when a KL term needs one
(the same frozen weights: one copy, `build_teacher`).
"""

from __future__ import annotations

import torch

from megarl import accelerator, kernels
from megarl.model_runner import FrozenModel, MicroBatch, last_stage_outputs, output_weight, response_aligned
from megarl.rollout import VllmEngine


class Teacher(FrozenModel):
    def __init__(self, args):
        from megarl.models.families import load_hf_config

        super().__init__(args, load_hf_config(args.teacher_model), args.teacher_model,
                         offload=args.offload_teacher_model)

    def score(self, micro_batches: list[MicroBatch], width: int, k: int) -> dict[str, torch.Tensor]:
        """One teacher forward over the student's sequences, response-aligned: `teacher_logprobs`
        [n, width], the sampled tokens' logprobs at the sampling --temperature (the teacher-student
        KL and the policy-gradient form of distillation); with k > 0 also `teacher_topk_ids`
        [n, width, k] (long) and `teacher_topk_logprobs` [n, width, k], the teacher's top-k next
        tokens at --gkd-temperature."""
        args, vocab_size = self.args, self.hf_config.vocab_size
        # As the student's logprobs: through the fused kernels from the final hidden states, the output
        # layer's logits formed one chunk of tokens at a time (never [tokens, V/TP] in fp32); --kernels
        # naive from the full logits.
        from_hidden = args.kernels != "naive"

        def score_of(batch, output, _):
            weight = output_weight(self.model) if from_hidden else None
            sampled = kernels.token_logprobs(output, batch.labels, vocab_size, args.temperature, args.kernels,
                                             weight_shard=weight)
            return (sampled,) + (kernels.select_topk(output, k, vocab_size, args.gkd_temperature, args.kernels,
                                                     weight_shard=weight) if k else ())

        # OPSD rows are run after their teacher prompt; response-aligned, they line up with the student's.
        views = [batch.teacher_view or batch for batch in micro_batches]
        outputs = self.forward_only(views, score_of, hidden=from_hidden)
        names = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")[: len(outputs[0])]
        return {name: response_aligned(views, [output[i] for output in outputs], width)
                for i, name in enumerate(names)}

    def logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """The reference's verb (--self-distill with a KL term: the initial policy is both)."""
        return self.sampled_logprobs(micro_batches, width)

    def companion_logits(self, batch: MicroBatch) -> torch.Tensor:
        """This rank's vocabulary shard of the teacher's logits, laid out like the student's micro-batch
        (its context-parallel part: full-vocabulary distillation). OPSD rows are run after their teacher
        prompt and their response positions moved to the student's (`_student_layout`)."""
        view = batch.whole.teacher_view
        if view is None:
            return self.logits(batch)
        part = view.context_parallel_part()
        return _student_layout(batch, part, self.logits(part))

    @torch.no_grad()
    def pipelined_companion_logits(self, micro_batches: list[MicroBatch]) -> list:
        """With pipeline stages: each micro-batch's `companion_logits` on the last stage, from the teacher's
        own forward-only schedule over the micro-batches (their teacher views for OPSD rows)."""
        def transform(i, part, logits):
            batch = micro_batches[i]
            return logits if batch.teacher_view is None else \
                _student_layout(batch.context_parallel_part(), part, logits)

        return last_stage_outputs(self.model, [b.teacher_view or b for b in micro_batches],
                                  self.args.micro_batch_size, transform)


class PolicyBaseTeacher(Teacher):
    """--self-distill with LoRA: the policy's base weights are frozen and are the initial policy, so the
    teacher is the actor's model with its adapters off (no second copy; on the device whenever the actor
    is). Every verb is the Teacher's, run under `adapters_disabled`."""

    def __init__(self, actor):  # noqa: super().__init__ would load a second copy: the point is not to
        self.actor, self.args, self.hf_config, self.model, self.offloader = \
            actor, actor.args, actor.hf_config, actor.model, None

    def forward_only(self, micro_batches: list[MicroBatch], transform, hidden: bool = False) -> list[torch.Tensor]:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            return self.actor.forward_only(micro_batches, transform, hidden=hidden)

    def logits(self, batch: MicroBatch) -> torch.Tensor:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            return super().logits(batch)

    def pipelined_companion_logits(self, micro_batches: list[MicroBatch]) -> list:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            return super().pipelined_companion_logits(micro_batches)


def build_teacher(args, actor, reference):
    """The colocated teacher of a train rank (--teacher-model, or --self-distill's initial policy) and the
    reference: a teacher that is the initial policy is the LoRA policy's base, or shares its weights
    with the reference (both the same frozen checkpoint)."""
    initial_policy = args.teacher_model == args.model  # --self-distill, or a teacher_model naming --model
    if initial_policy and args.lora_rank:
        return PolicyBaseTeacher(actor), reference
    from megarl.reference import Reference

    teacher = Teacher(args)
    # The reference replaying the policy's routes would not be the teacher (it routes its own tokens).
    if initial_policy and isinstance(reference, Reference) and args.ref_model == args.model \
            and args.routing_replay != "on":
        reference = teacher
    return teacher, reference


def _student_layout(batch: MicroBatch, view_part: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
    """The teacher's logits of an OPSD view's part laid out as the student micro-batch's part: each response
    position moved to the student's, other positions 0 (outside the loss). With context parallelism the
    two sequences' chunks do not line up (their prompts differ), so the view's logits are gathered over
    the CP ranks first and this rank takes its own positions of the student's layout."""
    view, whole = view_part.whole, batch.whole
    logits = view_part.gather(logits)
    aligned = logits.new_zeros(*whole.tokens.shape, logits.shape[-1])
    for sample in range(len(whole.spans)):
        row, columns = whole.response_positions(sample)
        aligned[row, columns] = logits[view.response_positions(sample)]
    return batch.own_positions(aligned)


class TeacherEngine(VllmEngine):
    """Standalone teacher: one vLLM engine of the teacher ranks (own world, own TP), serving
    teacher.model. `score_samples` gives, per response position of each sample, the teacher's top-K ids
    and logprobs from vLLM's `prompt_logprobs=K` over prompt + response (the teacher prompt for
    OPSD rows), and the sampled token's logprob; `generate` (the base class's) serves --seq-kd.

    vLLM computes prompt logprobs from the raw logits (T = 1; its sampling processors do
    not apply to prompt tokens): for --gkd-temperature T != 1 the top-k logprobs are
    rescaled by 1/T and renormalised over the K ids, which is exact for the renormalised
    top-k support (arguments.py refuses the tail bin then); the sampled tokens' logprobs
    are returned only at --temperature 1.
    """

    def __init__(self, args, engines, rank: int):
        super().__init__(args, engines, rank, args.standalone_teacher_model, args.seed + 7_919,
                         args.max_prompt_length + args.max_new_tokens + 1,
                         {**accelerator.vllm_engine_kwargs(args.teacher_kv_cache_gb,
                                                           args.teacher_gpu_memory_utilization, sleep_mode=False),
                          **args.teacher_engine_kwargs})

    def score_samples(self, samples, width: int, k: int) -> dict[str, torch.Tensor]:
        """Response-aligned `teacher_topk_ids` [n, width, k] (long), `teacher_topk_logprobs` [n, width, k]
        (at --gkd-temperature) and, at --temperature 1, `teacher_logprobs` [n, width] of `samples`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sequences = [(s.teacher_prompt_ids or s.prompt_ids) + s.response_ids for s in samples]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences],
                                    [params] * len(sequences), use_tqdm=False)
        # Entry t of prompt_logprobs is the distribution of token t given the tokens before it.
        positions = [[{token: (entry.logprob, entry.rank) for token, entry in candidates.items()}
                      for candidates in output.prompt_logprobs[len(sequence) - len(sample.response_ids):]]
                     for sample, sequence, output in zip(samples, sequences, outputs)]
        return response_topk(samples, positions, width, k, self.args.gkd_temperature, self.args.temperature)


def response_topk(samples, positions, width: int, k: int, gkd_temperature: float,
                  temperature: float) -> dict[str, torch.Tensor]:
    """A vLLM teacher's scores of `samples` (this engine's, or a teacher server's), response-aligned:
    `positions[i][j]` is {token id: (logprob, rank)} of response token j of sample i, as vLLM's prompt
    logprobs list it: the top K by rank, plus the response token itself when it ranks lower. Gives
    `teacher_topk_ids` [n, width, k] (long), `teacher_topk_logprobs` [n, width, k] (at `gkd_temperature`)
    and, at `temperature` 1, `teacher_logprobs` [n, width] (vLLM's prompt logprobs are at T = 1)."""
    n = len(samples)
    ids = torch.zeros(n, width, k, dtype=torch.long)
    logprobs = torch.zeros(n, width, k)
    sampled = torch.zeros(n, width)
    for i, sample in enumerate(samples):
        for j, token in enumerate(sample.response_ids):
            candidates = positions[i][j]
            best = sorted(candidates.items(), key=lambda item: item[1][1])[:k]
            ids[i, j] = torch.tensor([token_id for token_id, _ in best])
            logprobs[i, j] = torch.tensor([logprob for _, (logprob, _) in best])
            sampled[i, j] = candidates[token][0]
    if gkd_temperature != 1.0:  # exact for the renormalised top-k support only
        logprobs = torch.log_softmax(logprobs / gkd_temperature, dim=-1)
    scored = {"teacher_topk_ids": ids, "teacher_topk_logprobs": logprobs}
    if temperature == 1.0:
        scored["teacher_logprobs"] = sampled
    return scored
