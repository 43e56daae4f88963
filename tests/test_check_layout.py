"""tools/check_layout.py: the 7B example's layout on 2 x 8 GPUs validates and its estimate fits 80 GB; a wrong
shape is refused in one line; the parameter count is the model's."""

import json
import re

import pytest

from helpers import ROOT, load_script, make_random_model

check_layout = load_script(ROOT / "tools" / "check_layout.py")

EXAMPLE = str(ROOT / "examples" / "qwen7b_2x8.yaml")


def test_the_7b_example_fits_2_nodes_of_8_gpus(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert check_layout.main(["--config", EXAMPLE, "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 8 GPUs = 16 ranks" in out and "train   16 ranks: TP=4 x PP=1 x CP=1 x DP=4" in out
    assert "8 vLLM engines x TP=2" in out and "7.62B parameters" in out
    peak = float(re.search(r"^peak ([\d.]+) GiB of ([\d.]+) GiB: fits$", out, re.M).group(1))
    assert peak <= 80e9 / 2**30
    # Without the distributed optimizer the optimizer states are DP=4 times larger.
    sharded = float(re.search(r"optimizer, distributed \(DP=4\) +([\d.]+) +<- used", out).group(1))
    plain = float(re.search(r"optimizer, not distributed +([\d.]+)", out).group(1))
    assert plain == pytest.approx(4 * sharded, rel=0.01)


def test_a_wrong_cluster_shape_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert check_layout.main(["--config", EXAMPLE, "--nodes", "1", "--gpus-per-node", "8"]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "16" in out and "8 were launched" in out
    assert check_layout.main(["--config", EXAMPLE, "--nodes", "2", "--gpus-per-node", "8",
                              "--tensor-model-parallel-size", "3"]) == 2
    assert "tensor_model_parallel_size" in capsys.readouterr().out


def test_a_layout_that_does_not_fit_says_so(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # TP=1 without the distributed optimizer: 7.6B x 18 bytes of state per GPU
    assert check_layout.main(["--config", EXAMPLE, "--nodes", "2", "--gpus-per-node", "8",
                              "--tensor-model-parallel-size", "1", "--global-batch-size", "256"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("qwen2", True), ("qwen3", False)])
def test_parameter_count_is_the_models(tmp_path, family, tied):
    import transformers

    path = make_random_model(tmp_path, family, tied)
    hf = json.loads((tmp_path / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    shapes = check_layout.model_shapes(hf)
    counts = check_layout.parameters(shapes, tp=1, pp=1, divisible_by=1)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["per_gpu"] == counts["total"]


def test_a_mixture_of_experts_model_is_not_estimated_as_dense(capsys, monkeypatch, random_qwen3_moe_untied):
    """The estimate's MLP is dense (intermediate_size per layer): an MoE model gets one line, not wrong numbers."""
    monkeypatch.chdir(ROOT)
    assert check_layout.main(["--config", "examples/quickstart_grpo.yaml", "--nodes", "1", "--gpus-per-node", "2",
                              "--model", random_qwen3_moe_untied]) == 2
    out = capsys.readouterr().out.strip()
    assert "\n" not in out and "mixture-of-experts model (8 experts)" in out, out
