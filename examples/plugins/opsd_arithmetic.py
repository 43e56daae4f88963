"""An OPSD plugin: `--external-plugins examples/plugins/opsd_arithmetic.py --preprocessor arithmetic_opsd`.

On-policy self-distillation with a privileged teacher: every row gets a `teacher_prompt`
that the student never sees. The teacher scores the student's own response after that
prompt, so it can tell the student which tokens a better-informed model would have
chosen. Here the privileged information is the answer itself; in practice it is a
worked solution, a reference proof, passing tests, ...

Raw rows are the built-in task's problems, {"prompt": "What is 3 + 4?", "answer": "7"}, e.g.
    python -c "from megarl.data.tasks import arithmetic as a; a.write_jsonl('artifacts/arithmetic.jsonl', \
a.make_problems(5000, seed=5))"
"""

from megarl.data.datasets import register_preprocessor


@register_preprocessor("arithmetic_opsd")
def arithmetic_opsd(raw: dict) -> dict:
    """A raw problem -> an ms-swift row with a privileged teacher prompt (the `answer` column stays,
    for the arithmetic reward)."""
    from megarl.data.tasks.arithmetic import hinted

    return {"messages": [{"role": "user", "content": raw["prompt"]}], "solution": raw["answer"],
            "teacher_prompt": hinted(raw), "answer": raw["answer"]}
