"""run_quickstart.sh builds the tiny models a config names (tools/make_tiny_model.py --for-config)."""

from pathlib import Path

import pytest

from helpers import ROOT, load_script


def test_every_checkpoint_an_example_names_is_one_the_builder_makes():
    """Each artifacts/ checkpoint that an example config names is among the builds --for-config knows, so
    `MEGARL_CONFIG=<example> bash run_quickstart.sh` never stops at "no such directory"."""
    make = load_script(ROOT / "tools" / "make_tiny_model.py")
    known = {Path(out) for out in make.OUTS.values()}
    named = {config.name: make.models_named(config) for config in sorted((ROOT / "examples").rglob("*.yaml"))}
    tiny = {name: [p for p in paths if p.parts[:1] == ("artifacts",)] for name, paths in named.items()}
    unknown = {name: [str(p) for p in paths if p not in known] for name, paths in tiny.items()}
    assert not any(unknown.values()), unknown
    # The ones a reader runs first, each with the teacher, MoE, tool or Qwen3.5 model it needs.
    assert Path("artifacts/tiny-qwen2-teacher") in tiny["quickstart_gkd.yaml"]
    assert tiny["quickstart_grpo_moe.yaml"] == [Path("artifacts/tiny-qwen3-moe")]
    assert tiny["quickstart_grpo_tools.yaml"] == [Path("artifacts/tiny-qwen2-tools")]
    assert tiny["quickstart_gkd_qwen3_5.yaml"] == [Path("artifacts/tiny-qwen3_5"), Path("artifacts/tiny-qwen3_5-teacher")]
    assert tiny["quickstart_opsd.yaml"] == [Path("artifacts/tiny-qwen2-hints")]


def test_role_sections_name_models_too(tmp_path):
    make = load_script(ROOT / "tools" / "make_tiny_model.py")
    config = tmp_path / "c.yaml"
    config.write_text("model: artifacts/tiny-qwen2\nteacher:\n  gpus: 1\n  model: artifacts/tiny-qwen3_5-teacher\n")
    assert make.models_named(config) == [Path("artifacts/tiny-qwen2"), Path("artifacts/tiny-qwen3_5-teacher")]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_router_tiny_models_build_offline_in_one_go(family, tmp_path):
    """`--family deepseek_v3` / `glm4_moe` builds a random DeepSeek-V3 / GLM-4.5 with the tiny tokenizer (no warm-up
    by default): megarl reads it as its family, every tensor its config needs is there (the first layer dense, the
    others' experts, routers and expert biases; GLM-4.5's q/k/v biases and q/k norms), and the expert bias is not
    the zeros transformers initialises."""
    import json
    import os
    import subprocess
    import sys

    from safetensors import safe_open

    from megarl.models.convert import HFCheckpoint, check_checkpoint_tensors
    from megarl.models.families import family_of, load_hf_config

    out = tmp_path / f"tiny-{family}"
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--family", family, "--out", str(out), "--quiet"],
                   cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    config = load_hf_config(str(out))
    assert family_of(config).name == family
    assert (config.first_k_dense_replace, config.num_hidden_layers, config.n_routed_experts) == (1, 3, 8)
    check_checkpoint_tensors(config, HFCheckpoint(str(out)))
    report = json.loads((out / "megarl_tiny.json").read_text())
    assert report["family"] == family and report["train"]["steps"] == 0 and report["pass_at_1_t1"] is None
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.gate_proj.weight" in f.keys()
        if family == "glm4_moe":
            assert {"model.layers.2.self_attn.k_proj.bias", "model.layers.2.self_attn.q_norm.weight"} <= set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().max() > 0.1
