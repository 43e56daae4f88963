"""Distillation end to end on real torchrun ranks: GKD and OPSD with a teacher colocated on the train
ranks or on standalone vLLM ranks, --gkd-lmbda / --seq-kd, a crash on a teacher rank, the distillation
quickstart's learning, and the one-line configuration errors."""

import os
import re
import subprocess
import sys

import pytest

from helpers import FP32_PATHS_ULPS, ROOT, assert_signal_alive, length_reward_plugin, read_json, scalars, torchrun

from megarl.arguments import parse_args
from megarl.errors import ConfigError

SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "8",
         "--rollout-kv-cache-gb", "1", "--train-steps", "3"]


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory) -> str:
    """Another tiny model with the built-in tokenizer: same vocabulary, different weights."""
    out = tmp_path_factory.mktemp("teacher") / "tiny-teacher"
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(out), "--seed", "1", "--steps", "150",
                    "--quiet"], cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   timeout=600)
    return str(out)


@pytest.fixture(scope="module")
def other_shape_teacher(tiny_model, tmp_path_factory) -> str:
    """A random Qwen2 with the built-in vocabulary but other shapes (hidden size 64, not 128)."""
    from transformers import AutoConfig

    from helpers import make_random_model

    return make_random_model(tmp_path_factory.mktemp("other_shape"), "qwen2", True, seed=9,
                             vocab_size=AutoConfig.from_pretrained(tiny_model).vocab_size)


LAYOUTS = {
    # name: (config, extra flags, distillation loss tags expected); "{teacher}" is the teacher checkpoint
    "rollout-colocate-topk-renorm": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                                     ["--teacher-model", "{teacher}"], True),
    "rollout-separate-topk-tail-rl": ("examples/gkd/rollout_separate_teacher_colocate.yaml",
                                      ["--teacher-model", "{teacher}"], True),
    # The third seed layout: rank 0 trains and generates, rank 1 is a vLLM teacher engine.
    "rollout-colocate-teacher-standalone": ("examples/gkd/rollout_colocate_teacher_standalone.yaml",
                                            ["--standalone-teacher-model", "{teacher}"], True),
    # Full vocabulary at TP=2 with the JSD mixture (beta 0.5): vocabulary-parallel, never gathered.
    "colocate-full-vocabulary-tp2": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                                     ["--teacher-model", "{teacher}", "--gkd-logits-topk", "0", "--gkd-beta", "0.5",
                                      "--tensor-model-parallel-size", "2"], False),
    # The policy-gradient form alone: the teacher's per-token reverse KL as a negative reward.
    "policy-gradient-form": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                             ["--teacher-model", "{teacher}", "--gkd-logits-topk", "0", "--distill-coef", "0",
                              "--policy-loss-coef", "1", "--distill-reward-coef", "1", "--reward", "arithmetic"],
                             False),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_few_distillation_steps(layout, tiny_model, teacher_model, tmp_path):
    config, extra, topk = LAYOUTS[layout]
    extra = [flag.format(teacher=teacher_model) for flag in extra]
    result = torchrun("../../megarl/train.py", "--config", config, "--model", tiny_model, *SMALL, *extra,
                      "--log-dir", tmp_path / "tb", timeout=900)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, result.stdout[-3000:]
    series = {tag: list(values.values()) for tag, values in scalars(
        tmp_path / "tb", ["distill_loss", "teacher_topk_mass", "teacher_seconds", "teacher_kl"]).items()}
    # Two different models: the divergences are positive from the first step on.
    assert len(series["teacher_kl"]) == 3 and min(series["teacher_kl"]) > 0, series
    if "--distill-coef" in extra:  # the policy-gradient form only: no distillation loss term
        assert "distill_loss" not in series, series
        return
    assert len(series["distill_loss"]) == 3 and min(series["distill_loss"]) > 0, series
    if topk:
        assert all(0.0 < mass <= 1.0 for mass in series["teacher_topk_mass"]), series
        assert len(series["teacher_seconds"]) == 3, series
    else:
        assert "teacher_topk_mass" not in series


QWEN3_5_RUNS = {
    # GRPO (policy loss on a reward whose groups always differ: the response's length) plus top-k GKD from a
    # colocated Qwen3.5 teacher in the released multimodal layout, rollout on its own rank (ms-swift's second
    # layout): the weight sync to a separate vLLM engine of Gated DeltaNet layers every step.
    "grpo-topk-separate": ("examples/gkd/rollout_separate_teacher_colocate.yaml", ["--reward", "response_length"]),
    # Full-vocabulary GKD (the JSD mixture) at TP 2, everything colocated: the GDN heads and their delta-rule
    # states split over TP in both the student and the teacher.
    "gkd-full-vocabulary-tp2": ("examples/gkd/rollout_colocate_teacher_colocate.yaml",
                                ["--gkd-logits-topk", "0", "--gkd-beta", "0.5", "--tensor-model-parallel-size", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", list(QWEN3_5_RUNS))
def test_qwen3_5_grpo_and_distillation_steps(run, random_qwen3_5_policy, random_qwen3_5_teacher, tmp_path):
    """Three steps of a Qwen3.5 student with a Qwen3.5 teacher (the seeds' GKD pair): every step trains (a
    gradient, a positive divergence to the teacher), and the rollout engine's logprobs of its own samples match
    the trainer's after every sync (the mismatch at fp32 rounding: a sync or a layout that got one tensor wrong
    would move it by orders of magnitude)."""
    config, extra = QWEN3_5_RUNS[run]
    result = torchrun("../../megarl/train.py", "--config", config, "--model", random_qwen3_5_policy,
                      "--teacher-model", random_qwen3_5_teacher, "--external-plugins", length_reward_plugin(tmp_path),
                      *SMALL, *extra, "--log-dir", tmp_path / "tb", timeout=900)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, result.stdout[-3000:]
    assert "left out 21 vision-tower tensors (model.visual.*) and 2 multi-token-prediction (MTP) head tensors" \
        in result.stdout, result.stdout[-3000:]
    series = scalars(tmp_path / "tb", ["distill_loss", "teacher_kl", "grad_norm", "mismatch", "reward_std"])
    assert_signal_alive(tmp_path / "tb", steps=(0, 1, 2), what=run, advantages="--reward" in extra)
    assert min(series["teacher_kl"].values()) > 0 and min(series["distill_loss"].values()) > 0, series
    assert max(series["mismatch"].values()) < 1e-4, series
    if "--reward" in extra:  # the policy loss has a signal: the groups' rewards differ
        assert min(series["reward_std"].values()) > 0, series


BAD = [
    (["--gkd-logits-topk", "8"], ["--gkd-logits-topk needs a teacher", "--teacher-model"]),
    (["--policy-loss-coef", "0"], ["--policy-loss-coef 0 needs a teacher"]),
    (["--distill-reward-coef", "1"], ["--distill-reward-coef needs a teacher"]),
    (["--teacher-model", "{model}", "--teacher-gpus", "1"], ["teacher_model=", "teacher.gpus=1", "both set"]),
    (["--teacher-gpus", "1", "--gkd-logits-topk", "8"], ["teacher.gpus=1 needs teacher.model"]),
    (["--standalone-teacher-model", "{model}", "--gkd-logits-topk", "8"], ["teacher.model=", "needs teacher.gpus"]),
    (["--teacher-gpus", "1", "--standalone-teacher-model", "{model}"],
     ["teacher.gpus=1", "needs gkd_logits_topk"]),
    (["--teacher-gpus", "1", "--standalone-teacher-model", "{model}", "--gkd-logits-topk", "16",
      "--teacher-engine-kwargs", '{{"max_logprobs": 8}}'],
     ["teacher.engine_kwargs.max_logprobs=8 < gkd_logits_topk=16"]),
    (["--teacher-gpus", "1", "--standalone-teacher-model", "{random}", "--gkd-logits-topk", "8"],
     ["vocab_size=250", "one vocabulary"]),
    (["--teacher-gpus", "1", "--standalone-teacher-model", "{model}", "--gkd-logits-topk", "8", "--train-gpus", "2"],
     ["placement needs 3 ranks", "teacher.gpus=1", "but 2 were launched"]),
    (["--teacher-gpus", "1", "--standalone-teacher-model", "{model}", "--gkd-logits-topk", "8",
      "--gkd-topk-mode", "tail", "--gkd-temperature", "2"], ["gkd_temperature=2.0", "gkd_topk_mode=tail", "renorm"]),
    (["--teacher-model", "{wide}", "--seq-kd"], ["--seq-kd with teacher_model=", "hidden_size differs",
                                                   "standalone teacher ranks"]),
    (["--gkd-lmbda", "0.5"], ["--gkd-lmbda needs a teacher"]),
    (["--teacher-model", "{model}", "--gkd-lmbda", "1.5"], ["--gkd-lmbda must be in [0, 1]"]),
    (["--teacher-model", "{model}", "--gkd-beta", "1.5"], ["--gkd-beta must be in [0, 1]"]),
    (["--teacher-model", "{random}"], ["vocab_size=250", "vocab_size", "one vocabulary"]),
]


@pytest.mark.parametrize("flags,words", BAD)
def test_distillation_configuration_errors_are_one_line(flags, words, tiny_model, random_qwen2_tied,
                                                       other_shape_teacher):
    argv = ["--model", tiny_model] + [f.format(model=tiny_model, random=random_qwen2_tied, wide=other_shape_teacher)
                                      for f in flags]
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=2)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def _arithmetic_rows(path, teacher_prompts: bool) -> str:
    """The built-in task in ms-swift's layout; with teacher_prompts, every other row carries a
    privileged teacher prompt that states the answer (OPSD), the others fall back to plain GKD."""
    import json

    from megarl.data.tasks import arithmetic

    rows = []
    for i, problem in enumerate(arithmetic.make_problems(16, seed=3)):
        row = {"id": f"p{i}", "messages": [{"role": "user", "content": problem["prompt"]}],
               "solution": problem["answer"]}
        if teacher_prompts and i % 2 == 0:
            row["teacher_prompt"] = f"The answer is {problem['answer']}. {problem['prompt']}"
        rows.append(row)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
def test_opsd_rows_are_scored_after_the_teacher_prompt(tiny_model, teacher_model, tmp_path):
    """Same student samples (same seeds, prompts and weights) with and without teacher prompts: the
    teacher's view of them, and so the full-vocabulary distillation loss, changes only through its
    privileged prompt. Top-k OPSD is checked in test_standalone_teacher_topk_equals_the_colocated_teachers:
    the colocated teacher's top-k of OPSD rows equals the standalone one's and differs from the plain
    prompt's (one run there instead of two more here: CI's 60 minutes)."""
    kl = {}
    extra = ["--gkd-logits-topk", "0"]
    for opsd in (False, True):
        log_dir = tmp_path / f"tb_{opsd}"
        torchrun("../../megarl/train.py", "--config", "examples/gkd/rollout_colocate_teacher_colocate.yaml",
                 "--model", tiny_model, "--teacher-model", teacher_model, *SMALL, "--train-steps", "2", *extra,
                 "--train-data", _arithmetic_rows(tmp_path / f"rows_{opsd}.jsonl", opsd), "--reward", "boxed",
                 "--system-prompt", "", "--log-dir", log_dir, timeout=900)
        series = scalars(log_dir, ["teacher_kl", "reward_mean", "distill_loss"])
        assert len(series["distill_loss"]) == 2 and min(series["distill_loss"].values()) > 0, series
        kl[opsd] = series
    assert kl[True]["reward_mean"][0] == kl[False]["reward_mean"][0]  # the student sampled the same responses
    assert kl[True]["teacher_kl"][0] != kl[False]["teacher_kl"][0], kl
    assert kl[True]["distill_loss"][0] != kl[False]["distill_loss"][0], kl


def _self_distill_config(tmp_path) -> str:
    """The colocated GKD example without its teacher_model (--self-distill's teacher is the policy's)."""
    import yaml

    config = yaml.safe_load((ROOT / "examples/gkd/rollout_colocate_teacher_colocate.yaml").read_text())
    del config["teacher_model"]
    path = tmp_path / "self_distill.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_self_distillation_teacher_is_the_fixed_initial_policy(tiny_model, tmp_path):
    """--self-distill (OPSD's fixed teacher, ms-swift opsd.sh) on plain rows, with GRPO moving the student
    and a KL term whose reference is the teacher's weights (one copy): at the first step the teacher is
    the student (teacher_kl 0 up to rounding: the same weights on the same tokens), later the student has
    moved and the teacher has not (teacher_kl > 0). A teacher that followed the policy would read 0
    at every step; one that lost its weights would not read 0 at the first."""
    log_dir = tmp_path / "tb"
    torchrun("../../megarl/train.py", "--config", _self_distill_config(tmp_path),
             "--model", tiny_model, "--self-distill", *SMALL, "--train-steps", "3", "--gkd-logits-topk", "8",
             "--policy-loss-coef", "1", "--reward", "boxed", "--kl-coef", "0.01", "--kl-estimator", "k1",
             "--lr", "1e-3",
             "--train-data", _arithmetic_rows(tmp_path / "rows.jsonl", False), "--system-prompt", "",
             "--log-dir", log_dir, timeout=900)
    series = scalars(log_dir, ["teacher_kl", "distill_loss", "kl_ref", "grad_norm", "reward_std",
                               "advantage_abs_mean"])
    assert_signal_alive(series, steps=(0, 1), what="self-distillation")
    assert abs(series["teacher_kl"][0]) < 1e-6 and abs(series["kl_ref"][0]) < 1e-6, series
    assert series["teacher_kl"][2] > 1e-4, series  # the student moved away from its fixed initial self
    # The reference is the teacher's weights: the same k1 gap of the same tokens.
    assert series["kl_ref"][2] == pytest.approx(series["teacher_kl"][2], rel=1e-3), series


@pytest.mark.slow
def test_self_distillation_with_lora_scores_opsd_rows_on_the_policys_base(tiny_model, tmp_path):
    """--self-distill with LoRA: the teacher is the policy's own model with its adapters off. Same run, the
    same teacher given as a separate copy (--teacher-model at another path naming the same checkpoint,
    loaded as any teacher): every step's teacher_kl and distillation loss agree. Half the rows are OPSD
    rows whose privileged prompt changes the teacher's view, so the first step's teacher_kl is not 0 (the
    adapters start at B = 0: on plain rows student and teacher would agree)."""
    copy = tmp_path / "same-checkpoint"
    copy.symlink_to(os.path.abspath(tiny_model), target_is_directory=True)
    rows = _arithmetic_rows(tmp_path / "rows.jsonl", True)
    series = {}
    for name, teacher in (("base", ["--self-distill"]), ("copy", ["--teacher-model", str(copy)])):
        torchrun("../../megarl/train.py", "--config", _self_distill_config(tmp_path),
                 "--model", tiny_model, *teacher, *SMALL, "--train-steps", "2", "--gkd-logits-topk", "0",
                 "--lora-rank", "8", "--lora-alpha", "16", "--lr", "5e-3", "--train-data", rows,
                 "--reward", "boxed", "--system-prompt", "", "--log-dir", tmp_path / name, timeout=900)
        series[name] = scalars(tmp_path / name, ["teacher_kl", "distill_loss", "grad_norm"])
    base, copy_series = series["base"], series["copy"]
    assert abs(base["teacher_kl"][0]) > 1e-3 and min(base["grad_norm"].values()) > 0, base
    for tag in ("teacher_kl", "distill_loss"):
        for step in (0, 1):
            assert base[tag][step] == pytest.approx(copy_series[tag][step], rel=1e-4, abs=1e-6), (tag, series)


def test_self_distillation_refusals(tiny_model):
    for argv, words in (
            (["--self-distill", "--teacher-model", tiny_model], ["--self-distill", "--teacher-model"]),
            (["--self-distill", "--seq-kd", "--gkd-lmbda", "0.5"], ["--seq-kd", "--self-distill"])):
        with pytest.raises(ConfigError) as error:
            parse_args(["--model", tiny_model, "--policy-loss-coef", "0", *argv], world_size=1)
        assert "\n" not in str(error.value) and all(word in str(error.value) for word in words), str(error.value)
    args = parse_args(["--model", tiny_model, "--policy-loss-coef", "0", "--self-distill"], world_size=1)
    assert args.teacher_model == args.model


TP2_ENGINE = ["--teacher-gpus", "2", "--teacher-tensor-parallel-size", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("engines,models", [
    # two engines, each scoring its shard: -m variants; CI runs the TP=2 engine
    pytest.param(["--teacher-gpus", "2"], ("tiny_model", "teacher_model"), marks=pytest.mark.variants,
                 id="two-engines-tp1"),
    pytest.param(TP2_ENGINE, ("tiny_model", "teacher_model"), id="one-engine-tp2"),
    # a Qwen3.5 student and teacher (the teacher in the released multimodal layout): vLLM's Gated DeltaNet
    # prefill of every prompt against Megatron's
    pytest.param(TP2_ENGINE, ("random_qwen3_5_policy", "random_qwen3_5_teacher"), id="qwen3_5-one-engine-tp2")])
def test_standalone_teacher_topk_equals_the_colocated_teachers(engines, models, request, tmp_path):
    """The vLLM teacher's top-k (prompt_logprobs) and the Megatron teacher's (top-k over vocabulary
    shards) on the same student samples, half of them OPSD rows whose teacher prompt is longer.
    Rank 0 trains and generates, ranks 1-2 are the standalone teacher."""
    model, teacher = (request.getfixturevalue(name) for name in models)
    out = tmp_path / "report.json"
    torchrun("teacher_parity_worker.py", out, "--config", "examples/gkd/rollout_colocate_teacher_standalone.yaml",
             "--model", model, "--standalone-teacher-model", teacher, *SMALL, "--gkd-logits-topk", "8",
             *engines, nproc=3, timeout=900)
    report = read_json(out)
    assert report["opsd_rows"] > 0 and report["opsd_prompt_longer"], report
    # Ids are compared where the teacher's ranking is not a near-tie (adjacent top-k logprobs > 1e-4 apart).
    assert report["clear_positions"] >= 0.8 * report["positions"] and report["opsd_clear_positions"] > 0, report
    assert report["ids_differ_where_clear"] == 0, report
    assert report["topk_logprob_ulps"] <= FP32_PATHS_ULPS and report["sampled_logprob_ulps"] <= FP32_PATHS_ULPS, report
    assert report["opsd_vs_plain_max_diff"] > 1e-2, report  # the privileged prompt did change the teacher's view


@pytest.mark.slow
@pytest.mark.soak  # CI ends a run from a failing rollout rank in each placement (test_train_e2e.py)
def test_a_crash_on_a_teacher_rank_ends_every_rank(tiny_model, teacher_model):
    # The launcher must end every rank: the torchrun timeout (a hang guard) is inside the 10-minute
    # collective timeout that would otherwise end them.
    result = torchrun("crash_worker.py", "--config", "examples/gkd/rollout_colocate_teacher_standalone.yaml",
                      "--model", tiny_model, "--standalone-teacher-model", teacher_model, *SMALL, "--train-steps", "5",
                      env={"MEGARL_TEST_FAIL_RANK": "1"}, check=False, timeout=540)
    assert result.returncode != 0
    assert "megarl: rank 1 failed: RuntimeError: injected teacher failure" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_gkd_lmbda_trains_some_steps_on_the_datasets_responses(tiny_model, teacher_model, tmp_path):
    """--gkd-lmbda 0.5 on the built-in task: the steps response_source picks from (seed, step) train on the
    reference responses (all correct, so reward 1 on those steps); the others on the student's samples.
    --sft-alpha (ms-swift's GKD sft_alpha) adds the responses' cross-entropy on the dataset's steps alone."""
    from megarl.generation import response_source

    steps = 3  # seed 1234 draws student, student, dataset
    torchrun("../../megarl/train.py", "--config", "examples/gkd/rollout_colocate_teacher_colocate.yaml",
             "--model", tiny_model, "--teacher-model", teacher_model, *SMALL, "--train-steps", steps,
             "--gkd-lmbda", "0.5", "--sft-alpha", "0.5", "--log-dir", tmp_path / "tb", timeout=900)
    series = scalars(tmp_path / "tb", ["on_policy", "reward_mean", "distill_loss", "mismatch", "sft_loss"])
    expected = [float(response_source(0.5, False, 1234, step) == "student") for step in range(steps)]
    assert [series["on_policy"][step] for step in range(steps)] == expected, series
    assert 0 < sum(expected) < steps  # both kinds of step happened (seed 1234)
    for step in range(steps):
        assert series["distill_loss"][step] > 0, series
        if not expected[step]:
            assert series["reward_mean"][step] == 1.0 and step not in series["mismatch"], series
            assert series["sft_loss"][step] > 0, series
        else:
            assert series["mismatch"][step] <= 1e-3 and step not in series["sft_loss"], series


@pytest.mark.slow
# CI runs the colocated teacher (the rollout engines serve its weights, the path where staleness must stay 0);
# the standalone teacher's sampling runs with -m variants.
@pytest.mark.parametrize("teacher", [pytest.param("standalone", marks=pytest.mark.variants), "colocated"])
def test_seq_kd_trains_on_the_teachers_samples(teacher, tiny_model, teacher_model, tmp_path):
    """--seq-kd --gkd-lmbda 0: every step's responses are sampled by the teacher (its standalone vLLM engine,
    or the rollout engines serving a colocated teacher's weights), scored on the rollout ranks, with no
    rollout logprobs (no mismatch metric). The teacher's samples are off-policy by design, not stale:
    staleness 0 (serving the colocated teacher and handing the student's weights back is no new version)."""
    placement = (["--config", "examples/gkd/rollout_colocate_teacher_standalone.yaml", "--standalone-teacher-model",
                  teacher_model] if teacher == "standalone" else
                 ["--config", "examples/gkd/rollout_colocate_teacher_colocate.yaml", "--teacher-model", teacher_model])
    torchrun("../../megarl/train.py", *placement, "--model", tiny_model, *SMALL, "--train-steps", "2",
             "--seq-kd", "--gkd-lmbda", "0", "--rollout-save-dir", tmp_path / "dumps", "--log-dir", tmp_path / "tb",
             timeout=900)
    series = scalars(tmp_path / "tb", ["on_policy", "distill_loss", "mismatch", "teacher_kl", "staleness"])
    assert series["on_policy"] == {0: 0.0, 1: 0.0} and "mismatch" not in series, series
    assert series["staleness"] == {0: 0.0, 1: 0.0}, series
    assert min(series["distill_loss"].values()) > 0, series
    # On the teacher's own samples the student is the one that finds them unlikely: KL(student || teacher)
    # estimated from them (k1) is negative.
    assert max(series["teacher_kl"].values()) < 0, series
    assert len((tmp_path / "dumps" / "train_step1.jsonl").read_text().splitlines()) == 16


@pytest.mark.slow
@pytest.mark.learning  # the teacher's build (1200 steps) and the run: outside CI (-m learning)
def test_the_distillation_quickstart_closes_half_the_gap_to_the_teacher(tiny_model, tiny_teacher, tmp_path):
    """examples/quickstart_gkd.yaml, as `MEGARL_CONFIG=examples/quickstart_gkd.yaml bash run_quickstart.sh`
    runs it: distillation alone (no reward in the loss) from a colocated top-k teacher. Within 15 minutes
    on 2 cores the student closes at least half of its pass@1 gap to the teacher, both measured by the
    run on the same held-out problems at T=1 (the teacher and the student before the first step, the
    student after the last). Over seeds 1234, 1, 2 it closed 87% / 78% / 84% (mean 83%, spread 9%): the
    bar's margin is 3.6x the spread (docs/testing.md, "Learning bars")."""
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_gkd.yaml", "--model", tiny_model,
                      "--teacher-model", tiny_teacher, "--log-dir", tmp_path / "tb", timeout=15 * 60)
    lines = [line for line in result.stdout.splitlines() if line.startswith("pass@1: ")]
    assert lines, result.stdout[-3000:]
    match = re.fullmatch(r"pass@1: student ([\d.]+) -> ([\d.]+), teacher ([\d.]+)", lines[-1])
    before, after, teacher = (float(value) for value in match.groups())
    assert teacher >= before + 0.2, lines[-1]  # a real gap to close
    assert after - before >= (teacher - before) / 2, lines[-1]


@pytest.mark.slow
@pytest.mark.learning  # the hint model's build (~1 minute) and the run: outside CI (-m learning)
def test_the_self_distillation_quickstart_lifts_the_students_pass_at_1(tiny_hint_model, tmp_path):
    """examples/quickstart_opsd.yaml: OPSD with a fixed teacher (--self-distill, no teacher model). The teacher
    is the initial policy reading the problem with its answer as a hint, which the tiny hint model can use
    (tools/make_tiny_model.py --hints); the student reads the problem alone. Its pass@1 at T=1 on held-out
    problems rises by at least 0.30 in 60 steps. Over seeds 1234, 1, 2 it rose +0.504 / +0.460 / +0.443 (spread
    0.061): the bar's margin (mean - bar) is 2.8x the spread (docs/testing.md, "Learning bars")."""
    from megarl.data.tasks import arithmetic

    data = tmp_path / "arithmetic.jsonl"
    arithmetic.write_jsonl(data, arithmetic.make_problems(5000, seed=5))
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_opsd.yaml", "--model", tiny_hint_model,
                      "--train-data", data, "--log-dir", tmp_path / "tb", timeout=15 * 60)
    lines = [line for line in result.stdout.splitlines() if line.startswith("pass@1: ")]
    assert lines, result.stdout[-3000:]
    match = re.fullmatch(r"pass@1: student ([\d.]+) -> ([\d.]+), teacher ([\d.]+)", lines[-1])
    before, after, _ = (float(value) for value in match.groups())
    assert after - before >= 0.30, lines[-1]


@pytest.mark.slow
@pytest.mark.learning  # the tiny Qwen3.5 pair's builds (~6 minutes) and the run: outside CI (-m learning)
def test_the_qwen3_5_distillation_quickstart_closes_most_of_the_gap(tiny_qwen3_5, tiny_qwen3_5_teacher, tmp_path):
    """examples/quickstart_gkd_qwen3_5.yaml: the tiny Qwen3.5 student closes at least 60% of its pass@1 gap to
    the tiny Qwen3.5 teacher (issue 50's bar), both measured by the run on the same held-out problems at T=1.
    Over seeds 1234, 1, 2 it closed 75% / 73% / 73% (mean 74%, spread 3%): margin 4.9x the spread."""
    result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_gkd_qwen3_5.yaml", "--model",
                      tiny_qwen3_5, "--teacher-model", tiny_qwen3_5_teacher, "--log-dir", tmp_path / "tb",
                      timeout=20 * 60)
    lines = [line for line in result.stdout.splitlines() if line.startswith("pass@1: ")]
    assert lines, result.stdout[-3000:]
    match = re.fullmatch(r"pass@1: student ([\d.]+) -> ([\d.]+), teacher ([\d.]+)", lines[-1])
    before, after, teacher = (float(value) for value in match.groups())
    assert teacher >= before + 0.2, lines[-1]  # a real gap to close
    assert after - before >= 0.6 * (teacher - before), lines[-1]
