"""torchrun worker (2 ranks): the tiny model with LoRA adapters on every linear, the same adapters
(A as initialised, B drawn from a fixed seed, whole, then sharded as the layer shards it) at TP=2 and
then at TP=1 in the same launch; a loss on fixed random weights of the real vocabulary, backward.
Rank 0 writes a JSON report: the TP=2 logits and adapter gradients (gathered whole) against TP=1's,
in ulps (tests/helpers.py: two fp32 paths), and the gradients' scale; and, from a TP=2 pass with the
adapters' dropout on, how far the replicated A's gradients of the two TP ranks are apart (0: the same masks)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import fp32_paths_ulps


def run(model_dir: str, tp: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from megatron.core import parallel_state, tensor_parallel
    from transformers import AutoConfig

    from megarl.kernels import naive
    from megarl.models.convert import load_hf_weights
    from megarl.models.families import family_of
    from megarl.models.lora import LoraConfig, apply_lora, resolve_targets
    from megarl.models.megatron_gpt import build_gpt_model

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tp_rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, model_dir, hf_config)
    config = LoraConfig(4, 8.0, 0.0, resolve_targets(["all-linear"], family_of(hf_config)))
    apply_lora(model, hf_config, config, seed=5)
    adapters = {name: module for name, module in model.named_modules() if name.endswith("_lora")}
    with torch.no_grad():  # B as trained adapters have it: drawn whole, sharded as the layer's output rows
        for index, (name, adapter) in enumerate(sorted(adapters.items())):
            for module, b in adapter.B.items():
                rows = b.shape[0] * (tp if adapter.split == "column" else 1)
                whole = torch.randn(rows, b.shape[1], generator=torch.Generator().manual_seed(index)) * 0.1
                b.copy_(whole.chunk(tp, dim=0)[tp_rank] if adapter.split == "column" else whole)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, hf_config.vocab_size, (2, 10), generator=generator)
    weights = torch.randn(2, 10, hf_config.vocab_size, generator=generator)
    logits = model(tokens, torch.arange(10).expand(2, 10), attention_mask=None)  # [b, s, V/TP]
    width = logits.shape[-1]
    shard = torch.zeros(2, 10, width)
    real = weights[..., tp_rank * width: (tp_rank + 1) * width]
    shard[..., : real.shape[-1]] = real
    (logits * shard).sum().backward()  # the ranks' parts sum to the whole loss
    whole_logits = naive._all_gather_last_dim(logits.detach(), group)[..., : hf_config.vocab_size]
    grads = {}
    for name, adapter in adapters.items():
        for kind, params in (("A", adapter.A), ("B", adapter.B)):
            for module, param in params.items():
                grad = param.grad
                dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
                if dim is not None and tp > 1:
                    parts = [torch.empty_like(grad) for _ in range(tp)]
                    dist.all_gather(parts, grad.contiguous(), group=group)
                    grad = torch.cat(parts, dim=dim)
                grads[f"{name}.{kind}.{module}"] = grad
    if tp > 1:  # with dropout, a replicated A must see the same mask (so the same gradient) on every TP rank
        model.zero_grad()
        model.train()
        for adapter in adapters.values():
            adapter.dropout = 0.5
        (model(tokens, torch.arange(10).expand(2, 10), attention_mask=None) * shard).sum().backward()
        replicated = torch.cat([param.grad.flatten() for adapter in adapters.values() if adapter.split == "column"
                                for param in adapter.A.values()])
        everyone = [torch.empty_like(replicated) for _ in range(tp)]
        dist.all_gather(everyone, replicated, group=group)
        grads["dropout_replicated_A_rank_difference"] = (everyone[1] - everyone[0]).abs().max()
        grads["dropout_replicated_A_max"] = replicated.abs().max()
    parallel_state.destroy_model_parallel()
    return whole_logits, grads


def main():
    from megarl import accelerator

    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    accelerator.apply_megatron_shims()
    logits2, grads2 = run(model_dir, 2)
    logits1, grads1 = run(model_dir, 1)
    if dist.get_rank() == 0:
        dropout = {name: grads2.pop(name).item() for name in ("dropout_replicated_A_rank_difference",
                                                               "dropout_replicated_A_max")}
        assert grads1.keys() == grads2.keys(), (sorted(grads1), sorted(grads2))
        report = {**dropout, "logits_ulps": fp32_paths_ulps(logits2, logits1),
                  "grad_ulps": {name: fp32_paths_ulps(grads2[name], grads1[name]) for name in grads1},
                  "grad_max": {name: grads1[name].abs().max().item() for name in grads1},
                  "shapes": {name: list(grads2[name].shape) for name in grads2}}
        Path(out).write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
