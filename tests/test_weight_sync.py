"""Trainer -> rollout weight sync on 2 real torchrun ranks, in both placements and across TP sizes."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, WORKERS, read_json, torchrun

pytestmark = pytest.mark.slow  # real torchrun ranks with vLLM and Megatron-core

PLACEMENTS = {
    # name: flags; the train/rollout TP sizes differ in the last two
    "colocate-dp2": ["--tensor-model-parallel-size", "1", "--rollout-tensor-parallel-size", "1"],
    "separate": ["--colocate-groups", "none", "--train-gpus", "1", "--rollout-gpus", "1"],
    "colocate-train-tp2-rollout-tp1": ["--tensor-model-parallel-size", "2", "--rollout-tensor-parallel-size", "1"],
    "colocate-train-tp1-rollout-tp2": ["--tensor-model-parallel-size", "1", "--rollout-tensor-parallel-size", "2"],
}
COMMON = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12", "--temperature", "1.0",
          "--rollout-kv-cache-gb", "1", "--log-dir", ""]


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_sync_parity(placement, tiny_model, request, tmp_path):
    """The separate placement syncs a Qwen3-MoE (random, 8 experts, top 2): its broadcast carries the dense
    layers and the experts alike, into vLLM's fused expert layout (issue 27: expert weights in both
    placements; the colocated MoE sync is tests/test_families_vllm.py's and test_moe.py's)."""
    model = request.getfixturevalue("random_moe_policy") if placement == "separate" else tiny_model
    out = tmp_path / "sync"
    torchrun("sync_worker.py", out, "--model", model, *COMMON, *PLACEMENTS[placement], timeout=900)
    reports = read_json(f"{out}.json")
    train_reports = [r for r in reports if r["before"] is not None]
    assert train_reports
    for report in train_reports:
        # Before any update both sides hold the checkpoint's weights.
        assert report["before"]["mismatch"] <= 1e-3, report
        # Right after each of three syncs of perturbed weights: same logprobs, importance
        # ratio 1 (fp32: ~1e-7; stale weights from an earlier sync would be off by O(1)).
        assert len(report["syncs"]) == 3
        for synced in report["syncs"]:
            assert synced["after"]["mismatch"] <= 1e-4, report
            assert synced["after"]["ratio_dev_max"] <= 1e-3, report  # worst single token's exp(dlogp) - 1
            assert synced["sync"]["sync_bytes"] > 0

    greedy = [r["greedy"] for r in reports if "greedy" in r]
    assert greedy and all(g == greedy[0] for g in greedy)  # every engine holds the same weights
    if placement in ("colocate-dp2", "separate", "colocate-train-tp2-rollout-tp1"):
        # The engine, synced three times, generates exactly what a fresh engine loaded
        # from the last perturbed checkpoint generates (greedy; both TP=1).
        fresh = tmp_path / "fresh.json"
        subprocess.run([sys.executable, str(WORKERS / "fresh_engine.py"), f"{out}_hf", fresh, "12"], cwd=ROOT,
                       check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": f"{ROOT}:{WORKERS}", "OMP_NUM_THREADS": "1"})
        assert json.loads(fresh.read_text()) == greedy[0]
