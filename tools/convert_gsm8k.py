"""Convert GSM8K's published JSONL into a megarl training file.

    python tools/convert_gsm8k.py --input train.jsonl --output gsm8k.jsonl [--format colossalchat|verl|swift]

GSM8K rows are {"question": ..., "answer": "<worked solution>\\n#### 1,234"}.
The question becomes the user message (no instruction is added: the answer
format belongs to the system prompt, --system-prompt or the reward's default),
the number after the last "####" with its thousands commas removed becomes the
ground truth, and the worked solution is kept as the `reference_solution`
column. The output loads with `megarl.data.datasets.load_rows`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.data.datasets import DatasetError, Row, converter_main, read_file  # noqa: E402

# verl's reward routing recognises this name (verl/utils/reward_score).
DATA_SOURCE = "openai/gsm8k"


def final_answer(answer: str, where: str) -> str:
    """The number after the last '####', commas stripped: '#### 1,234' -> '1234'."""
    if not isinstance(answer, str) or "####" not in answer:
        raise DatasetError(f"{where}: field 'answer' has no '#### <number>' line")
    number = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not number:
        raise DatasetError(f"{where}: field 'answer' has nothing after '####'")
    return number


def convert_row(raw: dict, where: str, index: int, data_source: str) -> Row:
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: field 'question' must be a non-empty string")
    answer = raw.get("answer")
    return Row(id=f"gsm8k-{index}", messages=[{"role": "user", "content": question}],
               gt_answer=final_answer(answer, where), data_source=data_source,
               extra={"reference_solution": answer.rsplit("####", 1)[0].strip()}, origin=where)


def read_rows(path: str, data_source: str) -> list[Row]:
    return [convert_row(raw, f"{path}:{n}", i, data_source) for i, (n, raw) in enumerate(read_file(path))]


def main(argv=None) -> int:
    return converter_main("convert_gsm8k", __doc__.splitlines()[0], read_rows, DATA_SOURCE,
                          "GSM8K JSONL (question, answer)", several_inputs=False, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
