"""megarl/kernels: the chunked implementations and the naive one (kernels/naive.py), in fp32,
against a full-vocabulary torch reference in float64, within tests/helpers.py's fp32 rule.

The unit lane runs the cases in-process at TP=1 (a one-rank gloo world with Megatron's parallel
state); the slow lane runs the same cases under real torchrun at TP=1 and TP=2, where the
second shard is partly (V=250) or entirely (V=100) Megatron padding.
"""

from __future__ import annotations


import pytest
import torch

from helpers import (FP32_ULPS, WORKERS, assert_fp32_close, assert_runs_agree, assert_signal_alive, load_script, read_json, scalars,
                     torchrun, ulps)


worker = load_script(WORKERS / "kernels_worker.py")


@pytest.fixture(scope="module")
def tp1():
    """A one-rank gloo world with Megatron's parallel state at TP=1, torn down afterwards.
    (Megatron's CPU shims are not needed for its parallel state, so none is applied here.)"""
    from megarl import distributed

    distributed.init_single_process_world()
    yield
    distributed.destroy_single_process_world()


def _assert_close(report: dict, case: str = ""):
    """Every metric (an error in ulps of what is compared) within the fp32 rule; NaN fails too."""
    assert report, case
    over = {metric: value for metric, value in report.items() if not value <= FP32_ULPS}
    assert not over, f"{case}: {over} ulps > {FP32_ULPS}"


@pytest.mark.parametrize("vocab_size,temperature", worker.VOCABS)
@pytest.mark.parametrize("chunk", worker.CHUNKS)
def test_from_logits_tp1(tp1, vocab_size, temperature, chunk):
    _assert_close(worker.check_from_logits(vocab_size, temperature, chunk))


@pytest.mark.parametrize("vocab_size,temperature", worker.VOCABS)
@pytest.mark.parametrize("chunk", worker.CHUNKS)
def test_from_hidden_tp1(tp1, vocab_size, temperature, chunk):
    _assert_close(worker.check_from_hidden(vocab_size, temperature, chunk))


@pytest.mark.parametrize("mode,beta", worker.TOPK_CASES)
@pytest.mark.parametrize("from_hidden", [False, True])
@pytest.mark.parametrize("chunk", [5, None])
def test_topk_distill_tp1(tp1, mode, beta, from_hidden, chunk):
    _assert_close(worker.check_topk(250, 0.7, chunk, mode, beta, from_hidden))


@pytest.mark.parametrize("vocab_size,temperature", worker.VOCABS)
@pytest.mark.parametrize("chunk", [5, None])
def test_select_topk_tp1(tp1, vocab_size, temperature, chunk):
    """The colocated teacher's top-k (kernels.select_topk) by every implementation, from logits and from
    hidden states: the ids of the float64 reference and its log-probs within the fp32 rule; "naive" on the
    full logits is the path the teacher took before."""
    for k in worker.SELECT_KS(vocab_size):
        report = worker.check_select_topk(vocab_size, temperature, chunk, k)
        assert {metric.split("_")[0] for metric in report} == {"naive", *worker.FUSED}
        _assert_close(report, f"k={k}")


@pytest.mark.parametrize("beta", worker.FULL_BETAS)
@pytest.mark.parametrize("vocab_size,temperature", worker.VOCABS)
def test_full_vocabulary_divergence_tp1(tp1, beta, vocab_size, temperature):
    _assert_close(worker.check_full(vocab_size, temperature, 5, beta))


def test_one_output_and_unowned_labels(tp1):
    """Backward through the logprob alone (the entropy's gradient is None), and labels that no
    shard owns (-100: the largest logit, Megatron's vocab_parallel_cross_entropy's convention)."""
    from megarl import kernels

    torch.manual_seed(0)
    logits = 3 * torch.randn(2, 5, 128)
    labels = torch.randint(0, 120, (2, 5))
    labels[0, 1] = -100
    reference = logits[..., :120].double().requires_grad_(True)
    z = reference / 0.9
    log_z = torch.logsumexp(z, dim=-1)
    # the unowned label's M - log Z takes M as a constant (as Megatron's max, subtracted for stability)
    picked = torch.where(labels >= 0, z.gather(-1, labels.clamp(min=0)[..., None])[..., 0], z.max(-1).values.detach())
    expected = picked - log_z
    expected.sum().backward()
    for impl in ("naive", "chunked"):
        x = logits.clone().requires_grad_(True)
        value, _ = kernels.logprobs_and_entropy(x, labels, 120, 0.9, impl, chunk_tokens=3)
        value.sum().backward()
        assert torch.equal(x.detach(), logits)  # the chunks are scratch copies, never the input
        assert_fp32_close(value, expected, what=f"{impl} logprob")
        assert_fp32_close(x.grad[..., :120], reference.grad, what=f"{impl} grad")
        assert not x.grad[..., 120:].any(), impl  # the padding columns
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        kernels.logprobs_and_entropy(logits, labels, 120, 0.9, "fast")


def test_bf16_inputs_and_inputs_untouched(tp1):
    """bf16 logits, hidden states and weights (the GPU dtypes) give bf16 gradients within bf16 precision
    of the float64 reference on the same inputs (tests/helpers.py), naive and chunked alike; the chunked
    path works in scratch buffers and leaves its inputs unchanged (T = 1, where the scaling could have
    been skipped)."""
    from megarl import kernels

    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 6, 256)).bfloat16()
    hidden, weight = torch.randn(2, 6, 16).bfloat16(), (0.75 * torch.randn(256, 16)).bfloat16()
    labels = torch.randint(0, 250, (2, 6))
    reference = [t.double().requires_grad_(True) for t in (logits, hidden, weight)]
    outputs = [*worker._reference({"labels": labels}, reference[0], 250, 1.0),
               *worker._reference({"labels": labels}, reference[1] @ reference[2].t(), 250, 1.0)]
    sum(o.sum() for o in outputs).backward()
    expected = [*(o.detach() for o in outputs), *(r.grad for r in reference)]
    for impl in ("naive", "chunked"):
        leaves = [t.clone().requires_grad_(True) for t in (logits, hidden, weight)]
        from_logits = kernels.logprobs_and_entropy(leaves[0], labels, 250, 1.0, impl, chunk_tokens=5)
        from_hidden = kernels.logprobs_and_entropy_from_hidden(leaves[1], leaves[2], labels, 250, 1.0, impl,
                                                               chunk_tokens=5)
        sum(o.sum() for o in (*from_logits, *from_hidden)).backward()
        assert all(torch.equal(leaf.detach(), t) for leaf, t in zip(leaves, (logits, hidden, weight)))
        assert [leaf.grad.dtype for leaf in leaves] == [torch.bfloat16] * 3
        names = ["logprob", "entropy", "hidden logprob", "hidden entropy", "grad logits", "grad hidden", "grad weight"]
        results = [*from_logits, *from_hidden, *(leaf.grad for leaf in leaves)]
        for name, result, exact in zip(names, results, expected):
            assert_fp32_close(result.float(), exact, what=f"{impl} {name}", bf16=True)


def _exact_inputs(dtype, seed: int = 0, weight_step: float = 1 / 4):
    """hidden [2, 6, 16] of multiples of 1/4 in [-1, 1] and weight [256, 16] of multiples of `weight_step` within
    4 of them: every logit (a sum of 16 products, a multiple of weight_step / 4 within 16 x 4 weight_step) is
    exact in bf16 and fp16 (up to 8 significant bits), so a float64 reference needs no rounding model and the
    16-bit paths differ from it by their gradients' rounding alone."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-4, 5, (2, 6, 16), generator=generator).to(dtype) / 4
    weight = torch.randint(-4, 5, (256, 16), generator=generator).to(dtype) * weight_step
    labels = torch.randint(0, 250, (2, 6), generator=generator)
    return hidden, weight, labels


def _reference_grads(hidden, weight, labels, g_lp, g_h):
    """float64 d(sum(g_lp logprob + g_h entropy))/d(hidden, weight) over the real vocabulary (250 of 256 rows)."""
    leaves = [t.double().requires_grad_(True) for t in (hidden, weight)]
    logprob, entropy = worker._reference({"labels": labels}, leaves[0] @ leaves[1].t(), 250, 1.0)
    (g_lp.double() * logprob + g_h.double() * entropy).sum().backward()
    return [leaf.grad for leaf in leaves]


def test_the_output_weights_gradient_goes_into_its_main_grad_in_fp32(tp1):
    """A weight under Megatron's DDP (an fp32 `main_grad` and `grad_added_to_main_grad`, as DDP's constructor
    gives every trained parameter) gets the fused kernels' fp32 gradient added into main_grad, within the fp32
    rule of float64 (rounded to bf16 first it would be ~2^14 fp32 ulps off), accumulating over backward passes;
    autograd gets Megatron's placeholder, marked so that DDP's hook does not add it again, zeros where the weight
    is also the embedding's (zero_out_wgrad: the hook adds the lookup's gradient plus it)."""
    from megarl import kernels

    hidden, weight, labels = _exact_inputs(torch.bfloat16)
    g_lp, g_h = torch.randn(2, 6, generator=torch.Generator().manual_seed(1)), torch.full((2, 6), 0.3)
    expected = _reference_grads(hidden, weight, labels, g_lp, g_h)[1]
    for tied in (False, True):
        leaf = torch.nn.Parameter(weight.clone())
        leaf.main_grad = torch.zeros(leaf.shape, dtype=torch.float32)
        leaf.grad_added_to_main_grad = False
        if tied:
            leaf.zero_out_wgrad = True
        for passes in (1, 2):
            logprob, entropy = kernels.logprobs_and_entropy_from_hidden(hidden, leaf, labels, 250, 1.0, "chunked",
                                                                        chunk_tokens=5)
            (g_lp * logprob.float() + g_h * entropy.float()).sum().backward()
            assert_fp32_close(leaf.main_grad / passes, expected, what=f"main_grad after {passes} (tied {tied})")
            assert leaf.grad_added_to_main_grad and leaf.grad.dtype == torch.bfloat16
            leaf.grad = None
        assert not torch.equal(leaf.main_grad, leaf.main_grad.bfloat16().float())  # fp32, not bf16 values
        if tied:
            kernels.logprobs_and_entropy_from_hidden(hidden, leaf, labels, 250, 1.0, "chunked")[0].sum().backward()
            assert not leaf.grad.any()


def test_fp16_hidden_gradient_under_a_loss_scale_does_not_overflow(tp1):
    """fp16 hidden states and a weight of LLM-like size (|w| <= 1/16), the upstream gradient scaled by 2^17 (a
    loss scale): the logit gradient reaches ~2^17, past fp16's 65504, while the hidden's gradient made from it
    (at most 2 x 2^17 x 1/16) fits; it is finite and S times the float64 one within fp16 rounding. Casting the
    fp32 logit gradient to fp16 whole made such rows inf. The weight's, a sum over tokens that does not fit fp16
    here, goes into its fp32 main_grad (under DDP, as in training): S times the float64 one within the fp32 rule."""
    from helpers import FP16_EPS, FP16_PATHS_ULPS

    from megarl import kernels

    scale = 2.0**17
    hidden, weight, labels = _exact_inputs(torch.float16, seed=2, weight_step=1 / 64)
    g_lp, g_h = torch.ones(2, 6), torch.zeros(2, 6)
    expected = _reference_grads(hidden, weight, labels, g_lp, g_h)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    leaves[1].main_grad, leaves[1].grad_added_to_main_grad = torch.zeros(weight.shape), False
    logprob, _ = kernels.logprobs_and_entropy_from_hidden(*leaves, labels, 250, 1.0, "chunked", chunk_tokens=5)
    (scale * logprob.float()).sum().backward()
    assert leaves[0].grad.dtype == torch.float16 and torch.isfinite(leaves[0].grad).all()
    assert ulps(leaves[0].grad.float() / scale, expected[0], eps=FP16_EPS) <= FP16_PATHS_ULPS
    assert leaves[1].main_grad.abs().max() > 65504
    assert_fp32_close(leaves[1].main_grad / scale, expected[1], what="weight main_grad")
    assert (scale * (1 - logprob.detach().float().exp())).max() > 65504  # some logit's gradient did pass fp16's max


def test_triton_warps_grow_with_the_block():
    """triton_ops.num_warps: 8 values per thread per live vector, 4 warps (Triton's default) up to 1024-wide
    blocks, 8 at 2048, 16 at 4096 (the widest the kernels use on a GPU), never past CUDA's 32."""
    triton_ops = pytest.importorskip("megarl.kernels.triton_ops")

    assert [triton_ops.num_warps(block) for block in (16, 64, 256, 1024, 2048, 4096, 8192, 2**16)] == \
        [4, 4, 4, 4, 8, 16, 32, 32]
    assert triton_ops.num_warps(triton_ops.MAX_BLOCK_V) == 16


def _saved_sizes(fn) -> list[tuple[int, int]]:
    """(numel, data_ptr) of every tensor autograd saves for backward while `fn` runs."""
    saved = []

    def pack(tensor):
        saved.append((tensor.numel(), tensor.data_ptr()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return saved


def test_chunked_saves_no_vocabulary_sized_tensor(tp1):
    """What backward keeps: from logits, the input logits themselves and per-token floats; from
    hidden states, nothing of the logits' size at all. (The naive path keeps several.)"""
    from megarl import kernels

    tokens, width, hidden_size = 12, 256, 8
    logits = torch.randn(3, 4, width, requires_grad=True)
    hidden = torch.randn(3, 4, hidden_size, requires_grad=True)
    weight = torch.randn(width, hidden_size, requires_grad=True)
    labels = torch.randint(0, 250, (3, 4))

    saved = _saved_sizes(lambda: kernels.logprobs_and_entropy(logits, labels, 250, 0.7, "chunked", chunk_tokens=5))
    assert [ptr for numel, ptr in saved if numel >= tokens * width] == [logits.data_ptr()]
    assert max(numel for numel, ptr in saved if ptr != logits.data_ptr()) <= tokens
    saved = _saved_sizes(lambda: kernels.logprobs_and_entropy_from_hidden(hidden, weight, labels, 250, 0.7, "chunked",
                                                                          chunk_tokens=5))
    assert max(numel for numel, _ in saved) <= width * hidden_size < tokens * width
    naive = _saved_sizes(lambda: kernels.logprobs_and_entropy(logits, labels, 250, 0.7, "naive"))
    assert sum(numel >= tokens * width for numel, _ in naive) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_kernels_under_torchrun(tmp_path, tp):
    """Every case on real Megatron TP groups; each metric is the maximum over the ranks."""
    out = tmp_path / "kernels.json"
    torchrun("kernels_worker.py", "--out", out, nproc=tp, timeout=300)
    report = read_json(out)
    assert report["tp"] == tp
    per_setting = 2 + 2 * len(worker.TOPK_CASES) + len(worker.FULL_BETAS) + 2  # + the two top-k selections
    assert len(report["cases"]) == per_setting * len(worker.VOCABS) * len(worker.CHUNKS)
    for case, metrics in report["cases"].items():
        _assert_close(metrics, case)


# Training runs compared step by step: (name, extra flags, the metrics compared beyond loss and grad_norm).
# The policy loss with an entropy bonus (both kernel outputs carry gradient; hidden-state path); the
# exact KL to the reference in the loss (logits path: the reference's logits are a companion); top-k
# distillation in tail mode from a colocated teacher (hidden-state path) that is not the student (the perturbed
# tiny model: from itself, the divergence and its gradient would be 0 at the first step).
TRAINING_RUNS = [
    ("entropy", ["--entropy-coef", "0.01"], ["entropy", "reward_mean"]),
    ("full-kl", ["--kl-coef", "0.1", "--kl-estimator", "full", "--kl-placement", "loss"], ["kl_loss", "entropy"]),
    ("gkd-topk", ["--teacher-model", "{teacher}", "--gkd-logits-topk", "8", "--gkd-topk-mode", "tail",
                  "--gkd-beta", "0.5", "--policy-loss-coef", "0"], ["distill_loss", "teacher_topk_mass"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,flags,tags", TRAINING_RUNS, ids=[run[0] for run in TRAINING_RUNS])
def test_a_training_run_with_chunked_kernels_matches_naive(name, flags, tags, tiny_model, perturbed_tiny, tmp_path):
    """Three steps with --kernels naive vs chunked: the same per-step loss, gradient norm and the
    run's own metrics, within tests/helpers.py's rule for two training runs."""
    series, tags = {}, ["loss", "grad_norm", *tags]
    for impl in ("naive", "chunked"):
        torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                 "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "12",
                 "--micro-batch-size", "8", "--lr", "1e-3", "--train-steps", "3",
                 *[flag.format(teacher=perturbed_tiny) for flag in flags],
                 "--kernels", impl, "--log-dir", tmp_path / impl,
                 # the trainer's kernels are compared, not the engine: the HF backend spares each of the six
                 # launches vLLM's import and start (a third of a short run on two cores)
                 "--rollout-backend", "hf", timeout=900)
        series[impl] = scalars(tmp_path / impl, tags)
    # the policy loss is off in the distillation run: its signal is the divergence, not the rewards
    assert_signal_alive(tmp_path / "naive", steps=(0, 1, 2), what=name, advantages=name != "gkd-topk")
    if name == "gkd-topk":
        assert min(series["naive"]["distill_loss"].values()) > 1e-4, series["naive"]
    for tag in tags:
        assert sorted(series["naive"][tag]) == sorted(series["chunked"][tag]) == [0, 1, 2], (tag, series)
        assert_runs_agree(series["chunked"][tag], series["naive"][tag], tag)
