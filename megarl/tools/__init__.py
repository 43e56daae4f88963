"""Tools a policy calls inside its episode (megarl/multiturn.py runs the episodes).

A tool is a registered function with an OpenAI-style JSON schema: `@register_tool(name, description,
parameters)` puts it in TOOLS (plugins, `--external-plugins`, register more the same way); `--tools a,b`
enables some for a run, and a dataset row's `tools` field (a list of names) picks which of those its
prompt gets. The enabled tools' schemas (`Tool.schema`) go to the chat template as `tools=`.

A tool call is parsed from an assistant turn by a TOOL_PARSERS entry (`--tool-parser`, default "hermes":
Qwen2.5 / Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks). Calling it
(`ToolRunner`): the arguments are checked against the schema, the function runs on a worker thread with
`**arguments` and returns a string (or anything `str()` makes one of), cut at MAX_RESULT_CHARS. Every
failure becomes the tool message's text instead, "error: ...", and the episode goes on: malformed JSON,
an unknown or not-enabled tool, wrong arguments, a tool that raises, a tool still running at
--tool-timeout (its thread is abandoned: a Python thread cannot be killed, so a tool must bound its own
work; the built-in `python` runs in the code reward's sandbox, which kills the program at its limits).
`ToolResult.error` names the failure's kind (ERROR_KINDS), which the metrics count per tool.

A tool that wants its episode's context (the dataset row, the prompt and sample index, the turn) reads
`current_call()` while it runs.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from megarl.registry import Registry, register

MAX_RESULT_CHARS = 4000  # a tool's text beyond this is cut (the episode's token budget bounds it as well)
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")
# Calls that name no registered, enabled tool are counted under these names (a model's invented tool
# names would otherwise make a metric each).
MALFORMED, UNKNOWN = "malformed", "unknown"
# An interaction's reply (megarl/tools/interactions.py) comes back through the same runner under this name.
INTERACTION = "interaction"
RESERVED = (MALFORMED, UNKNOWN, INTERACTION)


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": {...}, "required": [...]}

    def schema(self) -> dict:
        """The OpenAI function-tool schema the chat template lists."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS = Registry("tool")  # name -> Tool


def register_tool(name: str, description: str, parameters: dict):
    """Decorator: register `fn(**arguments) -> str` as the tool `name`."""
    if parameters.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema of type 'object'")
    if name in RESERVED:
        raise ValueError(f"tool {name!r}: the name is reserved ({', '.join(RESERVED)} count failures and replies)")

    def wrap(fn):
        TOOLS.add(name, Tool(name, fn, description, parameters))
        return fn
    return wrap


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class BadCall:
    """A tool call that could not be parsed: the error goes back to the model as the tool message."""
    error: str


TOOL_PARSERS = Registry("tool-call parser")  # name -> fn(assistant text) -> [ToolCall | BadCall]
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register(TOOL_PARSERS, "hermes")
def parse_hermes(text: str) -> list:
    """Qwen2.5 / Hermes tool calls: each `<tool_call>` JSON `</tool_call>` block of the turn, in order (an
    unclosed last block up to the end of the turn)."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(BadCall(f"malformed tool call: invalid JSON ({error.msg} at char {error.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(BadCall('malformed tool call: expected {"name": ..., "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(BadCall(f"malformed tool call: 'arguments' of {value['name']!r} must be an object"))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def argument_error(tool: Tool, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's schema (required, unknown and wrongly typed properties), or
    None. Only the top level: what a function signature needs."""
    properties = tool.parameters.get("properties", {})
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} (takes {', '.join(properties) or 'none'})"
    for name, value in arguments.items():
        kind = properties[name].get("type")
        expected = _JSON_TYPES.get(kind)
        if expected is None:
            continue
        if isinstance(value, bool) and kind in ("integer", "number") or not isinstance(value, expected):
            return f"argument {name!r} must be {kind}, got {type(value).__name__}"
    return None


def row_tools(value, enabled: list[str], where: str = "row") -> list[str]:
    """The tools a dataset row's `tools` field gives its prompt, among the run's `enabled` ones: a list of
    tool names or of OpenAI schemas (ms-swift's layout, also as a JSON string); None or absent: all of
    `enabled`. ValueError (one line) for anything else, or a tool the run did not enable."""
    if value is None:
        return list(enabled)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [name.strip() for name in value.split(",") if name.strip()]
    if not isinstance(value, list):
        raise ValueError(f"{where}: field 'tools' must be a list of tool names or schemas, got {type(value).__name__}")
    names = []
    for item in value:
        if isinstance(item, dict):
            item = (item.get("function") or item).get("name")
        if not isinstance(item, str):
            raise ValueError(f"{where}: field 'tools' must be a list of tool names or schemas, got an entry {item!r}")
        names.append(item)
    missing = [name for name in names if name not in enabled]
    if missing:
        raise ValueError(f"{where}: field 'tools' names {', '.join(missing)}, not enabled by --tools "
                         f"({', '.join(enabled) or 'none'})")
    return names


def tool_schemas(names: list[str]) -> list[dict] | None:
    """The chat template's `tools=` for these tool names (None for none: the template lists nothing)."""
    return [TOOLS[name].schema() for name in names] or None


@dataclass(frozen=True)
class CallContext:
    """What a tool may read about the call it serves (`current_call()`)."""
    row: dict
    prompt_index: int
    sample: int  # the episode's index among its prompt's samples
    turn: int  # 1 for the calls of the first assistant turn


_CONTEXT: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("megarl_tool_call", default=None)


def current_call() -> CallContext | None:
    """The episode context of the tool call running in this thread (None outside one)."""
    return _CONTEXT.get()


@dataclass
class ToolResult:
    name: str  # the tool's name, MALFORMED / UNKNOWN when the call named none that is enabled, or INTERACTION
    content: str | None  # what the model reads as the tool message (an interaction's reply: None ends the episode)
    error: str | None = None  # one of ERROR_KINDS, None when the tool answered
    seconds: float = 0.0


@dataclass
class _Running:
    call: ToolCall
    future: Future
    started: list = field(default_factory=list)  # [perf_counter at start], filled by the worker thread


class ToolRunner:
    """Runs the tool calls of many episodes at once on `workers` threads: `start` returns at once, `poll`
    gives the calls that are done (answered, failed, or past `timeout` seconds since they started)."""

    def __init__(self, names: list[str], workers: int, timeout: float):
        unknown = [name for name in names if name not in TOOLS]
        if unknown:
            raise ValueError(f"--tools: unknown tool(s) {', '.join(unknown)} (registered: {', '.join(sorted(TOOLS))})")
        self.enabled = {name: TOOLS[name] for name in names}
        self.timeout = timeout
        self.executor = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="megarl-tool")
        self._lock = threading.Lock()

    def start(self, call, context: CallContext, allowed: list[str] | None = None):
        """Begin one parsed call (a ToolCall or BadCall) for the episode `context`: a ToolResult now when it
        fails before running, else a handle for `result`. `allowed`: the tools this episode was given
        (its row's `tools`), default every enabled one."""
        if isinstance(call, BadCall):
            return ToolResult(MALFORMED, f"error: {call.error}", "malformed")
        allowed = self.enabled if allowed is None else allowed
        tool = self.enabled.get(call.name) if call.name in allowed else None
        if tool is None:
            return ToolResult(UNKNOWN, f"error: unknown tool {call.name!r} (available: "
                                       f"{', '.join(sorted(allowed)) or 'none'})", "unknown_tool")
        problem = argument_error(tool, call.arguments)
        if problem:
            return ToolResult(tool.name, f"error: {tool.name}: {problem}", "bad_arguments")
        running = _Running(call, None)
        running.future = self.executor.submit(self._run, lambda: tool.function(**call.arguments), context,
                                              running.started)
        return running

    def start_reply(self, respond: Callable, turns: list[dict], context: CallContext) -> _Running:
        """Ask an interaction for the user's reply to the episode `turns` on a worker thread; `result` gives
        it as a ToolResult named INTERACTION, under the same timeout as a tool."""
        running = _Running(ToolCall(INTERACTION, {}), None)
        turns = [dict(m) for m in turns]  # the episode goes on appending to its own
        running.future = self.executor.submit(self._run, lambda: respond(turns, context), context, running.started)
        return running

    @staticmethod
    def _run(call: Callable, context: CallContext, started: list):
        started.append(time.perf_counter())
        token = _CONTEXT.set(context)
        try:
            return call()
        finally:
            _CONTEXT.reset(token)

    def result(self, running) -> ToolResult | None:
        """The call's ToolResult when it is done or past the timeout, else None."""
        if isinstance(running, ToolResult):
            return running
        name = running.call.name
        if running.future.done():
            seconds = time.perf_counter() - running.started[0]
            error = running.future.exception()
            if error is not None:
                return ToolResult(name, f"error: {name} raised {type(error).__name__}: {str(error)[:500]}", "raised",
                                  seconds)
            value = running.future.result()
            if name == INTERACTION and value is None:
                return ToolResult(name, None, None, seconds)
            if name == INTERACTION and not isinstance(value, str):  # a Continue (tools/interactions.py)
                return ToolResult(name, value, None, seconds)
            text = str(value)
            if len(text) > MAX_RESULT_CHARS:
                text = text[:MAX_RESULT_CHARS] + f"\n... ({len(text) - MAX_RESULT_CHARS} more characters cut)"
            return ToolResult(name, text, None, seconds)
        if running.started and time.perf_counter() - running.started[0] > self.timeout:
            running.future.cancel()
            return ToolResult(name, f"error: {name} timed out after {self.timeout:g} s", "timeout", self.timeout)
        return None

    def close(self) -> None:
        """Stop taking calls; threads still inside a timed-out tool are left to finish on their own."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def tool_metrics(samples) -> dict:
    """The step's tool metrics from its episodes' traces (Sample.turns): turns per episode, the policy's and
    the tools' tokens per episode, tool calls and errors per tool (and per error kind), the tools' seconds.
    {} when no sample is an episode with tools."""
    episodes = [s.turns for s in samples if s.turns is not None]
    if not episodes:
        return {}
    metrics = {"turns_mean": sum(sum(m["role"] == "assistant" for m in t) for t in episodes) / len(episodes)}
    # The response length counts both; these say how much of it the policy wrote (what trains).
    masks = [s.policy_mask for s in samples if s.turns is not None and s.policy_mask is not None]
    if masks:
        metrics["policy_tokens_mean"] = sum(sum(m) for m in masks) / len(masks)
        metrics["tool_tokens_mean"] = sum(len(m) - sum(m) for m in masks) / len(masks)
    calls = [m for t in episodes for m in t if m["role"] == "tool"]
    metrics["tool_calls_per_episode"] = len(calls) / len(episodes)
    metrics["tool_seconds_total"] = sum(m.get("seconds", 0.0) for m in calls)
    for name in sorted({m["name"] for m in calls}):
        mine = [m for m in calls if m["name"] == name]
        metrics[f"tool_calls_{name}"] = len(mine)
        metrics[f"tool_errors_{name}"] = sum(m["error"] is not None for m in mine)
    for kind in ERROR_KINDS:
        metrics[f"tool_errors_{kind}"] = sum(m["error"] == kind for m in calls)
    # An environment's user turns (--interaction), and its replies that failed (raised or timed out).
    failed = [m for t in episodes for m in t if m.get("interaction_error")]
    users = [m for t in episodes for m in t if m["role"] == "user"]
    if users or failed:
        metrics["user_turns_per_episode"] = len(users) / len(episodes)
        metrics["interaction_errors"] = len(failed)
    return metrics


from megarl.tools import builtin, interactions  # noqa: E402,F401 - registers the built-in tools and interactions
