"""Convert the MATH dataset (Hendrycks et al.) into a megarl training file.

    python tools/convert_math.py --input MATH/train --output math.jsonl [--format colossalchat|verl|swift]

MATH publishes one JSON object per problem, `train/<subject>/<id>.json`, with
"problem", "level", "type" and "solution"; the answer is the last
`\\boxed{...}` of the solution (braces may nest). --input takes directories
(searched recursively for *.json), single .json files, or JSONL files of the
same objects. The problem becomes the user message, the boxed answer the ground
truth; level, subject (from "type") and the worked solution
(`reference_solution`) are kept as extra columns. A handful of MATH solutions
box with `\\fbox{}`: it is accepted too. A problem without a boxed answer is an
error naming its file.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.data.datasets import DatasetError, Row, converter_main, read_file  # noqa: E402
from megarl.data.tasks.arithmetic import extract_boxed  # noqa: E402

# verl's reward routing recognises this name for MATH (verl/utils/reward_score).
DATA_SOURCE = "lighteval/MATH"


def input_files(inputs: list[str]) -> list[tuple[str, str]]:
    """(file, id prefix) pairs: directories are walked in sorted order; ids are paths relative to them."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(Path(item).rglob("*.json"))
            if not found:
                raise DatasetError(f"{item}: no .json files under this directory")
            files += [(str(p), str(p.relative_to(item).with_suffix(""))) for p in found]
        elif os.path.isfile(item):
            files.append((item, Path(item).stem))
        else:
            raise DatasetError(f"{item}: no such file or directory")
    return files


def boxed_answer(solution, where: str) -> str:
    if not isinstance(solution, str):
        raise DatasetError(f"{where}: field 'solution' must be a string")
    answer = extract_boxed(solution)
    if answer is None:
        answer = extract_boxed(solution.replace("\\fbox{", "\\boxed{"))
    if answer is None:
        raise DatasetError(f"{where}: field 'solution' has no complete \\boxed{{...}} answer")
    return answer.strip()


def convert_row(raw: dict, where: str, row_id: str, data_source: str) -> Row:
    problem = raw.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        raise DatasetError(f"{where}: field 'problem' must be a non-empty string")
    extra = {"level": raw.get("level"), "subject": raw.get("type"), "reference_solution": raw.get("solution")}
    return Row(id=str(raw.get("unique_id") or row_id), messages=[{"role": "user", "content": problem}],
               gt_answer=boxed_answer(raw.get("solution"), where), data_source=data_source,
               extra={k: v for k, v in extra.items() if v is not None}, origin=where)


def read_problems(inputs: list[str], data_source: str) -> list[Row]:
    rows = []
    for path, prefix in input_files(inputs):
        problems = list(read_file(path))
        for number, raw in problems:
            # MATH's one-problem files are known by their path; rows of a JSONL by their number too.
            row_id = prefix if len(problems) == 1 and path.endswith(".json") else f"{prefix}-{number}"
            rows.append(convert_row(raw, f"{path}:{number}", row_id, data_source))
    return rows


def main(argv=None) -> int:
    return converter_main("convert_math", __doc__.splitlines()[0], read_problems, DATA_SOURCE,
                          "MATH directories, .json or .jsonl files", several_inputs=True, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
