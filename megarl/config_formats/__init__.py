"""Other frameworks' configurations read as those frameworks mean them: ms-swift's Megatron RLHF YAML,
verl's nested PPO trainer YAML with Hydra-style overrides, and ColossalChat's rl_example.py flags.

    megarl/train.py --config swift_gkd.yaml                    # detected from the file
    megarl/train.py --config ppo_trainer.yaml trainer.total_epochs=15 data.train_batch_size=64
    megarl/train.py --config run_grpo.sh                       # a shell snippet with the rl_example.py line
    megarl/train.py --config-format colossalchat -t 1 -i 1 -ibs 2 -tbs 2 -g 4 -d data.jsonl
    python tools/import_config.py FILE [overrides]              # the megarl YAML and a table of every key

`read(argv, megarl_options)` finds `--config` / `--config-format` in the command line; for a foreign format
it returns the Translation (megarl option values by dest, one row per source key) and the command line left
for megarl's own parser. Each framework's module holds its whole option table (swift.py, verl.py,
colossalchat.py) and its semantics; common.py the rule machinery.
"""

from __future__ import annotations

import re

import yaml

from megarl.config_formats.common import Translation, bash_command, load_yaml_mapping, shell_command
from megarl.errors import ConfigError

FORMATS = ("megarl", "swift", "verl", "colossalchat")
# `megatron rlhf` / `swift rlhf`, or the script behind them run directly (swift/cli/_megatron/rlhf.py)
SWIFT_COMMAND = re.compile(r"\b(megatron|swift) rlhf\b|swift/cli/_megatron/rlhf\.py")
VERL_SECTIONS = ("actor_rollout_ref", "data", "algorithm", "trainer", "critic", "reward_model", "ray_init",
                 "custom_reward_function")


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror})") from None


def detect(path: str, text: str | None = None) -> str:
    """The format of a config file, from its content: an rl_example.py command line (ColossalChat), a mapping
    with `rlhf_type` (ms-swift) or with verl's sections, else megarl's own YAML."""
    if text is None:
        try:
            text = _text(path)
        except ConfigError:  # unreadable: megarl's own YAML reader says why, in its words
            return "megarl"
    if "verl.trainer.main_ppo" in text:
        return "verl"
    if SWIFT_COMMAND.search(text):
        return "swift"
    if "rl_example.py" in text:
        return "colossalchat"
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        raw = None
    if not isinstance(raw, dict):
        first = next((line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")),
                     "")
        # a flag (`-t 4`, `--model x`), not a YAML list item (`- x`)
        return "colossalchat" if re.match(r"--?[A-Za-z]", first) else "megarl"
    if "rlhf_type" in raw:
        return "swift"
    if any(key in raw for key in VERL_SECTIONS):
        return "verl"
    return "megarl"


def split_command_line(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(--config value, --config-format value, the rest of argv)."""
    config = fmt = None
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        for name in ("--config", "--config-format"):
            if token == name and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
                break
            if token.startswith(name + "="):
                value = token.split("=", 1)[1]
                break
        else:
            rest.append(token)
            i += 1
            continue
        if name == "--config":
            config = value
        else:
            fmt = value
        i += 1
    return config, fmt, rest


def read(argv: list[str], megarl_options) -> tuple[Translation, list[str]] | None:
    """The Translation of a foreign config named on the command line and the argv left for megarl's parser
    (None: megarl's own YAML or none). Refused keys stop here with one line."""
    config, fmt, rest = split_command_line(list(argv))
    if fmt is not None and fmt not in FORMATS:
        from megarl.config_formats.common import closest

        raise ConfigError(f"--config-format {fmt!r}: one of {', '.join(FORMATS)}{closest(fmt, FORMATS)}")
    if config is None and fmt in (None, "megarl"):
        return None
    if config is None and fmt == "swift":
        raise ConfigError("--config-format swift needs --config FILE (a YAML or a `megatron rlhf` command line)")
    detected = fmt or detect(config)
    if detected == "megarl":
        return None
    translation, rest = translate(detected, config, rest, megarl_options)
    translation.check()
    return translation, rest


def translate(fmt: str, path: str | None, rest: list[str], megarl_options) -> tuple[Translation, list[str]]:
    """Translate `path` (None: ColossalChat flags on the command line only) in format `fmt`; `rest` holds
    the command line after it: verl's overrides and ColossalChat's flags are taken from it."""
    if fmt == "colossalchat":
        from megarl.config_formats import colossalchat

        tokens = colossalchat.command_tokens(_text(path), path) if path else []
        # Flags on the command line (after the file's) are ColossalChat's too; what is left is megarl's.
        return colossalchat.translate(tokens + rest, path or "command line", megarl_options)
    text = _text(path) if path else ""
    if fmt == "swift":
        from megarl.config_formats import swift

        match = SWIFT_COMMAND.search(text)
        server = None
        if match:  # a `megatron rlhf --key value ...` command line
            raw = swift.parse_flags(shell_command(text, path, match.group(0)), path)
            started, _, _ = bash_command(text, "swift rollout")  # vllm_mode server: the server it starts
            server = swift.parse_flags(started, path) if started is not None else None
        else:
            raw = load_yaml_mapping(path, text)
        return swift.translate(raw, path, megarl_options, rest, server), rest
    if fmt == "verl":
        from megarl.config_formats import verl

        if path is None or "verl.trainer.main_ppo" in text:  # overrides only: over verl's defaults
            raw, script = {}, shell_command(text, path, "verl.trainer.main_ppo") if path else []
        else:
            raw, script = load_yaml_mapping(path, text), []
        script = verl.script_overrides(script, path)
        overrides = [token for token in rest if verl.is_override(token)]
        left = [token for token in rest if not verl.is_override(token)]
        return verl.translate(raw, path or "command line", megarl_options, script + overrides), left
    raise ConfigError(f"--config-format {fmt!r}: one of {', '.join(FORMATS)}")
