"""Export a megarl checkpoint's policy to an HF directory (safetensors, config, tokenizer).

Runs on TP x PP ranks of any size, whatever the sizes the checkpoint was saved
with (Megatron reshards on load):

    torchrun --nproc_per_node 2 tools/export_hf.py --checkpoint runs/x/ckpt/step_00000100 \\
        --out runs/x/hf_step100 --tensor-model-parallel-size 2

The export is the same stream the trainer uses for its weight sync and for
--save-hf-dir (`megarl/models/convert.py: iter_hf_weights`), so the directory
loads in transformers and vLLM with the trainer's logits.

A LoRA checkpoint (--lora-rank) holds only the adapters: they are loaded onto the base
they were trained on (recorded in its state.json; --model names another copy of it) and
written as --lora-export asks: a PEFT adapter directory, the merged HF checkpoint, or both.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.errors import ConfigError  # noqa: E402


def parse_own_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a step_N directory, or a --save-dir (newest is used)")
    parser.add_argument("--out", required=True, help="HF directory to write")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lora-export", choices=["adapter", "merged", "both"], default=None,
                        help="a LoRA checkpoint: the PEFT adapter directory (default), the merged HF checkpoint, "
                             "or the merged one with the adapter directory in its adapter/")
    parser.add_argument("--model", default=None,
                        help="a LoRA checkpoint: its base's HF directory (default: the one recorded at training)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    own = parse_own_args(argv)
    from megarl import checkpoint, distributed
    from megarl.arguments import parse_args

    path = own.checkpoint if os.path.isfile(os.path.join(own.checkpoint, "state.json")) \
        else checkpoint.find_latest(own.checkpoint)
    if path is None:
        print(f"export_hf: error: {own.checkpoint}: no complete megarl checkpoint", file=sys.stderr)
        return 2
    hf_dir = os.path.join(path, "hf_config")
    record = checkpoint.read_state(path).get("lora")
    if record is None and (own.lora_export or own.model):
        print(f"export_hf: error: --lora-export / --model: {path} is not a LoRA checkpoint", file=sys.stderr)
        return 2
    lora_argv = [] if record is None else [
        "--lora-rank", str(record["rank"]), "--lora-alpha", str(record["alpha"]), "--lora-dropout",
        str(record["dropout"]), "--lora-target-modules", *record["targets"],
        "--lora-export", own.lora_export or "adapter"]
    try:
        args = parse_args(["--model", own.model or (record["base"] if record else hf_dir),
                           "--tensor-model-parallel-size", str(own.tensor_model_parallel_size),
                           "--pipeline-model-parallel-size", str(own.pipeline_model_parallel_size),
                           "--params-dtype", own.params_dtype, *lora_argv])
        if record is not None:
            from megarl.models import lora

            why = lora.checkpoint_mismatch(record, args, lora.LoraConfig(record["rank"], record["alpha"],
                                                                         record["dropout"], tuple(record["targets"])))
            if why:
                raise ConfigError(f"{path}: {why}")
    except ConfigError as error:
        print(f"export_hf: error: {error}", file=sys.stderr)
        return 2
    context = distributed.init_distributed(args)
    distributed.init_megatron_parallel(context, args.seed)

    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from megarl.models.convert import load_hf_weights
    from megarl.models.megatron_gpt import DTYPES, build_gpt_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(hf_config, DTYPES[args.params_dtype], args.make_vocab_size_divisible_by,
                            lora=record is not None)
    if record is not None:  # the base, then the adapters on it (their initial values are overwritten below)
        from megarl.models.lora import apply_lora, lora_config

        load_hf_weights(model, args.model, hf_config)
        apply_lora(model, hf_config, lora_config(args, hf_config), args.seed)
    checkpoint.load_model_weights(model, path)
    checkpoint.export_policy(model, args, hf_config, own.out, AutoTokenizer.from_pretrained(hf_dir),
                             is_writer=dist.get_rank() == 0, base_model=args.model)
    if dist.get_rank() == 0:
        print(f"export_hf: {path} -> {own.out}", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown of gloo threads
