"""The math rewards (`boxed`, `think_answer_tags`) on a table of realistic answers.

Each row pins a score and a reason; rows marked "quirk" record math-verify's
behaviour as it is (see megarl/rewards/math.py), not what one might wish.
"""

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from megarl.rewards import get_reward
from megarl.rewards import math as math_rewards

boxed = get_reward("boxed").fn
tags = get_reward("think_answer_tags").fn

# (response, gt_answer, score, reason)
BOXED_TABLE = [
    # fractions, decimals, \dfrac
    (r"So the probability is \boxed{\frac{1}{2}}.", "0.5", 1.0, "correct"),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, "correct"),
    (r"\boxed{1/2}", r"\frac12", 1.0, "correct"),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0, "correct"),
    (r"\boxed{0.75}", r"\dfrac{3}{4}", 1.0, "correct"),
    (r"\boxed{\frac{2}{3}}", "0.75", 0.0, "wrong answer"),
    # units
    (r"The side is \boxed{5\text{ cm}}", "5", 1.0, "correct"),
    (r"\boxed{5}", r"5\text{ cm}", 1.0, "correct"),
    (r"\boxed{12\mbox{ apples}}", "12", 1.0, "correct"),
    (r"\boxed{90^\circ}", "90", 1.0, "correct"),
    (r"\boxed{\text{5 cm}}", "5", 0.0, "wrong answer"),  # quirk: one \text{} is one symbol
    # nested braces in the box
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0, "correct"),
    (r"\boxed{\frac{a}{b}}", r"\frac{a}{b}", 1.0, "correct"),
    (r"\boxed{x^{2}+2x+1}", "(x+1)^2", 1.0, "correct"),
    # several boxes: the last one counts
    (r"First \boxed{3}, wait, no: \boxed{4}", "4", 1.0, "correct"),
    (r"First \boxed{4}, wait, no: \boxed{3}", "4", 0.0, "wrong answer"),
    # no usable box
    ("The answer is 5.", "5", 0.0, "no box"),
    (r"The answer is \boxed 5", "5", 0.0, "no box"),  # braces required (documented)
    (r"\boxed{5} and then \boxed{\frac{1}{2", "5", 0.0, "unclosed box"),  # truncated
    (r"\boxed{}", "5", 0.0, "unparsable"),
    # words
    (r"\boxed{five}", "5", 0.0, "wrong answer"),
    (r"\boxed{\text{five}}", "5", 0.0, "wrong answer"),
    (r"\boxed{five}", "five", 1.0, "correct"),
    (r"\boxed{Yes}", "yes", 1.0, "correct"),
    (r"\boxed{silent}", "listen", 1.0, "correct"),  # quirk: letters are multiplied, so anagrams match
    # multiple choice
    (r"\boxed{B}", "B", 1.0, "correct"),
    (r"\boxed{\text{(B)}}", "B", 1.0, "correct"),
    (r"\boxed{C}", "B", 0.0, "wrong answer"),
    # negative numbers
    (r"\boxed{-3}", "-3", 1.0, "correct"),
    (r"\boxed{3}", "-3", 0.0, "wrong answer"),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0, "correct"),
    # integers vs floats, thousands separators, scientific notation
    (r"\boxed{5}", "5.0", 1.0, "correct"),
    (r"\boxed{5.00}", "5", 1.0, "correct"),
    (r"\boxed{1,000}", "1000", 1.0, "correct"),
    (r"\boxed{1,\!000}", "1000", 1.0, "correct"),  # the MATH dataset's thousands separator
    (r"\boxed{1,\!000}", "1", 0.0, "wrong answer"),
    (r"\boxed{042}", "42", 1.0, "correct"),  # AIME answers are written with three digits
    (r"\boxed{042}", "420", 0.0, "wrong answer"),
    (r"\boxed{\$10.50}", "10.5", 1.0, "correct"),
    (r"\boxed{\$10.50}", "1050", 0.0, "wrong answer"),
    (r"\boxed{\tfrac{1}{2}}", "0.5", 1.0, "correct"),
    (r"\boxed{1e6}", "1000000", 0.0, "wrong answer"),  # quirk: e is Euler's number
    (r"\boxed{0.333}", r"\frac{1}{3}", 0.0, "wrong answer"),  # floats compared at 6 decimals
    (r"\boxed{0.3333333}", r"\frac{1}{3}", 1.0, "correct"),
    # percentages
    (r"\boxed{50\%}", "50", 1.0, "correct"),
    (r"\boxed{0.5}", r"50\%", 1.0, "correct"),
    (r"\boxed{25}", "0.25", 0.0, "wrong answer"),  # a percentage without % is not a fraction
    # sets, intervals, equations, expressions
    (r"\boxed{\{2,1\}}", r"\{1,2\}", 1.0, "correct"),
    (r"\boxed{[1,2)}", "[1,2)", 1.0, "correct"),
    (r"\boxed{(1,2)}", "[1,2)", 0.0, "wrong answer"),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0, "correct"),
    (r"\boxed{\left( 1, 2 \right)}", "(2,1)", 0.0, "wrong answer"),
    (r"\boxed{x=3}", "3", 1.0, "correct"),
    (r"\boxed{2+2}", "4", 1.0, "correct"),
    (r"\boxed{\pi}", "3.14", 0.0, "wrong answer"),
    # the ground truth as plain text, LaTeX, $...$ or already boxed
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0, "correct"),
    (r"\boxed{\frac{1}{2}}", r"$\frac{1}{2}$", 1.0, "correct"),
    (r"\boxed{7}", r"\boxed{7}", 1.0, "correct"),
    (r"\boxed{7}", 7, 1.0, "correct"),  # a non-string column
    (r"\boxed{7}", "", 0.0, "bad gt_answer"),
    (r"\boxed{7}", None, 0.0, "bad gt_answer"),
]

# Forms `normalize_answer` rewrites before math-verify sees them: each right form scores 1, a wrong one 0.
NORMALISED_TABLE = [
    # digit-group spacing (math-verify alone reads 1\,000 as 1*000 = 0)
    (r"\boxed{1\,000\,000}", "1000000", 1.0, "correct"),
    (r"\boxed{1\,000\,000}", "1000", 0.0, "wrong answer"),
    (r"\boxed{1\,000}", "0", 0.0, "wrong answer"),  # scored 1 before: 1*000
    (r"\boxed{-1\,000.5}", "-1000.5", 1.0, "correct"),
    (r"\boxed{1\,000\text{ m}}", "1000", 1.0, "correct"),
    (r"\boxed{1000000}", r"1\,000\,000", 1.0, "correct"),  # the ground truth is normalised too
    (r"\boxed{1000}", r"1\,000\,000", 0.0, "wrong answer"),
    (r"\boxed{12\,34}", "1234", 0.0, "wrong answer"),  # not a group of three: left as it is (12*34)
    (r"\boxed{2\,x}", "2x", 1.0, "correct"),  # spacing before a letter is left alone
    (r"\boxed{2\,x}", "2", 0.0, "wrong answer"),
    # a thin space after thousands commas (math-verify alone: 1,\,000 is the set {1, 0})
    (r"\boxed{1,\,000}", "1000", 1.0, "correct"),
    (r"\boxed{1,\,000}", "1", 0.0, "wrong answer"),
    (r"\boxed{1,\,000}", r"\{0, 1\}", 0.0, "wrong answer"),  # scored 1 before
    (r"\boxed{12,\thinspace 345,\,678.9}", "12345678.9", 1.0, "correct"),
    (r"\boxed{12,\thinspace 345,\,678.9}", "12345678", 0.0, "wrong answer"),
    (r"\boxed{-\$1,\,000}", "-1000", 1.0, "correct"),
    (r"\boxed{1000000}", r"1,\,000,\,000", 1.0, "correct"),  # the ground truth is normalised too
    (r"\boxed{1000}", r"1,\,000,\,000", 0.0, "wrong answer"),
    (r"\boxed{(1,\,2)}", "(1,2)", 1.0, "correct"),  # a tuple's spacing stays a tuple
    (r"\boxed{(1,\,2)}", "12", 0.0, "wrong answer"),
    (r"\boxed{(1,\,000)}", "(1,0)", 1.0, "correct"),  # in brackets a pair, as math-verify reads (1,000)
    (r"\boxed{(1,\,000)}", "1000", 0.0, "wrong answer"),
    (r"\boxed{1,\,2345}", "12345", 0.0, "wrong answer"),  # not a group of three: a list
    (r"\boxed{0,\,100}", r"\{0, 100\}", 1.0, "correct"),  # no thousands start with 0: a list, not 0.1
    (r"\boxed{0,\,100}", "0.1", 0.0, "wrong answer"),
    (r"\boxed{1, 000}", "1000", 0.0, "wrong answer"),  # a plain space after a comma separates, as in math-verify
    # repeating decimals, graded as the exact fraction (math-verify alone: unparsable, or 0.1(6) = 0.1*6)
    (r"\boxed{0.\overline{3}}", r"\frac{1}{3}", 1.0, "correct"),
    (r"\boxed{0.\overline{3}}", "0.3", 0.0, "wrong answer"),
    (r"\boxed{1.2\overline{45}}", r"\frac{137}{110}", 1.0, "correct"),
    (r"\boxed{1.2\overline{45}}", "1.245", 0.0, "wrong answer"),
    (r"\boxed{-.\bar 6}", r"-\frac{2}{3}", 1.0, "correct"),
    (r"\boxed{0.(3)}", r"\frac{1}{3}", 1.0, "correct"),
    (r"\boxed{0.(3)}", "0.3", 0.0, "wrong answer"),
    (r"\boxed{0.1(6)}", r"\frac{1}{6}", 1.0, "correct"),
    (r"\boxed{0.1(6)}", "0.6", 0.0, "wrong answer"),  # scored 1 before: 0.1*6
    (r"\boxed{0.1\dot{6}}", r"\frac{1}{6}", 1.0, "correct"),
    (r"\boxed{0.1\dot{6}}", "0.16", 0.0, "wrong answer"),
    (r"\boxed{0.\dot{1}4\dot{2}}", r"\frac{142}{999}", 1.0, "correct"),  # dots over a repetend's ends
    (r"\boxed{0.\dot{1}4\dot{2}}", r"\frac{1}{7}", 0.0, "wrong answer"),
    (r"\boxed{0.\overline{9}}", "1", 1.0, "correct"),
    (r"\boxed{\frac{1}{3}}", r"0.\overline{3}", 1.0, "correct"),  # a repeating ground truth
    (r"\boxed{0.3}", r"0.\overline{3}", 0.0, "wrong answer"),
    (r"\boxed{(0.5,(3))}", "(0.5,3)", 1.0, "correct"),  # a parenthesised tuple member is not a repetend
    (r"\boxed{\overline{12}}", r"\frac{4}{33}", 0.0, "wrong answer"),  # no decimal point: not a repetend
    # a trailing full stop (math-verify alone: unparsable)
    (r"\boxed{2.}", "2", 1.0, "correct"),
    (r"\boxed{3.}", "2", 0.0, "wrong answer"),
    (r"\boxed{(1,2).}", "(1,2)", 1.0, "correct"),
    (r"\boxed{(1,3).}", "(1,2)", 0.0, "wrong answer"),
    # the Unicode degree sign (math-verify alone: unparsable)
    (r"\boxed{45°}", "45", 1.0, "correct"),
    (r"\boxed{45°}", r"90^\circ", 0.0, "wrong answer"),
    # a temperature scale after a degree mark (math-verify alone: 45^\circ C is 45*C, 45°C unparsable)
    (r"\boxed{45°C}", "45", 1.0, "correct"),
    (r"\boxed{45°C}", "50", 0.0, "wrong answer"),
    (r"\boxed{45^\circ C}", "45", 1.0, "correct"),
    (r"\boxed{45^\circ C}", r"45^\circ", 1.0, "correct"),
    (r"\boxed{-5 ℃}", "-5", 1.0, "correct"),  # the one-character Celsius sign
    (r"\boxed{-5 ℃}", "5", 0.0, "wrong answer"),
    (r"\boxed{98.6^{\circ}F}", "98.6", 1.0, "correct"),
    (r"\boxed{98.6^{\circ}F}", "98", 0.0, "wrong answer"),
    (r"\boxed{45\degree C}", "45", 1.0, "correct"),  # gensymb's \degree (math-verify alone: unparsable)
    (r"\boxed{45\degree}", "45", 1.0, "correct"),
    (r"\boxed{45\degree}", "54", 0.0, "wrong answer"),
    (r"\boxed{(20°C, 25°C)}", "(20, 25)", 1.0, "correct"),  # not only at the end
    (r"\boxed{(20°C, 25°C)}", "(20, 30)", 0.0, "wrong answer"),
    (r"\boxed{45}", "45°C", 1.0, "correct"),  # the ground truth is normalised too
    (r"\boxed{40}", r"45^\circ\mathrm{C}", 0.0, "wrong answer"),
    (r"\boxed{45^\circ Cx}", "45", 0.0, "wrong answer"),  # a word or a symbol, not a scale: left alone
    (r"\boxed{45^\circ C_1}", "45", 0.0, "wrong answer"),
    (r"\boxed{273 K}", "273", 0.0, "wrong answer"),  # no degree mark: K is a variable
    (r"\boxed{45°N}", "45", 0.0, "wrong answer"),  # a bearing's N, E, S, W is not dropped
    # \varnothing (math-verify alone: not equal to \emptyset)
    (r"\boxed{\varnothing}", r"\emptyset", 1.0, "correct"),
    (r"\boxed{\emptyset}", r"\varnothing", 1.0, "correct"),
    (r"\boxed{\varnothing}", r"\{0\}", 0.0, "wrong answer"),
    # spacing before \% (math-verify alone: unparsable)
    (r"\boxed{5\,\%}", "5", 1.0, "correct"),
    (r"\boxed{5\,\%}", "50", 0.0, "wrong answer"),
    # ordinals (math-verify alone: 5^{\text{th}} unparsable, 5^{th} = 5^(t*h), 2nd = 2*n*d)
    (r"\boxed{5^{\text{th}}}", "5", 1.0, "correct"),
    (r"\boxed{5^{\text{th}}}", "6", 0.0, "wrong answer"),
    (r"\boxed{21^\text{st}}", "21", 1.0, "correct"),
    (r"\boxed{21^\text{st}}", "1", 0.0, "wrong answer"),
    (r"\boxed{3^{\rm rd}}", "3", 1.0, "correct"),
    (r"\boxed{12^{\mathrm{th}}}", "12", 1.0, "correct"),
    (r"\boxed{5^{th}}", "5", 1.0, "correct"),
    (r"\boxed{5^{th}}", "1", 0.0, "wrong answer"),  # was 5^(t*h)
    (r"\boxed{4\textsuperscript{th}}", "4", 1.0, "correct"),
    (r"\boxed{2nd}", "2", 1.0, "correct"),
    (r"\boxed{2nd}", "3", 0.0, "wrong answer"),
    (r"\boxed{22nd}", "22", 1.0, "correct"),
    (r"\boxed{\text{101st}}", "101", 1.0, "correct"),
    (r"\boxed{\text{101st}}", "11", 0.0, "wrong answer"),
    (r"\boxed{(1^{\text{st}}, 3^{\text{rd}})}", "(1, 3)", 1.0, "correct"),
    (r"\boxed{(1^{\text{st}}, 3^{\text{rd}})}", "(1, 2)", 0.0, "wrong answer"),
    (r"\boxed{7}", r"7^{\text{th}}", 1.0, "correct"),  # the ground truth is normalised too
    (r"\boxed{8}", r"7^{\text{th}}", 0.0, "wrong answer"),
    (r"\boxed{12nd}", "12", 0.0, "wrong answer"),  # not 12's suffix: left alone (12*n*d)
    (r"\boxed{21^{\text{th}}}", "21", 0.0, "unparsable"),
    (r"\boxed{2a+2nd}", "2a", 0.0, "wrong answer"),  # a bare suffix inside an expression is a product
    (r"\boxed{2a+2nd}", "2nd+2a", 1.0, "correct"),
    (r"\boxed{2.5^{th}}", "2.5", 0.0, "wrong answer"),  # a decimal has no ordinal
    (r"\boxed{n^{th}}", "n", 0.0, "wrong answer"),  # nor a letter
    # infinity in words or in \text{} (math-verify alone: the symbol "infty", a product of letters, or unparsable)
    (r"\boxed{\text{infinity}}", r"\infty", 1.0, "correct"),
    (r"\boxed{\text{infinity}}", r"-\infty", 0.0, "wrong answer"),
    (r"\boxed{\text{Infinity}}", r"\infty", 1.0, "correct"),
    (r"\boxed{\mathrm{\infty}}", r"\infty", 1.0, "correct"),
    (r"\boxed{-\text{infinity}}", r"-\infty", 1.0, "correct"),  # unparsable before
    (r"\boxed{-\text{infinity}}", r"\infty", 0.0, "wrong answer"),
    (r"\boxed{\text{-infinity}}", r"-\infty", 1.0, "correct"),
    (r"\boxed{\text{negative infinity}}", r"-\infty", 1.0, "correct"),
    (r"\boxed{\text{negative infinity}}", r"\infty", 0.0, "wrong answer"),
    (r"\boxed{Infinity}", r"\infty", 1.0, "correct"),
    (r"\boxed{-Infinity}", r"\infty", 0.0, "wrong answer"),
    (r"\boxed{\infin}", r"\infty", 1.0, "correct"),  # KaTeX's alias
    (r"\boxed{(-\text{infinity}, 2)}", r"(-\infty, 2)", 1.0, "correct"),
    (r"\boxed{(-\text{infinity}, 2)}", r"(-\infty, 2]", 0.0, "wrong answer"),
    (r"\boxed{\infty}", r"\text{infinity}", 1.0, "correct"),  # the ground truth is normalised too
    (r"\boxed{-\infty}", r"\text{infinity}", 0.0, "wrong answer"),
    (r"\boxed{\text{infinitely many}}", r"\infty", 0.0, "wrong answer"),  # a count in words: not read
    (r"\boxed{\text{inf}}", r"\infty", 1.0, "correct"),  # as math-verify reads a bare inf
    (r"\boxed{\text{-inf}}", r"\infty", 0.0, "wrong answer"),
    (r"\boxed{\inf}", r"\infty", 0.0, "unparsable"),  # LaTeX's infimum operator: not read
    (r"\boxed{Infinityx}", r"\infty", 0.0, "wrong answer"),  # a longer word
    # plain-text Unicode math (math-verify alone: unparsable)
    (r"\boxed{√12}", r"2\sqrt{3}", 1.0, "correct"),  # the radical covers the whole number, not \sqrt{1}2
    (r"\boxed{√12}", "2", 0.0, "wrong answer"),
    (r"\boxed{2√3}", r"\sqrt{12}", 1.0, "correct"),
    (r"\boxed{2√3}", r"\sqrt{6}", 0.0, "wrong answer"),
    (r"\boxed{√(x+1)}", r"\sqrt{x+1}", 1.0, "correct"),
    (r"\boxed{√(x+1)}", r"\sqrt{x}+1", 0.0, "wrong answer"),
    (r"\boxed{√3/2}", r"\frac{\sqrt{3}}{2}", 1.0, "correct"),
    (r"\boxed{√(2+√4)}", "2", 1.0, "correct"),  # nested
    (r"\boxed{√(2+√4)}", r"\sqrt{2}+2", 0.0, "wrong answer"),
    (r"\boxed{∛8}", "2", 1.0, "correct"),
    (r"\boxed{∛8}", r"\sqrt{8}", 0.0, "wrong answer"),
    (r"\boxed{\sqrt{2}}", "√2", 1.0, "correct"),  # a Unicode ground truth
    (r"\boxed{2}", "√2", 0.0, "wrong answer"),
    (r"\boxed{½}", "0.5", 1.0, "correct"),
    (r"\boxed{½}", "2", 0.0, "wrong answer"),
    (r"\boxed{⅔}", r"\frac{2}{3}", 1.0, "correct"),
    (r"\boxed{⅔}", r"\frac{3}{2}", 0.0, "wrong answer"),
    (r"\boxed{3½}", r"\frac{7}{2}", 1.0, "correct"),  # a mixed number
    (r"\boxed{3½}", "1.5", 0.0, "wrong answer"),  # not 3 * 1/2
    (r"\boxed{-2¾}", "-2.75", 1.0, "correct"),
    (r"\boxed{x^½}", r"\sqrt{x}", 1.0, "correct"),
    (r"\boxed{1⁄4}", "0.25", 1.0, "correct"),  # the fraction slash
    (r"\boxed{3·4}", "12", 1.0, "correct"),  # the middle dot multiplies
    (r"\boxed{3·4}", "3.4", 0.0, "wrong answer"),
    (r"\boxed{x²+1}", "x^2+1", 1.0, "correct"),
    (r"\boxed{x²+1}", "2x+1", 0.0, "wrong answer"),
    (r"\boxed{2×10³}", "2000", 1.0, "correct"),
    (r"\boxed{2×10³}", "60", 0.0, "wrong answer"),
    (r"\boxed{10⁻²}", "0.01", 1.0, "correct"),
    (r"\boxed{x¹⁰}", "x^{10}", 1.0, "correct"),
    (r"\boxed{\log₂ 8}", "3", 1.0, "correct"),
    (r"\boxed{a₁₀}", "a_{10}", 1.0, "correct"),
    (r"\boxed{a₁₀}", "a_{1}", 0.0, "wrong answer"),
    (r"\boxed{(−∞, 2]}", r"(-\infty, 2]", 1.0, "correct"),
    (r"\boxed{(-\infty, 2]}", "(−∞, 2]", 1.0, "correct"),
    (r"\boxed{∞}", r"-\infty", 0.0, "wrong answer"),
    (r"\boxed{(−∞, 2]}", r"(-\infty, 2)", 0.0, "wrong answer"),
]

# Unicode math-verify reads itself (left to it, pinned here): each right form scores 1, a wrong one 0.
UNICODE_READ_BY_MATH_VERIFY = [
    (r"\boxed{3×4}", "12", 1.0, "correct"),
    (r"\boxed{3×4}", "7", 0.0, "wrong answer"),
    (r"\boxed{12÷4}", "3", 1.0, "correct"),
    (r"\boxed{−5}", "-5", 1.0, "correct"),  # U+2212 minus sign
    (r"\boxed{5}", "−5", 0.0, "wrong answer"),
    (r"\boxed{2⋅3}", "6", 1.0, "correct"),  # U+22C5 dot operator
    (r"\boxed{2π}", r"2\pi", 1.0, "correct"),
    (r"\boxed{2π}", "6.28", 0.0, "wrong answer"),
    (r"\boxed{x≥3}", r"x\ge 3", 1.0, "correct"),
    (r"\boxed{x≥3}", r"x\le 3", 0.0, "wrong answer"),
    (r"\boxed{[1,2]∪[3,4]}", r"[1,2]\cup[3,4]", 1.0, "correct"),
    (r"\boxed{∅}", r"\emptyset", 1.0, "correct"),
    (r"\boxed{±2}", r"\pm 2", 1.0, "correct"),
]

# (response, gt_answer, score, reason); a well-formed wrong answer earns the 0.1 format score.
TAGS_TABLE = [
    ("<think>1 + 1 is 2</think><answer>2</answer>", "2", 1.0, "correct"),
    ("\n<think>\nhalf of one\n</think>\n\n<answer> 0.5 </answer>\n", r"\frac{1}{2}", 1.0, "correct"),
    (r"<think>...</think><answer>\boxed{\frac{1}{2}}</answer>", "0.5", 1.0, "correct"),
    (r"<think>...</think><answer>\boxed{1} or rather \boxed{2}</answer>", "2", 1.0, "correct"),
    (r"<think>...</think><answer>5\text{ cm}</answer>", "5", 1.0, "correct"),
    ("<think>...</think><answer>The answer is 5</answer>", "5", 0.1, "wrong answer"),  # prose: letter symbols
    ("<think>...</think><answer>3</answer>", "2", 0.1, "wrong answer"),
    ("<think>...</think><answer></answer>", "2", 0.1, "unparsable"),
    ("<think>...</think><answer>2</answer>", "", 0.1, "bad gt_answer"),
    # no answer block at all
    ("The answer is 2.", "2", 0.0, "no answer tags"),
    ("<think>it is 2</think>", "2", 0.0, "no answer tags"),
    ("<think>...</think><answer>2", "2", 0.0, "no answer tags"),  # truncated
    # answer present but the format is broken: a right answer still scores 0
    ("<answer>2</answer>", "2", 0.0, "bad format"),
    ("<think>...</think><answer>1</answer><answer>2</answer>", "2", 0.0, "bad format"),
    ("<think>a</think><think>b</think><answer>2</answer>", "2", 0.0, "bad format"),
    ("<answer>2</answer><think>...</think>", "2", 0.0, "bad format"),
    ("<think>...</think> so <answer>2</answer>", "2", 0.0, "bad format"),
    ("<think>...</think><answer>2</answer> Hope this helps!", "2", 0.0, "bad format"),
    ("Sure! <think>...</think><answer>2</answer>", "2", 0.0, "bad format"),
    ("<think>...<answer>2</answer></think><answer>2</answer>", "2", 0.0, "bad format"),
]


def _ids(table):
    return [f"{i}:{response[:40]}|{gt}" for i, (response, gt, _, _) in enumerate(table)]


@pytest.mark.parametrize("response,gt,score,reason", BOXED_TABLE, ids=_ids(BOXED_TABLE))
def test_boxed(response, gt, score, reason):
    assert boxed(response, {"gt_answer": gt}) == math_rewards.RewardOutput(score, reason)


@pytest.mark.parametrize("response,gt,score,reason", NORMALISED_TABLE, ids=_ids(NORMALISED_TABLE))
def test_normalised_forms(response, gt, score, reason):
    assert boxed(response, {"gt_answer": gt}) == math_rewards.RewardOutput(score, reason)


@pytest.mark.parametrize("response,gt,score,reason", UNICODE_READ_BY_MATH_VERIFY,
                         ids=_ids(UNICODE_READ_BY_MATH_VERIFY))
def test_unicode_read_by_math_verify(response, gt, score, reason):
    assert boxed(response, {"gt_answer": gt}) == math_rewards.RewardOutput(score, reason)


@pytest.mark.parametrize("sep", [r"\,", r"\ ", r"\!", "~", "{,}", r"\;", r"\:", r"\>", r"\thinspace ", " ", r"\, "])
def test_digit_group_separators(sep):
    """Every spacing form between thousands groups reads as one number, on either side."""
    number = f"1{sep}234{sep}567"
    assert boxed(f"\\boxed{{{number}}}", {"gt_answer": "1234567"}) == math_rewards.RewardOutput(1.0, "correct")
    assert boxed(f"\\boxed{{{number}}}", {"gt_answer": "1234"}) == math_rewards.RewardOutput(0.0, "wrong answer")
    assert boxed("\\boxed{1234567}", {"gt_answer": number}) == math_rewards.RewardOutput(1.0, "correct")


@pytest.mark.parametrize("response,gt,score,reason", TAGS_TABLE, ids=_ids(TAGS_TABLE))
def test_think_answer_tags(response, gt, score, reason):
    assert tags(response, {"gt_answer": gt}) == math_rewards.RewardOutput(score, reason)


def test_registered_with_system_prompts():
    prompt = get_reward("boxed").system_prompt
    assert prompt == "Please reason step by step, and put your final answer within \\boxed{}."
    prompt = get_reward("think_answer_tags").system_prompt
    assert "<think>" in prompt and "<answer>" in prompt


def test_factories_set_the_score_convention():
    reward = math_rewards.make_boxed_reward(correct_score=2.0, format_score=0.25)
    assert reward(r"\boxed{4}", {"gt_answer": "4"}).score == 2.0
    assert reward(r"\boxed{3}", {"gt_answer": "4"}).score == 0.25
    assert reward("4", {"gt_answer": "4"}).score == 0.0
    reward = math_rewards.make_think_answer_reward(format_score=0.0)
    assert reward("<think></think><answer>3</answer>", {"gt_answer": "4"}).score == 0.0


def test_worker_threads_score_like_the_main_thread():
    """From a ThreadPoolExecutor (no SIGALRM there) the verdicts come from helper processes: same table."""
    rows = BOXED_TABLE[::4] + NORMALISED_TABLE + TAGS_TABLE[::4]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda r: (tags if r in TAGS_TABLE else boxed)(r[0], {"gt_answer": r[1]}), rows))
    assert [(out.score, out.reason) for out in results] == [(score, reason) for _, _, score, reason in rows]


HANG = r"\boxed{9^{9^{9^{9}}}}"  # sympy would compare this to 5 for ever


def test_timeout_in_main_thread_restores_outer_timer(monkeypatch):
    monkeypatch.setattr(math_rewards, "MATH_VERIFY_TIMEOUT_S", 0.5)
    handler = signal.getsignal(signal.SIGALRM)
    signal.setitimer(signal.ITIMER_REAL, 30)  # an outer timer (a test harness, the code reward, ...)
    try:
        # Our timeout fired (a hang would end at the outer timer, whose default SIGALRM kills the process)
        assert boxed(HANG, {"gt_answer": "5"}) == math_rewards.RewardOutput(0.0, math_rewards.GRADING_TIMEOUT)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining < 30  # the outer timer is armed again, with what was left of it
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_timeout_in_worker_thread(monkeypatch):
    monkeypatch.setattr(math_rewards, "MATH_VERIFY_TIMEOUT_S", 0.5)
    with ThreadPoolExecutor(max_workers=1) as pool:
        out = pool.submit(boxed, HANG, {"gt_answer": "5"}).result(timeout=120)  # a hang guard only
    assert out == math_rewards.RewardOutput(0.0, math_rewards.GRADING_TIMEOUT)


def test_overrunning_helper_is_killed_and_replaced():
    """A helper that overruns its wait (C code deaf to its own alarm) is killed; the next call gets a new one."""
    assert threading.current_thread() is threading.main_thread()
    verdict = math_rewards._judge_in_helper(HANG[7:-1], "5", seconds=60, wait=1.0)
    assert verdict == math_rewards.GRADING_TIMEOUT
    assert all(helper.alive for helper in math_rewards._ALL_HELPERS)
    assert math_rewards._judge_in_helper("4", "4", seconds=5) == "correct"
