"""ms-swift's GRPO/GKD extras (issue 53 item 5), each against ms-swift's definition computed here by hand:
its shaping rewards (format, cosine, repetition; soft_overlong = megarl's overlong buffer), the cispo and
sapo policy losses (values and gradients, with the clip / gate active), REAL (its on-policy gradient),
GKD's sft_alpha term, the
repetition penalty's sampling parameters and refusals, and the ms-swift reader's rows for all of them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megarl import algorithms as A
from megarl.arguments import parse_args
from megarl.errors import ConfigError
from megarl.rewards import as_output, build_reward, get_reward, score_all
from megarl.rewards import swift_rules


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def settings():
    """ms-swift's defaults with cosine_max_len 100, restored afterwards."""
    saved = swift_rules.current_settings()
    swift_rules.configure(**swift_rules.DEFAULTS)
    swift_rules.configure(cosine_max_len=100)
    yield swift_rules
    swift_rules.SETTINGS.clear()
    swift_rules.SETTINGS.update(saved)


def score(name, response, row=None):
    return as_output(get_reward(name).fn(response, row or {}))


# ------------------------------------------------------------------ rewards ----
@pytest.mark.parametrize("response,expected", [
    ("<think>a\nb</think>\n<answer>5</answer>", 1.0),
    ("<think>x</think><answer>5</answer>", 1.0),
    ("<think>x</think>  <answer>5</answer>\n", 0.0),  # anything after </answer>, even a newline: 0
    (" <think>x</think><answer>5</answer>", 0.0),  # anything before <think>: 0
    ("<answer>5</answer>", 0.0),
    ("<think>x</think> 5 <answer>5</answer>", 0.0),
])
def test_format(response, expected):
    assert score("format", response).score == expected


def test_react_format():
    assert score("react_format", "<think>t</think>\nAction: search\nAction Input: {\"q\": 1}").score == 1.0
    assert score("react_format", "Action: search\nAction Input: {}").score == 0.0


def test_repetition_hand_computed(settings):
    # 9 words, 3-grams: 7 of them, 3 distinct ("a b c", "b c a", "c a b") -> (1 - 3/7) * -1.0
    assert score("repetition", "a b c a b c a b c").score == pytest.approx(-(1 - 3 / 7))
    # case folded: "The the THE the" 2-grams: 3 of them, 1 distinct -> (1 - 1/3) * -0.5
    settings.configure(repetition_n_grams=2, repetition_max_penalty=-0.5)
    assert score("repetition", "The the THE the").score == pytest.approx(-0.5 * (2 / 3))
    assert score("repetition", "no repeats at all here").score == 0.0
    assert score("repetition", "one").score == 0.0  # fewer words than n
    assert score("repetition", "").score == 0.0


def cosfn(t, T, lo_at_0, hi_at_T):
    """ms-swift's CosineReward.cosfn(t, T, min_value=value at T, max_value=value at 0), written out."""
    return lo_at_0 - (lo_at_0 - hi_at_T) * (1 - math.cos(t * math.pi / T)) / 2


@pytest.mark.parametrize("tokens", [0, 25, 50, 100])
def test_cosine_hand_computed(settings, tokens):
    right, wrong = {"gt_answer": "5", "response_tokens": tokens}, {"gt_answer": "6", "response_tokens": tokens}
    expected_right = {0: 1.0, 50: 0.75, 100: 0.5}.get(tokens, cosfn(tokens, 100, 1.0, 0.5))
    expected_wrong = {0: -0.5, 50: -0.25, 100: 0.0}.get(tokens, cosfn(tokens, 100, -0.5, 0.0))
    assert score("cosine", "so \\boxed{5}", right).score == pytest.approx(expected_right)
    assert score("cosine", "so \\boxed{5}", wrong).score == pytest.approx(expected_wrong)
    # at 25 of 100 tokens: 1 - 0.5 (1 - cos(pi/4)) / 2 for a right answer
    if tokens == 25:
        assert score("cosine", "\\boxed{5}", right).score == pytest.approx(1 - 0.5 * (1 - math.sqrt(0.5)) / 2)


def test_cosine_parameters_and_missing_length(settings):
    settings.configure(cosine_min_len_value_correct=2.0, cosine_max_len_value_correct=0.0, cosine_max_len=10)
    assert score("cosine", "\\boxed{5}", {"gt_answer": "5", "response_tokens": 5}).score == pytest.approx(1.0)
    # no token count: the sample scores 0 with an error reason (score_all), not a silent length 0
    (out,) = score_all(get_reward("cosine"), ["\\boxed{5}"], [{"gt_answer": "5"}])
    assert out.score == 0.0 and "response_tokens" in out.reason


def test_reward_row_carries_the_token_count():
    from megarl.rewards.scoring import reward_row
    from megarl.samples import Sample

    sample = Sample(0, [1, 2], [5, 6, 7], "x", None, False, metadata={"gt_answer": "1"})
    assert reward_row(sample) == {"gt_answer": "1", "response_tokens": 3}
    sample.policy_mask, sample.turns = [1, 0, 1], []
    assert reward_row(sample) == {"gt_answer": "1", "response_tokens": 2, "conversation": []}
    assert sample.metadata == {"gt_answer": "1"}  # the prompt's row itself is left alone


def test_weighted_sum_of_swift_rewards(settings):
    spec = build_reward("boxed:1.0,format:0.5,cosine:1.0,repetition:0.2")
    row = {"gt_answer": "5", "response_tokens": 50}
    response = "<think> go go go go </think><answer>\\boxed{5}</answer>"
    # boxed 1, format 1, cosine 0.75 (right, half of Lmax), repetition: 6 words ("<think>", go x 4, the rest)
    # -> 4 3-grams, 3 distinct (the two "go go go" are one)
    rep = -(1 - 3 / 4)
    assert as_output(spec.fn(response, row)).score == pytest.approx(1.0 + 0.5 + 0.75 + 0.2 * rep)


def test_soft_overlong_matches_megarl_overlong_buffer():
    """ms-swift's SoftOverlong: min(-(L - (max - cache)) / cache, 0); megarl's penalty for L <= max_len."""
    max_len, cache = 100, 20
    lengths = torch.arange(0, max_len + 1)
    swift = torch.tensor([min(-(n - (max_len - cache)) / cache, 0.0) for n in lengths.tolist()])
    assert torch.allclose(A.soft_overlong_penalty(lengths, max_len, cache), swift.to(torch.float32))


def test_code_reward_reads_verification_info():
    from megarl.rewards.code import read_test_cases

    row = {"verification_info": '{"language": "python", "test_cases": [{"input": "1\\n", "output": "2\\n"}]}'}
    assert read_test_cases(row) == (["1\n"], ["2\n"])
    with pytest.raises(ValueError, match="runs Python only"):
        read_test_cases({"verification_info": {"language": "cpp", "test_cases": []}})


# ------------------------------------------------------------------- losses ----
def loss_case():
    """Two samples x 3 tokens; ratios exp(0.9), exp(-0.4), 1.0 / exp(0.05), exp(2.0), exp(-1.5)."""
    old = torch.zeros(2, 3, dtype=torch.float64) - 1.0
    log_ratio = torch.tensor([[0.9, -0.4, 0.0], [0.05, 2.0, -1.5]], dtype=torch.float64)
    logp = (old + log_ratio).clone().requires_grad_(True)
    advantages = torch.tensor([[1.5] * 3, [-0.7] * 3], dtype=torch.float64)
    return logp, old, advantages


def test_cispo_values_and_gradients():
    logp, old, adv = loss_case()
    eps_high = 1.0  # cap 2.0: active at exp(2.0) = 7.39 (A < 0) and exp(0.9) = 2.46 (A > 0)
    loss, metrics = A.POLICY_LOSSES["cispo"](logp, old, adv, 0.2, eps_high)
    ratio = torch.exp(logp.detach() - old)
    weight = torch.minimum(ratio, torch.full_like(ratio, 2.0))
    assert torch.allclose(loss, -weight * adv * logp.detach())
    loss.sum().backward()
    # d/dlogp of -sg(w) A logp = -w A (no gradient through the weight), the capped tokens included
    assert torch.allclose(logp.grad, -weight * adv)
    assert logp.grad[0, 0].item() == pytest.approx(-2.0 * 1.5) and logp.grad[1, 1].item() == pytest.approx(2.0 * 0.7)
    assert metrics["clipped"].tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    # ms-swift: clamp(coef_1, max=epsilon_high) with epsilon_high = 2.0 is megarl's clip_eps_high 1.0
    swift = -torch.clamp(ratio, max=2.0) * adv * logp.detach()
    assert torch.allclose(loss, swift)


def test_sapo_values_and_gradients():
    logp, old, adv = loss_case()
    tau_pos, tau_neg = 1.0, 1.05
    loss, metrics = A.POLICY_LOSSES["sapo"](logp, old, adv, 0.2, 0.2, tau_pos=tau_pos, tau_neg=tau_neg)
    r = torch.exp(logp.detach() - old)
    tau = torch.tensor([[tau_pos] * 3, [tau_neg] * 3], dtype=torch.float64)
    s = torch.sigmoid(tau * (r - 1))
    assert torch.allclose(loss, -s * 4 / tau * adv)
    loss.sum().backward()
    # d/dlogp: -A (4 / tau) s (1 - s) tau r = -4 A s (1 - s) r
    assert torch.allclose(logp.grad, -4 * adv * s * (1 - s) * r)
    # at r = 1 the gradient is the policy gradient's -A; far from 1 the gate has decayed (no hard zero)
    assert logp.grad[0, 2].item() == pytest.approx(-1.5)
    assert 0 < logp.grad[1, 1].item() < 0.7 * 0.2 and not metrics["clipped"].any()
    # a hand value: r = exp(0.9), tau 1: -1.5 * 4 sigmoid(e^0.9 - 1)
    assert loss[0, 0].item() == pytest.approx(-1.5 * 4 / (1 + math.exp(-(math.exp(0.9) - 1))))


def test_sapo_gradcheck_and_first_step():
    logp, old, adv = loss_case()
    torch.autograd.gradcheck(lambda lp: A.POLICY_LOSSES["sapo"](lp, old, adv, 0.2, 0.2, tau_pos=2.0, tau_neg=3.0)[0],
                             (logp.detach().clone().requires_grad_(True),))
    for name in ("sapo", "cispo"):
        x = old.clone().requires_grad_(True)
        A.POLICY_LOSSES[name](x, old, adv, 0.2, 0.2)[0].sum().backward()
        assert torch.allclose(x.grad, -adv)  # r = 1: the plain policy gradient


# -------------------------------------------------------------------- REAL ----
def swift_real_loss(logp, old, mask, advantages, group_size, tau):
    """ms-swift's loss_type real (its Megatron GRPO trainer), written out: per sample the mean token log-ratio
    s, per group with both signs of advantage log(1 + sum_neg e^(s/tau)) + log(1 + sum_pos e^(-s/tau)), summed
    over those groups and divided by the number of groups."""
    s = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    seq_adv = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    scores, rewards = s.view(-1, group_size) / tau, seq_adv.view(-1, group_size)
    pos, neg = rewards > 0, rewards <= 0
    valid = (pos.sum(1) != 0) & (neg.sum(1) != 0)
    zeros = torch.zeros(int(valid.sum()), 1, dtype=s.dtype)
    neg_loss = torch.logsumexp(torch.cat([scores[valid].masked_fill(~neg[valid], float("-inf")), zeros], 1), 1)
    pos_loss = torch.logsumexp(torch.cat([(-scores[valid]).masked_fill(~pos[valid], float("-inf")), zeros], 1), 1)
    return (neg_loss + pos_loss).sum() / rewards.shape[0]


def test_real_advantages_give_swifts_real_gradient_on_policy():
    """megarl's `real` estimator with its sample-level PG loss has the gradient of ms-swift's REAL loss at the
    on-policy point (old = the current logprobs), for groups with 1..3 positives, ties at the mean and a group
    of equal rewards (no gradient); a sign, the 1 + n or the group-size scale wrong would fail."""
    torch.manual_seed(0)
    group, tau = 4, 0.5
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,  0.0, 1.0, 1.0, 0.0,  1.0, 1.0, 1.0, 0.0,  0.5, 0.5, 0.5, 0.5,
                            0.0, 0.5, 1.0, 0.2], dtype=torch.float64)
    lengths = torch.randint(1, 7, (rewards.numel(),))
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(torch.float64)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(rewards.numel()), lengths - 1] = rewards
    advantages, _ = A.ADVANTAGE_ESTIMATORS["real"](token_rewards, mask, group, real_tau=tau)
    grpo, _ = A.ADVANTAGE_ESTIMATORS["grpo"](token_rewards, mask, group)
    logp = (torch.randn(mask.shape, dtype=torch.float64) - 2.0).requires_grad_(True)

    token_loss, _ = A.POLICY_LOSSES["ppo_clip"](logp, logp.detach(), advantages, 0.2, 0.2, mask=mask)
    numerator, units = A.LOSS_AGGREGATIONS["sample_level"](token_loss, mask)
    (mine,) = torch.autograd.grad(numerator / units, logp)
    swift = swift_real_loss(logp, logp.detach(), mask, grpo, group, tau)
    (theirs,) = torch.autograd.grad(swift, logp)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15), (mine - theirs).abs().max()
    assert theirs[12:16].abs().max() == 0 and theirs.abs().sum() > 0  # the equal group: nothing to learn
    # at s = 0 ms-swift's loss is log(1 + n_neg) + log(1 + n_pos) per mixed group, over all 5 groups
    expected = (math.log(2 * 4) + math.log(3 * 3) + math.log(4 * 2) + math.log(3 * 3)) / 5
    assert swift.item() == pytest.approx(expected)
    # a positive sample is pushed up, a negative one down, by 1/(tau (1 + n)) x group size
    assert advantages[0, 0].item() == pytest.approx(group / (tau * 2)) and \
        advantages[1, 0].item() == pytest.approx(-group / (tau * 4))


@pytest.mark.parametrize("flags,words", [
    (["--ppo-epochs", "2"], ["--advantage-estimator real", "--ppo-epochs 2", "on-policy only"]),
    (["--loss-agg", "token_level"], ["--loss-agg token_level", "sample_level"]),
    (["--tis-level", "token"], ["--tis-level token", "no importance weights"]),
    (["--real-tau", "0"], ["--real-tau must be > 0"]),
    (["--num-generations", "1"], ["--num-generations 1"]),
])
def test_real_refuses_what_its_weights_do_not_hold_for(flags, words, tiny_model):
    base = ["--model", tiny_model, "--advantage-estimator", "real", "--loss-agg", "sample_level"]
    with pytest.raises(ConfigError) as error:
        parse_args([*base, *flags], world_size=1)
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words), str(error.value)


def test_swift_loss_type_real_is_the_real_estimator(tiny_model, tmp_path):
    config = tmp_path / "real.yaml"
    config.write_text(f"rlhf_type: grpo\nmodel: {tiny_model}\nloss_type: real\nreal_tau: 0.25\nnum_generations: 4\n"
                      f"global_batch_size: 8\n")
    args = parse_args(["--config", str(config), "--train-data", "x.jsonl"], world_size=1)
    assert (args.advantage_estimator, args.loss_agg, args.real_tau) == ("real", "sample_level", 0.25)
    config.write_text(config.read_text() + "advantage_estimator: rloo\n")
    with pytest.raises(ConfigError, match="advantage_estimator: 'rloo' with loss_type real"):
        parse_args(["--config", str(config), "--train-data", "x.jsonl"], world_size=1)


# --------------------------------------------------------------- sft_alpha ----
class Part:
    """A micro-batch stand-in for ActorLoss: logits output, naive kernels, no context parallelism."""

    def __init__(self, labels, mask):
        n = labels.shape[0]
        self.labels, self.whole = labels, SimpleNamespace(
            loss_mask=mask, old_logprobs=torch.zeros_like(mask), is_weights=None, advantages=torch.zeros_like(mask),
            response_aligned=lambda x: x)
        self.n = n

    def gather(self, value):
        return value

    def held_back(self):
        return None


@pytest.mark.parametrize("kernels,temperature", [("naive", 0.7), ("chunked", 0.7), ("naive", 1.0)])
def test_sft_alpha_adds_the_responses_cross_entropy_at_temperature_one(megatron_rank, kernels, temperature):
    """ms-swift's Megatron GKD loss_func: loss = jsd + sft_alpha * (sum of the response tokens' cross-entropy /
    their count) on batches that are not the student's; the cross-entropy is its language-model loss on the
    raw logits (temperature 1, whatever the sampling / distillation temperature)."""
    from megarl.loss import ActorLoss, LossTerms

    torch.manual_seed(0)
    vocab = 7
    logits = torch.randn(2, 4, vocab, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 4))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    args = SimpleNamespace(policy_loss="ppo_clip", loss_agg="token_level", kl_estimator="k1", kernels=kernels,
                           temperature=temperature, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None,
                           skip_threshold=20.0,
                           sapo_tau_pos=1.0, sapo_tau_neg=1.05, policy_loss_coef=0.0, entropy_coef=0.0,
                           sft_alpha=0.3, max_new_tokens=4, distill_coef=1.0)
    part = Part(labels, mask)
    numerator, units, reduced = ActorLoss(args, vocab, LossTerms(sft=True), lambda: None)(part, logits, {})
    reference = logits.detach().double().requires_grad_(True)
    nll = -torch.log_softmax(reference, -1).gather(-1, labels[..., None])[..., 0]  # T = 1, not 0.7
    expected = 0.3 * (nll * mask).sum() / mask.sum()
    assert torch.allclose((numerator / units).double(), expected.detach(), atol=1e-6)
    assert torch.allclose(reduced["sums"]["sft_loss"].double(), (nll.detach() * mask).sum(), atol=1e-5)
    (numerator / units).backward()
    expected.backward()
    assert torch.allclose(logits.grad.double(), reference.grad, atol=1e-6)
    # without the term (a step on the student's own samples) nothing is added
    numerator, units, reduced = ActorLoss(args, vocab, LossTerms(sft=False), lambda: None)(part, logits, {})
    assert numerator.item() == 0.0 and "sft_loss" not in reduced["sums"]


# -------------------------------------------------------- repetition penalty ----
def test_repetition_penalty_reaches_sampling_params():
    pytest.importorskip("vllm")
    from megarl.rollout import sampling_params

    args = SimpleNamespace(seed=1, top_p=1.0, top_k=-1, max_new_tokens=8, stop=[], repetition_penalty=1.3)
    (params,) = sampling_params(args, [0], 0, (), 1, 1.0, 0, False)
    assert params.repetition_penalty == 1.3


def test_vllm_processed_logprobs_are_taken_after_the_penalties():
    """vLLM 0.32's sampler applies the penalties in apply_logits_processors, before `sample` computes the
    processed logprobs megarl asks for (logprobs_mode processed_logprobs): the rollout logprobs are the
    penalised sampler's, what --tis-level corrects with."""
    vllm_sampler = pytest.importorskip("vllm.v1.sample.sampler")
    import inspect

    forward = inspect.getsource(vllm_sampler.Sampler.forward)
    assert forward.index("apply_logits_processors(") < forward.index("self.sample(")
    assert "apply_penalties" in inspect.getsource(vllm_sampler.Sampler.apply_logits_processors)


# ---------------------------------------------------------------- arguments ----
@pytest.mark.parametrize("flags,message", [
    (["--policy-loss", "sapo", "--dual-clip-c", "3"], "--policy-loss sapo has no such clip"),
    (["--policy-loss", "cispo", "--clip-eps-high", "-1"], "--policy-loss cispo caps the weight"),
    (["--sapo-tau-neg", "0"], "--sapo-tau-pos and --sapo-tau-neg must be > 0"),
    (["--sft-alpha", "0.1"], "with --gkd-lmbda 1 every step trains on the student's own"),
    (["--repetition-penalty", "1.2"], "set --tis-level"),
    (["--repetition-max-penalty", "0.5"], "--repetition-max-penalty <= 0"),
])
def test_refusals_are_one_line(tiny_model, flags, message):
    with pytest.raises(ConfigError) as error:
        parse_args(["--model", tiny_model, *flags], world_size=1)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_flags_with_swift_defaults(tiny_model):
    args = parse_args(["--model", tiny_model, "--policy-loss", "sapo", "--repetition-penalty", "1.1",
                       "--tis-level", "token", "--reward", "cosine:1,repetition:0.5"], world_size=1)
    assert (args.sapo_tau_pos, args.sapo_tau_neg, args.repetition_penalty) == (1.0, 1.05, 1.1)
    assert (args.cosine_min_len_value_wrong, args.cosine_max_len_value_wrong, args.cosine_min_len_value_correct,
            args.cosine_max_len_value_correct, args.cosine_max_len) == (-0.5, 0.0, 1.0, 0.5, None)
    assert (args.repetition_n_grams, args.repetition_max_penalty, args.sft_alpha) == (3, -1.0, 0.0)


# ------------------------------------------------------------------ reader -----
SWIFT = "rlhf_type: grpo\ncolocate_groups: [[train, rollout]]\ntrain: {gpus: 2}\nrollout: {gpus: 2}\n" \
        "global_batch_size: 16\n"


def _swift(tmp_path, tiny_model, text, *flags):
    config = tmp_path / "c.yaml"
    config.write_text(SWIFT + text)
    return parse_args(["--config", str(config), "--model", tiny_model, *flags], world_size=2)


def test_reader_maps_reward_funcs_with_weights_and_parameters(tmp_path, tiny_model):
    args = _swift(tmp_path, tiny_model, "reward_funcs: [accuracy, format, cosine, repetition]\n"
                                        "reward_weights: [1.0, 0.5, 1.0, 0.2]\ncosine_max_len: 300\n"
                                        "cosine_min_len_value_wrong: -1.0\nrepetition_n_grams: 4\n"
                                        "repetition_max_penalty: -0.5\nmax_completion_length: 400\n")
    assert args.reward == "boxed,format:0.5,cosine,repetition:0.2"
    assert (args.cosine_max_len, args.cosine_min_len_value_wrong, args.repetition_n_grams,
            args.repetition_max_penalty, args.cosine_max_len_value_correct) == (300, -1.0, 4, -0.5, 0.5)
    args = _swift(tmp_path, tiny_model, "reward_funcs: [code_reward, soft_overlong]\nsoft_cache_length: 64\n")
    assert args.reward == "code" and args.overlong_buffer_len == 64


def test_reader_maps_cispo_and_sapo(tmp_path, tiny_model):
    args = _swift(tmp_path, tiny_model, "loss_type: cispo\nepsilon_high: 5.0\n")
    assert (args.policy_loss, args.loss_agg, args.clip_eps_high) == ("cispo", "token_level", 4.0)
    args = _swift(tmp_path, tiny_model, "loss_type: sapo\ntau_pos: 2.0\ntau_neg: 3.0\n")
    assert (args.policy_loss, args.loss_agg, args.sapo_tau_pos, args.sapo_tau_neg) == ("sapo", "sample_level", 2.0, 3.0)
    args = _swift(tmp_path, tiny_model, "repetition_penalty: 1.05\nrollout_importance_sampling_mode: token_truncate\n")
    assert (args.repetition_penalty, args.tis_level) == (1.05, "token")


@pytest.mark.parametrize("text,message", [
    ("loss_type: cispo\n", "epsilon_high: unset (epsilon) with loss_type cispo"),
    ("loss_type: cispo\nepsilon_high: 0.3\n", "caps the IS weight at epsilon_high itself"),
    ("loss_type: sapo\nimportance_sampling_level: sequence\n", "megarl's sapo uses the token ratio"),
    ("loss_type: real\nsteps_per_generation: 2\n", "REAL's weights are its gradient on-policy only"),
    ("loss_type: fipo\n", "FIPO: future-KL"),
    ("reward_funcs: [soft_overlong]\nreward_weights: [0.5]\nsoft_cache_length: 8\n", "soft_overlong weighted 0.5"),
    ("reward_funcs: [code_format]\n", "'code_format' is an ms-swift built-in reward megarl does not have"),
    ("repetition_penalty: 1.1\n", "set rollout_importance_sampling_mode"),
])
def test_reader_refusals_are_one_line(tmp_path, tiny_model, text, message):
    with pytest.raises(ConfigError) as error:
        _swift(tmp_path, tiny_model, text)
    assert message in str(error.value) and "\n" not in str(error.value)
