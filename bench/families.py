"""Benchmark: the same GRPO job on a Qwen3.5 (hybrid Gated DeltaNet / gated attention) and a Qwen3 of about the
same size, side by side, in one run.

    python bench/families.py [--steps 4 --warmup 1 --length 128]

The job is bench/e2e.py's (8 prompts x 4 samples of the built-in arithmetic task per step, fp32, 2 ranks
colocated, one optimizer step per generation), with every response exactly --length new tokens
(--min-new-tokens = --max-new-tokens) so that both models train the same tokens. The models are built here,
offline and seeded, with random weights and the built-in tokenizer, on bench/e2e.py's trunk (hidden 512,
12 layers, 8 query heads of 64 in 2 groups, SwiGLU of 1408): the Qwen3 with q/k norms; the Qwen3.5 with
Qwen3.5's pattern of three Gated DeltaNet layers (2 key heads and 4 value heads of 64) to one gated softmax
attention layer (a quarter of each head rotated). Their parameter counts are printed: the GDN layers are a
little lighter than attention layers, the gated ones a little heavier.

Printed: each model's parameters and per-step seconds (median after --warmup) of the whole step, the
generation and the update, and Qwen3.5's over Qwen3's for each. On CPU ranks Qwen3.5's Gated DeltaNet runs
torch code: Megatron's chunked delta rule in the trainer (a Python loop over each 64-token chunk's rows) and
megarl's fp32 recurrence in vLLM (megarl/vllm_cpu.py: a Python loop over each sequence's tokens), where a
GPU runs flash-linear-attention's and vLLM's kernels; the ratios say what that costs here, not on a GPU.

It prints; it asserts nothing.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from e2e import MODEL, median_after, megarl_command, run_megarl  # noqa: E402

TRUNK = {key: value for key, value in MODEL.items() if key != "max_position_embeddings"}
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(head_dim=64, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                     linear_value_head_dim=64, linear_conv_kernel_dim=4)),
}


def build_model(family: str, out: str) -> int:
    """The family's bench model (seeded, rebuilt when its recorded shape differs); its parameter count."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_tiny_model import build_tokenizer

    config_class, model_class, fields = FAMILIES[family]
    shape = {**TRUNK, **fields, "max_position_embeddings": 1024}
    marker = os.path.join(out, "bench_families.json")
    if os.path.exists(marker):
        with open(marker) as f:
            stored = json.load(f)
        if stored["shape"] == shape:
            return stored["parameters"]
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    rope = dict(rope_type="default", rope_theta=10000.0, **({"partial_rotary_factor": 0.25} if family == "qwen3_5"
                                                             else {}))
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), tie_word_embeddings=True,
                                                 bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                                 pad_token_id=tokenizer.pad_token_id, rope_parameters=rope,
                                                 dtype="float32", **shape)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    with open(marker, "w") as f:  # last: an interrupted build is redone
        json.dump({"parameters": parameters, "shape": shape}, f)
    return parameters


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--length", type=int, default=128, help="every response exactly this many new tokens")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "artifacts", "bench-families"))
    args = parser.parse_args()
    results = {}
    for family in FAMILIES:
        model = os.path.join(args.work_dir, family)
        parameters = build_model(family, model)
        command = megarl_command(model, args.steps, os.path.join(args.work_dir, f"tb_{family}"), ["--padding-free"],
                                 args.length)
        print(f"[bench] {family}: {parameters / 1e6:.1f}M parameters, {args.steps} steps", flush=True)
        run = run_megarl(command)
        results[family] = {"parameters": parameters, **{part: median_after(run[f"{part}_seconds"], args.warmup)
                                                        for part in ("step", "generate", "update")}}
    base, hybrid = results["qwen3"], results["qwen3_5"]
    print(f"\n{'':10} {'params':>8} {'step s':>8} {'generate s':>11} {'update s':>9}")
    for family, result in results.items():
        print(f"{family:10} {result['parameters'] / 1e6:7.1f}M {result['step']:8.2f} {result['generate']:11.2f} "
              f"{result['update']:9.2f}")
    print(f"{'qwen3_5 / qwen3':10} {hybrid['parameters'] / base['parameters']:7.2f}x "
          + " ".join(f"{hybrid[part] / base[part]:{width}.2f}x" for part, width in
                     (("step", 7), ("generate", 10), ("update", 8))))


if __name__ == "__main__":
    main()
