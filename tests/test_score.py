"""`python -m megarl.score`: offline scoring of a responses file against a dataset."""

import json
import subprocess
import sys

from helpers import ROOT


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _score(*argv):
    return subprocess.run([sys.executable, "-m", "megarl.score", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


MATH = [{"messages": [{"role": "user", "content": "Half of one?"}], "gt_answer": "\\frac{1}{2}"},
        {"messages": [{"role": "user", "content": "2 + 2?"}], "gt_answer": "4"},
        {"messages": [{"role": "user", "content": "3 + 3?"}], "gt_answer": "6"}]


def test_scores_by_line_order(tmp_path):
    data = _write(tmp_path / "data.jsonl", MATH)
    responses = _write(tmp_path / "responses.jsonl", [{"response": "so \\boxed{0.5}"}, {"response": "\\boxed{5}"},
                                                      {"response": "six"}])
    result = _score("--reward", "boxed", "--data", data, "--responses", responses)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]
    assert [(r["score"], r["reason"]) for r in rows] == [(1.0, "correct"), (0.0, "wrong answer"), (0.0, "no box")]
    assert lines[-1] == "mean: 0.333333"


def test_scores_by_id_when_both_sides_have_one(tmp_path):
    data = _write(tmp_path / "data.jsonl", [{**row, "id": f"q{i}"} for i, row in enumerate(MATH)])
    responses = _write(tmp_path / "responses.jsonl", [{"id": "q2", "response": "\\boxed{6}"},
                                                      {"id": "q0", "response": "\\boxed{1/3}"}])
    result = _score("--reward", "boxed", "--data", data, "--responses", responses)
    rows = [json.loads(line) for line in result.stdout.strip().splitlines()[:-1]]
    assert [(r["id"], r["score"]) for r in rows] == [("q2", 1.0), ("q0", 0.0)]
    assert result.stdout.strip().endswith("mean: 0.5")


def test_code_reward_reasons_from_the_sandbox(tmp_path):
    data = _write(tmp_path / "code.jsonl", [
        {"messages": [{"role": "user", "content": "Echo the number doubled."}],
         "test_cases": {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}}] * 3)
    programs = ["print(int(input()) * 2)", "while True: pass", "print(int(input()) + 2)"]
    responses = _write(tmp_path / "responses.jsonl", [{"response": f"```python\n{p}\n```"} for p in programs])
    result = _score("--reward", "code", "--data", data, "--responses", responses)
    rows = [json.loads(line) for line in result.stdout.strip().splitlines()[:-1]]
    assert [(r["score"], r["reason"]) for r in rows] == [(1.0, "correct"), (0.0, "timeout"), (0.5, "wrong answer")]


def test_bad_input_is_one_line_naming_file_and_line(tmp_path):
    data = _write(tmp_path / "data.jsonl", MATH)
    cases = [
        ([{"response": "a"}], "1 responses for 3 dataset rows"),
        ([{"response": "a"}, {"text": "b"}, {"response": "c"}], "responses.jsonl:2: needs a string field 'response'"),
    ]
    for records, words in cases:
        result = _score("--reward", "boxed", "--data", data, "--responses", _write(tmp_path / "responses.jsonl",
                                                                                  records))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert words in result.stderr, result.stderr
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}], "gt_answer": [1]}\n')
    result = _score("--reward", "boxed", "--data", tmp_path / "bad.jsonl", "--responses",
                    _write(tmp_path / "r.jsonl", [{"response": "a"}]))
    assert result.returncode == 2 and "bad.jsonl:1" in result.stderr and "gt_answer" in result.stderr, result.stderr
    three = _write(tmp_path / "r.jsonl", [{"response": "a"}] * 3)
    result = _score("--reward", "boxd", "--data", data, "--responses", three)
    assert result.returncode == 2 and "boxd" in result.stderr, result.stderr
