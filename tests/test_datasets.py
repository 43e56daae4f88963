"""megarl/data/datasets.py: layouts, rendering, truncation, ordering, resumption, errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ROOT, load_script
from megarl.errors import ConfigError
from megarl.data.datasets import (DATASET_PREPROCESSORS, DatasetError, PromptDataset, load_eval_dataset, load_rows,
                             make_prompts, register_preprocessor, render, shard)

GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's byte-level tokenizer and ChatML template, built offline (no model, a few seconds)."""
    return load_script(ROOT / "tools" / "make_tiny_model.py").build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def user(text):
    return [{"role": "user", "content": text}]


def chat_text(*turns):
    """ChatML text of (role, content) turns followed by the generation prompt."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + GENERATION_PROMPT


def numbered(n, layout="colossalchat"):
    """n simple rows in `layout`; question i has answer str(i)."""
    make = {"colossalchat": lambda i: {"messages": user(f"q{i}"), "gt_answer": str(i)},
            "verl": lambda i: {"prompt": user(f"q{i}"), "reward_model": {"ground_truth": str(i)}},
            "swift": lambda i: {"messages": user(f"q{i}"), "solution": str(i)}}[layout]
    return [make(i) for i in range(n)]


# ------------------------------------------------------------------ layouts ----

def test_colossalchat_jsonl(tmp_path):
    path = tmp_path / "cc.jsonl"
    path.write_text("\n".join([
        json.dumps({"messages": {"role": "user", "content": "What is 2+3?"}, "gt_answer": "5", "level": 1}),
        "",  # a blank line is not a row, but line numbers still count it
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, *user("Reverse a string.")],
                    "test_cases": {"inputs": ["ab\n"], "outputs": ["ba\n"]}, "id": 7, "data_source": "code"}),
    ]) + "\n")
    first, second = load_rows(str(path))
    assert first.messages == user("What is 2+3?") and first.gt_answer == "5"
    assert first.extra == {"level": 1} and first.origin == f"{path}:1" and first.id == f"{path}:1"
    assert second.origin == f"{path}:3" and second.id == "7" and second.data_source == "code"
    assert second.test_cases == {"inputs": ["ab\n"], "outputs": ["ba\n"]} and second.gt_answer is None
    assert second.messages[0] == {"role": "system", "content": "Be brief."}


def test_verl_parquet(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": user("How many?"), "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": 72},  # verl files sometimes store numbers
             "extra_info": {"split": "train", "index": 0}},
            {"data_source": "openai/gsm8k", "prompt": user("How much?"), "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": 10}, "extra_info": {"split": "train", "index": 1}}]
    first, second = load_rows(write_parquet(tmp_path / "train.parquet", rows))
    assert first.messages == user("How many?") and first.gt_answer == "72" and second.gt_answer == "10"
    assert first.data_source == "openai/gsm8k" and first.origin.endswith("train.parquet:1")
    assert first.extra == {"ability": "math", "extra_info": {"split": "train", "index": 0}}


def test_verl_list_ground_truth_and_custom_prompt_key(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"question": user("Name a prime."),
                                               "reward_model": {"ground_truth": ["2", "3"]}}])
    (row,) = load_rows(path, prompt_key="question")
    assert row.messages == user("Name a prime.") and json.loads(row.gt_answer) == ["2", "3"]


def test_swift_jsonl(tmp_path):
    messages = [{"role": "system", "content": "Think first."}, *user("1+1?"),
                {"role": "assistant", "content": "1+1=2, so \\boxed{2}"}]
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": messages, "solution": "2",
                                               "teacher_prompt": "The answer is 2. 1+1?"}])
    (row,) = load_rows(path)
    # The final assistant message is the reference, not part of the prompt.
    assert row.messages == messages[:2] and row.gt_answer == "2"
    assert row.extra == {"reference_solution": "1+1=2, so \\boxed{2}"}
    assert row.teacher_prompt == "The answer is 2. 1+1?"
    meta = row.as_metadata()
    assert {k: meta[k] for k in ("gt_answer", "teacher_prompt", "reference_solution")} == {
        "gt_answer": "2", "teacher_prompt": "The answer is 2. 1+1?", "reference_solution": "1+1=2, so \\boxed{2}"}


def test_explicit_format_keeps_other_columns_as_extra(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"messages": user("q"), "gt_answer": "1", "solution": "long"}])
    (row,) = load_rows(path, format="colossalchat")
    assert row.gt_answer == "1" and row.extra == {"solution": "long"}


def test_several_files_glob_directory_and_json(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "b.jsonl", numbered(2, "swift"))
    write_parquet(tmp_path / "d" / "a.parquet", numbered(3, "verl"))
    (tmp_path / "d" / "c.json").write_text(json.dumps(numbered(1)))  # a JSON array
    (tmp_path / "one.json").write_text(json.dumps(numbered(1)[0], indent=2))  # one pretty-printed row
    by_glob = load_rows(str(tmp_path / "d" / "*"))
    assert [r.gt_answer for r in by_glob] == ["0", "1", "2", "0", "1", "0"]  # sorted: a, b, c
    assert [r.gt_answer for r in load_rows(tmp_path / "d")] == ["0", "1", "2", "0", "1", "0"]
    several = load_rows([str(tmp_path / "one.json"), str(tmp_path / "d" / "b.jsonl")])
    assert [r.origin.rsplit("/", 1)[1] for r in several] == ["one.json:1", "b.jsonl:1", "b.jsonl:2"]
    assert [r.gt_answer for r in load_eval_dataset(str(tmp_path / "d" / "*.parquet"))] == ["0", "1", "2"]


def test_preprocessor(tmp_path):
    @register_preprocessor("test_qa")
    def qa(raw):
        return {"messages": user(raw["q"]), "gt_answer": raw["a"]}

    try:
        path = write_jsonl(tmp_path / "qa.jsonl", [{"q": "2*3?", "a": "6"}, {"q": "oops"}])
        with pytest.raises(DatasetError, match=rf"^{path}:2: preprocessor 'test_qa' failed: KeyError: 'a'$"):
            load_rows(path, preprocessor="test_qa")
        write_jsonl(tmp_path / "qa.jsonl", [{"q": "2*3?", "a": "6"}])
        (row,) = load_rows(path, preprocessor="test_qa")
        assert row.messages == user("2*3?") and row.gt_answer == "6"
    finally:
        DATASET_PREPROCESSORS.pop("test_qa")


# ---------------------------------------------------------------- rendering ----

def test_system_prompt_rule(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "r.jsonl", [
        {"messages": user("Q1"), "gt_answer": "1"},
        {"messages": [{"role": "system", "content": "Own."}, *user("Q2")], "gt_answer": "2"}])
    plain, own = load_rows(path)
    assert tokenizer.decode(render(plain, tokenizer)) == chat_text(("user", "Q1"))
    assert tokenizer.decode(render(plain, tokenizer, "Box it.")) == chat_text(("system", "Box it."), ("user", "Q1"))
    # The row's own system message wins over the configured one.
    assert tokenizer.decode(render(own, tokenizer, "Box it.")) == chat_text(("system", "Own."), ("user", "Q2"))


def test_teacher_prompt_is_rendered_like_the_prompt(tmp_path, tokenizer):
    """OPSD: a row's teacher_prompt (a user message, or a chat) is rendered with the same template and
    system-prompt rule; rows without one have none (plain GKD)."""
    path = write_jsonl(tmp_path / "o.jsonl", [
        {"messages": user("1+1?"), "solution": "2", "teacher_prompt": "The answer is 2. 1+1?"},
        {"messages": user("2+2?"), "solution": "4",
         "teacher_prompt": [{"role": "system", "content": "Hint: 4."}, *user("2+2?")]},
        {"messages": user("3+3?"), "solution": "6"}])
    with_text, with_chat, without = make_prompts(load_rows(path), tokenizer, system_prompt="Box it.")
    assert tokenizer.decode(with_text.teacher_ids) == chat_text(("system", "Box it."), ("user", "The answer is 2. 1+1?"))
    assert tokenizer.decode(with_chat.teacher_ids) == chat_text(("system", "Hint: 4."), ("user", "2+2?"))
    assert tokenizer.decode(with_text.ids) == chat_text(("system", "Box it."), ("user", "1+1?"))
    assert without.teacher_ids is None


def test_truncation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": user("x" * 40)}])
    (row,) = load_rows(path)
    full = render(row, tokenizer)
    assert render(row, tokenizer, max_prompt_length=len(full)) == full
    assert render(row, tokenizer, max_prompt_length=10, truncation="left") == full[-10:]
    assert render(row, tokenizer, max_prompt_length=10, truncation="right") == full[:10]
    with pytest.raises(DatasetError, match=rf"^{path}:1: prompt is {len(full)} tokens, over --max-prompt-length 10"):
        render(row, tokenizer, max_prompt_length=10)
    with pytest.raises(DatasetError, match=rf"^{path}:1: prompt is {len(full)} tokens"):  # found at start
        PromptDataset([row], tokenizer, prompts_per_step=1, max_prompt_length=10)
    with pytest.raises(DatasetError, match="truncation must be one of error, left, right, drop, got 'middle'"):
        PromptDataset([row], tokenizer, prompts_per_step=1, truncation="middle")


def test_truncation_drop_leaves_over_long_rows_out(tmp_path, tokenizer):
    """truncation "drop" (verl's filter_overlong_prompts, ms-swift's truncation_strategy delete): rows whose
    prompt, or OPSD teacher prompt, is over the limit are not in the set, and counted; none left is one error."""
    rows = load_rows(write_jsonl(tmp_path / "t.jsonl", [{"messages": user("x" * 40)}, {"messages": user("y")},
                                                        {"messages": user("z"), "teacher_prompt": "w" * 40}]))
    short = len(render(rows[1], tokenizer))
    data = PromptDataset(rows, tokenizer, prompts_per_step=1, max_prompt_length=short, truncation="drop")
    assert (len(data), data.dropped) == (1, 2)
    assert [p.ids for p in data.batch(0)] == [render(rows[1], tokenizer)]
    with pytest.raises(DatasetError, match="every one of the 1 training rows is over --max-prompt-length 4"):
        PromptDataset(rows[:1], tokenizer, prompts_per_step=1, max_prompt_length=4, truncation="drop")


def test_a_file_name_with_a_count_draws_that_many_rows(tmp_path, tokenizer):
    """ms-swift's `name#N`: N distinct rows (its data seed) when the set has them, else the set repeated and
    the rest drawn; a file whose own name ends so is read whole."""
    path = write_jsonl(tmp_path / "n.jsonl", numbered(5))
    three = load_rows(f"{path}#3")
    assert len(three) == 3 == len({r.messages[0]["content"] for r in three})
    seven = load_rows([f"{path}#7"])
    assert len(seven) == 7 and len({r.messages[0]["content"] for r in seven}) == 5
    assert [r.messages for r in load_rows(f"{path}#3")] == [r.messages for r in three]  # seeded
    odd = tmp_path / "odd#2"
    odd.mkdir()
    write_jsonl(odd / "rows.jsonl", numbered(4))
    assert len(load_rows(str(odd))) == 4  # a directory whose name ends in #2: every file's rows


# ----------------------------------------------------------------- ordering ----

def dataset(tmp_path, tokenizer, n=12, per_step=4, seed=0):
    rows = load_rows(write_jsonl(tmp_path / f"n{n}.jsonl", numbered(n)))
    return PromptDataset(rows, tokenizer, prompts_per_step=per_step, seed=seed, max_prompt_length=64)


def answers(prompts):
    return [p.metadata["gt_answer"] for p in prompts]


def test_batches_are_prompts(tmp_path, tokenizer):
    ds = dataset(tmp_path, tokenizer)
    prompts = ds.batch(0)
    assert [p.index for p in prompts] == [0, 1, 2, 3]
    for prompt in prompts:
        row = ds.rows[int(prompt.metadata["gt_answer"])]
        assert prompt.ids == render(row, tokenizer) and prompt.metadata == row.as_metadata()
        assert {"messages", "gt_answer", "test_cases", "data_source", "id", "teacher_prompt"} <= set(prompt.metadata)


def test_order_is_deterministic_and_covers_epochs(tmp_path, tokenizer):
    epochs = [[a for step in range(3 * e, 3 * e + 3) for a in answers(dataset(tmp_path, tokenizer).batch(step))]
              for e in range(2)]
    for epoch in epochs:  # every row once per epoch
        assert sorted(epoch, key=int) == [str(i) for i in range(12)]
    assert epochs[0] != epochs[1]  # reshuffled
    assert epochs[0] != [str(i) for i in range(12)]  # shuffled at all
    same = dataset(tmp_path, tokenizer)
    assert [answers(same.batch(s)) for s in range(3)] == [epochs[0][i:i + 4] for i in (0, 4, 8)]
    other_seed = dataset(tmp_path, tokenizer, seed=1)
    assert [a for s in range(3) for a in answers(other_seed.batch(s))] != epochs[0]


def test_batches_straddle_epochs(tmp_path, tokenizer):
    ds = dataset(tmp_path, tokenizer, n=10, per_step=4)
    stream = [a for s in range(5) for a in answers(ds.batch(s))]
    assert sorted(stream[:10], key=int) == sorted(stream[10:], key=int) == [str(i) for i in range(10)]


def test_dapo_attempts_take_fresh_prompts(tmp_path, tokenizer):
    ds, plain = dataset(tmp_path, tokenizer), dataset(tmp_path, tokenizer)
    stream = [a for s in range(6) for a in answers(plain.batch(s))]
    assert answers(ds.batch(0)) == stream[0:4]
    assert answers(ds.batch(0, attempt=1)) == stream[4:8]
    assert answers(ds.batch(0)) == stream[0:4]  # idempotent
    assert ds.position(1) == 8 and answers(ds.batch(1)) == stream[8:12]
    assert answers(ds.batch(1, 1)) == stream[12:16] and answers(ds.batch(1, 2)) == stream[16:20]
    assert answers(ds.batch(2)) == stream[20:24]
    with pytest.raises(DatasetError, match="step 1 is before step 2"):
        ds.batch(1)
    # Without extra attempts a batch is a pure function of the step.
    assert answers(dataset(tmp_path, tokenizer).batch(5)) == stream[20:24]


def test_resume_from_state(tmp_path, tokenizer):
    ds = dataset(tmp_path, tokenizer)
    for step, attempts in enumerate([1, 3, 2, 1]):
        for attempt in range(attempts):
            ds.batch(step, attempt)
    state = json.loads(json.dumps(ds.state_dict()))  # checkpoints may store it as JSON
    assert state["consumed"] == (1 + 3 + 2 + 1) * 4
    resumed = dataset(tmp_path, tokenizer)
    resumed.load_state_dict(state)
    assert answers(resumed.batch(4)) == answers(ds.batch(4))
    assert answers(resumed.batch(4, 1)) == answers(ds.batch(4, 1))
    with pytest.raises(DatasetError, match="data checkpoint: prompts_per_step was 4, now 3"):
        dataset(tmp_path, tokenizer, per_step=3).load_state_dict(state)


def test_shard():
    items = list(range(7))
    assert [shard(items, r, 3) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        shard(items, 3, 3)


# --------------------------------------------------------------- bad input ----

BAD_ROWS = [  # (second line of a JSONL file, expected message after "file:2: ")
    ('{"messages": [{"role": "user", "content": "q"}], "gt_answer": ["1"]}',
     "field 'gt_answer' must be a string, got list"),
    ('{"messages": [{"role": "user", "content": "q"}', "not valid JSON"),
    ('["messages"]', "expected a JSON object, got list"),
    ('{"gt_answer": "1"}', "cannot tell the layout: no 'messages' or 'prompt' field (fields: gt_answer)"),
    ('{"messages": "hi"}', "field 'messages' must be a non-empty list of messages, got string"),
    ('{"messages": []}', "field 'messages' must be a non-empty list of messages, got list"),
    ('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
     "field 'messages[0].content' must be a string, got list"),
    ('{"messages": [{"role": "system", "content": "s"}]}', "field 'messages' has no user message"),
    ('{"messages": [{"role": "user", "content": "q"}], "solution": {"a": 1}}',
     "field 'solution' must be a string, got object"),
    ('{"prompt": [{"role": "user", "content": "q"}], "reward_model": "5"}',
     "field 'reward_model' must be an object, got string"),
    ('{"prompt": [{"role": "user", "content": "q"}], "messages": []}',
     "field 'messages' does not belong in a verl row"),
    ('{"messages": [{"role": "user", "content": "q"}], "test_cases": {"inputs": [1], "outputs": []}}',
     "field 'test_cases' has 1 inputs but 0 outputs"),
    ('{"messages": [{"role": "user", "content": "q"}], "test_cases": {"inputs": "1"}}',
     "field 'test_cases.inputs' must be a list, got string"),
    ('{"messages": [{"role": "user", "content": "q"}], "data_source": 3}',
     "field 'data_source' must be a string, got integer"),
    ('{"messages": [{"role": "user", "content": "q"}], "id": true}', "field 'id' must be a string, got boolean"),
]


@pytest.mark.parametrize("line, message", BAD_ROWS, ids=[m.split(" (")[0] for _, m in BAD_ROWS])
def test_bad_rows_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n' + line + "\n")
    with pytest.raises(DatasetError) as error:
        load_rows(str(path))
    assert str(error.value).startswith(f"{path}:2: {message}") and "\n" not in str(error.value)
    assert isinstance(error.value, ConfigError)  # train.py reports these as one line


def test_missing_field_with_explicit_format(tmp_path):
    path = write_jsonl(tmp_path / "v.jsonl", [{"messages": user("q")}])
    with pytest.raises(DatasetError, match=rf"^{path}:1: field 'prompt' is missing$"):
        load_rows(path, format="verl")


def test_bad_parquet_row_names_row(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": user("q"), "reward_model": {"ground_truth": "1"}},
                                                    {"prompt": None, "reward_model": {"ground_truth": "2"}}])
    with pytest.raises(DatasetError, match=rf"^{path}:2: cannot tell the layout"):
        load_rows(path)


@pytest.mark.parametrize("case, message", [
    ("empty", "{path}: empty file (no rows)"),
    ("blank", "{path}: empty file (no rows)"),
    ("no_match", "{path}: no files match"),
    ("missing", "{path}: no such file"),
    ("csv", "{path}: unknown file type (expected .jsonl, .json, .parquet)"),
    ("not_parquet", "{path}: not a readable Parquet file"),
])
def test_bad_files(tmp_path, case, message):
    path = {"empty": tmp_path / "e.jsonl", "blank": tmp_path / "b.jsonl", "no_match": tmp_path / "*.parquet",
            "missing": tmp_path / "nope.jsonl", "csv": tmp_path / "d.csv", "not_parquet": tmp_path / "x.parquet"}[case]
    contents = {"empty": "", "blank": "\n\n", "csv": "a,b\n", "not_parquet": "not parquet"}
    if case in contents:
        path.write_text(contents[case])
    with pytest.raises(DatasetError) as error:
        load_rows(str(path))
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value)


def test_bad_options(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", numbered(1))
    with pytest.raises(DatasetError, match="unknown dataset format 'alpaca'; known: auto, colossalchat, verl, swift"):
        load_rows(path, format="alpaca")
    with pytest.raises(DatasetError, match="--preprocessor 'nope' is not registered"):
        load_rows(path, preprocessor="nope")


# ----------------------------------------------------- subsets (--train/--eval-max-samples) ----

def test_max_samples_draw_a_seeded_training_subset_and_cut_evaluation_sets(tiny_model, tmp_path):
    """--train-max-samples N: N distinct rows in file order, the same for the same --seed and another for
    another; --eval-max-samples N: each evaluation set's first N prompts; 0 keeps every row."""
    from transformers import AutoTokenizer

    from megarl.arguments import parse_args
    from megarl.data.sources import eval_prompts, prompt_source

    data = write_jsonl(tmp_path / "d.jsonl", numbered(20))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def answers(*flags):
        args = parse_args(["--model", tiny_model, "--train-data", data, "--eval-dataset", f"val={data}",
                           "--eval-interval", "1", *flags], world_size=1)
        train = [int(row.gt_answer) for row in prompt_source(args, tokenizer, None).rows]
        return train, [int(p.metadata["gt_answer"]) for p in eval_prompts(args, tokenizer, None)["val"]]

    every, every_eval = answers()
    assert every == list(range(20)) and every_eval == list(range(20))
    subset, first = answers("--train-max-samples", "6", "--eval-max-samples", "3")
    assert len(set(subset)) == 6 and subset == sorted(subset) and subset != list(range(6)), subset
    assert first == [0, 1, 2]
    assert answers("--train-max-samples", "6")[0] == subset  # a function of the seed
    assert answers("--train-max-samples", "6", "--seed", "7")[0] != subset
    assert answers("--train-max-samples", "50")[0] == every  # more than the set: every row
    with pytest.raises(ConfigError, match="--eval-max-samples must be >= 0"):
        parse_args(["--model", tiny_model, "--eval-max-samples", "-1"], world_size=1)


def test_a_chat_template_given_renders_every_prompt(tiny_model, tmp_path):
    """--chat-template @FILE (verl's model.custom_chat_template[_file]) replaces the tokenizer's template in the
    rendering of training and evaluation prompts, and in what HF exports save; a missing file is one line."""
    from megarl.arguments import parse_args
    from megarl.run import load_inputs

    data = write_jsonl(tmp_path / "d.jsonl", numbered(3))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    args = parse_args(["--model", tiny_model, "--train-data", data, "--system-prompt", "",
                       "--eval-dataset", f"val={data}", "--eval-interval", "1", "--chat-template", f"@{template}"],
                      world_size=1)
    inputs = load_inputs(args)
    first = inputs.prompts.batch(0)[0]
    assert inputs.tokenizer.decode(first.ids).startswith("[user] q") and "<|im_start|>" not in \
        inputs.tokenizer.decode(first.ids)
    assert inputs.tokenizer.decode(inputs.eval_sets["val"][0].ids) == "[user] q0\n[assistant] "
    inputs.tokenizer.save_pretrained(tmp_path / "export")
    assert "[assistant]" in (tmp_path / "export" / "chat_template.jinja").read_text()
    with pytest.raises(ConfigError, match="--chat-template @.*missing.jinja: cannot read"):
        parse_args(["--model", tiny_model, "--chat-template", f"@{tmp_path}/missing.jinja"], world_size=1)
