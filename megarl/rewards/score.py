"""Score a file of responses offline with any configured reward: how a user debugs a reward.

    python -m megarl.score --reward boxed --data data/test.jsonl --responses responses.jsonl

--responses has one JSON object per line with a `response` field. It is matched
to the dataset rows by line order, or by `id` when every response and every row
has one. Output: one JSON object per row (`score`, `reason`, and the row's `id`),
then a last line `mean: X`. Bad input is a one-line error on stderr naming the
file, line and field (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from megarl.errors import ConfigError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.score", description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="reward name, or weighted names such as boxed:1.0,rm:0.5")
    parser.add_argument("--data", nargs="+", required=True, help="dataset files, globs or directories")
    parser.add_argument("--responses", required=True, help="JSONL file, one {\"response\": ...} per line")
    parser.add_argument("--reward-model", default=None, help="checkpoint for the reward named 'rm'")
    parser.add_argument("--data-format", default="auto", choices=["auto", "colossalchat", "verl", "swift"])
    parser.add_argument("--prompt-key", default="prompt")
    parser.add_argument("--preprocessor", default=None)
    parser.add_argument("--external-plugins", nargs="*", default=[], help="files registering rewards / preprocessors")
    return parser.parse_args(argv)


def read_responses(path: str) -> list[dict]:
    records = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("response"), str):
                    raise ConfigError(f"{path}:{number}: needs a string field 'response'")
                records.append({**record, "_line": number})
    except OSError as error:
        raise ConfigError(f"--responses {path}: {error.strerror}") from None
    if not records:
        raise ConfigError(f"{path}: no responses")
    return records


def match(rows, responses: list[dict], path: str) -> list[tuple[object, dict]]:
    """Pair rows and responses: by id when all of both have one, else by order."""
    # A row without an id of its own is known by its origin (file:line).
    if all("id" in r for r in responses) and all(row.id != row.origin for row in rows):
        by_id = {str(row.id): row for row in rows}
        pairs = []
        for record in responses:
            if str(record["id"]) not in by_id:
                raise ConfigError(f"{path}:{record['_line']}: id {record['id']!r} is not in the dataset")
            pairs.append((by_id[str(record["id"])], record))
        return pairs
    if len(rows) != len(responses):
        raise ConfigError(f"{path}: {len(responses)} responses for {len(rows)} dataset rows; match them by order "
                          f"(same count) or give every row and response an 'id'")
    return list(zip(rows, responses))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megarl.data.datasets import load_eval_dataset
        from megarl.plugins import load_plugins
        from megarl.rewards import build_reward, score_all

        load_plugins(args.external_plugins)
        rows = load_eval_dataset(args.data, format=args.data_format, prompt_key=args.prompt_key,
                                 preprocessor=args.preprocessor)
        pairs = match(rows, read_responses(args.responses), args.responses)
        try:
            reward = build_reward(args.reward, args.reward_model)
        except ValueError as error:
            raise ConfigError(f"--reward: {error}") from None
    except ConfigError as error:
        print(f"megarl.score: error: {error}", file=sys.stderr)
        return 2
    outputs = score_all(reward, [record["response"] for _, record in pairs], [row.as_metadata() for row, _ in pairs])
    for (row, _), output in zip(pairs, outputs):
        print(json.dumps({"id": row.id, "score": output.score, "reason": output.reason}, ensure_ascii=False))
    print(f"mean: {sum(o.score for o in outputs) / len(outputs):.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
