"""Shared test utilities: launching real torchrun workers and building random HF models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


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
_FAMILIES = {
    # family: (transformers classes, config fields, init std)
    "qwen2": (("Qwen2Config", "Qwen2ForCausalLM"), dict(max_position_embeddings=128), 0.1),
    # head_dim 32 != hidden / heads = 16: Megatron's kv_channels must follow the config. (The
    # new families also go into vLLM, whose CPU attention has no kernel for head_dim 16.)
    "qwen3": (("Qwen3Config", "Qwen3ForCausalLM"), dict(max_position_embeddings=128, head_dim=32), 0.1),
    # Larger weights: at std 0.1 attention is so nearly uniform that positions (hence RoPE
    # scaling) barely move the logits; at 0.2 the scaling changes them by > 1e-2.
    "llama": (("LlamaConfig", "LlamaForCausalLM"), dict(max_position_embeddings=16384, head_dim=32), 0.2),
}


def make_random_model(path, family: str, tied: bool, seed: int = 0, vocab_size: int = 250,
                      llama3_rope: str | None = None, **config_fields) -> str:
    """A small random HF checkpoint of `family` in which every tensor is N(0, std).

    `llama3_rope` names an entry of LLAMA3_ROPE (Llama only); `config_fields` override the
    tiny config.
    """
    import torch
    import transformers

    (config_class, model_class), fields, std = _FAMILIES[family]
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope is not None:
        rope.update(rope_type="llama3", **LLAMA3_ROPE[llama3_rope])
    config = getattr(transformers, config_class)(**{**_TINY, **fields, **config_fields}, vocab_size=vocab_size,
                                                 tie_word_embeddings=tied, rope_parameters=rope)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # default init leaves biases and norms at 0/1; make every tensor matter
        for param in model.parameters():
            param.normal_(std=std)
    model.save_pretrained(path)
    return str(path)


def make_random_qwen2(path, tied: bool, seed: int = 0, vocab_size: int = 250) -> str:
    """A small random Qwen2 checkpoint with GQA, QKV bias and an unpadded vocabulary."""
    return make_random_model(path, "qwen2", tied, seed, vocab_size)
