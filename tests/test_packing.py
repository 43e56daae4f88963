"""Micro-batches by a token budget and padding-free packing (megarl/packing.py, model_runner)."""

import random

import pytest
import torch

from helpers import assert_fp32_paths_agree, assert_runs_agree, assert_signal_alive, read_json, scalars, torchrun
from megarl.batch import score_and_filter
from megarl.model_runner import make_micro_batches, response_aligned
from megarl.packing import partition_count, token_budget_partitions
from megarl.samples import Sample


def check_partition(lengths, budget, count):
    groups = token_budget_partitions(lengths, budget, count)
    assert len(groups) == count and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups), groups
    return groups


def test_every_data_parallel_rank_gets_the_largest_count_each_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.randint(8, 64)
        ranks = [[rng.randint(1, 80) for _ in range(rng.randint(4, 16))] for _ in range(4)]
        ranks = [r[: min(len(x) for x in ranks)] for r in ranks]  # data-parallel shares are equal
        count = max(partition_count(r, budget) for r in ranks)  # the all-reduce (MAX) of make_micro_batches
        for lengths in ranks:
            check_partition(lengths, budget, count)


def test_a_sample_longer_than_the_budget_is_alone():
    lengths = [3, 50, 4, 2]
    assert partition_count(lengths, 10) == 2
    groups = check_partition(lengths, 10, 2)
    assert [1] in groups
    assert check_partition(lengths, 10, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError):
        token_budget_partitions(lengths, 10, 1)


def test_partitions_are_balanced_when_that_fits():
    groups = check_partition([10, 10, 1, 1, 9, 9], 20, 2)
    assert sorted(sum([10, 10, 1, 1, 9, 9][i] for i in g) for g in groups) == [20, 20]


def samples(count=5):
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = torch.randint(3, 50, (2 + i % 3,), generator=generator).tolist()
        response = torch.randint(3, 50, (1 + i % 4,), generator=generator).tolist()
        out.append(Sample(i, prompt, response, "", [-0.5] * len(response), False, reward=1.0))
    return out


def test_packed_layout_and_response_alignment_round_trip():
    batch, _ = score_and_filter(samples(), max_new_tokens=8)
    batch.advantages = torch.arange(batch.width).float()[None].expand(len(batch), -1) * batch.response_mask
    padded = make_micro_batches(batch, 2, 0)
    packed = make_micro_batches(batch, 2, 0, packed=True)
    assert all(b.tokens.shape[0] == 1 and b.padding_tokens() == 0 for b in packed)
    assert sum(b.padding_tokens() for b in padded) > 0
    for b in packed:
        assert b.position_ids[0].tolist() == [t for length in b.packed_lengths for t in range(length)]
        assert not b.loss_mask[0, torch.tensor(b.packed_lengths).cumsum(0) - 1].any()  # a sequence's last token
    for layout in (padded, packed):
        for name in ("advantages", "rollout_logprobs"):
            aligned = response_aligned(layout, [getattr(b, name) for b in layout], batch.width)
            assert torch.equal(aligned, getattr(batch, name) * batch.response_mask), name
        assert torch.equal(response_aligned(layout, [b.loss_mask for b in layout], batch.width),
                           batch.loss_mask.float())


@pytest.mark.slow
@pytest.mark.parametrize("tp,model", [("1", "tiny_model"), ("2", "tiny_model"), ("2", "random_qwen3_5_untied")])
def test_layouts_give_the_padded_outputs_and_losses(tp, model, request, tmp_path):
    """Every layout gives the right-padded one's outputs and losses; at TP=2 sequence parallelism (--sequence-
    parallel) gives those without it, right-padded and packed: its losses and gradient norms too (the norms'
    TP-summed gradients; rows padded to a multiple of TP). Qwen3.5: a packed row's sequences each start the
    Gated DeltaNet's recurrent state and conv window afresh; with the row run as one sequence instead
    (state and window carried across its sequences), the packed logprobs moved by 0.46 from the padded ones."""
    out = tmp_path / "packing"
    torchrun("packing_worker.py", out, "--model", request.getfixturevalue(model), "--advantage-estimator", "gae", "--micro-batch-size",
             "2", "--lr", "1e-3", "--critic-lr", "1e-3", "--loss-agg", "sample_level", "--entropy-coef", "0.01",
             "--tensor-model-parallel-size", tp, timeout=600)
    report = read_json(f"{out}.json")
    padded = report["padded"]
    for name in ("budget", "packed", "budget_packed"):
        layout = report[name]
        for key in ("logprobs", "values"):  # the same weights, summed in another order
            assert_fp32_paths_agree(layout[key], padded[key], f"{name} {key}")
        for role, loss in (("actor", "loss"), ("critic", "value_loss")):
            assert len(layout[role]) == len(padded[role]) > 0, (name, role)
            assert_runs_agree(dict(enumerate(s[loss] for s in layout[role])),
                              dict(enumerate(s[loss] for s in padded[role])), f"{name} {role}")
        if name.startswith("budget"):
            counts = layout["micro_batches"]
            assert len({len(rank) for rank in counts}) == 1, counts  # one count on every rank
            assert all(n == 1 or tokens <= 19 for rank in counts for n, tokens in rank), counts
        if name.endswith("packed"):
            assert layout["padding"] == 0
    assert padded["padding"] > 0
    assert_signal_alive({"grad_norm": dict(enumerate(s["grad_norm"] for s in padded["actor"]))},
                        steps=range(len(padded["actor"])), what="padded actor", advantages=False)
    if tp == "2":  # sequence parallelism (its layouts run at TP > 1 only) against the same layout without it
        for name, plain in (("padded_sp", "padded"), ("packed_sp", "packed")):
            layout, base = report[name], report[plain]
            assert layout["sequence_parallel"] and not base["sequence_parallel"], name
            assert all(length % 2 == 0 for length in layout["lengths"]) and layout["lengths"] != base["lengths"]
            for key in ("logprobs", "values"):
                assert_fp32_paths_agree(layout[key], base[key], f"{name} {key}")
            for role, metrics in (("actor", ("loss", "grad_norm", "entropy")),
                                  ("critic", ("value_loss", "critic_grad_norm"))):
                for metric in metrics:
                    assert_runs_agree(dict(enumerate(s[metric] for s in layout[role])),
                                      dict(enumerate(s[metric] for s in base[role])), f"{name} {role} {metric}")


@pytest.mark.slow
def test_grpo_with_a_token_budget_and_packing_matches_padded(tiny_model, tmp_path):
    common = ["--config", "examples/quickstart_grpo.yaml", "--model", tiny_model, "--prompts-per-step", "4",
              "--num-generations", "4", "--max-new-tokens", "12", "--micro-batch-size", "4", "--lr", "1e-3",
              "--rollout-kv-cache-gb", "1", "--train-steps", "3", "--entropy-coef", "0.01"]
    tags = ["loss", "grad_norm", "entropy", "padding_fraction"]
    runs = {}
    for name, extra in (("padded", []), ("packed", ["--max-tokens-per-micro-batch", "64", "--padding-free"])):
        # the trainer's two layouts are compared: the HF backend spares vLLM's import and start
        torchrun("../../megarl/train.py", *common, *extra, "--rollout-backend", "hf", "--log-dir", tmp_path / name,
                 timeout=900)
        runs[name] = scalars(tmp_path / name, tags)
    assert len(runs["padded"]["loss"]) == 3
    # the loss alone is the same for any model on-policy (its ratio is exactly 1): the gradient and the entropy
    # are the trainer's forward and backward on each layout; the entropy bonus gives every step a gradient (the
    # trained tiny model's answers are often all right or all wrong in a group at a step)
    assert_signal_alive(tmp_path / "padded", steps=(0, 1, 2), what="padded")
    for tag in ("loss", "grad_norm", "entropy"):
        assert_runs_agree(runs["packed"][tag], runs["padded"][tag], tag)
    assert max(runs["padded"]["padding_fraction"].values()) > 0
    assert all(value == 0 for value in runs["packed"]["padding_fraction"].values())
