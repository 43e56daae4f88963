"""Math rewards: the final answer, judged equal to ``gt_answer`` by math-verify.

Two answer formats, each registered with the system prompt that asks for it:

``boxed``              the answer is the content of the LAST ``\\boxed{...}``
                       (nested braces kept; an earlier box is a draft, the last
                       one counts). ``\\boxed 5`` without braces is NOT accepted:
                       in TeX it boxes one token only (``\\boxed 12`` is
                       ``\\boxed{1}2``), so its extent is ambiguous; models told
                       to use ``\\boxed{}`` emit braces.
``think_answer_tags``  the response is ``<think>...</think>`` then
                       ``<answer>...</answer>`` and nothing else (surrounding
                       whitespace allowed), each tag exactly once. The answer is
                       the ``<answer>`` content, or the last ``\\boxed{}`` inside
                       it when it has one. The block must hold the answer alone:
                       prose in it ("The answer is 5") parses as a product of
                       letter symbols and is judged wrong.

Score convention (ColossalChat's math reward, scaled to 1): correctness only
counts when the format is valid, and a valid format alone may earn a small
bonus. Both are factory parameters (`make_boxed_reward`,
`make_think_answer_reward`):

  reward             correct + format   format only   bad format
  boxed              1.0                0.0           0.0   ("no box")
  think_answer_tags  1.0                0.1           0.0   ("no answer tags", "bad format")

``boxed`` has no format bonus: a box is trivial to produce and a bonus would only
reward boxing anything. The tag format is a real skill for a base model, so a
small bonus gives GRPO a signal while every answer is still wrong. Malformed
tags (a duplicated ``<answer>``, text after ``</answer>``, ...) score 0 even with
a right answer: several answer blocks would let the policy hedge.

Reasons: "correct", "wrong answer", "unparsable" (math-verify found no
expression in the answer), "timeout: math grading" (over MATH_VERIFY_TIMEOUT_S;
counted in reward_timeouts), "no box", "unclosed box" (the last
``\\boxed{`` never closes: usually a truncated response), "no answer tags",
"bad format", "bad gt_answer" (the ground truth itself does not parse).

Equivalence is ``math_verify.verify(parse(gold), parse(answer))`` with both
sides wrapped in ``\\boxed{}``: math-verify only reads LaTeX inside ``$...$`` or
``\\boxed{}`` (an unwrapped ``\\frac12`` or ``(1,2)`` parses to nothing), and a
gold that is already boxed or in ``$...$`` still parses when wrapped. So
``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``\\dfrac{3}{4}`` = ``0.75``, ``5\\text{ cm}`` = ``5``,
``5.0`` = ``5``, ``x=3`` = ``3``, ``1,000`` = ``1000``, ``\\{1,2\\}`` = ``\\{2,1\\}``,
``50\\%`` = ``50`` = ``0.5``. Known math-verify behaviour (tests pin it down):
words parse as products of single-letter symbols, so ``five`` != ``5`` while
``yes`` = ``Yes`` (and anagrams are equal); ``1e6`` is ``1*e*6`` (Euler's e);
``\\text{5 cm}`` is one symbol, not 5; floats compare at 6 decimals, so
``0.333`` != ``1/3`` but ``0.3333333`` = ``1/3``.

Normalisation (`normalize_answer`, applied to both the answer and the ground
truth inside `_judge`, so both judge paths below apply it): rewrites forms that
math-verify misreads, each only where one reading is the plain one (the few
costs are named), in this order:
  - one trailing full stop is dropped (``2.`` and ``(1,2).`` are unparsable
    otherwise); ``...`` is an ellipsis and stays.
  - plain-text Unicode math becomes LaTeX (all unparsable otherwise): ``√12`` =
    ``\\sqrt{12}`` (the radical covers a whole number or a parenthesised group,
    as plain text means it: ``√(x+1)`` = ``\\sqrt{x+1}``; anything else is TeX's
    one-token argument), ``∛8`` = 2; vulgar fractions, a mixed number after an
    integer (``½`` = 0.5, ``3½`` = 7/2, not 3*1/2); superscript and subscript
    digits (``x²`` = ``x^2``, ``10⁻³``, ``a₁``); ``·`` is multiplication (as
    prm800k's grader reads it; ``3·4`` = 12, not 3.4); ``∞`` = ``\\infty``;
    the fraction slash ``1⁄2`` = ``1/2``.
  - infinity spelt out is ``\\infty``: ``\\text{infinity}`` (math-verify alone: the
    symbol "infty"), ``\\text{Infinity}``, ``\\mathrm{\\infty}``, ``-\\text{infinity}``
    (unparsable alone), ``\\text{-infinity}``, ``\\text{negative infinity}``,
    ``\\text{inf}`` (math-verify reads a bare ``inf`` as ``\\infty``), a bare
    ``Infinity`` (a product of letters alone), KaTeX's ``\\infin``. The whole
    ``\\text{}`` must be the (signed) word, and a bare word must stand alone
    (``Infinityx`` is left as it is).
  - the Unicode degree sign and gensymb's ``\\degree`` become ``^{\\circ}``
    (``45°`` = ``45``; unparsable otherwise), and ``\\varnothing`` becomes
    ``\\emptyset`` (math-verify alone has ``\\emptyset`` = ``\\{\\}`` but
    ``\\varnothing`` != ``\\emptyset``).
  - a temperature scale right after a degree mark is dropped, as math-verify
    drops other units: ``45°C`` = ``45^\\circ C`` = ``45 ℃`` = ``98.6^\\circ F``
    = the number (otherwise unparsable, or ``45*C``). Only ``C``, ``F``, ``K``
    (bare or in ``\\text{}``) after a degree mark, not going on as a word or a
    symbol (``45^\\circ Cx``, ``C_1``, ``C =``): a bare ``C`` or ``K`` is a
    constant or a variable (``273 K`` stays ``273*K``), and a bearing's
    ``45°N`` keeps its direction.
  - an ordinal is its number: ``5^{\\text{th}}`` = ``5^\\text{th}`` = ``5^{\\rm th}``
    = ``5^{th}`` = ``5\\textsuperscript{th}`` = ``22nd`` = ``\\text{5th}`` = the
    number (otherwise unparsable, ``5^(t*h)`` or ``2*n*d``), only where the
    suffix is the one English gives that integer (``12th``, not ``12nd``, which
    stays a product). A bare suffix (``2nd``) only as the whole answer: inside an
    expression, ``2a+2nd`` is a sum of products. Cost: a whole answer ``2nd``
    or a power ``2^{nd}`` meant as ``2*n*d`` or ``2^(n*d)`` reads as 2.
  - spacing between a digit and ``\\%`` is dropped: ``5\\,\\%`` = ``5\\%`` (SI
    style; unparsable otherwise).
  - a thin space (``\\,``, ``\\thinspace``) after each comma of a thousands-grouped
    number (lead group 1-9 then up to two digits, then groups of exactly three) is
    dropped, leaving math-verify's own reading of ``1,000``: ``1,\\,000`` =
    ``1000`` as the whole answer (a set ``{1, 0}`` otherwise), while
    ``(1,\\,000)`` stays a pair, as ``(1,000)`` is. A tuple's spacing is kept
    where it cannot be thousands: ``(1,\\,2)``, ``1,\\,2345``, ``0,\\,100``
    (math-verify reads ``0,100`` as the decimal 0.1). A plain space after a
    comma (``1, 000``) stays a list separator, as math-verify has it. Cost:
    a whole answer listing three-digit numbers with thin spaces
    (``153,\\,370``) reads as one number, as ``153,370`` already does.
  - digit-group spacing: a run of ``\\,`` ``\\:`` ``\\;`` ``\\>`` ``\\!`` ``\\ `` ``~``
    ``{,}`` ``\\thinspace`` or plain spaces between a digit and exactly three
    digits (not followed by a fourth) is dropped: ``1\\,000\\,000`` = ``1000000``
    (math-verify alone reads ``1\\,000`` as ``1*000`` = 0). A group of three
    digits after a space can only be thousands; anything else is left alone:
    ``2\\,x`` stays ``2x``, ``12\\,34`` stays ``12*34``, and a shorter last group
    of decimals (``3.141\\,59``) is not joined.
  - repeating decimals become the exact fraction: ``0.\\overline{3}`` =
    ``0.\\bar 3`` = ``0.(3)`` = ``1/3``, ``1.2\\overline{45}`` = ``137/110``,
    ``0.1\\dot{6}`` = ``1/6``, ``0.\\dot{1}4\\dot{2}`` = ``142/999`` (UK dots mark the
    repetend's first and last digits). Only right after a decimal point and its
    digits, with no space: ``(0.5,(3))`` stays a tuple and ``\\overline{12}`` (a
    digit string, or a segment) is untouched. ``0.1(6)`` is thus never the
    product ``0.1*6`` nor physics' uncertainty notation (``1.23(4)`` = 1.23 +- 0.04);
    neither is a plausible final answer to a math problem.
math-verify already handles, so these are left to it (tests pin them down):
``\\$``, ``\\text{}``/``\\mbox{}`` units, ``^\\circ``, ``\\left(``/``\\right)``,
``\\dfrac``/``\\tfrac``, ``x =``, ``\\%``, ``1,000`` and ``1,\\!000`` (thousands),
leading zeros (AIME's ``042`` = ``42``), Unicode ``× ÷ − ⋅ π ≤ ≥ ≠ ∪ ∅ ±``.
Still not read, as rare in final answers or ambiguous: ``\\inf`` (LaTeX's
infimum operator); ``\\text{infinitely many}``, ``\\text{infinite}`` (a count
in words; datasets write it as ``\\infty`` or in words, so equating them is
the ground truth's call); a temperature scale with no degree mark (``273 K``,
``45C``: C and K are variables); the ASCII degree ``45^o`` (a power of o); a
bearing's letter (``45°N``); an ordinal whose suffix is not its number's
(``21^{\\text{th}}``) or a bare suffix inside an expression (``2a+2nd``);
``1, 000`` with a plain space (math-verify's list separator); the en dash
``2–3`` (a range more often than a minus); other Unicode that only NFKC
folds (full-width digits): NFKC would also turn ``x²`` into ``x2``.

Timeouts: sympy can run for ever (``\\boxed{9^{9^{9^{9}}}}``), and one hung
reward stalls every rank of a run. math-verify's own timeouts use SIGALRM,
which only works in the main thread (elsewhere it raises), so its timeouts are
disabled and this module bounds the whole judgement (parse both sides and
compare) itself, MATH_VERIFY_TIMEOUT_S seconds:
  - in the main thread: a SIGALRM timer (an outer timer is re-armed after);
  - in any other thread: the judgement runs in a helper process (one per
    concurrent caller, started on first use, about a second, and reused); the
    helper times itself out the same way, and is killed and replaced if it
    overruns by HELPER_GRACE_S (C code that never yields to the signal).
Both paths run the same `_judge`, so the score never depends on the thread.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from megarl.rewards import SCORER_TIMEOUT, RewardOutput, register_reward
from megarl.data.tasks.arithmetic import extract_boxed

MATH_VERIFY_TIMEOUT_S = 5.0
"""Wall-clock budget of one judgement (parse gold + parse answer + compare)."""
GRADING_TIMEOUT = f"{SCORER_TIMEOUT}math grading"
"""The verdict (and reason) of a judgement over MATH_VERIFY_TIMEOUT_S."""
HELPER_GRACE_S = 5.0
"""How long past the budget a helper process may take before it is killed."""

BOXED_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
TAGS_SYSTEM_PROMPT = (
    "Think through the problem inside <think> </think> tags, then give only the final answer "
    "inside <answer> </answer> tags, for example: <think> reasoning </think> <answer> 42 </answer>"
)

Judge = Callable[[str, object], str]

# ------------------------------------------------------------------ rewards ----


def make_boxed_reward(correct_score: float = 1.0, format_score: float = 0.0, judge: Judge | None = None):
    """A `boxed` reward: `correct_score` if the last box is right, `format_score` for any other closed box."""
    judge = judge or judge_answer

    def boxed_reward(response: str, row: dict) -> RewardOutput:
        answer = extract_boxed(response)
        if answer is None:
            return RewardOutput(0.0, "unclosed box" if "\\boxed{" in response else "no box")
        verdict = judge(answer, row.get("gt_answer"))
        return RewardOutput(correct_score if verdict == "correct" else format_score, verdict)

    return boxed_reward


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_WELL_FORMED = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)


def tags_well_formed(response: str) -> bool:
    """`<think>...</think>` then `<answer>...</answer>`, each tag once, nothing outside but whitespace."""
    return all(response.count(tag) == 1 for tag in _TAGS) and _WELL_FORMED.fullmatch(response) is not None


def tagged_answer(response: str) -> str | None:
    """The last `<answer>` block's content, or the last `\\boxed{}` in it when it has one; None if no block."""
    blocks = _ANSWER.findall(response)
    if not blocks:
        return None
    boxed = extract_boxed(blocks[-1])
    return boxed if boxed is not None else blocks[-1].strip()


def make_think_answer_reward(correct_score: float = 1.0, format_score: float = 0.1, judge: Judge | None = None):
    """A `think_answer_tags` reward: `correct_score` if right, `format_score` if only well-formed."""
    judge = judge or judge_answer

    def think_answer_reward(response: str, row: dict) -> RewardOutput:
        answer = tagged_answer(response)
        if answer is None:
            return RewardOutput(0.0, "no answer tags")
        if not tags_well_formed(response):
            return RewardOutput(0.0, "bad format")
        verdict = judge(answer, row.get("gt_answer"))
        return RewardOutput(correct_score if verdict == "correct" else format_score, verdict)

    return think_answer_reward


# -------------------------------------------------------------- judgement ----


def judge_answer(answer: str, gt_answer) -> str:
    """Verdict on `answer` against `gt_answer`, bounded by MATH_VERIFY_TIMEOUT_S from any thread."""
    if threading.current_thread() is threading.main_thread():
        _warm_up()
        return _judge_with_alarm(answer, gt_answer, MATH_VERIFY_TIMEOUT_S)
    return _judge_in_helper(answer, gt_answer, MATH_VERIFY_TIMEOUT_S)


@functools.cache
def _warm_up() -> None:
    """Import math-verify and judge once, untimed: the import (sympy, the LaTeX grammar) and the first
    parse take seconds on a loaded host, and counted inside the first judgement's timer they would turn
    a correct answer into a timeout (seen under load 10 on 2 cores)."""
    _judge("1", "1")


def _judge(answer: str, gt_answer) -> str:
    """The verdict, with no time limit: "correct", "wrong answer", "unparsable" or "bad gt_answer"."""
    from math_verify import parse, verify

    if gt_answer is None or not str(gt_answer).strip():
        return "bad gt_answer"
    # Timeouts off: they are SIGALRM-based (main thread only); the callers bound the time instead.
    gold = parse(f"\\boxed{{{normalize_answer(str(gt_answer))}}}", parsing_timeout=None)
    if not gold:
        return "bad gt_answer"
    pred = parse(f"\\boxed{{{normalize_answer(answer)}}}", parsing_timeout=None)
    if pred and verify(gold, pred, timeout_seconds=None):
        return "correct"
    # parse() falls back to the raw string when sympy fails; string-only means nothing parsed.
    return "wrong answer" if any(not isinstance(p, str) for p in pred) else "unparsable"


# ---------------------------------------------------------- normalisation ----

# Spacing that typesets a digit-group separator: \, \: \; \> \! \<space> ~ {,} \thinspace.
_SPACING = r"(?:\\[,:;>! ]|~|\{,\}|\\thinspace(?![a-zA-Z]))"
# A run of them and of plain spaces (TeX ignores those in math mode), between a digit and exactly three digits.
_DIGIT_GROUP_SEPARATOR = re.compile(rf"(?<=\d)(?:\s|{_SPACING})+(?=\d{{3}}(?!\d))")

# A number with a thin space after each thousands comma: 1,\,000 or 12,\,345,\,678.9. The lead group has no
# leading zero: math-verify reads 0,100 as the decimal 0.100, so 0,\,100 stays the list it looks like.
_THIN_SPACE = r"(?:\s*(?:\\,|\\thinspace(?![a-zA-Z])))+\s*"
_THIN_SPACED_THOUSANDS = re.compile(rf"(?<![\w.])[1-9]\d{{0,2}}(?:,{_THIN_SPACE}\d{{3}})+(?!\d)")

# A decimal (not inside a longer word or number) whose digits end in a marked repetend:
# 0.1\overline{6}, 0.1\bar 6, 0.1(6), 0.1\dot{6}, or 0.\dot{1}4\dot{2} (dots over its first and last digits).
_REPEATING_DECIMAL = re.compile(
    r"(?<![\w.])(?P<whole>\d*)\.(?P<fixed>\d*)(?:"
    r"\\(?:overline|bar)\s*(?:\{(?P<bar>\d+)\}|(?P<bar1>\d))"
    r"|\((?P<paren>\d+)\)"
    r"|\\dot\s*\{?(?P<dot>\d)\}?(?:(?P<mid>\d*)\\dot\s*\{?(?P<last>\d)\}?)?)")

# The commands that typeset a word upright; math-verify keeps \text{} content as one symbol.
_TEXT = r"\\(?:text|textrm|textnormal|textup|mathrm|mbox)"

# An ordinal's suffix on an integer, in a superscript or \text{}: 5^{\text{th}}, 5^\text{th}, 5^{\rm th},
# 5^{th}, 5\textsuperscript{th}, 5\text{th}. Each form has its own group for the suffix (one name per group).
_SUFFIX = "st|nd|rd|th"


def _in_text(group: str) -> str:
    return rf"{_TEXT}\s*\{{\s*(?P<{group}>{_SUFFIX})\s*\}}"


_ORDINAL = re.compile(
    r"(?<![\w.])(?P<number>\d+)\s*(?:"
    rf"\^\s*\{{\s*(?:{_in_text('s1')}|\\rm\s*(?P<s2>{_SUFFIX})|(?P<s3>{_SUFFIX}))\s*\}}"
    rf"|\^\s*{_in_text('s4')}"
    rf"|\\textsuperscript\s*\{{\s*(?P<s5>{_SUFFIX})\s*\}}"
    rf"|{_in_text('s6')})")
# A bare suffix (5th, 22nd) only as the whole answer, or the whole of a \text{}: inside an expression 2nd
# can be the product 2*n*d.
_WHOLE_ORDINAL = re.compile(
    rf"\s*(?:(?P<number>\d+)(?P<s1>{_SUFFIX})|{_TEXT}\s*\{{\s*(?P<n2>\d+)(?P<s2>{_SUFFIX})\s*\}})\s*")

_SPACE_BEFORE_PERCENT = re.compile(rf"(?<=\d)(?:\s|{_SPACING})+(?=\\%)")
_TRAILING_PERIOD = re.compile(r"(?<![.\\])\.\s*$")  # one period: "..." is an ellipsis, "\." an accent

# Unicode math that math-verify's LaTeX grammar cannot read (it does read × ÷ − ⋅ ∙ π ≤ ≥ ≠ ∪ ∅ ± ℝ and Greek).
_UNICODE_SYMBOLS = {
    "·": r"\cdot ",  # U+00B7: multiplication, as prm800k reads it (a raised decimal point is old British print)
    "∞": r"\infty ",
    "⁄": "/", "∕": "/",  # fraction slash, division slash: 1⁄2 is a fraction
}
_VULGAR_FRACTIONS = {
    "½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5), "⅗": (3, 5),
    "⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅐": (1, 7), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8), "⅞": (7, 8),
    "⅑": (1, 9), "⅒": (1, 10), "↉": (0, 3),
}
# An integer right before a vulgar fraction makes a mixed number (3½ = 7/2, not 3 * 1/2); a decimal does not.
# The spaces belong to the integer, so a long run of spaces is not rescanned from each of its positions.
_VULGAR_FRACTION = re.compile(rf"(?<![\d.])(?:(?P<whole>\d+)\s*)?(?P<frac>[{''.join(_VULGAR_FRACTIONS)}])")
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-")
_SUBSCRIPTS = str.maketrans("₀₁₂₃₄₅₆₇₈₉₊₋", "0123456789+-")
_SUPERSCRIPT = re.compile("[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_SUBSCRIPT = re.compile("[₊₋]?[₀₁₂₃₄₅₆₇₈₉]+")
_RADICALS = {"√": r"\sqrt", "∛": r"\sqrt[3]", "∜": r"\sqrt[4]"}
_RADICAL_OR_CLOSE = re.compile("[√∛∜)]")
_RADICAND_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)")

# Infinity in words or in \text{} (math-verify reads \text{infinity} as the symbol "infty", Infinity as a product
# of letters): \text{infinity}, \mathrm{\infty}, \text{-infinity}, \text{negative infinity}, \text{inf},
# \infin (KaTeX).
_INFINITY_WORD = r"(?:infinity|infty|inf|\\infty(?![a-zA-Z]))"  # math-verify reads a bare inf as \infty too
_INFINITY_IN_TEXT = re.compile(
    rf"{_TEXT}\s*\{{\s*"
    rf"(?:(?P<sign>[+-])\s*|(?P<word>positive|negative|plus|minus)\s+)?{_INFINITY_WORD}\s*\}}", re.IGNORECASE)
_INFINITY_BARE = re.compile(r"(?<![a-zA-Z\\])infinity(?![a-zA-Z])|\\infin(?![a-zA-Z])", re.IGNORECASE)

# A degree mark: ^\circ, ^{\circ} (what ° becomes), or the gensymb/textcomp commands \degree, \textdegree.
_DEGREE_COMMAND = re.compile(r"\\(?:text)?degree(?![a-zA-Z])")
_DEGREE = r"\^\s*(?:\\circ(?![a-zA-Z])|\{\s*\\circ\s*\})"
# A temperature scale right after a degree mark: a bare C F K, or one in \text{} and the like. Not a letter that
# goes on as a word or a symbol (45^\circ Cx, 45^\circ C', C_1, C^2), nor the left side of an equation (C = ...).
_TEMPERATURE_SCALE = re.compile(
    rf"(?P<degree>{_DEGREE})(?:\s|\\[,:;! ]|~|\{{\}})*"
    rf"(?:{_TEXT}\s*\{{\s*[CFK]\s*\}}|[CFK](?![\w'^_]))(?!\s*=)")


def normalize_answer(text: str) -> str:
    """`text` with the forms math-verify misreads rewritten (see the module docstring), applied to both sides."""
    # A sentence's full stop: math-verify cannot parse "2." nor "(1,2).".
    text = _TRAILING_PERIOD.sub("", text)
    # Plain-text Unicode math (√2, 3½, x², ∞): math-verify's LaTeX grammar leaves it unparsable.
    text = _unicode_as_latex(text)
    # Infinity spelt out, or in \text{}: math-verify reads only \infty (and a lower-case bare "infinity").
    text = _INFINITY_IN_TEXT.sub(_infinity_as_latex, text)
    text = _INFINITY_BARE.sub(lambda m: "\\infty ", text)
    # Unicode degrees, gensymb's \degree and \varnothing: math-verify knows ^\circ and \emptyset only
    # (\degree is unparsable there, and \varnothing != \emptyset).
    text = text.replace("℃", "°C").replace("℉", "°F")  # the one-character Celsius and Fahrenheit signs
    text = text.replace("°", "^{\\circ}").replace("\\varnothing", "\\emptyset")
    text = _DEGREE_COMMAND.sub(lambda m: "^{\\circ}", text)
    # A temperature is its number, like other units: 45^\circ C is otherwise 45*C (math-verify drops only
    # \text{C}, and only at the very end). Only after a degree mark: a bare C or K is a constant or a variable.
    text = _TEMPERATURE_SCALE.sub(r"\g<degree>", text)
    # An ordinal answers with its number: 5^{\text{th}} is unparsable, 5^{th} is 5^(t*h), 2nd is 2*n*d.
    text = _ORDINAL.sub(_ordinal_as_number, text)
    if whole := _WHOLE_ORDINAL.fullmatch(text):
        text = _ordinal_as_number(whole)
    # "5\,\%" (SI style) is unparsable, "5\%" is 5. Only after a digit, so a long run of spaces is scanned once.
    text = _SPACE_BEFORE_PERCENT.sub("", text)
    # 1,\,000 is a set {1, 0} to math-verify, which reads 1,000 as a number only when it is the whole answer and
    # as a tuple's members inside brackets. Dropping the thin space leaves that call to math-verify: 1,\,000 is
    # 1000 and (1,\,000) stays a pair, as (1,000) is; a thin space after a comma before fewer or more than three
    # digits ((1,\,2), 1,\,2345) is a list's spacing and is kept.
    text = _THIN_SPACED_THOUSANDS.sub(lambda m: re.sub(_THIN_SPACE, "", m[0]), text)
    # math-verify reads "1\,000" as 1*000 = 0: drop the separator, a group of three digits can only be thousands.
    text = _DIGIT_GROUP_SEPARATOR.sub("", text)
    # math-verify cannot parse 0.\overline{3} and reads 0.1(6) as 0.1*6: write the exact fraction instead.
    return _REPEATING_DECIMAL.sub(_repeating_decimal_as_fraction, text)


def _infinity_as_latex(match: re.Match) -> str:
    negative = match["sign"] == "-" or (match["word"] or "").lower() in ("negative", "minus")
    return "-\\infty " if negative else "\\infty "


def _ordinal_as_number(match: re.Match) -> str:
    """The number, if the suffix is the one English gives it (1st, 12th, 22nd): anything else is left as it is."""
    groups = match.groupdict()
    number = groups.get("number") or groups["n2"]
    suffix = next(groups[g] for g in groups if g[0] == "s" and groups[g])
    return number if suffix == _ordinal_suffix(int(number)) else match[0]


def _ordinal_suffix(n: int) -> str:
    if n % 100 in (11, 12, 13):
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _unicode_as_latex(text: str) -> str:
    """`text` with the Unicode math math-verify cannot read written as LaTeX: √12 -> \\sqrt{12}, x² -> x^2, ..."""
    if text.isascii():
        return text
    for char, latex in _UNICODE_SYMBOLS.items():
        text = text.replace(char, latex)
    text = _VULGAR_FRACTION.sub(_vulgar_fraction_as_latex, text)
    # A single digit stays unbraced: math-verify strips a unit's power only in the form \text{ m}^2.
    text = _SUPERSCRIPT.sub(lambda m: _script("^", m[0].translate(_SUPERSCRIPTS)), text)
    text = _SUBSCRIPT.sub(lambda m: _script("_", m[0].translate(_SUBSCRIPTS)), text)
    return _radicals_as_latex(text)


def _script(mark: str, content: str) -> str:
    return f"{mark}{content}" if len(content) == 1 else f"{mark}{{{content}}}"


def _vulgar_fraction_as_latex(match: re.Match) -> str:
    numerator, denominator = _VULGAR_FRACTIONS[match["frac"]]
    if match["whole"]:
        numerator += int(match["whole"]) * denominator
    latex = f"\\frac{{{numerator}}}{{{denominator}}}"
    # After ^ or _ a bare \frac is misread (x^\frac{1}{2} parses as 1/2); braces keep it one group.
    return f"{{{latex}}}" if match.string[match.start() - 1:match.start()] in ("^", "_") else latex


def _radicals_as_latex(text: str) -> str:
    """√12 -> \\sqrt{12} and √(x+1) -> \\sqrt{x+1}, as plain text means them; otherwise TeX's one-token argument."""
    if not any(radical in text for radical in _RADICALS):
        return text
    matching = _matching_parens(text)
    out, braced_closes, i = [], set(), 0
    for match in _RADICAL_OR_CLOSE.finditer(text):  # one pass, so nested or unclosed radicals stay linear
        j = match.start()
        out.append(text[i:j])
        i = j + 1
        if text[j] == ")":
            out.append("}" if j in braced_closes else ")")
        else:
            out.append(_RADICALS[text[j]])
            # Plain text's radical covers the whole number (√12 is sqrt(12)); TeX's \sqrt12 would be sqrt(1)*2.
            if number := _RADICAND_NUMBER.match(text, i):
                out.append(f"{{{number[1]}}}")
                i = number.end()
            elif i in matching:
                out.append("{")
                braced_closes.add(matching[i])
                i += 1
            else:
                out.append(" ")  # \sqrt x, \sqrt{...}: the next token is the radicand, as in TeX
    out.append(text[i:])
    return "".join(out)


def _matching_parens(text: str) -> dict[int, int]:
    """The index of each "(" that is closed, mapped to its ")"."""
    matching, open_at = {}, []
    for k, char in enumerate(text):
        if char == "(":
            open_at.append(k)
        elif char == ")" and open_at:
            matching[open_at.pop()] = k
    return matching


def _repeating_decimal_as_fraction(match: re.Match) -> str:
    """``\\frac{p}{q}`` equal to the matched repeating decimal: 0.1(6) = (16 - 1) / 90 = 1/6."""
    repetend = (match["bar"] or match["bar1"] or match["paren"]
                or match["dot"] + (match["mid"] + match["last"] if match["last"] else ""))
    fixed = (match["whole"] or "0") + match["fixed"]
    value = Fraction(int(fixed + repetend) - int(fixed), 10 ** len(match["fixed"]) * (10 ** len(repetend) - 1))
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


class _Timeout(BaseException):
    """BaseException, like math-verify's own, so no `except Exception` inside it swallows the alarm."""


def _judge_with_alarm(answer: str, gt_answer, seconds: float) -> str:
    """`_judge` under a SIGALRM timer (main thread only); restores any outer handler and timer."""
    def on_alarm(signum, frame):
        raise _Timeout()

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return _judge(answer, gt_answer)
    except _Timeout:
        return GRADING_TIMEOUT
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:  # an outer timer was running: give it back what is left (fire at once if overdue)
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)


# ------------------------------------------------------- helper processes ----

_ROOT = str(Path(__file__).resolve().parents[2])
# -c, not the file: run as a script, this file's folder would shadow the stdlib `math`.
_HELPER_MAIN = f"import sys; sys.path.insert(0, {_ROOT!r}); from megarl.rewards.math import _serve; _serve()"


class _Helper:
    """A child process that judges one request at a time over JSON lines on stdin/stdout."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _HELPER_MAIN], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._read(timeout=120) != "ready":
            self.kill()
            raise RuntimeError("math-verify helper process failed to start (see its stderr above)")

    def judge(self, answer: str, gt_answer, seconds: float, wait: float) -> str:
        gold = None if gt_answer is None else str(gt_answer)
        self.proc.stdin.write(json.dumps({"answer": answer, "gold": gold, "seconds": seconds}) + "\n")
        self.proc.stdin.flush()
        verdict = self._read(timeout=wait)
        if verdict is None:
            self.kill()
            return GRADING_TIMEOUT
        return verdict

    def _read(self, timeout: float) -> str | None:
        """The next line's verdict; None after `timeout` seconds; raises if the child died."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RuntimeError(f"math-verify helper process exited with code {self.proc.poll()}")
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self):
        self.proc.kill()
        self.proc.wait()


_IDLE_HELPERS: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
_ALL_HELPERS: list[_Helper] = []


def _judge_in_helper(answer: str, gt_answer, seconds: float, wait: float | None = None) -> str:
    """`_judge` in an idle helper (a new one if all are busy); the helper is reused unless it was killed."""
    helper = _idle_helper()
    verdict = helper.judge(answer, gt_answer, seconds, seconds + HELPER_GRACE_S if wait is None else wait)
    if helper.alive:
        _IDLE_HELPERS.put(helper)
    else:
        _ALL_HELPERS.remove(helper)
    return verdict


def _idle_helper() -> _Helper:
    """An idle live helper, or a new one; a helper that died while idle (OOM killer, ...) is dropped."""
    while True:
        try:
            helper = _IDLE_HELPERS.get_nowait()
        except queue.Empty:
            helper = _Helper()
            _ALL_HELPERS.append(helper)
            return helper
        if helper.alive:
            return helper
        _ALL_HELPERS.remove(helper)


@atexit.register
def _stop_helpers():
    for helper in _ALL_HELPERS:
        helper.kill()


def _serve():
    """The helper process's loop (its main thread, so the alarm works); exits when stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns stdout: stray prints go to stderr
    _warm_up()  # before "ready": the parent's first wait excludes the import and first parse

    out.write(json.dumps("ready") + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        out.write(json.dumps(_judge_with_alarm(request["answer"], request["gold"], request["seconds"])) + "\n")
        out.flush()


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; this module bounds the time itself."""

    def filter(self, record):
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


register_reward("boxed", system_prompt=BOXED_SYSTEM_PROMPT)(make_boxed_reward())
register_reward("think_answer_tags", system_prompt=TAGS_SYSTEM_PROMPT)(make_think_answer_reward())
