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


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def make_random_qwen2(path, tied: bool, seed: int = 0, vocab_size: int = 250) -> str:
    """A small random Qwen2 checkpoint with GQA, QKV bias and an unpadded vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, rope_theta=10000.0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # default init leaves biases and norms at 0/1; make every tensor matter
        for param in model.parameters():
            param.normal_(std=0.1)
    model.save_pretrained(path)
    return str(path)
