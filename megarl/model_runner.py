"""Running a Megatron GPTModel over micro-batches: the skeleton the actor, critic and reference share.

Samples arrive as token ids; a micro-batch holds one sample per row, right-padded
to its longest sequence (causal attention needs no mask), or with --padding-free
all its samples end to end in one row (`run_model` gives the attention what keeps
them apart; megarl/packing.py). Position t's output scores token t+1: the response
tokens of a sample with prompt length p and response length r starting at offset
o of its row sit at positions o+p-1 .. o+p+r-2. `make_micro_batches` turns a
`batch.Batch` (response-aligned [N, R]) into position-aligned micro-batches, of
--micro-batch-size samples or by a token budget; `response_aligned` turns
per-micro-batch outputs back, in the batch's order.

`TrainableModel` owns one model under Megatron DDP with its optimizer and LR
schedule: a forward-only pass, one optimizer step over micro-batches, offload
and onload, and the state a checkpoint saves. Roles supply only their loss.

Context parallelism (megarl/context_parallel.py): every CP rank builds the same whole
micro-batch; the model runs on this rank's part of it (`context_parallel_part`), and loss
functions and kept outputs compute per-token values on the part and gather them into the
whole micro-batch (`MicroBatch.gather`) before anything that spans a sequence.

Loss normalisation: a loss function returns (numerator, units, {"sums": ...})
and the model is built with `calculate_per_token_loss`, so Megatron divides the
accumulated gradients by the units summed over micro-batches and data-parallel
ranks (x context-parallel ranks, each counting the whole micro-batch's units, as
its gradient is CP times one copy's: megarl/context_parallel.py): the exact mean
over the mini-batch. The named metric sums are summed over micro-batches and
data-parallel ranks only (each CP rank holds whole sums), and named maxima (an
optional "maxes" dict) reduced by max (`reduce_over_data_parallel`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megarl import accelerator, context_parallel, kernels, packing
from megarl.batch import TOKEN_FIELDS, Batch
from megarl.offload import Offloader, model_tensors, optimizer_tensors


@dataclass
class MicroBatch:
    """Sequences right-padded one per row, or packed end to end in one row (`packed_lengths`);
    every per-token field is position-aligned [b, L]."""

    tokens: torch.Tensor  # [b, L]
    labels: torch.Tensor  # [b, L], each sequence's tokens shifted left (pad_id past its end)
    loss_mask: torch.Tensor  # [b, L], 1 on positions scoring a response token left in the loss
    spans: list[tuple[int, int, int, int]]  # (row, offset in the row, prompt length, response length) per sample
    fields: dict[str, torch.Tensor]  # Batch's per-token fields (TOKEN_FIELDS), position-aligned
    position_ids: torch.Tensor  # [b, L], restarting at 0 with each sequence
    indices: list[int]  # each sample's index in the batch the micro-batches were made from
    packed_lengths: list[int] | None = None  # packed: the sequences' slots laid end to end in row 0 (their
                                            # lengths; with CP rounded up to a multiple of 2 x CP; the
                                            # last one longer where `sequence_multiple` asks for it)
    # OPSD: the same samples as the teacher sees them (its privileged prompt, then the same response),
    # laid out the same way; None when no sample of this micro-batch has a teacher prompt.
    teacher_view: MicroBatch | None = None
    # Context parallelism: the whole micro-batch this is this CP rank's part of (None: it is whole).
    # A part's per-token tensors hold its own positions, and its packed_lengths are the whole slots.
    part_of: MicroBatch | None = None
    # The token ids the sampler held back where the `constrained` field is True (Batch.held_back_ids).
    held_back_ids: tuple[int, ...] = ()
    # --routing-replay: [b, L, layers, k] long, the experts the rollout engine routed the token at each position
    # to (routing_replay.micro_batch_routes; NO_ROUTE where none was recorded); None: the routers choose.
    routes: torch.Tensor | None = None

    def __getattr__(self, name):  # batch.advantages etc.: the field, or None when the batch has none
        if name in TOKEN_FIELDS:
            return self.__dict__["fields"].get(name)
        raise AttributeError(name)

    def held_back(self) -> kernels.HeldBack | None:
        """The sampler's constraint on these positions, for scoring the policy (and the reference) as
        the sampler did (batch.sampler_constraint); None when there is none."""
        if not self.held_back_ids or self.constrained is None:
            return None
        return kernels.HeldBack(torch.tensor(self.held_back_ids, device=self.constrained.device), self.constrained)

    @property
    def whole(self) -> MicroBatch:
        """The whole micro-batch (itself unless this is a context-parallel part)."""
        return self if self.part_of is None else self.part_of

    def gather(self, local):
        """Per-token tensors [b, L_part, ...] of this part (or a tuple of them) -> the same over the whole
        micro-batch [b, L, ...], differentiable; unchanged when this micro-batch is whole."""
        if self.part_of is None:
            return local
        if isinstance(local, tuple):
            return tuple(None if x is None else self.gather(x) for x in local)
        return context_parallel.gather(local, self.packed_lengths)

    def context_parallel_part(self) -> MicroBatch:
        """What this CP rank computes of the micro-batch: two chunks of each sequence's slot
        (megarl/context_parallel.py); the micro-batch itself without context parallelism."""
        from megatron.core import parallel_state

        cp = context_parallel.size()
        if cp == 1:
            return self
        if self.packed_lengths is None:
            raise ValueError("context parallelism needs packed micro-batches (--padding-free)")
        positions = context_parallel.local_positions(self.packed_lengths, cp,
                                                     parallel_state.get_context_parallel_rank())

        def part(x):
            return x.index_select(1, positions.to(x.device))

        return MicroBatch(part(self.tokens), part(self.labels), part(self.loss_mask), [],
                          {name: part(values) for name, values in self.fields.items()}, part(self.position_ids),
                          self.indices, self.packed_lengths, part_of=self, held_back_ids=self.held_back_ids,
                          routes=None if self.routes is None else part(self.routes))

    def own_positions(self, whole: torch.Tensor) -> torch.Tensor:
        """A per-token tensor [b, L, ...] of the whole micro-batch -> this part's positions [b, L_part, ...]
        (`gather`'s inverse); unchanged when this micro-batch is whole."""
        if self.part_of is None:
            return whole
        from megatron.core import parallel_state

        positions = context_parallel.local_positions(self.packed_lengths, context_parallel.size(),
                                                     parallel_state.get_context_parallel_rank())
        return whole.index_select(1, positions.to(whole.device))

    def response_positions(self, sample: int) -> tuple[int, slice]:
        """(row, columns) of the positions scoring sample `sample`'s response tokens."""
        row, offset, p, r = self.spans[sample]
        return row, slice(offset + p - 1, offset + p + r - 1)

    def response_aligned(self, x: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """[samples, width] with column j = response token j of each sample (0 past the response);
        width defaults to the longest response here."""
        width = max(r for *_, r in self.spans) if width is None else width
        out = torch.zeros(len(self.spans), width, *x.shape[2:], dtype=x.dtype, device=x.device)
        for sample, (*_, r) in enumerate(self.spans):
            row, columns = self.response_positions(sample)
            out[sample, :r] = x[row, columns]
        return out

    def response_mask(self) -> torch.Tensor:
        """[rows, L] 1 on the positions scoring a response token the policy sampled (the batch's response
        mask, position-aligned: a tool result's tokens in a multi-turn episode are not, Batch.policy)."""
        mask = torch.zeros(self.tokens.shape, device=self.tokens.device)
        for sample in range(len(self.spans)):
            row, columns = self.response_positions(sample)
            mask[row, columns] = 1.0
        return mask if self.policy is None else mask * self.policy

    def padding_tokens(self) -> int:
        """Positions the model computes that hold no sample's token."""
        return self.tokens.numel() - sum(p + r for *_, p, r in self.spans)


def sequence_multiple(args) -> int:
    """What each model's sequence length (per CP rank) must be a multiple of: the TP size under sequence
    parallelism (Megatron splits the sequence over the TP ranks, split_along_first_dim), else 1."""
    return args.tensor_model_parallel_size if args.sequence_parallel else 1


def make_micro_batches(batch: Batch, micro_batch_size: int, pad_id: int, max_tokens: int | None = None,
                       packed: bool = False, sequence_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches of the batch's samples, carrying every per-token field it has (and, for OPSD
    samples, the teacher's view of them): `micro_batch_size` consecutive samples each, or with
    `max_tokens` groups of at most that many real tokens, the same number on every data-parallel rank
    (collective; megarl/packing.py). Right-padded, or with `packed` laid end to end in one row (with
    context parallelism each in a slot of a multiple of 2 x CP tokens); the rows padded further so that
    each CP rank's length is a multiple of `sequence_multiple` (the `sequence_multiple` function)."""
    if context_parallel.size() > 1 and not packed:
        raise ValueError("context parallelism needs packed micro-batches (--padding-free)")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch.samples]
    if max_tokens:
        count = _max_over_data_parallel(packing.partition_count(lengths, max_tokens))
        groups = packing.token_budget_partitions(lengths, max_tokens, count)
    else:
        groups = [list(range(start, min(start + micro_batch_size, len(batch))))
                  for start in range(0, len(batch), micro_batch_size)]
    fields = batch.token_fields()
    micro_batches = []
    for rows in groups:
        chunk = [batch.samples[i] for i in rows]
        micro_batch = _micro_batch([s.prompt_ids for s in chunk], chunk, pad_id, batch.loss_mask[rows],
                                   {name: values[rows] for name, values in fields.items()}, rows, packed,
                                   sequence_multiple)
        micro_batch.held_back_ids = batch.held_back_ids
        if any(s.teacher_prompt_ids for s in chunk):  # the teacher routes its own tokens: no routes
            micro_batch.teacher_view = _micro_batch([s.teacher_prompt_ids or s.prompt_ids for s in chunk], chunk,
                                                    pad_id, batch.loss_mask[rows], {}, rows, packed,
                                                    sequence_multiple, with_routes=False)
        micro_batches.append(micro_batch)
    return micro_batches


def _max_over_data_parallel(count: int) -> int:
    from megatron.core import parallel_state

    count = torch.tensor(count, device=accelerator.device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return int(count)


def _micro_batch(prompts: list[list[int]], samples, pad_id: int, loss_mask: torch.Tensor,
                 fields: dict[str, torch.Tensor], indices: list[int], packed: bool,
                 sequence_multiple: int = 1, with_routes: bool = True) -> MicroBatch:
    """Sequences prompt + response, one per right-padded row or (`packed`) end to end in one row;
    response-aligned `loss_mask` and `fields` placed at the positions that score each response token; the
    samples' routes (`with_routes`, when they carry them) at the positions of their tokens.
    Each CP rank's length a multiple of `sequence_multiple`: right-padded rows are padded to it, a packed
    row's last slot lengthened (context_parallel.packed_slots)."""
    device = accelerator.device()
    lengths = [len(prompt) + len(s.response_ids) for prompt, s in zip(prompts, samples)]
    if packed:
        slots = context_parallel.packed_slots(lengths, context_parallel.size(), sequence_multiple)
        places = [(0, offset) for offset in packing.offsets(slots)[:-1]]
        shape = (1, sum(slots))
    else:
        places = [(row, 0) for row in range(len(samples))]
        shape = (len(samples), -(-max(lengths) // sequence_multiple) * sequence_multiple)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full_like(tokens, pad_id)
    position_ids = torch.zeros_like(tokens)
    per_token = {"loss_mask": torch.zeros(shape)}
    per_token.update({name: torch.zeros(*shape, *values.shape[2:], dtype=values.dtype)
                      for name, values in fields.items()})
    spans = []
    for sample, (prompt, s, (row, offset)) in enumerate(zip(prompts, samples, places)):
        p, r = len(prompt), len(s.response_ids)
        spans.append((row, offset, p, r))
        sequence = torch.tensor(prompt + s.response_ids)
        tokens[row, offset: offset + p + r] = sequence
        labels[row, offset: offset + p + r - 1] = sequence[1:]
        position_ids[row, offset: offset + p + r] = torch.arange(p + r)
        response = slice(offset + p - 1, offset + p + r - 1)
        per_token["loss_mask"][row, response] = loss_mask[sample, :r].float()
        for name, values in fields.items():
            per_token[name][row, response] = values[sample, :r]
    per_token = {name: value.to(device) for name, value in per_token.items()}
    loss_mask = per_token.pop("loss_mask")
    routes = None
    if with_routes and any(getattr(s, "routes", None) is not None for s in samples):
        from megarl.routing_replay import micro_batch_routes

        routes = micro_batch_routes(samples, places, tokens.shape).to(device)
    return MicroBatch(tokens.to(device), labels.to(device), loss_mask, spans, per_token, position_ids.to(device),
                      list(indices), slots if packed else None, routes=routes)


def response_aligned(micro_batches: list[MicroBatch], outputs: list[torch.Tensor], width: int) -> torch.Tensor:
    """Position-aligned outputs, one per micro-batch, as one response-aligned [N, width] tensor in the
    order of the batch the micro-batches were made from."""
    aligned = torch.cat([b.response_aligned(x, width) for b, x in zip(micro_batches, outputs)])
    order = torch.tensor([i for b in micro_batches for i in b.indices], device=aligned.device)
    return torch.empty_like(aligned).index_copy_(0, order, aligned)


def run_model(model, batch: MicroBatch):
    """The model's output on the micro-batch. Right-padded rows need only the causal mask; a packed
    row goes in the THD format (`accelerator.packed_sequence_params`): each sequence attends only to
    itself, with RoPE restarted at its own first token. With routing replay installed on the model, its
    routers take the micro-batch's recorded routes (megarl/routing_replay.py)."""
    from megarl import routing_replay

    routing_replay.set_targets(model, batch.routes)
    params = None if batch.packed_lengths is None else accelerator.packed_sequence_params(batch.packed_lengths)
    return model(batch.tokens, batch.position_ids, attention_mask=None, packed_seq_params=params)


def output_weight(model) -> torch.Tensor:
    """This TP rank's shard [V/TP, H] of the output layer's weight (the word embeddings when tied)."""
    from megarl.models.convert import unwrap

    module = unwrap(model)
    if module.share_embeddings_and_output_weights:
        return module.shared_embedding_or_output_weight()
    return module.output_layer.weight


@contextlib.contextmanager
def final_hidden_states(model):
    """The model returns its final hidden states [b, s, H] (after the last norm) where it returned
    logits: the output layer is skipped, for the fused kernels that take hidden states and
    `output_weight` and never form the [b, s, V/TP] logits (megarl/kernels). Under sequence
    parallelism gathered over the whole sequence, as the output layer would have
    (megatron_gpt.whole_sequence)."""
    from megarl.models.convert import unwrap
    from megarl.models.megatron_gpt import whole_sequence

    module = unwrap(model)
    if not module.post_process:  # an earlier pipeline stage: its output is already hidden states
        yield
        return
    layer = module.output_layer
    layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (
        whole_sequence(hidden_states, module.config), None)
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def forward_backward(model, micro_batches: list[MicroBatch], loss_fn, forward_only: bool,
                     micro_batch_size: int, companions: dict | None = None, hidden: bool = False) -> list[dict]:
    """Megatron's forward-backward schedule over the micro-batches.

    loss_fn(batch, output, companion_outputs) -> (numerator, units, dict); the dicts are
    returned, one per micro-batch. The output is the logits, or with `hidden` the final hidden
    states (`final_hidden_states`). `companions` maps names to frozen models (the reference
    for a full-vocabulary KL, the teacher for full-vocabulary distillation) whose logits of the
    same tokens the loss takes (`companion_outputs`), under no_grad:
      * one pipeline stage: `role.companion_logits(part)` beside each micro-batch, on the same
        context-parallel part (the frozen model runs its CP attention with the same ranks), so
        only one micro-batch of their logits exists at a time;
      * pipeline stages: the student's 1F1B schedule cannot run another model's stages beside a
        micro-batch, so `role.pipelined_companion_logits(micro_batches)` runs the frozen model's own
        forward-only schedule first (`last_stage_outputs`); the last stage, where the loss runs, keeps
        each micro-batch's logits in host memory until its loss takes them.

    With pipeline stages, Megatron's 1F1B schedule passes activations between them and runs
    `loss_fn` on the last stage only; its dicts are then sent to every stage, so callers see
    the same results on every train rank.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core import parallel_state

    from megarl import routing_replay

    routing_replay.start_pass(model)
    companions = companions or {}
    ready = None
    if companions and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        with torch.no_grad():
            ready = {name: iter(role.pipelined_companion_logits(micro_batches)) for name, role in companions.items()}
    device = accelerator.device()

    def forward_step(data_iterator, model):
        batch = next(data_iterator).context_parallel_part()
        with final_hidden_states(model) if hidden else contextlib.nullcontext():
            output = run_model(model, batch)
        with torch.no_grad():
            if ready is not None:  # None on the stages before the last: their loss is not run
                outputs = {name: _to(next(kept), device) for name, kept in ready.items()}
            else:
                outputs = {name: role.companion_logits(batch) for name, role in companions.items()}
        return output, partial(loss_fn, batch, companion_outputs=outputs)

    # seq_length and micro_batch_size only size the activations sent between pipeline stages; with
    # stages the model's config has variable_seq_lengths, so each micro-batch sends its own shape.
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=max(b.tokens.shape[1] for b in micro_batches),
        micro_batch_size=micro_batch_size, forward_only=forward_only)
    return from_last_stage(outputs)


def clear_moe_losses() -> None:
    """Zero Megatron's MoE loss tracker (module state shared by every model of the rank), so that the next
    step's values are its own model's."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()


def moe_losses(model, num_micro_batches: int) -> dict[str, float]:
    """The MoE router losses of the last forward-backward, unweighted, as Megatron-LM logs them
    (track_moe_metrics): each layer's value summed over the micro-batches, over the pipeline stages and
    averaged over data-parallel ranks (reduce_aux_losses_tracker_across_ranks), then the mean over layers
    and micro-batches: {"moe_load_balancing_loss", "moe_z_loss"} for the terms the run turned on, {} for a
    dense model. Collective over the train ranks."""
    from megatron.core.transformer.moe import moe_utils

    from megarl.models.convert import unwrap

    config = unwrap(model).config
    names = [name for name, on in (("load_balancing_loss", config.moe_aux_loss_coeff),
                                   ("z_loss", config.moe_z_loss_coeff)) if config.num_moe_experts and on]
    if not names:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:  # a stage without the loss's layers still takes part in the reductions
        if name not in tracker:
            tracker[name] = {"values": torch.zeros(config.num_layers, device=accelerator.device()),
                             "reduce_group": None, "avg_group": None, "reduce_group_has_dp": False}
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    return {f"moe_{name}": tracker[name]["values"].sum().item() / (config.num_layers * num_micro_batches)
            for name in names}


def _to(tensor, device):
    return None if tensor is None else tensor.to(device)


def last_stage_outputs(model, micro_batches: list[MicroBatch], micro_batch_size: int, transform) -> list:
    """A frozen model's forward-only pipeline schedule over the micro-batches (each on this CP rank's
    part): `transform(i, part, logits)` of micro-batch i on the last pipeline stage, in host memory
    (a pipelined companion's logits wait there for the student's schedule: forward_backward); None on
    the other stages. Call while the model is resident."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl import routing_replay

    routing_replay.start_pass(model)
    kept, index = [], iter(range(len(micro_batches)))

    def forward_step(data_iterator, model):
        i, part = next(index), next(data_iterator).context_parallel_part()
        output = run_model(model, part)

        def keep(output):
            kept.append(transform(i, part, output).to("cpu"))
            return output.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        return output, keep

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=max(b.tokens.shape[1] for b in micro_batches),
        micro_batch_size=micro_batch_size, forward_only=True)
    return kept if parallel_state.is_pipeline_last_stage() else [None] * len(micro_batches)


def from_last_stage(outputs: list[dict]) -> list[dict]:
    """The last pipeline stage's loss-function results on every stage (the others got [] from the
    schedule); tensors travel through host memory, whatever the group's backend."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return outputs
    device = accelerator.device()
    payload = [_map_tensors(outputs, lambda t: t.detach().cpu()) if parallel_state.is_pipeline_last_stage()
               else None]
    dist.broadcast_object_list(payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return _map_tensors(payload[0], lambda t: t.to(device))


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value


def keep_output(transform):
    """A forward-only loss function that keeps transform(batch, output, companion_outputs) per micro-batch:
    per-token tensors (or a tuple of them), over the whole micro-batch (gathered over context parallelism)."""
    def loss_fn(batch, output, companion_outputs):
        kept = batch.gather(transform(batch, output, companion_outputs))
        return output.sum() * 0, torch.tensor(1, dtype=torch.int), {"kept": kept}

    return loss_fn


def reduce_over_data_parallel(per_micro_batch: list[dict[str, torch.Tensor]], op: str = "sum") -> dict[str, float]:
    """Named metrics reduced (op "sum" or "max") over micro-batches and then over the data-parallel ranks."""
    from megatron.core import parallel_state

    names = sorted(per_micro_batch[0])
    stacked = torch.stack([torch.stack([m[name].float() for name in names]) for m in per_micro_batch])
    reduced = stacked.sum(dim=0) if op == "sum" else stacked.amax(dim=0)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                    group=parallel_state.get_data_parallel_group())
    return dict(zip(names, reduced.tolist()))


def build_trainable(module, args, lr: float, weight_decay: float):
    """Megatron DDP, Adam and the LR schedule around `module` (policy or critic)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.models.megatron_gpt import DTYPES

    dtype = DTYPES[args.params_dtype]
    config = module.config
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=args.use_distributed_optimizer),
        module=module)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, min_lr=min(args.min_lr, lr), weight_decay=weight_decay,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
                        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        [model])
    # Megatron's schedules multiply the last stage's loss by config.grad_scale_func before its backward
    # (schedules.backward_step; the MoE and MTP auxiliary losses take the same scale) and the optimizer divides
    # the gradients by its scale before the step. Megatron-core leaves the wiring to the caller (Megatron-LM's
    # training.py sets it): without it an fp16 step divides unscaled gradients by the loss scale and never
    # sees an overflow. The fp32 and bf16 optimizers' scale is 1.
    config.grad_scale_func = optimizer.scale_loss
    accelerator.fuse_torch_adam(optimizer)
    accelerator.allocate_adam_states_on_host(optimizer)
    total_updates = max(args.train_steps * args.steps_per_generation * args.ppo_epochs, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_steps else lr, max_lr=lr,
        min_lr=min(args.min_lr, lr), lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=max(total_updates, args.lr_warmup_steps + 1), lr_decay_style=args.lr_decay_style,
        start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=total_updates, wd_incr_style="constant")
    return model, optimizer, scheduler


class TrainableModel:
    """One Megatron model under DDP with its optimizer and LR schedule.

    Offload (`offload_model`, `offload_optimizer`): parameters and gradient buffers, and
    the optimizer's states, leave the device between updates (megarl/offload.py).
    """

    def __init__(self, module, args, lr: float, offload_model: bool = False, offload_optimizer: bool = False):
        self.micro_batch_size = args.micro_batch_size
        self.model, self.optimizer, self.scheduler = build_trainable(module, args, lr, args.weight_decay)
        self.offloaders = []
        self.moe_losses = {}  # the last step's MoE router losses (moe_losses), logged by the actor
        if offload_model:
            self.offloaders.append(Offloader(lambda: model_tensors(self.model)))
        if offload_optimizer:
            self.offloaders.append(Offloader(lambda: (optimizer_tensors(self.optimizer), [])))

    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch], transform, companions=None,
                     hidden: bool = False) -> list[torch.Tensor]:
        """transform(batch, output, companion_outputs) of each micro-batch, in eval mode (the output is
        the final hidden states with `hidden`)."""
        self.model.eval()
        outputs = forward_backward(self.model, micro_batches, keep_output(transform), True, self.micro_batch_size,
                                   companions=companions, hidden=hidden)
        return [o["kept"] for o in outputs]

    def optimizer_step(self, micro_batches: list[MicroBatch], loss_fn, companions=None,
                       hidden: bool = False) -> tuple[dict, float]:
        """Forward and backward over the micro-batches, then one optimizer step (the LR schedule
        advances when the step was taken). The loss's named sums (and maxima), over all
        data-parallel ranks, and the gradient norm."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_moe_losses()
        outputs = forward_backward(self.model, micro_batches, loss_fn, False, self.micro_batch_size,
                                   companions=companions, hidden=hidden)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        metrics = reduce_over_data_parallel([o["sums"] for o in outputs])
        if "maxes" in outputs[0]:
            metrics.update(reduce_over_data_parallel([o["maxes"] for o in outputs], op="max"))
        self.moe_losses = moe_losses(self.model, len(micro_batches))
        return metrics, grad_norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------ memory ----
    def offload(self) -> None:
        for offloader in self.offloaders:
            offloader.offload()

    def onload(self) -> None:
        for offloader in self.offloaders:
            offloader.onload()

    # -------------------------------------------------------- checkpoint ----
    def sharded_state_dict(self, prefix: str, is_loading: bool, optimizer: bool = True) -> dict:
        """Megatron's sharded model and optimizer state (dist_checkpointing), keys under `prefix`; the model
        alone without `optimizer` (--no-save-optim)."""
        model_state = model_checkpoint_state(self.model, prefix)
        if not optimizer:
            return {f"{prefix}_model": model_state}
        # The distributed optimizer's states in the model's own layout (each parameter's Adam moments
        # and main copy shaped like the parameter, gathered over the data-parallel group on save): loads
        # at another data-parallel, TP or PP size. (Megatron-core 0.16.1 refuses the flattened shards
        # that its default, fully_sharded_model_space, writes.) Other optimizers ignore it.
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        return {f"{prefix}_model": model_state,
                f"{prefix}_optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                                         metadata=metadata)}

    def load_sharded_state_dict(self, loaded: dict, prefix: str) -> None:
        load_model_checkpoint_state(self.model, loaded[f"{prefix}_model"], prefix)
        if f"{prefix}_optimizer" in loaded:  # absent when saved with --no-save-optim: Adam starts afresh
            # (the distributed optimizer's shared Adam step on load is fixed in accelerator.py)
            self.optimizer.load_state_dict(loaded[f"{prefix}_optimizer"])

    def state_dict(self) -> dict:
        """What is not in the sharded state: the LR schedule."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


def model_checkpoint_state(model, prefix: str) -> dict:
    """The model's part of a checkpoint (Megatron's sharded state dict, keys `{prefix}.{name}`): every
    parameter, or with LoRA adapters only those (megarl/models/lora.py: the base is --model's)."""
    from megarl.models import lora
    from megarl.models.convert import unwrap

    state = unwrap(model).sharded_state_dict(prefix=f"{prefix}.")
    return lora.adapter_state(model, state, prefix) if lora.adapters_of(model) else state


def load_model_checkpoint_state(model, loaded: dict, prefix: str) -> None:
    """model_checkpoint_state's tensors, loaded, into the model (a LoRA model's base loaded already)."""
    from megarl.models import lora
    from megarl.models.convert import unwrap

    state = {key.removeprefix(f"{prefix}."): value for key, value in loaded.items()}
    if lora.adapters_of(model):
        lora.load_adapter_state(model, state)
    else:
        unwrap(model).load_state_dict(state)


class SampledLogprobs:
    """For a role with `model`, `args`, `hf_config` and `forward_only(micro_batches, transform, hidden=)`:
    the sampled tokens' logprobs through the fused kernels (megarl/kernels, --kernels) from the final
    hidden states, the output layer's logits never formed (the naive path: from the logits)."""

    def sampled_logprobs(self, micro_batches: list[MicroBatch], width: int) -> torch.Tensor:
        """Response-aligned [n, width] logprobs of the sampled tokens, through the fused kernels from the
        final hidden states (--kernels; the naive path from the logits)."""
        return response_aligned(micro_batches, self.forward_only(micro_batches, self.token_logprobs,
                                                                 hidden=self.args.kernels != "naive"), width)

    def token_logprobs(self, batch: MicroBatch, output: torch.Tensor, _=None) -> torch.Tensor:
        """The labels' logprobs [b, L] from this model's output (hidden states unless --kernels naive), under
        the sampler's constraint (the policy's old logprobs and the reference's: both compare with
        distributions the samples were drawn under)."""
        args = self.args
        weight = None if args.kernels == "naive" else output_weight(self.model)
        return kernels.token_logprobs(output, batch.labels, self.hf_config.vocab_size, args.temperature, args.kernels,
                                      weight_shard=weight, held_back=batch.held_back())


class FrozenModel(SampledLogprobs):
    """A frozen Megatron GPTModel on the train ranks with the trainer's TP (no DDP, no optimizer),
    loaded from an HF checkpoint; with `offload`, it waits in host memory between its forwards; with
    `replay_routes` its routers replay the samples' routes (the reference of an MoE policy)."""

    def __init__(self, args, hf_config, checkpoint: str, offload: bool, replay_routes: bool = False):
        from megarl.models.convert import load_hf_weights
        from megarl.models.megatron_gpt import DTYPES, build_gpt_model, model_config_overrides

        self.args, self.hf_config = args, hf_config
        self.model = build_gpt_model(hf_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by,
                                     **model_config_overrides(args))
        load_hf_weights(self.model, checkpoint, hf_config)
        if replay_routes:
            from megarl import routing_replay

            routing_replay.install_on_model(self.model)
        self.model.requires_grad_(False).eval()
        self.offloader = Offloader(lambda: model_tensors(self.model)) if offload else None
        self.offload()

    def offload(self) -> None:
        if self.offloader is not None:
            self.offloader.offload()

    def onload(self) -> None:
        if self.offloader is not None:
            self.offloader.onload()

    @contextlib.contextmanager
    def resident(self):
        """On the device for the duration (back in host memory after, when offloading)."""
        self.onload()
        try:
            yield self
        finally:
            self.offload()

    @torch.no_grad()
    def logits(self, batch: MicroBatch) -> torch.Tensor:
        """This TP rank's vocabulary shard of the logits of the micro-batch (call while resident)."""
        return run_model(self.model, batch)

    def companion_logits(self, batch: MicroBatch) -> torch.Tensor:
        """Beside a student micro-batch (forward_backward's companions): the logits of the same tokens."""
        return self.logits(batch)

    @torch.no_grad()
    def pipelined_companion_logits(self, micro_batches: list[MicroBatch]) -> list:
        """With pipeline stages (forward_backward's companions): each micro-batch's logits on the last stage."""
        return last_stage_outputs(self.model, micro_batches, self.args.micro_batch_size,
                                  lambda i, part, logits: logits)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[MicroBatch], transform, hidden: bool = False) -> list[torch.Tensor]:
        """transform(batch, output, {}) of each micro-batch, while resident (the output is the final
        hidden states with `hidden`, the logits otherwise)."""
        with self.resident():
            outputs = forward_backward(self.model, micro_batches, keep_output(transform), True,
                                       self.args.micro_batch_size, hidden=hidden)
        return [o["kept"] for o in outputs]

