"""The code rewards: program extraction, output comparison, scores and reasons (real sandbox runs)."""

import pytest

from megarl.rewards import REWARDS
from megarl.rewards.code import (
    SYSTEM_PROMPT,
    code_all_or_nothing_reward,
    code_reward,
    extract_program,
    normalise_output,
    read_test_cases,
    score_batch,
)
from megarl.rewards.sandbox import SandboxLimits, SandboxPool

ADD = "a, b = map(int, input().split())\nprint(a + b)"
# Right for non-negative numbers only.
ADD_ABS = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))"
ROW = {"id": "add", "test_cases": {"inputs": ["1 2\n", "10 20\n", "-1 -2\n"], "outputs": ["3\n", "30\n", "-3\n"]}}


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nIt adds the numbers."


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=4, limits=SandboxLimits(cpu_seconds=1, wall_seconds=2.0, memory_mb=128)) as pool:
        yield pool


# --- extraction and comparison (no runs)


def test_extracts_the_last_python_block():
    response = ("First try:\n```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```\n"
                "Run it with:\n```bash\npython main.py\n```")
    assert extract_program(response) == "print(2)\n"


@pytest.mark.parametrize("tag", ["py", "python3", "Python", "python title='main.py'"])
def test_python_tag_variants(tag):
    assert extract_program(fenced("print(1)", tag) + "\n```text\nout\n```") == "print(1)\n"


def test_falls_back_to_the_last_block_of_any_language():
    assert extract_program("```\nprint(1)\n```\nor\n```\nprint(2)\n```") == "print(2)\n"


def test_no_block_is_no_program():
    assert extract_program("print(1)  # no fence") is None
    assert extract_program("```python\nprint(1)  # never closed") is None


def test_normalise_output():
    assert normalise_output("1 2  \r\n3\t\n\n  \n") == "1 2\n3"
    assert normalise_output("  indented\n") == "  indented"  # leading whitespace counts
    assert normalise_output("") == normalise_output("\n\n") == ""


def test_rows_without_test_cases_are_a_dataset_error():
    for row in ({}, {"test_cases": {"inputs": [], "outputs": []}}):
        with pytest.raises(ValueError, match="no test cases"):
            read_test_cases(row)
    with pytest.raises(ValueError):
        read_test_cases({"test_cases": {"inputs": ["1"], "outputs": []}})
    with pytest.raises(ValueError, match="no test cases"):
        score_batch([fenced(ADD)], [{"id": 7}])


def test_registered_with_a_system_prompt():
    for name in ("code", "code_all_or_nothing"):
        assert REWARDS[name].system_prompt == SYSTEM_PROMPT
    assert "```python" in SYSTEM_PROMPT and "standard input" in SYSTEM_PROMPT


# --- scores and reasons (sandboxed runs)


def test_pass_fraction_and_all_or_nothing(pool):
    responses = [fenced(ADD), fenced(ADD_ABS), "I don't know."]
    fraction = score_batch(responses, [ROW] * 3, pool=pool)
    strict = score_batch(responses, [ROW] * 3, all_or_nothing=True, pool=pool)
    assert [(o.score, o.reason) for o in fraction] == [(1.0, "correct"), (pytest.approx(2 / 3), "wrong answer"),
                                                       (0.0, "no code")]
    assert [(o.score, o.reason) for o in strict] == [(1.0, "correct"), (0.0, "wrong answer"), (0.0, "no code")]


def test_whitespace_is_normalised(pool):
    program = "print('3   ')\nprint()\nprint('  ')"
    row = {"test_cases": {"inputs": [""], "outputs": ["3"]}}
    assert score_batch([fenced(program)], [row], pool=pool)[0].score == 1.0


@pytest.mark.parametrize("program, reason", [
    ("raise SystemExit(1)", "runtime error"),
    ("while True: pass", "timeout"),
    ("x = bytearray(2**30)", "memory limit"),
    ("while True: print('x' * 100000)", "output limit"),
])
def test_failure_reasons(pool, program, reason):
    row = {"test_cases": {"inputs": [""], "outputs": [""]}}
    assert score_batch([fenced(program)], [row], pool=pool)[0].reason == reason


def test_the_reason_is_the_first_failing_cases(pool):
    program = "n = int(input())\nif n == 2: raise ValueError\nprint(n if n != 3 else 0)"
    row = {"test_cases": {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}}
    output = score_batch([fenced(program)], [row], pool=pool)[0]
    assert (output.score, output.reason) == (pytest.approx(1 / 3), "runtime error")


def test_a_batch_runs_in_parallel(pool):
    # Each run reports when it started and ended; with 4 workers the runs' intervals overlap (serially
    # they would not). No wall-clock bound: a loaded host only stretches the intervals.
    program = "import time\nprint(time.time())\ntime.sleep(0.5)\nprint(time.time())"
    runs = [r for job in pool.run_jobs([(program, ["a", "b"]), (program, ["c", "d"])]) for r in job]
    assert all(r.status == "ok" for r in runs), runs
    intervals = sorted(tuple(map(float, r.stdout.split())) for r in runs)
    assert any(later_start < end for (_, end), (later_start, _) in zip(intervals, intervals[1:])), intervals
    row = {"test_cases": {"inputs": ["a", "b"], "outputs": ["a", "b"]}}
    outputs = score_batch([fenced("print(input())")] * 2, [row, row], pool=pool)
    assert [o.score for o in outputs] == [1.0, 1.0]


def test_the_single_response_functions():
    assert code_reward(fenced(ADD_ABS), ROW).score == pytest.approx(2 / 3)
    assert code_all_or_nothing_reward(fenced(ADD), ROW).score == 1.0
