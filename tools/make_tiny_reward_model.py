"""Build a tiny random reward model (Qwen2ForSequenceClassification, num_labels=1), offline.

    python tools/make_tiny_reward_model.py --out DIR [--seed 0]

For tests and dry runs of `megarl.rewards.reward_model`: its scores mean nothing,
but it is a real HF sequence-classification checkpoint with its own tokenizer,
chat template and pad token, saved with save_pretrained, so loading, rendering,
padding and pooling run exactly as with a trained reward model. The tokenizer is
the tiny policy's (tools/make_tiny_model.py: byte-level, ChatML template,
pad = <|endoftext|>). Weights are drawn from N(0, 0.1), norm scales from
N(1, 0.1): the default init (std 0.02, biases 0) makes every score nearly the
same, which would hide pooling mistakes in tests. Deterministic in --seed.
Takes a few seconds, most of it importing torch and transformers.
"""
import argparse
import sys
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForSequenceClassification

MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512}


def build(out: Path, seed: int = 0) -> Path:
    """Write the tokenizer and a random reward model to `out`; returns `out`."""
    # The policy's tokenizer builder, imported from the sibling script (tools/ is not a package).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, rope_theta=10000.0,
                         tie_word_embeddings=False, dtype="float32", **MODEL)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    print(build(args.out, args.seed))


if __name__ == "__main__":
    main()
