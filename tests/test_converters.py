"""tools/convert_gsm8k.py and tools/convert_math.py: published layouts in, loadable files out."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, load_script
from megarl.data.datasets import load_rows

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A bakery sells 120 loaves a day at $3 each. How many dollars does it take in over 5 days?",
     "answer": "Each day it takes in 120*3 = $<<120*3=360>>360.\n"
               "Over 5 days that is 360*5 = $<<360*5=1800>>1,800.\n#### 1,800"},
]

MATH = {  # path under train/ -> problem, as MATH ships them
    "algebra/1.json": {"problem": "What is $\\sin 60^\\circ$?", "level": "Level 2", "type": "Algebra",
                       "solution": "From the unit circle, $\\sin 60^\\circ = \\boxed{\\frac{\\sqrt{3}}{2}}$."},
    "algebra/12.json": {"problem": "Solve $2x + 3 = 7$.", "level": "Level 1", "type": "Algebra",
                        "solution": "Then $2x = 4$, so $x = \\boxed{2}$."},
    "geometry/5.json": {"problem": "A square has side 3. What is its area?", "level": "Level 1", "type": "Geometry",
                        "solution": "We try $\\boxed{6}$ first, but the area is $3^2 = \\fbox{9}$."},
}


def load_tool(name):
    return load_script(ROOT / "tools" / f"{name}.py")


@pytest.fixture(scope="module")
def gsm8k_tool():
    return load_tool("convert_gsm8k")


@pytest.fixture(scope="module")
def math_tool():
    return load_tool("convert_math")


def write_gsm8k(tmp_path, rows=GSM8K):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_math_tree(tmp_path):
    root = tmp_path / "MATH" / "train"
    for name, problem in MATH.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(problem, indent=4))  # pretty-printed, as published
    return str(root)


@pytest.mark.parametrize("layout, marker", [("colossalchat", "gt_answer"), ("verl", "reward_model"),
                                            ("swift", "solution")])
def test_gsm8k(tmp_path, gsm8k_tool, layout, marker):
    out = str(tmp_path / "out.jsonl")
    assert gsm8k_tool.main(["--input", write_gsm8k(tmp_path), "--output", out, "--format", layout]) == 0
    with open(out) as f:
        raw = [json.loads(line) for line in f]
    assert all(marker in r for r in raw)
    rows = load_rows(out)  # auto-detects the layout just written
    assert [r.gt_answer for r in rows] == ["72", "1800"]  # thousands comma stripped
    assert rows[0].messages == [{"role": "user", "content": GSM8K[0]["question"]}]
    assert rows[1].data_source == "openai/gsm8k" and rows[1].id == "gsm8k-1"
    assert rows[1].extra["reference_solution"].endswith("$<<360*5=1800>>1,800.")


def test_gsm8k_without_final_answer_fails(tmp_path, gsm8k_tool):
    path = write_gsm8k(tmp_path, [GSM8K[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(SystemExit, match=rf"{path}:2: field 'answer' has no '#### <number>' line"):
        gsm8k_tool.main(["--input", path, "--output", str(tmp_path / "out.jsonl")])


def test_gsm8k_command_line(tmp_path):
    out = tmp_path / "out.jsonl"
    result = subprocess.run([sys.executable, "tools/convert_gsm8k.py", "--input", write_gsm8k(tmp_path),
                             "--output", str(out), "--format", "verl"], cwd=ROOT, capture_output=True, text=True,
                            check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{out}: 2 rows (verl)"
    assert [r.gt_answer for r in load_rows(str(out), format="verl")] == ["72", "1800"]


@pytest.mark.parametrize("layout", ["colossalchat", "verl", "swift"])
def test_math_directory(tmp_path, math_tool, layout):
    out = str(tmp_path / "math.jsonl")
    assert math_tool.main(["--input", write_math_tree(tmp_path), "--output", out, "--format", layout]) == 0
    rows = {r.id: r for r in load_rows(out)}
    assert sorted(rows) == ["algebra/1", "algebra/12", "geometry/5"]
    assert rows["algebra/1"].gt_answer == "\\frac{\\sqrt{3}}{2}"  # nested braces kept whole
    assert rows["algebra/12"].gt_answer == "2"
    assert rows["geometry/5"].gt_answer == "6"  # the last \boxed wins; \fbox only when there is none
    assert rows["algebra/1"].messages == [{"role": "user", "content": MATH["algebra/1.json"]["problem"]}]
    assert rows["algebra/1"].extra == {"level": "Level 2", "subject": "Algebra",
                                       "reference_solution": MATH["algebra/1.json"]["solution"]}
    assert rows["algebra/1"].data_source == "lighteval/MATH"


def test_math_fbox_and_jsonl(tmp_path, math_tool):
    path = tmp_path / "math500.jsonl"
    problems = [{**MATH["algebra/12.json"], "unique_id": "test/algebra/12.json"},
                {**MATH["geometry/5.json"], "solution": "The area is $3^2 = \\fbox{9}$."}]
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    out = str(tmp_path / "out.jsonl")
    assert math_tool.main(["--input", str(path), "--output", out]) == 0
    first, second = load_rows(out)
    assert (first.id, first.gt_answer) == ("test/algebra/12.json", "2")
    assert (second.id, second.gt_answer) == ("math500-2", "9")


def test_math_without_boxed_answer_fails(tmp_path, math_tool):
    root = write_math_tree(tmp_path)
    bad = os.path.join(root, "algebra", "99.json")
    with open(bad, "w") as f:
        json.dump({"problem": "p", "level": "Level 1", "type": "Algebra", "solution": "The answer is 4."}, f)
    with pytest.raises(SystemExit, match=rf"{bad}:1: field 'solution' has no complete \\boxed"):
        math_tool.main(["--input", root, "--output", str(tmp_path / "out.jsonl")])
