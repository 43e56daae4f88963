"""--min-new-tokens: the trainer scores the policy under the constraint vLLM sampled under (min_tokens holds
EOS and the stop ids back before the N-th generated token: logit -inf).

Kernels (tests/workers/held_back_worker.py): every implementation with a kernels.HeldBack against a
float64 reference that sets the held-back logits to -inf before the softmax (logprob, entropy and
their gradients from logits and from hidden states; the exact KL to a reference with both sides
constrained), the held-back logits' gradient exactly 0, and the same operations without the constraint
far outside the bound (so the comparison can fail). In-process at TP=1 for naive and chunked; all of
them, Triton under its interpreter included, at TP=2 under torchrun (slow: the interpreter takes
most of a minute), where the held-back ids fall in both shards.

Data: which positions are constrained (batch.sampler_constraint) and where they land in a micro-batch.

End to end (slow): with --min-new-tokens = --max-new-tokens the rollout-vs-trainer `mismatch` of the
tiny model's first step stays at the level of the same run without it (it read 0.84 before), on the
on-policy shortcut and on the two-pass path with a reference, whose KL to the policy is then exactly 0.
"""

from __future__ import annotations

import importlib.util
import pytest
import torch

from helpers import WORKERS, load_script, read_json, scalars, torchrun
from megarl.batch import sampler_constraint, score_and_filter
from megarl.model_runner import make_micro_batches
from megarl.samples import Sample


worker = load_script(WORKERS / "held_back_worker.py")


def _assert_within_bounds(case: str, metrics: dict) -> None:
    """Errors at most their bound (NaN fails), held-back gradients exactly 0, and the unconstrained
    operation at least 10x its bound away from the constrained reference."""
    for metric, value in metrics.items():
        if metric.endswith("_held_grad"):
            assert value == 0.0, (case, metric, value)
        elif metric.endswith("_unconstrained"):
            assert value >= 10.0, (case, metric, value)
        else:
            assert value <= 1.0, (case, metric, value)


@pytest.fixture(scope="module")
def tp1():
    from megarl import distributed

    distributed.init_single_process_world()
    yield
    distributed.destroy_single_process_world()


@pytest.mark.parametrize("vocab_size,temperature", worker.VOCABS)
@pytest.mark.parametrize("chunk", worker.CHUNKS)
@pytest.mark.parametrize("check", list(worker.CHECKS))
def test_kernels_against_a_float64_masked_reference(tp1, check, vocab_size, temperature, chunk):
    metrics = worker.CHECKS[check](vocab_size, temperature, chunk)
    assert {metric.split("_")[0] for metric in metrics} == {"naive", *worker.FUSED}
    _assert_within_bounds(check, metrics)


@pytest.mark.slow
def test_kernels_at_tp2_under_torchrun(tmp_path):
    """Every case on a real TP=2 group, Triton included (its interpreter, TRITON_INTERPRET=1 before
    Python starts): the held-back ids of each shard are masked there, and the hidden states' gradient
    sums both shards' parts."""
    out = tmp_path / "report.json"
    torchrun("held_back_worker.py", "--out", out, nproc=2, timeout=900, env={"TRITON_INTERPRET": "1"})
    report = read_json(out)
    implementations = ["naive", "chunked", "triton"] if importlib.util.find_spec("triton") else ["naive", "chunked"]
    assert report["tp"] == 2 and report["fused"] == implementations[1:]
    assert len(report["cases"]) == len(worker.CHECKS) * len(worker.VOCABS) * len(worker.CHUNKS)
    for case, metrics in report["cases"].items():
        assert {metric.split("_")[0] for metric in metrics} == set(implementations), case
        _assert_within_bounds(case, metrics)


# ------------------------------------------------------------------------ data ----
def _sample(response, min_tokens=0, held_back=(), logprobs=True):
    return Sample(0, [7, 8], list(response), "", [-1.0] * len(response) if logprobs else None, False,
                  min_tokens=min_tokens, held_back_ids=held_back)


def test_constrained_positions_are_the_first_min_tokens_of_each_constrained_response():
    samples = [_sample([5, 6, 7, 0], 3, (0, 2)), _sample([5, 2], 3, (0, 2)),  # 2 at token 1: allowed? no: held
               _sample([5, 0, 6], 0, ()), _sample([9, 9, 9, 9, 9], 0, (), logprobs=False)]
    with pytest.raises(ValueError, match="sample 1: response token 1 is id 2, which the sampler held back before "
                                         "token 3"):
        sampler_constraint(samples, 5)
    samples[1] = _sample([5, 6], 3, (0, 2))  # shorter than min_tokens (cut by the length limit)
    ids, constrained = sampler_constraint(samples, 5)
    assert ids == (0, 2)
    assert constrained.tolist() == [[True, True, True, False, False], [True, True, False, False, False],
                                    [False] * 5, [False] * 5]
    assert sampler_constraint(samples[2:], 5) == ((), None)  # evaluation, dataset or teacher responses
    with pytest.raises(ValueError, match="different held-back token ids"):
        sampler_constraint([samples[0], _sample([5], 3, (0,))], 4)


@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_carries_the_constraint_at_the_positions_scoring_those_tokens(packed):
    samples = [_sample([5, 6, 7, 0], 2, (0, 2)), _sample([5, 6, 0], 2, (0, 2)), _sample([4], 0, ())]
    batch, _ = score_and_filter(samples, max_new_tokens=8)
    assert batch.held_back_ids == (0, 2) and batch.select([2]).held_back_ids == (0, 2)
    for micro_batch in make_micro_batches(batch, 2, 0, packed=packed):
        held_back = micro_batch.held_back()
        assert held_back.ids.tolist() == [0, 2]
        # position-aligned: True exactly at the positions scoring response tokens 0 and 1 of samples 0 and 1
        expected = torch.zeros_like(held_back.where)
        for sample, index in enumerate(micro_batch.indices):
            row, columns = micro_batch.response_positions(sample)
            expected[row, columns.start: columns.start + samples[index].min_tokens] = True
        assert torch.equal(held_back.where, expected)
    plain, _ = score_and_filter(samples[2:], max_new_tokens=8)
    assert all(b.held_back() is None for b in make_micro_batches(plain, 2, 0))


# ------------------------------------------------------------------ end to end ----
RUN = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "16", "--micro-batch-size", "16",
       "--train-steps", "1", "--rollout-kv-cache-gb", "0.25"]


@pytest.mark.slow
def test_mismatch_at_min_new_tokens_equal_to_max_is_at_the_level_of_a_run_without_it(tiny_model, tmp_path):
    """The tiny model's first step, one rank: without --min-new-tokens; with --min-new-tokens 16 = max (on-policy
    shortcut: the training forward scores the policy); the same with a reference (--kl-coef: a separate
    old-logprob pass and the reference's logprobs, both constrained).

    Rollout and trainer compute the same fp32 model in different code (vLLM, Megatron), so `mismatch`
    is their rounding noise, a mean of |difference| per token; the constrained run differs only in
    which tokens are averaged (16 per response, none ending early), so its noise is of the same order:
    at most 10x the run without (a factor for the different tokens, not for a different computation:
    the unmasked trainer read 0.84, millions of times more). The reference is the initial policy, so
    its constrained logprobs equal the policy's and kl_ref is exactly 0 (unconstrained it read the
    held-back mass)."""
    tags = ("mismatch", "ratio_dev_max", "kl_ref", "response_length_mean", "on_policy_shortcut")
    runs = {"free": [], "constrained": ["--min-new-tokens", "16"],
            "reference": ["--min-new-tokens", "16", "--kl-coef", "0.1"]}
    series = {}
    for name, flags in runs.items():
        torchrun("../../megarl/train.py", "--model", tiny_model, *RUN, *flags, "--log-dir", tmp_path / name,
                 nproc=1, timeout=600)
        series[name] = {tag: values[0] for tag, values in scalars(tmp_path / name, tags).items()}
    free, constrained, reference = series["free"], series["constrained"], series["reference"]
    assert free["response_length_mean"] < 16.0, series  # the model stops early when let
    assert constrained["response_length_mean"] == reference["response_length_mean"] == 16.0, series
    assert constrained["on_policy_shortcut"] == 1.0 and reference["on_policy_shortcut"] == 0.0, series
    for run in (constrained, reference):
        assert run["mismatch"] <= 10 * free["mismatch"], series
        assert run["ratio_dev_max"] <= 1e-3, series  # as every other run's (docs/design.md)
    assert reference["kl_ref"] == 0.0, series
