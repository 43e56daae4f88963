"""The reward-model reward against an independent transformers forward, on the tiny RM the tool builds."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, assert_fp32_close, assert_fp32_paths_agree, load_script
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen2ForSequenceClassification,
)

from megarl.rewards import RewardOutput
from megarl.rewards.combine import combined_reward_spec
from megarl.rewards.reward_model import RewardModelReward, make_reward_model_reward

TOOL = ROOT / "tools" / "make_tiny_reward_model.py"
MESSAGES = [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "What is 3 + 4?"}]
RESPONSES = ["\\boxed{7}", "", "Let me think. 3 + 4 = 7, so the answer is \\boxed{7}.", "\\boxed{8}", "7" * 40]
ROWS = [{"messages": MESSAGES, "gt_answer": "7"}] * len(RESPONSES)


def _load_tool():
    return load_script(TOOL)


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


@pytest.fixture(scope="module")
def rm_path(tool, tmp_path_factory) -> str:
    return str(tool.build(tmp_path_factory.mktemp("tiny_rm"), seed=0))


def _direct_score(path: str, response: str) -> float:
    """The RM's head on the last token of the chat-rendered conversation, one unpadded sequence, in float64
    (the reference: the fp32 weights exactly; tests/helpers.py)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    text = tokenizer.apply_chat_template(MESSAGES + [{"role": "assistant", "content": response}], tokenize=False)
    assert text.endswith(response + "<|im_end|>\n")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        return model.score(hidden).item()


def test_score_matches_direct_forward(rm_path):
    reward = RewardModelReward(rm_path)
    outputs = [reward(response, ROWS[0]) for response in RESPONSES[:3]]
    assert all(out.reason == "" for out in outputs)
    assert_fp32_close([out.score for out in outputs], [_direct_score(rm_path, r) for r in RESPONSES[:3]])


def test_an_episode_is_scored_whole(rm_path):
    """A multi-turn episode's row carries its conversation (megarl/multiturn.py): the RM reads every turn
    and tool message, not only the final answer."""
    reward = RewardModelReward(rm_path)
    turns = [{"role": "assistant", "content": "<tool_call>{}</tool_call>", "tool_calls": []},
             {"role": "tool", "name": "calculator", "content": "7", "error": None, "seconds": 0.0},
             {"role": "assistant", "content": "\\boxed{7}", "tool_calls": []}]
    text = reward.render("\\boxed{7}", {**ROWS[0], "conversation": turns})
    assert text == reward.tokenizer.apply_chat_template(
        MESSAGES + [{"role": m["role"], "content": m["content"]} for m in turns], tokenize=False)
    assert "<tool_call>{}</tool_call>" in text and text != reward.render("\\boxed{7}", ROWS[0])


def test_scores_depend_on_the_response(rm_path):
    scores = RewardModelReward(rm_path).score_batch(RESPONSES, ROWS)
    assert len({round(s, 4) for s in scores}) == len(scores)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_batched_equals_single_on_either_padding_side(rm_path, padding_side):
    """Batches of 2 mix lengths, so every batch pads; each score must equal the unpadded one."""
    reward = RewardModelReward(rm_path, batch_size=2, padding_side=padding_side)
    single = [reward(response, row).score for response, row in zip(RESPONSES, ROWS, strict=True)]
    assert_fp32_paths_agree(reward.score_batch(RESPONSES, ROWS), single)
    lengths = [len(reward.tokenizer(reward.render(r, ROWS[0]))["input_ids"]) for r in RESPONSES]
    assert all(lengths[i] != lengths[i + 1] for i in range(0, len(lengths) - 1, 2))


def test_sigmoid(rm_path):
    raw = RewardModelReward(rm_path).score_batch(RESPONSES, ROWS)
    squashed = RewardModelReward(rm_path, sigmoid=True).score_batch(RESPONSES, ROWS)
    assert_fp32_paths_agree(squashed, torch.sigmoid(torch.tensor(raw)))


def test_tokenizer_without_pad_token_pads_with_eos(rm_path, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path)
    model.config.pad_token_id = None
    model.save_pretrained(tmp_path)
    reward = RewardModelReward(str(tmp_path), batch_size=3)
    assert reward.tokenizer.pad_token == tokenizer.eos_token
    expected = RewardModelReward(rm_path).score_batch(RESPONSES, ROWS)
    assert_fp32_paths_agree(reward.score_batch(RESPONSES, ROWS), expected)


def test_rejects_a_classifier_with_several_labels(rm_path, tmp_path):
    config = AutoConfig.from_pretrained(rm_path)
    config.num_labels = 2
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(rm_path).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModelReward(str(tmp_path))


def test_spec_and_combination(rm_path):
    rm = make_reward_model_reward(rm_path)
    assert (rm.name, rm.system_prompt) == ("rm", None)
    spec = combined_reward_spec("boxed:1.0,rm:0.5", extra={"rm": rm})
    rm_score = rm.fn(RESPONSES[0], ROWS[0]).score
    out = spec.fn(RESPONSES[0], ROWS[0])
    assert out.score == pytest.approx(1.0 + 0.5 * rm_score)
    assert out.reason == f"boxed=correct, rm={rm_score:.3g}"
    assert isinstance(out, RewardOutput)


def test_builder_is_deterministic_in_seed(tool, tmp_path):
    from safetensors.torch import load_file

    a, b, c = (load_file(tool.build(tmp_path / name, seed) / "model.safetensors")
               for name, seed in (("a", 3), ("b", 3), ("c", 4)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["score.weight"], c["score.weight"])


@pytest.mark.slow  # launches a command in a process of its own (python + torch start-up): the slow lane
def test_cli_builds_a_loadable_reward_model(tmp_path):
    out = tmp_path / "rm"
    subprocess.run([sys.executable, str(TOOL), "--out", str(out), "--seed", "1"], check=True, cwd=ROOT,
                   capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token is not None and tokenizer.chat_template


def test_reward_flag_with_a_reward_model_scores_a_batch(rm_path):
    """--reward boxed:1.0,rm:0.5 --reward-model PATH: the batch path equals per-sample scoring."""
    from megarl.rewards import build_reward, score_all

    spec = build_reward("boxed:1.0,rm:0.5", rm_path)
    rows = [ROWS[0]] * len(RESPONSES)
    batch = score_all(spec, RESPONSES, rows)
    single = [spec.fn(response, row) for response, row in zip(RESPONSES, rows)]
    assert_fp32_paths_agree([o.score for o in batch], [o.score for o in single])
    assert all(o.reason.startswith("boxed=") and ", rm=" in o.reason for o in batch)
    with pytest.raises(ValueError, match="no --reward-model"):
        build_reward("boxed:1.0,rm:0.5")


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_micro_batches_give_the_scores_of_one_batch(rm_path, micro_batch_size):
    """--reward-model-micro-batch-size: the same scores as the whole call in one forward (fp32 rounding)."""
    whole = RewardModelReward(rm_path, batch_size=len(RESPONSES)).score_batch(RESPONSES, ROWS)
    micro = RewardModelReward(rm_path, batch_size=micro_batch_size).score_batch(RESPONSES, ROWS)
    assert_fp32_paths_agree(micro, whole)


def test_max_length_scores_the_end_of_longer_conversations_and_counts_them(rm_path, capsys):
    """--reward-model-max-length L: a conversation over L tokens is scored on its last L tokens (the response's
    end, where the model pools), the others as before; a warning line counts the truncated ones."""
    full = RewardModelReward(rm_path)
    lengths = [len(full.tokenizer(full.render(r, ROWS[0]), add_special_tokens=False)["input_ids"]) for r in RESPONSES]
    limit = sorted(lengths)[2]  # the two longest are cut
    reward = RewardModelReward(rm_path, max_length=limit, batch_size=2)
    scores = reward.score_batch(RESPONSES, ROWS)
    untouched = full.score_batch(RESPONSES, ROWS)
    model = full.model
    for response, length, score, before in zip(RESPONSES, lengths, scores, untouched):
        if length <= limit:
            assert_fp32_paths_agree(score, before, what=response)
            continue
        ids = full.tokenizer(full.render(response, ROWS[0]), add_special_tokens=False,
                             return_tensors="pt")["input_ids"][:, -limit:]
        with torch.no_grad():
            direct = model.score(model.model(input_ids=ids).last_hidden_state[0, -1]).item()
        assert_fp32_paths_agree(score, direct, what=response)
        assert abs(score - before) > 1e-3 * abs(before), (score, before)  # the cut changed what was scored
    assert reward.truncated == sum(length > limit for length in lengths) == 2
    warning = capsys.readouterr().out
    assert warning.count("\n") == 1 and "2 of 5 samples" in warning and f"max-length {limit} tokens" in warning


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU host's placement (the GPU lane runs this file on CUDA)")
def test_on_cpu_the_reward_model_stays_on_the_cpu_and_offload_is_a_no_op(rm_path):
    reward = RewardModelReward(rm_path, offload=True)
    assert reward.device == torch.device("cpu") and next(reward.model.parameters()).device.type == "cpu"
    assert reward.score_batch(RESPONSES, ROWS) == RewardModelReward(rm_path).score_batch(RESPONSES, ROWS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/run.sh runs it)")
def test_on_cuda_the_reward_model_scores_on_the_gpu_and_waits_in_host_memory(rm_path):
    """On a GPU host the model sits on the rank's GPU (accelerator.device()); with offload it waits in host
    memory between calls, its device memory handed back, and scores as the resident one does."""
    resident = RewardModelReward(rm_path)
    assert resident.device.type == "cuda" and next(resident.model.parameters()).is_cuda
    expected = resident.score_batch(RESPONSES, ROWS)
    del resident
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    reward = RewardModelReward(rm_path, offload=True)
    model_bytes = sum(p.numel() * p.element_size() for p in reward.model.parameters())
    assert reward.device.type == "cuda" and next(reward.model.parameters()).device.type == "cpu"
    # Nothing of the model stays on the GPU (less than half its bytes: room for the allocator's own rounding).
    assert torch.cuda.memory_allocated() - before < model_bytes // 2
    assert_fp32_paths_agree(reward.score_batch(RESPONSES, ROWS), expected)
    assert next(reward.model.parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() - before < model_bytes // 2


def test_a_scoring_call_from_a_pool_thread_runs_on_the_models_own_device(rm_path, monkeypatch):
    """--reward-workers > 0 scores in pool threads, whose current CUDA device is cuda:0 whatever the rank set:
    each call makes the model's device (here given explicitly) current, then moves the offloaded model onto
    that device, not accelerator.device(), and back. Recorded through megarl.accelerator's own functions
    (which are no-ops for a CPU device), so the order and the devices are what is checked here."""
    import contextlib
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from megarl import accelerator

    calls, real_context = [], accelerator.device_context

    @contextlib.contextmanager
    def device_context(on):
        calls.append(("enter", on, threading.current_thread().name))
        with real_context(on):
            yield
        calls.append(("exit", on, threading.current_thread().name))

    monkeypatch.setattr(accelerator, "device_context", device_context)
    for name in ("module_to_device", "module_to_host"):
        real = getattr(accelerator, name)
        monkeypatch.setattr(accelerator, name, lambda module, on, name=name, real=real: (
            calls.append((name, on, threading.current_thread().name)), real(module, on))[1])
    device = torch.device("cpu")
    reward = RewardModelReward(rm_path, device=device, offload=True)
    calls.clear()
    with ThreadPoolExecutor(1, thread_name_prefix="megarl-reward") as pool:
        scores = pool.submit(reward.score_batch, RESPONSES, ROWS).result()
    assert [(what, on) for what, on, _ in calls] == [("enter", device), ("module_to_device", device),
                                                      ("module_to_host", device), ("exit", device)]
    assert all(thread.startswith("megarl-reward") for _, _, thread in calls)
    assert scores == RewardModelReward(rm_path, device=device).score_batch(RESPONSES, ROWS)
