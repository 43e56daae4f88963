"""vLLM's own completion text against megarl's `response_text` (one in-process engine): JSON report.

argv: model dir, output file. Samples at temperature 1 with room to end on EOS (64 tokens) and without
it (3 tokens), vLLM detokenizing; then the same prompts with detokenize=False, as megarl asks for them
when no --stop string needs vLLM's text."""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: an EngineCore process would outlive os._exit


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megarl.data.prompts import render_chat
    from megarl.rollout import _samples_of, response_text

    path, out = sys.argv[1], sys.argv[2]
    llm = LLM(model=path, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)
    tokenizer = llm.get_tokenizer()
    texts = [f"What is {a} + {b}?" for a, b in [(12, 30), (7, 88), (3, 9), (41, 5), (60, 17), (2, 2)]]
    prompts = [render_chat(tokenizer, text) for text in texts]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    report = {"completions": [], "ids_only": []}
    for max_tokens in (64, 3):
        params = SamplingParams(n=4, temperature=1.0, max_tokens=max_tokens, logprobs=0)
        for prompt, output in zip(prompts, llm.generate(requests, params, use_tqdm=False)):
            samples = _samples_of(0, prompt, output, text_of=functools.partial(response_text, tokenizer))
            for completion, sample in zip(output.outputs, samples):
                report["completions"].append({"finish": completion.finish_reason, "vllm": completion.text,
                                              "megarl": sample.response_text, "ids": list(completion.token_ids)})
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, logprobs=0, detokenize=False)
    for output in llm.generate(requests, params, use_tqdm=False):
        for completion in output.outputs:
            report["ids_only"].append({"text": completion.text, "ids": len(completion.token_ids),
                                       "logprobs": len(completion.logprobs or [])})
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    os._exit(0)
