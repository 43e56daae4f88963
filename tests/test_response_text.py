"""The response text rewards read: `rollout.response_text`, the tokenizer's decode of the response ids
(special tokens skipped, the stop token that ended it left out), which is what vLLM's own incremental
text is for valid UTF-8 and what the HF backend, TRL and verl decode. megarl asks vLLM for ids only
unless a --stop string needs vLLM's text (vLLM would otherwise decode every sampled token's logprob
entry too)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT, WORKERS, read_json
from megarl.arguments import parse_args
from megarl.rollout import response_text, sampling_params


def test_response_text_leaves_out_the_stop_token_only_when_one_ended_the_response(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids = tokenizer.encode("42", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert response_text(tokenizer, ids + [eos], ended_by_stop_token=True) == "42"
    assert response_text(tokenizer, ids, ended_by_stop_token=False) == "42"
    # a truncated response keeps its last token, and special tokens are skipped wherever they are
    assert response_text(tokenizer, ids + ids, ended_by_stop_token=False) == "4242"
    assert response_text(tokenizer, ids + [eos] + ids, ended_by_stop_token=False) == "4242"
    assert response_text(tokenizer, ids + ids, ended_by_stop_token=True) == "424"


def test_vllm_detokenizes_only_where_a_stop_string_or_a_tool_call_needs_it():
    args = parse_args([], world_size=1)
    assert [p.detokenize for p in sampling_params(args, [0, 1], 0, (), 2, 1.0, 0, False, detokenize=False)] == \
        [False, False]
    assert all(p.detokenize and p.logprobs == 0
               for p in sampling_params(args, [0], 0, (), 2, 1.0, 0, False, detokenize=True))


@pytest.mark.slow
def test_response_text_is_vllms_own_text(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(WORKERS / "response_text_worker.py"), tiny_model, str(out)], cwd=ROOT,
                   check=True, timeout=600, env={**os.environ, "PYTHONPATH": f"{ROOT}:{WORKERS}"})
    report = read_json(out)
    completions = report["completions"]
    assert {c["finish"] for c in completions} == {"stop", "length"}  # both endings, so both rules are checked
    # Valid UTF-8 (no replacement character in the decode): the same text. A byte-level model sampling at
    # temperature 1 may emit an incomplete byte sequence, where the two differ by design (response_text).
    valid = [c for c in completions if "\ufffd" not in c["megarl"]]
    assert len(valid) >= len(completions) // 2 and any(c["vllm"] for c in valid)
    for c in valid:
        assert c["megarl"] == c["vllm"], c
    # ids only: no text from vLLM, the ids and one logprob entry per token still there
    assert report["ids_only"] and all(r["text"] == "" and r["ids"] == r["logprobs"] > 0 for r in report["ids_only"])
