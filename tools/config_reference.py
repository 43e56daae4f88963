"""Print megarl's configuration reference (Markdown) from the argument parser.

    python tools/config_reference.py            # print it
    python tools/config_reference.py --write    # refresh docs/configuration.md in place

The section of docs/configuration.md between the config-reference markers is this
output; a test checks that the two agree, so the reference cannot drift from the parser.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.arguments import build_parser  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def reference() -> str:
    lines = []
    for group in build_parser()._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"**{group.title}**", "", "| flag | YAML key | default | meaning |", "|---|---|---|---|"]
        for action in actions:
            default = "" if action.default in (None, "", [], {}) else f"`{action.default}`"
            help_text = (action.help or "").replace("|", "\\|")
            if action.choices:
                help_text += f" (one of {', '.join(map(str, action.choices))})"
            lines.append(f"| `{action.option_strings[0]}` | `{action.dest}` | {default} | {help_text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", action="store_true")
    if not parser.parse_args().write:
        print(reference(), end="")
        return
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{START}\n{reference()}{END}{tail}")


if __name__ == "__main__":
    main()
