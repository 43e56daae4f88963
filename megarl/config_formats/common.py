"""What the three framework readers share: the rule table, the translation record, paths.

A framework's configuration is a flat list of source keys (verl's nested YAML flattened to dotted
paths, ms-swift's role groups to `train.gpus`, ColossalChat's flags to their long names). Each key
meets one rule of its framework's table:

    map      -> one or more megarl options (values converted with that framework's semantics)
    ignore   -> no meaning in megarl (Ray, FSDP, hub settings, kernel switches): listed in one line
    refuse   -> meaningful but needs a capability megarl lacks: the run stops with one line

and a key no rule knows is a one-line error naming the file, the key and the closest known key.
Keys a framework sets by default when they are omitted are recorded as `default` rows, so that the
translation shows every value that differs from megarl's own defaults and why.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from megarl.errors import ConfigError

MAPPED, DEFAULT, IGNORED, REFUSED = "mapped", "default", "ignored", "refused"


@dataclass(frozen=True)
class Rule:
    kind: str  # MAPPED, IGNORED or REFUSED
    convert: Callable[[Any, "Context"], dict[str, Any]] | None = None  # value -> {megarl dest: value}
    reason: str = ""
    refuse_if: Callable[[Any], bool] | None = None  # a mapped/ignored key refused for some values only
    refusal: str = ""  # why, when refuse_if holds
    dest: str = ""  # the megarl option(s) it sets, for the reference tables (docs/migrating.md)

    def refusal_text(self) -> str:
        """Why a value `refuse_if` holds for is refused."""
        return self.refusal or (f"megarl supports only: {self.reason}" if self.reason else "no counterpart in megarl")


def to(dest: str, convert: Callable[[Any], Any] | None = None, note: str = "",
       refuse_if: Callable[[Any], bool] | None = None, refusal: str = "") -> Rule:
    """The key sets megarl option `dest` (its value passed through `convert`); a null value leaves megarl's
    default (every framework here uses null for "unset")."""
    return Rule(MAPPED, lambda value, ctx: {} if value is None else {dest: convert(value) if convert else value},
                note, refuse_if, refusal, dest)


def custom(fn: Callable[[Any, "Context"], dict[str, Any]], note: str = "",
           refuse_if: Callable[[Any], bool] | None = None, refusal: str = "", dest: str = "") -> Rule:
    """The key sets whatever `fn(value, context)` returns ({} when it only informs a later step)."""
    return Rule(MAPPED, fn, note, refuse_if, refusal, dest)


INFORMS = "read with the keys it qualifies"


def informs() -> Rule:
    """A key whose meaning depends on others: the framework's own post-processing maps it."""
    return Rule(MAPPED, lambda value, ctx: {}, INFORMS)


def ignore(reason: str, refuse_if: Callable[[Any], bool] | None = None, refusal: str = "") -> Rule:
    """No meaning in megarl; `refuse_if(value)`: this value would need what megarl lacks (`refusal`, else
    "megarl supports only <reason>")."""
    return Rule(IGNORED, None, reason, refuse_if, refusal)


def refuse(reason: str) -> Rule:
    return Rule(REFUSED, None, reason)


def routing_replay_mode() -> Rule:
    """A router replay mode key (ms-swift router_replay_mode, verl router_replay.mode): R3 is megarl's routing
    replay, disabled is off; R2 (routes recorded by the trainer's own forward) stops."""
    return custom(lambda v, ctx: {"routing_replay": "on"} if v == "R3" else
                  {"routing_replay": "off"} if v == "disabled" else {},
                  "R3: `routing_replay` on (the rollout's routes); disabled: off",
                  refuse_if=lambda v: v not in (None, "disabled", "R3"),
                  refusal="R2 replays routes recorded in the trainer's own old-logprob forward; megarl replays "
                          "the rollout's (R3)")


def ignore_all(reason: str, keys) -> dict[str, Rule]:
    rule = ignore(reason)
    return {key: rule for key in keys}


@dataclass
class Row:
    """One line of the import table: a source key and what became of it."""
    key: str
    value: Any
    status: str  # MAPPED, DEFAULT, IGNORED, REFUSED
    targets: dict[str, Any] = field(default_factory=dict)  # megarl dest -> value
    note: str = ""
    placeholder: bool = False  # a key read with others: replaced by the row that maps it


@dataclass
class Context:
    """The whole source config, for rules whose meaning depends on other keys."""
    source: dict[str, Any]  # flat key -> value
    where: str  # the file (or "command line") for error messages

    def get(self, key: str, default=None):
        return self.source.get(key, default)

    def fail(self, key: str, message: str):
        raise ConfigError(f"{self.where}: {key}: {message}")


@dataclass
class Translation:
    format: str  # swift | verl | colossalchat
    where: str
    values: dict[str, Any] = field(default_factory=dict)  # megarl dest -> value (YAML semantics)
    rows: list[Row] = field(default_factory=list)
    how: str = ""  # how the file was read, for the one line rank 0 prints

    def set(self, key: str, value, status: str, targets: dict[str, Any], note: str = "") -> None:
        """Record a row; a target `dest.key` sets one key of the mapping option `dest` (engine kwargs); a
        later row of a key that only informed others replaces its placeholder."""
        kept = [row for row in self.rows if not (row.key == key and row.placeholder)]
        note = "; ".join(filter(None, [note] + [row.note.removeprefix(INFORMS).lstrip("; ")
                                                for row in self.rows if row not in kept]))
        self.rows = kept
        self.rows.append(Row(key, value, status, dict(targets), note))
        for dest, item in targets.items():
            if "." in dest:  # `dest.a.b`: key a of the mapping, itself a mapping with key b (vLLM's compilation_config)
                dest, *path, leaf = dest.split(".")
                node = self.values.setdefault(dest, {})
                for part in path:
                    node = node.setdefault(part, {})
                node[leaf] = item
            else:
                self.values[dest] = item

    def refused(self) -> list[Row]:
        return [row for row in self.rows if row.status == REFUSED]

    def ignored(self) -> list[Row]:
        return [row for row in self.rows if row.status == IGNORED]

    def summary(self) -> str:
        counts = {status: sum(row.status == status for row in self.rows)
                  for status in (MAPPED, DEFAULT, IGNORED, REFUSED)}
        return (f"read {self.where} as {self.how}: {counts[MAPPED]} keys mapped, {counts[DEFAULT]} of its "
                f"defaults applied, {counts[IGNORED]} ignored")

    def ignored_line(self) -> str | None:
        rows = self.ignored()
        if not rows:
            return None
        by_reason: dict[str, list[str]] = {}
        for row in rows:
            by_reason.setdefault(row.note, []).append(row.key)
        return "ignored (no meaning in megarl): " + "; ".join(f"{', '.join(keys)} ({reason})"
                                                             for reason, keys in by_reason.items())

    def check(self) -> None:
        """A refused key stops the run: one line naming the first."""
        for row in self.refused():
            raise ConfigError(f"{self.where}: {row.key}={_short(row.value)}: {row.note}")


def _short(value) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def closest(name: str, names) -> str:
    match = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def lookup(table: dict[str, Rule], key: str) -> Rule | None:
    """The rule of `key`: its own, else that of the longest `prefix.*` entry above it."""
    if key in table:
        return table[key]
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        rule = table.get(".".join(parts[:end]) + ".*")
        if rule is not None:
            return rule
    return None


def apply_table(translation: Translation, table: dict[str, Rule], source: dict[str, Any], context: Context,
                order=None) -> None:
    """Every source key through its rule; an unknown key is one error line with the closest name."""
    known = [key for key in table if not key.endswith(".*")]
    for key in (order or source):
        value = source[key]
        rule = lookup(table, key)
        if rule is None:
            raise ConfigError(f"{context.where}: {key}: unknown {translation.how} key{closest(key, known)}")
        if rule.refuse_if is not None and rule.refuse_if(value):
            translation.set(key, value, REFUSED, {}, rule.refusal_text())
        elif rule.kind == MAPPED:
            if isinstance(value, str) and "${" in value:
                raise ConfigError(f"{context.where}: {key}: cannot resolve {value!r}")
            translation.set(key, value, MAPPED, rule.convert(value, context), rule.reason)
            translation.rows[-1].placeholder = rule.reason == INFORMS
        else:
            translation.set(key, value, rule.kind, {}, rule.reason)


def apply_defaults(translation: Translation, defaults: dict[str, tuple[Any, str]], given) -> None:
    """The framework's own default for each megarl option its keys did not set."""
    for dest, (value, why) in defaults.items():
        if dest not in translation.values and dest not in given:
            translation.set(f"({why})", value, DEFAULT, {dest: value})


_ENV = re.compile(r"\$(\w+)|\$\{([^}:]+)\}")


def expand_path(value: str, where: str = "path") -> str:
    """`~` and `$VAR` / `${VAR}` in a path, as a shell would expand them; an unset variable is an error
    (an empty expansion would silently point somewhere else)."""
    if not isinstance(value, str):
        return value

    def env(match):
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ConfigError(f"{where}: {value!r} uses ${name}, which is not set in the environment")
        return os.environ[name]

    return os.path.expanduser(_ENV.sub(env, value))


def as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (an empty mapping stays a value: `override_config: {}`)."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`; its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key '{key}' is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml_mapping(path: str, text: str) -> dict:
    """A YAML file's top-level mapping (UniqueKeyLoader); invalid YAML or another top level is one line
    naming the file (and the line)."""
    try:
        raw = yaml.load(text, Loader=UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(error, 'problem', error)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of options")
    return raw


def reference(table: dict[str, Rule], semantics: dict[str, str]) -> list[str]:
    """A Markdown table of a framework's keys: what each becomes; ignored keys grouped by reason.
    `semantics`: for keys read together with others, the megarl options they end in."""
    lines = ["| key | megarl | notes |", "|---|---|---|"]
    ignored: dict[str, list[str]] = {}
    for key, rule in table.items():
        when = f"other values refused: {rule.refusal_text()}" if rule.refuse_if else ""
        if rule.kind == IGNORED and not rule.refuse_if:
            ignored.setdefault(rule.reason, []).append(key)
            continue
        if rule.kind == REFUSED:
            lines.append(f"| `{key}` | refused | {rule.reason} |")
        elif rule.kind == IGNORED:
            lines.append(f"| `{key}` | ignored | {'; '.join(filter(None, [rule.reason, when]))} |")
        else:
            target = semantics.get(key) or rule.dest
            note = "" if rule.reason == INFORMS else rule.reason
            shown = f"`{target}`" if target and " " not in target else target
            lines.append(f"| `{key}` | {shown} | {'; '.join(filter(None, [note, when]))} |")
    for reason, keys in ignored.items():
        lines.append(f"| {', '.join(f'`{k}`' for k in keys)} | ignored | {reason} |")
    return [line.replace("||", "| |") for line in lines]


# Megatron's interleaved (virtual) pipeline stages change the schedule, not the model or its gradients.
VIRTUAL_PIPELINE = ("interleaved pipeline stages, a schedule of the same math: megarl runs one model chunk per "
                    "stage (plain 1F1B: a larger pipeline bubble, no more activation memory)")


_ASSIGNMENT = re.compile(r"(?:export\s+)?([A-Za-z_]\w*)=(.*)")


def shell_command(text: str, where: str, marker: str) -> list[str]:
    """The arguments after `marker` (e.g. `rl_example.py`, `verl.trainer.main_ppo`, `megatron rlhf`) in a
    shell script, as bash computes them (`bash_command`: arrays, arithmetic, conditionals, defaults), or,
    where bash finds no such command (a README snippet that is not a script), as read here: backslash
    continuations joined; lines that begin with a flag continue the command (the way READMEs write them);
    `$NAME` of the snippet's own assignments before the command (`gsm8k=$HOME/x`) and of the environment
    expanded as the shell would (a name set nowhere is left as written)."""
    found, bash_error, stopped = bash_command(text, marker)
    if bash_error:  # a script the shell cannot parse does not run: its launcher's users would see this too
        raise ConfigError(f"{where}: bash cannot parse it: {bash_error}")
    if found is None and stopped:  # the script's own check (a usage line, a missing variable) ended it
        raise ConfigError(f"{where}: the script stopped before its {marker} command: {stopped}")
    return found if found is not None else _read_snippet(text, where, marker)


def _read_snippet(text: str, where: str, marker: str) -> list[str]:
    variables: dict[str, str] = {}

    def expand(value: str) -> str:
        return _expand_shell(value, lambda name: variables.get(name, os.environ.get(name)))

    command = None
    for line in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if command is None:
            assignment = _ASSIGNMENT.fullmatch(stripped)
            if marker in stripped:
                command = stripped[stripped.index(marker) + len(marker):]
            elif assignment and marker not in stripped:
                rhs = assignment.group(2)
                try:
                    parts = shlex.split(rhs if rhs.startswith("'") else expand(rhs))
                except ValueError:
                    parts = [rhs]
                variables[assignment.group(1)] = parts[0] if parts else ""
            elif re.match(r"--?[A-Za-z]", stripped):  # flags alone: the command line itself
                command = stripped
        elif stripped.startswith("-"):
            command += " " + stripped
        else:
            break
    if command is None:
        raise ConfigError(f"{where}: no {marker} command line in it")
    try:
        return shlex.split(_without_comment(expand(command)))
    except ValueError as error:
        raise ConfigError(f"{where}: cannot split the command line ({error})") from None


# Runs a launch script under bash with no command on its PATH: every command it would run (python3, megatron,
# torchrun, mkdir, nvidia-smi, ...) reaches bash's command_not_found_handle instead, which records its
# arguments (NUL-separated, a file per command named by its time and process: the two sides of a pipeline run
# at once) and returns 0. So the shell computes
# the command line exactly (arrays, $((...)), if/case, ${X:-default}) and nothing but bash's builtins runs.
# `set` is a no-op: a recipe's `set -euo pipefail` would otherwise stop at the first missing command. The EXIT
# trap waits for the commands a script starts in the background (`swift rollout ... &`): their records are
# written before the capture folder is read.
_BASH_PRELUDE = r"""
command_not_found_handle() {
    printf '%s\0' "$@" > "$MEGARL_CAPTURE/$EPOCHREALTIME-$BASHPID-$RANDOM"
    return 0
}
set() { :; }
trap wait EXIT
"""
BASH_SECONDS = 20


def bash_command(text: str, marker: str) -> tuple[list[str] | None, str | None, str | None]:
    """The arguments after `marker` (its words in sequence, or a word ending with it: `rl_example.py` of
    `examples/rl_example.py`) of the first command of the script that has it, as bash computes them (None
    without bash, when the script fails to run, or when no command has the marker), bash's syntax error, if
    it reported one, and the last line the script printed to stderr when it exited non-zero (its own usage or
    check; not a command bash could not find, such as an absolute path to another machine's python)."""
    import shutil
    import subprocess
    import tempfile

    bash = shutil.which("bash")
    if bash is None:
        return None, None, None
    with tempfile.TemporaryDirectory(prefix="megarl-shell-") as scratch:
        script, capture = os.path.join(scratch, "script.sh"), os.path.join(scratch, "capture")
        os.mkdir(capture)
        with open(script, "w") as handle:
            handle.write(text)
        env = {**os.environ, "PATH": os.path.join(scratch, "no-commands"), "MEGARL_CAPTURE": capture}
        try:
            ran = subprocess.run([bash, "--noprofile", "--norc", "-c", _BASH_PRELUDE + '\n. "$0"', script],
                                 env=env, cwd=scratch, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, timeout=BASH_SECONDS, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None, None, None
        errors = [line for line in ran.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
        syntax = next((line.split(": ", 1)[-1] for line in errors if "syntax error" in line), None)
        own = [line for line in errors if "No such file or directory" not in line and "command not found" not in line]
        stopped = own[-1].strip() if ran.returncode != 0 and own else None
        records = []
        # in time order (bash 5's EPOCHREALTIME; older bash leaves it empty: the order is then the listing's)
        for name in sorted(os.listdir(capture), key=lambda name: float(name.split("-")[0] or 0)):
            with open(os.path.join(capture, name), "rb") as handle:
                records.append([word.decode("utf-8", "replace") for word in handle.read().split(b"\0")[:-1]])
    marker_words = marker.split()
    for number, args in enumerate(records):
        for index in range(len(args) - len(marker_words) + 1):
            window = args[index:index + len(marker_words)]
            if window[:-1] == marker_words[:-1] and (window[-1] == marker_words[-1] or
                                                     window[-1].endswith("/" + marker_words[-1])):
                found = args[index + len(marker_words):]
                # A README's flag lines after a line without its backslash ran as commands of their own
                # ("-t 16 ..."): they belong to the command, as its reader means them.
                for following in records[number + 1:]:
                    if not (following and following[0].startswith("-")):
                        break
                    found += following
                return found, syntax, None
    return None, syntax, stopped


def _expand_shell(value: str, lookup) -> str:
    """`$NAME`, `${NAME}` and `${NAME:-default}` (the default itself expanded, so nested ones too: verl's
    `${ACTOR_PARAM_OFFLOAD:-$COMMON_PARAM_OFFLOAD}`) as the shell expands them; `lookup(name)` is the value or
    None, and a name set nowhere without a default is left as written."""
    out, index = [], 0
    while index < len(value):
        if value.startswith("${", index):
            depth, end = 0, index
            while end < len(value):
                if value.startswith("${", end):
                    depth, end = depth + 1, end + 2
                    continue
                if value[end] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                end += 1
            inner = value[index + 2:end]
            name, default_given, default = inner.partition(":-")
            known = lookup(name)
            if default_given:
                out.append(known if known else _expand_shell(default, lookup))
            else:
                out.append(known if known is not None else value[index:end + 1])
            index = end + 1
            continue
        simple = re.match(r"\$(\w+)", value[index:])
        if simple:
            known = lookup(simple.group(1))
            out.append(known if known is not None else simple.group(0))
            index += simple.end()
            continue
        out.append(value[index])
        index += 1
    return "".join(out)


def _without_comment(command: str) -> str:
    """`command` up to its comment, as the shell reads one: a `#` that begins a word outside quotes. shlex's
    own comments=True ends a word at any `#`, which would cut ms-swift's `--dataset name#2000` (its sample
    count) and drop every flag after it."""
    quote = None
    for index, char in enumerate(command):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or command[index - 1].isspace()):
            return command[:index]
    return command


# LoRA target names of the other frameworks -> megarl's --lora-target-modules names (megarl/models/lora.py:
# the family's HF module names, Megatron's fused linears, or all-linear). Megatron-Bridge's canonical LoRA
# names one adapter per HF module, as megarl's adapters are.
CANONICAL_LORA = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj", "linear_fc1_gate": "gate_proj",
                  "linear_fc1_up": "up_proj"}
FUSED_LINEARS = ("all-linear", "linear_qkv", "linear_fc1")
LORA_LAYOUT = ("megarl's adapters are PEFT's, one (A, B) pair per HF module: an adapter on a fused linear "
               "(linear_qkv, linear_fc1, all-linear in Megatron) is one per q/k/v and gate/up module here")


def lora_targets(value, key: str, ctx: "Context") -> list[str]:
    """A framework's LoRA target_modules as megarl names. PEFT matches a name as a suffix of the module path,
    so `self_attn.q_proj` is q_proj; names that pick layers (`*.layers.0.*.linear_qkv`, digits) or regexes
    are refused: megarl puts adapters on every layer. Unknown module names are left to --lora-target-modules'
    own check against the model's family."""
    items = as_list(value)
    if isinstance(value, str) and value != "all-linear" and re.search(r"[\\^$*+?()\[\]|{}]", value):
        ctx.fail(key, f"{value!r} is a regular expression over module paths; megarl takes module names "
                      f"(q_proj, linear_qkv, all-linear)")
    out = []
    for item in items:
        name = str(item)
        if name in ("all-router", "all-embedding", "router", "embed_tokens", "lm_head", "output_layer",
                    "word_embeddings"):
            ctx.fail(key, f"{name}: megarl puts adapters on the decoder layers' linears only "
                          f"(attention and MLP)")
        if re.search(r"[*?\[\]]|(^|\.)\d+(\.|$)", name):
            ctx.fail(key, f"{name!r} picks some layers; megarl's adapters go on every layer")
        name = name.rsplit(".", 1)[-1]
        out.append(CANONICAL_LORA.get(name, name))
    if not out:
        ctx.fail(key, "empty: name the modules that get adapters (all-linear for every linear)")
    return out


def rslora_alpha(alpha: float, rank: int) -> float:
    """rsLoRA scales the adapters by alpha / sqrt(rank); megarl's scale is alpha / rank, so this alpha gives
    the same scale (the initialisation does not depend on alpha: the runs are the same)."""
    return alpha * rank ** 0.5
