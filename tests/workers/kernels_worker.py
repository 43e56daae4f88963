"""torchrun worker: megarl/kernels.py's implementations against each other and against a
full-vocabulary torch reference, at the TP size of the launch (every rank is one TP rank).

Each case builds the same full-vocabulary inputs on every rank (seeded), hands each rank its
Megatron shard (vocabulary padded to a multiple of 128 * TP), and backpropagates
sum(mask * (a * logprob + c * entropy)) with random per-token a, c, so that both outputs carry
gradient and masked positions carry none. Writes {case: {metric: max over ranks}} from rank 0.
The case functions also run in-process at TP=1 (tests/test_kernels.py).
"""

import argparse
import json

import torch
import torch.distributed as dist

from megarl import accelerator, kernels

# The fused implementations checked against the naive one: Triton too where it can run (a GPU, or
# its interpreter on CPU: TRITON_INTERPRET=1 in the test run's environment, before Triton is imported).
FUSED = ["chunked"]
if accelerator.triton_available():
    FUSED.append("triton")

# (vocab_size, temperature): 250 leaves 6 padding columns in the last shard; 100 at TP=2 leaves
# the second shard all padding (Megatron pads 100 to 256).
VOCABS = [(250, 0.7), (100, 1.3), (250, 1.0)]
SHAPE = (2, 7)  # 14 tokens
CHUNKS = [5, 7, 1, None]  # does not divide 14, divides it, one token, the default (one chunk here)
HIDDEN = 16


def padded(vocab_size: int, tp: int) -> int:
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple


def inputs(vocab_size: int, tp: int, seed: int) -> dict:
    """The full problem, identical on every rank; padding columns and rows hold garbage, which
    must not matter. Logits from either input have standard deviation 3."""
    g = torch.Generator().manual_seed(seed)
    width = padded(vocab_size, tp)
    labels = torch.randint(0, vocab_size, SHAPE, generator=g)
    mask = (torch.rand(SHAPE, generator=g) > 0.3).float()
    labels[mask == 0] = 0  # the micro-batch's pad id at masked positions
    labels[0, 0], mask[0, 0] = -100, 0.0  # a label no shard owns
    return {"logits": 3 * torch.randn(*SHAPE, width, generator=g), "labels": labels, "mask": mask,
            "a": torch.randn(SHAPE, generator=g), "c": torch.randn(SHAPE, generator=g),
            "hidden": torch.randn(*SHAPE, HIDDEN, generator=g),
            "weight": 3 / HIDDEN**0.5 * torch.randn(width, HIDDEN, generator=g)}


def _loss(case: dict, logprob, entropy):
    return (case["mask"] * (case["a"] * logprob + case["c"] * entropy)).sum()


def _reference(case, logits, vocab_size, temperature):
    """(logprob, entropy) on the real vocabulary; an unowned label (-100) takes the largest logit."""
    log_p = torch.log_softmax(logits[..., :vocab_size] / temperature, dim=-1)
    labels = case["labels"]
    picked = torch.where(labels >= 0, log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0],
                         log_p.max(dim=-1).values)
    return picked, -(log_p.exp() * log_p).sum(-1)


def _shard(tensor, dim: int):
    from megatron.core import parallel_state

    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return tensor.chunk(tp, dim=dim)[rank]


def _max_diff(x, y) -> float:
    return (x - y).abs().max().item()


def check_from_logits(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    """Values and logit gradients of naive and chunked (and of naive against the full-vocabulary
    reference, its gradient on this shard's columns)."""
    from megatron.core import parallel_state

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    full = case["logits"].clone().requires_grad_(True)
    expected = _reference(case, full, vocab_size, temperature)
    _loss(case, *expected).backward()
    results = {}
    for impl in ["naive", *FUSED]:
        shard = _shard(case["logits"], -1).clone().requires_grad_(True)
        results[impl] = (*kernels.logprobs_and_entropy(shard, case["labels"], vocab_size, temperature, impl,
                                                        chunk_tokens=chunk), shard)
        _loss(case, *results[impl][:2]).backward()
    lp_n, h_n, x_n = results["naive"]
    report = {"naive_vs_full_logprob": _max_diff(lp_n, expected[0]),
              "naive_vs_full_entropy": _max_diff(h_n, expected[1]),
              "naive_vs_full_grad_logits": _max_diff(x_n.grad, _shard(full.grad, -1))}
    masked = case["mask"] == 0
    for impl in FUSED:
        lp, h, x = results[impl]
        report.update({f"{impl}_logprob": _max_diff(lp, lp_n), f"{impl}_entropy": _max_diff(h, h_n),
                       f"{impl}_grad_logits": _max_diff(x.grad, x_n.grad),
                       f"{impl}_masked_grad_max": x.grad[masked].abs().max().item() if masked.any() else 0.0})
    return report


def check_from_hidden(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    """Values and hidden / weight-shard gradients of naive and chunked (and of both against the
    full-vocabulary reference: the hidden gradient must include every shard's part)."""
    from megatron.core import parallel_state

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    hidden, weight = case["hidden"].clone().requires_grad_(True), case["weight"].clone().requires_grad_(True)
    expected = _reference(case, hidden @ weight.t(), vocab_size, temperature)
    _loss(case, *expected).backward()
    results = {}
    for impl in ["naive", *FUSED]:
        h = case["hidden"].clone().requires_grad_(True)
        w = _shard(case["weight"], 0).clone().requires_grad_(True)
        results[impl] = (*kernels.logprobs_and_entropy_from_hidden(h, w, case["labels"], vocab_size, temperature,
                                                                    impl, chunk_tokens=chunk), h, w)
        _loss(case, *results[impl][:2]).backward()
    lp_n, h_n, hid_n, w_n = results["naive"]
    report = {f"{impl}_{name}": _max_diff(value, reference)
              for impl in FUSED
              for name, value, reference in zip(("logprob", "entropy", "grad_hidden", "grad_weight"),
                                                (results[impl][0], results[impl][1], results[impl][2].grad,
                                                 results[impl][3].grad), (lp_n, h_n, hid_n.grad, w_n.grad))}
    return {**report, **{f"{impl}_vs_full_{name}": _max_diff(value, reference)
               for impl, (lp, h, hid, w) in results.items()
               for name, value, reference in (("logprob", lp, expected[0]), ("entropy", h, expected[1]),
                                              ("grad_hidden", hid.grad, hidden.grad),
                                              ("grad_weight", w.grad, _shard(weight.grad, 0)))}}


def _teacher(case: dict, vocab_size: int, temperature: float, k: int, seed: int):
    """Teacher logits [.., padded V] and their top-k (global ids, log softmax(logits / T) there). The
    teacher is the student's logits plus unit noise, so the divergences are O(1), as between a student
    and its teacher (between two independent draws of std 3 they are O(20), where fp32's own rounding,
    a few units of 2e-6, reaches the 1e-5 tolerance whatever the implementation)."""
    g = torch.Generator().manual_seed(seed + 1)
    logits = case["logits"] + torch.randn(case["logits"].shape, generator=g)
    logprobs = torch.log_softmax(logits[..., :vocab_size] / temperature, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return logits, ids, values


def check_topk(vocab_size: int, temperature: float, chunk, mode: str, beta: float, from_hidden: bool,
               k: int = 5, seed: int = 0) -> dict:
    """The top-k GKD loss (and the student's top-k mass) of each fused implementation against naive,
    values and gradients, from logits or from hidden states; naive against algorithms'
    full-vocabulary GKD_TOPK_MODES."""
    from megatron.core import parallel_state

    from megarl.algorithms import GKD_TOPK_MODES

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    _, ids, teacher_logprobs = _teacher(case, vocab_size, temperature, k, seed)
    full = (case["hidden"] @ case["weight"].t() if from_hidden else case["logits"])[..., :vocab_size]
    expected = GKD_TOPK_MODES[mode](full, ids, teacher_logprobs, beta, temperature)
    results = {}
    for impl in ["naive", *FUSED]:
        if from_hidden:
            leaves = [case["hidden"].clone().requires_grad_(True),
                      _shard(case["weight"], 0).clone().requires_grad_(True)]
        else:
            leaves = [_shard(case["logits"], -1).clone().requires_grad_(True)]
        loss, mass = kernels.distill_topk(leaves[0], ids, teacher_logprobs, vocab_size, beta, temperature, mode, impl,
                                          weight_shard=leaves[1] if from_hidden else None, chunk_tokens=chunk)
        (case["mask"] * case["a"] * loss).sum().backward()
        results[impl] = (loss, mass, [leaf.grad for leaf in leaves])
    loss_n, mass_n, grads_n = results["naive"]
    report = {"naive_vs_full_loss": _max_diff(loss_n, expected)}
    for impl in FUSED:
        loss, mass, grads = results[impl]
        report.update({f"{impl}_loss": _max_diff(loss, loss_n), f"{impl}_mass": _max_diff(mass, mass_n),
                       **{f"{impl}_grad{i}": _max_diff(g, g_n) for i, (g, g_n) in enumerate(zip(grads, grads_n))}})
    return report


def check_full(vocab_size: int, temperature: float, chunk, beta: float | None, seed: int = 0) -> dict:
    """The full-vocabulary divergence (beta) or, with beta None, the KL to a reference, of each fused
    implementation against naive; naive against algorithms.distill_full / kl_full."""
    from megatron.core import parallel_state

    from megarl.algorithms import distill_full

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    teacher, _, _ = _teacher(case, vocab_size, temperature, 1, seed)
    expected = distill_full(case["logits"][..., :vocab_size], teacher[..., :vocab_size], 1.0 if beta is None else beta,
                            temperature)
    results = {}
    for impl in ["naive", *FUSED]:
        shard = _shard(case["logits"], -1).clone().requires_grad_(True)
        if beta is None:
            loss = kernels.full_kl(shard, _shard(teacher, -1), vocab_size, temperature, impl, chunk_tokens=chunk)
        else:
            loss = kernels.full_divergence(shard, _shard(teacher, -1), vocab_size, beta, temperature, impl,
                                           chunk_tokens=chunk)
        (case["mask"] * case["a"] * loss).sum().backward()
        results[impl] = (loss, shard.grad)
    loss_n, grad_n = results["naive"]
    report = {"naive_vs_full_loss": _max_diff(loss_n, expected)}
    for impl in FUSED:
        report.update({f"{impl}_loss": _max_diff(results[impl][0], loss_n),
                       f"{impl}_grad": _max_diff(results[impl][1], grad_n)})
    return report


# (mode, beta) of the top-k cases and the betas of the full-vocabulary ones (None: the KL to a reference)
TOPK_CASES = [("tail", 0.0), ("tail", 0.5), ("renorm", 1.0), ("tail", 1.0)]
FULL_BETAS = [0.0, 0.5, 1.0, None]


def all_cases() -> dict:
    report = {}
    for vocab_size, temperature in VOCABS:
        for chunk in CHUNKS:
            name = f"V{vocab_size}_T{temperature:g}_chunk{chunk}"
            report[f"logits_{name}"] = check_from_logits(vocab_size, temperature, chunk)
            report[f"hidden_{name}"] = check_from_hidden(vocab_size, temperature, chunk)
            for mode, beta in TOPK_CASES:
                for from_hidden in (False, True):
                    report[f"topk_{mode}_b{beta:g}_{'hidden' if from_hidden else 'logits'}_{name}"] = check_topk(
                        vocab_size, temperature, chunk, mode, beta, from_hidden)
            for beta in FULL_BETAS:
                report[f"full_{'kl' if beta is None else f'b{beta:g}'}_{name}"] = check_full(
                    vocab_size, temperature, chunk, beta)
    return report


def max_over_ranks(report: dict) -> dict:
    """Each metric's maximum over the ranks (each rank checks its own shard's gradients)."""
    keys = [(case, metric) for case in report for metric in report[case]]
    values = torch.tensor([report[case][metric] for case, metric in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    out = {}
    for (case, metric), value in zip(keys, values.tolist()):
        out.setdefault(case, {})[metric] = value
    return out


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--out", required=True)
    mine = own.parse_args()
    from megatron.core import parallel_state

    from megarl import accelerator

    dist.init_process_group("gloo")
    accelerator.apply_megatron_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    report = max_over_ranks(all_cases())
    if dist.get_rank() == 0:
        with open(mine.out, "w") as f:
            json.dump({"tp": dist.get_world_size(), "cases": report}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
