"""Rollout and evaluation dumps: one JSONL file per step and set, written by rank 0.

Each line: step, prompt (decoded, with the chat template), response, reward,
reason, truncated, prompt_tokens and response_tokens (the token counts: what was trained, where the
decoded text need not re-encode to the same ids), and the row's id / gt_answer / data_source when it has them; a multi-turn
episode (--tools) also its `conversation` after the prompt (megarl/multiturn.py: the assistant turns
with their tool calls and the tool messages), its `response` being the last assistant turn.
A file is written aside and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os

ROW_FIELDS = ("id", "gt_answer", "data_source")


def write_samples(directory: str, filename: str, samples, tokenizer, step: int) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, filename)
    partial = path + ".partial"
    with open(partial, "w") as f:
        for sample in samples:
            record = {"step": step, "prompt": tokenizer.decode(sample.prompt_ids), "response": sample.response_text,
                      "reward": sample.reward, "reason": sample.reason, "truncated": sample.truncated,
                      "prompt_tokens": len(sample.prompt_ids), "response_tokens": len(sample.response_ids)}
            record.update({key: sample.metadata[key] for key in ROW_FIELDS if sample.metadata.get(key) is not None})
            if sample.turns is not None:  # a multi-turn episode: "response" is its last turn, this the whole of it
                record["conversation"] = sample.turns
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(partial, path)
    return path
