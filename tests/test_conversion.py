"""HF <-> Megatron for the Qwen2 family, on real torchrun ranks (gloo); also the trainer's
vocab-parallel logprobs, entropy and full KL against a full-vocabulary softmax, and the
critic's value head against HF hidden states."""

import pytest

from helpers import read_json, torchrun

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP); logits are compared where PP == 1


def _run(model_path, tp, pp, tmp_path):
    out = tmp_path / f"report_tp{tp}_pp{pp}.json"
    # Two ranks always: TP=1, PP=1 then runs as two data-parallel replicas.
    torchrun("parity_worker.py", "--hf", model_path, "--out", out, "--tp", tp, "--pp", pp, nproc=2)
    return read_json(out)


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("which", ["tiny_model", "random_qwen2_untied", "random_qwen2_tied"])
def test_logits_parity_and_round_trip(which, tp, pp, request, tmp_path):
    report = _run(request.getfixturevalue(which), tp, pp, tmp_path)
    assert report["tp"] == tp and report["pp"] == pp
    if pp == 1:
        assert report["max_abs_logit_diff"] <= 1e-4, report
        assert report["max_abs_logprob_diff"] <= 1e-4 and report["max_abs_entropy_diff"] <= 1e-4, report
        # Full-vocabulary KL and its gradient, computed shard by shard (the KL itself is far from 0).
        assert report["full_kl_mean"] > 1e-3, report
        assert report["max_abs_full_kl_diff"] <= 1e-5 and report["max_abs_full_kl_grad_diff"] <= 1e-5, report
        assert report["padding_grad_max"] == 0.0, report
        # Critic: the value head on the trunk equals HF's final hidden states times the head.
        assert report["value_std"] > 1e-3 and report["max_abs_value_diff"] <= 1e-4, report
    # Round trip: every HF tensor comes back bit-exact, none missing, none invented.
    assert report["exported"] > 0
    assert report["mismatched"] == [] and report["missing"] == [] and report["extra"] == [], report
