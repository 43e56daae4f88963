"""The container image's pins against what its packages declare (tools/image_pins.py; offline, the recorded
metadata of the pinned releases): the Dockerfile as it is agrees, and the Transformer Engine it used to pin
(2.20.2, outside megatron-core 0.16.1's declared <2.12) is refused naming both pins."""

import subprocess
import sys

from helpers import ROOT, load_script

pins = load_script(ROOT / "tools" / "image_pins.py")
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_the_images_pins_agree():
    result = subprocess.run([sys.executable, "tools/image_pins.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "image pins: agree", result.stdout
    # what the check saw: the Dockerfile's and setup.py's pins, and the torch vLLM pins
    pinned = {str(req) for req, _ in pins.dockerfile_requirements(DOCKERFILE)}
    assert {"vllm==0.32.0", "megatron-core==0.16.1", "transformer_engine[core_cu13,pytorch]==2.11.0"} <= pinned


def test_transformer_engine_outside_megatron_cores_range_is_a_conflict():
    text = DOCKERFILE.replace('"transformer_engine[core_cu13,pytorch]==2.11.0"',
                              '"transformer_engine[core_cu13,pytorch]==2.20.2"')
    assert text != DOCKERFILE
    problems, _ = pins.conflicts(text)
    assert "transformer_engine[core_cu13,pytorch]==2.20.2 (Dockerfile) conflicts with megatron-core==0.16.1 " \
           '(extra "dev"), which declares transformer-engine<2.12.0,>=2.9.0a0' in problems, problems


def test_a_pin_against_a_required_version_is_a_conflict():
    """vLLM pins torch: another torch pinned beside it is refused (a requirement, not an optional extra's)."""
    text = DOCKERFILE.replace('pip install --no-cache-dir "vllm==0.32.0"',
                              'pip install --no-cache-dir "vllm==0.32.0" "torch==2.12.0"')
    assert text != DOCKERFILE
    problems, _ = pins.conflicts(text)
    assert "torch==2.12.0 (Dockerfile) conflicts with vllm==0.32.0, which declares torch==2.13.0" in problems, problems
