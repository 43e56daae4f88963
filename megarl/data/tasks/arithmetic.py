"""megarl's built-in task: add two integers, answer in ``\\boxed{}``.

Small enough that a 0.3M-parameter model learns it in about a minute on CPU,
which is what the quickstart and the tests need. The operand range is tuned
together with ``tools/make_tiny_model.py``.
"""
import json
import random

# Operands are drawn uniformly from [0, MAX_OPERAND]. The tiny model's warm-up
# is tuned for this range: with 0-49 or 0-99 it stays under 10% for minutes,
# with 0-19 it climbs through 25-50% within a minute. Change both together.
MAX_OPERAND = 19


def make_problems(num, seed, max_operand=MAX_OPERAND):
    """``num`` addition problems, deterministic in ``seed``.

    Returns ``[{"prompt": "What is 37 + 48?", "answer": "85"}, ...]``.
    Use a different seed for held-out problems.
    """
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        problems.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    return problems


def extract_boxed(text):
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unclosed: the response was cut off


def score(response_text, answer):
    """1.0 if the last boxed answer equals ``answer`` exactly (after stripping), else 0.0."""
    boxed = extract_boxed(response_text)
    return 1.0 if boxed is not None and boxed.strip() == str(answer).strip() else 0.0


def format_response(answer):
    """The target response for supervised warm-up, e.g. ``\\boxed{85}``."""
    return f"\\boxed{{{answer}}}"


# OPSD's privileged prompt of a problem (examples/plugins/opsd_arithmetic.py): the problem with its answer as a
# hint; the tiny hint model (tools/make_tiny_model.py --hints) has learned to read it.
HINT = "{prompt} (A hint only you can see: the answer is {answer}.)"


def hinted(problem):
    """The problem's prompt with its answer as a hint (OPSD's teacher prompt)."""
    return HINT.format(prompt=problem["prompt"], answer=problem["answer"])


def write_jsonl(path, problems):
    """Write one problem dict per line."""
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps(p) + "\n")
