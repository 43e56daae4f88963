"""GKD's data knobs without ranks: whose responses a step trains on (--gkd-lmbda, --seq-kd), the
reference response as the chat template renders it, and the configuration that selects a teacher."""

import json

import pytest

from megarl.arguments import parse_args
from megarl.errors import ConfigError
from megarl.generation import response_source


def test_response_source_follows_lmbda_and_is_a_function_of_seed_and_step():
    draws = [response_source(0.3, False, 7, step) for step in range(2000)]
    assert set(draws) == {"student", "dataset"}
    assert abs(draws.count("student") / len(draws) - 0.3) < 0.04
    assert draws == [response_source(0.3, False, 7, step) for step in range(2000)]  # resumable
    assert draws != [response_source(0.3, False, 8, step) for step in range(2000)]  # seeded
    assert {response_source(1.0, True, 7, step) for step in range(200)} == {"student"}  # the default: on-policy
    assert {response_source(0.0, True, 7, step) for step in range(200)} == {"teacher"}
    assert {response_source(0.0, False, 7, step) for step in range(200)} == {"dataset"}


def test_reference_response_is_the_assistant_turn_up_to_its_end(tiny_model):
    from transformers import AutoTokenizer

    from megarl.data.prompts import chat_token_ids, reference_response_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ids = reference_response_ids(tokenizer, messages, "\\boxed{42}")
    assert tokenizer.decode(ids) == "\\boxed{42}<|im_end|>"  # ends where generation stops (no trailing newline)
    whole = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "\\boxed{42}"}],
                                          tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert whole[: len(chat_token_ids(tokenizer, messages)) + len(ids)] == chat_token_ids(tokenizer, messages) + ids


def test_the_teacher_group_of_a_yaml_config_is_a_standalone_teacher(tiny_model, tmp_path):
    config = tmp_path / "gkd.yaml"
    config.write_text(f"model: {tiny_model}\ncolocate_groups: [[train, rollout]]\ngkd_logits_topk: 8\n"
                      f"teacher: {{gpus: 1, model: {tiny_model}, tensor_parallel_size: 1, kv_cache_gb: 2,\n"
                      f"          engine_kwargs: {{max_logprobs: 12}}}}\n")
    args = parse_args(["--config", str(config)], world_size=3)
    assert (args.teacher_model, args.standalone_teacher_model, args.teacher_gpus) == (None, tiny_model, 1)
    assert args.teacher_engine_kwargs == {"max_logprobs": 12} and args.teacher_kv_cache_gb == 2.0
    assert (args.train_gpus, args.rollout_gpus) == (2, 2)
    config.write_text(config.read_text() + f"teacher_model: {tiny_model}\n")
    with pytest.raises(ConfigError, match="are both set; keep one"):
        parse_args(["--config", str(config)], world_size=3)


def test_off_policy_steps_on_a_dataset_need_its_responses(tiny_model, tmp_path):
    from megarl.data.sources import prompt_source
    from megarl.data.datasets import DatasetError

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant",
                                                                                   "content": "2"}]}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "2+2?"}]}) + "\n")
    args = parse_args(["--model", tiny_model, "--teacher-model", tiny_model, "--gkd-lmbda", "0.5",
                       "--train-data", str(rows), "--prompts-per-step", "2", "--num-generations", "2",
                       "--micro-batch-size", "2"], world_size=1)
    from transformers import AutoTokenizer

    with pytest.raises(DatasetError, match=r"rows.jsonl:2: --gkd-lmbda 0.5 trains some steps on the dataset's "
                                           r"responses, but this row has none"):
        prompt_source(args, AutoTokenizer.from_pretrained(tiny_model), None)


def test_the_opsd_example_gives_every_row_a_privileged_teacher_prompt(tiny_model, tmp_path):
    """examples/gkd/opsd_arithmetic.yaml with its plugin: raw problems become rows whose teacher prompt
    (rendered like the student's) carries the answer the student's prompt lacks."""
    from transformers import AutoTokenizer

    from megarl.data.sources import prompt_source
    from megarl.data.tasks import arithmetic

    rows = tmp_path / "arithmetic.jsonl"
    arithmetic.write_jsonl(rows, arithmetic.make_problems(8, seed=5))
    args = parse_args(["--config", "examples/gkd/opsd_arithmetic.yaml", "--model", tiny_model, "--teacher-model",
                       tiny_model, "--train-data", str(rows), "--prompts-per-step", "4", "--micro-batch-size", "8"],
                      world_size=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = prompt_source(args, tokenizer, None).batch(0)
    assert len(prompts) == 4
    for prompt in prompts:
        student, teacher = tokenizer.decode(prompt.ids), tokenizer.decode(prompt.teacher_ids)
        answer = prompt.metadata["answer"]
        assert f"the answer is {answer}" in teacher and "the answer is" not in student, (student, teacher)
        assert teacher.endswith("<|im_start|>assistant\n") and student.endswith("<|im_start|>assistant\n")
