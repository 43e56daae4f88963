"""fp16's loss scaling (issue 54): Megatron-core's schedules multiply the last stage's loss by
`config.grad_scale_func` before its backward, and the fp16 optimizer divides the gradients by its scale
before the step. Megatron-core leaves the wiring to its caller; before megarl did it, an fp16 step divided
unscaled gradients by 2^32 and never saw an overflow, so it updated by almost nothing.

In-process, one Megatron rank on CPU with the real fp16 model, DDP, optimizer and loss scaler. --fp16 is
refused on CPU ranks for vLLM's sake (accelerator.check_supported: its CPU backend has no float16), which
these tests step around: they build the trainer, not a run.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from helpers import FP16_EPS, FP16_PATHS_ULPS, nll, ulps

SCALE = 2.0**10  # a static --loss-scale at the default's size
PROMPTS = ["What is 12 + 7?", "What is 3 + 45?", "Compute 8 + 9.", "What is 21 + 30?"]


@pytest.fixture(scope="module")
def own_samples(tiny_model):
    """Two micro-batches of two rows: the tiny model's own greedy answers to arithmetic prompts (transformers'
    generate), the responses in the loss; what RL trains on. (helpers.micro_batches' random tokens, 17 nats a
    token, push layer 0's fp16 weight gradient past 65504 already at a scale of 2^10: a loss scale's test
    needs data whose gradients fit at the scales it compares.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.model_runner import MicroBatch

    tokenizer, model = AutoTokenizer.from_pretrained(tiny_model), AutoModelForCausalLM.from_pretrained(tiny_model)
    sequences = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0].tolist()
        sequences.append((out, len(ids)))
    batches = []
    for first in range(0, len(sequences), 2):
        rows = sequences[first:first + 2]
        length = max(len(sequence) for sequence, _ in rows)
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        labels, loss_mask = torch.zeros_like(tokens), torch.zeros(len(rows), length)
        for row, (sequence, prompt) in enumerate(rows):
            tokens[row, :len(sequence)] = torch.tensor(sequence)
            labels[row, :len(sequence) - 1] = torch.tensor(sequence[1:])
            loss_mask[row, prompt - 1:len(sequence) - 1] = 1.0
        spans = [(row, 0, prompt, len(sequence) - prompt) for row, (sequence, prompt) in enumerate(rows)]
        batches.append(MicroBatch(tokens, labels, loss_mask, spans, {},
                                  torch.arange(length).expand(len(rows), length).contiguous(),
                                  [first + row for row in range(len(rows))]))
    return batches


@pytest.fixture
def fp16_host(monkeypatch):
    from megarl import accelerator

    monkeypatch.setattr(accelerator, "check_supported", lambda *args, **kwargs: None)


def trainer(model: str, *flags: str, role: str = "actor"):
    from transformers import AutoConfig

    from megarl.actor import Actor
    from megarl.arguments import parse_args
    from megarl.critic import Critic

    args = parse_args(["--model", model, "--lr", "1e-2", "--micro-batch-size", "2", "--fp16",
                       "--advantage-estimator", "gae", "--critic-lr", "1e-2", *flags], world_size=1)
    return (Actor if role == "actor" else Critic)(args, AutoConfig.from_pretrained(model))


def fused_nll(actor):
    """helpers.nll through the fused kernels from the final hidden states (the actor's own path): the output
    weight's gradient goes into its main_grad in fp32, the hidden's through the fp16 row scaling."""
    from megarl import kernels
    from megarl.model_runner import output_weight

    def loss(batch, hidden, companion_outputs):
        logprobs, _ = kernels.logprobs_and_entropy_from_hidden(hidden, output_weight(actor.model), batch.labels,
                                                               actor.hf_config.vocab_size, 1.0, "chunked")
        total = -(logprobs.float() * batch.loss_mask).sum()
        return total, batch.loss_mask.sum().to(torch.int), {"sums": {"loss": total.detach()}}

    return loss


def main_grads(actor, batches, loss_fn, hidden: bool) -> dict[str, torch.Tensor]:
    """One forward-backward (no step) over the micro-batches: every parameter's main_grad, before unscaling."""
    from megarl.model_runner import forward_backward

    actor.model.train()
    actor.model.zero_grad_buffer()
    forward_backward(actor.model, batches, loss_fn, False, 2, hidden=hidden)
    return {name: param.main_grad.clone() for name, param in actor.model.named_parameters()}


def fp32_main_params(actor) -> list[torch.Tensor]:
    """The fp16 optimizer's fp32 copies of the parameters (what Adam updates)."""
    return [param for part in actor.optimizer.chained_optimizers for group in part.fp32_from_float16_groups
            for param in group]


def test_the_policy_and_the_critic_scale_their_loss_by_their_optimizers_scale(megatron_rank, tiny_model, fp16_host):
    """The config Megatron's schedules read (get_model_config of the DDP model) carries the optimizer's
    scale_loss, for both trained models; the scale starts at --initial-loss-scale's default."""
    from megatron.core.utils import get_model_config

    for role in ("actor", "critic"):
        model = trainer(tiny_model, role=role)
        config = get_model_config(model.model)
        assert config.grad_scale_func == model.optimizer.scale_loss, role
        assert next(model.model.parameters()).dtype == torch.float16
        assert model.optimizer.get_loss_scale().item() == 2.0**10, role
        assert config.grad_scale_func(torch.ones(1)).item() == 2.0**10, role


def test_the_gradient_before_unscaling_is_the_scale_times_the_unscaled_one(megatron_rank, tiny_model, fp16_host,
                                                                             own_samples):
    """Every parameter's accumulated gradient at a static loss scale S is S times the one at scale 1, from the
    logits and through the fused kernels from hidden states (a tied output weight: its main_grad gets the
    kernels' fp32 part and the embedding lookup's through DDP's hook). Not wired: the ratio is 1; scaled twice
    (the loss function scaling too): S^2. Within fp16 rounding: the scale is a power of two, so the two
    backward passes round alike except where a scale-1 value falls below fp16's normal range."""
    runs = {scale: trainer(tiny_model, "--loss-scale", str(scale)) for scale in (1.0, SCALE)}
    for hidden in (False, True):
        grads = {scale: main_grads(actor, own_samples, fused_nll(actor) if hidden else nll, hidden)
                 for scale, actor in runs.items()}
        for name, unscaled in grads[1.0].items():
            scaled = grads[SCALE][name]
            assert torch.isfinite(scaled).all(), name
            error = ulps(scaled / SCALE, unscaled, eps=FP16_EPS)
            assert error <= FP16_PATHS_ULPS, f"{'hidden' if hidden else 'logits'} {name}: {error:.3g} fp16 ulps"
        assert any(grad.abs().max() > 0 for grad in grads[1.0].values())


def test_an_fp16_step_at_the_default_scale_is_the_step_at_scale_1(megatron_rank, tiny_model, fp16_host,
                                                                  own_samples):
    """One optimizer step at the default dynamic scale, at a static scale of 1, and at 1 with the wiring
    removed: the step is taken, the unscaled gradient norm is the same (fp16 rounding apart; the no-op this
    guards against divided it by the scale), the two scale-1 steps are the same bit for bit (the wiring adds
    nothing at scale 1), and Adam's first step moves the parameters by about the LR (a gradient divided by 2^32
    without being multiplied first moved them by lr |g| / (2^32 eps), ~1% of it)."""
    from megatron.core.utils import get_model_config

    steps = {}
    for name, flags, wired in (("default", [], True), ("scale 1", ["--loss-scale", "1"], True),
                               ("scale 1 unwired", ["--loss-scale", "1"], False)):
        actor = trainer(tiny_model, *flags)
        if not wired:
            get_model_config(actor.model).grad_scale_func = None
        before = [param.detach().clone() for param in fp32_main_params(actor)]
        model_before = [param.detach().clone() for param in actor.model.parameters()]
        _, grad_norm = actor.optimizer_step(own_samples, nll)
        assert all(not torch.equal(param, start) for param, start in zip(actor.model.parameters(), model_before)), name
        steps[name] = (grad_norm, [param.detach() - start for param, start in zip(fp32_main_params(actor), before)])
    (default_norm, default_moves), (one_norm, one_moves), (unwired_norm, unwired_moves) = steps.values()
    assert math.isfinite(default_norm) and one_norm > 0
    assert ulps(default_norm, one_norm, eps=FP16_EPS) <= FP16_PATHS_ULPS, (default_norm, one_norm)
    assert unwired_norm == one_norm and all(torch.equal(a, b) for a, b in zip(one_moves, unwired_moves))
    lr = 1e-2
    magnitudes = torch.cat([move.abs().flatten() for move in default_moves])
    assert statistics.median(magnitudes.tolist()) > lr / 2, statistics.median(magnitudes.tolist())
