"""HF <-> Megatron weights, driven by the family tables in `families.py`.

`load_hf_weights` fills a (TP/PP-sharded) GPTModel from an HF safetensors
checkpoint, reading one HF tensor at a time. `iter_hf_weights` streams the
model back out as (hf_name, full tensor) pairs, one parameter at a time: it is
the single export path used by the HF exporter and by the trainer -> rollout
weight sync, so it never holds a second full copy of the model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open

from megarl.models import fused_experts
from megarl.models.families import (BUFFER_NAMES, TE_FUSED_NAMES, Family, Rule, family_of, hf_name_prefix, layer_kinds,
                                    num_experts)
from megarl.models.megatron_gpt import head_dim

_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class HFCheckpoint:
    """Lazy reader of an HF safetensors checkpoint (single file or sharded with an index)."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            single = os.path.join(path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, "pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        self.path = path
        self.weight_map = weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}")
        with safe_open(os.path.join(self.path, self.weight_map[name]), "pt") as f:
            return f.get_tensor(name)


def open_checkpoint(path: str, hf_config):
    """The checkpoint at `path` as the family tables name its tensors: gpt-oss's fused experts read as per-expert
    tensors (models/fused_experts.py), any other checkpoint as it is."""
    checkpoint = HFCheckpoint(path)
    if family_of(hf_config).gpt_oss:
        return fused_experts.PerExpertView(checkpoint, num_experts(hf_config))
    return checkpoint


# ------------------------------------------------------------- layouts --------

def _qkv_groups(hf_config) -> tuple[int, int, int]:
    groups = hf_config.num_key_value_heads
    return groups, hf_config.num_attention_heads // groups, head_dim(hf_config)


def interleave_qkv(q, k, v, groups: int, dim: int = 0) -> torch.Tensor:
    """q, k, v of `groups` query groups, each along `dim` -> Megatron's per-query-group interleaving
    [q_g, k_g, v_g for g in groups] along `dim` (whole tensors, or one TP rank's groups)."""
    q, k, v = (t.movedim(dim, 0) for t in (q, k, v))
    tail = q.shape[1:]
    return torch.cat([t.reshape(groups, -1, *tail) for t in (q, k, v)], dim=1).reshape(-1, *tail).movedim(0, dim)


def merge_qkv(q, k, v, hf_config) -> torch.Tensor:
    """[q; k; v] -> Megatron's per-query-group interleaving [q_g, k_g, v_g for g in groups]."""
    return interleave_qkv(q, k, v, hf_config.num_key_value_heads)


def split_qkv(qkv, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, q_per_group, dim = _qkv_groups(hf_config)
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (q_per_group + 2) * dim, *tail).split([q_per_group * dim, dim, dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def interleave_gated_qkv(q_and_gate, k, v, groups: int, head_dim: int, dim: int = 0) -> torch.Tensor:
    """HF's gated q_proj output ([q_h; gate_h] per head) with k, v of `groups` query groups, each along `dim` ->
    Megatron's linear_qkv under attention_output_gate: per query group [its q heads, their gates, k_g, v_g]
    (attention.py: get_query_key_value_tensors splits it so); whole tensors, or one TP rank's groups."""
    q_and_gate, k, v = (t.movedim(dim, 0) for t in (q_and_gate, k, v))
    tail = q_and_gate.shape[1:]
    per_head = q_and_gate.reshape(groups, -1, 2, head_dim, *tail)
    q, gate = per_head[:, :, 0].reshape(groups, -1, *tail), per_head[:, :, 1].reshape(groups, -1, *tail)
    return torch.cat([q, gate, k.reshape(groups, head_dim, *tail), v.reshape(groups, head_dim, *tail)],
                     dim=1).reshape(-1, *tail).movedim(0, dim)


def merge_gated_qkv(q_and_gate, k, v, hf_config) -> torch.Tensor:
    return interleave_gated_qkv(q_and_gate, k, v, hf_config.num_key_value_heads, head_dim(hf_config))


def split_gated_qkv(qkv, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gated_qkv`."""
    groups, q_per_group, dim = _qkv_groups(hf_config)
    tail = qkv.shape[1:]
    q, gate, k, v = qkv.reshape(groups, (2 * q_per_group + 2) * dim, *tail).split(
        [q_per_group * dim, q_per_group * dim, dim, dim], dim=1)
    q_and_gate = torch.stack([q.reshape(groups, q_per_group, dim, *tail),
                              gate.reshape(groups, q_per_group, dim, *tail)], dim=2)
    return q_and_gate.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def gdn_sections(hf_config) -> list[int]:
    """Row counts of a Gated DeltaNet's q, k, v (the conv1d's channels; in_proj_qkv's rows)."""
    key = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
    return [key, key, hf_config.linear_num_value_heads * hf_config.linear_value_head_dim]


MAMBA_LAYOUTS = ("mamba_in_proj", "mamba_conv")


def mamba_sections(hf_config, layout: str) -> list[int]:
    """Row counts of a Mamba-2 mixer's in_proj parts [z, x, B, C, dt] (`mamba_in_proj`) or conv1d channels
    [x, B, C] (`mamba_conv`), each split over TP by heads (z, x, dt) or groups (B, C)."""
    return mamba_parts(hf_config.mamba_num_heads, hf_config.mamba_head_dim, hf_config.n_groups,
                       hf_config.ssm_state_size, layout)


def mamba_parts(heads: int, head_dim: int, groups: int, state: int, layout: str) -> list[int]:
    """`mamba_sections` from the sizes (Megatron's config names them otherwise: models/lora.py)."""
    inner, states = heads * head_dim, groups * state
    conv = [inner, states, states]
    return [inner, *conv, heads] if layout == "mamba_in_proj" else conv


def _rank_pieces(pieces: list[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
    """cat of each piece's TP chunk on dim 0: Megatron's column-parallel layout of several outputs in one
    linear (each rank computes its share of each)."""
    return torch.cat([piece.chunk(tp_size, dim=0)[tp_rank] for piece in pieces], dim=0)


def unrank_pieces(shards: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """Inverse of `_rank_pieces` from every TP rank's shard: the whole pieces, of `sizes` rows in all."""
    tp = len(shards)
    per_rank = [shard.split([size // tp for size in sizes], dim=0) for shard in shards]
    return [_cat([pieces[n] for pieces in per_rank]) for n in range(len(sizes))]


def to_megatron_shard(rule: Rule, hf: list[torch.Tensor], hf_config, tp_rank: int, tp_size: int,
                      vocab_rows: int) -> torch.Tensor:
    """This TP rank's shard of the Megatron parameter built from the HF tensors."""
    if rule.layout in ("replicated", "expert", "expert_up"):
        return hf[0]
    if rule.layout == "expert_gate_up":
        return torch.cat(hf, dim=0)
    if rule.layout == "column":
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if rule.layout == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if rule.layout == "vocab":
        padded = hf[0].new_zeros(vocab_rows, *hf[0].shape[1:])
        padded[: hf[0].shape[0]] = hf[0]
        return padded.chunk(tp_size, dim=0)[tp_rank]
    if rule.layout == "qkv":
        return merge_qkv(*hf, hf_config).chunk(tp_size, dim=0)[tp_rank]
    if rule.layout == "gate_up":
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0)
    if rule.layout == "gated_qkv":
        return merge_gated_qkv(*hf, hf_config).chunk(tp_size, dim=0)[tp_rank]
    if rule.layout in ("gdn_in_proj", "gdn_conv"):
        return _rank_pieces([*hf[0].split(gdn_sections(hf_config), dim=0), *hf[1:]], tp_rank, tp_size)
    if rule.layout in MAMBA_LAYOUTS:
        return _rank_pieces(list(hf[0].split(mamba_sections(hf_config, rule.layout), dim=0)), tp_rank, tp_size)
    raise ValueError(f"unknown layout {rule.layout!r}")


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, but a single tensor passes through as it is (a view: no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def to_hf_tensors(rule: Rule, shards: list[torch.Tensor], hf_config) -> list[torch.Tensor]:
    """Inverse of `to_megatron_shard`, from the shards of every TP rank.

    With one shard (TP=1) nothing is copied that a view can express: the
    results may be views of the shards (consumers copy them anyway)."""
    if rule.layout in ("replicated", "expert", "expert_up"):
        return [shards[0]]
    if rule.layout == "expert_gate_up":
        return list(shards[0].chunk(2, dim=0))
    if rule.layout == "row":
        return [_cat(shards, dim=1)]
    if rule.layout == "column":
        return [_cat(shards, dim=0)]
    if rule.layout == "vocab":
        return [_cat(shards, dim=0)[: hf_config.vocab_size]]
    if rule.layout == "qkv":
        return list(split_qkv(_cat(shards, dim=0), hf_config))
    if rule.layout == "gate_up":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return [_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]
    if rule.layout == "gated_qkv":
        return list(split_gated_qkv(_cat(shards, dim=0), hf_config))
    if rule.layout in ("gdn_in_proj", "gdn_conv"):
        qkv_sizes = gdn_sections(hf_config)
        heads = hf_config.linear_num_value_heads
        extra = [qkv_sizes[2], heads, heads] if rule.layout == "gdn_in_proj" else []  # z, b, a
        pieces = unrank_pieces(shards, qkv_sizes + extra)
        return [torch.cat(pieces[:3], dim=0), *pieces[3:]]
    if rule.layout in MAMBA_LAYOUTS:
        return [_cat(unrank_pieces(shards, mamba_sections(hf_config, rule.layout)))]
    raise ValueError(f"unknown layout {rule.layout!r}")


# ------------------------------------------------------------ naming ---------

def _rule_table(family: Family, hf_config) -> dict[str, Rule]:
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    table = {rule.megatron: rule for rule in family.rules(tied) + family.layer_rules}
    for rule in family.layer_rules:  # the Transformer Engine spec's names for the same tensors
        for local, fused in TE_FUSED_NAMES.items():
            if rule.megatron.endswith(local):
                table[rule.megatron.replace(local, fused)] = rule
    return table


# A routed expert's weights: the local spec's SequentialMLP (`local_experts.<j>.linear_fc1.weight`) or Transformer
# Engine's grouped GEMM (`linear_fc1.weight<j>`), <j> this EP rank's local index of the expert.
_EXPERT_NAME = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)"
                          r"|(linear_fc[12])\.(weight|bias)(\d+))")
EXPERT_LAYOUTS = ("expert", "expert_gate_up", "expert_up")


def _expert_parallel() -> tuple[int, int]:
    """(EP rank, EP size) of this rank, (0, 1) outside Megatron's parallel state or without experts."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _layer_key(name: str) -> str:
    """A Megatron name's decoder layer ('decoder.layers.3'), or the name itself outside the layers."""
    match = _LAYER_NAME.fullmatch(name)
    return f"decoder.layers.{match.group(1)}" if match else name


def _local_entries(model, hf_config) -> list[tuple[str, Rule, dict | None, torch.nn.Parameter]]:
    """(canonical name, rule, index, parameter) for every parameter of this stage; index is None for
    global parameters, else {"i": global layer} and, for a routed expert, "e": the expert's index on
    this EP rank (`_ep_indices` gives the global ones)."""
    gpt = unwrap(model)
    table = _rule_table(family_of(hf_config), hf_config)
    entries, unknown = [], []
    # Parameters, and the buffers that are weights of the checkpoint (BUFFER_NAMES: DeepSeek-V3's expert bias)
    buffers = [(name, buffer) for name, buffer in gpt.named_buffers() if name.endswith(BUFFER_NAMES)]
    tensors = [*gpt.named_parameters(), *buffers]
    # Each buffer with its layer's parameters: a weight sync then streams a decoder block in one go (an engine
    # processes a block once the stream has moved past it: rollout._load_in_place; back at it, again).
    first = {}
    for n, (name, _) in enumerate(tensors):
        first.setdefault(_layer_key(name), n)
    tensors.sort(key=lambda item: first[_layer_key(item[0])])  # stable: the model's order otherwise
    for name, param in tensors:
        if getattr(param, "lora_adapter", False):  # LoRA adapters (models/lora.py): exported merged into their base
            continue
        index = None
        match = _LAYER_NAME.fullmatch(name)
        if match:
            index = {"i": gpt.decoder.layers[int(match.group(1))].layer_number - 1}  # global, 0-based
            rest = match.group(2)
            expert = _EXPERT_NAME.fullmatch(rest)
            if expert:
                local, linear, kind = expert.group(1, 2, 3) if expert.group(1) else expert.group(6, 4, 5)
                index["e"] = int(local)
                rest = f"mlp.experts.local_experts.{{e}}.{linear}.{kind}"
            key = "decoder.layers.{i}." + rest
        else:
            key = name
        if key not in table:
            unknown.append(name)
            continue
        entries.append((key, table[key], index, param))
    if unknown:
        raise KeyError(f"no {family_of(hf_config).name} conversion rule for Megatron parameters {unknown}")
    return entries


def _ep_indices(index: dict, hf_config, ep_rank: int, ep_size: int) -> dict:
    """The index with a local expert number made global: EP rank r holds experts [r * E/EP, (r + 1) * E/EP)
    (Megatron's MoELayer: local_expert_indices)."""
    if index is None or "e" not in index:
        return index
    return {**index, "e": ep_rank * (num_experts(hf_config) // ep_size) + index["e"]}


def _hf_names(rule: Rule, index: dict | None, prefix: str = "model.") -> list[str]:
    """The rule's HF tensor names for this layer / expert, under the checkpoint's prefix for the text model
    (`families.hf_name_prefix`: the tables are written with `model.`; lm_head has no prefix)."""
    names = [name.format(**(index or {})) for name in rule.hf]
    return [prefix + name.removeprefix("model.") if name.startswith("model.") else name for name in names]


def expected_hf_names(hf_config, output_layer: bool = True) -> list[str]:
    """Every HF tensor name a model of this config is built from (each layer's rules for its kind, every
    routed expert, lm_head unless tied or not `output_layer`: a critic's trunk), under the checkpoint's prefix,
    in the tables' order."""
    family = family_of(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    prefix = hf_name_prefix(hf_config)
    kinds = layer_kinds(hf_config)
    rules = [rule for rule in family.rules(tied)
             if rule.export and (output_layer or rule.megatron != "output_layer.weight")]
    names = [name for rule in rules for name in _hf_names(rule, None, prefix)]
    for layer in range(hf_config.num_hidden_layers):
        for rule in family.layer_rules:
            if rule.layer_type is not None and kinds is not None and rule.layer_type not in kinds[layer]:
                continue
            experts = range(num_experts(hf_config)) if rule.layout in EXPERT_LAYOUTS else (None,)
            for expert in experts:
                index = {"i": layer} if expert is None else {"i": layer, "e": expert}
                names += _hf_names(rule, index, prefix)
    return names


def check_checkpoint_tensors(hf_config, checkpoint: HFCheckpoint, output_layer: bool = True) -> None:
    """Raise, in one line, if the checkpoint lacks a tensor the model needs (before any rank builds it)."""
    present = set(checkpoint.weight_map)
    missing = [name for name in expected_hf_names(hf_config, output_layer) if name not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{checkpoint.path}: checkpoint has no tensor {missing[0]!r}{more}, which a "
                         f"{family_of(hf_config).name} model of this config.json needs")


# ------------------------------------------------------------- load/export ---

# What a multimodal checkpoint (Qwen3.5's ...ForConditionalGeneration) holds beside its language model:
# megarl trains and serves the text model only.
_NOT_TEXT_PREFIXES = {"model.visual.": "vision-tower", "mtp.": "multi-token-prediction (MTP) head"}


def mtp_layer_names(hf_config, names) -> list[str]:
    """The names among `names` of a DeepSeek-V3 or GLM-4.5 checkpoint's multi-token-prediction layers: its MTP modules
    are saved as decoder layers after the last one (`model.layers.{num_hidden_layers + j}.*`, j <
    num_nextn_predict_layers), which megarl neither trains nor serves (transformers does not build them either)."""
    if not family_of(hf_config).mtp_layers_after_last:
        return []
    prefix = hf_name_prefix(hf_config) + "layers."
    return [name for name in names if name.startswith(prefix)
            and int(name[len(prefix):].split(".", 1)[0]) >= hf_config.num_hidden_layers]


def _report_left_out(checkpoint: HFCheckpoint, prefix: str, hf_config=None) -> None:
    """One line on the first rank naming the checkpoint's tensors that are not the text model's, when it has
    any: they are never read (a multimodal checkpoint's vision tower and MTP head, DeepSeek-V3's and GLM-4.5's MTP layers)."""
    left_out = []
    if prefix != "model.":
        counts = {what: sum(name.startswith(start) for name in checkpoint.weight_map)
                  for start, what in _NOT_TEXT_PREFIXES.items()}
        left_out = [f"{count} {what} tensors ({start}*)" for (start, what), count
                    in zip(_NOT_TEXT_PREFIXES.items(), counts.values()) if count]
    mtp = mtp_layer_names(hf_config, checkpoint.weight_map) if hf_config is not None else []
    if mtp:
        left_out.append(f"{len(mtp)} multi-token-prediction (MTP) layer tensors ({prefix}layers."
                        f"{hf_config.num_hidden_layers}+.*, num_nextn_predict_layers="
                        f"{getattr(hf_config, 'num_nextn_predict_layers', None)})")
    if left_out and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"megarl: {checkpoint.path}: left out {' and '.join(left_out)}; megarl trains the language model",
              flush=True)

def load_hf_weights(model, hf_path: str, hf_config) -> None:
    """Copy an HF checkpoint into this rank's shard of the model, tensor by tensor."""
    from megatron.core import parallel_state

    checkpoint = open_checkpoint(hf_path, hf_config)
    prefix = hf_name_prefix(hf_config)
    _report_left_out(checkpoint, prefix, hf_config)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_rank, ep_size = _expert_parallel()
    vocab_rows = unwrap(model).vocab_size
    with torch.no_grad():
        for key, rule, index, param in _local_entries(model, hf_config):
            names = _hf_names(rule, _ep_indices(index, hf_config, ep_rank, ep_size), prefix)
            hf = [checkpoint.get(name) for name in names]
            shard = to_megatron_shard(rule, hf, hf_config, tp_rank, tp_size, vocab_rows)
            if shard.shape != param.shape:
                raise ValueError(f"{hf_path}: {names} give shape {tuple(shard.shape)} for "
                                 f"{key} ({index}) but the model has {tuple(param.shape)}")
            param.copy_(shard)


def iter_hf_weights(model, hf_config, bucket_bytes: int = 256 * 2**20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for the whole model on every rank of the train world.

    Parameters are gathered over their TP group in buckets of about
    `bucket_bytes` (one all-gather per bucket) and, with pipeline parallelism,
    broadcast from the stage that owns them. At most one bucket is held at a
    time. The order is the model's (stage by stage, layer by layer), rebuilt on
    every call. Tensors may be views of the model's parameters or of the
    bucket: consumers copy what they keep.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    prefix = hf_name_prefix(hf_config)
    ep_rank, ep_size = _expert_parallel()
    ep_group = parallel_state.get_expert_model_parallel_group() if ep_size > 1 else None
    entries = [e for e in _local_entries(model, hf_config) if e[1].export]

    def this_stage():
        for bucket in _buckets(entries, bucket_bytes, tp_size, ep_size):
            gathered = _gather_tp_shards(bucket, tp_group, tp_size)
            gathered = _gather_experts(bucket, gathered, ep_group, ep_size, ep_rank)
            for (_, rule, index, _), sources in zip(bucket, gathered):
                for source_ep_rank, shards in sources:
                    names = _hf_names(rule, _ep_indices(index, hf_config, source_ep_rank, ep_size), prefix)
                    yield from zip(names, to_hf_tensors(rule, shards, hf_config))

    names = [name for _, rule, index, _ in entries
             for r in (range(ep_size) if rule.layout in EXPERT_LAYOUTS else (ep_rank,))
             for name in _hf_names(rule, _ep_indices(index, hf_config, r, ep_size), prefix)]
    if family_of(hf_config).gpt_oss:  # the checkpoint's fused expert tensors, a layer's once all its experts passed
        yield from fused_experts.fuse(every_stage(names, this_stage), num_experts(hf_config))
    else:
        yield from every_stage(names, this_stage)


def every_stage(names: list[str], this_stage) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's (name, tensor) pairs on every rank of the train world, stage by stage:
    `this_stage()` yields this stage's, named `names` in that order (collective over this stage's TP
    group if its tensors are gathered there); each tensor goes from its stage to the others by a
    broadcast over the PP group (the shapes with it), and the names once, by one all-gather. The
    single loop over stages of the merged export (iter_hf_weights) and of the LoRA adapters'
    (lora.iter_peft_weights)."""
    from megatron.core import parallel_state

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        yield from this_stage()
        return
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    stage_names = [None] * pp_size
    dist.all_gather_object(stage_names, names, group=pp_group)
    for stage in range(pp_size):
        src = dist.get_global_rank(pp_group, stage)
        if stage != my_stage:
            for name in stage_names[stage]:
                yield name, _broadcast_tensor(None, src, pp_group)
            continue
        count = 0
        for name, tensor in this_stage():
            if count >= len(names) or name != names[count]:  # the others would take it under another name
                raise RuntimeError(f"pipeline stage {stage} yielded {name!r} where its names say "
                                   f"{names[count] if count < len(names) else 'nothing more'}")
            count += 1
            _broadcast_tensor(tensor, src, pp_group)
            yield name, tensor
        if count != len(names):
            raise RuntimeError(f"pipeline stage {stage} yielded {count} tensors of its {len(names)} names")


def _buckets(entries, bucket_bytes: int, tp_size: int, ep_size: int = 1):
    """Consecutive entries whose gathered size stays under bucket_bytes (at least one each)."""
    bucket, size = [], 0
    for entry in entries:
        param = entry[3]
        nbytes = param.numel() * param.element_size() * (ep_size if entry[1].layout in EXPERT_LAYOUTS else tp_size)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def _gather_experts(bucket, shards, ep_group, ep_size: int, ep_rank: int) -> list[list[tuple[int, list]]]:
    """For each entry, [(EP rank, its shards there)]: every EP rank's copy of a routed expert's weight (one
    all-gather over the EP group per bucket: each EP rank holds the same local experts' shapes in the same
    order), and this rank's alone for every other parameter (the same on every EP rank)."""
    experts = [n for n, entry in enumerate(bucket) if entry[1].layout in EXPERT_LAYOUTS]
    result = [[(ep_rank, entry_shards)] for entry_shards in shards]
    if ep_size == 1 or not experts:
        return result
    flat = torch.cat([shards[n][0].reshape(-1) for n in experts])
    everyone = torch.empty(ep_size * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(everyone, flat, group=ep_group)
    per_rank = everyone.view(ep_size, -1)
    offset = 0
    for n in experts:
        shape, numel = shards[n][0].shape, shards[n][0].numel()
        result[n] = [(r, [per_rank[r, offset: offset + numel].view(shape)]) for r in range(ep_size)]
        offset += numel
    return result


def _exported(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard as the HF model has it: with LoRA adapters on its linear (models/lora.py,
    `lora_delta`), the merged W + scale * B A, summed in fp32."""
    delta = getattr(param, "lora_delta", None)
    if delta is None:
        return param.detach()
    return (param.detach().float() + delta()).to(param.dtype)


def _gather_tp_shards(bucket, tp_group, tp_size: int) -> list[list[torch.Tensor]]:
    """For each entry, the list of its shards on every TP rank, with one all-gather per bucket."""
    if tp_size == 1:
        return [[_exported(entry[3])] for entry in bucket]
    split = [entry for entry in bucket if entry[1].layout not in ("replicated",) + EXPERT_LAYOUTS]
    gathered = {}
    if split:
        flat = torch.cat([_exported(entry[3]).reshape(-1) for entry in split])
        everyone = torch.empty(tp_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(everyone, flat, group=tp_group)
        per_rank = everyone.view(tp_size, -1)
        offset = 0
        for entry in split:
            param = entry[3]
            gathered[id(param)] = [per_rank[r, offset: offset + param.numel()].view(param.shape)
                                   for r in range(tp_size)]
            offset += param.numel()
    return [gathered.get(id(entry[3]), [_exported(entry[3])]) for entry in bucket]


def _broadcast_tensor(tensor: torch.Tensor | None, src: int, group) -> torch.Tensor:
    """Broadcast a tensor whose shape only the source knows (dtype: the model's)."""
    from megarl import accelerator

    shape = torch.zeros(5, dtype=torch.int64, device=accelerator.device())
    if tensor is not None:
        shape[0] = tensor.dim()
        shape[1: 1 + tensor.dim()] = torch.tensor(tensor.shape)
        shape[4] = _DTYPE_CODES.index(tensor.dtype)
    dist.broadcast(shape, src, group=group)
    if tensor is None:
        dims = shape.tolist()
        tensor = torch.empty(dims[1: 1 + dims[0]], dtype=_DTYPE_CODES[dims[4]], device=accelerator.device())
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src, group=group)
    return tensor


_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16]


def save_hf_checkpoint(model, hf_config, out_dir: str, tokenizer=None, is_writer: bool = True,
                       shard_bytes: int = 2 * 2**30, source_dir: str | None = None) -> None:
    """Write the model as an HF checkpoint (safetensors shards, config, tokenizer).

    Every rank of the train world must call this (the export gathers across
    ranks); only `is_writer` writes. `source_dir`'s generation_config.json (stop
    tokens) is carried over when present. Shards are written as the stream passes,
    into `<out_dir>.tmp`, which is renamed to `out_dir` only when complete, so
    an interrupted save never looks like a checkpoint.
    """
    import shutil

    from safetensors.torch import save_file

    tmp = out_dir.rstrip("/") + ".tmp"
    # A multimodal checkpoint's language model is written as a text checkpoint of its family (names under
    # `model.`, the family's ...ForCausalLM): the vision tower and MTP head were never loaded, so they are
    # the source checkpoint's, unchanged by training.
    prefix = hf_name_prefix(hf_config)
    written_config = hf_config
    if prefix != "model.":
        import copy

        written_config = copy.deepcopy(hf_config)
        written_config.architectures = [family_of(hf_config).hf_architectures[0]]
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"part-{len(files):05d}.safetensors"
        save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({tensor_name: name for tensor_name in shard})
        shard, size = {}, 0

    for name, tensor in iter_hf_weights(model, hf_config):
        if not is_writer:
            continue
        name = "model." + name.removeprefix(prefix) if name.startswith(prefix) else name
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    if not is_writer:
        return
    if shard or not files:
        flush()
    if len(files) == 1:
        os.rename(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
    else:
        for index, name in enumerate(files):
            final = f"model-{index + 1:05d}-of-{len(files):05d}.safetensors"
            os.rename(os.path.join(tmp, name), os.path.join(tmp, final))
            weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    written_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if source_dir and os.path.exists(os.path.join(source_dir, "generation_config.json")):
        shutil.copy(os.path.join(source_dir, "generation_config.json"), tmp)
    replace_directory(tmp, out_dir)


def replace_directory(tmp: str, out_dir: str) -> None:
    """Publish the complete export `tmp` as `out_dir`, replacing an older one."""
    import shutil

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
