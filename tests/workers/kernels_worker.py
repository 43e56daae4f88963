"""torchrun worker: megarl/kernels.py's implementations (naive, chunked, Triton where it runs) in fp32
against a full-vocabulary torch reference in float64, at the TP size of the launch (every rank is one TP rank).

Each case builds the same full-vocabulary inputs on every rank (seeded), hands each rank its
Megatron shard (vocabulary padded to a multiple of 128 * TP), and backpropagates
sum(mask * (a * logprob + c * entropy)) with random per-token a, c, so that both outputs carry
gradient and masked positions carry none. Each metric is an error in ulps of what
is compared (tests/helpers.py); writes {case: {metric: max over ranks}} from rank 0.
The case functions also run in-process at TP=1 (tests/test_kernels.py).
"""

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import accelerator, kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers (also under torchrun)
from helpers import ulps  # noqa: E402

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


def _double_leaves(*tensors):
    """float64 copies that take gradient: the reference runs the same inputs in double."""
    return [t.double().requires_grad_(True) for t in tensors]


def _compare(report: dict, impl: str, pairs):
    """report[f"{impl}_{name}"] = ulps(value, reference, scale) (tests/helpers.py: the fp32 rule) for each
    (name, value, reference, scale); scale None means max |reference|."""
    for name, value, reference, scale in pairs:
        report[f"{impl}_{name}"] = ulps(value, reference, scale)


def _max_abs(tensor) -> float:
    return tensor.abs().max().item()


def check_from_logits(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    """Values and logit gradients of every implementation (fp32) against the full-vocabulary reference
    in float64 (its gradient on this shard's columns), in ulps (tests/helpers.py); masked tokens get
    exactly zero gradient."""
    from megatron.core import parallel_state

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    [full] = _double_leaves(case["logits"])
    expected = _reference(case, full, vocab_size, temperature)
    _loss(case, *expected).backward()
    grad_scale = _max_abs(full.grad)  # the whole gradient's: a shard may be padding only
    report, masked = {}, case["mask"] == 0
    for impl in ["naive", *FUSED]:
        shard = _shard(case["logits"], -1).clone().requires_grad_(True)
        lp, h = kernels.logprobs_and_entropy(shard, case["labels"], vocab_size, temperature, impl, chunk_tokens=chunk)
        _loss(case, lp, h).backward()
        _compare(report, impl, [("logprob", lp, expected[0], None), ("entropy", h, expected[1], None),
                                ("grad_logits", shard.grad, _shard(full.grad, -1), grad_scale),
                                ("masked_grad", shard.grad[masked], 0 * shard.grad[masked], grad_scale)])
    return report


def check_from_hidden(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    """Values and hidden / weight-shard gradients of every implementation (fp32) against the
    full-vocabulary reference in float64 (the hidden gradient must include every shard's part), in ulps."""
    from megatron.core import parallel_state

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    hidden, weight = _double_leaves(case["hidden"], case["weight"])
    expected = _reference(case, hidden @ weight.t(), vocab_size, temperature)
    _loss(case, *expected).backward()
    report = {}
    for impl in ["naive", *FUSED]:
        h = case["hidden"].clone().requires_grad_(True)
        w = _shard(case["weight"], 0).clone().requires_grad_(True)
        lp, ent = kernels.logprobs_and_entropy_from_hidden(h, w, case["labels"], vocab_size, temperature, impl,
                                                           chunk_tokens=chunk)
        _loss(case, lp, ent).backward()
        _compare(report, impl, [("logprob", lp, expected[0], None), ("entropy", ent, expected[1], None),
                                ("grad_hidden", h.grad, hidden.grad, None),
                                ("grad_weight", w.grad, _shard(weight.grad, 0), _max_abs(weight.grad))])
    return report


def _teacher(case: dict, vocab_size: int, temperature: float, k: int, seed: int):
    """Teacher logits [.., padded V] and their top-k (global ids, log softmax(logits / T) there). The
    teacher is the student's logits plus unit noise, so the divergences are O(1), as between a student
    and its teacher."""
    g = torch.Generator().manual_seed(seed + 1)
    logits = case["logits"] + torch.randn(case["logits"].shape, generator=g)
    logprobs = torch.log_softmax(logits[..., :vocab_size] / temperature, dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return logits, ids, values


def check_topk(vocab_size: int, temperature: float, chunk, mode: str, beta: float, from_hidden: bool,
               k: int = 5, seed: int = 0) -> dict:
    """The top-k GKD loss, its gradients and the student's top-k mass, of every implementation (fp32),
    from logits or from hidden states, against algorithms' full-vocabulary GKD_TOPK_MODES and
    student_topk_mass in float64 on the same inputs, in ulps."""
    from megatron.core import parallel_state

    from megarl.algorithms import GKD_TOPK_MODES, student_topk_mass

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    _, ids, teacher_logprobs = _teacher(case, vocab_size, temperature, k, seed)
    names = ("hidden", "weight") if from_hidden else ("logits",)
    reference = _double_leaves(*(case[name] for name in names))
    full = (reference[0] @ reference[1].t() if from_hidden else reference[0])[..., :vocab_size]
    expected = GKD_TOPK_MODES[mode](full, ids, teacher_logprobs.double(), beta, temperature)
    (case["mask"] * case["a"] * expected).sum().backward()
    expected_mass = student_topk_mass(full.detach(), ids, temperature)
    # (the reference gradient of each leaf on this rank, the whole gradient's scale)
    reference_grads = [(reference[0].grad, None)] if from_hidden else [(_shard(reference[0].grad, -1),
                                                                          _max_abs(reference[0].grad))]
    if from_hidden:
        reference_grads.append((_shard(reference[1].grad, 0), _max_abs(reference[1].grad)))
    report = {}
    for impl in ["naive", *FUSED]:
        if from_hidden:
            leaves = [case["hidden"].clone().requires_grad_(True),
                      _shard(case["weight"], 0).clone().requires_grad_(True)]
        else:
            leaves = [_shard(case["logits"], -1).clone().requires_grad_(True)]
        loss, mass = kernels.distill_topk(leaves[0], ids, teacher_logprobs, vocab_size, beta, temperature, mode, impl,
                                          weight_shard=leaves[1] if from_hidden else None, chunk_tokens=chunk)
        (case["mask"] * case["a"] * loss).sum().backward()
        _compare(report, impl, [("loss", loss, expected, None), ("mass", mass, expected_mass, None),
                                *((f"grad{i}", leaf.grad, grad, scale)
                                  for i, (leaf, (grad, scale)) in enumerate(zip(leaves, reference_grads)))])
    return report


def check_full(vocab_size: int, temperature: float, chunk, beta: float | None, seed: int = 0) -> dict:
    """The full-vocabulary divergence (beta) or, with beta None, the KL to a reference, and its logit
    gradient, of every implementation (fp32) against algorithms.distill_full in float64, in ulps."""
    from megatron.core import parallel_state

    from megarl.algorithms import distill_full

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    teacher, _, _ = _teacher(case, vocab_size, temperature, 1, seed)
    [full] = _double_leaves(case["logits"])
    expected = distill_full(full[..., :vocab_size], teacher[..., :vocab_size].double(),
                            1.0 if beta is None else beta, temperature)
    (case["mask"] * case["a"] * expected).sum().backward()
    report = {}
    for impl in ["naive", *FUSED]:
        shard = _shard(case["logits"], -1).clone().requires_grad_(True)
        if beta is None:
            loss = kernels.full_kl(shard, _shard(teacher, -1), vocab_size, temperature, impl, chunk_tokens=chunk)
        else:
            loss = kernels.full_divergence(shard, _shard(teacher, -1), vocab_size, beta, temperature, impl,
                                           chunk_tokens=chunk)
        (case["mask"] * case["a"] * loss).sum().backward()
        _compare(report, impl, [("loss", loss, expected, None),
                                ("grad", shard.grad, _shard(full.grad, -1), _max_abs(full.grad))])
    return report


def check_select_topk(vocab_size: int, temperature: float, chunk, k: int, seed: int = 0) -> dict:
    """The top-k selection (a colocated teacher's ids and log-probs) of every implementation, fp32, from
    logits and from hidden states, against log_softmax(...).topk in float64 on the same inputs: "{path}_ids"
    0 when the ids are the same, inf otherwise; "{path}_logprobs" in ulps. k = vocab_size takes every real
    id, so at TP=2 a shard has fewer real columns than k."""
    from megatron.core import parallel_state

    case = inputs(vocab_size, parallel_state.get_tensor_model_parallel_world_size(), seed)
    report = {}
    for source in ("logits", "hidden"):
        full = (case["hidden"].double() @ case["weight"].double().t() if source == "hidden"
                else case["logits"].double())[..., :vocab_size]
        expected, expected_ids = torch.log_softmax(full / temperature, dim=-1).topk(k, dim=-1)
        for impl in ["naive", *FUSED]:
            if source == "hidden":
                ids, logprobs = kernels.select_topk(case["hidden"], k, vocab_size, temperature, impl,
                                                    weight_shard=_shard(case["weight"], 0), chunk_tokens=chunk)
            else:
                ids, logprobs = kernels.select_topk(_shard(case["logits"], -1), k, vocab_size, temperature, impl,
                                                    chunk_tokens=chunk)
            report[f"{impl}_{source}_ids"] = 0.0 if torch.equal(ids, expected_ids) else float("inf")
            report[f"{impl}_{source}_logprobs"] = ulps(logprobs, expected)
    return report


# (mode, beta) of the top-k cases and the betas of the full-vocabulary ones (None: the KL to a reference)
TOPK_CASES = [("tail", 0.0), ("tail", 0.5), ("renorm", 1.0), ("tail", 1.0)]
FULL_BETAS = [0.0, 0.5, 1.0, None]


def SELECT_KS(vocab_size: int) -> list[int]:  # noqa: N802  (a table, by vocabulary)
    """The k of the top-k selection cases: a teacher's few, and every real id."""
    return [5, vocab_size]


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
            for k in SELECT_KS(vocab_size):
                report[f"select_k{k}_{name}"] = check_select_topk(vocab_size, temperature, chunk, k)
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


def start_tensor_parallel_world() -> str:
    """A kernel worker's start: its --out path, and a gloo world whose every rank is one TP rank (with
    Megatron's CPU shims and parallel state)."""
    global CHUNKS
    own = argparse.ArgumentParser()
    own.add_argument("--out", required=True)
    own.add_argument("--chunks", help="comma-separated chunk sizes ('None' = the default) instead of CHUNKS: "
                     "the Triton interpreter at TP=2 runs one (its chunking is checked at TP=1)")
    parsed = own.parse_args()
    if parsed.chunks:
        CHUNKS = [None if c == "None" else int(c) for c in parsed.chunks.split(",")]
    out = parsed.out
    from megatron.core import parallel_state

    from megarl import accelerator

    dist.init_process_group("gloo")
    accelerator.apply_megatron_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return out


def main():
    out = start_tensor_parallel_world()
    report = max_over_ranks(all_cases())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"tp": dist.get_world_size(), "cases": report}, f)
    dist.barrier()
    # as train.py ends: a hard exit once every rank is done. Interpreter teardown with gloo's and
    # the CPU libraries' threads alive aborted once in CI ("terminate called without an active
    # exception", SIGABRT) after the work was written
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
