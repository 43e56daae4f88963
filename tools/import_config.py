"""Translate an ms-swift, verl or ColossalChat configuration into megarl's YAML, with a table of every
source key: mapped to which megarl option, a default of that framework applied, ignored and why, or
refused and why.

    python tools/import_config.py ppo_trainer.yaml trainer.total_epochs=15 > run.yaml
    python tools/import_config.py swift_gkd.yaml
    python tools/import_config.py run_grpo.sh -tbs 4           # ColossalChat: extra flags after the file
    python tools/import_config.py --config-format colossalchat -t 2 -i 2 -ibs 8 -tbs 4 -d data.jsonl
    python tools/import_config.py --reference [--write]     # the key tables of docs/migrating.md

The output is YAML (the table is in comment lines), so it can be saved and run with
`megarl/train.py --config run.yaml`. Exit status: 0, or 1 when a key is refused (the table says why);
an unknown key is one error line (status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl import config_formats  # noqa: E402
from megarl.arguments import _actions, _translated_values, build_parser  # noqa: E402
from megarl.errors import ConfigError  # noqa: E402

# megarl options written inside their role group (megarl/arguments.py reads `rollout: {gpus: 2}` as rollout_gpus).
ROLE_KEYS = {"train_gpus": ("train", "gpus"), "standalone_teacher_model": ("teacher", "model"),
             **{f"rollout_{key}": ("rollout", key) for key in (
                 "gpus", "tensor_parallel_size", "kv_cache_gb", "gpu_memory_utilization", "sleep_level",
                 "engine_kwargs", "model")},
             **{f"teacher_{key}": ("teacher", key) for key in (
                 "gpus", "tensor_parallel_size", "kv_cache_gb", "gpu_memory_utilization", "engine_kwargs")}}


def megarl_yaml(values: dict) -> dict:
    """Options as megarl's YAML lays them out: top-level keys, and the role groups."""
    out, groups = {}, {}
    for dest, value in values.items():
        if dest in ROLE_KEYS:
            group, key = ROLE_KEYS[dest]
            groups.setdefault(group, {})[key] = value
        else:
            out[dest] = value
    out.update(groups)
    return out


def table(translation) -> list[str]:
    lines = ["| source key | value | status | megarl option | why |", "|---|---|---|---|---|"]
    for row in translation.rows:
        targets = ", ".join(f"{dest}={value!r}" for dest, value in row.targets.items())
        value = "" if row.value is None else repr(row.value)
        lines.append(f"| {row.key} | {value} | {row.status} | {targets} | {row.note} |".replace("\n", " "))
    return lines


START, END = "<!-- migrating-reference:start -->", "<!-- migrating-reference:end -->"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"


def reference() -> str:
    """One Markdown table per framework, from the rule tables themselves (they cannot drift apart)."""
    from megarl.config_formats import colossalchat, swift, verl
    from megarl.config_formats.common import reference as rows

    cc_table, cc_semantics = colossalchat.reference_table()
    sections = [("ms-swift (Megatron RLHF YAML)", {**swift.TABLE, **swift.ROLE_TABLE}, swift.SEMANTICS,
                 "Role groups: `train.X` is the top-level key X for the trainer."),
                ("verl (ppo_trainer.yaml, ppo_megatron_trainer.yaml)", verl.TABLE, verl.SEMANTICS,
                 "`X.*`: every key under X. `_target_` keys are ignored everywhere."),
                ("ColossalChat (rl_example.py flags)", cc_table, cc_semantics, "")]
    out = []
    for title, table, semantics, note in sections:
        out += [f"### {title}", ""] + ([note, ""] if note else []) + rows(table, semantics) + [""]
    return "\n".join(out).rstrip() + "\n"


def write_reference() -> None:
    text = PAGE.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    PAGE.write_text(f"{head}{START}\n{reference()}{END}{tail}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--reference"]:
        if argv[1:] == ["--write"]:
            write_reference()
        else:
            print(reference(), end="")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("file", nargs="?", help="the configuration (or nothing, with --config-format colossalchat)")
    parser.add_argument("--config-format", choices=[f for f in config_formats.FORMATS if f != "megarl"],
                        help="the format (default: detected from the file)")
    known, rest = parser.parse_known_args(argv)
    if known.file and known.file.startswith("-"):  # ColossalChat flags with no file
        rest, known.file = [known.file] + rest, None
    try:
        if known.file is None and known.config_format != "colossalchat":
            raise ConfigError("name a configuration file (or --config-format colossalchat and its flags)")
        fmt = known.config_format or config_formats.detect(known.file)
        if fmt == "megarl":
            raise ConfigError(f"{known.file} is already megarl's own YAML")
        options = build_parser()
        translation, left = config_formats.translate(fmt, known.file, rest, set(_actions(options)))
        if left:
            raise ConfigError(f"not {translation.how}: {' '.join(left)}")
        values = _translated_values(translation, options)
    except ConfigError as error:
        print(f"import_config: error: {error}", file=sys.stderr)
        return 2
    print(f"# megarl configuration translated from {translation.where} ({translation.how})")
    print(f"# {translation.summary()}")
    print(yaml.safe_dump(megarl_yaml(values), sort_keys=False, default_flow_style=None).rstrip())
    print("\n# ---- source keys ----")
    for line in table(translation):
        print(f"# {line}")
    refused = translation.refused()
    for row in refused:
        print(f"import_config: refused: {row.key}: {row.note}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
