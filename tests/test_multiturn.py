"""Multi-turn episodes with tools (megarl/multiturn.py, megarl/tools/): only the policy's tokens train.

The token mask (in-process, naive kernels, TP = 1): a batch of episodes whose responses hold tool-result
tokens between the policy's turns goes through make_micro_batches and ActorLoss as in training. The
loss's gradient on the logits that score a tool token is exactly 0, and changing anything a tool token
carries (its advantage, its rollout and old logprobs, its reference logprob) leaves the loss, the KL and
the mismatch unchanged, while the same change on a policy token moves them (so the check can fail).
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import ROOT, load_script, read_json, reward_rise, torchrun
from megarl.batch import score_and_filter
from megarl.model_runner import make_micro_batches
from megarl.samples import Sample

VOCAB = 32
PLUGIN = ROOT / "tests" / "plugins" / "probe_tools.py"


@pytest.fixture(scope="module")
def tp1():
    from megarl import distributed

    distributed.init_single_process_world()
    yield
    distributed.destroy_single_process_world()


def _episode(prompt, turns, prompt_index=0):
    """A Sample from [(tokens, is_policy)] turns: tool turns get logprob 0, as the episode loop gives them."""
    ids, mask, logprobs = [], [], []
    generator = torch.Generator().manual_seed(len(ids) + 7 * prompt_index)
    for tokens, mine in turns:
        ids += tokens
        mask += [int(mine)] * len(tokens)
        logprobs += (-torch.rand(len(tokens), generator=generator) * 3).tolist() if mine else [0.0] * len(tokens)
    return Sample(prompt_index, prompt, ids, "", logprobs, False, policy_mask=mask)


def _samples():
    return [_episode([1, 5, 6], [([7, 8, 9], True), ([3, 4, 4, 3], False), ([10, 11], True)], 0),
            _episode([1, 5], [([12, 2], True)], 1),  # one turn, no tool
            _episode([1, 6, 6, 7], [([13], True), ([3, 3], False), ([14, 15, 16], True), ([3, 4], False),
                                    ([17, 2], True)], 2),
            Sample(3, [1, 9], [18, 19, 2], "", [-0.5, -1.0, -0.2], False)]  # a plain single-turn sample


def _args(*flags):
    from megarl.arguments import parse_args

    return parse_args(["--model", "artifacts/tiny-qwen2", "--kernels", "naive", "--kl-coef", "0.1",
                       "--kl-placement", "loss", "--tis-level", "token", "--loss-agg", "sample_level",
                       *flags], world_size=1)


def _loss(args, batch, logits, packed=False):
    """ActorLoss on each micro-batch of `batch` (the on-policy shortcut: the mismatch and TIS come from this
    forward), summed; the sums of its metrics."""
    from megarl.loss import ActorLoss, LossTerms

    terms = LossTerms(kl_coef=0.1, on_policy=True)
    loss = ActorLoss(args, VOCAB, terms, output_weight=lambda: None)
    total, sums = 0.0, {}
    for micro_batch, x in zip(make_micro_batches(batch, 2, 0, packed=packed), logits):
        numerator, units, reduced = loss(micro_batch, x, {})
        total = total + numerator / units
        for name, value in reduced["sums"].items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return total, sums


def _batch(samples, width_fields=None):
    batch, _ = score_and_filter(samples, max_new_tokens=16)
    generator = torch.Generator().manual_seed(3)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    # near the random logits' logprobs (about -log 32), where the KL estimators are not clamped
    batch.ref_logprobs = (-3.5 - 0.2 * torch.rand(batch.response_mask.shape, generator=generator)) * batch.response_mask
    return batch


def _logits(batch, packed=False):
    shapes = [b.tokens.shape for b in make_micro_batches(batch, 2, 0, packed=packed)]
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(*shape, VOCAB, generator=generator).requires_grad_() for shape in shapes]


def test_policy_mask_marks_the_policy_tokens_of_each_response():
    batch, _ = score_and_filter(_samples(), max_new_tokens=16)
    assert batch.policy is not None
    assert batch.response_mask[0].tolist()[:9] == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert batch.response_mask[3].tolist()[:4] == [1, 1, 1, 0]
    assert torch.equal(batch.loss_mask, batch.response_mask)
    plain, _ = score_and_filter(_samples()[3:], max_new_tokens=16)
    assert plain.policy is None
    with pytest.raises(ValueError, match="sample 0: policy_mask has 2 entries for 3 response tokens"):
        score_and_filter([Sample(0, [1], [4, 5, 6], "", [0.0] * 3, False, policy_mask=[1, 1])], 16)


@pytest.mark.parametrize("packed", [False, True])
def test_tool_tokens_get_no_gradient_and_do_not_enter_loss_kl_or_mismatch(tp1, packed):
    """Right-padded rows, and packed ones (--padding-free: several episodes end to end in one row)."""
    args = _args()
    batch = _batch(_samples())
    tool = (batch.policy == 0) & (torch.arange(batch.width)[None, :] < torch.tensor(
        [len(s.response_ids) for s in batch.samples])[:, None])
    assert tool.sum() == 8
    logits = _logits(batch, packed)
    total, sums = _loss(args, batch, logits, packed)
    total.backward()
    micro_batches = make_micro_batches(batch, 2, 0, packed=packed)
    scored_tool = 0
    for micro_batch, x in zip(micro_batches, logits):
        for sample, index in enumerate(micro_batch.indices):
            row, columns = micro_batch.response_positions(sample)
            grads = x.grad[row, columns].abs().sum(dim=-1)  # per response token of the sample
            for j, grad in enumerate(grads.tolist()):
                if tool[index, j]:
                    assert grad == 0.0, (index, j)
                    scored_tool += 1
                else:
                    assert grad > 0.0, (index, j)
    assert scored_tool == 8
    assert sums["tokens"] == batch.response_mask.sum().item() == 16.0
    assert sums["mismatch_tokens"] == 16.0

    # Anything a tool token carries changes nothing; the same change on a policy token does.
    def perturbed(where):
        changed = _batch(_samples())
        for name in ("advantages", "ref_logprobs", "rollout_logprobs"):
            value = getattr(changed, name).clone()
            value[where] += 0.5
            setattr(changed, name, value)
        return _loss(args, changed, [x.detach() for x in logits], packed)

    with torch.no_grad():
        same, same_sums = perturbed(tool)
        assert float(same) == float(total)
        assert same_sums == sums
        policy_token = torch.zeros_like(tool)
        policy_token[0, 1] = True
        moved, moved_sums = perturbed(policy_token)
        assert float(moved) != float(total)
        assert moved_sums["mismatch"] != sums["mismatch"] and moved_sums["kl_loss"] != sums["kl_loss"]


# ------------------------------------------------------------------ tools ----
from megarl.tools import (BadCall, CallContext, ToolCall, ToolResult, ToolRunner, TOOLS, parse_hermes, register_tool,
                          row_tools, tool_metrics)  # noqa: E402


def test_hermes_parser_reads_each_call_and_names_what_is_malformed():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2**70 + 1"}}\n'
            '</tool_call><tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["not", "an", "object"]</tool_call><tool_call>{"name": "python", "arguments": 5}</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}')  # unclosed, string args
    calls = parse_hermes(text)
    assert calls[0] == ToolCall("calculator", {"expression": "2**70 + 1"})
    assert isinstance(calls[1], BadCall) and "invalid JSON" in calls[1].error
    assert isinstance(calls[2], BadCall) and "expected" in calls[2].error
    assert isinstance(calls[3], BadCall) and "'arguments' of 'python' must be an object" in calls[3].error
    assert calls[4] == ToolCall("python", {"code": "print(1)"})
    assert parse_hermes("no call here, \\boxed{3}") == []


@register_tool("_test_raises", "raises", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
def _raises(n):
    raise ZeroDivisionError(f"{n} / 0")


@register_tool("_test_hangs", "hangs", {"type": "object", "properties": {}})
def _hangs():
    import time

    time.sleep(3)
    return "late"


def _run(runner, call, allowed=None):
    """A call through the runner to its result (polling, as the episode loop does between engine steps)."""
    import time

    handle = runner.start(call, CallContext({}, 0, 0, 1), allowed)
    for _ in range(2000):
        result = runner.result(handle)
        if result is not None:
            return result
        time.sleep(0.005)
    raise AssertionError("the runner never answered")


def test_every_bad_call_becomes_a_tool_message_with_its_error_kind():
    runner = ToolRunner(["calculator", "_test_raises", "_test_hangs"], workers=2, timeout=0.3)
    try:
        cases = {
            "malformed": (BadCall("malformed tool call: invalid JSON (x at char 3)"), None, "malformed"),
            "unknown": (ToolCall("search", {"q": "x"}), None, "unknown"),
            "not given to this row": (ToolCall("_test_raises", {"n": 1}), ["calculator"], "unknown"),
            "missing argument": (ToolCall("calculator", {}), None, "calculator"),
            "unknown argument": (ToolCall("calculator", {"expression": "1", "x": 2}), None, "calculator"),
            "wrong type": (ToolCall("_test_raises", {"n": "3"}), None, "_test_raises"),
            "raises": (ToolCall("_test_raises", {"n": 3}), None, "_test_raises"),
            "hangs": (ToolCall("_test_hangs", {}), None, "_test_hangs"),
            "not arithmetic": (ToolCall("calculator", {"expression": "__import__('os').system('true')"}), None,
                               "calculator"),
        }
        kinds = {"malformed": "malformed", "unknown": "unknown_tool", "not given to this row": "unknown_tool",
                 "missing argument": "bad_arguments", "unknown argument": "bad_arguments", "wrong type": "bad_arguments",
                 "raises": "raised", "hangs": "timeout", "not arithmetic": "raised"}
        results = {case: _run(runner, call, allowed) for case, (call, allowed, _) in cases.items()}
        for case, result in results.items():
            assert result.error == kinds[case], (case, result)
            assert result.name == cases[case][2], (case, result)
            assert result.content.startswith("error: "), (case, result)
        assert "ZeroDivisionError: 3 / 0" in results["raises"].content
        assert "timed out after 0.3 s" in results["hangs"].content
        assert "must be integer" in results["wrong type"].content
        good = _run(runner, ToolCall("calculator", {"expression": "123456789012345678901234567890 * 3 - 1"}))
        assert (good.error, good.content) == (None, "370370367037037036703703703669")
    finally:
        runner.close()
    traces = [[{"role": "assistant"}, {"role": "tool", **vars(r)}, {"role": "assistant"}] for r in results.values()]
    metrics = tool_metrics([Sample(0, [1], [2, 3, 4], "", [0.0] * 3, False, policy_mask=[1, 0, 1], turns=t)
                            for t in traces])
    assert metrics["turns_mean"] == 2.0 and metrics["tool_calls_per_episode"] == 1.0
    assert (metrics["policy_tokens_mean"], metrics["tool_tokens_mean"]) == (2.0, 1.0)
    assert (metrics["tool_calls_calculator"], metrics["tool_errors_calculator"]) == (3, 3)
    assert (metrics["tool_errors_unknown"], metrics["tool_errors_malformed"]) == (2, 1)
    assert metrics["tool_errors_timeout"] == 1 and metrics["tool_errors_raised"] == 2
    assert not any(name.endswith("search") for name in metrics)  # invented names make no metric
    assert tool_metrics([Sample(0, [1], [2], "", [0.0], False)]) == {}


def test_calculator_is_exact_and_refuses_anything_but_arithmetic():
    calculator = TOOLS["calculator"].function
    assert calculator("98765432109876543210 + 12345678901234567890") == "111111111011111111100"
    assert calculator("(7 - 10) * 4 // 3") == "-4" and calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024"
    for bad in ("x + 1", "print(1)", "'a' * 3", "[1, 2]", "(1).__class__", "9 ** 9 ** 9", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_row_tools_names_or_schemas_among_the_enabled():
    enabled = ["calculator", "python"]
    assert row_tools(None, enabled) == enabled
    assert row_tools(["python"], enabled) == ["python"]
    assert row_tools('[{"type": "function", "function": {"name": "calculator"}}]', enabled) == ["calculator"]
    with pytest.raises(ValueError, match="r.jsonl:3: field 'tools' names search, not enabled by --tools"):
        row_tools(["search"], enabled, "r.jsonl:3")
    with pytest.raises(ValueError, match="must be a list"):
        row_tools(5, enabled)


def test_tool_messages_are_the_template_s_tokens_after_the_assistant_turn():
    from transformers import AutoTokenizer

    from megarl.data.prompts import chat_token_ids
    from megarl.multiturn import TurnMessages, tool_messages

    tokenizer = AutoTokenizer.from_pretrained("artifacts/tiny-qwen2")
    messages = TurnMessages(tokenizer, stop_ids=(0, 2))
    results = tool_messages([ToolResult("calculator", "42"), ToolResult("python", "7\n")])
    turn = "<tool_call>{}</tool_call>"
    chat = [{"role": "user", "content": "q"}]
    # The whole conversation as the template writes it == prompt + the model's turn (ending <|im_end|>) + these.
    prompt = chat_token_ids(tokenizer, chat)
    model_turn = tokenizer.encode(turn) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    whole = chat_token_ids(tokenizer, chat + [{"role": "assistant", "content": turn},
                                              {"role": "tool", "content": "42"}, {"role": "tool", "content": "7\n"}])
    assert prompt + model_turn + messages.ids(results, ended_with_stop=True) == whole
    assert tokenizer.decode(messages.ids(results, True)) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>tool\n7\n<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut by a --stop string has no end-of-turn token: the template's is added.
    assert messages.ids(results, ended_with_stop=False)[:2] == [2] + messages.ids(results, True)[:1]


def test_the_tool_model_trains_on_episodes_as_a_run_renders_them():
    """tools/make_tiny_model.py --tools: a call episode's tokens are the conversation as the chat template
    writes it (the call turn, the calculator's message, the boxed answer), which is what a run shows the
    policy; the loss is on the policy's turns only (none on the prompt or the tool message); the call turn is
    one the run's parser reads as a calculator call worth the answer. A direct row is the plain task's."""
    from megarl.data.prompts import chat_token_ids
    from megarl.tools import TOOLS, ToolCall, parse_hermes

    make = load_script(ROOT / "tools" / "make_tiny_model.py")
    tokenizer = make.build_tokenizer()
    problems = [{"prompt": "What is 605988 + 48068?", "answer": "654056", "call": True},
                {"prompt": "What is 17 + 3?", "answer": "20", "call": False}]
    ids, labels = make.tool_batch(tokenizer, problems)
    call_text = make.tool_call_text("605988 + 48068")
    [call] = parse_hermes(call_text)
    assert isinstance(call, ToolCall) and call.name == "calculator"
    assert TOOLS["calculator"].function(**call.arguments) == "654056"
    user = [{"role": "user", "content": problems[0]["prompt"]}]
    whole = chat_token_ids(tokenizer, user + [{"role": "assistant", "content": call_text},
                                              {"role": "tool", "content": "654056"}]) + \
        tokenizer.encode("\\boxed{654056}<|im_end|>")
    pad = tokenizer.pad_token_id
    assert ids[0, :len(whole)].tolist() == whole and set(ids[0, len(whole):].tolist()) <= {pad}
    trained = labels[0][labels[0] != -100].tolist()
    assert tokenizer.decode(trained) == call_text + "<|im_end|>\\boxed{654056}<|im_end|>"
    prompt = chat_token_ids(tokenizer, [{"role": "user", "content": problems[1]["prompt"]}])
    assert tokenizer.decode(ids[1, len(prompt):][labels[1, len(prompt):] != -100].tolist()) == "\\boxed{20}<|im_end|>"
    assert (labels[1, :len(prompt)] == -100).all()


def test_hostile_programs_through_the_python_tool_end_as_through_the_code_reward():
    """The tool runs programs on the code reward's own pool and limits: each hostile program ends with the same
    status through both (and never runs to completion). The CPU limit is the same limit again
    (test_sandbox.py's loop), left out here for its 5 s."""
    from concurrent.futures import ThreadPoolExecutor

    from megarl.rewards import code

    python = TOOLS["python"].function
    assert python.sandbox_limits == code.LIMITS
    programs = {
        "memory": "x = bytearray(10 * 2**30)\nprint('allocated')",
        "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')",
        "escape": "open('/tmp/megarl-escaped', 'w').write('x')\nprint('wrote')",
        "fork bomb": "import os\nwhile True:\n    os.fork()",
    }
    row = {"test_cases": {"inputs": [""], "outputs": ["never"]}}
    with ThreadPoolExecutor(len(programs) * 2) as pool:
        tool = {name: pool.submit(python, source) for name, source in programs.items()}
        reward = {name: pool.submit(code.score_batch, [f"```python\n{source}\n```"], [row])
                  for name, source in programs.items()}
        for name in programs:
            text, verdict = tool[name].result(), reward[name].result()[0]
            status = re.search(r"^\[([a-z ]+)\]$", text, re.MULTILINE).group(1)  # the tool's status line
            assert status == verdict.reason, (name, text, verdict)
            assert status in ("timeout", "memory limit", "runtime error"), (name, text)
    import os

    assert not os.path.exists("/tmp/megarl-escaped")


# ------------------------------------------------------------ the real engine ----
@pytest.mark.slow
def test_episodes_on_the_engine(tiny_model, tmp_path):
    """tests/workers/multiturn_worker.py on two ranks, one engine at rollout TP = 2 (the leader runs the tools
    and sends their results to the other rank at the engine step where they are taken up; both ranks report
    the same request log and episodes). The tiny model writes no tool calls, so the plugin's
    `always_probe` parser reads each turn as a call of `probe` (tests/plugins/probe_tools.py); the turns
    after it are the engine's own continuations after the template's tool messages.

    Scheduling, from the engine's request log: prompt 0's first-turn tool returns only once every other
    prompt's episodes have ended, and by then the others have run their later turns (a loop that waited for
    every tool before generating again would reach the tool's 50 s limit instead, and the others' turns
    would come after it). Prompt 1's tool raises: the error is its tool message and the episode goes on.
    Masks and logprobs: the rollout's logprobs are 0 exactly on the tool tokens; the trainer's logprobs of
    the policy's tokens equal the rollout's within the run's rounding (before and after an update and a
    sync), while its logprobs of the tool tokens are nowhere near the 0 recorded there (what the mismatch
    would read if they entered it)."""
    from transformers import AutoTokenizer

    out = tmp_path / "report.json"
    torchrun("multiturn_worker.py", out, "--model", tiny_model, "--external-plugins", PLUGIN, "--tools", "probe",
             "--tool-parser", "always_probe", "--max-turns", "3", "--tool-timeout", "60", "--prompts-per-step", "2",
             "--num-generations", "4", "--max-new-tokens", "128", "--micro-batch-size", "4",
             "--rollout-kv-cache-gb", "0.25", "--kl-coef", "0.1", "--train-steps", "2",
             "--rollout-tensor-parallel-size", "2", "--rollout-save-dir", tmp_path / "dumps", nproc=2, timeout=600)
    report = read_json(out)
    assert report["ranks"] == 2 and report["ranks_agree"]
    log = [tuple(event) for event in report["log"]]
    assert report["released_by_others"] and report["done_order"][-1] == 0
    slow_back = min(i for i, (kind, _, prompt, _, turn) in enumerate(log) if kind == "tool_done" and prompt == 0)
    others = [i for i, (kind, _, prompt, _, turn) in enumerate(log) if prompt != 0 and kind == "finish" and turn >= 2]
    assert len(others) >= 6 and max(others) < slow_back, log  # their later turns ran while prompt 0 waited
    steps = [step for _, step, *_ in log]
    assert steps == sorted(steps) and log[slow_back][1] > max(step for _, step, p, *_ in log if p != 0) - 1

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for episode in report["episodes"]:
        mask, logprobs, ids = episode["policy_mask"], episode["logprobs"], episode["response_ids"]
        assert len(mask) == len(logprobs) == len(ids) <= 128
        assert all((lp == 0.0) == (m == 0) for m, lp in zip(mask, logprobs)), episode
        roles = [turn["role"] for turn in episode["turns"]]
        assert roles[:2] == ["assistant", "tool"] and roles.count("assistant") >= 2, episode
        tool_text = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        for turn in episode["turns"]:
            if turn["role"] == "tool":
                assert f"<|im_start|>tool\n{turn['content']}<|im_end|>" in tool_text
        first_tool = episode["turns"][1]
        if episode["prompt"] == 1:
            assert first_tool["error"] == "raised" and "probe failed on purpose" in first_tool["content"]
        else:
            assert first_tool["error"] is None and first_tool["content"].startswith(f"probe {episode['prompt']}.")
    for name in ("mismatch_before", "mismatch_after"):
        measured = report[name]
        assert measured["tool_tokens"] > 0 and measured["policy_tokens"] > 0
        assert measured["policy"]["ratio_dev_max"] <= 1e-3, measured  # as every run's (docs/design.md)
        assert measured["tool_tokens_unmasked"]["mismatch"] > 1.0, measured
        metrics = measured["metrics"]
        assert metrics["tool_calls_probe"] == 16 and metrics["tool_errors_probe"] == 0
        assert 2.0 <= metrics["turns_mean"] <= 3.0 and "tool_wait_seconds" in metrics
    assert len(report["dump"]) == 8
    # Scored: the reward wrote into the samples the step trains on (the arithmetic reward's reasons).
    assert all(record["reason"] in ("correct", "wrong answer", "no box") for record in report["dump"]), report["dump"]
    for record in report["dump"]:
        roles = [turn["role"] for turn in record["conversation"]]
        assert roles[:2] == ["assistant", "tool"]
        last = max(i for i, role in enumerate(roles) if role == "assistant")
        assert record["response"] == record["conversation"][last]["content"]
    _check_user_turns(report["interaction"], tokenizer)
    _check_tips(report["tip"], tokenizer)


def _check_tips(report, tokenizer):
    """math_tip_trick on the engine: every (wrong) first turn is kept without its end-of-turn, followed by
    ms-swift's tip as non-policy tokens and the model's continuation in the same turn, once."""
    from megarl.tools.interactions import SWIFT_MATH_TIP

    tip_ids = tokenizer.encode(SWIFT_MATH_TIP, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for episode in report["episodes"]:
        mask, logprobs, ids, turns = (episode[k] for k in ("policy_mask", "logprobs", "response_ids", "turns"))
        assert all((lp == 0.0) == (m == 0) for m, lp in zip(mask, logprobs)), episode
        assert [t["role"] for t in turns] == ["assistant", "assistant"] and turns[0]["continued"], turns
        start = [i for i in range(len(ids)) if mask[i] == 0]
        assert start and ids[start[0]:start[0] + len(tip_ids)] == tip_ids and len(start) == len(tip_ids), episode
        kept, after = ids[:start[0]], ids[start[0] + len(tip_ids):]
        assert end not in kept and all(mask[:start[0]]) and after and all(mask[start[0] + len(tip_ids):]), episode
        assert turns[0]["content"] == tokenizer.decode(kept, skip_special_tokens=True) + SWIFT_MATH_TIP


def _check_user_turns(report, tokenizer):
    """An environment that answers (--interaction; the plugin's `probe_user`, the built-in `retry` unless its
    row says otherwise), on episodes without tools, 3 assistant turns at most: after each wrong answer the
    user asks again, after a right one the episode ends; the user's tokens are the template's user message
    with policy mask 0 and logprob 0; a user who hangs past the 2 s timeout or raises ends the episode and
    is counted; one who says nothing (None) ends it."""
    from megarl.rewards.arithmetic import arithmetic_reward
    from megarl.tools.interactions import RETRY_MESSAGE

    def right(turn, row):
        return arithmetic_reward(turn["content"], row).score >= 1.0

    asked_again = 0
    for episode in report["episodes"]:
        row, turns = report["rows"][episode["prompt"]], episode["turns"]
        mask, logprobs, ids = episode["policy_mask"], episode["logprobs"], episode["response_ids"]
        assert all((lp == 0.0) == (m == 0) for m, lp in zip(mask, logprobs)), episode
        assert [t["role"] for t in turns][::2] == ["assistant"] * ((len(turns) + 1) // 2), turns
        if "user" in row:  # hung, raised, or ended: no user turn
            assert len(turns) == 1 and not episode["truncated"], episode
            assert turns[0].get("interaction_error") == {"hang": "timeout", "raise": "raised"}.get(row["user"])
            continue
        assert not any("interaction_error" in turn for turn in turns), turns
        for k, turn in enumerate(turns):
            if turn["role"] == "user":
                assert turn["content"] == RETRY_MESSAGE and not right(turns[k - 1], row), turns
                asked_again += 1
        # stopped by a right answer, at 3 turns, or out of tokens
        assert right(turns[-1], row) or len(turns) == 5 or episode["truncated"], turns
        user_text = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        assert user_text.count(f"<|im_start|>user\n{RETRY_MESSAGE}<|im_end|>") == (len(turns) - 1) // 2, user_text
    assert asked_again > 0  # the tiny model answers some of these wrong at T = 1
    assert sum(kind == "reply" for kind, *_ in report["log"]) >= asked_again
    assert report["metrics"]["interaction_errors"] == 8  # 4 samples hung, 4 raised
    assert report["metrics"]["user_turns_per_episode"] == asked_again / 20


@pytest.mark.learning  # the tool model's build and a multi-turn run: outside CI (bash run_tests.sh -m learning)
def test_tool_quickstart_learns(tiny_tool_model, tmp_path):
    """examples/quickstart_grpo_tools.yaml: GRPO on the six-digit task with the calculator, from the tiny tool
    model (tools/make_tiny_model.py --tools, which calls the calculator in about half of its episodes): the
    reward rises (fitted rise, helpers.reward_rise, over seeds 1234, 1, 2: +0.401 / +0.290 / +0.370, mean
    +0.354, spread 0.111: bar +0.13; docs/testing.md, "Learning bars"), by calling the calculator more often
    (the dumps' share of episodes that call it, first step against last), and the dumps show whole
    conversations: the call, the calculator's message, the boxed answer copied from it."""
    import json

    dumps = tmp_path / "dumps"
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo_tools.yaml", "--model",
                      tiny_tool_model, "--log-dir", tmp_path / "tb", "--rollout-save-dir", dumps, timeout=2400)
    line = [text for text in result.stdout.splitlines() if text.startswith("reward: ")][-1]
    assert reward_rise(tmp_path / "tb") >= 0.13, (reward_rise(tmp_path / "tb"), line)

    steps = sorted(dumps.glob("train_step*.jsonl"), key=lambda path: int(path.stem.removeprefix("train_step")))
    records = {path: [json.loads(text) for text in path.read_text().splitlines()] for path in steps}

    def call_share(episodes):
        return sum(bool(r["conversation"][0]["tool_calls"]) for r in episodes) / len(episodes)

    shares = call_share(records[steps[0]]), call_share(records[steps[-1]])
    print(f"{line}; episodes calling the calculator: {shares[0]:.3f} -> {shares[1]:.3f}")  # seen with -s
    assert shares[1] > shares[0], shares
    whole = ["assistant", "tool", "assistant"]  # the call, the calculator's message, the answer
    solved = [r for episodes in records.values() for r in episodes
              if r["reward"] == 1.0 and [turn["role"] for turn in r["conversation"]] == whole]
    assert solved
    from megarl.tools import TOOLS

    copied = 0
    for record in solved:
        call, tool, final = record["conversation"]
        assert call["tool_calls"][0]["name"] == "calculator" and "<tool_call>" in call["content"]
        assert tool["name"] == "calculator" and tool["error"] is None
        # The tool message is the calculator's value of the call the policy wrote (a miscopied operand
        # gives a wrong sum that a miscopied result can still turn right: rare, but not an error).
        assert tool["content"] == str(TOOLS["calculator"].function(**call["tool_calls"][0]["arguments"]))
        assert record["response"] == final["content"]
        operands = re.search(r"What is (\d+) \+ (\d+)\?", record["prompt"]).groups()
        right_sum = tool["content"] == str(sum(map(int, operands)))
        copied += right_sum and f"\\boxed{{{tool['content']}}}" in final["content"]
    assert copied >= len(solved) / 2, (copied, len(solved))  # solved, mostly, by the right call and its copy


def test_the_tool_task_lists_the_enabled_tools_to_the_template_and_draws_big_numbers():
    """--task-max-operand makes the built-in task's numbers too long to add by heart; the prompts list the
    --tools through the chat template's `tools=` (a template that writes the tools' names, standing in for
    Qwen's tool section: the tiny model's template ignores them), a row's `tools` field picking among them."""
    from transformers import AutoTokenizer

    from megarl.arguments import parse_args
    from megarl.data.datasets import Row, make_prompts
    from megarl.data.sources import prompt_source

    tokenizer = AutoTokenizer.from_pretrained("artifacts/tiny-qwen2")
    tokenizer.chat_template = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    args = parse_args(["--model", "artifacts/tiny-qwen2", "--tools", "calculator,python", "--task-max-operand",
                       str(10 ** 15), "--max-prompt-length", "120"], world_size=1)
    prompts = prompt_source(args, tokenizer, None).batch(0)
    text = tokenizer.decode(prompts[0].ids)
    assert text.startswith("[calculator;python;]What is ")
    assert max(len(p.metadata["answer"]) for p in prompts) >= 14
    rows = [Row("a", [{"role": "user", "content": "x"}], extra={"tools": ["python"]}, origin="f.jsonl:1"),
            Row("b", [{"role": "user", "content": "y"}], extra={"tools": ["search"]}, origin="f.jsonl:2")]
    assert tokenizer.decode(make_prompts(rows[:1], tokenizer, tools=args.tools)[0].ids) == "[python;]x"
    with pytest.raises(Exception, match="f.jsonl:2: field 'tools' names search, not enabled by --tools"):
        make_prompts(rows, tokenizer, tools=args.tools)
    assert tokenizer.decode(make_prompts(rows[:1], tokenizer)[0].ids) == "x"  # no --tools: no tools listed


def test_tool_options_are_checked_in_one_line():
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError

    def refused(*flags):
        with pytest.raises(ConfigError) as error:
            parse_args(["--model", "artifacts/tiny-qwen2", *flags], world_size=1)
        return str(error.value)

    assert "--tools: search not registered" in refused("--tools", "calculator,search")
    assert "--tools: --rollout-backend hf" in refused("--tools", "calculator", "--rollout-backend", "hf")
    assert "--max-turns" in refused("--tools", "calculator", "--max-turns", "0")
    assert "--tool-timeout" in refused("--tool-timeout", "0")
    assert "--tools: --seq-kd" in refused("--tools", "calculator", "--teacher-model", "artifacts/tiny-qwen2",
                                          "--seq-kd")
    assert "--task-max-operand must be >= 1" in refused("--task-max-operand", "0")
    assert "--interaction: retyr not registered (did you mean 'retry'?)" in refused("--interaction", "retyr")
    assert "--interaction: --rollout-backend hf" in refused("--interaction", "retry", "--rollout-backend", "hf")
    args = parse_args(["--model", "artifacts/tiny-qwen2", "--tools", " calculator, python "], world_size=1)
    assert args.tools == ["calculator", "python"]
    assert parse_args(["--model", "artifacts/tiny-qwen2"], world_size=1).tools == []


@pytest.mark.parametrize("text,kept", [("Let me see. <answer>7</answer>", "Let me see. "),
                                       ("a</think>b<answer>c", "a"), ("no marker at all", "no marker at all")])
def test_a_continue_cuts_its_turn_before_the_marker_and_drops_the_end_of_turn(text, kept, tiny_model):
    from transformers import AutoTokenizer

    from megarl.multiturn import _Episode, continue_turn
    from megarl.tools.interactions import Continue

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    before = tokenizer.encode("<|im_start|>tool\nx<|im_end|>\n", add_special_tokens=False)  # an earlier turn's
    turn = tokenizer.encode(text, add_special_tokens=False) + [end]
    episode = _Episode(0, 0, [1, 2], {}, response_ids=before + turn, policy_mask=[0] * len(before) + [1] * len(turn),
                       logprobs=[0.0] * len(before) + [-0.5] * len(turn),
                       turns=[{"role": "assistant", "content": text}], turn_start=len(before))
    ids = continue_turn(episode, Continue("TIP!", ("<answer>", "</think>")), tokenizer, (end,))
    assert episode.response_ids[:len(before)] == before and tokenizer.decode(episode.response_ids[len(before):]) == kept
    assert len(episode.policy_mask) == len(episode.logprobs) == len(episode.response_ids)
    assert episode.policy_mask[len(before):] == [1] * (len(episode.response_ids) - len(before))
    assert tokenizer.decode(ids) == "TIP!" and episode.turns[-1] == {"role": "assistant", "content": kept + "TIP!",
                                                                     "continued": True}


def test_verls_gsm8k_tool_and_swifts_tip_interaction():
    """calc_gsm8k_reward (verl's Gsm8kTool): verl's flexible rule against the episode's row, its reply text.
    math_tip_trick_multi_turn (ms-swift's scheduler): a wrong answer gets ms-swift's tip once, a right one ends."""
    from megarl.tools import _CONTEXT
    from megarl.tools.interactions import INTERACTIONS, SWIFT_TIP_MESSAGE

    gsm8k = TOOLS.get("calc_gsm8k_reward").function
    token = _CONTEXT.set(CallContext(row={"gt_answer": "72"}, prompt_index=0, sample=0, turn=1))
    try:
        assert gsm8k("72") == "Current parsed answer='72' reward=1.0"
        assert gsm8k("#### 72") == "Current parsed answer='#### 72' reward=1.0"
        assert gsm8k("it is 71") == "Current parsed answer='it is 71' reward=0.0"
        assert gsm8k(72) == "Current parsed answer='72' reward=1.0"  # a number argument, as verl str()s it
    finally:
        _CONTEXT.reset(token)
    respond = INTERACTIONS.get("math_tip_trick_multi_turn")(None)
    context = CallContext(row={"solution": "\\boxed{7}", "gt_answer": "7"}, prompt_index=0, sample=0, turn=1)
    wrong = [{"role": "assistant", "content": "so \\boxed{8}"}]
    assert respond(wrong, context) == SWIFT_TIP_MESSAGE
    assert respond(wrong + [{"role": "user", "content": SWIFT_TIP_MESSAGE}] + wrong, context) is None  # once
    assert respond([{"role": "assistant", "content": "so \\boxed{7}"}], context) is None
