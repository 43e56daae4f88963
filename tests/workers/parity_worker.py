"""torchrun worker: load an HF checkpoint into Megatron at the given TP/PP, then
(1) compare logits with transformers, (2) export back to HF and compare every tensor.
Writes a JSON report from rank 0."""

import argparse
import json

import torch
import torch.distributed as dist

from megarl import distributed
from megarl.arguments import parse_args
from megarl.models.convert import HFCheckpoint, iter_hf_weights, load_hf_weights
from megarl.models.megatron_gpt import build_gpt_model
from megarl.trainer import vocab_parallel_entropy, vocab_parallel_logprobs


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--hf", required=True)
    own.add_argument("--out", required=True)
    own.add_argument("--tp", type=int, default=1)
    own.add_argument("--pp", type=int, default=1)
    mine, _ = own.parse_known_args()
    args = parse_args(["--model", mine.hf, "--tensor-model-parallel-size", str(mine.tp),
                       "--pipeline-model-parallel-size", str(mine.pp)])
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)

    from megatron.core import tensor_parallel
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(mine.hf)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, mine.hf, hf_config)
    report = {"tp": mine.tp, "pp": mine.pp}

    if mine.pp == 1:
        torch.manual_seed(0)
        tokens = torch.randint(0, hf_config.vocab_size, (2, 17))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model.eval()
        with torch.no_grad():
            shard_logits = model(tokens, positions, attention_mask=None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(shard_logits)[..., : hf_config.vocab_size]
            reference = AutoModelForCausalLM.from_pretrained(mine.hf, dtype=torch.float32).eval()(tokens).logits
            # The trainer's vocab-parallel logprobs and entropy (padding masked, T = 0.7)
            # against a full-vocabulary softmax of the HF logits.
            labels = torch.roll(tokens, -1, dims=1)
            full = torch.log_softmax(reference / 0.7, dim=-1)
            logprobs = vocab_parallel_logprobs(shard_logits, labels, hf_config.vocab_size, 0.7)
            entropy = vocab_parallel_entropy(shard_logits, hf_config.vocab_size, 0.7)
        report["max_abs_logit_diff"] = (logits - reference).abs().max().item()
        report["max_abs_logprob_diff"] = (logprobs - full.gather(-1, labels[..., None])[..., 0]).abs().max().item()
        report["max_abs_entropy_diff"] = (entropy + (full.exp() * full).sum(-1)).abs().max().item()

    original = HFCheckpoint(mine.hf)
    exported, mismatched = set(), []
    # Small buckets, so the round trip also covers bucket boundaries.
    for name, tensor in iter_hf_weights(model, hf_config, bucket_bytes=20_000):
        exported.add(name)
        if not torch.equal(tensor.cpu(), original.get(name)):
            mismatched.append(name)
    report["mismatched"] = mismatched
    report["missing"] = sorted(set(original.weight_map) - exported - {"lm_head.weight"}
                               if hf_config.tie_word_embeddings else set(original.weight_map) - exported)
    report["extra"] = sorted(exported - set(original.weight_map))
    report["exported"] = len(exported)
    if dist.get_rank() == 0:
        with open(mine.out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
