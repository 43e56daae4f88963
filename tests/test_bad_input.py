"""Bad input by the dozen: malformed configs, data files and model directories.

Each row of CASES is one bad input given to megarl's entry point (`megarl/train.py`'s
`main`). Every one must end the run with one line on stderr that names the file and
line, the field or the flag (the row's words), a non-zero exit status, and nothing
written: no --save-dir, --log-dir, --rollout-save-dir or --save-hf-dir, and nothing
in the working directory. All of them are caught before any process group or engine
starts, so the table runs in-process (the run itself is replaced by a stub that fails
the case if it is ever reached); `test_the_real_command_line` runs a few through
`python megarl/train.py`, and the slow test one through torchrun on two ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT

TINY = ROOT / "artifacts" / "tiny-qwen2"
OUTPUT_FLAGS = {"--save-dir": "ckpt", "--log-dir": "tb", "--rollout-save-dir": "dumps", "--save-hf-dir": "hf"}


# ------------------------------------------------------------------ inputs ----

def write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def row(question="What is 1 + 1?", answer="2", **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], "gt_answer": answer, **fields}


def jsonl(path: Path, *lines) -> str:
    """One line per item: dicts as JSON, strings verbatim."""
    return write(path, "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))


def parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def model_dir(path: Path, weights=True, config: dict | str | None = None) -> str:
    """A copy of the tiny model; without its weights, or with another config.json."""
    shutil.copytree(TINY, path, ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(
            {**json.loads((TINY / "config.json").read_text()), **config})
        (path / "config.json").write_text(text)
    return str(path)


# The tiny model's config as a Qwen3.5 one, layer 0 Gated DeltaNet (no such tensors in the tiny model's weights).
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "head_dim": 32,
           "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}


def qwen3_5_policy(path: Path) -> str:
    """A random Qwen3.5 with the tiny model's tokenizer (tests/helpers.py's shape): every tensor it needs."""
    import shutil

    from transformers import AutoTokenizer

    from helpers import make_random_model

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    make_random_model(path, "qwen3_5", True, 0, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    shutil.copy(TINY / "generation_config.json", path)
    return str(path)


def bigger_tokenizer(path: Path) -> str:
    """The tiny model's tokenizer with 20 more tokens than the model's vocab_size (259)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(20)])
    tokenizer.save_pretrained(path)
    return str(path)


def config(d: Path, text: str) -> list[str]:
    return ["--config", write(d / "config.yaml", text)]


# ------------------------------------------------------------------- table ----

def peft_adapter(path: Path, r: int = 4, in_width: int | None = None, layer: int = 0, **config) -> str:
    """A PEFT LoRA directory for the tiny model's q_proj of `layer` (rank `r`; A's input `in_width`, default the
    model's hidden size), adapter_config.json's fields overridden by `config`."""
    import torch
    from safetensors.torch import save_file

    hidden = json.loads((TINY / "config.json").read_text())["hidden_size"]
    path.mkdir(parents=True)
    stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    save_file({f"{stem}.lora_A.weight": torch.zeros(r, in_width or hidden),
               f"{stem}.lora_B.weight": torch.zeros(hidden, r)}, path / "adapter_model.safetensors")
    write(path / "adapter_config.json", json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8,
                                                    "target_modules": ["q_proj"], **config}))
    return str(path)


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]  # the bad input, built in the test's directory
    words: list[str]  # what the one line must contain
    world: int = 1  # launched ranks (RANK / WORLD_SIZE)
    env: dict = field(default_factory=dict)


def train_data(d: Path, *lines) -> list[str]:
    return ["--train-data", jsonl(d / "train.jsonl", *lines)]


CASES = [
    # --- YAML config
    Case("yaml-syntax", lambda d: config(d, "lr: 1e-6\ntrain: {gpus: 1\n"), ["config.yaml line 3", "not valid YAML"]),
    Case("yaml-not-a-mapping", lambda d: config(d, "- lr\n- 1e-6\n"), ["config.yaml", "top level must be a mapping"]),
    Case("yaml-unknown-key", lambda d: config(d, "temperture: 0.7\n"),
         ["config.yaml", "temperture", "did you mean 'temperature'"]),
    Case("yaml-unknown-role-key", lambda d: config(d, "rollout: {gpus: 1, tensor_paralel_size: 1}\n"),
         ["rollout.tensor_paralel_size", "did you mean 'tensor_parallel_size'"]),
    Case("yaml-wrong-type", lambda d: config(d, "lr: fast\n"), ["config.yaml: lr", "expected a number", "'fast'"]),
    Case("yaml-float-for-int", lambda d: config(d, "num_generations: 2.5\n"),
         ["num_generations", "expected an integer"]),
    Case("yaml-engine-kwargs-not-mapping", lambda d: config(d, "rollout: {engine_kwargs: max_num_seqs=4}\n"),
         ["rollout.engine_kwargs", "expected a mapping"]),
    Case("yaml-unknown-estimator", lambda d: config(d, "advantage_estimator: grp\n"),
         ["advantage_estimator", "one of", "grpo"]),
    Case("config-missing", lambda d: ["--config", str(d / "nope.yaml")], ["--config", "nope.yaml", "no such file"]),
    Case("config-is-a-directory", lambda d: ["--config", str(d)], ["--config", "cannot read it", "Is a directory"]),
    Case("config-not-utf8", lambda d: ["--config", write(d / "config.yaml", b"lr: 1e-6\nsystem_prompt: caf\xe9\n")],
         ["config.yaml line 2", "not UTF-8"]),
    Case("yaml-key-twice", lambda d: config(d, "lr: 1e-6\ntrain: {gpus: 1}\nlr: 2e-6\n"),
         ["config.yaml line 3", "'lr' is given twice"]),
    Case("yaml-key-twice-spelled-two-ways", lambda d: config(d, "max-new-tokens: 8\nmax_new_tokens: 16\n"),
         ["config.yaml", "max-new-tokens and max_new_tokens set the same option"]),
    Case("yaml-key-top-level-and-in-train", lambda d: config(d, "lr: 1e-6\ntrain: {lr: 2e-6}\n"),
         ["config.yaml", "lr and train.lr set the same option"]),
    # --- command line
    Case("unknown-flag", lambda d: ["--lerning-rate", "1e-6"], ["unrecognized arguments", "--lerning-rate"]),
    Case("flag-wrong-type", lambda d: ["--micro-batch-size", "two"], ["--micro-batch-size", "invalid int value"]),
    Case("unknown-estimator", lambda d: ["--advantage-estimator", "grp"],
         ["--advantage-estimator", "invalid choice", "'grp'"]),
    Case("unknown-reward", lambda d: ["--reward", "boxd"], ["--reward 'boxd' is not registered", "'boxed'"]),
    Case("bad-reward-weight", lambda d: ["--reward", "boxed:heavy"], ["--reward", "boxed:heavy"]),
    Case("engine-kwargs-bad-json", lambda d: ["--rollout-engine-kwargs", "{max_num_seqs: 4}"],
         ["--rollout-engine-kwargs", "not valid JSON"]),
    Case("engine-kwargs-not-object", lambda d: ["--rollout-engine-kwargs", "[4]"],
         ["--rollout-engine-kwargs", "expected a JSON object"]),
    Case("engine-kwargs-unknown-key", lambda d: ["--rollout-engine-kwargs", '{"max_num_seq": 4}'],
         ["rollout.engine_kwargs", "'max_num_seq' is not an argument of vLLM's engine", "'max_num_seqs'"]),
    Case("yaml-teacher-engine-kwargs-unknown-key", lambda d: config(d, "teacher: {engine_kwargs: {max_logprob: 8}}\n"),
         ["teacher.engine_kwargs", "'max_logprob'", "'max_logprobs'"]),
    # --- sizes
    Case("zero-micro-batch", lambda d: ["--micro-batch-size", "0"], ["--micro-batch-size must be >= 1"]),
    Case("negative-generations", lambda d: ["--num-generations", "-2"], ["--num-generations must be >= 1"]),
    Case("zero-max-prompt-length", lambda d: ["--max-prompt-length", "0"], ["--max-prompt-length must be >= 1"]),
    Case("negative-train-steps", lambda d: ["--train-steps", "-1"], ["--train-steps must be >= 0"]),
    Case("zero-temperature", lambda d: ["--temperature", "0"], ["--temperature > 0", "got 10 and 0.0"]),
    Case("negative-min-new-tokens", lambda d: ["--min-new-tokens", "-1"],
         ["--min-new-tokens must be in [0, --max-new-tokens=32]", "got -1"]),
    Case("min-new-tokens-over-max", lambda d: ["--max-new-tokens", "8", "--min-new-tokens", "9"],
         ["--min-new-tokens must be in [0, --max-new-tokens=8]", "got 9"]),
    Case("fixed-length-with-filter-truncated",
         lambda d: ["--max-new-tokens", "8", "--min-new-tokens", "8", "--filter-truncated"],
         ["--filter-truncated", "--min-new-tokens = --max-new-tokens = 8", "every response"]),
    Case("builtin-task-prompt-too-long", lambda d: ["--max-prompt-length", "8"],
         ["the built-in task", "over --max-prompt-length 8"]),
    # --- rank layouts (2 ranks launched)
    Case("tp-does-not-divide", lambda d: ["--tensor-model-parallel-size", "3"],
         ["train.gpus=2", "tensor_model_parallel_size"], world=2),
    Case("colocated-counts-differ", lambda d: config(d, "train: {gpus: 2}\nrollout: {gpus: 1}\n"),
         ["colocate_groups", "train.gpus=2", "rollout.gpus=1"], world=2),
    Case("more-ranks-than-launched", lambda d: config(d, "colocate_groups: []\ntrain: {gpus: 2}\nrollout: {gpus: 1}\n"),
         ["needs 3 ranks", "2 were launched"], world=2),
    Case("rollout-tp-too-big", lambda d: ["--rollout-tensor-parallel-size", "4"],
         ["rollout.tensor_parallel_size=4"], world=2),
    # --- LoRA
    Case("lora-target-the-family-lacks", lambda d: ["--lora-rank", "8", "--lora-target-modules", "q_proj", "c_attn"],
         ["--lora-target-modules 'c_attn'", "qwen2 family has no such linear", "q_proj", "all-linear"]),
    Case("lora-alpha-without-rank", lambda d: ["--lora-alpha", "16"], ["--lora-alpha need --lora-rank > 0"]),
    Case("lora-negative-rank", lambda d: ["--lora-rank", "-8", "--lora-alpha", "16"],
         ["--lora-rank must be >= 0", "got -8"]),
    Case("lora-dropout-one", lambda d: ["--lora-rank", "8", "--lora-dropout", "1"], ["--lora-dropout", "[0, 1)"]),
    Case("lora-other-reference", lambda d: ["--lora-rank", "8", "--kl-coef", "0.1", "--ref-model", model_dir(d / "ref")],
         ["--ref-model", "--lora-rank", "the policy's base", "drop --ref-model"]),
    Case("lora-load-another-rank", lambda d: ["--lora-rank", "8", "--lora-load", peft_adapter(d / "adapter")],
         ["--lora-load", "adapter_config.json", "--lora-rank 4, this run --lora-rank 8"]),
    Case("lora-load-another-width", lambda d: ["--lora-load", peft_adapter(d / "adapter", in_width=96)],
         ["adapter_model.safetensors", "layers.0.self_attn.q_proj.lora_A.weight is [4, 96]", "another base"]),
    Case("lora-load-a-layer-the-base-lacks", lambda d: ["--lora-load", peft_adapter(d / "adapter", layer=7)],
         ["made for another base", "model.layers.7.self_attn.q_proj", "does not have"]),
    Case("lora-load-dora", lambda d: ["--lora-load", peft_adapter(d / "adapter", use_dora=True)],
         ["adapter_config.json", "use_dora = True is not supported"]),
    Case("lora-load-nothing-there", lambda d: ["--lora-load", str(d / "missing")],
         ["--lora-load", "no PEFT adapter there", "adapter_config.json"]),
    Case("lora-export-without-rank", lambda d: ["--lora-export", "merged"], ["--lora-export need --lora-rank > 0"]),
    Case("lora-sync-without-rank", lambda d: ["--lora-sync", "adapter"], ["--lora-sync need --lora-rank > 0"]),
    Case("routing-replay-dense", lambda d: ["--routing-replay", "on"],
         ["--routing-replay on needs a mixture-of-experts model", "(dense)"]),
    Case("lora-adapter-sync-on-hf-engines", lambda d: ["--lora-rank", "8", "--lora-sync", "adapter",
                                                       "--rollout-backend", "hf"],
         ["--lora-sync adapter does not work with --rollout-backend hf", "use --lora-sync merged"]),
    # --- plugins
    Case("plugin-missing", lambda d: ["--external-plugins", str(d / "gone.py")], ["gone.py", "no such file"]),
    Case("plugin-syntax-error", lambda d: ["--external-plugins", write(d / "broken.py", "def f(:\n    pass\n")],
         ["--external-plugins", "broken.py", "SyntaxError", "line 1"]),
    # --- checkpoints
    Case("resume-not-a-checkpoint", lambda d: ["--resume", os.path.dirname(write(d / "old_run" / "log.txt", "x"))],
         ["--resume", "old_run", "not a complete megarl checkpoint"]),
    Case("resume-a-file", lambda d: ["--resume", write(d / "step_1.pt", "x")],
         ["--resume", "step_1.pt", "not a complete megarl checkpoint"]),
    # --- data files
    Case("jsonl-broken-line", lambda d: train_data(d, row(), '{"messages": [{"role": "user", "content": "x"}]',
                                                   row()),
         ["train.jsonl:2", "not valid JSON"]),
    Case("missing-field", lambda d: train_data(d, row(), {"question": "1+1?", "gt_answer": "2"}),
         ["train.jsonl:2", "cannot tell the layout", "question"]),
    Case("missing-content", lambda d: train_data(d, {"messages": [{"role": "user"}], "gt_answer": "2"}),
         ["train.jsonl:1", "messages[0].content", "must be a string, got nothing"]),
    Case("answer-wrong-type", lambda d: train_data(d, row(), row(answer=["2", "two"])),
         ["train.jsonl:2", "gt_answer", "must be a string, got list"]),
    Case("messages-wrong-type", lambda d: train_data(d, {"messages": "What is 1 + 1?", "gt_answer": "2"}),
         ["train.jsonl:1", "'messages' must be a non-empty list", "got string"]),
    Case("row-not-object", lambda d: ["--train-data", write(d / "rows.json", json.dumps([row(), [1, 2]]))],
         ["rows.json:2", "expected a JSON object, got list"]),
    Case("empty-file", lambda d: ["--train-data", write(d / "train.jsonl", "")], ["train.jsonl", "empty file"]),
    Case("blank-lines-only", lambda d: ["--train-data", write(d / "train.jsonl", "\n \n\n")],
         ["train.jsonl", "empty file"]),
    Case("not-utf8", lambda d: ["--train-data", write(d / "train.jsonl", json.dumps(row()).encode() + b"\n" +
                                                     '{"messages": "caf\u00e9"}'.encode("latin-1"))],
         ["train.jsonl:2", "not UTF-8"]),
    Case("parquet-wrong-schema", lambda d: ["--train-data", parquet(d / "train.parquet",
                                                                    [{"question": "1+1?", "answer": 2}])],
         ["train.parquet:1", "cannot tell the layout", "answer, question"]),
    Case("parquet-wrong-column-type", lambda d: ["--train-data", parquet(d / "train.parquet",
                                                                         [{"messages": 7, "gt_answer": "2"}])],
         ["train.parquet:1", "'messages' must be a non-empty list", "got integer"]),
    Case("parquet-not-parquet", lambda d: ["--train-data", write(d / "train.parquet", "question,answer\n1+1?,2\n")],
         ["train.parquet", "not a readable Parquet file"]),
    Case("unknown-file-type", lambda d: ["--train-data", write(d / "train.csv", "question,answer\n")],
         ["train.csv", "unknown file type"]),
    Case("no-such-file", lambda d: ["--train-data", str(d / "nope.jsonl")], ["nope.jsonl", "no such file"]),
    Case("directory-without-data", lambda d: ["--train-data", os.path.dirname(write(d / "data" / "notes.txt", "x"))],
         ["data", "directory has no .jsonl, .json, .parquet files"]),
    Case("glob-matches-nothing", lambda d: ["--train-data", str(d / "shards" / "*.parquet")],
         ["shards/*.parquet", "no files match"]),
    Case("prompt-too-long", lambda d: train_data(d, row(), row(question="x" * 400)) + ["--truncation", "error"],
         ["train.jsonl:2", "over --max-prompt-length 128"]),
    Case("unknown-preprocessor", lambda d: train_data(d, row()) + ["--preprocessor", "my_qa"],
         ["--preprocessor 'my_qa' is not registered"]),
    Case("preprocessor-without-data", lambda d: ["--preprocessor", "my_qa"], ["--preprocessor", "--train-data"]),
    Case("gkd-rows-without-responses", lambda d: train_data(d, row()) + ["--teacher-model", str(TINY),
                                                                         "--gkd-lmbda", "0.5"],
         ["train.jsonl:1", "--gkd-lmbda 0.5", "this row has none"]),
    # --- evaluation sets
    Case("eval-spec-without-name", lambda d: ["--eval-dataset", str(d / "eval.jsonl")],
         ["--eval-dataset", "NAME=PATH"]),
    Case("eval-builtin-zero", lambda d: ["--eval-dataset", "arith=builtin:0"], ["builtin:N", "positive"]),
    Case("eval-name-twice", lambda d: ["--eval-dataset", "a=builtin", "a=builtin:10"], ["'a' is given twice"]),
    Case("eval-broken-row", lambda d: ["--eval-dataset", "math=" + jsonl(d / "eval.jsonl", row(), "{oops")],
         ["--eval-dataset math", "eval.jsonl:2", "not valid JSON"]),
    Case("eval-missing-file", lambda d: ["--eval-dataset", f"math={d / 'eval.jsonl'}"],
         ["--eval-dataset math", "eval.jsonl", "no such file"]),
    # --- model directories and tokenizer
    Case("model-dir-missing", lambda d: ["--model", str(d / "no-model")], ["--model", "no-model", "no such directory"]),
    Case("model-without-weights", lambda d: ["--model", model_dir(d / "m", weights=False)],
         ["--model", "m: no model.safetensors"]),
    Case("model-config-broken", lambda d: ["--model", model_dir(d / "m", config='{"model_type": "qwen2",')],
         ["--model", "config.json"]),
    Case("model-unsupported-family",
         lambda d: ["--model", model_dir(d / "m", config={"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})],
         ["--model", "unsupported model", "GPT2LMHeadModel"]),
    Case("ref-model-without-weights",
         lambda d: ["--kl-coef", "0.1", "--ref-model", model_dir(d / "ref", weights=False)],
         ["--ref-model", "no model.safetensors"]),
    # --- Qwen3.5 (the tiny model's config turned into a hybrid one: its tensors are the wrong kind)
    Case("qwen3_5-unknown-layer-type",
         lambda d: ["--model", model_dir(d / "m", config=dict(QWEN3_5, layer_types=["linear_attention", "hybrid"]))],
         ["--model", "layer_types[1]='hybrid'", "linear_attention", "full_attention"]),
    Case("qwen3_5-missing-linear-attention-tensor", lambda d: ["--model", model_dir(d / "m", config=QWEN3_5)],
         ["--model", "no tensor 'model.layers.0.linear_attn.in_proj_qkv.weight'", "qwen3_5 model"]),
    Case("qwen3_5-context-parallel", lambda d: ["--model", qwen3_5_policy(d / "m"), "--context-parallel-size", "2",
                                                "--padding-free"],
         ["--model", "context_parallel_size=2", "Gated DeltaNet", "use CP 1"], world=2),
    Case("row-with-images", lambda d: train_data(d, row(images=["cat.png"])),
         ["train.jsonl:1", "field 'images' holds media", "text models"]),
    Case("message-with-image-part", lambda d: train_data(d, {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is 1 + 1?"}]}], "gt_answer": "2"}),
         ["train.jsonl:1", "messages[0].content", "part of type 'image'", "text models"]),
    Case("tokenizer-vocab-mismatch", lambda d: ["--tokenizer", bigger_tokenizer(d / "tok")],
         ["--tokenizer", "279 tokens", "vocab_size=259"]),
    Case("tokenizer-dir-empty", lambda d: ["--tokenizer", os.path.dirname(write(d / "tok" / "README", "x"))],
         ["--tokenizer", "cannot load a tokenizer"]),
    Case("engine-context-over-the-model", lambda d: ["--rollout-engine-kwargs", '{"max_model_len": 4096}'],
         ["max_model_len=4096", "max_position_embeddings=512"]),
    Case("prompt-and-response-over-the-model", lambda d: ["--max-new-tokens", "1024"],
         ["--max-prompt-length 128 + --max-new-tokens 1024 = 1152", "max_position_embeddings=512"]),
    # verl's model.override_config.model_config.max_position_embeddings: the engine's positions, checked too
    Case("engine-context-over-the-overridden-positions", lambda d: [
        "--rollout-engine-kwargs", '{"max_model_len": 1024, "hf_overrides": {"max_position_embeddings": 768}}'],
         ["max_model_len=1024", "max_position_embeddings=768", "hf_overrides"]),
]


# -------------------------------------------------------------- the checks ----

def outputs(d: Path) -> list[str]:
    return [arg for flag, name in OUTPUT_FLAGS.items() for arg in (flag, str(d / name))]


def assert_nothing_written(d: Path, cwd: Path) -> None:
    for flag, name in OUTPUT_FLAGS.items():
        assert not (d / name).exists(), f"{flag} was written"
    assert not list(cwd.iterdir()), f"written in the working directory: {list(cwd.iterdir())}"


def assert_one_line(stderr: str, words: list[str]) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("megarl: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


class _RunStarted(SystemExit):
    """Raised by the stub run: the input passed every check (main re-raises an exit status 0)."""


def _started(*args, **kwargs):
    raise _RunStarted(0)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_fails_on_one_line_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    from megarl import train as entry

    monkeypatch.setattr(entry, "train", _started)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    if case.world > 1:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(case.world))
    data, cwd = tmp_path / "in", tmp_path / "cwd"
    data.mkdir()
    cwd.mkdir()
    # The outputs first, so that a case's own flag wins; the tiny model by absolute path.
    argv = ["--model", str(TINY)] + outputs(data) + case.argv(data)
    capsys.readouterr()
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exit_info:
        entry.main(argv)
    assert not isinstance(exit_info.value, _RunStarted), "the input passed every check: the run would start"
    assert exit_info.value.code not in (0, None)
    assert_one_line(capsys.readouterr().err, case.words)
    assert_nothing_written(data, cwd)


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({case.id for case in CASES}) == len(CASES)


REAL = ["jsonl-broken-line", "tokenizer-vocab-mismatch"]


@pytest.mark.slow  # launches a command in a process of its own (python + torch start-up): the slow lane
def test_the_real_command_line(tmp_path):
    """Two rows through `python megarl/train.py` itself (side by side): exit status 2, stderr exactly one
    line (no warning or traceback from the libraries), nothing written."""
    running = []
    for case in (c for c in CASES if c.id in REAL):
        data, cwd = tmp_path / case.id / "in", tmp_path / case.id / "cwd"
        data.mkdir(parents=True)
        cwd.mkdir()
        argv = ["--model", str(TINY)] + outputs(data) + case.argv(data)
        process = subprocess.Popen([sys.executable, str(ROOT / "megarl" / "train.py"), *argv], cwd=cwd,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        running.append((case, data, cwd, process))
    for case, data, cwd, process in running:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, (case.id, process.returncode, stderr[-3000:])
        assert_one_line(stderr, case.words)
        assert_nothing_written(data, cwd)


@pytest.mark.slow
def test_bad_data_under_torchrun_fails_on_every_rank_before_the_engines(tmp_path):
    """Two ranks under torchrun: a rank prints the one line and exits 2, torchrun fails, no vLLM engine
    was started (the check is before them) and nothing was written."""
    data, cwd = tmp_path / "in", tmp_path / "cwd"
    data.mkdir()
    cwd.mkdir()
    argv = ["--model", str(TINY)] + outputs(data) + train_data(data, row(), row(answer={"x": 1}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "megarl" / "train.py"), *argv], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("megarl: error: ")]
    # Every rank that got as far as printing printed the same line (torchrun stops the others at the first exit).
    assert ours and len(set(ours)) == 1, result.stderr[-3000:]
    assert "train.jsonl:2" in ours[0] and "gt_answer" in ours[0]
    assert "failed:" not in result.stderr  # megarl's traceback path (a failure after the start) was not taken
    assert "vllm" not in (result.stdout + result.stderr).lower().replace("megarl", "")
    assert_nothing_written(data, cwd)
