"""torchrun worker: load HF checkpoints into Megatron at the given TP/PP, then for each
(1) compare logits with transformers, (2) export back to HF and compare every tensor.
Several checkpoints share one launch (the parallel state is built once), so a family's
tied and untied models cost one torchrun start-up. Writes a JSON report from rank 0:
{"tp", "pp", "models": [one report per checkpoint, in the order given]}.

Every float comparison is reported in ulps of the compared scale (tests/helpers.py: the fp32 rule),
against a float64 reference: the forward (logits, values) against transformers run in float64 on
the same fp32 weights; the trainer's vocabulary-parallel functions (logprobs, entropy, KL, GKD,
top-k) against the pure full-vocabulary functions in float64 on Megatron's own logits, so that each
check measures its own rounding and not the forward's."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import distributed  # noqa: E402
from megarl.algorithms import kl_full  # noqa: E402
from megarl.arguments import parse_args  # noqa: E402
from megarl.critic import attach_value_head  # noqa: E402
from megarl.kernels import naive  # noqa: E402
from megarl.models.convert import HFCheckpoint, iter_hf_weights, load_hf_weights, mtp_layer_names  # noqa: E402
from megarl.models.families import family_of, load_hf_config  # noqa: E402
from megarl.models.megatron_gpt import build_gpt_model, rope_parameters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers (also under torchrun)
from helpers import ulps  # noqa: E402

TEMPERATURE = 0.7


def _tp_columns(shard_logits, vocab_size):
    """(start, real): this TP rank's first vocabulary column and how many of its columns are real
    (the rest is Megatron's vocabulary padding)."""
    from megatron.core import parallel_state

    width = shard_logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return start, max(min(vocab_size - start, width), 0)


def _gathered(shard_logits, vocab_size):
    """Megatron's logits over the whole real vocabulary (every TP shard), detached."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return naive._all_gather_last_dim(shard_logits.detach(), group)[..., :vocab_size]


def _value_and_grad_ulps(report, name, shard_fn, reference_fn, shard_logits, vocab_size):
    """report[name + "_ulps"], report[name + "_grad_ulps"]: the vocabulary-parallel `shard_fn(shard)`
    (fp32) and its gradient on this shard's real columns against `reference_fn(full)` in float64 on the
    same logits gathered; report[name + "_plain_ulps"] and [name + "_grad_plain_ulps"]: the same for
    `reference_fn` itself run in fp32 (the plain formula's own rounding, which is what an
    ill-conditioned result, a small difference of large terms, is judged against: tests/helpers.py);
    report[name + "_mean"] the reference's mean (to show it is far from 0), and
    report[name + "_padding_grad_max"] the gradient on padding columns (must be exactly 0)."""
    start, real = _tp_columns(shard_logits, vocab_size)
    shard = shard_logits.detach().clone().requires_grad_(True)
    value = shard_fn(shard)
    value.sum().backward()
    results = {}
    for dtype in (torch.float64, torch.float32):
        full = _gathered(shard_logits, vocab_size).to(dtype).requires_grad_(True)
        expected = reference_fn(full)
        expected.sum().backward()
        results[dtype] = expected.detach(), full.grad
    (expected, grad), (plain, plain_grad) = results[torch.float64], results[torch.float32]
    grad_scale = grad.abs().max().item()  # the whole gradient's: a shard may hold padding only
    report[f"{name}_ulps"] = ulps(value, expected)
    report[f"{name}_grad_ulps"] = ulps(shard.grad[..., :real], grad[..., start: start + real], grad_scale)
    report[f"{name}_plain_ulps"] = ulps(plain, expected)
    report[f"{name}_grad_plain_ulps"] = ulps(plain_grad, grad)
    report[f"{name}_mean"] = expected.mean().item()
    report[f"{name}_padding_grad_max"] = shard.grad[..., real:].abs().max().item() if real < shard.shape[-1] else 0.0


def _vocab_parallel_parity(shard_logits, labels, vocab_size) -> dict:
    """The trainer's vocabulary-parallel logprobs, entropy and full KL(pi || ref) (the reference
    policy's logits are the policy's scaled by 0.5), against full-vocabulary float64 softmaxes."""
    report = {}
    with torch.no_grad():
        full = torch.log_softmax(_gathered(shard_logits, vocab_size).double() / TEMPERATURE, dim=-1)
        logprobs = naive.logprobs(shard_logits, labels, vocab_size, TEMPERATURE)
        entropy = naive.entropy(shard_logits, vocab_size, TEMPERATURE)
    report["logprob_ulps"] = ulps(logprobs, full.gather(-1, labels[..., None])[..., 0])
    report["entropy_ulps"] = ulps(entropy, -(full.exp() * full).sum(-1))
    _value_and_grad_ulps(
        report, "full_kl", lambda shard: naive.full_kl(shard, 0.5 * shard.detach(), vocab_size, TEMPERATURE),
        lambda full: kl_full(torch.log_softmax(full / TEMPERATURE, -1),
                             torch.log_softmax(0.5 * full.detach() / TEMPERATURE, -1)),
        shard_logits, vocab_size)
    return report


def _distill_parity(shard_logits, vocab_size) -> dict:
    """Vocabulary-parallel teacher top-k and the student's top-k GKD losses (renorm and tail, beta 0.5)
    with their gradients, the teacher's logits being the student's scaled by 0.5; then the
    full-vocabulary GKD (forward KL, the JSD mixture, reverse KL) against a teacher that is the
    student's logits rolled by half the vocabulary, so that its mass sits on the other shard at TP=2: a
    gradient that missed the other shard's share of a normaliser would show."""
    from megarl.algorithms import GKD_TOPK_MODES, distill_full, student_topk_mass

    k, report = 8, {}
    gathered = _gathered(shard_logits, vocab_size).double()
    teacher = 0.5 * gathered
    with torch.no_grad():
        ids, logprobs = naive.topk_logprobs(0.5 * shard_logits.detach(), k, vocab_size, TEMPERATURE)
    teacher_logprobs = torch.log_softmax(teacher / TEMPERATURE, -1)
    expected_logprobs, expected_ids = teacher_logprobs.topk(k, dim=-1)
    # Ids may swap only between ranks whose log-probs are within rounding of each other.
    ranked = teacher_logprobs.topk(k + 1, dim=-1).values
    clear = (ranked[..., :-1] - ranked[..., 1:]).min(dim=-1).values > 1e-4
    report["topk_ids_differ_where_clear"] = int((ids != expected_ids).any(dim=-1)[clear].sum())
    report["topk_clear_positions"] = int(clear.sum())
    report["topk_logprob_ulps"] = ulps(logprobs, expected_logprobs)  # sorted values: ids that swap are equal
    for mode in ("renorm", "tail"):
        _value_and_grad_ulps(
            report, f"gkd_{mode}",
            lambda shard, mode=mode: naive.distill_topk(shard, expected_ids, expected_logprobs.float(), vocab_size, 0.5,
                                             TEMPERATURE, mode),
            lambda full, mode=mode: GKD_TOPK_MODES[mode](full, expected_ids, expected_logprobs, 0.5, TEMPERATURE),
            shard_logits, vocab_size)
    start, real = _tp_columns(shard_logits, vocab_size)
    teacher_full = torch.roll(gathered, shifts=vocab_size // 2, dims=-1)
    teacher_shard = torch.zeros_like(shard_logits)
    teacher_shard[..., :real] = teacher_full[..., start: start + real].float()
    for beta in (0.0, 0.5, 1.0):
        _value_and_grad_ulps(
            report, f"gkd_full_beta{beta:g}",
            lambda shard, beta=beta: naive.distill_full(shard, teacher_shard, vocab_size, beta, TEMPERATURE),
            lambda full, beta=beta: distill_full(full, teacher_full, beta, TEMPERATURE), shard_logits, vocab_size)
    with torch.no_grad():
        mass = naive.topk_mass(shard_logits, expected_ids, vocab_size, TEMPERATURE)
    report["topk_mass_ulps"] = ulps(mass, student_topk_mass(gathered, expected_ids, TEMPERATURE))
    return report


def _value_head_parity(hf_path, hf_config, tokens, positions, seed) -> dict:
    """Critic values (trunk loaded tied-style, fresh value head) against HF's final hidden states @ head
    in float64, in ulps of the dot product's own scale (sum of |hidden| * |weight|, + |bias|): its
    rounding is proportional to that, not to the value, which a random head can put near 0."""
    import copy

    trunk_config = copy.deepcopy(hf_config)
    trunk_config.tie_word_embeddings = True
    critic = build_gpt_model(trunk_config)
    load_hf_weights(critic, hf_path, trunk_config)
    attach_value_head(critic, hf_config, hf_path, seed)
    critic.eval()
    with torch.no_grad():
        values = critic(tokens, positions, attention_mask=None).squeeze(-1)
        hidden = load_hf_model(hf_path).base_model(tokens).last_hidden_state
        head = critic.output_layer.score
        weight, bias = head.weight[0].double(), head.bias[0].double()
        expected = hidden @ weight + bias
        scale = (hidden.abs() @ weight.abs() + bias.abs()).max().item()
    return {"value_ulps": ulps(values, expected, scale), "value_std": expected.std().item()}


def load_hf_model(hf_path: str, without_rope_scaling: bool = False, without_sliding_window: bool = False):
    """The checkpoint as a transformers model in float64 (the fp32 weights exactly; the reference of
    every forward check), optionally with plain RoPE instead of its scaled RoPE, or full attention in
    every layer instead of its sliding windows (to show how much either matters)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = load_hf_config(hf_path)
    if without_rope_scaling:
        config = copy.deepcopy(config)
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_parameters(config)["rope_theta"]}
    if without_sliding_window:
        config = copy.deepcopy(config)
        config.use_sliding_window = False
        if not family_of(config).gpt_oss:  # gpt-oss's model builds its sliding mask whatever layer_types says
            config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    # MoE: transformers' per-expert loop (its default grouped GEMM takes no float64)
    moe = {"experts_implementation": "eager"} if family_of(config).moe else {}
    return _unclamped(AutoModelForCausalLM.from_pretrained(hf_path, config=config, dtype=torch.float64, **moe).eval())


def _unclamped(model):
    """Nemotron-H's Mamba-2 mixers without transformers' floor on dt (models/mamba_mixer.py); others unchanged."""
    from megarl.models.mamba_mixer import without_dt_floor

    return without_dt_floor(model)


def _feature_effects(hf_path, reference_logits, tokens, changes: dict, undone: dict) -> dict:
    """`{name}_effect`: how far transformers' own logits move with one feature undone, either by config fields
    (`changes[name]`) or by a (module attribute, value) filled in after loading (`undone[name]`)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = load_hf_config(hf_path)
    report = {}
    for name in [*changes, *undone]:
        changed = copy.deepcopy(config)
        for field, value in changes.get(name, {}).items():
            setattr(changed, field, value)
        model = _unclamped(AutoModelForCausalLM.from_pretrained(hf_path, config=changed, dtype=torch.float64,
                                                                experts_implementation="eager").eval())
        with torch.no_grad():
            if name in undone:
                attribute, value = undone[name]
                for module in model.modules():
                    if hasattr(module, attribute):
                        getattr(module, attribute).fill_(value)
            report[f"{name}_effect"] = (model(tokens).logits - reference_logits).abs().max().item()
    return report


def _sigmoid_router_effects(hf_path, reference_logits, tokens) -> dict:
    """How far transformers' own logits move with each feature of a DeepSeek-V3 or GLM-4.5 model undone: the
    expert bias zeroed (the router's choice unbiased), routed_scaling_factor 1, every expert group kept
    (topk_group = n_group); DeepSeek-V3's rope dims rotated as halves instead of interleaved pairs, GLM-4.5's
    whole heads rotated instead of their first half; so that the logit check cannot pass with one of them
    ignored or laid out otherwise."""
    config = load_hf_config(hf_path)
    changes = {"routed_scaling": dict(routed_scaling_factor=1.0), "group_limit": dict(topk_group=config.n_group)}
    if family_of(config).multi_latent_attention:
        changes["rope_interleave"] = dict(rope_interleave=False)
    elif family_of(config).block_types:  # Nemotron-H: no RoPE to lay out; the squared ReLU instead of ReLU
        changes["squared_relu"] = dict(mlp_hidden_act="relu")
    else:
        changes["partial_rotary"] = dict(rope_parameters={**config.rope_parameters, "partial_rotary_factor": 1.0})
    return _feature_effects(hf_path, reference_logits, tokens, changes,
                            {"expert_bias": ("e_score_correction_bias", 0.0)})


def _gpt_oss_effects(hf_path, reference_logits, tokens) -> dict:
    """How far transformers' own logits move with gpt-oss's sinks removed (their logits at -1e4) and its SwiGLU
    unclamped (swiglu_limit 1e9), so that the logit check cannot pass with either ignored (the window's and
    YaRN's effects are checked as every family's)."""
    return _feature_effects(hf_path, reference_logits, tokens, {"swiglu_clamp": dict(swiglu_limit=1e9)},
                            {"sinks": ("sinks", -1e4)})


def _rope_parity(model, hf_model, reference_logits, hf_path, hf_config, tokens) -> dict:
    """RoPE frequencies against HF's; with RoPE scaling, also how far HF's logits move
    without it (so that the logit check cannot pass with the scaling ignored)."""
    if family_of(hf_config).block_types:  # Nemotron-H has no positional embedding (GPTModel's none)
        assert model.position_embedding_type == "none" and not hasattr(hf_model.base_model, "rotary_emb")
        return {"rope_type": "none"}
    # multi-latent attention keeps its RoPE in each attention layer (over qk_rope_head_dim, HF's head_dim)
    rotary = model.decoder.layers[0].self_attention.rotary_pos_emb if model.config.multi_latent_attention \
        else model.rotary_pos_emb
    inv_freq = rotary.inv_freq.cpu()
    if type(rotary).__name__ == "YarnRotaryEmbedding":
        # Megatron's YaRN blends its frequencies when it builds the embedding: position 1's angles are they
        inv_freq = rotary.get_emb(2)[0][1, 0, 0, : inv_freq.numel()].cpu()
    report = {"inv_freq_ulps": ulps(inv_freq, hf_model.model.rotary_emb.inv_freq.to(inv_freq.dtype)),
              "rope_type": rope_parameters(hf_config)["rope_type"]}
    if report["rope_type"] != "default":
        with torch.no_grad():
            unscaled = load_hf_model(hf_path, without_rope_scaling=True)(tokens).logits
        report["rope_scaling_effect"] = (unscaled - reference_logits).abs().max().item()
    return report


def _sliding_window_parity(model, hf_path, hf_config, tokens, reference_logits) -> dict:
    """A model with sliding-window layers: its logits on the same sequences packed into one row (THD, as
    --padding-free runs them: each sequence's windowed layers through the local attention, its full layers
    through megarl's fast paths) against transformers; and how far transformers' own logits move with every
    window removed (use_sliding_window false: all layers full attention), so that a model that ignored the
    window would fail the logit check."""
    from megatron.core import tensor_parallel

    from megarl import accelerator

    rows, length = tokens.shape
    packed = tokens.reshape(1, -1)
    positions = torch.arange(length).repeat(rows)[None]
    with torch.no_grad():
        shard = model(packed, positions, attention_mask=None,
                      packed_seq_params=accelerator.packed_sequence_params([length] * rows))
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(shard)[..., : hf_config.vocab_size]
    report = {"packed_logit_ulps": ulps(logits.reshape(rows, length, -1), reference_logits)}
    with torch.no_grad():
        unwindowed = load_hf_model(hf_path, without_sliding_window=True)(tokens).logits
    report["sliding_window_effect"] = (unwindowed - reference_logits).abs().max().item()
    report["sliding_window"] = hf_config.sliding_window
    return report


def check_checkpoint(hf_path: str, pp: int, seq_len: int, seed: int) -> dict:
    from megatron.core import tensor_parallel

    hf_config = load_hf_config(hf_path)
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
        report["logit_ulps"] = ulps(logits, reference)
        report["logit_scale"] = reference.abs().max().item()
        labels = torch.roll(tokens, -1, dims=1)
        report.update(_vocab_parallel_parity(shard_logits, labels, hf_config.vocab_size))
        report.update(_distill_parity(shard_logits, hf_config.vocab_size))
        report.update(_value_head_parity(hf_path, hf_config, tokens, positions, seed))
        report.update(_rope_parity(model, hf_model, reference, hf_path, hf_config, tokens))
        if family_of(hf_config).sigmoid_router:
            report.update(_sigmoid_router_effects(hf_path, reference, tokens))
        if family_of(hf_config).gpt_oss:
            report.update(_gpt_oss_effects(hf_path, reference, tokens))
        if model.config.window_size is not None:
            report.update(_sliding_window_parity(model, hf_path, hf_config, tokens, reference))

    original = HFCheckpoint(hf_path)
    exported, mismatched = set(), []
    # Small buckets, so the round trip also covers bucket boundaries.
    for name, tensor in iter_hf_weights(model, hf_config, bucket_bytes=20_000):
        exported.add(name)
        if not torch.equal(tensor.cpu(), original.get(name)):
            mismatched.append(name)
    report["mismatched"] = mismatched
    # A multimodal checkpoint's vision tower and MTP head are not the text model's: never read, never written.
    # Nor are a DeepSeek-V3 or GLM-4.5 checkpoint's MTP layers (model.layers.{num_hidden_layers + j}.*).
    mtp = set(mtp_layer_names(hf_config, original.weight_map))
    text_names = {name for name in original.weight_map if not name.startswith(("model.visual.", "mtp."))} - mtp
    report["left_out"] = len(original.weight_map) - len(text_names)
    report["missing"] = sorted(text_names - exported - {"lm_head.weight"}
                               if hf_config.tie_word_embeddings else text_names - exported)
    report["extra"] = sorted(exported - set(original.weight_map))
    report["exported"] = len(exported)
    report["exported_names"] = sorted(exported)
    return report


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--hf", required=True, nargs="+", help="HF checkpoints, checked one after the other")
    own.add_argument("--out", required=True)
    own.add_argument("--tp", type=int, default=1)
    own.add_argument("--pp", type=int, default=1)
    own.add_argument("--ep", type=int, default=1)
    own.add_argument("--seq-len", type=int, default=17)
    mine, _ = own.parse_known_args()
    args = parse_args(["--model", mine.hf[0], "--tensor-model-parallel-size", str(mine.tp),
                       "--pipeline-model-parallel-size", str(mine.pp), "--expert-model-parallel-size", str(mine.ep)])
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)

    reports = [check_checkpoint(path, mine.pp, mine.seq_len, args.seed) for path in mine.hf]
    if dist.get_rank() == 0:
        with open(mine.out, "w") as f:
            json.dump({"tp": mine.tp, "pp": mine.pp, "ep": mine.ep, "models": reports}, f)
    dist.barrier()
    # as train.py ends: a hard exit once every rank is done. Interpreter teardown with gloo's and
    # the CPU libraries' threads alive aborted once in CI ("terminate called without an active
    # exception", SIGABRT) after the work was written
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
