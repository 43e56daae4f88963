"""The built-in tools: `calculator` (exact arithmetic, no eval) and `python` (a program in the sandbox)."""

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
