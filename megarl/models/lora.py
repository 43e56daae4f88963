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
Initialisation is drawn on the host from a generator seeded by (--seed, layer, module), whole,
and then sharded: every TP, DP and PP layout starts from the same adapters.

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

Not served (refused at start by megarl/arguments.py): Transformer Engine's layer-norm-fused
linears (their input is the un-normalised hidden state), sequence parallelism, pipeline and
context parallelism (untested: their gradient reductions of a frozen tied embedding).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from megarl.models.convert import interleave_qkv, unwrap
from megarl.models.families import Family, family_of

ALL_LINEAR = "all-linear"
_LAYER_PREFIX = "decoder.layers.{i}."
# Family rule layouts of the decoder layers' linear weights, and how TP splits each.
_LINEAR_LAYOUTS = {"qkv": "column", "gate_up": "column", "column": "column", "row": "row"}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # HF module names

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def linear_modules(family: Family) -> dict[str, tuple[str, tuple[str, ...]]]:
    """{Megatron linear's path in a layer ('self_attention.linear_qkv'): (layout, its HF modules in fused
    order ('q_proj', 'k_proj', 'v_proj'))}, read off the family's conversion rules."""
    linears = {}
    for rule in family.layer_rules:
        if rule.layout in _LINEAR_LAYOUTS and rule.megatron.endswith(".weight") and \
                rule.megatron.startswith(_LAYER_PREFIX):
            path = rule.megatron.removeprefix(_LAYER_PREFIX).removesuffix(".weight")
            linears[path] = (rule.layout, tuple(name.rsplit(".", 2)[-2] for name in rule.hf))
    return linears


def resolve_targets(targets: list[str], family: Family) -> tuple[str, ...]:
    """--lora-target-modules -> the HF module names they cover, in the model's order; ValueError naming
    the first name the family does not have."""
    linears = linear_modules(family)
    every = [module for _, modules in linears.values() for module in modules]
    by_megatron = {path.rsplit(".", 1)[-1]: modules for path, (_, modules) in linears.items()}
    chosen = set()
    for target in targets:
        if target == ALL_LINEAR:
            chosen.update(every)
        elif target in every:
            chosen.add(target)
        elif target in by_megatron:
            chosen.update(by_megatron[target])
        else:
            raise ValueError(f"--lora-target-modules {target!r}: the {family.name} family has no such linear; it has "
                             f"{', '.join(every)} (or Megatron's {', '.join(by_megatron)}), or {ALL_LINEAR}")
    return tuple(module for module in every if module in chosen)


def _seed(seed: int, layer: int, module: str) -> int:
    """A generator seed per (run seed, global layer, HF module), the same on every rank."""
    return (seed * 1_000_003 + layer * 1009 + sum(ord(c) * 31 ** i for i, c in enumerate(module))) % 2**63


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear: an (A, B) pair per targeted HF module inside it."""

    def __init__(self, base, layout: str, modules: tuple[str, ...], config: LoraConfig, layer: int, seed: int):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.layout, self.split = layout, _LINEAR_LAYOUTS[layout]
        self.scale, self.rank, self.dropout = config.scale, config.rank, config.dropout
        self.enabled = True
        self.modules = modules  # every HF module of the fused linear, in its order
        conf = base.config
        self.groups = conf.num_query_groups // tp  # this rank's query groups (qkv)
        if layout == "qkv":
            full_out = {modules[0]: conf.num_attention_heads * conf.kv_channels,
                        modules[1]: conf.num_query_groups * conf.kv_channels,
                        modules[2]: conf.num_query_groups * conf.kv_channels}
        else:
            full_out = {module: base.output_size // len(modules) for module in modules}
        self.local_out = {module: out // tp if self.split == "column" else out for module, out in full_out.items()}
        in_features = base.input_size
        device, dtype = base.weight.device, base.weight.dtype
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for module in modules:
            if module not in config.targets:
                continue
            generator = torch.Generator().manual_seed(_seed(seed, layer, module))
            bound = 1.0 / math.sqrt(in_features)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]
            a = torch.empty(config.rank, in_features).uniform_(-bound, bound, generator=generator)
            if self.split == "row":
                a = a.chunk(tp, dim=1)[tp_rank]
            self.A[module] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            self.B[module] = torch.nn.Parameter(torch.zeros(self.local_out[module], config.rank, device=device,
                                                            dtype=dtype))
            split = self.B[module] if self.split == "column" else self.A[module]
            set_tensor_model_parallel_attributes(split, True, 0 if self.split == "column" else 1, 1)
            for param in (self.A[module], self.B[module]):
                param.lora_adapter = True  # convert._local_entries: not a weight of the HF model

    def _combine(self, parts: dict[str, torch.Tensor], lead: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Per-module outputs along the last dim -> the fused linear's local output layout (zeros for the
        modules without an adapter)."""
        tensors = [parts[module] if module in parts else like.new_zeros(*lead, self.local_out[module])
                   for module in self.modules]
        if self.layout == "qkv":
            return interleave_qkv(*tensors, groups=self.groups, dim=-1)
        return torch.cat(tensors, dim=-1) if len(tensors) > 1 else tensors[0]

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input: the same mask on every TP rank where the input is replicated
        (column: Megatron's data-parallel RNG, seeded alike over TP), one per rank where it is split (row:
        the model-parallel RNG). Both trackers are replayed by activation recomputation."""
        if not (self.dropout and self.training):
            return x
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        with tracker.fork(get_data_parallel_rng_tracker_name()) if self.split == "column" else tracker.fork():
            return torch.nn.functional.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x of the base's input `x`, in the base's local output layout."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        x = self._dropped(x)
        names = list(self.A)
        a = torch.cat([self.A[name] for name in names]) if len(names) > 1 else self.A[names[0]]
        h = x @ a.t()  # [..., adapters * r]
        if self.split == "row":
            h = reduce_from_tensor_model_parallel_region(h)
            return self.scale * (h @ self.B[names[0]].t())
        h = copy_to_tensor_model_parallel_region(h)
        parts = {name: part @ self.B[name].t() for name, part in zip(names, h.split(self.rank, dim=-1))}
        return self.scale * self._combine(parts, tuple(x.shape[:-1]), x)

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

        axis = {f"B.{name}": 0 for name in self.B} if self.split == "column" else \
            {f"A.{name}": 1 for name in self.A}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets)


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
    if gpt.config.sequence_parallel:
        raise ValueError("--lora-rank with sequence parallelism is not supported yet")
    gpt.requires_grad_(False)
    adapters = []
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1  # global, 0-based
        for path, (layout, modules) in linear_modules(family_of(hf_config)).items():
            if not set(modules) & set(config.targets):
                continue
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            base = getattr(parent, name)
            expected = RowParallelLinear if _LINEAR_LAYOUTS[layout] == "row" else ColumnParallelLinear
            if type(base) is not expected:  # Transformer Engine's linears (a layer norm fused in) differ
                raise ValueError(f"--lora-rank: {path} is {type(base).__name__}, not Megatron's "
                                 f"{expected.__name__}; LoRA needs the local layer spec")
            if _LINEAR_LAYOUTS[layout] == "row" and not base.input_is_parallel:
                raise ValueError(f"--lora-rank: {path} takes an unsplit input; the adapter expects a split one")
            adapter = LoraAdapter(base, layout, modules, config, index, seed)
            parent.add_module(f"{name}_lora", adapter)
            base.register_forward_hook(_hook(adapter))
            base.weight.lora_delta = adapter.delta_weight
            adapters.append(adapter)
    if gpt.config.recompute_granularity == "full" and gpt.pre_process:
        gpt.embedding.register_forward_hook(_require_input_grad)
    return adapters


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
                      resolve_targets(args.lora_target_modules, family_of(hf_config)))
