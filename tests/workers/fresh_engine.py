"""A fresh vLLM engine (one process) loaded from an HF checkpoint: greedy outputs as JSON."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# In-process engine: a separate EngineCore process would outlive os._exit and
# hold the caller's output pipes open.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.data.prompts import render_chat
    from sync_worker import GREEDY_PROMPTS

    path, out = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=path, enforce_eager=True, dtype="float32", max_model_len=256)
    prompts = [TokensPrompt(prompt_token_ids=render_chat(tokenizer, text)) for text in GREEDY_PROMPTS]
    max_tokens = int(sys.argv[3])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)


if __name__ == "__main__":
    main()
    os._exit(0)
