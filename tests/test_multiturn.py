"""Multi-turn episodes with tools (megarl/multiturn.py, megarl/tools/): only the policy's tokens train.

The token mask (in-process, naive kernels, TP = 1): a batch of episodes whose responses hold tool-result
tokens between the policy's turns goes through make_micro_batches and ActorLoss as in training. The
loss's gradient on the logits that score a tool token is exactly 0, and changing anything a tool token
carries (its advantage, its rollout and old logprobs, its reference logprob) leaves the loss, the KL and
the mismatch unchanged, while the same change on a policy token moves them (so the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from megarl.batch import score_and_filter
from megarl.model_runner import make_micro_batches
from megarl.rollout import Sample

VOCAB = 32


@pytest.fixture(scope="module")
def tp1():
    from megarl import distributed

    distributed.init_single_process_world()
    yield
    distributed.destroy_single_process_world()


def _episode(prompt, turns, prompt_index=0):
    """A Sample from [(tokens, is_policy)] turns: tool turns get logprob 0, as the episode loop gives them."""
    ids, mask, logprobs = [], [], []
    generator = torch.Generator().manual_seed(len(ids) + 7 * prompt_index)
    for tokens, mine in turns:
        ids += tokens
        mask += [int(mine)] * len(tokens)
        logprobs += (-torch.rand(len(tokens), generator=generator) * 3).tolist() if mine else [0.0] * len(tokens)
    return Sample(prompt_index, prompt, ids, "", logprobs, False, policy_mask=mask)


def _samples():
    return [_episode([1, 5, 6], [([7, 8, 9], True), ([3, 4, 4, 3], False), ([10, 11], True)], 0),
            _episode([1, 5], [([12, 2], True)], 1),  # one turn, no tool
            _episode([1, 6, 6, 7], [([13], True), ([3, 3], False), ([14, 15, 16], True), ([3, 4], False),
                                    ([17, 2], True)], 2),
            Sample(3, [1, 9], [18, 19, 2], "", [-0.5, -1.0, -0.2], False)]  # a plain single-turn sample


def _args(*flags):
    from megarl.arguments import parse_args

    return parse_args(["--model", "artifacts/tiny-qwen2", "--kernels", "naive", "--kl-coef", "0.1",
                       "--kl-placement", "loss", "--tis-level", "token", "--loss-agg", "sample_level",
                       *flags], world_size=1)


def _loss(args, batch, logits):
    """ActorLoss on each micro-batch of `batch` (the on-policy shortcut: the mismatch and TIS come from this
    forward), summed; the sums of its metrics."""
    from megarl.loss import ActorLoss, LossTerms

    terms = LossTerms(kl_coef=0.1, on_policy=True)
    loss = ActorLoss(args, VOCAB, terms, output_weight=lambda: None)
    total, sums = 0.0, {}
    for micro_batch, x in zip(make_micro_batches(batch, 2, 0), logits):
        numerator, units, reduced = loss(micro_batch, x, {})
        total = total + numerator / units
        for name, value in reduced["sums"].items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return total, sums


def _batch(samples, width_fields=None):
    batch, _ = score_and_filter(samples, max_new_tokens=16)
    generator = torch.Generator().manual_seed(3)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    # near the random logits' logprobs (about -log 32), where the KL estimators are not clamped
    batch.ref_logprobs = (-3.5 - 0.2 * torch.rand(batch.response_mask.shape, generator=generator)) * batch.response_mask
    return batch


def _logits(batch):
    shapes = [b.tokens.shape for b in make_micro_batches(batch, 2, 0)]
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(*shape, VOCAB, generator=generator).requires_grad_() for shape in shapes]


def test_policy_mask_marks_the_policy_tokens_of_each_response():
    batch, _ = score_and_filter(_samples(), max_new_tokens=16)
    assert batch.policy is not None
    assert batch.response_mask[0].tolist()[:9] == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert batch.response_mask[3].tolist()[:4] == [1, 1, 1, 0]
    assert torch.equal(batch.loss_mask, batch.response_mask)
    plain, _ = score_and_filter(_samples()[3:], max_new_tokens=16)
    assert plain.policy is None
    with pytest.raises(ValueError, match="sample 0: policy_mask has 2 entries for 3 response tokens"):
        score_and_filter([Sample(0, [1], [4, 5, 6], "", [0.0] * 3, False, policy_mask=[1, 1])], 16)


def test_tool_tokens_get_no_gradient_and_do_not_enter_loss_kl_or_mismatch(tp1):
    args = _args()
    batch = _batch(_samples())
    tool = (batch.policy == 0) & (torch.arange(batch.width)[None, :] < torch.tensor(
        [len(s.response_ids) for s in batch.samples])[:, None])
    assert tool.sum() == 8
    logits = _logits(batch)
    total, sums = _loss(args, batch, logits)
    total.backward()
    micro_batches = make_micro_batches(batch, 2, 0)
    scored_tool = 0
    for micro_batch, x in zip(micro_batches, logits):
        for sample, index in enumerate(micro_batch.indices):
            row, columns = micro_batch.response_positions(sample)
            grads = x.grad[row, columns].abs().sum(dim=-1)  # per response token of the sample
            for j, grad in enumerate(grads.tolist()):
                if tool[index, j]:
                    assert grad == 0.0, (index, j)
                    scored_tool += 1
                else:
                    assert grad > 0.0, (index, j)
    assert scored_tool == 8
    assert sums["tokens"] == batch.response_mask.sum().item() == 16.0
    assert sums["mismatch_tokens"] == 16.0

    # Anything a tool token carries changes nothing; the same change on a policy token does.
    def perturbed(where):
        changed = _batch(_samples())
        for name in ("advantages", "ref_logprobs", "rollout_logprobs"):
            value = getattr(changed, name).clone()
            value[where] += 0.5
            setattr(changed, name, value)
        return _loss(args, changed, [x.detach() for x in logits])

    with torch.no_grad():
        same, same_sums = perturbed(tool)
        assert float(same) == float(total)
        assert same_sums == sums
        policy_token = torch.zeros_like(tool)
        policy_token[0, 1] = True
        moved, moved_sums = perturbed(policy_token)
        assert float(moved) != float(total)
        assert moved_sums["mismatch"] != sums["mismatch"] and moved_sums["kl_loss"] != sums["kl_loss"]
