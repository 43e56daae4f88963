"""Prompt datasets from local JSONL and Parquet files, in other frameworks' layouts.

Why: users arrive with data already prepared for ColossalChat, verl or ms-swift.
Rather than asking them to convert, every row is normalised into one `Row`, and
the rest of megarl (rendering, rewards, evaluation) sees only that.

Files
    `load_rows(paths)` takes one path, a list, globs (`data/*.parquet`) or
    directories (their `*.jsonl`, `*.json`, `*.parquet`, sorted). `.jsonl` is one
    JSON object a line (blank lines are not rows); `.json` is one JSON array of
    rows, one row object (pretty-printed or not), or else JSON Lines; `.parquet`
    needs pyarrow.
    Every row carries `origin` = "file:N": N is the 1-based line of a JSONL file,
    the 1-based row of a Parquet file or JSON array. Errors name it.
    A null value (JSON null, a Parquet null) means the field is absent.

Layouts (`format=`), and where each one keeps the prompt and the answer
    colossalchat  `messages` (a chat list, or one {"role","content"} object)
                  and `gt_answer`
    verl          a chat list under `prompt_key` (default "prompt") and
                  `reward_model: {"ground_truth": ...}`; other keys of
                  `reward_model` (e.g. "style") are not kept
    swift         `messages` and `solution` (ms-swift GRPO passes extra columns
                  such as `solution` to its reward functions)
    Every layout may also carry `id`, `data_source`, `test_cases`
    ({"inputs": [...], "outputs": [...]}, code tasks) and `teacher_prompt`
    (a string or chat list, kept for distillation). Any other column goes to
    `Row.extra` untouched.

Detection (`format="auto"`, decided per row, in this order)
    1. the row has `prompt_key`         -> verl
    2. it has `messages` and `solution` -> swift
    3. it has `messages`                -> colossalchat
    4. otherwise: an error naming the row and its fields.
    A column that another layout uses for a normalised field (a `messages`
    column in a verl row, `gt_answer` in a swift row, ...) is an error rather
    than a silent extra, since the row is ambiguous.

Answers
    `gt_answer` is a string. Numbers are written as str(number) in every layout
    (hand-written JSONL often has `"gt_answer": 42`, and verl Parquet files store
    ground_truth as int64 or double). verl's ground_truth may also be a list or
    object (e.g. several accepted answers, test cases): it becomes its JSON text,
    which the reward can `json.loads`. Anything else is a type error.

Messages
    Text only: each message needs string `role` and `content`. A final
    assistant message (some ms-swift and SFT-style files keep the reference
    response there) is removed from the prompt, because the prompt must end where
    the model's answer starts, and kept in `extra["reference_solution"]`.

System prompt rule
    `render(row, tokenizer, system_prompt)` adds `system_prompt` (from
    --system-prompt or the reward's default) only when the row has no system
    message of its own: the dataset's own system message wins, as in verl and
    ColossalChat, because it was written for that row.

Truncation (`max_prompt_length`, `truncation=`)
    "error" (default) raises naming the file, line, length and limit; "left"
    keeps the last tokens (the end of the question and the generation prompt);
    "right" keeps the first tokens (this can cut off the generation prompt); "drop" leaves
    such rows out of the set (verl's data.filter_overlong_prompts, ms-swift's truncation_strategy
    delete), counted in `PromptDataset.dropped`.
    `PromptDataset` renders every row once at start in "error" mode so an overlong
    prompt fails before training rather than at step 5000 (`check_lengths=False`
    skips that for very large files).

Ordering and resumption (`PromptDataset`)
    The prompt stream is the concatenation of per-epoch permutations of the
    rows, permutation e seeded by (seed, e); every rank computes it alone. Each
    epoch visits every row exactly once; a batch may straddle two epochs.
    Batch (step, attempt) starts at stream position
        (step + extra + attempt) * prompts_per_step
    where `extra` counts the additional batches (attempt >= 1, DAPO's dynamic
    sampling) drawn by the steps before `step`. Without dynamic sampling extra
    is 0 and batches are a pure function of (seed, step, prompts_per_step); with
    it, `extra` is the only state: `state_dict()` holds it and
    `load_state_dict()` restores it, so a resumed run draws exactly the prompts
    the uninterrupted run would have. Calls are idempotent (asking for the same
    (step, attempt) again gives the same prompts); steps may not go back.

Preprocessors
    A plugin maps a custom layout onto a known one:
        from megarl.data.datasets import register_preprocessor
        @register_preprocessor("my_qa")
        def my_qa(raw: dict) -> dict:
            return {"messages": [{"role": "user", "content": raw["q"]}], "gt_answer": raw["a"]}
    and `load_rows(..., preprocessor="my_qa")` applies it to every raw row before
    detection. Its exceptions become errors naming the row.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from megarl.data.prompts import Prompt, chat_token_ids
from megarl.errors import ConfigError
from megarl.registry import Registry, register

FORMATS = ("auto", "colossalchat", "verl", "swift")
TRUNCATIONS = ("error", "left", "right", "drop")
FILE_TYPES = (".jsonl", ".json", ".parquet")
# Normalised field names: a leftover column with one of these names would shadow one.
RESERVED = ("id", "messages", "gt_answer", "test_cases", "data_source", "teacher_prompt", "origin")
REFERENCE_KEY = "reference_solution"


class DatasetError(ConfigError):
    """A data mistake; the message is one line starting with "file:line:" where there is one."""


@dataclass
class Row:
    id: str
    messages: list[dict]
    gt_answer: str | None = None
    test_cases: dict | None = None
    data_source: str | None = None
    teacher_prompt: str | list | None = None
    extra: dict = field(default_factory=dict)
    origin: str = ""

    def as_metadata(self) -> dict:
        """The row as rewards see it: extra columns plus the normalised fields."""
        return {**self.extra, "id": self.id, "messages": self.messages, "gt_answer": self.gt_answer,
                "test_cases": self.test_cases, "data_source": self.data_source,
                "teacher_prompt": self.teacher_prompt, "origin": self.origin}


# ------------------------------------------------------------ preprocessors ----

DATASET_PREPROCESSORS = Registry("dataset preprocessor")  # name -> fn(raw_row) -> row


def register_preprocessor(name: str):
    """Decorator: register `fn(raw_row) -> row in a known layout` under `name`."""
    return register(DATASET_PREPROCESSORS, name)


def _preprocessor(name: str | None):
    if name is None:
        return None
    if name not in DATASET_PREPROCESSORS:
        raise DatasetError(f"--preprocessor '{name}' is not registered (a plugin's @register_preprocessor); "
                           f"registered: {', '.join(sorted(DATASET_PREPROCESSORS)) or 'none'}")
    return DATASET_PREPROCESSORS[name]


# -------------------------------------------------------------------- files ----

def expand_paths(paths) -> list[str]:
    """Files named by a path, a glob, a directory, or a list of them, in order."""
    files = []
    for pattern in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths):
        pattern = os.fspath(pattern)
        if os.path.isdir(pattern):
            found = sorted(p for p in glob.glob(os.path.join(pattern, "*")) if p.endswith(FILE_TYPES))
            if not found:
                raise DatasetError(f"{pattern}: directory has no {', '.join(FILE_TYPES)} files")
        elif any(c in pattern for c in "*?["):
            found = sorted(glob.glob(pattern))
            if not found:
                raise DatasetError(f"{pattern}: no files match")
        elif os.path.isfile(pattern):
            found = [pattern]
        else:
            raise DatasetError(f"{pattern}: no such file")
        files += found
    if not files:
        raise DatasetError("no dataset files given")
    return files


def read_file(path: str) -> Iterator[tuple[int, dict]]:
    """(row number, raw row) pairs of one file; see the module docstring for numbering."""
    if path.endswith(".parquet"):
        rows = _read_parquet(path)
    elif path.endswith((".jsonl", ".json")):
        rows = _read_json(path)
    else:
        raise DatasetError(f"{path}: unknown file type (expected {', '.join(FILE_TYPES)})")
    empty = True
    for number, raw in rows:
        empty = False
        if not isinstance(raw, dict):
            raise DatasetError(f"{path}:{number}: expected a JSON object, got {_type(raw)}")
        yield number, raw
    if empty:
        raise DatasetError(f"{path}: empty file (no rows)")


def _read_json(path: str) -> Iterator[tuple[int, object]]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DatasetError(f"{path}:{line}: not UTF-8 text (byte {e.start})") from None
    if path.endswith(".json") and text.lstrip()[:1] in ("[", "{"):
        try:  # a whole-file array of rows, or one (maybe pretty-printed) row as MATH ships them
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise DatasetError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            whole = None  # several documents: JSON Lines
        if whole is not None:
            yield from enumerate(whole if isinstance(whole, list) else [whole], start=1)
            return
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and friends.
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield number, _loads(line, path, number)


def _loads(line: str, path: str, number: int):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None


def _read_parquet(path: str) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for raw in batch.to_pylist():
                number += 1
                yield number, raw
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None


# ---------------------------------------------------------------- normalise ----

def load_rows(paths, format: str = "auto", prompt_key: str = "prompt",
              preprocessor: str | None = None, id_key: str | None = None) -> list[Row]:
    """Every row of the files, normalised, in file order. Any bad row raises DatasetError. `id_key`: the
    column that holds each row's id instead of `id` (verl's data.prompt_id_key)."""
    if format not in FORMATS:
        raise DatasetError(f"unknown dataset format '{format}'; known: {', '.join(FORMATS)}")
    prepare = _preprocessor(preprocessor)
    rows = []
    for given in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths):
        pattern, count = sample_count(os.fspath(given))
        chosen = []
        for path in expand_paths(pattern):
            for number, raw in read_file(path):
                where = f"{path}:{number}"
                if prepare is not None:
                    raw = _apply_preprocessor(prepare, preprocessor, raw, where)
                if id_key not in (None, "id"):
                    raw = _id_from(raw, id_key, where)
                chosen.append(normalize(raw, where, format, prompt_key))
        rows += chosen if count is None else sample_rows(chosen, count, given)
    return rows


SAMPLE_SEED = 42  # ms-swift's data_seed default: the rows `name#N` draws


def sample_count(path: str) -> tuple[str, int | None]:
    """ms-swift's `name#N` (N rows of the set): the path and N; a file whose own name ends so is read whole."""
    base, mark, count = path.rpartition("#")
    if not mark or not count.isdigit() or os.path.exists(path):
        return path, None
    return base, int(count)


def sample_rows(rows: list, count: int, given: str) -> list:
    """ms-swift's sampling of `name#N`: N distinct rows drawn with its data seed when the set has as many;
    otherwise the whole set repeated, then a draw for the rest. Drawn rows keep their file order."""
    import random

    if not rows:
        raise DatasetError(f"{given}: no rows to draw {count} from")
    draw = random.Random(SAMPLE_SEED)
    whole, rest = divmod(count, len(rows))
    return rows * whole + [rows[i] for i in sorted(draw.sample(range(len(rows)), rest))]


def load_eval_dataset(paths, format: str = "auto", prompt_key: str = "prompt",
                      preprocessor: str | None = None, id_key: str | None = None) -> list[Row]:
    """An evaluation set: all rows in file order (no shuffling, no repeats)."""
    return load_rows(paths, format, prompt_key, preprocessor, id_key)


def _id_from(raw: dict, id_key: str, where: str) -> dict:
    """The row with its `id_key` column as its id; a row that has an `id` as well is ambiguous."""
    if raw.get(id_key) is None:
        return raw
    if raw.get("id") is not None:
        raise DatasetError(f"{where}: both '{id_key}' (--prompt-id-key) and 'id' fields; keep one")
    raw = dict(raw)
    raw["id"] = raw.pop(id_key)
    return raw


def _apply_preprocessor(fn, name: str, raw: dict, where: str) -> dict:
    try:
        out = fn(raw)
    except Exception as e:  # noqa: BLE001 - any plugin failure is a data error for this row
        raise DatasetError(f"{where}: preprocessor '{name}' failed: {type(e).__name__}: {e}") from None
    if not isinstance(out, dict):
        raise DatasetError(f"{where}: preprocessor '{name}' returned {_type(out)}, expected a dict")
    return out


def detect_layout(raw: dict, prompt_key: str = "prompt") -> str | None:
    """The layout of a raw row by the rules in the module docstring, or None."""
    if raw.get(prompt_key) is not None:
        return "verl"
    if raw.get("messages") is not None:
        return "swift" if raw.get("solution") is not None else "colossalchat"
    return None


def normalize(raw: dict, where: str, format: str = "auto", prompt_key: str = "prompt") -> Row:
    """One raw row as a Row; `where` ("file:line") prefixes every error."""
    fields = {k: v for k, v in raw.items() if v is not None}  # null means absent
    layout = detect_layout(fields, prompt_key) if format == "auto" else format
    if layout is None:
        raise DatasetError(f"{where}: cannot tell the layout: no 'messages' or '{prompt_key}' field "
                           f"(fields: {', '.join(sorted(fields)) or 'none'}); pass format= or a preprocessor")
    prompt_field, answer = _LAYOUTS[layout](fields, where, prompt_key)
    _refuse_media(fields, where)
    messages, reference = _messages(fields.pop(prompt_field, None), prompt_field, where)
    row = Row(id=_id(fields.pop("id", None), where), messages=messages, gt_answer=answer,
              test_cases=_test_cases(fields.pop("test_cases", None), where),
              data_source=_string(fields.pop("data_source", None), "data_source", where),
              teacher_prompt=_teacher_prompt(fields.pop("teacher_prompt", None), where),
              origin=where)
    for key in fields:
        if key in RESERVED:
            raise DatasetError(f"{where}: field '{key}' does not belong in a {layout} row "
                               f"(it would shadow the normalised '{key}')")
    if reference is not None:
        if REFERENCE_KEY in fields:
            raise DatasetError(f"{where}: both a final assistant message and a '{REFERENCE_KEY}' field")
        fields[REFERENCE_KEY] = reference
    row.extra = fields
    return row


# Each layout takes its answer out of `fields` and names the field that holds its prompt.
def _colossalchat(fields: dict, where: str, prompt_key: str) -> tuple[str, str | None]:
    return "messages", _answer(fields.pop("gt_answer", None), "gt_answer", where)


def _swift(fields: dict, where: str, prompt_key: str) -> tuple[str, str | None]:
    return "messages", _answer(fields.pop("solution", None), "solution", where)


def _verl(fields: dict, where: str, prompt_key: str) -> tuple[str, str | None]:
    reward = fields.pop("reward_model", None)
    if reward is None:
        return prompt_key, None
    if not isinstance(reward, dict):
        raise DatasetError(f"{where}: field 'reward_model' must be an object, got {_type(reward)}")
    truth = reward.get("ground_truth")
    if isinstance(truth, (list, dict)):  # several answers or test cases: keep them readable
        truth = json.dumps(truth, ensure_ascii=False)
    return prompt_key, _answer(truth, "reward_model.ground_truth", where)


_LAYOUTS = {"colossalchat": _colossalchat, "swift": _swift, "verl": _verl}


# ------------------------------------------------------------ field checks ----

def _type(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "nothing"}.get(type(value), type(value).__name__)


def _string(value, name: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DatasetError(f"{where}: field '{name}' must be a string, got {_type(value)}")


def _answer(value, name: str, where: str) -> str | None:
    """A string answer; numbers (common in hand-made and Parquet files) become str(number)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _string(value, name, where)


def _id(value, where: str) -> str:
    """The row's id; rows without one are known by their origin."""
    if value is None:
        return where
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _string(value, "id", where)


def _messages(value, name: str, where: str) -> tuple[list[dict], str | None]:
    """A validated chat list without a final assistant message, and that message's text."""
    if value is None:
        raise DatasetError(f"{where}: field '{name}' is missing")
    if isinstance(value, dict):  # ColossalChat writes a single-turn prompt as one object
        value = [value]
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: field '{name}' must be a non-empty list of messages, got {_type(value)}")
    messages = [_message(m, f"{name}[{i}]", where) for i, m in enumerate(value)]
    reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    if not any(m["role"] != "system" for m in messages):
        raise DatasetError(f"{where}: field '{name}' has no user message")
    return messages, reference


# Multimodal rows as ms-swift and verl write them: media columns beside the messages, or OpenAI-style content
# parts. megarl trains and serves the text model (of a multimodal checkpoint: its language model alone).
MEDIA_FIELDS = ("images", "videos", "audios")
_NO_MEDIA = "megarl trains text models (of a multimodal checkpoint, its language model alone)"


def _refuse_media(fields: dict, where: str) -> None:
    for key in MEDIA_FIELDS:
        if fields.get(key):
            raise DatasetError(f"{where}: field '{key}' holds media; {_NO_MEDIA}: images, videos and audio are "
                               f"not supported")


def _message(value, name: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: field '{name}' must be an object with 'role' and 'content', got {_type(value)}")
    content = value.get("content")
    if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") not in (None, "text")
                                         for part in content):
        kind = next(part["type"] for part in content if isinstance(part, dict) and part.get("type") not in
                    (None, "text"))
        raise DatasetError(f"{where}: field '{name}.content' has a part of type {kind!r}; {_NO_MEDIA}")
    for key in ("role", "content"):
        if not isinstance(value.get(key), str):
            raise DatasetError(f"{where}: field '{name}.{key}' must be a string, got {_type(value.get(key))}")
    return {k: v for k, v in value.items() if v is not None}  # Parquet structs fill absent keys with null


def _test_cases(value, where: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: field 'test_cases' must be an object, got {_type(value)}")
    for key in ("inputs", "outputs"):
        if not isinstance(value.get(key), list):
            raise DatasetError(f"{where}: field 'test_cases.{key}' must be a list, got {_type(value.get(key))}")
    if len(value["inputs"]) != len(value["outputs"]):
        raise DatasetError(f"{where}: field 'test_cases' has {len(value['inputs'])} inputs "
                           f"but {len(value['outputs'])} outputs")
    return value


def _teacher_prompt(value, where: str) -> str | list | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return [_message(m, f"teacher_prompt[{i}]", where) for i, m in enumerate(value)]
    raise DatasetError(f"{where}: field 'teacher_prompt' must be a string or a list of messages, got {_type(value)}")


# ---------------------------------------------------------------- rendering ----

def render(row: Row, tokenizer, system_prompt: str | None = None, max_prompt_length: int | None = None,
           truncation: str = "error", tools: list[str] = ()) -> list[int]:
    """Token ids of the row's chat, ending with the generation prompt; see the system prompt rule. `tools`:
    the run's enabled tools (--tools); the row's `tools` field picks among them (megarl.tools.row_tools),
    and the chat template lists their schemas."""
    schemas = None
    if tools:
        from megarl.tools import row_tools, tool_schemas

        try:
            schemas = tool_schemas(row_tools(row.extra.get("tools"), list(tools), row.origin or f"row {row.id}"))
        except ValueError as error:
            raise DatasetError(str(error)) from None
    return _render_messages(row.messages, row, tokenizer, system_prompt, max_prompt_length, truncation, schemas)


def render_teacher_prompt(row: Row, tokenizer, system_prompt: str | None = None,
                          max_prompt_length: int | None = None, truncation: str = "error") -> list[int] | None:
    """OPSD: token ids of the row's privileged `teacher_prompt` (a user message, or a chat), rendered
    like the student's prompt; None when the row has none (plain GKD)."""
    prompt = row.teacher_prompt
    if not prompt:
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return _render_messages(messages, row, tokenizer, system_prompt, max_prompt_length, truncation)


def _render_messages(messages, row: Row, tokenizer, system_prompt, max_prompt_length, truncation,
                     tools: list[dict] | None = None) -> list[int]:
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError("the tokenizer has no chat template; datasets are rendered with apply_chat_template")
    return fit_length(chat_token_ids(tokenizer, messages, tools), max_prompt_length, truncation, row.origin)


def fit_length(ids: list[int], limit: int | None, truncation: str, where: str) -> list[int]:
    """Apply the truncation rule: error, keep the last `limit` tokens (left) or the first (right)."""
    if truncation not in TRUNCATIONS:
        raise DatasetError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got '{truncation}'")
    if limit is None or len(ids) <= limit:
        return ids
    if truncation in ("error", "drop"):  # drop: the row should have been left out (fitting_rows)
        raise DatasetError(f"{where}: prompt is {len(ids)} tokens, over --max-prompt-length {limit} "
                           f"(truncation 'left' or 'right' cuts it instead, 'drop' leaves the row out)")
    return ids[-limit:] if truncation == "left" else ids[:limit]


def fitting_rows(rows: list[Row], tokenizer, system_prompt: str | None, max_prompt_length: int | None,
                 tools: list[str] = ()) -> list[Row]:
    """The rows whose prompt (and OPSD teacher prompt) fit --max-prompt-length: truncation "drop"."""
    if max_prompt_length is None:
        return list(rows)

    def fits(row):
        options = (tokenizer, system_prompt, None, "error")
        teacher = render_teacher_prompt(row, *options)
        return len(render(row, *options, tools=tools)) <= max_prompt_length and \
            (teacher is None or len(teacher) <= max_prompt_length)
    return [row for row in rows if fits(row)]


def make_prompts(rows: Iterable[Row], tokenizer, system_prompt: str | None = None,
                 max_prompt_length: int | None = None, truncation: str = "error", tools: list[str] = ()) -> list[Prompt]:
    """Rendered prompts, indexed 0.. in order, each carrying its row as metadata (`tools`: as `render`;
    truncation "drop" leaves over-long rows out)."""
    if truncation == "drop":
        rows = fitting_rows(list(rows), tokenizer, system_prompt, max_prompt_length, tools)
    options = (tokenizer, system_prompt, max_prompt_length, truncation)
    return [Prompt(index, render(row, *options, tools=tools), row.as_metadata(), render_teacher_prompt(row, *options))
            for index, row in enumerate(rows)]


def shard(items: list, rank: int, world: int) -> list:
    """Item i goes to rank i % world (strided, so long and short rows spread evenly)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    return items[rank::world]


# ------------------------------------------------------------- training set ----

class PromptDataset:
    """Training prompts: `batch(step, attempt)` like `megarl.data.sources.ArithmeticPrompts`.

    Ordering and the resumable `extra` counter are described in the module
    docstring; every rank builds the same batches without communication.
    """

    def __init__(self, rows: list[Row], tokenizer, *, prompts_per_step: int, seed: int = 0,
                 system_prompt: str | None = None, max_prompt_length: int | None = None,
                 truncation: str = "error", check_lengths: bool = True, tools: list[str] = ()):
        if not rows:
            raise DatasetError("the training set has no rows")
        self.dropped = 0  # rows left out as over-long (truncation "drop")
        if truncation == "drop":
            kept = fitting_rows(rows, tokenizer, system_prompt, max_prompt_length, tools)
            self.dropped = len(rows) - len(kept)
            if not kept:
                raise DatasetError(f"every one of the {len(rows)} training rows is over --max-prompt-length "
                                   f"{max_prompt_length} (truncation drop)")
            rows = kept
        if prompts_per_step < 1:
            raise DatasetError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.rows, self.tokenizer = rows, tokenizer
        self.prompts_per_step, self.seed = prompts_per_step, seed
        self.render_args = {"system_prompt": system_prompt, "max_prompt_length": max_prompt_length,
                            "truncation": truncation, "tools": tuple(tools)}
        fit_length([], None, truncation, "")  # reject an unknown truncation mode now
        self._step, self._attempts, self._extra = -1, 1, 0
        self._permutations: dict[int, list[int]] = {}
        if check_lengths and truncation == "error" and max_prompt_length is not None:
            for row in rows:
                render(row, tokenizer, **self.render_args)

    def __len__(self) -> int:
        return len(self.rows)

    def position(self, step: int, attempt: int = 0) -> int:
        """Stream position where batch (step, attempt) starts; steps before the latest are unknown."""
        if step < 0 or attempt < 0:
            raise DatasetError(f"step and attempt must be >= 0, got step {step}, attempt {attempt}")
        if step < self._step:
            raise DatasetError(f"step {step} is before step {self._step}, the latest drawn: the data order "
                               "only moves forward (load_state_dict restores it on resume)")
        extra = self._extra if step == self._step else self._extra + self._attempts - 1
        return (step + extra + attempt) * self.prompts_per_step

    def row_indices(self, step: int, attempt: int = 0) -> list[int]:
        """Indices into `rows` of batch (step, attempt), without drawing it."""
        start = self.position(step, attempt)
        return [self._row_at(p) for p in range(start, start + self.prompts_per_step)]

    def batch(self, step: int, attempt: int = 0) -> list[Prompt]:
        """The prompts of `step`; attempt > 0 gives fresh ones for DAPO's extra generation batches."""
        indices = self.row_indices(step, attempt)
        if step > self._step:  # fold the finished step's extra batches into the counter
            self._extra += self._attempts - 1
            self._step, self._attempts = step, 1
        self._attempts = max(self._attempts, attempt + 1)
        return make_prompts((self.rows[i] for i in indices), self.tokenizer, **self.render_args)

    def peek(self, step: int) -> list[Prompt]:
        """The prompts of batch `step` (attempt 0) without drawing it: the draw order stays as it is. Streaming
        generation (--max-staleness) reads the prompt stream ahead of the steps and back (its groups in flight
        span batches), with no extra batches (DAPO filters inside the stream)."""
        start = (step + self._extra) * self.prompts_per_step
        return make_prompts((self.rows[self._row_at(p)] for p in range(start, start + self.prompts_per_step)),
                            self.tokenizer, **self.render_args)

    def state_dict(self) -> dict:
        """What a checkpoint must keep; `consumed` is the stream position after the latest step."""
        consumed = (self._step + self._extra + self._attempts) * self.prompts_per_step if self._step >= 0 else 0
        return {"step": self._step, "attempts": self._attempts, "extra_batches": self._extra,
                "consumed": consumed, "prompts_per_step": self.prompts_per_step, "seed": self.seed,
                "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("prompts_per_step", self.prompts_per_step), ("seed", self.seed),
                          ("num_rows", len(self.rows))):
            if state.get(key) != mine:
                raise DatasetError(f"data checkpoint: {key} was {state.get(key)}, now {mine}; "
                                   "the saved position would point at different prompts")
        self._step, self._attempts, self._extra = state["step"], state["attempts"], state["extra_batches"]

    def _row_at(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs
                self._permutations.pop(min(self._permutations))
            order = list(range(len(self.rows)))
            # A string seed goes through sha512: stable across processes and Python versions.
            random.Random(f"megarl-data:{self.seed}:{epoch}").shuffle(order)
            self._permutations[epoch] = order
        return self._permutations[epoch][offset]


# ------------------------------------------------------------------ writing ----

def to_layout(row: Row, format: str, prompt_key: str = "prompt") -> dict:
    """The row as a raw dict in `format` (the inverse of `normalize`), for converters."""
    if format == "colossalchat":
        # ColossalChat's published examples write a single-turn prompt as one object.
        body = {"messages": row.messages[0] if len(row.messages) == 1 else row.messages,
                "gt_answer": row.gt_answer}
    elif format == "verl":
        reward = {"style": "rule", "ground_truth": row.gt_answer} if row.gt_answer is not None else None
        body = {prompt_key: row.messages, "reward_model": reward}
    elif format == "swift":
        body = {"messages": row.messages, "solution": row.gt_answer}
    else:
        raise DatasetError(f"unknown output format '{format}'; known: colossalchat, verl, swift")
    common = {"id": row.id, "data_source": row.data_source, "test_cases": row.test_cases,
              "teacher_prompt": row.teacher_prompt}
    return {k: v for k, v in {**body, **common, **row.extra}.items() if v is not None}


def write_jsonl(path: str, records: Iterable[dict]) -> int:
    """Write one JSON object a line; returns the count."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def converter_main(tool: str, description: str, read_rows, default_source: str, input_help: str,
                   several_inputs: bool, argv=None) -> int:
    """The command line shared by tools/convert_*.py: read_rows(inputs, data_source) -> rows,
    written in --format; a bad input row ends the tool with its one-line error."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=tool, description=description)
    parser.add_argument("--input", nargs="+" if several_inputs else None, required=True, help=input_help)
    parser.add_argument("--output", required=True, help="JSONL to write")
    parser.add_argument("--format", default="colossalchat", choices=["colossalchat", "verl", "swift"])
    parser.add_argument("--data-source", default=default_source, help="value of the data_source column")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.input, args.data_source)
    except DatasetError as error:
        sys.exit(f"{tool}: {error}")
    count = write_jsonl(args.output, (to_layout(row, args.format) for row in rows))
    print(f"{args.output}: {count} rows ({args.format})")
    return 0
