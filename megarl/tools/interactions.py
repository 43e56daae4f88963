"""Environments that answer: after an assistant turn that calls no tool, an interaction may reply as the
user, and the episode goes on with that user turn (verl's multi-turn `interaction`, whose GSM8K example
tells the model its answer is wrong and asks it to try again).

An interaction is registered under a name (`@register_interaction(name)`, plugins register more the same
way) as a factory `factory(reward) -> respond`, where `reward` is the run's RewardSpec (--reward), and
`respond(turns, context) -> str | Continue | None` gets the episode's conversation after the prompt
(Sample.turns: assistant turns with their parsed tool calls, tool and user messages) and the episode's
CallContext (its dataset row, prompt and sample index, the turn just ended); it returns the user's reply, a
Continue (the assistant's turn goes on after a text of the environment's), or None to end the episode. `--interaction NAME` enables one for a run. It runs on the ToolRunner's threads beside
generation, under --tool-timeout like a tool; one that raises or runs past the timeout ends its episode
and is counted (`interaction_errors`). The user's tokens, like the tools', are not the policy's: they
carry policy mask 0 (no gradient, no loss, no KL, no mismatch). At --max-turns assistant turns the
episode ends without asking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megarl.registry import Registry

# name -> factory(reward spec) -> respond(turns, context) -> str | None. The gym environments add theirs as
# gym:<name> when megarl/tools/environments.py is imported (it imports this module, so not the other way).
INTERACTIONS = Registry("interaction")

# verl's GSM8K interaction says as much; the arithmetic task's tiny model reads any text as the user's.
RETRY_MESSAGE = "Your answer is incorrect. Please reflect on it and try again."


@dataclass(frozen=True)
class Continue:
    """A reply that continues the assistant's own turn instead of answering it as the user (ms-swift's
    math_tip_trick): the turn is cut before the first of the `cut_before` strings in its text, its end-of-turn
    dropped, `text` appended in the assistant's voice (policy mask 0: not the policy's tokens), and the model
    generates on from there in the same turn (megarl/multiturn.py, `continue_turn`)."""
    text: str
    cut_before: tuple[str, ...] = ()


def register_interaction(name: str):
    """Decorator: register `factory(reward) -> respond(turns, context) -> str | None` as `name`."""
    def wrap(factory: Callable):
        INTERACTIONS.add(name, factory)
        return factory
    return wrap


def last_answer(turns: list[dict]) -> str:
    """The content of the episode's last assistant turn ("" before any)."""
    return next((m["content"] for m in reversed(turns) if m["role"] == "assistant"), "")


def _ask_again_while_wrong(reward, message: str, times: int | None):
    """`respond` that scores the last assistant turn with `reward` against the prompt's row and, below 1.0
    (what megarl's answer-checking rewards give a correct answer), replies `message`, at most `times`
    times (None: until --max-turns)."""
    from megarl.rewards import score_all

    def respond(turns: list[dict], context) -> str | None:
        asked = sum(1 for m in turns if m["role"] == "user" and m["content"] == message)
        if times is not None and asked >= times:
            return None
        row = {**context.row, "conversation": turns}  # what a reward reads of an episode (scoring.reward_row)
        output = score_all(reward, [last_answer(turns)], [row])[0]
        return None if output.score >= 1.0 else message
    return respond


@register_interaction("retry")
def retry(reward):
    """Until the answer is right: the run's reward scores the last assistant turn against the prompt's row;
    below 1.0 the user asks for another try, at 1.0 the episode ends. The episode's reward then scores its
    last answer, as without the interaction."""
    return _ask_again_while_wrong(reward, RETRY_MESSAGE, None)


# ms-swift's MathTipsMultiTurnScheduler (swift/plugin/multi_turn.py), word for word.
SWIFT_TIP_MESSAGE = "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."


@register_interaction("math_tip_trick_multi_turn")
def math_tip_trick_multi_turn(reward):
    """ms-swift's `multi_turn_scheduler: math_tip_trick_multi_turn`: a wrong answer gets its tip as one user
    turn, once. ms-swift judges with its math accuracy reward whatever the run's reward funcs are; so
    does this (megarl's `boxed`: math-verify on the last boxed answer against the row's solution)."""
    from megarl.rewards import get_reward

    return _ask_again_while_wrong(get_reward("boxed"), SWIFT_TIP_MESSAGE, 1)


# ms-swift's MathTipsScheduler (swift/plugin/multi_turn.py): its tip and where it cuts the answer.
SWIFT_MATH_TIP = "But wait... It seems I made a mistake,"
SWIFT_MATH_TIP_CUT = ("<answer>", "</think>")


@register_interaction("math_tip_trick")
def math_tip_trick(reward):
    """ms-swift's `multi_turn_scheduler: math_tip_trick`: a wrong first answer (its math accuracy: megarl's
    `boxed` against the row's solution, as in math_tip_trick_multi_turn) is cut before its `<answer>` /
    `</think>`, ms-swift's tip is appended in the assistant's own turn (not trained: policy mask 0) and the
    model goes on in that turn; once, then the episode ends. The kept tokens stay the policy's."""
    from megarl.rewards import get_reward, score_all

    judge = get_reward("boxed")

    def respond(turns: list[dict], context):
        if any(m.get("continued") for m in turns if m["role"] == "assistant"):
            return None
        row = {**context.row, "conversation": turns}
        return None if score_all(judge, [last_answer(turns)], [row])[0].score >= 1.0 else \
            Continue(SWIFT_MATH_TIP, SWIFT_MATH_TIP_CUT)
    return respond

