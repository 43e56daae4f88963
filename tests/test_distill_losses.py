"""Distillation losses of megarl/algorithms.py against hand-written references.

The references are numpy float64 with explicit probabilities: softmax, the
KL divergence sum p log(p / q) with 0 log 0 = 0, the mixture M = beta P_t +
(1 - beta) P_s, the renormalised top-k bins and the tail bin 1 - sum. None of
them uses the module's helpers. The implementation runs in float32 and is judged by the fp32 rule
of tests/helpers.py (ulps of the compared scale against the float64 reference).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import EPS32, FP32_ULPS, assert_fp32_close, assert_fp32_paths_agree

from megarl import algorithms as A

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
TEMPERATURES = [1.0, 0.7, 2.0]


# --------------------------------------------------------------- references ----
def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """sum_i p_i log(p_i / q_i) over the last axis, 0 log 0 = 0."""
    out = np.zeros(p.shape[:-1])
    for index in np.ndindex(*p.shape[:-1]):
        total = 0.0
        for pi, qi in zip(p[index], q[index]):
            if pi > 0:
                total += pi * np.log(pi / qi)
        out[index] = total
    return out


def jsd(ps: np.ndarray, pt: np.ndarray, beta: float) -> np.ndarray:
    """TRL's generalised JSD from probabilities: 0 -> KL(t || s), 1 -> KL(s || t)."""
    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = beta * pt + (1 - beta) * ps
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def ref_full(s, t, beta, temperature):
    return jsd(softmax(s / temperature), softmax(t / temperature), beta)


def take(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, ids, axis=-1)


def ref_renorm(s, teacher_logprobs, ids, beta, temperature):
    """teacher_logprobs: the top-k log-probs as given to the loss (the teacher is its input, not its logits)."""
    ps, pt = take(softmax(s / temperature), ids), np.exp(np.asarray(teacher_logprobs, dtype=np.float64))
    return jsd(ps / ps.sum(-1, keepdims=True), pt / pt.sum(-1, keepdims=True), beta)


def ref_tail(s, teacher_logprobs, ids, beta, temperature):
    """K + 1 bins; each side's tail mass 1 - sum, at least the documented floor (1e-7)."""
    ps, pt = take(softmax(s / temperature), ids), np.exp(np.asarray(teacher_logprobs, dtype=np.float64))
    ps = np.concatenate([ps, np.maximum(1 - ps.sum(-1, keepdims=True), 1e-7)], axis=-1)
    pt = np.concatenate([pt, np.maximum(1 - pt.sum(-1, keepdims=True), 1e-7)], axis=-1)
    return jsd(ps, pt, beta)


REFERENCES = {"renorm": ref_renorm, "tail": ref_tail}


# ------------------------------------------------------------------- inputs ----
def logits(seed: int, shape=(2, 3, 11), scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape) * scale, rng.normal(size=shape) * scale


def teacher_topk(t: np.ndarray, k: int, temperature: float):
    """The teacher's top-k ids and their log-probs of the full softmax(t / T), as the caller provides them."""
    logprobs = torch.log_softmax(torch.tensor(t, dtype=torch.float32) / temperature, dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1)
    return ids, values


def f32(x: np.ndarray, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, requires_grad=grad)


def loss_and_grad(fn, s: np.ndarray, *args):
    student = f32(s, grad=True)
    loss = fn(student, *args)
    (grad,) = torch.autograd.grad(loss.sum(), student)
    return loss.detach(), grad


# --------------------------------------------------------------- full vocab ----
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_full_against_reference(beta, temperature):
    s, t = logits(0)
    out = A.distill_full(f32(s), f32(t), beta, temperature)
    assert out.shape == s.shape[:-1] and out.dtype == torch.float32
    assert_fp32_close(out.numpy(), ref_full(s, t, beta, temperature))
    out64 = A.distill_full(torch.tensor(s), torch.tensor(t), beta, temperature)
    assert out64.dtype == torch.float64
    np.testing.assert_allclose(out64.numpy(), ref_full(s, t, beta, temperature), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_beta_endpoints_are_the_two_kls(temperature):
    s, t = logits(1)
    ps, pt = softmax(s / temperature), softmax(t / temperature)
    forward = A.distill_full(f32(s), f32(t), 0.0, temperature).numpy()
    reverse = A.distill_full(f32(s), f32(t), 1.0, temperature).numpy()
    assert_fp32_close(forward, kl(pt, ps))
    assert_fp32_close(reverse, kl(ps, pt))
    # and against torch's own KL: F.kl_div(input=log q, target=p) = sum p (log p - log q)
    ls = torch.log_softmax(torch.tensor(s) / temperature, -1)
    lt = torch.log_softmax(torch.tensor(t) / temperature, -1)
    kd = torch.nn.functional.kl_div
    assert_fp32_close(forward, kd(ls, lt, reduction="none", log_target=True).sum(-1).numpy())
    assert_fp32_close(reverse, kd(lt, ls, reduction="none", log_target=True).sum(-1).numpy())
    assert (forward != reverse).any()


def test_jsd_properties():
    s, t = logits(2)
    # beta 0.5 is the symmetric JSD; beta and 1 - beta swap the roles of student and teacher
    half = A.distill_full(f32(s), f32(t), 0.5).numpy()
    assert_fp32_paths_agree(half, A.distill_full(f32(t), f32(s), 0.5).numpy())
    assert_fp32_paths_agree(A.distill_full(f32(s), f32(t), 0.1).numpy(),
                            A.distill_full(f32(t), f32(s), 0.9).numpy())
    assert (half >= 0).all() and (half <= np.log(2) * (1 + FP32_ULPS * EPS32)).all()
    # identical distributions: 0 up to the rounding of terms of O(1)
    assert_fp32_close(A.distill_full(f32(s), f32(s), 0.3), np.zeros(s.shape[:-1]), scale=1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_gradients_analytic(temperature, dtype):
    """d KL(t || s) / d s = (p_s - p_t) / T; d KL(s || t) / d s_j = p_s,j (log p_s,j - log p_t,j - KL) / T."""
    s, t = logits(3)
    ps, pt = softmax(s / temperature), softmax(t / temperature)
    teacher = torch.tensor(t, dtype=dtype)

    def grad_of(beta):
        student = torch.tensor(s, dtype=dtype, requires_grad=True)
        A.distill_full(student, teacher, beta, temperature).sum().backward()
        return student.grad.numpy()

    expected = ps * (np.log(ps) - np.log(pt) - kl(ps, pt)[..., None]) / temperature
    for beta, reference in ((0.0, (ps - pt) / temperature), (1.0, expected)):
        if dtype == torch.float64:
            np.testing.assert_allclose(grad_of(beta), reference, rtol=1e-10, atol=1e-12)
        else:
            assert_fp32_close(grad_of(beta), reference, what=f"beta {beta}")


def test_vocabulary_shards_sum_to_the_whole():
    """generalized_jsd_terms is per bin: a vocabulary-parallel caller sums its shard and all-reduces."""
    s, t = logits(4, shape=(3, 12))
    ls, lt = torch.log_softmax(f32(s), -1), torch.log_softmax(f32(t), -1)
    for beta in BETAS:
        whole = A.generalized_jsd(ls, lt, beta)
        shards = sum(A.generalized_jsd_terms(ls[:, i:i + 4], lt[:, i:i + 4], beta).sum(-1) for i in (0, 4, 8))
        assert_fp32_paths_agree(shards, whole, what=f"beta {beta}")


def test_low_precision_input_is_computed_in_float32():
    s, t = logits(5)
    out = A.distill_full(f32(s).bfloat16(), f32(t).bfloat16(), 0.5)
    assert out.dtype == torch.float32
    sb, tb = f32(s).bfloat16().double().numpy(), f32(t).bfloat16().double().numpy()
    assert_fp32_close(out.numpy(), ref_full(sb, tb, 0.5, 1.0))


# -------------------------------------------------------------------- top-k ----
@pytest.mark.parametrize("mode", sorted(A.GKD_TOPK_MODES))
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("order", ["topk", "random"])
def test_topk_with_k_equal_v_is_the_full_loss(mode, beta, temperature, order):
    """K = V (ids a permutation of the vocabulary): values and gradients equal distill_full's."""
    s, t = logits(6)
    vocab = s.shape[-1]
    if order == "topk":
        ids, lt = teacher_topk(t, vocab, temperature)
    else:
        ids = torch.argsort(torch.rand(s.shape, generator=torch.Generator().manual_seed(0)), dim=-1)
        lt = torch.gather(torch.log_softmax(f32(t) / temperature, -1), -1, ids)
    fn = A.GKD_TOPK_MODES[mode]
    full, full_grad = loss_and_grad(lambda x: A.distill_full(x, f32(t), beta, temperature), s)
    topk, topk_grad = loss_and_grad(lambda x: fn(x, ids, lt, beta, temperature), s)
    assert_fp32_paths_agree(topk, full, what="loss")
    assert_fp32_paths_agree(topk_grad, full_grad, what="gradient")


@pytest.mark.parametrize("mode", sorted(A.GKD_TOPK_MODES))
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_topk_against_reference(mode, beta, temperature, k):
    s, t = logits(7)
    ids, lt = teacher_topk(t, k, temperature)
    out = A.GKD_TOPK_MODES[mode](f32(s), ids, lt, beta, temperature)
    assert out.shape == s.shape[:-1] and out.dtype == torch.float32
    expected = REFERENCES[mode](s, lt.numpy(), ids.numpy(), beta, temperature)
    # A divergence sums terms p * (log p - log q) whose rounding is eps * O(1) (log-probs of O(1)): its
    # scale is at least 1, also where the divergence itself is 0 (K = 1 renormalised: one bin).
    assert_fp32_close(out, expected, scale=max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("beta", BETAS)
def test_tail_sees_student_mass_outside_the_topk(beta):
    """The student matches the teacher's top-k proportions but puts ~95% of its mass elsewhere."""
    k, temperature = 3, 1.0
    s, t = logits(8)
    ids, lt = teacher_topk(t, k, temperature)
    s = s.copy()
    in_topk = np.zeros(s.shape, dtype=bool)
    np.put_along_axis(in_topk, ids.numpy(), True, axis=-1)
    s = np.where(in_topk, t, t.max(-1, keepdims=True) + 4.0)  # same top-k ratios, large mass outside
    mass = A.student_topk_mass(f32(s), ids, temperature).numpy()
    assert (mass < 0.1).all()
    renorm = A.distill_topk_renorm(f32(s), ids, lt, beta, temperature).numpy()
    tail = A.distill_topk_tail(f32(s), ids, lt, beta, temperature).numpy()
    assert_fp32_close(renorm, np.zeros_like(renorm), scale=1.0)  # blind to it (0 up to rounding of O(1) terms)
    assert_fp32_close(tail, ref_tail(s, lt.numpy(), ids.numpy(), beta, temperature))
    assert (tail > 0.05).all()
    # the tail loss's gradient moves mass back onto the top-k
    student = f32(s, grad=True)
    A.distill_topk_tail(student, ids, lt, beta, temperature).sum().backward()
    grad = student.grad.numpy()
    assert (grad[in_topk] < 0).all() and (grad[~in_topk] > 0).all()


def test_renorm_accepts_teacher_logprobs_at_temperature_one_divided_by_t():
    """ms-swift passes T = 1 logprobs and divides by T: the renormalisation makes it the same loss."""
    s, t = logits(9)
    temperature = 0.6
    ids, lt_t = teacher_topk(t, 4, temperature)
    lt_1 = torch.gather(torch.log_softmax(f32(t), -1), -1, ids)
    for beta in BETAS:
        assert_fp32_paths_agree(A.distill_topk_renorm(f32(s), ids, lt_1 / temperature, beta, temperature),
                                A.distill_topk_renorm(f32(s), ids, lt_t, beta, temperature), what=f"beta {beta}")


def test_teacher_tail_logprob():
    lt = torch.log(torch.tensor([[0.5, 0.25], [0.6, 0.4], [0.7, 0.4]]))
    tail = torch.exp(A.teacher_tail_logprob(lt))
    torch.testing.assert_close(tail[:, 0], torch.tensor([0.25, A.GKD_TAIL_MASS_FLOOR, A.GKD_TAIL_MASS_FLOOR]))
    assert tail.shape == (3, 1) and tail.dtype == torch.float32


# ----------------------------------------------------------------- helpers ----
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_student_topk_mass(temperature):
    s, t = logits(10)
    ids, _ = teacher_topk(t, 4, temperature)
    student = f32(s, grad=True)
    mass = A.student_topk_mass(student, ids, temperature)
    assert not mass.requires_grad and mass.shape == s.shape[:-1]
    expected = take(softmax(s / temperature), ids.numpy()).sum(-1)
    assert_fp32_close(mass.numpy(), expected)
    full_ids = torch.argsort(f32(t), dim=-1)
    assert_fp32_close(A.student_topk_mass(f32(s), full_ids, temperature), np.ones(s.shape[:-1]))


def test_distill_token_rewards():
    student = torch.tensor([[-0.1, -2.0, -1.0], [-3.0, -0.5, -7.0]], requires_grad=True)
    teacher = torch.tensor([[-1.1, -0.5, -1.0], [-3.0, -2.5, -1.0]])
    rewards = A.distill_token_rewards(student, teacher)
    assert not rewards.requires_grad
    # student more confident than the teacher on its sampled token -> negative reward, and vice versa
    torch.testing.assert_close(rewards, torch.tensor([[-1.0, 1.5, 0.0], [0.0, -2.0, 6.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(A.distill_token_rewards(student, teacher, mask),
                               torch.tensor([[-1.0, 1.5, 0.0], [0.0, 0.0, 0.0]]))
    # its mean under the student's own samples estimates -KL(student || teacher)
    rng = torch.Generator().manual_seed(0)
    s, t = torch.randn(7, generator=rng), torch.randn(7, generator=rng)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    samples = torch.multinomial(ls.exp(), 200_000, replacement=True, generator=rng)
    estimate = A.distill_token_rewards(ls[samples], lt[samples]).mean()
    torch.testing.assert_close(estimate, -A.distill_full(s, t, 1.0), rtol=0, atol=2e-2)


def test_registry_and_flags():
    assert sorted(A.GKD_TOPK_MODES) == ["renorm", "tail"]
    assert A.distill_support(0) is A.distill_full
    assert A.distill_support(0, "tail") is A.distill_full
    assert A.distill_support(8, "renorm") is A.distill_topk_renorm
    assert A.distill_support(8, "tail") is A.distill_topk_tail
    with pytest.raises(ValueError, match="renorm, tail"):
        A.distill_support(8, "nope")
    with pytest.raises(ValueError, match="gkd_logits_topk"):
        A.distill_support(-1)
    s, t = logits(11)
    with pytest.raises(ValueError, match="beta"):
        A.distill_full(f32(s), f32(t), 1.5)
    with pytest.raises(ValueError, match="temperature"):
        A.distill_full(f32(s), f32(t), 0.5, 0.0)


# ---------------------------------------------------------------- numerics ----
def check_finite(fn, s: np.ndarray, *args):
    loss, grad = loss_and_grad(fn, s, *args)
    assert torch.isfinite(loss).all(), loss
    assert torch.isfinite(grad).all(), grad
    return loss, grad


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_very_negative_student_logits_stay_finite(beta, temperature):
    s, t = logits(12)
    s = s.copy()
    s[..., 0] = -1e30  # "-inf-like"
    s[..., 1] = -np.inf
    s[0, 0, 2] = np.finfo(np.float32).min  # -inf after / T < 1
    t = t.copy()
    t[..., 1] = -np.inf  # where the student has no mass, neither has the teacher
    check_finite(lambda x: A.distill_full(x, f32(t), beta, temperature), s)
    for k in (3, 11):
        ids, lt = teacher_topk(t, k, temperature)
        for fn in A.GKD_TOPK_MODES.values():
            check_finite(fn, s, ids, lt, beta, temperature)
    # the teacher puts mass on ids 0, 2 where the student has ~none: forward KL's gradient there is the
    # unfloored one, (p_s - p_t) / T, so the student is pushed back up
    if beta == 0:
        _, grad = loss_and_grad(lambda x: A.distill_full(x, f32(t), 0.0, temperature), s)
        pt = softmax(t / temperature)
        assert_fp32_close(grad[..., 0], -pt[..., 0] / temperature)


@pytest.mark.parametrize("beta", BETAS)
def test_teacher_zero_probabilities(beta):
    """Teacher probability exactly 0 on some ids (where the student also has none, or has some)."""
    s, t = logits(13)
    t = t.copy()
    t[..., :3] = -np.inf
    s_zero = s.copy()
    s_zero[..., :3] = -np.inf  # same support: every beta is finite and equals the reference
    out, _ = check_finite(lambda x: A.distill_full(x, f32(t), beta), s_zero)
    assert_fp32_close(out.numpy(), ref_full(s_zero, t, beta, 1.0))
    # student mass where the teacher has none: finite (floored) everywhere; exact for beta < 1
    out, _ = check_finite(lambda x: A.distill_full(x, f32(t), beta), s)
    if beta < 1:
        assert_fp32_close(out.numpy(), ref_full(s, t, beta, 1.0))
    else:
        assert (out > 1.0).all()  # KL(s || t) is infinite: large
    # top-k whose K exceeds the teacher's support: -inf logprobs among the top-k
    ids, lt = teacher_topk(t, 9, 1.0)
    assert torch.isinf(lt).any()
    for mode, fn in A.GKD_TOPK_MODES.items():
        out, _ = check_finite(fn, s_zero, ids, lt, beta, 1.0)
        assert_fp32_close(out, REFERENCES[mode](s_zero, lt.numpy(), ids.numpy(), beta, 1.0), what=mode)


@pytest.mark.parametrize("beta", BETAS)
def test_tail_with_an_empty_student_tail(beta):
    """K < V but every non-top-k student logit is -inf: the student's tail bin is 0, no NaN."""
    s, t = logits(14)
    ids, lt = teacher_topk(t, 5, 1.0)
    s = s.copy()
    in_topk = np.zeros(s.shape, dtype=bool)
    np.put_along_axis(in_topk, ids.numpy(), True, axis=-1)
    s[~in_topk] = -np.inf
    check_finite(lambda x: A.distill_topk_tail(x, ids, lt, beta, 1.0), s)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_tail_gradient_is_exact_below_the_floor(temperature):
    """A student tail of ~1e-11 (below the 1e-7 floor) keeps its exact forward-KL gradient:
    d/ds_i = (p_s,i - p_t,i) / T on the top-k, p_s,j (1 - P_t,tail / P_s,tail) / T off it."""
    k = 3
    s, t = logits(15, scale=1.0)
    ids, lt = teacher_topk(t, k, temperature)
    in_topk = np.zeros(s.shape, dtype=bool)
    np.put_along_axis(in_topk, ids.numpy(), True, axis=-1)
    s = np.where(in_topk, 0.0, -25.0 * temperature)
    ps = softmax(s / temperature)
    ps_tail = np.where(in_topk, 0.0, ps).sum(-1, keepdims=True)
    assert (ps_tail < 1e-10).all()  # well below GKD_TAIL_MASS_FLOOR
    pt_k = np.exp(lt.double().numpy())
    pt_tail = 1 - pt_k.sum(-1, keepdims=True)
    assert (pt_tail > 0.01).all()
    pt = np.zeros(s.shape)
    np.put_along_axis(pt, ids.numpy(), pt_k, axis=-1)
    expected = np.where(in_topk, ps - pt, ps * (1 - pt_tail / ps_tail)) / temperature
    _, grad = loss_and_grad(lambda x: A.distill_topk_tail(x, ids, lt, 0.0, temperature), s)
    assert_fp32_close(grad, expected)
