"""tests/gpu/ (the GPU lane) where there is no GPU: its dry run passes, it skips in one line without CUDA, and
its bookkeeping of carried wheels judges what it should. The lane itself runs on a GPU machine only
(tests/gpu/run.sh LOGDIR)."""

import os
import subprocess

import pytest
import torch

from helpers import ROOT, load_script

RUN = ["bash", str(ROOT / "tests" / "gpu" / "run.sh")]
lane = load_script(ROOT / "tests" / "gpu" / "lane.py")  # standard library only at import


@pytest.mark.slow  # ~10-30 s: fetches 4 wheels (pip's cache), imports torch, transformers and Megatron
def test_fetch_then_dry_run_passes(tmp_path, tiny_model):
    """The lane's one fetch command, then its dry run on what it fetched: the carried wheels and tiny model,
    the travelling size, the part limits against the budget, run.sh's output files, imports, paths, every
    entry point's arguments and the trainer's command lines through megarl's parser, as on a one-GPU host."""
    env = dict(os.environ, GPU_LANE_CARRY=str(tmp_path / "carry"))
    fetch = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "fetch.sh")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert fetch.returncode == 0, (fetch.stdout + fetch.stderr)[-4000:]
    result = subprocess.run([*RUN, str(tmp_path / "logs"), "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "dry run: PASS", \
        (result.stdout + result.stderr)[-4000:]
    assert (tmp_path / "logs" / "dry_run.log").read_text() == result.stdout
    lines = result.stdout.splitlines()
    for check in ("carry/wheels/ covers every carried package", "carry/tiny-qwen2/ is the tiny model",
                  "what travels fits the device tool", "the part limits fit the lane's budget",
                  "run.sh rehearsed: its summary on stdout, its output files"):
        assert any(line.startswith("ok   ") and check in line for line in lines), check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_without_cuda_the_lane_skips_in_one_line(tmp_path):
    result = subprocess.run([*RUN, str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "gpu lane: skipped (no CUDA device here)\n"


@pytest.mark.parametrize("argv", [[], ["a", "b"], ["--no-such-flag", "logs"]])
def test_bad_arguments_get_the_usage_line(argv):
    result = subprocess.run([*RUN, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == "usage: bash tests/gpu/run.sh LOGDIR [--dry-run]\n"


def _wheels(folder, *names):
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")


def test_wheel_folder_problems(tmp_path, monkeypatch):
    monkeypatch.setattr(lane, "WHEELS", tmp_path / "none")
    assert lane.wheel_problems() == []  # nothing carried: nothing wrong
    monkeypatch.setattr(lane, "WHEELS", tmp_path / "w")
    _wheels(tmp_path / "w", "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
            "math_verify-0.9.0-py3-none-any.whl", "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl",
            "torch-2.11.0-cp312-cp312-macosx_11_0_arm64.whl", "math_verify-0.8.0-py3-none-any.whl", "notes.txt")
    problems = lane.wheel_problems()
    assert problems == [
        f"{tmp_path / 'w'}/ holds files that are not wheels: notes.txt",
        f"{tmp_path / 'w'}/ holds two versions of math_verify (math_verify-0.8.0-py3-none-any.whl, "
        "math_verify-0.9.0-py3-none-any.whl): pip would refuse to install both",
        "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl: not for CPython 3.12 (cp311)",
        "torch-2.11.0-cp312-cp312-macosx_11_0_arm64.whl: not for manylinux x86-64 (macosx_11_0_arm64)",
    ], problems
    assert lane.wheel_for("megatron-core", "0.16.1").name.startswith("megatron_core-0.16.1-")
    assert lane.wheel_for("math-verify", "0.9.0").name == "math_verify-0.9.0-py3-none-any.whl"
    assert lane.wheel_for("megatron-core", "0.15.0") is None


def test_a_missing_module_is_covered_only_by_its_wheel(tmp_path, monkeypatch):
    """What the dry run and setup decide: a module that is not installed needs the wheel of its pinned
    version; one without a distribution must be on the machine."""
    monkeypatch.setattr(lane, "MODULES", [("torch", None, None), ("megarl_no_such_module", "no-such.dist", "1.0"),
                                          ("megarl_no_such_either", None, None)])
    monkeypatch.setattr(lane, "WHEELS", tmp_path / "w")
    _wheels(tmp_path / "w", "no_such_dist-2.0-py3-none-any.whl")
    missing = lane.missing_modules()
    assert [(m, why) for m, _, _, why in missing] == [("megarl_no_such_module", "not installed"),
                                                      ("megarl_no_such_either", "not installed")]
    assert lane.wheel_for("no-such.dist", "1.0") is None  # another version does not cover it
    (tmp_path / "w" / "no_such_dist-1.0-py3-none-any.whl").write_bytes(b"")
    assert lane.wheel_for("no-such.dist", "1.0").name == "no_such_dist-1.0-py3-none-any.whl"


def test_a_pinned_distribution_in_another_version_counts_as_missing(monkeypatch):
    installed = lane.importlib.metadata.version("torch")
    monkeypatch.setattr(lane, "MODULES", [("torch", "torch", installed), ("numpy", "numpy", "0.0.1")])
    monkeypatch.setattr(lane, "PINNED", {"torch", "numpy"})
    assert [(m, why) for m, _, _, why in lane.missing_modules()] == \
        [("numpy", f"version {lane.importlib.metadata.version('numpy')} installed")]


def _fake_run(tmp_path, monkeypatch, losses: list[float], grad_norms: list[float], rc: int = 0):
    """The train part's torchrun replaced by a stand-in (no GPU here) that prints the step lines and writes
    the TensorBoard scalars as megarl.metrics does (non-finite values left out)."""
    import math

    from torch.utils.tensorboard import SummaryWriter

    def run(command):
        tb = command[command.index("--log-dir") + 1]
        writer = SummaryWriter(tb)
        for step, (loss, grad_norm) in enumerate(zip(losses, grad_norms)):
            for tag, value in (("loss", loss), ("grad_norm", grad_norm), ("reward_mean", 0.5)):
                if math.isfinite(value):
                    writer.add_scalar(tag, value, step)
        writer.close()
        return rc, "".join(f"step {step + 1}/{lane.TRAIN_STEPS} | reward 0.500 |\n" for step in range(len(losses)))

    monkeypatch.setattr(lane, "run_streaming", run)
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


NAN = float("nan")


@pytest.mark.parametrize("name,losses,grad_norms,bf16_grad_norms,verdict", [
    ("train_bf16", [0.1, 0.2, 0.3], [1.0, 2.0, 3.0], None,
     "PASS 3 steps, losses finite, optimizer steps taken at [0, 1, 2]"),
    ("train_bf16", [0.1, NAN, 0.3], [1.0, 2.0, 3.0], None, "FAIL finite losses at steps [0, 2], expected all of 0..2"),
    ("train_bf16", [0.1, 0.2, 0.3], [1.0, NAN, 3.0], None, "FAIL finite grad norms at steps [0, 2], expected all"),
    ("train_fp16", [0.1, 0.2, 0.3], [NAN, 2.5, 3.0], [1.0, 2.0, 3.0],
     "PASS 3 steps, losses finite, optimizer steps taken at [1, 2]"),
    ("train_fp16", [0.1, 0.2, 0.3], [NAN, NAN, 3.0], [1.0, 2.0, 3.0],
     "FAIL optimizer steps taken at [2], expected at least 2 (every other step overflowed the fp16 loss scale)"),
    # the loss never multiplied by the scale: the optimizer's division leaves the gradients 2^10 too small
    ("train_fp16", [0.1, 0.2, 0.3], [2.0 / 1024] * 3, [1.0, 2.0, 3.0],
     "FAIL fp16's median grad norm is 0.000977 x bf16's, outside a factor of 4 (is the loss scaled once in the "
     "backward?)"),
    ("train_fp16", [0.1, 0.2, 0.3], [1.0, 2.0, 3.0], None,
     "FAIL no train_bf16 grad norms to compare with (train_bf16 runs first, into the same --work)"),
    ("train_fp16", [0.1, 0.2], [1.0, 1.0], [1.0, 2.0, 3.0],
     "FAIL 2 step lines, expected 3; finite losses at steps [0, 1], expected all of 0..2"),
])
def test_train_part_verdict(name, losses, grad_norms, bf16_grad_norms, verdict, tmp_path, monkeypatch, capsys):
    if bf16_grad_norms is not None:  # the train_bf16 part's scalars, which the fp16 part compares with
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(tmp_path / "tb_train_bf16") as writer:
            for step, value in enumerate(bf16_grad_norms):
                writer.add_scalar("grad_norm", value, step)
    _fake_run(tmp_path, monkeypatch, losses, grad_norms)
    assert lane.train(name, tmp_path) == verdict.startswith("PASS")
    assert capsys.readouterr().out.splitlines()[-1] == verdict


def test_the_parts_fit_the_budget_and_one_second_more_fails(monkeypatch, capsys):
    assert lane.budget_problem() is None
    assert lane.PARTS[0][0] == "setup" and [n for n, _, _ in lane.PARTS[2:]][:2] == ["train_bf16", "kernels"]
    spare = lane.BUDGET - sum(limit for _, limit, _ in lane.PARTS)
    monkeypatch.setattr(lane, "PARTS", [(name, limit + (spare + 1) * (name == "train_bf16"), need)
                                        for name, limit, need in lane.PARTS])
    assert lane.budget_problem() == f"the part limits add up to {lane.BUDGET + 1} s, over the {lane.BUDGET} s budget"


@pytest.mark.parametrize("selected,expected", [
    ("", [name for name, _, _ in lane.PARTS]),
    ("bench kernels", ["setup", "kernels", "bench"]),  # in the lane's order, setup always
    ("train_fp16", ["setup", "nccl", "train_bf16", "train_fp16"]),  # and what it needs
    ("sleep_level2", ["setup", "nccl", "sleep_level2"]),  # an extra part only when named
])
def test_plan(selected, expected):
    assert [name for name, _, _ in lane.plan(selected)] == expected


def test_an_unknown_part_gets_one_line(tmp_path):
    env = dict(os.environ, GPU_LANE_PARTS="kernels nope", GPU_LANE_REHEARSE="1")
    result = subprocess.run([*RUN, str(tmp_path / "logs")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr == \
        f"gpu lane: GPU_LANE_PARTS names no part nope (parts: {' '.join(lane.PART_NAMES)})\n", result.stderr


def test_the_rehearsal_counts_run_shs_own_output_files(monkeypatch):
    """run.sh run for real with no-op parts: its files under LOGDIR are what the device tool must bring back."""
    assert lane.rehearsal_problem() is None
    monkeypatch.setattr(lane, "OUTPUT_FILES_LIMIT", 1)
    assert lane.rehearsal_problem() == "2 output files, over the 1 the device tool brings back"


def test_travel_and_carried_model_problems(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setattr(lane, "CARRY", tmp_path / "carry")
    monkeypatch.setattr(lane, "CARRIED_MODEL", tmp_path / "carry" / "tiny-qwen2")
    assert lane.carried_model_problem() == \
        f"no tiny model at {tmp_path / 'carry' / 'tiny-qwen2'} (run bash tests/gpu/fetch.sh)"
    (tmp_path / "carry" / "tiny-qwen2").mkdir(parents=True)
    (tmp_path / "carry" / "tiny-qwen2" / "megarl_tiny.json").write_text("{}")  # another build's
    assert "is not artifacts/tiny-qwen2" in lane.carried_model_problem()
    tree, carried = lane.travelling_bytes()
    assert carried == 2 and tree > 0
    monkeypatch.setattr(lane, "TRAVEL_LIMIT", tree)
    assert lane.travel_problem().endswith(f"would travel, over {tree / 2**20:.0f} MiB")
