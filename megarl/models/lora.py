"""LoRA adapters on Megatron's column- and row-parallel linears (--lora-rank R > 0).

Megatron-core 0.16.1 has no LoRA of its own (its only trace is ColumnParallelLinear's
`disable_grad_reduce`, "used by Lora Adapter in Nemo"; the adapters live in NeMo and
Megatron-Bridge), so the adapters are written here, after PEFT's definition:

    y = W x + scale * B (A dropout(x)),   scale = alpha / r,   A ~ U(+-1/sqrt(in)), B = 0

Which modules. The targets are the HF module names of the family (`q_proj` ... `down_proj`,
read off the family's conversion rules, so a new family brings its own), Megatron's fused
linears (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`: all the HF modules inside),
or `all-linear`. A fused Megatron linear carries one (A, B) pair per targeted HF module
(`linear_qkv` up to three, `linear_fc1` two), so each adapter is PEFT's adapter of one HF
module: the export to PEFT and vLLM's LoRA need no splitting of a fused rank.

Tensor parallelism: A and B are split the way the base weight is.
  column-parallel base (qkv, gate/up; output split): A [r, in] replicated, B [out/TP, r] split on
    its output rows, each HF module's rows as the base's (q heads, k/v groups, gate/up halves);
    the rank's part of the fused output is assembled in the base's layout (per-group
    interleaving for qkv, cat(gate_i, up_i) for fc1). The [tokens, r] intermediate goes through
    `copy_to_tensor_model_parallel_region`, so its gradient (each rank's B_i contribution) is
    summed over TP in the backward: A's gradient is then the same on every TP rank, as A is.
  row-parallel base (o, down; input split): A [r, in/TP] split on its input columns, B [out, r]
    replicated; the partial [tokens, r] product is all-reduced over TP
    (`reduce_from_tensor_model_parallel_region`) before B. Adding B's partial [tokens, out]
    product into the base's own reduction would save that collective but leave B's gradient a
    per-rank partial sum that Megatron does not reduce for a replicated parameter; the r-wide
    reduction costs r/out of the base's.
Initialisation is drawn on the host from a generator seeded by (--seed, global layer, module), whole,
and then sharded: every TP, PP, CP and DP layout starts from the same adapters (tests/workers/lora_worker.py:
PP=2's logits equal one rank's bit for bit).

Pipeline and context parallelism need nothing of their own: each stage's layers carry their adapters,
which enter the stages' activations and gradients like any layer's weights. Megatron's reductions of
the frozen base skip it (megatron/core/distributed/finalize_model_grads.py, 0.16.1): the tied
embedding's across the first and last stage finds no main_grad (DDP keeps none for a frozen parameter)
and a None .grad, and returns on both stages alike ("When the embedding is frozen, the grad is None");
the position embedding's group is the first stage alone (and RoPE models have none); the layer norms'
TP reduction (sequence parallelism, qk_layernorm) takes only parameters that require grad. DDP's
buffers hold the adapters alone and reduce them over DP x CP, each CP rank's gradient being of its own
positions, divided by the loss units counted over DP x CP (megarl/model_runner.py). Measured at TP=2,
PP=2 and CP=2 against one rank (tests/workers/lora_worker.py, through the actor's DDP, schedule and
finalize_model_grads, the tiny model's tied embedding frozen): logits 2.9, 0, 1.9 ulps; every
adapter's gradient <= 91, 0, 126 ulps (fp32, the rule of tests/helpers.py: 2048).

The base is frozen: every parameter of the model is requires_grad False but the adapters, so
Megatron's DDP makes no gradient buffer, and its optimizer (distributed or not) no fp32 main copy
and no state, for anything but the adapters (DDP and get_megatron_optimizer skip parameters that
do not require grad); offload moves what those hold.

The adapters are siblings of their base linear (`self_attention.linear_qkv_lora`), so Megatron's
per-module sharded_state_dict reaches them, and enter the base's forward through a forward hook.
The base's weight carries `lora_delta` (its shard's scale * B A, fp32, in the base's layout) for
`convert.iter_hf_weights`, which exports merged W + scale * B A to the rollout engine and HF
checkpoints (summed in fp32, rounded once to the parameters' dtype: after a sync the
rollout-vs-trainer mismatch stays at full training's level, ~3e-7 in fp32 and ~2e-3 in bf16 on the
tiny model at TP=2, as full training's). `adapters_disabled(model)` switches them off: the reference of a KL term is the
policy's own base weights (megarl/reference.py), no second copy.

Sync to the rollout engines (--lora-sync): `merged` (the default) sends the whole model with the merged
weights through the weight sync's strategies, as full training does; `adapter` sends the adapters only
(`iter_peft_weights`, PEFT's names, gathered whole over TP, every pipeline stage's on every train rank by
the merged export's own stage loop, convert.every_stage; Actor.hf_weights) through the same strategies, and
the engine, started with vLLM's LoRA (`vllm_lora_kwargs`: one slot of the smallest vLLM rank >= r), loads
them as one adapter replaced in place each sync and runs every request with it (megarl/rollout.py:
RolloutEngine._load_adapter). vLLM's LoRA computes x A^T B^T scale beside the base's output in its punica
ops (torch ops on CPU): on the tiny model at TP=2 the mismatch stays at ~3e-7 in fp32, as the merged sync's.
It moves r (in + out) per adapted linear instead of the whole model, and the engine's base is never
rewritten, but every forward of the engine pays the LoRA kernels (bench/weight_sync.py --lora-rank prints
both). Measured on CPU (a busy 2-core host; 201M-parameter Qwen2, r = 16 on every linear, colocated): a
sync moves 13.3 MiB in 0.08 s instead of 766 MiB in 1.8 s (merged; full training's 1.0 s), but a greedy
generation of 16 x 32 tokens took 33 s instead of 7.5 s (vLLM's CPU LoRA ops), so `merged` stays the
default; GPU (triton punica kernels) is not measured yet. Not with --rollout-backend hf or a colocated --teacher-model (the engines would serve its weights).

Checkpoints hold the adapters only: the policy's sharded state (megarl/checkpoint.py's dist/) is the
adapters and their optimizer state (Adam's moments; with the distributed optimizer also its fp32 main
copies), under the same keys as in a full checkpoint, so Megatron reshards them to another TP, PP or DP size
on load (the layers' global offsets reach `LoraAdapter.sharded_state_dict` through TransformerBlock's
sharded_offsets: a PP=2 checkpoint resumes at PP=2 bit for bit and loads at PP=1 as saved, lora_worker). The frozen base is not saved again: it is --model, the HF checkpoint the run started from, recorded in
state.json's `lora` (its path and a fingerprint of its weights, `base_fingerprint`, with the adapters' rank,
alpha, dropout and targets). A resume rebuilds the base from its own --model and loads the adapters onto it;
it is refused, in one line, when the fingerprint or the adapters' shape differ, or when a LoRA checkpoint
meets a full run or the reverse (`checkpoint_mismatch`). tools/export_hf.py loads the base from the
recorded path (or its --model). Size: Llama-2-7B with rank-16 adapters on every linear has 40.0M adapter
parameters, 12-14 bytes each in a checkpoint (the adapter, Adam's two fp32 moments, the fp32 main copy
with bf16), ~0.5 GB, where a full checkpoint of the same model holds 6.7B parameters at those bytes, ~80-95 GB.

Export (--save-hf-dir, tools/export_hf.py; --lora-export): `adapter` writes a PEFT LoRA directory,
adapter_config.json (r, lora_alpha, target_modules as HF module names, base_model_name_or_path = --model)
and adapter_model.safetensors, whose tensors are named and shaped as peft's save_pretrained writes them for
the HF model (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight`
[out, r], gathered whole over TP), so scale = alpha / r there as here: transformers + peft
(PeftModel.from_pretrained) and vLLM's LoRA load it on the base; `merged` writes the HF checkpoint with
W + scale * B A (the same stream as the merged sync); `both`, the merged checkpoint with the adapter
directory in its adapter/.

Sequence parallelism: a column-parallel base takes this rank's tokens and gathers them itself, a row-parallel
one reduce-scatters its output over the tokens; the adapters' r-wide products follow (LoraAdapter.forward).

Transformer Engine: its layer-norm-fused column linear takes the un-normed hidden state, so a LoRA policy
takes Megatron's local spec on every host (megatron_gpt.transformer_engine_spec; the cost: docs/platform.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from megarl.models.convert import _rank_pieces, interleave_gated_qkv, interleave_qkv, mamba_parts, unrank_pieces, unwrap
from megarl.models.families import family_of, layer_kinds, module_name_prefix

ALL_LINEAR = "all-linear"
_LAYER_PREFIX = "decoder.layers.{i}."
# Family rule layouts of the decoder layers' linear weights, and how TP splits each.
_LINEAR_LAYOUTS = {"qkv": "column", "gate_up": "column", "column": "column", "row": "row", "gated_qkv": "column",
                   "gdn_in_proj": "column", "mamba_in_proj": "column", "expert_gate_up": "column", "expert": "row",
                   "expert_up": "column"}
# A routed expert's linears (MoE families): one adapter on each, as PEFT puts one on each of transformers'
# fused expert parameters (target_parameters `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`):
# the fused gate/up rows share their A, as they do in PEFT. Named by that parameter.
EXPERTS = "experts"  # --lora-target-modules: both expert linears
_EXPERT_MODULES = {"expert_gate_up": "experts.gate_up_proj", "expert": "experts.down_proj"}
# Nemotron-H's non-gated experts' up projection (their adapters are refused at parse: arguments._validate_lora)
_NON_GATED_EXPERT_MODULES = {"expert_up": "experts.up_proj"}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # HF module names

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class Linear:
    """A Megatron linear of a decoder layer as LoRA sees it."""
    layout: str  # the family rule's layout of its weight
    modules: tuple[str, ...]  # its HF modules in fused order ('q_proj', 'k_proj', 'v_proj')
    hf_paths: tuple[str, ...]  # their HF paths ('model.layers.{i}.self_attn.q_proj', ...)
    layer_type: str | None  # the kind of the layers that have it (families.layer_kinds), else None
    expert: bool = False  # a routed expert's linear (`{e}` in its Megatron path: one adapter per expert)


def linear_modules(hf_config) -> dict[str, Linear]:
    """{Megatron linear's path in a layer ('self_attention.linear_qkv'): Linear}, read off the family's
    conversion rules: those some layer of this model has (`layer_kinds`: a Qwen-MoE without dense layers has no
    dense MLP linears)."""
    family, kinds = family_of(hf_config), layer_kinds(hf_config)
    present = set().union(*kinds) if kinds is not None else set()
    linears = {}
    for rule in family.layer_rules:
        if rule.layer_type is not None and kinds is not None and rule.layer_type not in present:
            continue
        # (a norm split over TP, as a Mamba-2 mixer's gated norm, has a linear's layout but is no linear)
        if rule.layout in _LINEAR_LAYOUTS and rule.megatron.endswith(".weight") and \
                rule.megatron.startswith(_LAYER_PREFIX) and not rule.megatron.endswith("norm.weight"):
            path = rule.megatron.removeprefix(_LAYER_PREFIX).removesuffix(".weight")
            experts = {**_EXPERT_MODULES, **_NON_GATED_EXPERT_MODULES}
            if rule.layout in experts:  # HF's `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` ...
                module = experts[rule.layout]
                layer_path = rule.hf[0].partition(".experts.")[0]
                linears[path] = Linear(rule.layout, (module,), (f"{layer_path}.{module}",), rule.layer_type, True)
                continue
            linears[path] = Linear(rule.layout, tuple(name.rsplit(".", 2)[-2] for name in rule.hf),
                                   tuple(name.removesuffix(".weight") for name in rule.hf), rule.layer_type)
    return linears


def resolve_targets(targets: list[str], hf_config) -> tuple[str, ...]:
    """--lora-target-modules -> the HF module names they cover, in the model's order; ValueError naming
    the first name the model does not have."""
    family, linears = family_of(hf_config), linear_modules(hf_config)
    every = list(dict.fromkeys(module for linear in linears.values() for module in linear.modules))
    by_megatron = {}  # a Megatron name covers every linear of that name: a dense MLP's, a shared expert's, experts'
    for path, linear in linears.items():
        by_megatron.setdefault(path.rsplit(".", 1)[-1], []).extend(linear.modules)
    if any(linear.expert for linear in linears.values()):
        by_megatron[EXPERTS] = list(_EXPERT_MODULES.values())
    chosen = set()
    for target in targets:
        if target == ALL_LINEAR:  # as ms-swift's and verl's Megatron LoRA: the experts' linears too
            chosen.update(every)
        elif target in every:
            chosen.add(target)
        elif target in by_megatron:
            chosen.update(by_megatron[target])
        else:
            raise ValueError(f"--lora-target-modules {target!r}: the {family.name} family has no such linear; it has "
                             f"{', '.join(every)} (or {', '.join(by_megatron)}), or {ALL_LINEAR}")
    return tuple(module for module in every if module in chosen)


def _seed(seed: int, layer: int, module: str) -> int:
    """A generator seed per (run seed, global layer, HF module), the same on every rank."""
    return (seed * 1_000_003 + layer * 1009 + sum(ord(c) * 31 ** i for i, c in enumerate(module))) % 2**63


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: an (A, B) pair per targeted HF module inside it."""

    def __init__(self, base, layout: str, modules: tuple[str, ...], config: LoraConfig, layer: int, seed: int,
                 hf_paths: tuple[str, ...], expert: int | None = None):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        # the base's TP group: a routed expert's is the expert-TP group (size 1: experts are whole on their EP rank)
        self.tp_group = getattr(base, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.layer, self.expert = layer, expert  # global layer, global expert index (None: not an expert's)
        # the experts' modules the run targets (PEFT's nesting of expert parameters depends on them)
        self.expert_targets = tuple(module for module in _EXPERT_MODULES.values() if module in config.targets)
        self.layout, self.split = layout, _LINEAR_LAYOUTS[layout]
        self.scale, self.rank, self.dropout = config.scale, config.rank, config.dropout
        self.enabled = True
        # Sequence parallelism: a column base takes this rank's tokens and gathers them itself, a row base
        # reduce-scatters its output over the tokens (megatron/core/tensor_parallel/layers.py)
        # (not an expert's linear: its tokens come from the dispatcher, and it runs without, layers.py's
        # explicit_expert_comm)
        self.sequence_parallel = (bool(base.sequence_parallel) and tp > 1
                                  and not getattr(base, "explicit_expert_comm", False))
        targeted = {module.rpartition(".")[2] for module in modules if module in config.targets}
        # every HF module of the fused linear, in its order, by its last name (a ParameterDict key: an expert
        # parameter's `experts.gate_up_proj` is `gate_up_proj` here)
        modules = tuple(module.rpartition(".")[2] for module in modules)
        self.modules = modules
        self.hf_paths = {module: path.format(i=layer) for module, path in zip(modules, hf_paths)}  # PEFT's names
        conf = base.config
        self.groups = conf.num_query_groups // tp  # this rank's query groups (qkv)
        self.head_dim = conf.kv_channels
        # HF modules whose rows Megatron splits over TP piece by piece (a GDN's in_proj_qkv: each rank holds
        # cat(q_r, k_r, v_r)): {module: the pieces' whole sizes}; this adapter's B holds its rank's rows in
        # that order, gathered back into HF's by `convert.unrank_pieces`
        self.pieces = {}
        if layout in ("qkv", "gated_qkv"):
            query = conf.num_attention_heads * conf.kv_channels * (2 if layout == "gated_qkv" else 1)
            full_out = {modules[0]: query, modules[1]: conf.num_query_groups * conf.kv_channels,
                        modules[2]: conf.num_query_groups * conf.kv_channels}
        elif layout == "mamba_in_proj":  # a Mamba-2 in_proj: [z, x, B, C, dt], each part split over TP
            sections = mamba_parts(conf.mamba_num_heads, conf.mamba_head_dim, conf.mamba_num_groups,
                                   conf.mamba_state_dim, layout)
            full_out = {modules[0]: sum(sections)}
            self.pieces[modules[0]] = sections
        elif layout == "gdn_in_proj":  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
            key = conf.linear_num_key_heads * conf.linear_key_head_dim
            value = conf.linear_num_value_heads * conf.linear_value_head_dim
            full_out = dict(zip(modules, (2 * key + value, value, conf.linear_num_value_heads,
                                          conf.linear_num_value_heads)))
            self.pieces[modules[0]] = [key, key, value]
        else:
            full_out = {module: base.output_size // len(modules) for module in modules}
        self.local_out = {module: out // tp if self.split == "column" else out for module, out in full_out.items()}
        in_features = base.input_size
        device, dtype = base.weight.device, base.weight.dtype
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for module in modules:
            if module not in targeted:
                continue
            generator = torch.Generator().manual_seed(_seed(seed, layer, module if expert is None else f"{module}.{expert}"))
            bound = 1.0 / math.sqrt(in_features)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]
            a = torch.empty(config.rank, in_features).uniform_(-bound, bound, generator=generator)
            if self.split == "row":
                a = a.chunk(tp, dim=1)[tp_rank]
            self.A[module] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[module] = torch.nn.Parameter(torch.zeros(self.local_out[module], config.rank, device=device,
                                                            dtype=dtype))
            split = self.B[module] if self.split == "column" else self.A[module]
            set_tensor_model_parallel_attributes(split, True, 0 if self.split == "column" else 1, 1)
            if self.sequence_parallel:  # the replicated one sees this rank's tokens only: its gradient is a
                # part, summed over TP by finalize_model_grads (as the sequence-parallel norms' weights)
                (self.A[module] if self.split == "column" else self.B[module]).sequence_parallel = True
            for param in (self.A[module], self.B[module]):
                param.lora_adapter = True  # convert._local_entries: not a weight of the HF model
                if expert is not None:  # as its expert's weights: reduced over the expert-data-parallel group
                    param.allreduce = False

    def rank_rows(self, module: str, whole: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
        """This TP rank's rows of `module`'s whole B (HF's row order) as this adapter holds them."""
        if module in self.pieces:
            return _rank_pieces(list(whole.split(self.pieces[module])), tp_rank, tp)
        return whole.chunk(tp, dim=0)[tp_rank]

    def whole_rows(self, module: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `rank_rows` from every TP rank's rows of `module`'s B."""
        if module in self.pieces:
            return torch.cat(unrank_pieces(shards, self.pieces[module]))
        return torch.cat(shards, dim=0)

    def _combine(self, parts: dict[str, torch.Tensor], lead: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Per-module outputs along the last dim -> the fused linear's local output layout (zeros for the
        modules without an adapter)."""
        tensors = [parts[module] if module in parts else like.new_zeros(*lead, self.local_out[module])
                   for module in self.modules]
        if self.layout == "qkv":
            return interleave_qkv(*tensors, groups=self.groups, dim=-1)
        if self.layout == "gated_qkv":
            return interleave_gated_qkv(*tensors, groups=self.groups, head_dim=self.head_dim, dim=-1)
        # gdn_in_proj: this rank's in_proj rows are cat(its q, k, v rows, z, b, a), each module's in order
        return torch.cat(tensors, dim=-1) if len(tensors) > 1 else tensors[0]

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input: the same mask on every TP rank where the input is replicated
        (column without sequence parallelism: Megatron's data-parallel RNG, seeded alike over TP), one per
        rank where it is split (row, on its features; column under sequence parallelism, on its tokens: the
        model-parallel RNG). Both trackers are replayed by activation recomputation."""
        if not (self.dropout and self.training):
            return x
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        replicated = self.split == "column" and not self.sequence_parallel
        with tracker.fork(get_data_parallel_rng_tracker_name()) if replicated else tracker.fork():
            return torch.nn.functional.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x of the base's input `x`, in the base's local output layout.

        The TP collectives run on the r-wide product, never on the base's width. Without sequence
        parallelism: a column base's [tokens, r] product enters its region by a copy (its gradient summed
        over TP in the backward), a row base's partial products are all-reduced before B. With it the
        tokens move as the base's do: a column base's product of this rank's tokens is gathered over the
        sequence (reduce-scattered in the backward), a row base's partial products are reduce-scattered to
        this rank's tokens (gathered in the backward); the replicated A (column) or B (row) then sees this
        rank's tokens only, so its gradient is summed over TP at the step (its `sequence_parallel` mark).
        The same sums as gathering the input before A or reduce-scattering after B, r/width the traffic."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        x = self._dropped(x)
        names = list(self.A)
        a = torch.cat([self.A[name] for name in names]) if len(names) > 1 else self.A[names[0]]
        h = x @ a.t()  # [..., adapters * r]
        group = self.tp_group
        if self.split == "row":
            h = (reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(h, group=group))
            return self.scale * (h @ self.B[names[0]].t())
        h = (gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
             if self.sequence_parallel else copy_to_tensor_model_parallel_region(h, group=group))
        parts = {name: part @ self.B[name].t() for name, part in zip(names, h.split(self.rank, dim=-1))}
        return self.scale * self._combine(parts, tuple(h.shape[:-1]), x)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of scale * B A in the base weight's layout, fp32 (the merged export adds it)."""
        if self.split == "row":
            name = next(iter(self.A))
            return self.scale * (self.B[name].float() @ self.A[name].float())
        parts = {name: self.A[name].float().t() @ self.B[name].float().t() for name in self.A}  # [in, out_m]
        in_features = next(iter(self.A.values())).shape[1]
        return self.scale * self._combine(parts, (in_features,), parts[next(iter(parts))]).t()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron dist-checkpointing: B split on dim 0 (column base), A on dim 1 (row base)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        from megatron.core import parallel_state

        axis = {f"B.{name}": 0 for name in self.B} if self.split == "column" else \
            {f"A.{name}": 1 for name in self.A}
        # a routed expert's adapter: its expert's TP group and the DP group SequentialMLP's metadata gives (which
        # then sets the replicas over the expert-data-parallel ranks), as its linears'
        dp_cp_group = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp_group)


def _hook(adapter: LoraAdapter):
    def add_adapter(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]), bias

    return add_adapter


def _require_input_grad(module, args, output):
    """Full activation recomputation runs each group of layers in an autograd Function whose output
    needs grad only when its input does: with the embedding frozen, it would not, and the adapters
    inside would get no gradient (PEFT's enable_input_require_grads for the same reason)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def apply_lora(model, hf_config, config: LoraConfig, seed: int) -> list[LoraAdapter]:
    """Freeze `model` (a GPTModel, this rank's stage, before DDP) and add the adapters; returns them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    gpt = unwrap(model)
    gpt.requires_grad_(False)
    adapters = []
    kinds = layer_kinds(hf_config)
    prefix = module_name_prefix(hf_config)  # PEFT names the model's modules (a multimodal one's language model)
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1  # global, 0-based
        for path, linear in linear_modules(hf_config).items():
            layout, modules = linear.layout, linear.modules
            if not set(modules) & set(config.targets):
                continue
            if linear.layer_type is not None and kinds is not None and linear.layer_type not in kinds[index]:
                continue  # another kind of layer's linear (Qwen3.5's other attention, a dense or an MoE MLP)
            hf_paths = tuple(prefix + hf.removeprefix("model.") for hf in linear.hf_paths)
            for expert, local_path in _instances(layer, path, linear):
                parent_path, _, name = local_path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                base = getattr(parent, name)
                expected = RowParallelLinear if _LINEAR_LAYOUTS[layout] == "row" else ColumnParallelLinear
                if type(base) is not expected:  # Transformer Engine's linears (a layer norm fused in) differ
                    raise ValueError(f"--lora-rank: {local_path} is {type(base).__name__}, not Megatron's "
                                     f"{expected.__name__}; LoRA needs the local layer spec (build_gpt_model(lora=True))")
                if _LINEAR_LAYOUTS[layout] == "row" and not base.input_is_parallel:
                    raise ValueError(f"--lora-rank: {local_path} takes an unsplit input; the adapter expects a split one")
                adapter = LoraAdapter(base, layout, modules, config, index, seed, hf_paths, expert)
                parent.add_module(f"{name}_lora", adapter)
                base.register_forward_hook(_hook(adapter))
                base.weight.lora_delta = adapter.delta_weight
                adapters.append(adapter)
    if gpt.config.recompute_granularity == "full" and gpt.pre_process:
        gpt.embedding.register_forward_hook(_require_input_grad)
    return adapters


def _instances(layer, path: str, linear: Linear) -> list[tuple[int | None, str]]:
    """(global expert index or None, path in the layer) of each Megatron linear `path` names: itself, or for a
    routed expert's linear one per local expert of this EP rank (Megarl's local spec: SequentialMLP's
    `local_experts`; EP rank r holds experts [r * E/EP, (r + 1) * E/EP))."""
    if not linear.expert:
        return [(None, path)]
    experts = layer.mlp.experts
    if not hasattr(experts, "local_experts"):  # Transformer Engine's grouped GEMM: one weight per expert, no module
        raise ValueError(f"--lora-rank: the experts are {type(experts).__name__}; adapters on them need Megatron's "
                         f"SequentialMLP (the local spec: build_gpt_model(lora=True))")
    first = experts.ep_group.rank() * experts.num_local_experts
    return [(first + local, path.replace("{e}", str(local))) for local in range(experts.num_local_experts)]


def adapters_of(model) -> list[LoraAdapter]:
    return [module for module in unwrap(model).modules() if isinstance(module, LoraAdapter)]


@contextlib.contextmanager
def adapters_disabled(model):
    """The model without its adapters for the duration: the base weights' outputs."""
    adapters = adapters_of(model)
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def lora_config(args, hf_config) -> LoraConfig:
    """The adapters the options ask for (checked by megarl/arguments.py)."""
    return LoraConfig(args.lora_rank, args.lora_alpha, args.lora_dropout,
                      resolve_targets(args.lora_target_modules, hf_config))


# ------------------------------------------------------------ checkpoints ---

def _adapter_names(model) -> set[str]:
    return {name for name, param in unwrap(model).named_parameters() if getattr(param, "lora_adapter", False)}


def adapter_state(model, model_state: dict, prefix: str) -> dict:
    """Of a LoRA model's sharded state dict (keys `{prefix}.{parameter name}`), what its checkpoint holds:
    the adapters (the base is --model's, see the module docstring)."""
    kept = {f"{prefix}.{name}" for name in _adapter_names(model)}
    return {key: value for key, value in model_state.items() if key in kept}


def load_adapter_state(model, state: dict) -> None:
    """The adapters (keys without prefix) into a LoRA model whose base is loaded already."""
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    lost = sorted(_adapter_names(model) & set(missing))
    if lost or unexpected:
        raise ValueError(f"LoRA checkpoint: adapters missing {lost[:3]}, unexpected tensors {unexpected[:3]}")


def base_fingerprint(path: str) -> str:
    """An identity of the HF checkpoint at `path` that is cheap for any size: every tensor's name, dtype, shape
    and first row, hashed (whatever the file sharding and metadata, which a re-save may change)."""
    import hashlib

    from safetensors import safe_open

    from megarl.models.convert import HFCheckpoint

    weight_map = HFCheckpoint(path).weight_map
    digest = hashlib.sha256()
    for file in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, file), "pt") as f:
            for name in sorted(n for n, where in weight_map.items() if where == file):
                first = f.get_slice(name)[0:1]
                digest.update(f"{name}:{first.dtype}:{f.get_slice(name).get_shape()}".encode())
                digest.update(first.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def checkpoint_record(args, config: LoraConfig) -> dict:
    """state.json's `lora` entry: the adapters' shape and the base they were trained on."""
    return {"rank": config.rank, "alpha": config.alpha, "dropout": config.dropout, "targets": list(config.targets),
            "base": os.path.abspath(args.model), "base_fingerprint": base_fingerprint(args.model)}


def checkpoint_mismatch(saved: dict | None, args, config: LoraConfig | None) -> str | None:
    """Why a checkpoint whose state.json has `saved` (its `lora` entry, None for a full-parameter one) cannot
    resume a run with these options (`config`: the run's adapters, None without --lora-rank); None if it can."""
    if saved is None:
        return None if config is None else ("it was saved by a full-parameter run, and --lora-rank trains "
                                            "adapters on --model: resume without --lora-rank")
    if config is None:
        return (f"it holds LoRA adapters (rank {saved['rank']}) on the base {saved['base']}, not a whole model: "
                f"resume with --lora-rank {saved['rank']} --lora-alpha {saved['alpha']} --lora-target-modules "
                f"{' '.join(saved['targets'])} --model {saved['base']}")
    for flag, mine, theirs in (("--lora-rank", config.rank, saved["rank"]),
                               ("--lora-alpha", config.alpha, saved["alpha"]),
                               ("--lora-target-modules", " ".join(config.targets), " ".join(saved["targets"]))):
        if mine != theirs:
            return f"its adapters have {flag} {theirs}, this run {mine}: resume with {flag} {theirs}"
    if base_fingerprint(args.model) != saved["base_fingerprint"]:
        return (f"--model {args.model} is not the base its adapters were trained on ({saved['base']}; the "
                f"weights differ): resume with that --model")
    return None


# ----------------------------------------------------------------- export ---

PEFT_ADAPTER_CONFIG = "adapter_config.json"
PEFT_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def iter_peft_weights(model, bucket_bytes: int = 256 * 2**20):
    """(PEFT name, whole tensor) of every adapter of the model, every pipeline stage's on every train rank,
    gathered over TP (the split one of each pair: B of a column-parallel base, A of a row-parallel one), in
    the model's order; collective over the train ranks (convert.every_stage: the merged export's stage loop).
    PEFT's names for the HF model: `base_model.model.<HF module>.lora_A.weight` [r, in] and `lora_B.weight`
    [out, r], adapter name `default` left out, as peft's save_pretrained writes them."""
    from megatron.core import parallel_state

    from megarl.models.convert import _buckets, _gather_tp_shards, every_stage
    from megarl.models.families import Rule

    entries, owners = [], {}
    adapters = adapters_of(model)
    experts = _expert_groups(adapters)
    for adapter in adapters:
        if adapter.expert is not None:
            continue
        for which, params in (("A", adapter.A), ("B", adapter.B)):
            split = (which == "B") == (adapter.split == "column")
            for module, param in params.items():
                name = f"base_model.model.{adapter.hf_paths[module]}.lora_{which}.weight"
                entries.append((name, Rule("", (), "split" if split else "replicated"),
                                0 if which == "B" else 1, param))
                if which == "B":
                    owners[name] = adapter, module
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()

    def this_stage():
        for bucket in _buckets(entries, bucket_bytes, tp_size):
            for (name, rule, dim, _), shards in zip(bucket, _gather_tp_shards(bucket, tp_group, tp_size)):
                if rule.layout != "split":
                    yield name, shards[0]
                elif name in owners:  # a column base's B: its rows, whole in HF's order
                    adapter, module = owners[name]
                    yield name, adapter.whole_rows(module, shards)
                else:
                    yield name, torch.cat(shards, dim=dim)
        yield from _peft_expert_tensors(experts)

    names = [entry[0] for entry in entries] + [name for (path, module), group in experts.items()
                                                for name in _peft_expert_names(path, module, group[0].expert_targets)]
    yield from every_stage(names, this_stage)


def _expert_groups(adapters: list[LoraAdapter]) -> dict[tuple[str, str], list[LoraAdapter]]:
    """{(HF path of the experts' parameter, its module): this rank's adapters on it, by expert}, in the model's
    order."""
    groups = {}
    for adapter in adapters:
        if adapter.expert is not None:
            module = next(iter(adapter.A))
            groups.setdefault((adapter.hf_paths[module], module), []).append(adapter)
    return groups


def _peft_expert_names(path: str, module: str, targets: tuple[str, ...] | None = None) -> tuple[str, str]:
    """PEFT's saved names of the A and B of the experts' parameter at `path` (`model.layers.3.mlp.experts.
    gate_up_proj`): peft wraps the module once per targeted parameter, in target_parameters' sorted order,
    the later ones inside (`mlp.experts.lora_A.weight` for down_proj, `mlp.experts.base_layer.lora_A.weight`
    for gate_up_proj when both are targeted). `targets`: the targeted expert modules (default: both)."""
    stem, _, parameter = path.rpartition(".")
    order = sorted(target.rpartition(".")[2] for target in (_EXPERT_MODULES.values() if targets is None else targets))
    nested = "base_layer." * order.index(parameter)
    return tuple(f"base_model.model.{stem}.{nested}lora_{which}.weight" for which in "AB")


def _peft_expert_tensors(groups):
    """(PEFT name, whole tensor) of each experts' parameter: every expert's A and B gathered over EP, laid out as
    peft's ParamWrapper keeps E experts of rank r (peft/tuners/lora/layer.py): A [E * r, in], expert e's rows
    e * r ... (e + 1) * r; B [out, r * E], expert e's columns e, E + e, ... (B.reshape(out, r, E)[..., e])."""
    from megatron.core import parallel_state

    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    for (path, module), adapters in groups.items():
        a_name, b_name = _peft_expert_names(path, module, adapters[0].expert_targets)
        local_a = torch.stack([adapter.A[module].detach() for adapter in adapters])  # [E_local, r, in]
        local_b = torch.stack([adapter.B[module].detach() for adapter in adapters])  # [E_local, out, r]
        whole = []
        for local in (local_a, local_b):
            if ep_size > 1:
                gathered = torch.empty(ep_size * local.numel(), dtype=local.dtype, device=local.device)
                torch.distributed.all_gather_into_tensor(gathered, local.contiguous().reshape(-1), group=ep_group)
                local = gathered.view(ep_size * local.shape[0], *local.shape[1:])
            whole.append(local)
        a, b = whole
        yield a_name, a.reshape(-1, a.shape[-1])
        yield b_name, b.permute(1, 2, 0).reshape(b.shape[1], -1)


def save_peft_adapter(model, config: LoraConfig, out_dir: str, base_model: str, tokenizer=None,
                      is_writer: bool = True) -> None:
    """Write the adapters as a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors, the
    tokenizer) that peft's PeftModel.from_pretrained and vLLM's LoRA load on `base_model`; collective over the
    train ranks, `is_writer` writes. Written into `<out_dir>.tmp` and renamed when complete."""
    import shutil

    from megarl.models.convert import replace_directory

    tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in iter_peft_weights(model)}
    if not is_writer:
        return
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    adapter_config = write_peft_adapter(tensors, config, tmp, base_model)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    replace_directory(tmp, out_dir)
    warn_of_peft_remapping(adapter_config, base_model, out_dir)


def write_peft_adapter(tensors: dict[str, torch.Tensor], config: LoraConfig, directory: str, base_model: str) -> dict:
    """iter_peft_weights' tensors (whole, on the host) and their adapter_config.json into `directory`; that
    config."""
    import json

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, PEFT_ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {  # the fields of peft's LoraConfig that describe these adapters; peft's defaults otherwise
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": os.path.abspath(base_model),
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
        "target_modules": [module for module in config.targets if module not in _EXPERT_MODULES.values()],
        # transformers' fused expert parameters (MoE), which peft adapts as parameters, not modules
        "target_parameters": sorted(f"mlp.{module}" for module in config.targets if module in _EXPERT_MODULES.values())
        or None, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    with open(os.path.join(directory, PEFT_ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=1)
    return adapter_config


def warn_of_peft_remapping(adapter_config: dict, base_model: str, directory: str) -> None:
    remapped = targets_peft_remaps(adapter_config, base_model)
    if remapped:
        print(f"[lora] warning: {directory}: the installed peft reads this adapter's {', '.join(remapped)} targets "
              f"(the dense and shared-expert MLPs) as transformers 4's per-expert modules and moves them onto the "
              f"routed experts (peft issue #3711), so PeftModel loads it wrongly; --lora-load and the merged export "
              f"(--lora-export merged|both) are exact", flush=True)


def targets_peft_remaps(adapter_config: dict, base_model: str) -> list[str]:
    """The target_modules that the installed peft rewrites when it loads `adapter_config` on `base_model`: for some
    MoE families (DeepSeek-V3, GLM-4.5, Mixtral) its transformers-5 conversion takes gate_proj / up_proj / down_proj
    for the experts' pre-fusion modules even when they name dense or shared-expert MLPs (peft 0.21;
    peft/utils/transformers_weight_conversion.py). Asked of peft itself, on a copy of the config."""
    import copy
    import json
    from types import SimpleNamespace

    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
        with open(os.path.join(base_model, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (ImportError, OSError, ValueError):
        return []
    fields = {key: value for key, value in adapter_config.items() if key not in ("peft_type", "task_type")}
    converted = PeftLoraConfig(**copy.deepcopy(fields))
    convert_peft_config_for_transformers(converted, SimpleNamespace(config=SimpleNamespace(model_type=model_type)),
                                         None)
    return [module for module in adapter_config["target_modules"] if module not in set(converted.target_modules)]


# ------------------------------------------------------------ loading ---

# adapter_config.json fields whose non-default values these adapters cannot express (field: its PEFT default)
_PEFT_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
                     "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def read_peft_config(directory: str) -> dict:
    """A PEFT LoRA directory's adapter_config.json (--lora-load), checked: ValueError naming the file and
    field where it holds adapters that megarl's (y = W x + alpha / r * B A x, one rank and alpha for every
    module) are not."""
    import json

    path = os.path.join(directory, PEFT_ADAPTER_CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as error:
        raise ValueError(f"--lora-load {directory}: no PEFT adapter there ({error.strerror}: {path})") from None
    except ValueError as error:
        raise ValueError(f"--lora-load: {path}: not JSON ({error})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"--lora-load: {path}: peft_type {config['peft_type']!r}, not LORA")
    for field, default in _PEFT_UNSUPPORTED.items():
        if config.get(field, default) not in (default, [] if default is None else default):
            raise ValueError(f"--lora-load: {path}: {field} = {config[field]!r} is not supported (megarl's adapters: "
                             f"one rank and alpha for every module, scale alpha / r, no bias); {field} must be "
                             f"{default!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise ValueError(f"--lora-load: {path}: target_modules is the pattern {targets!r}; megarl takes a list of "
                         f"module names (or {ALL_LINEAR!r})")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise ValueError(f"--lora-load: {path}: r = {config.get('r')!r}, not a positive integer")
    known = sorted(f"mlp.{module}" for module in _EXPERT_MODULES.values())
    for parameter in config.get("target_parameters") or []:
        if parameter not in known:
            raise ValueError(f"--lora-load: {path}: target_parameters holds {parameter!r}; megarl adapts the routed "
                             f"experts' {' and '.join(known)}")
    return config


def peft_targets(config: dict) -> list[str]:
    """The HF module names an adapter_config.json targets, megarl's way: its target_modules, and its
    target_parameters as `experts.gate_up_proj` / `experts.down_proj`."""
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    return modules + [parameter.removeprefix("mlp.") for parameter in config.get("target_parameters") or []]


def peft_tensors(directory: str) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT directory by PEFT's saved name (an adapter name `.default.` dropped, as
    save_pretrained writes them)."""
    from safetensors.torch import load_file

    path = os.path.join(directory, PEFT_ADAPTER_WEIGHTS)
    if not os.path.exists(path):
        raise ValueError(f"--lora-load {directory}: no {PEFT_ADAPTER_WEIGHTS} (megarl reads the safetensors file "
                         f"save_pretrained writes)")
    return {name.replace(".default.", "."): tensor for name, tensor in load_file(path).items()}


def _expert_parameter(stem: str, targets: list[str]) -> tuple[str, str] | None:
    """(the experts' module path, the parameter) a saved name's stem stands for (`model.layers.3.mlp.experts.
    base_layer` with both targeted: gate_up_proj; `_peft_expert_names`), or None for a module's adapter."""
    head, found, nested = stem.partition(".mlp.experts")
    if not found or nested.replace("base_layer", "").strip("."):
        return None
    order = sorted(target.rpartition(".")[2] for target in targets if target.startswith("experts."))
    depth = nested.count("base_layer")
    return (f"{head}.mlp.experts", order[depth]) if depth < len(order) else None


def check_peft_adapter(directory: str, base: str, rank: int) -> None:
    """ValueError naming the tensor where the adapter at `directory` was made for another base (a module the
    base lacks, or another width) or rank. Reads only the files' headers."""
    from safetensors import safe_open

    from megarl.models.convert import HFCheckpoint

    targets = peft_targets(read_peft_config(directory))
    weight_map = HFCheckpoint(base).weight_map
    path = os.path.join(directory, PEFT_ADAPTER_WEIGHTS)

    def shape_of(weight: str) -> list[int]:
        with safe_open(os.path.join(base, weight_map[weight]), "pt") as g:
            return list(g.get_slice(weight).get_shape())

    with safe_open(path, "pt") as f:
        for name in f.keys():
            stem, _, which = name.replace(".default.", ".").removeprefix("base_model.model.").rpartition(".lora_")
            if which not in ("A.weight", "B.weight"):
                raise ValueError(f"--lora-load: {path}: {name} is no LoRA A or B weight")
            expert = _expert_parameter(stem, targets)
            experts = 1
            if expert is not None:  # every expert's A and B side by side (peft's ParamWrapper)
                module_path, parameter = expert
                count = sum(1 for weight in weight_map if weight.startswith(f"{module_path}.")
                            and weight.endswith(".down_proj.weight"))
                first = f"{module_path}.0.{'gate_proj' if parameter == 'gate_up_proj' else 'down_proj'}.weight"
                if not count or first not in weight_map:
                    raise ValueError(f"--lora-load: {path} was made for another base: it adapts {module_path}."
                                     f"{parameter}, and --model {base} has no routed experts there")
                out_features, in_features = shape_of(first)
                out_features *= 2 if parameter == "gate_up_proj" else 1
                experts, stem = count, f"{module_path}.{parameter}"
            elif f"{stem}.weight" not in weight_map:
                raise ValueError(f"--lora-load: {path} was made for another base: it adapts {stem}, which --model "
                                 f"{base} does not have")
            else:
                out_features, in_features = shape_of(f"{stem}.weight")
            rank_width = rank * experts
            a = which == "A.weight"
            expected = [rank_width, in_features] if a else [out_features, rank_width]
            shape = list(f.get_slice(name).get_shape())
            if shape != expected:
                other = "rank" if shape[1 if a else 0] == expected[1 if a else 0] else "base"
                raise ValueError(f"--lora-load: {path}: {name} is {shape}, where rank {rank} on --model {base}'s "
                                 f"{stem} ({out_features} x {in_features}) takes {expected}: made for another {other}")


@torch.no_grad()
def load_peft_adapter(model, directory: str) -> None:
    """--lora-load: the PEFT adapter at `directory` into this stage's adapters (apply_lora's, same rank and
    targets: megarl/arguments.py checked them), each rank its shard as initialisation shards it."""
    from megatron.core import parallel_state

    tensors = peft_tensors(directory)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for adapter in adapters_of(model):
        if adapter.expert is not None:  # this expert's rank-r slice of the experts' A and B (_peft_expert_tensors)
            module = next(iter(adapter.A))
            a_name, b_name = _peft_expert_names(adapter.hf_paths[module], module, adapter.expert_targets)
            if a_name not in tensors or b_name not in tensors:
                raise ValueError(f"--lora-load {directory}: no adapter for {adapter.hf_paths[module]}")
            a, b = tensors[a_name], tensors[b_name]
            experts = a.shape[0] // adapter.rank
            adapter.A[module].copy_(a.reshape(experts, adapter.rank, -1)[adapter.expert])
            adapter.B[module].copy_(b.reshape(b.shape[0], adapter.rank, experts)[..., adapter.expert])
            continue
        for module in adapter.A:
            name = f"base_model.model.{adapter.hf_paths[module]}"
            if f"{name}.lora_A.weight" not in tensors or f"{name}.lora_B.weight" not in tensors:
                raise ValueError(f"--lora-load {directory}: no adapter for {adapter.hf_paths[module]} (the run "
                                 f"targets {module} in every layer)")
            a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            if adapter.split == "row":
                a = a.chunk(tp, dim=1)[tp_rank]
            else:
                b = adapter.rank_rows(module, b, tp_rank, tp)
            adapter.A[module].copy_(a)
            adapter.B[module].copy_(b)


# vLLM's LoRA slots come in these ranks (vllm/config/lora.py, MaxLoRARanks); a smaller adapter is padded.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_kwargs(rank: int) -> dict:
    """--lora-sync adapter: the rollout engine's LoRA settings, one adapter slot of the smallest rank that holds
    `rank` (megarl/rollout.py: RolloutEngine)."""
    return dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
