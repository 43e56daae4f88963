"""The built-in tools: `calculator` (exact arithmetic, no eval), `python` (a program in the sandbox) and
`calc_gsm8k_reward` (verl's GSM8K tool: the model submits an answer and reads whether it is right)."""

from __future__ import annotations

import ast
import operator

from megarl.tools import register_tool

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 10000  # results and operands of a power beyond this many digits are refused, not computed

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _digits(value) -> int:
    return len(str(abs(int(value)))) if isinstance(value, int) else 0


def _evaluate(node):
    """An arithmetic expression's value: numbers, + - * / // % ** and parentheses; anything else (names,
    calls, attributes, strings) is refused, so nothing but arithmetic ever runs."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(right, int) and abs(right) > 1 and \
                _digits(left) * abs(right) > MAX_DIGITS:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
        value = _BINARY[type(node.op)](left, right)
        if _digits(value) > MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"not arithmetic: {type(node).__name__} (numbers, + - * / // % ** and parentheses only)")


@register_tool("calculator", "Evaluate an arithmetic expression exactly (integers of any size, + - * / // % ** "
                             "and parentheses) and return its value.",
               {"type": "object", "properties": {"expression": {"type": "string", "description":
                                                                "the expression, e.g. (12345678901 + 98765) * 3"}},
                "required": ["expression"]})
def calculator(expression: str) -> str:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {error.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


@register_tool("python", "Run a Python 3 program in a sandbox (no network, no files kept, limited time and memory) "
                         "and return what it printed.",
               {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                "required": ["code"]})
def python(code: str) -> str:
    """The program runs exactly as a code reward's program does: the same sandbox, pool and limits
    (megarl/rewards/code.py's shared_pool and LIMITS); a run over them is reported, not raised."""
    from megarl.rewards import code as code_reward

    result = code_reward.shared_pool().submit(code).result()
    if result.status == "ok":
        return result.stdout
    tail = result.stderr_tail.strip()[-1000:]  # the traceback's end says why
    stdout = result.stdout if not result.stdout or result.stdout.endswith("\n") else result.stdout + "\n"
    return f"{stdout}[{result.status}]" + (f"\n{tail}" if tail else "")


def _code_limits():
    from megarl.rewards.code import LIMITS

    return LIMITS


# The run probes the sandbox at start-up and counts the tool's programs in --sandbox-memory-budget-mb
# (megarl.rewards.scoring.tool_sandbox_limits), as for a code reward.
python.sandbox_limits = _code_limits()


@register_tool("calc_gsm8k_reward", "A tool for calculating the reward of gsm8k. (1.0 if your answer is correct, 0.0 "
                                    "if your answer is incorrect)",
               {"type": "object", "properties": {"answer": {"type": "string", "description":
                                                            "The model's answer to the GSM8K math problem, must be "
                                                            "a digits"}},
                "required": ["answer"]})
def calc_gsm8k_reward(answer) -> str:
    """verl's Gsm8kTool (its multi-turn GSM8K example), under its function name and schema: the answer is
    checked against the episode's row (gt_answer) by verl's "flexible" rule, and the model reads
    "Current parsed answer='...' reward=1.0". verl's per-call tool reward (-0.05 for an answer that did
    not improve) is not added: the episode's reward (--reward) scores its final answer."""
    from megarl.rewards.verl_rules import gsm8k_flexible_answer
    from megarl.tools import current_call

    answer = answer if isinstance(answer, str) else str(answer)
    call = current_call()
    truth = None if call is None else call.row.get("gt_answer")
    parsed = gsm8k_flexible_answer(answer if answer.startswith("#### ") else "#### " + answer)
    reward = 1.0 if parsed is not None and truth is not None and parsed == str(truth) else 0.0
    return f"Current parsed answer={answer!r} reward={reward!r}"
