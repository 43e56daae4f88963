"""The typed batch and its pure functions: scores and masks, selection, sharding, mini-batches (no torchrun)."""

import pytest
import torch

from megarl import batch as B
from megarl.samples import Sample


def sample(index, response_length, reward, max_new_tokens=4):
    return Sample(prompt_index=index, prompt_ids=[1, 2, 3], response_ids=list(range(5, 5 + response_length)),
                  response_text="x", logprobs=[-0.1 * (k + 1) for k in range(response_length)],
                  truncated=response_length == max_new_tokens, reward=reward)


SAMPLES = [sample(0, 2, 1.0), sample(0, 4, 0.0), sample(1, 1, 0.5), sample(1, 3, 1.0)]


def test_score_and_filter_builds_response_aligned_masks_and_logprobs():
    batch, metrics = B.score_and_filter(SAMPLES, max_new_tokens=4)
    assert metrics == {} and len(batch) == 4 and batch.width == 4
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert torch.equal(batch.loss_mask, batch.response_mask)
    assert batch.scores.tolist() == [1.0, 0.0, 0.5, 1.0]
    assert torch.allclose(batch.rollout_logprobs[3], torch.tensor([-0.1, -0.2, -0.3, 0.0]))


def test_truncation_filter_masks_the_loss_but_keeps_the_score():
    batch, metrics = B.score_and_filter(SAMPLES, max_new_tokens=4, filter_truncated=True)
    assert batch.loss_mask[1].sum() == 0 and batch.response_mask[1].sum() == 4
    assert batch.scores[1] == 0.0 and metrics["truncated_filtered"] == 0.25


def test_overlong_penalty_enters_the_score():
    # DAPO: the last `buffer` tokens before max_new_tokens cost up to 1, linearly.
    batch, metrics = B.score_and_filter(SAMPLES, max_new_tokens=4, overlong_buffer_len=2)
    assert batch.scores.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.5])
    assert metrics["overlong_penalty_mean"] == pytest.approx(-1.5 / 4)


def test_select_takes_rows_of_every_field_and_the_samples():
    batch, _ = B.score_and_filter(SAMPLES, max_new_tokens=4)
    batch.advantages = torch.arange(16.0).view(4, 4)
    picked = batch.select(torch.tensor([3, 1]))
    assert [s.reward for s in picked.samples] == [1.0, 0.0]
    assert picked.advantages.tolist() == [[12, 13, 14, 15], [4, 5, 6, 7]]
    assert torch.equal(picked.response_mask, batch.response_mask[[3, 1]])
    assert picked.old_logprobs is None
    assert list(picked.token_fields()) == ["rollout_logprobs", "advantages"]


@pytest.mark.parametrize("count,parts", [(10, 3), (7, 7), (3, 5), (16, 4)])
def test_contiguous_shards_cover_everything_once_and_differ_by_at_most_one(count, parts):
    pieces = [list(range(count))[B.contiguous_shard(count, i, parts)] for i in range(parts)]
    assert sum(pieces, []) == list(range(count))
    sizes = [len(p) for p in pieces]
    assert max(sizes) - min(sizes) <= 1


def test_data_parallel_shard_needs_an_even_split():
    assert B.data_parallel_shard(8, 4, 2) == slice(4, 6)
    with pytest.raises(ValueError, match="do not split evenly"):
        B.data_parallel_shard(6, 4, 0)


def test_mini_batches_give_each_rank_its_share_of_each_mini_batch():
    # 8 samples, mini-batches of 4, 2 data-parallel ranks: rank 1 takes 2-3, then 6-7.
    assert [m.tolist() for m in B.mini_batch_indices(8, 4, 2, 1)] == [[2, 3], [6, 7]]
    # Over all ranks, every sample appears exactly once per epoch, shuffled or not.
    for seed in (None, B.shuffle_seed(1234, 3, 1)):
        seen = [i for rank in range(2) for m in B.mini_batch_indices(8, 4, 2, rank, seed) for i in m.tolist()]
        assert sorted(seen) == list(range(8))
    a = B.mini_batch_indices(8, 4, 2, 0, B.shuffle_seed(1234, 3, 0))
    b = B.mini_batch_indices(8, 4, 2, 0, B.shuffle_seed(1234, 3, 1))
    assert [m.tolist() for m in a] != [m.tolist() for m in b]  # a new permutation per epoch
    assert [m.tolist() for m in a] == [m.tolist() for m in B.mini_batch_indices(8, 4, 2, 0, B.shuffle_seed(1234, 3, 0))]
    with pytest.raises(ValueError):
        B.mini_batch_indices(8, 3, 1, 0)


def test_balanced_mini_batches_give_each_rank_equal_samples_and_near_equal_tokens():
    # Two mini-batches of 8; the long samples sit together at the front, as a prompt's group would.
    lengths = [300, 290, 280, 270, 20, 15, 10, 5, 100, 100, 100, 100, 100, 100, 100, 100]
    for seed in (None, B.shuffle_seed(1234, 0, 0)):
        shares = [B.mini_batch_indices(16, 8, 2, rank, seed, lengths) for rank in range(2)]
        contiguous = [B.mini_batch_indices(16, 8, 2, rank, seed) for rank in range(2)]
        for mini_batch in range(2):
            mine = [shares[rank][mini_batch].tolist() for rank in range(2)]
            # the same samples as the contiguous split's mini-batch, 4 per rank, each once
            assert sorted(mine[0] + mine[1]) == sorted(sum((c[mini_batch].tolist() for c in contiguous), []))
            assert [len(m) for m in mine] == [4, 4]
            tokens = [sum(lengths[i] for i in m) for m in mine]
            assert abs(tokens[0] - tokens[1]) <= max(lengths)
    # without a shuffle, the first mini-batch: contiguous is 1140 vs 50 tokens; balanced within 30
    balanced = [sum(lengths[i] for i in B.mini_batch_indices(16, 8, 2, rank, None, lengths)[0]) for rank in range(2)]
    assert abs(balanced[0] - balanced[1]) <= 30, balanced
    assert [m.tolist() for m in B.mini_batch_indices(16, 8, 1, 0, None, lengths)] == [list(range(8)), list(range(8, 16))]


def test_mismatch_metrics_against_their_formulas():
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0], [-0.3, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    metrics = B.mismatch_metrics(old, rollout, mask)
    diffs = torch.tensor([0.1, 0.0, -0.2])
    assert metrics["mismatch"] == pytest.approx(diffs.abs().mean().item())
    assert metrics["mismatch_max"] == pytest.approx(0.2)
    assert metrics["mismatch_kl"] == pytest.approx((diffs.exp() - diffs - 1).mean().item())
    assert metrics["ratio_dev_max"] == pytest.approx((diffs.exp() - 1).abs().max().item())


def test_importance_weights_in_mask_mode_take_rejected_tokens_out_of_the_loss():
    batch, _ = B.score_and_filter(SAMPLES[:2], max_new_tokens=4)
    batch.old_logprobs = batch.rollout_logprobs.clone()
    batch.old_logprobs[1, 2] += 2.0  # ratio e^2 > threshold 2: rejected
    metrics = B.importance_weights(batch, level="token", mode="mask", threshold=2.0)
    assert batch.loss_mask[1, 2] == 0 and batch.loss_mask.sum() == batch.response_mask.sum() - 1
    assert metrics["tis_masked_fraction"] == pytest.approx(1 / 6)
    assert batch.is_weights.shape == batch.response_mask.shape
