"""bench/e2e.py's pure bookkeeping: the compute floor's matmul FLOPs (with the causal attention) and
TRL's micro-batches under the sweep's token budget. The bench itself runs megarl, TRL and vLLM and is
run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from helpers import ROOT, load_script

e2e = load_script(ROOT / "bench" / "e2e.py")


def test_matmul_flops_counts_causal_attention_by_hand():
    # 6 x 1000 parameters x (2 + 3) tokens = 30,000; the causal pairs 2*3/2 + 3*4/2 = 3 + 6 = 9, each
    # 2 x 4 FLOPs per matmul, 2 matmuls, x 3 for forward + backward, 2 layers: 9 x 8 x 2 x 3 x 2 = 864.
    assert e2e.matmul_flops(1000, [2, 3], layers=2, attention_width=4) == 30_000 + 864


def test_attention_share_of_the_bench_model_at_2048_tokens():
    # The bench's 34.0M-parameter model, one sequence of 34 prompt + 2048 response tokens: per token
    # 6N = 203.8 MFLOP and the attention 12 x 12 layers x 512 x (2082 + 1) / 2 = 76.8 MFLOP, 37.7% of 6N.
    s = 34 + 2048
    total = e2e.matmul_flops(33_971_200, [s], e2e.MODEL["num_hidden_layers"], e2e.attention_width())
    attention = total - 6 * 33_971_200 * s
    assert e2e.attention_width() == 512
    assert attention == 12 * 12 * 512 * s * (s + 1) // 2
    assert attention / (6 * 33_971_200 * s) == pytest.approx(0.3768, abs=1e-4)


def test_train_floor_per_step_from_the_samples_lengths():
    steps = e2e.train_floor(1000, [[3, 4], [4]], rate=10.0)
    layers, width = e2e.MODEL["num_hidden_layers"], e2e.attention_width()
    assert [step["tokens"] for step in steps] == [3 + 4, 4]
    first = 6 * 1000 * 7 + 12 * layers * width * (3 * 4 // 2 + 4 * 5 // 2)
    assert steps[0]["seconds"] == pytest.approx(first / 10.0)
    assert steps[0]["attention"] == pytest.approx(1 - 6 * 1000 * 7 / first)


@pytest.mark.parametrize("longest, k", [(51, 1), (162, 2), (546, 8), (2082, 32), (5000, 32)])
def test_trl_micro_batches_fit_the_token_budget(longest, k):
    # 32 samples in micro-batches of 32 / k rows, each row padded to the longest sample, <= 4096 tokens:
    # 32 x 51 = 1632 fits; 32 x 162 = 5184 does not, 16 x 162 does; 8 x 546 = 4368 does not, 4 x 546
    # does; 2 x 2082 does not, so one sample each; a sample over the budget alone, as in megarl.
    assert e2e.trl_micro_batches(32, longest, budget=4096) == k


def _megarl(step: float, generate: float, update: float, length: int, prompts: list[int]) -> dict:
    """Three steps of megarl scalars, the first (the warm-up) far off; each step trains the prompts + length."""
    tokens = sum(prompts) + length * len(prompts)
    return {"step_seconds": [999.0, step, step], "generate_seconds": [99.0, generate, generate],
            "update_seconds": [99.0, update, update], "response_length_mean": [float(length)] * 3,
            "tokens_per_second": [tokens / 999.0, tokens / step, tokens / step]}


def test_print_sweep_ratios_and_goals(capsys):
    samples = e2e.JOB["prompts"] * e2e.JOB["generations"]
    prompts = [30] * (samples // 2) + [34] * (samples // 2)
    parameters, rate, bare = 1_000_000, 1e9, 2.0
    results, training = {}, {}
    for length, ratio, trl_ratio in ((16, 1.2, 1.5), (64, 1.38, 0.9)):
        flops = e2e.matmul_flops(parameters, [p + length for p in prompts], e2e.MODEL["num_hidden_layers"],
                                 e2e.attention_width())
        training[length] = flops / rate
        step = ratio * (training[length] + bare)
        results[length] = {"megarl": _megarl(step, 1.0, 1.4 * training[length], length, prompts),
                           "prompts": [prompts] * 3, "bare": bare,
                           "trl": {"transformers": {"step_seconds": [999.0, trl_ratio * step, trl_ratio * step],
                                                    "generated_tokens": [float(length * samples)] * 3},
                                   "vllm": {"error": "AttributeError: no weight_loader"}}}
    goals = e2e.print_sweep(results, parameters, rate, warmup=1)
    out = capsys.readouterr().out
    assert goals["step/floor"] == pytest.approx({16: 1.2, 64: 1.38})
    assert goals["update/floor"] == pytest.approx({16: 1.4, 64: 1.4})
    assert goals["spread"] == pytest.approx(0.15)
    assert goals["TRL best/megarl"] == pytest.approx({16: 1.5, 64: 0.9})
    assert "WARNING" not in out  # the token counts agree and every response is L long
    assert "TRL vllm           failed: AttributeError: no weight_loader" in out
    assert "megarl per step    step 999.00 " in out  # the warm-up step is shown, though not in the medians
    goal_lines = out.split("goals (printed, not asserted):")[1].strip().splitlines()
    assert [line.rsplit(": ", 1)[1] for line in goal_lines] == ["missed", "met", "missed", "missed"]


def test_print_sweep_warns_on_a_response_not_l_long(capsys):
    samples = e2e.JOB["prompts"] * e2e.JOB["generations"]
    prompts = [32] * samples
    run = _megarl(10.0, 1.0, 5.0, 16, prompts)
    run["response_length_mean"][2] = 15.5  # a response stopped early: the floor's tokens and L disagree
    e2e.print_sweep({16: {"megarl": run, "prompts": [prompts] * 3, "bare": 1.0, "trl": {}}}, 1_000_000, 1e9, 1)
    out = capsys.readouterr().out
    assert "are not all 16" in out and "the floor counts" in out
    assert "not measured at [16]" in out


def test_a_trl_run_stopped_at_its_time_limit_counts_as_a_lower_bound(capsys):
    # Stopped in step 3 (index 2) after 500 s of it: steps 2 and 3 started after the warm-up, at least
    # 400 and 500 s; the median of what was counted, 450, bounds the run's median from below.
    stopped = {"step_seconds": [900.0, 400.0], "generated_tokens": [],
               "cut_short": {"timeout": 1800.0, "running_step_seconds": 500.0}}
    assert e2e.trl_seconds_per_step(stopped, warmup=1) == (450.0, True)
    between = {**stopped, "cut_short": {"timeout": 1800.0, "running_step_seconds": None}}
    assert e2e.trl_seconds_per_step(between, warmup=1) == (400.0, True)
    only_warmup = {"step_seconds": [], "generated_tokens": [],
                   "cut_short": {"timeout": 1800.0, "running_step_seconds": 1790.0}}
    assert e2e.trl_seconds_per_step(only_warmup, warmup=1) == (1790.0, True)  # the warm-up step, lacking others
    finished = {"step_seconds": [900.0, 400.0, 420.0], "generated_tokens": [64.0] * 3}
    assert e2e.trl_seconds_per_step(finished, warmup=1) == (410.0, False)

    samples = e2e.JOB["prompts"] * e2e.JOB["generations"]
    prompts = [32] * samples
    run = _megarl(100.0, 40.0, 60.0, 16, prompts)
    e2e.print_sweep({16: {"megarl": run, "prompts": [prompts] * 3, "bare": 1.0,
                          "trl": {"transformers": stopped}}}, 1_000_000, 1e9, 1)
    out = capsys.readouterr().out
    assert "  >450.00 " in out and "stopped at --trl-timeout 1800 s: 2 steps done" in out
    assert "WARNING" not in out  # a stopped run's token counts are not read
    lead = out.split("megarl ahead of TRL's best mode")[1]
    assert "L=16 4.50" in lead and lead.rstrip().endswith("met")
