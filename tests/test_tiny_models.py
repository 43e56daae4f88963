"""run_quickstart.sh builds the tiny models a config names (tools/make_tiny_model.py --for-config)."""

from pathlib import Path

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
