"""Shared test utilities: launching real torchrun workers and building random HF models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def load_script(path) -> object:
    """A script that is not a package module (a tool in tools/, a torchrun worker in tests/workers/) imported
    as a module, for its functions and case lists."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(worker: str, *args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run tests/workers/<worker> under a real `torchrun --standalone` (gloo on CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKERS / worker), *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{worker} failed with exit code {result.returncode}:\n"
                             f"{(result.stdout + result.stderr)[-6000:]}")
    return result


def in_thread_ranks(placement, body, timeout_seconds: float = 30.0) -> list:
    """`body(context)` on every launched rank of `placement`, each rank a thread of this process with its own
    megarl DistContext on one shared in-memory store (no default world: the store groups megarl builds
    itself, as new_store_group does, are real gloo groups between the threads). Results in rank order; the
    first rank's exception is raised. For the bookkeeping of cross-role traffic without a torchrun launch."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from megarl.distributed import DistContext, LaunchEnv, new_store_group

    store, size = dist.HashStore(), placement.world_size
    timeout = timedelta(seconds=timeout_seconds)
    results, errors = [None] * size, [None] * size

    def rank_main(rank):
        try:
            env = LaunchEnv(rank, size, rank, "127.0.0.1", 0, False)
            context = DistContext(env, placement, store, placement.world_of(rank)[0], timeout,
                                  roles=placement.roles_of(rank))
            if placement.needs_cross_role_group:
                context.cross_role_group = new_store_group("cross-role", context)
            results[rank] = body(context)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = error

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_seconds * 2)
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} still running")
    for error in errors:
        if error is not None:
            raise error
    return results


def scalars(log_dir, tags) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of TensorBoard scalars over every events file in `log_dir` (a resumed
    run writes a second file); tags that were never logged are absent."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series = {}
    for events_file in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        events = EventAccumulator(str(events_file))
        events.Reload()
        for tag in set(tags) & set(events.Tags()["scalars"]):
            series.setdefault(tag, {}).update({event.step: event.value for event in events.Scalars(tag)})
    return series


def reward_rise(log_dir, tag: str = "reward_mean") -> float:
    """The rise of a run's reward_mean (or `tag`: DAPO's dapo_reward_all_mean, every generated sample's, where
    reward_mean is the kept groups', mixed by construction) over its steps, read off a least-squares line
    through every step (the line's end minus its start): a learning test's statistic. Measured over 3 seeds (tools/learning_bars.py,
    docs/testing.md) its spread is half that of the 5-step means at both ends (the run's `reward: a -> b` line),
    and a run that does not learn reads 0 +- noise/sqrt(steps^3 / 12) (estimated, not measured: 0.015
    over 80 steps of 128 samples, at a per-step noise of 0.04)."""
    series = scalars(log_dir, [tag])[tag]
    values = [series[step] for step in sorted(series)]
    n = len(values)
    assert n >= 2, series
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    slope = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values)) / \
        sum((i - x_mean) ** 2 for i in range(n))
    return slope * (n - 1)


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# Tiny configs per family: GQA (4 query / 2 KV heads, both divisible by TP=2), an unpadded
# vocabulary (Megatron pads it to a multiple of 128 * TP), and each family's own features.
# Llama-3 RoPE scaling only changes the low frequencies; "megatron" keeps the values
# Megatron-core hard-codes (its own path), "custom" moves all of them (our path, and a
# short original context so that the scaling shows within a few dozen tokens).
LLAMA3_ROPE = {
    "megatron": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    "custom": dict(factor=6.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=64),
}
_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
QWEN3_5_FIELDS = dict(max_position_embeddings=512, head_dim=32, num_hidden_layers=4,
                      layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4, rope_extra=dict(partial_rotary_factor=0.25))
_FAMILIES = {
    # family: (transformers classes, config fields, init std)
    "qwen2": (("Qwen2Config", "Qwen2ForCausalLM"), dict(max_position_embeddings=128), 0.1),
    # head_dim 32 != hidden / heads = 16: Megatron's kv_channels must follow the config. (The
    # new families also go into vLLM, whose CPU attention has no kernel for head_dim 16.)
    "qwen3": (("Qwen3Config", "Qwen3ForCausalLM"), dict(max_position_embeddings=512, head_dim=32), 0.1),
    # Larger weights: at std 0.1 attention is so nearly uniform that positions (hence RoPE
    # scaling) barely move the logits; at 0.2 the scaling changes them by > 1e-2.
    "llama": (("LlamaConfig", "LlamaForCausalLM"), dict(max_position_embeddings=16384, head_dim=32), 0.2),
    # Mixture of experts: 8 experts, top 2, every layer sparse. Qwen3-MoE renormalises the top-k weights
    # (norm_topk_prob, as Qwen3-30B-A3B), Qwen2-MoE does not (as Qwen1.5-MoE-A2.7B) and adds a gated shared
    # expert: the two router orders of Megatron (moe_router_pre_softmax) and its shared-expert gate.
    "qwen3_moe": (("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                  dict(max_position_embeddings=128, head_dim=32, moe_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True), 0.1),
    "qwen2_moe": (("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                  dict(max_position_embeddings=128, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False), 0.1),
    # Qwen3.5: Gated DeltaNet and gated softmax attention in turn (both kinds on each PP=2 stage), partial
    # RoPE (a quarter of head_dim 32), more value than key heads (each key head serves two), norms as 1 + w.
    "qwen3_5": (("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"), dict(QWEN3_5_FIELDS), 0.1),
    "qwen3_5_moe": (("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
                    dict(QWEN3_5_FIELDS, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=8,
                         num_experts_per_tok=2), 0.1),
    # DeepSeek-V3: multi-latent attention (q through its low-rank pair, or with q_lora_rank None one q_proj; the
    # rope dims interleaved, as the released checkpoints), a sigmoid router with a random expert bias (a buffer:
    # set below), groups of 2 experts of which the best 2 groups are kept (8 experts, top 4: HF's group score,
    # the top 2 of a group, is Megatron's top_k / topk_group), routed_scaling_factor 2.5, one shared expert, the
    # first layer dense; values narrower than keys (v_head_dim 24 against 32 + 16); two MTP layers' tensors after
    # the last layer, as the released checkpoints carry them (left out).
    "deepseek_v3": (("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                    dict(max_position_embeddings=512, num_hidden_layers=4, num_key_value_heads=4, q_lora_rank=48,
                         kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                         n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                         num_nextn_predict_layers=2), 0.1),
    # GLM-4.5: grouped-query attention with q/k/v biases and q/k norms, half of each head rotated (transformers'
    # default partial_rotary_factor, written into rope_parameters as the released configs have it); DeepSeek-V3's
    # router at the same tiny scale (top 4 of the best 2 of 4 groups, scaling 2.5), one shared expert, the first
    # layer dense; one MTP layer's tensors after the last layer, as GLM-4.5's checkpoints carry one.
    "glm4_moe": (("Glm4MoeConfig", "Glm4MoeForCausalLM"),
                 dict(max_position_embeddings=512, num_hidden_layers=4, head_dim=32, attention_bias=True,
                      use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
                      topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                      norm_topk_prob=True, num_nextn_predict_layers=1,
                      rope_extra=dict(partial_rotary_factor=0.5)), 0.1),
    # gpt-oss: biases everywhere, a learned sink per head, 8 experts of width 64 (vLLM's CPU MoE packs multiples
    # of 32) under a softmax-after-top-k router with a bias, the clamped SwiGLU, YaRN RoPE as the released models
    # (truncate false) at a tiny scale, alternating sliding-window (8 tokens) and full layers.
    "gpt_oss": (("GptOssConfig", "GptOssForCausalLM"),
                dict(max_position_embeddings=512, head_dim=32, intermediate_size=64, num_local_experts=8,
                     num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                     rope_extra=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                     beta_fast=32.0, beta_slow=1.0, truncate=False)), 0.1),
    # Nemotron-H: one mixer per layer, ME*M-E (Mamba-2: 8 heads of 16, 2 groups, state 16, conv 4, the scan's chunks
    # of 16; attention without RoPE; a squared-ReLU MLP; MoE with 8 squared-ReLU experts of 32 under the sigmoid
    # router: top 4 of the best 2 of 4 groups, scaling 2.5, a shared expert of 48). No rope_parameters (no RoPE).
    "nemotron_h": (("NemotronHConfig", "NemotronHForCausalLM"),
                   dict(max_position_embeddings=512, num_hidden_layers=6, hybrid_override_pattern="ME*M-E", head_dim=32,
                        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                        chunk_size=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5,
                        norm_topk_prob=True, rope_extra=None), 0.1),
}
GPT_OSS_GATE_UP_SCALE = 300.0
DEEPSEEK_MTP_TENSORS = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def make_random_model(path, family: str, tied: bool, seed: int = 0, vocab_size: int = 250,
                      llama3_rope: str | None = None, expert_bias_std: float = 0.2, std: float | None = None,
                      **config_fields) -> str:
    """A small random HF checkpoint of `family` in which every tensor is N(0, std).

    `llama3_rope` names an entry of LLAMA3_ROPE (Llama only); `expert_bias_std` DeepSeek-V3's expert bias
    (on the scale of the router's scores: 0.2 outweighs them, so that its effect shows; smaller, routes that
    follow the token); `std` the weights' (default the family's: 0.2 makes attention depend on positions
    enough for a RoPE scaling to show); `config_fields` override the tiny config.
    """
    import torch
    import transformers

    (config_class, model_class), fields, family_std = _FAMILIES[family]
    std = family_std if std is None else std
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope is not None:
        rope.update(rope_type="llama3", **LLAMA3_ROPE[llama3_rope])
    fields = {**_TINY, **fields, **config_fields}
    extra = fields.pop("rope_extra", {})
    rope.update(extra or {})
    config = getattr(transformers, config_class)(**fields, vocab_size=vocab_size, tie_word_embeddings=tied,
                                                 **({} if extra is None else dict(rope_parameters=rope)))  # None: no RoPE
    config.architectures = [model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # default init leaves biases and norms at 0/1; make every tensor matter
        for param in model.parameters():
            param.normal_(std=std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's expert bias: on the scale of the scores
                buffer.normal_(std=expert_bias_std)
        for name, param in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):  # gpt-oss: gate and up past its SwiGLU's clamp at 7 (the
                param.mul_(GPT_OSS_GATE_UP_SCALE)    # normed inputs are ~0.1: at std 0.1 they stay near 0.1)
    model.save_pretrained(path)
    if family in ("deepseek_v3", "glm4_moe"):
        _add_mtp_layers(path, config, seed)
    return str(path)


def _add_mtp_layers(path, config, seed: int) -> None:
    """A DeepSeek-V3 (or GLM-4.5) checkpoint's multi-token-prediction layers as the released ones store them: decoder layers
    numbered after the last (model.layers.{num_hidden_layers + j}.*), here a few of their tensors each
    (transformers builds none of them; megarl leaves them out)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(Path(path) / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    for layer in range(config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers):
        for name in DEEPSEEK_MTP_TENSORS:
            shape = (hidden, 2 * hidden) if name == "eh_proj.weight" else (hidden,)
            tensors[f"model.layers.{layer}.{name}"] = torch.randn(*shape, generator=generator)
    save_file(tensors, Path(path) / "model.safetensors", metadata={"format": "pt"})


def make_random_multimodal_qwen3_5(path, tied: bool = True, seed: int = 0, vocab_size: int = 250) -> str:
    """A random Qwen3.5 checkpoint as the released ones are laid out: Qwen3_5ForConditionalGeneration, the
    language model under model.language_model., a (tiny) vision tower under model.visual. and two MTP-head
    tensors under mtp. (transformers does not model the MTP head; the released checkpoints carry one)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    text_path = make_random_model(Path(path) / "text", "qwen3_5", tied, seed, vocab_size)
    text = transformers.AutoConfig.from_pretrained(text_path).to_dict()
    config = transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=tied,
                                        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                                           out_hidden_size=text["hidden_size"]))
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(std=0.1)
        model.model.language_model.load_state_dict(
            {k.removeprefix("model."): v for k, v in load_file(Path(text_path) / "model.safetensors").items()
             if k.startswith("model.")})
        if not tied:
            model.lm_head.weight.copy_(load_file(Path(text_path) / "model.safetensors")["lm_head.weight"])
    model.save_pretrained(path)
    tensors = load_file(Path(path) / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]
    tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator),
                    "mtp.norm.weight": torch.zeros(hidden)})
    save_file(tensors, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return str(path)


# A reward no group of samples scores alike unless its responses are equally long: a live GRPO signal from any
# policy, a random one included (--external-plugins <this file> --reward response_length).
LENGTH_REWARD = '''
from megarl.rewards import register_reward


@register_reward("response_length")
def response_length(response, row):
    return len(response) / 1000.0
'''


def length_reward_plugin(directory) -> str:
    """The LENGTH_REWARD plugin written into `directory`; its path."""
    path = Path(directory) / "length_reward.py"
    path.write_text(LENGTH_REWARD)
    return str(path)


def make_random_qwen2(path, tied: bool, seed: int = 0, vocab_size: int = 250) -> str:
    """A small random Qwen2 checkpoint with GQA, QKV bias and an unpadded vocabulary."""
    return make_random_model(path, "qwen2", tied, seed, vocab_size)


# ------------------------------------------------------------------------------ tolerances ----
# How close fp32 results must be, stated once for every suite. An fp32 result is the exact value plus
# rounding whose *size* follows from the computation (its magnitude, the number of terms summed) but
# whose *pattern* follows from the summation order: the BLAS, the vector width (AVX2 vs AVX-512), the
# thread count and our own chunking each reorder the sums. An absolute 1e-5 is a few ulps of an O(10)
# logit-sized number and so a property of one machine (issue 22). So a test computes the reference in
# float64 (the same formula, rounding ~1e-16, exact at this scale) and bounds the fp32 result's error
# relative to the magnitude of what is compared:
#
#     |x32 - ref64| <= FP32_ULPS * EPS32 * scale,   scale = max |ref64| over the compared tensor
#
# (a gradient is compared as a whole tensor, so its small entries are judged on its largest entry's
# scale, which is what the rounding of the sums behind it is proportional to). The classic worst case of
# summing n terms in fp32 is (n - 1) ulps of the terms' magnitude; these suites sum at most 256 terms
# (a padded vocabulary shard; hidden sizes are 16-96), and chain a few such steps (log-softmax, entropy,
# a tail's log(1 - mass), a matmul), so FP32_ULPS = 4 * 256. Measured: up to 75 ulps for the fused
# kernels' top-k gradients (the tail's log(1 - mass) amplifies), 160 between two fp32 implementations on
# another AVX-512 host. A wrong kernel misses by a relative O(1) (a missing temperature, a dropped
# chunk, a lost gradient term): millions of ulps.
EPS32 = 2.0**-23  # torch.finfo(torch.float32).eps
FP32_ULPS = 1024
# bf16 results (the GPU dtype) are fp32 arithmetic rounded to bf16 a handful of times (the logits of a
# bf16 matmul, the outputs, the gradients): a few bf16 ulps of the scale; measured 1.4.
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps
BF16_ULPS = 8
# Two bf16 paths (the GPU lane's Triton kernels against the chunked torch ones, both rounding fp32 results to
# bf16): each within BF16_ULPS of the exact value, so within twice that of each other (as FP32_PATHS_ULPS).
BF16_PATHS_ULPS = 2 * BF16_ULPS
# fp16 results (the --fp16 trainer's gradients) are judged as bf16 ones, in fp16 ulps (10-bit mantissa) of the
# compared tensor's scale: two fp16 paths (a loss scale of 2^10 against 1) within BF16_PATHS_ULPS of each other.
FP16_EPS = 2.0**-10
FP16_PATHS_ULPS = BF16_PATHS_ULPS
# An fp32 matmul on CUDA tensor cores in TF32 (megarl's fused weight gradient, accelerator.tf32_matmuls)
# rounds its inputs to 10 mantissa bits: two paths whose inputs differ by fp32 rounding can round one
# term's input to neighbouring TF32 values, a TF32 ulp of that term, which may be the largest one. Judged
# like bf16, in TF32 ulps of the scale (not measured yet: tests/gpu/ prints every case's error).
TF32_EPS = 2.0**-10
TF32_PATHS_ULPS = 2 * BF16_ULPS


def ulps(actual, reference, scale: float | None = None, eps: float = EPS32) -> float:
    """max |actual - reference| in units of eps * scale (scale = max |reference| unless given, e.g. the
    whole tensor's when `reference` is one rank's shard of it), computed in float64; equal infinities
    count as 0 and NaN as inf. 0 when both are empty."""
    import torch

    actual, reference = torch.as_tensor(actual).double(), torch.as_tensor(reference).double()
    if actual.numel() == 0 and reference.numel() == 0:
        return 0.0
    same_inf = torch.isinf(reference) & (actual == reference)
    diff = torch.where(same_inf, 0.0, (actual - reference).abs())
    if scale is None:
        finite = reference[torch.isfinite(reference)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
    error = diff.max().item()
    if error != error:  # NaN
        return float("inf")
    if error == 0.0:
        return 0.0
    return error / (eps * scale) if scale > 0 else float("inf")


def assert_fp32_close(actual, reference, scale: float | None = None, what: str = "", bf16: bool = False):
    """`actual` (fp32, or bf16 with `bf16`) within FP32_ULPS (BF16_ULPS) of its float64 `reference` (see above)."""
    eps, limit = (BF16_EPS, BF16_ULPS) if bf16 else (EPS32, FP32_ULPS)
    error = ulps(actual, reference, scale, eps)
    assert error <= limit, f"{what}: {error:.1f} ulps of the reference's scale > {limit}"


# An ill-conditioned result, a small difference of large terms (the JSD mixture's gradient against a
# teacher far from the student: terms of O(1) cancelling to 1e-5), carries rounding of the *terms'*
# scale, which the caller cannot see from the result. The plain formula evaluated in fp32 on the same
# inputs shows that level: a path is then within PLAIN_FP32_FACTOR of the plain formula's own error (its
# summation order differs, so its rounding is another draw of the same size; 8 = 3 bits of slack). A
# wrong path misses by O(1) of the result: for that gradient, 8e6 ulps against a limit of ~1e6.
PLAIN_FP32_FACTOR = 8


def fp32_limit(plain_ulps: float = 0.0) -> float:
    """The ulps an fp32 path may be from its float64 reference: the fp32 rule, or PLAIN_FP32_FACTOR times
    the plain fp32 formula's own error on the same inputs where that is larger (ill-conditioned)."""
    return max(FP32_ULPS, PLAIN_FP32_FACTOR * plain_ulps)


# Two fp32 computations of the same thing by different paths (CP=2 vs CP=1, packed vs padded, PP=2 vs
# PP=1), neither in float64: each is within the rule above of the exact value, so they are within twice
# it of each other.
FP32_PATHS_ULPS = 2 * FP32_ULPS


def fp32_paths_ulps(a, b) -> float:
    """max |a - b| in ulps of the larger's scale (two fp32 paths, neither a float64 reference)."""
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ulps(a, b, max(a.abs().max().item(), b.abs().max().item()) if a.numel() else 0.0)


def assert_fp32_paths_agree(a, b, what: str = ""):
    error = fp32_paths_ulps(a, b)
    assert error <= FP32_PATHS_ULPS, f"{what}: {error:.1f} ulps of the larger's scale > {FP32_PATHS_ULPS}"


# Two whole training runs that should agree (chunked vs naive kernels, CP=2 vs CP=1, a resumed run vs
# an uninterrupted one at another layout) cannot be rerun in float64 cheaply. Their first step differs by
# fp32 rounding (the rule above, ~1e-4 relative at most), and each Adam step amplifies it: an entry whose
# gradient is at rounding level in both runs (v ~ g^2 tiny) gets an update of up to +-lr in either, so the
# weights, and the next step's loss and gradient norm, drift apart by a relative 1e-5 to 1e-4 (a grad
# norm of 0.437 differed by 2.25e-5 at step 1 on an AVX-512 host). RUN_RTOL bounds that relative to the
# magnitude of the compared series (max |value| over its steps, so a metric that starts at 0 is judged
# on its later values); a run that computes something else differs by O(1) already at step 0.
RUN_RTOL = 1e-3
# Metrics that are themselves rounding-level differences of O(1) log-probs (rollout vs trainer, old vs
# new on the same weights): their own magnitude (~1e-7) is no scale; judged on 1.0.
ROUNDING_LEVEL_METRICS = {"mismatch", "mismatch_max", "mismatch_kl", "ratio_dev_max", "kl_old_new"}
# The policy loss is a mean of advantage x ratio terms, the advantages O(0.1-1) (GRPO's normalized, Dr. GRPO's
# reward differences): on-policy, a step whose responses are all equally long cancels it to 0 up to rounding
# (a group's advantages sum to 0), and two runs' rounding then differs on a series of magnitude ~1e-9. Such a
# series is judged on at least CANCELLING_SCALE, a hundredth of its terms (rtol x it = 1e-5, ten times the
# fp32 rounding of a mean of O(1) terms; a run that computes another loss differs by O(advantage)).
CANCELLING_METRICS, CANCELLING_SCALE = {"loss"}, 1e-2


# Such a metric, or a KL between two policies that are the same weights, is at rounding level when it is
# within the fp32 rule of 0 on that scale: 1024 ulps of 1.0 = 1.2e-4 (measured ~3e-7 for the rollout vs
# the trainer in fp32; a missed weight sync or a stale engine reads 1e-3 to 1).
ROUNDING_LEVEL = FP32_ULPS * EPS32


def assert_runs_agree(a: dict, b: dict, what: str = "", steps=None, rtol: float = RUN_RTOL,
                      scale: float | None = None):
    """Series {step: value} of two runs equal within rtol of the series' magnitude at `steps` (all
    of `a`'s steps unless given), each step present in both. `scale` replaces the magnitude (1.0 for
    ROUNDING_LEVEL_METRICS, named by `what`; at least CANCELLING_SCALE for CANCELLING_METRICS)."""
    steps = sorted(a) if steps is None else list(steps)
    assert steps and all(step in a and step in b for step in steps), (what, steps, a, b)
    metric = what.split()[-1] if what.split() else ""
    if scale is None and metric in ROUNDING_LEVEL_METRICS:
        scale = 1.0
    if scale is None:
        scale = max(abs(v) for series in (a, b) for v in series.values())
        if metric in CANCELLING_METRICS:
            scale = max(scale, CANCELLING_SCALE)
    off = {step: (a[step], b[step]) for step in steps if not abs(a[step] - b[step]) <= rtol * scale}
    assert not off, f"{what}: differ by more than {rtol:g} of {scale:.4g} at steps {off}"


# A comparison of two runs says something only about steps that carry a learning signal: with every reward of
# every group equal (GRPO's advantages 0) or no gradient, two runs agree whatever state they loaded. The floors
# sit far below a live run's values (grad norms 0.01-10, advantages' absolute mean 0.1-1 on these tests' runs)
# and far above a dead one's (exactly 0, or rounding: ~1e-9).
GRAD_NORM_FLOOR, ADVANTAGE_FLOOR = 1e-4, 1e-3
SIGNAL_TAGS = ("grad_norm", "advantage_abs_mean", "reward_std")


def assert_signal_alive(run, steps=(2, 3), what: str = "", advantages: bool = True):
    """The compared steps of a run carry a learning signal, so that two runs agreeing on them says something:
    a gradient above GRAD_NORM_FLOOR at each step, and not the same one twice (the model or the batch moved);
    with `advantages` (every policy-gradient run), rewards that differ in some group and advantages above
    ADVANTAGE_FLOOR at one compared step at least (a step without them still trains on its KL terms).
    `run`: a TensorBoard log dir or {tag: {step: value}} holding SIGNAL_TAGS. The gradient norm, not the loss:
    on-policy, GRPO's token-mean surrogate is exactly 0 whenever a step's responses are equally long."""
    series = scalars(run, SIGNAL_TAGS) if isinstance(run, (str, Path)) else run
    label = f"{what}: " if what else ""
    needed = SIGNAL_TAGS if advantages else SIGNAL_TAGS[:1]
    missing = [(tag, step) for tag in needed for step in steps if step not in series.get(tag, {})]
    assert not missing, f"{label}no logged value to judge the signal by: {missing}"
    norms = {step: series["grad_norm"][step] for step in steps}
    dead = []
    if min(norms.values()) <= GRAD_NORM_FLOOR:
        dead.append(f"grad_norm {norms} not above the floor {GRAD_NORM_FLOOR:g} at every step")
    if len(set(norms.values())) < len(norms):
        dead.append(f"grad_norm {norms} the same at two steps")
    if advantages:
        spread = {step: series["reward_std"][step] for step in steps}
        size = {step: series["advantage_abs_mean"][step] for step in steps}
        if not any(spread[step] > 0 and size[step] > ADVANTAGE_FLOOR for step in steps):
            dead.append(f"no step with rewards that differ and advantages above the floor {ADVANTAGE_FLOOR:g}: "
                        f"reward_std {spread}, advantage_abs_mean {size}")
    assert not dead, f"{label}a dead signal, the comparison would say nothing: " + "; ".join(dead)


def assert_moved(before, after, what: str = "", rtol: float = RUN_RTOL):
    """Per-token outputs (e.g. log-probs) before and after training steps differ by more than the runs' rule
    (assert_runs_agree's rtol of their magnitude): two runs agreeing on `after` then says the steps were taken
    alike, not only that neither moved the model."""
    before, after = flat_series(before), flat_series(after)
    assert before.keys() == after.keys(), what
    scale = max(abs(v) for series in (before, after) for v in series.values())
    moved = max(abs(after[i] - before[i]) for i in before)
    assert moved > rtol * scale, (f"{what}: moved by {moved:.3g}, not more than the comparison's tolerance "
                                  f"{rtol:g} x {scale:.4g}")


def flat_series(nested) -> dict:
    """{i: value} of a (nested) list of numbers, for assert_runs_agree on a per-token output."""
    import torch

    return dict(enumerate(torch.as_tensor(nested, dtype=torch.float64).flatten().tolist()))


def micro_batches(count=2, rows=2, length=12, prompt=4, seed=0):
    """Random token rows (megarl.model_runner.MicroBatch), each one sample (prompt, then response) of the tiny vocabulary."""
    import torch

    from megarl.model_runner import MicroBatch

    generator = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(count):
        tokens = torch.randint(1, 259, (rows, length), generator=generator)
        labels = torch.cat([tokens[:, 1:], torch.zeros(rows, 1, dtype=torch.long)], dim=1)
        loss_mask = torch.zeros(rows, length)
        loss_mask[:, prompt - 1: length - 1] = 1.0
        batches.append(MicroBatch(tokens, labels, loss_mask, [(row, 0, prompt, length - prompt) for row in range(rows)],
                                  {}, torch.arange(length).expand(rows, length).contiguous(),
                                  list(range(index * rows, (index + 1) * rows))))
    return batches


def nll(batch, logits, companion_outputs):
    """A transform for TrainableModel.optimizer_step: the summed negative log-likelihood of the responses."""
    import torch

    logprobs = logits.float().log_softmax(-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    loss = -(logprobs * batch.loss_mask).sum()
    return loss, batch.loss_mask.sum().to(torch.int), {"sums": {"loss": loss.detach()}}


def opsd_step_batch(run):
    """The step-0 samples of `run`, every other one made an OPSD row whose privileged teacher prompt is longer
    than the student's, scored and prepared (old logprobs): what a teach phase reads."""
    from megarl import phases
    from megarl.data.prompts import render_chat

    samples, _ = phases.generate(run, 0)
    for i, sample in enumerate(samples):
        if i % 2 == 0:
            sample.teacher_prompt_ids = render_chat(
                run.tokenizer, f"Hint: the answer is {sample.metadata['answer']}. Add the numbers carefully.",
                system_prompt="You are a careful calculator.")
    batch, _ = phases.score_and_filter(run, samples)
    batch, _ = phases.prepare(run, batch)
    return batch


def with_positions(model: str, positions: int, directory) -> str:
    """A copy of `model` in `directory`/model whose config allows `positions` positions (RoPE has no table to
    grow): room for a gym environment's long opening (its rules and board)."""
    import json
    import shutil

    path = Path(directory) / "model"
    shutil.copytree(model, path)
    config = json.loads((path / "config.json").read_text())
    for holder in (config, config.get("text_config") or {}):
        if "max_position_embeddings" in holder:
            holder["max_position_embeddings"] = positions
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
