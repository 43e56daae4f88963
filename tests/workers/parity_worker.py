"""torchrun worker: load HF checkpoints into Megatron at the given TP/PP, then for each
(1) compare logits with transformers, (2) export back to HF and compare every tensor.
Several checkpoints share one launch (the parallel state is built once), so a family's
tied and untied models cost one torchrun start-up. Writes a JSON report from rank 0:
{"tp", "pp", "models": [one report per checkpoint, in the order given]}."""

import argparse
import json

import torch
import torch.distributed as dist

from megarl import distributed
from megarl.arguments import parse_args
from megarl.models.convert import HFCheckpoint, iter_hf_weights, load_hf_weights
from megarl.models.families import family_of
from megarl.models.megatron_gpt import build_gpt_model, rope_parameters
from megarl.algorithms import kl_full
from megarl.critic import attach_value_head
from megarl.kernels import naive


def _full_kl_parity(shard_logits, reference, vocab_size) -> dict:
    """The trainer's vocab-parallel KL(pi || ref) and its gradient against algorithms.kl_full on
    the gathered vocabulary; the reference policy's logits are the policy's scaled by 0.5."""
    from megatron.core import parallel_state

    shard = shard_logits.detach().clone().requires_grad_(True)
    kl = naive.full_kl(shard, 0.5 * shard.detach(), vocab_size, 0.7)
    kl.sum().backward()
    full = reference.detach().clone().requires_grad_(True)
    expected = kl_full(torch.log_softmax(full / 0.7, -1), torch.log_softmax(0.5 * full.detach() / 0.7, -1))
    expected.sum().backward()
    width = shard.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    real = max(min(vocab_size - start, width), 0)  # columns of this shard inside the real vocabulary
    grad_diff = (shard.grad[..., :real] - full.grad[..., start: start + real]).abs().max().item()
    return {"max_abs_full_kl_diff": (kl - expected).abs().max().item(), "max_abs_full_kl_grad_diff": grad_diff,
            "full_kl_mean": expected.mean().item(), "padding_grad_max": shard.grad[..., real:].abs().max().item()
            if real < width else 0.0}


def _distill_topk_parity(shard_logits, reference, vocab_size) -> dict:
    """Vocabulary-parallel teacher top-k and the student's top-k GKD losses (renorm and tail, beta 0.5,
    T = 0.7) with their gradients, against the pure full-vocabulary functions (algorithms); the
    teacher's logits are the student's scaled by 0.5."""
    from megatron.core import parallel_state

    from megarl.algorithms import GKD_TOPK_MODES, distill_full, student_topk_mass

    k, temperature, report = 8, 0.7, {}
    teacher = 0.5 * reference.detach()
    ids, logprobs = naive.topk_logprobs(0.5 * shard_logits.detach(), k, vocab_size, temperature)
    expected_logprobs, expected_ids = torch.log_softmax(teacher / temperature, -1).topk(k, dim=-1)
    # Megatron's and HF's logits differ by ~1e-5: ids may swap only where the ranking is that close.
    ranked = torch.log_softmax(teacher / temperature, -1).topk(k + 1, dim=-1).values
    clear = (ranked[..., :-1] - ranked[..., 1:]).min(dim=-1).values > 1e-3
    report["topk_ids_differ_where_clear"] = int((ids != expected_ids).any(dim=-1)[clear].sum())
    report["topk_clear_positions"] = int(clear.sum())
    report["max_abs_topk_logprob_diff"] = (logprobs - expected_logprobs).abs().max().item()
    width = shard_logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    real = max(min(vocab_size - start, width), 0)
    for mode in ("renorm", "tail"):
        shard = shard_logits.detach().clone().requires_grad_(True)
        loss = naive.distill_topk(shard, expected_ids, expected_logprobs, vocab_size, 0.5, temperature, mode)
        loss.sum().backward()
        full = reference.detach().clone().requires_grad_(True)
        expected = GKD_TOPK_MODES[mode](full, expected_ids, expected_logprobs, 0.5, temperature)
        expected.sum().backward()
        report[f"max_abs_gkd_{mode}_diff"] = (loss - expected).abs().max().item()
        report[f"max_abs_gkd_{mode}_grad_diff"] = (shard.grad[..., :real] - full.grad[..., start: start + real]
                                                   ).abs().max().item()
        report[f"gkd_{mode}_mean"] = expected.mean().item()
    # Full vocabulary: forward KL, the JSD mixture, reverse KL. The teacher is the student's logits
    # rolled by half the vocabulary, so that its mass sits on the other shard at TP=2: a gradient
    # that missed the other shard's share of a normaliser would show. The pure function gets
    # Megatron's own logits, gathered (HF's differ by ~5e-6, which these large gradients amplify).
    gathered = naive._all_gather_last_dim(shard_logits.detach(),
                                                   parallel_state.get_tensor_model_parallel_group())[..., :vocab_size]
    teacher_full = torch.roll(gathered, shifts=vocab_size // 2, dims=-1)
    teacher_shard = torch.zeros_like(shard_logits)
    teacher_shard[..., :real] = teacher_full[..., start: start + real]
    for beta in (0.0, 0.5, 1.0):
        shard = shard_logits.detach().clone().requires_grad_(True)
        loss = naive.distill_full(shard, teacher_shard, vocab_size, beta, temperature)
        loss.sum().backward()
        full = gathered.clone().requires_grad_(True)
        expected = distill_full(full, teacher_full, beta, temperature)
        expected.sum().backward()
        report[f"max_abs_gkd_full_beta{beta:g}_diff"] = (loss - expected).abs().max().item()
        report[f"max_abs_gkd_full_beta{beta:g}_grad_diff"] = (shard.grad[..., :real]
                                                              - full.grad[..., start: start + real]).abs().max().item()
        report[f"gkd_full_beta{beta:g}_mean"] = expected.mean().item()
    mass = naive.topk_mass(shard_logits, expected_ids, vocab_size, temperature)
    expected_mass = student_topk_mass(reference, expected_ids, temperature)
    report["max_abs_topk_mass_diff"] = (mass - expected_mass).abs().max().item()
    return report


def _value_head_parity(hf_path, hf_config, tokens, positions, seed) -> dict:
    """Critic values (trunk loaded tied-style, fresh value head) against HF's final hidden states @ head."""
    import copy

    from transformers import AutoModelForCausalLM

    trunk_config = copy.deepcopy(hf_config)
    trunk_config.tie_word_embeddings = True
    critic = build_gpt_model(trunk_config)
    load_hf_weights(critic, hf_path, trunk_config)
    attach_value_head(critic, hf_config, hf_path, seed)
    critic.eval()
    with torch.no_grad():
        values = critic(tokens, positions, attention_mask=None).squeeze(-1)
        hidden = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).model(tokens).last_hidden_state
        head = critic.output_layer.score
        expected = hidden @ head.weight[0] + head.bias[0]
    return {"max_abs_value_diff": (values - expected).abs().max().item(), "value_std": expected.std().item()}


def load_hf_model(hf_path: str, without_rope_scaling: bool = False):
    """The checkpoint as a transformers model in fp32, optionally with plain RoPE instead of
    its scaled RoPE (to show how much the scaling matters)."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_path)
    if without_rope_scaling:
        config = copy.deepcopy(config)
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_parameters(config)["rope_theta"]}
    return AutoModelForCausalLM.from_pretrained(hf_path, config=config, dtype=torch.float32).eval()


def _rope_parity(model, hf_model, reference_logits, hf_path, hf_config, tokens) -> dict:
    """RoPE frequencies against HF's; with RoPE scaling, also how far HF's logits move
    without it (so that the logit check cannot pass with the scaling ignored)."""
    inv_freq_diff = (model.rotary_pos_emb.inv_freq.cpu() - hf_model.model.rotary_emb.inv_freq).abs().max().item()
    report = {"max_abs_inv_freq_diff": inv_freq_diff, "rope_type": rope_parameters(hf_config)["rope_type"]}
    if report["rope_type"] != "default":
        with torch.no_grad():
            unscaled = load_hf_model(hf_path, without_rope_scaling=True)(tokens).logits
        report["rope_scaling_effect"] = (unscaled - reference_logits).abs().max().item()
    return report


def check_checkpoint(hf_path: str, pp: int, seq_len: int, seed: int) -> dict:
    from megatron.core import tensor_parallel
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_path)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_path, hf_config)
    report = {"model": hf_path, "family": family_of(hf_config).name, "tied": hf_config.tie_word_embeddings}

    if pp == 1:
        torch.manual_seed(0)
        tokens = torch.randint(0, hf_config.vocab_size, (2, seq_len))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model.eval()
        with torch.no_grad():
            shard_logits = model(tokens, positions, attention_mask=None)
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(shard_logits)[..., : hf_config.vocab_size]
            hf_model = load_hf_model(hf_path)
            reference = hf_model(tokens).logits
            # The trainer's vocab-parallel logprobs and entropy (padding masked, T = 0.7)
            # against a full-vocabulary softmax of the HF logits.
            labels = torch.roll(tokens, -1, dims=1)
            full = torch.log_softmax(reference / 0.7, dim=-1)
            logprobs = naive.logprobs(shard_logits, labels, hf_config.vocab_size, 0.7)
            entropy = naive.entropy(shard_logits, hf_config.vocab_size, 0.7)
        report["max_abs_logit_diff"] = (logits - reference).abs().max().item()
        report["max_abs_logprob_diff"] = (logprobs - full.gather(-1, labels[..., None])[..., 0]).abs().max().item()
        report["max_abs_entropy_diff"] = (entropy + (full.exp() * full).sum(-1)).abs().max().item()
        report.update(_full_kl_parity(shard_logits, reference, hf_config.vocab_size))
        report.update(_distill_topk_parity(shard_logits, reference, hf_config.vocab_size))
        report.update(_value_head_parity(hf_path, hf_config, tokens, positions, seed))
        report.update(_rope_parity(model, hf_model, reference, hf_path, hf_config, tokens))

    original = HFCheckpoint(hf_path)
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
    return report


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--hf", required=True, nargs="+", help="HF checkpoints, checked one after the other")
    own.add_argument("--out", required=True)
    own.add_argument("--tp", type=int, default=1)
    own.add_argument("--pp", type=int, default=1)
    own.add_argument("--seq-len", type=int, default=17)
    mine, _ = own.parse_known_args()
    args = parse_args(["--model", mine.hf[0], "--tensor-model-parallel-size", str(mine.tp),
                       "--pipeline-model-parallel-size", str(mine.pp)])
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)

    reports = [check_checkpoint(path, mine.pp, mine.seq_len, args.seed) for path in mine.hf]
    if dist.get_rank() == 0:
        with open(mine.out, "w") as f:
            json.dump({"tp": mine.tp, "pp": mine.pp, "models": reports}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
