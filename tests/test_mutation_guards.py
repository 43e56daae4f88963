"""Tests the mutation lane (tools/mutations.py, `bash run_tests.sh -m mutations`) found missing: each one
fails under a mutation the rest of the suite let survive, and passes on the real code.

- The actor's loss against its formula written out here, in value and gradient (in-process, naive kernels,
  TP = 1): the sampled tokens' logprobs from the sequences themselves (not the micro-batch's labels), the
  on-policy shortcut's ratio exp(logp - sg(logp)), TIS weights, KL in the loss, the entropy bonus, a sample
  filtered out of the loss mask; and the top-k distillation term's value and sign. The distillation losses
  pass no gradient to the teacher.
- The micro-batch layout: every response token is the label of the position before it.
- The optimizer step (one in-process Megatron rank, the tiny model): the LR schedule advances with each step
  and a checkpoint's schedule loads; gradient clipping scales the gradient Adam sees.
- Data-parallel balance: each rank gets its share of samples whatever their lengths.
- Routing replay: a sample's recorded route of token t sits at the position of token t.
"""

from __future__ import annotations

import pytest
import torch

from helpers import micro_batches, nll
from megarl.batch import score_and_filter
from megarl.model_runner import make_micro_batches
from megarl.samples import Sample

VOCAB = 32
KL_COEF, ENTROPY_COEF, TIS_THRESHOLD = 0.1, 0.05, 1.5


def _samples():
    """Prompts and responses of the toy vocabulary; rollout logprobs around log(1 / VOCAB), so that the TIS
    ratios exp(old - rollout) of random logits fall on both sides of the threshold."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for index, (p, r) in enumerate([(3, 5), (2, 3), (4, 6), (3, 2), (2, 4)]):
        prompt = torch.randint(1, VOCAB, (p,), generator=generator).tolist()
        response = torch.randint(1, VOCAB, (r,), generator=generator).tolist()
        logprobs = (-2.5 - 2.0 * torch.rand(r, generator=generator)).tolist()
        out.append(Sample(index, prompt, response, "", logprobs, False))
    return out


def _batch(samples):
    batch, _ = score_and_filter(samples, max_new_tokens=16)
    generator = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    batch.ref_logprobs = (-3.5 - 0.3 * torch.rand(batch.response_mask.shape, generator=generator)) * \
        batch.response_mask
    loss_mask = batch.loss_mask.clone()
    loss_mask[1] = 0.0  # a sample left out of the loss (as --filter-truncated does): it must weigh nothing
    batch.loss_mask = loss_mask
    return batch


def _args(model, *flags):
    from megarl.arguments import parse_args

    return parse_args(["--model", model, "--kernels", "naive", *flags], world_size=1)


def _logits(micro_batches_, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*b.tokens.shape, VOCAB, generator=generator).requires_grad_() for b in micro_batches_]


def _actor_loss(args, terms, micro_batches_, logits):
    """The global loss of the micro-batches as Megatron forms it (numerators and units summed) and the sums."""
    from megarl.loss import ActorLoss

    loss = ActorLoss(args, VOCAB, terms, output_weight=lambda: None)
    numerator, units, sums = 0.0, 0, {}
    for micro_batch, x in zip(micro_batches_, logits):
        n, u, reduced = loss(micro_batch, x, {})
        numerator, units = numerator + n, units + int(u)
        for name, value in reduced["sums"].items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return numerator / units, sums


def _response_logits(batch, micro_batches_, logits):
    """Per sample i: (the logits [r, V] of the positions that score its response tokens, the tokens [r]),
    the positions found from the sample's own lengths and the tokens from its sequence."""
    out = {}
    for micro_batch, x in zip(micro_batches_, logits):
        for k, index in enumerate(micro_batch.indices):
            sample = batch.samples[index]
            row, offset = micro_batch.spans[k][:2]
            p, r = len(sample.prompt_ids), len(sample.response_ids)
            out[index] = (x[row, offset + p - 1: offset + p + r - 1], torch.tensor(sample.response_ids))
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_the_actor_loss_is_its_formula_in_value_and_gradient(packed, megatron_rank, tiny_model):
    """On-policy shortcut (old = sg(new): ratio 1, gradient A grad logp), token TIS truncated at the
    threshold, k3 KL to the reference in the loss, the entropy bonus, token-mean aggregation over the loss
    mask, one sample filtered out of it."""
    from megarl.loss import LossTerms

    args = _args(tiny_model, "--kl-coef", str(KL_COEF), "--kl-placement", "loss", "--kl-estimator", "low_var_kl",
                 "--tis-level", "token", "--tis-threshold", str(TIS_THRESHOLD), "--entropy-coef",
                 str(ENTROPY_COEF), "--loss-agg", "token_level")
    batch = _batch(_samples())
    layout = make_micro_batches(batch, 2, 0, packed=packed)
    logits = _logits(layout)
    total, sums = _actor_loss(args, LossTerms(kl_coef=KL_COEF, on_policy=True), layout, logits)
    mine = torch.autograd.grad(total, logits)

    numerator, units, clipped = 0.0, 0.0, 0
    for index, (x, tokens) in _response_logits(batch, layout, logits).items():
        r = len(tokens)
        all_logprobs = torch.log_softmax(x.float() / args.temperature, dim=-1)
        logp = all_logprobs.gather(-1, tokens[:, None])[:, 0]
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
        advantage, ref = batch.advantages[index, :r], batch.ref_logprobs[index, :r]
        ratio = torch.exp(logp - logp.detach())
        raw = torch.exp(logp.detach() - batch.rollout_logprobs[index, :r])
        weight = raw.clamp(max=TIS_THRESHOLD)
        clipped += int((raw > TIS_THRESHOLD).sum())
        kl = torch.exp(ref - logp) - (ref - logp) - 1.0
        token_loss = -advantage * ratio * weight + KL_COEF * kl - ENTROPY_COEF * entropy
        mask = batch.loss_mask[index, :r]
        numerator = numerator + (token_loss * mask).sum()
        units += float(mask.sum())
    assert 0 < clipped < batch.response_mask.sum()  # the threshold acts on some tokens, not all
    reference = numerator / units
    expected = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(mine, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert sums["tokens"] == units


def test_the_distillation_term_is_the_top_k_reverse_kl(megatron_rank, tiny_model):
    """--gkd-logits-topk 4 --gkd-beta 1 (renorm): per token KL(student || teacher) over the teacher's 4 ids,
    both renormalised over them; a loss the student lowers by moving towards the teacher (positive)."""
    from megarl.loss import LossTerms

    args = _args(tiny_model, "--loss-agg", "token_level")
    args.gkd_logits_topk, args.gkd_beta, args.gkd_topk_mode, args.gkd_temperature = 4, 1.0, "renorm", 1.0
    args.distill_coef, args.policy_loss_coef = 0.7, 1.0
    batch = _batch(_samples())
    generator = torch.Generator().manual_seed(9)
    teacher = torch.log_softmax(torch.randn(*batch.response_mask.shape, VOCAB, generator=generator) * 2, dim=-1)
    batch.teacher_topk_logprobs, batch.teacher_topk_ids = teacher.topk(4, dim=-1)
    batch.advantages = torch.zeros_like(batch.response_mask)  # the policy-gradient term is 0
    layout = make_micro_batches(batch, 2, 0)
    logits = _logits(layout)
    total, _ = _actor_loss(args, LossTerms(distill=True, on_policy=True), layout, logits)

    numerator, units = 0.0, 0.0
    for index, (x, _) in _response_logits(batch, layout, logits).items():
        r = x.shape[0]
        ids = batch.teacher_topk_ids[index, :r]
        student = torch.log_softmax(x.float().gather(-1, ids), dim=-1)
        teacher_k = torch.log_softmax(batch.teacher_topk_logprobs[index, :r], dim=-1)
        kl = (student.exp() * (student - teacher_k)).sum(-1)
        mask = batch.loss_mask[index, :r]
        numerator = numerator + (args.distill_coef * kl * mask).sum()
        units += float(mask.sum())
    reference = numerator / units
    assert reference > 0
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(total, logits), torch.autograd.grad(reference, logits)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_distillation_losses_pass_no_gradient_to_the_teacher(beta):
    """The teacher is a constant (algorithms' Distillation conventions): its logits or top-k log-probs get no
    gradient even where they carry one (a teacher that shares the policy's weights, as OPSD's)."""
    from megarl.algorithms import GKD_TOPK_MODES, distill_full

    generator = torch.Generator().manual_seed(3)
    student = torch.randn(3, 5, VOCAB, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 5, VOCAB, generator=generator, requires_grad=True)
    distill_full(student, teacher, beta, temperature=0.8).sum().backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None
    topk_logprobs, ids = torch.log_softmax(teacher.detach(), dim=-1).topk(6, dim=-1)
    for mode, loss in GKD_TOPK_MODES.items():
        teacher_topk = topk_logprobs.clone().requires_grad_()
        loss(student, ids, teacher_topk, beta, 0.8).sum().backward()
        assert teacher_topk.grad is None, mode


@pytest.mark.parametrize("packed", [False, True])
def test_each_response_token_is_the_label_of_the_position_before_it(packed):
    batch, _ = score_and_filter(_samples(), max_new_tokens=16)
    for micro_batch in make_micro_batches(batch, 2, 0, packed=packed):
        for k, index in enumerate(micro_batch.indices):
            sample = batch.samples[index]
            row, offset, p, r = micro_batch.spans[k]
            sequence = sample.prompt_ids + sample.response_ids
            assert (p, r) == (len(sample.prompt_ids), len(sample.response_ids))
            assert micro_batch.tokens[row, offset: offset + p + r].tolist() == sequence
            assert micro_batch.labels[row, offset: offset + p + r - 1].tolist() == sequence[1:]
            row, columns = micro_batch.response_positions(k)
            assert micro_batch.labels[row, columns].tolist() == sample.response_ids
            assert micro_batch.loss_mask[row, columns].tolist() == [1.0] * r


# ------------------------------------------------------------ the optimizer step ----
def _actor(model, *flags):
    from transformers import AutoConfig

    from megarl.actor import Actor
    from megarl.arguments import parse_args

    args = parse_args(["--model", model, "--micro-batch-size", "2", *flags], world_size=1)
    return Actor(args, AutoConfig.from_pretrained(model))


def test_the_lr_schedule_advances_with_each_step_and_loads_from_a_checkpoint(megatron_rank, tiny_model):
    """4 steps of linear warm-up to 1e-3: the LR after step k is k / 4 of it; a fresh actor that loads the
    schedule's state (what a checkpoint keeps) goes on from there."""
    flags = ("--lr", "1e-3", "--lr-warmup-steps", "4", "--lr-decay-style", "linear", "--train-steps", "20")
    actor = _actor(tiny_model, *flags)
    lrs = []
    for step in range(3):
        actor.optimizer_step(micro_batches(seed=step), nll)
        lrs.append(actor.lr)
    assert lrs == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3], rel=1e-9)
    resumed = _actor(tiny_model, *flags)
    assert resumed.lr == 0.0
    resumed.load_state_dict(actor.state_dict())
    assert resumed.lr == pytest.approx(0.75e-3, rel=1e-9)
    for role in (actor, resumed):
        role.optimizer_step(micro_batches(seed=3), nll)
    assert resumed.lr == actor.lr == pytest.approx(1e-3, rel=1e-9)


def test_gradient_clipping_scales_the_gradient_adam_sees(megatron_rank, tiny_model):
    """--clip-grad c with a gradient of norm G > c: the step is the step of an unclipped actor whose loss is
    scaled by c / G (Megatron's clip coefficient c / (G + 1e-6)), and far from the unclipped step (Adam's
    first step moves each parameter with a gradient by about the LR; a clipped gradient near Adam's epsilon
    moves it less)."""
    clip, lr = 1e-6, 1e-3
    actors = {name: _actor(tiny_model, "--lr", str(lr), "--clip-grad", str(clip) if name == "clipped" else "0")
              for name in ("clipped", "scaled", "unclipped")}
    before = [p.detach().clone() for p in actors["clipped"].model.parameters()]
    batches = micro_batches(seed=1)
    _, norm = actors["clipped"].optimizer_step(batches, nll)
    assert norm > 1e3 * clip
    scale = clip / (norm + 1e-6)

    def scaled_nll(batch, logits, companion_outputs):
        loss, units, sums = nll(batch, logits, companion_outputs)
        return loss * scale, units, sums

    _, scaled_norm = actors["scaled"].optimizer_step(batches, scaled_nll)
    assert scaled_norm == pytest.approx(norm * scale, rel=1e-4)
    actors["unclipped"].optimizer_step(batches, nll)

    def moved(name):
        return torch.cat([(p.detach() - b).abs().flatten()
                          for p, b in zip(actors[name].model.parameters(), before)]).mean().item()

    assert 0 < moved("clipped") < 0.5 * moved("unclipped")
    for a, b in zip(actors["clipped"].model.parameters(), actors["scaled"].model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=lr * 1e-3)


# -------------------------------------------------------------- data-parallel balance ----
def test_each_data_parallel_rank_gets_its_share_of_samples_even_when_one_outweighs_the_rest():
    """--balance-batch: equal sample counts per rank come first (every rank must run the same micro-batches:
    the schedule and the gradient all-reduce are collective); near-equal tokens only within that."""
    from megarl.packing import data_parallel_partitions

    assert data_parallel_partitions([100, 1, 1, 1], 2) == [[0, 3], [1, 2]]
    for lengths, count in (([500, 3, 2, 1, 1, 1], 3), ([7, 7, 7, 7, 900, 1, 1, 1], 4)):
        groups = data_parallel_partitions(lengths, count)
        assert [len(g) for g in groups] == [len(lengths) // count] * count, groups
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


# ------------------------------------------------------------------ routing replay ----
def test_a_samples_route_of_token_t_is_at_the_position_of_token_t():
    from megarl.routing_replay import NO_ROUTE, micro_batch_routes

    samples = []
    for index, (p, r) in enumerate([(3, 4), (2, 2)]):
        sample = Sample(index, list(range(1, p + 1)), list(range(10, 10 + r)), "", [-1.0] * r, False)
        # token t's route in every layer and slot: 100 * sample + t (the last response token has none)
        sample.routes = (100 * index + torch.arange(p + r - 1))[:, None, None].expand(-1, 2, 2).to(torch.int16)
        samples.append(sample)
    for places, shape in (([(0, 0), (1, 0)], (2, 8)), ([(0, 0), (0, 7)], (1, 12))):  # padded rows, one packed row
        routes = micro_batch_routes(samples, places, shape)
        for index, (sample, (row, offset)) in enumerate(zip(samples, places)):
            fed = len(sample.routes)
            assert routes[row, offset: offset + fed, 1, 0].tolist() == [100 * index + t for t in range(fed)]
        assert (routes == NO_ROUTE).sum() == 2 * 2 * (shape[0] * shape[1] - sum(len(s.routes) for s in samples))
