"""tools/plot_metrics.py: a PNG of a real run's curves, merged resumed logs, globs, and the error exits."""

import subprocess
import sys

import pytest

from helpers import ROOT, load_script, torchrun

TOOL = ROOT / "tools" / "plot_metrics.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plot_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def tool():
    return load_script(TOOL)


@pytest.mark.slow
def test_plots_a_real_run(tiny_model, tmp_path):
    import matplotlib.image

    torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
             "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "8",
             "--train-steps", "3", "--log-dir", tmp_path / "tb", timeout=900)
    out = tmp_path / "run.png"
    result = plot_tool(tmp_path / "tb", "--out", out, "--smooth", "0.6")
    assert result.returncode == 0, result.stderr
    assert "eval/*/pass@1" in result.stderr  # requested by default, absent without --eval-dataset
    panels = int(result.stdout.split(": ")[1].split()[0])
    assert panels >= 8, result.stdout  # reward_mean, accuracy, kl_old_new, entropy, clip, grad norm, length, ...
    assert out.read_bytes()[:8] == PNG_MAGIC
    height, width, channels = matplotlib.image.imread(out).shape
    assert 600 <= width <= 3000 and 300 <= height <= 3000 and channels in (3, 4), (height, width)
    assert out.stat().st_size > 20_000  # curves drawn, not an empty canvas

    # Only some metrics, one of them missing: named on stderr, the rest plotted (default --out).
    result = plot_tool(tmp_path / "tb", "--metrics", "reward_mean,no_such_metric")
    assert result.returncode == 0 and "no_such_metric" in result.stderr, result.stderr
    assert (tmp_path / "tb" / "metrics.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_no_event_files_is_a_one_line_error(make, tmp_path):
    run_dir = tmp_path / "run"
    if make == "empty":
        run_dir.mkdir()
    result = plot_tool(run_dir)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no TensorBoard event files" in result.stderr, result.stderr


def test_resumed_logs_globs_and_smoothing(tool, tmp_path):
    """A resumed run's events replace the first attempt's from the resume step; eval/*/pass@1 is one panel per set."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    first = SummaryWriter(run)
    for step in range(10):
        first.add_scalar("reward_mean", 0.1 * step, step)
    first.add_scalar("eval/math/pass@1", 0.2, 0)
    first.close()
    resumed = SummaryWriter(run)  # a second event file in the same --log-dir, written later
    for step in range(6, 8):
        resumed.add_scalar("reward_mean", 1.0 + step, step)
    resumed.add_scalar("eval/gsm8k/pass@1", 0.5, 8)
    resumed.close()

    series = tool.load_scalars(str(run))
    steps, values = series["reward_mean"]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7]
    assert values[5] == pytest.approx(0.5) and values[6:] == [7.0, 8.0]
    assert tool.select(["eval/*/pass@1", "kl_ref", "reward_mean"], set(series)) == (
        ["eval/gsm8k/pass@1", "eval/math/pass@1", "reward_mean"], ["kl_ref"])
    assert tool.ema([2.0, 2.0, 2.0], 0.6) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards 0
    assert tool.ema([0.0, 1.0], 0.0) == [0.0, 1.0]

    # A folder of runs: each sub-folder is a line.
    SummaryWriter(tmp_path / "other").close()
    other = SummaryWriter(tmp_path / "other")
    other.add_scalar("reward_mean", 0.3, 0)
    other.close()
    out = tmp_path / "both.png"
    result = plot_tool(tmp_path, "--out", out)
    assert result.returncode == 0 and "2 run(s)" in result.stdout, result.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
