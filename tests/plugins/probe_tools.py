"""--external-plugins file of tests/test_multiturn.py: a tool-call parser and a tool that drive episodes on a
model that never writes a tool call by itself (the tiny test model: random-ish text).

`always_probe` (--tool-parser) reads every assistant turn as one call of `probe` with no arguments, so each
episode runs to --max-turns, its turns the engine's real continuations after real tool messages. `probe`
answers from its call's context (megarl.tools.current_call): what the row's "probe" field asks for its
first-turn call ("slow": wait until RELEASE is set, at most 50 s; "raise"),
otherwise a short text naming the episode and turn. `probe_user` (an interaction) drives user turns."""

import threading

from megarl.registry import register
from megarl.tools import TOOL_PARSERS, ToolCall, current_call, register_tool
from megarl.tools.interactions import INTERACTIONS, register_interaction

RELEASE = threading.Event()


@register(TOOL_PARSERS, "always_probe")
def always_probe(text: str) -> list:
    return [ToolCall("probe", {})]


@register_tool("probe", "Answer with the episode's name.", {"type": "object", "properties": {}})
def probe() -> str:
    call = current_call()
    behaviour = call.row.get("probe", "ok") if call.turn == 1 else "ok"
    if behaviour == "slow":
        RELEASE.wait(50)
    elif behaviour == "raise":
        raise RuntimeError("probe failed on purpose")
    return f"probe {call.prompt_index}.{call.sample}.{call.turn}"


@register_interaction("probe_user")
def probe_user(reward):
    """A user who answers from the row's "user" field: "hang" sleeps past any short --tool-timeout (its
    episode ends, counted), "raise" raises, "end" ends the episode; otherwise the built-in `retry`."""
    retry = INTERACTIONS["retry"](reward)

    def respond(turns, context):
        behaviour = context.row.get("user")
        if behaviour == "hang":
            RELEASE.wait(20)
        elif behaviour == "raise":
            raise RuntimeError("the user left")
        elif behaviour == "end":
            return None
        return retry(turns, context)
    return respond
