"""Worker of tests/test_min_new_tokens.py: the kernels' sampler constraint (kernels.HeldBack: token ids
held back at some positions, vLLM's min_tokens) against a float64 reference that sets those logits to
-inf before the softmax, at the TP size of the torchrun launch (every rank one TP rank); the case
functions also run in-process at TP=1.

Operations: the label's logprob and the entropy from logits and from hidden states, and the exact KL
to a reference (both distributions constrained); implementations naive, chunked, and triton where it
can run (a GPU, or TRITON_INTERPRET=1 set before Python starts). The held-back ids fall in every
shard at TP=2 (V=250: ids 0, 2 in the first shard, 131, 249 in the second) or only in the first one
(V=100: the second shard is all Megatron padding). One held-back id is given the largest logit by a
margin at every position, so the constraint moves every constrained logprob by O(1).

Each metric is an error divided by its bound (pass: <= 1), except
    *_held_grad          max |gradient| at the held-back logits of constrained positions: must be 0
    *_unconstrained      the same operation without the constraint, its error / bound: must be >> 1
                         (the comparison can fail)
The bound: an fp32 sum of V terms is off by at most gamma_V = V * eps32 of the sum of their
magnitudes (the standard worst case); the terms here are at most as large as (1 + max |z|), the scaled
logits, times (1 + max |reference|), the compared quantity; so bound = V * eps32 * (1 + max |z|) *
(1 + max |reference|). It follows from the computation (vocabulary size, logit and result magnitudes),
not from one machine's rounding.
"""

from __future__ import annotations

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import accelerator, kernels  # noqa: E402

FUSED = ["chunked"]
if accelerator.triton_available():
    FUSED.append("triton")

EPS32 = torch.finfo(torch.float32).eps
SHAPE = (2, 7)
HIDDEN = 16
HELD_BACK = {250: [0, 2, 131, 249], 100: [0, 2, 99]}
VOCABS = [(250, 0.7), (100, 1.3), (250, 1.0)]
CHUNKS = [3, None]  # several chunks, some holding constrained and unconstrained rows; one chunk


def padded(vocab_size: int, tp: int) -> int:
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    tp, rank = _tp()
    return tensor.chunk(tp, dim=dim)[rank]


def inputs(vocab_size: int, seed: int) -> dict:
    """The full problem, identical on every rank. Response positions 0..3 of row 0 and 0..1 of row 1 are
    constrained; no label there is held back, one label after them is (EOS once allowed)."""
    g = torch.Generator().manual_seed(seed)
    width, ids = padded(vocab_size, _tp()[0]), torch.tensor(HELD_BACK[vocab_size])
    where = torch.zeros(SHAPE, dtype=torch.bool)
    where[0, :4], where[1, :2] = True, True
    labels = torch.randint(0, vocab_size, SHAPE, generator=g)
    held = torch.isin(labels, ids) & where
    labels[held] = (labels[held] + 3) % vocab_size  # 0 -> 3, 2 -> 5, 131 -> 134, 249 -> 2 (V=250), 99 -> 2 (V=100)
    labels[0, 5] = ids[0]
    assert not (torch.isin(labels, ids) & where).any()
    hidden = torch.randn(*SHAPE, HIDDEN, generator=g)
    weight = 3 / HIDDEN**0.5 * torch.randn(width, HIDDEN, generator=g)
    logits = 3 * torch.randn(*SHAPE, width, generator=g)
    # The first held-back id takes the largest logit (+3) everywhere, from logits and from hidden states
    # (its weight row follows the hidden state at each position well enough: set it from the logits).
    logits[..., ids[0]] = logits[..., :vocab_size].max(dim=-1).values + 3
    weight[ids[0]] = 0
    hidden_logits = hidden @ weight.t()
    boost = (hidden_logits[..., :vocab_size].max(dim=-1).values + 3)
    # a weight row w with h . w = boost at every position: the least-squares solution (exact: 14 equations
    # in 16 unknowns, full rank almost surely)
    weight[ids[0]] = torch.linalg.lstsq(hidden.reshape(-1, HIDDEN), boost.reshape(-1, 1)).solution[:, 0]
    return {"logits": logits, "labels": labels, "where": where, "ids": ids, "hidden": hidden, "weight": weight,
            "a": torch.randn(SHAPE, generator=g), "c": torch.randn(SHAPE, generator=g),
            "ref_noise": torch.randn(*SHAPE, width, generator=g)}


def _masked_log_softmax(logits64: torch.Tensor, case: dict, vocab_size: int, temperature: float,
                        constrained: bool = True) -> torch.Tensor:
    """float64 log softmax over the real vocabulary, the held-back ids at -inf where constrained."""
    z = logits64[..., :vocab_size] / temperature
    if constrained:
        held = torch.zeros(vocab_size, dtype=torch.bool)
        held[case["ids"]] = True
        z = z.masked_fill(case["where"][..., None] & held, -torch.inf)
    return torch.log_softmax(z, dim=-1)


def reference(logits64: torch.Tensor, case: dict, vocab_size: int, temperature: float, constrained: bool = True):
    """(logprob of the label, entropy) in float64; 0 log 0 = 0."""
    log_p = _masked_log_softmax(logits64, case, vocab_size, temperature, constrained)
    p = log_p.exp()
    return (log_p.gather(-1, case["labels"][..., None])[..., 0],
            -(p * torch.where(p > 0, log_p, 0.0)).sum(-1))


def _loss(case: dict, logprob, entropy):
    return (case["a"] * logprob + case["c"] * entropy).sum()


def _ratio(value: torch.Tensor, expected: torch.Tensor, vocab_size: int, z_max: float) -> float:
    bound = vocab_size * EPS32 * (1 + z_max) * (1 + expected.abs().max().item())
    return (value.double() - expected).abs().max().item() / bound


def _held_back(case: dict) -> kernels.HeldBack:
    return kernels.HeldBack(case["ids"], case["where"])


def check_from_logits(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    case = inputs(vocab_size, seed)
    full = case["logits"].double().requires_grad_(True)
    expected = reference(full, case, vocab_size, temperature)
    _loss(case, *expected).backward()
    z_max = (case["logits"][..., :vocab_size] / temperature).abs().max().item()
    local = _shard(torch.arange(full.shape[-1]), 0)
    held_columns = torch.isin(local, case["ids"])
    report = {}
    for impl in ["naive", *FUSED]:
        x = _shard(case["logits"], -1).clone().requires_grad_(True)
        logprob, entropy = kernels.logprobs_and_entropy(x, case["labels"], vocab_size, temperature, impl,
                                                        chunk_tokens=chunk, held_back=_held_back(case))
        _loss(case, logprob, entropy).backward()
        free, _ = kernels.logprobs_and_entropy(x.detach(), case["labels"], vocab_size, temperature, impl,
                                               chunk_tokens=chunk)
        report.update({f"{impl}_logprob": _ratio(logprob, expected[0], vocab_size, z_max),
                       f"{impl}_entropy": _ratio(entropy, expected[1], vocab_size, z_max),
                       f"{impl}_grad_logits": _ratio(x.grad, _shard(full.grad, -1), vocab_size, z_max),
                       f"{impl}_held_grad": x.grad[case["where"]][:, held_columns].abs().max().item()
                       if held_columns.any() else 0.0,
                       f"{impl}_unconstrained": _ratio(free, expected[0], vocab_size, z_max)})
    return report


def check_from_hidden(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    case = inputs(vocab_size, seed)
    hidden64, weight64 = (case[name].double().requires_grad_(True) for name in ("hidden", "weight"))
    expected = reference(hidden64 @ weight64.t(), case, vocab_size, temperature)
    _loss(case, *expected).backward()
    z_max = ((case["hidden"] @ case["weight"].t())[..., :vocab_size] / temperature).abs().max().item()
    report = {}
    for impl in ["naive", *FUSED]:
        h = case["hidden"].clone().requires_grad_(True)
        w = _shard(case["weight"], 0).clone().requires_grad_(True)
        logprob, entropy = kernels.logprobs_and_entropy_from_hidden(h, w, case["labels"], vocab_size, temperature,
                                                                    impl, chunk_tokens=chunk,
                                                                    held_back=_held_back(case))
        _loss(case, logprob, entropy).backward()
        free, _ = kernels.logprobs_and_entropy_from_hidden(h.detach(), w.detach(), case["labels"], vocab_size,
                                                           temperature, impl, chunk_tokens=chunk)
        report.update({f"{impl}_logprob": _ratio(logprob, expected[0], vocab_size, z_max),
                       f"{impl}_entropy": _ratio(entropy, expected[1], vocab_size, z_max),
                       f"{impl}_grad_hidden": _ratio(h.grad, hidden64.grad, vocab_size, z_max),
                       f"{impl}_grad_weight": _ratio(w.grad, _shard(weight64.grad, 0), vocab_size, z_max),
                       f"{impl}_unconstrained": _ratio(free, expected[0], vocab_size, z_max)})
    return report


def check_full_kl(vocab_size: int, temperature: float, chunk, seed: int = 0) -> dict:
    """KL(pi || ref) with both distributions constrained: exactly 0 where they agree, as at the first step."""
    case = inputs(vocab_size, seed)
    ref_logits = case["logits"] + case["ref_noise"]
    full = case["logits"].double().requires_grad_(True)
    log_p = _masked_log_softmax(full, case, vocab_size, temperature)
    log_q = _masked_log_softmax(ref_logits.double(), case, vocab_size, temperature)
    p = log_p.exp()
    expected = (p * torch.where(p > 0, log_p - log_q, 0.0)).sum(-1)
    (case["a"] * expected).sum().backward()
    unconstrained = torch.tensor(0.0)
    z_max = (torch.cat([case["logits"], ref_logits], -1)[..., :vocab_size] / temperature).abs().max().item()
    report = {}
    for impl in ["naive", *FUSED]:
        x = _shard(case["logits"], -1).clone().requires_grad_(True)
        kl = kernels.full_kl(x, _shard(ref_logits, -1), vocab_size, temperature, impl, chunk_tokens=chunk,
                             held_back=_held_back(case))
        (case["a"] * kl).sum().backward()
        free = kernels.full_kl(x.detach(), _shard(ref_logits, -1), vocab_size, temperature, impl,
                               chunk_tokens=chunk)
        same = kernels.full_kl(x.detach(), x.detach(), vocab_size, temperature, impl, chunk_tokens=chunk,
                               held_back=_held_back(case))
        report.update({f"{impl}_kl": _ratio(kl, expected, vocab_size, z_max),
                       f"{impl}_grad": _ratio(x.grad, _shard(full.grad, -1), vocab_size, z_max),
                       f"{impl}_kl_to_itself": _ratio(same, unconstrained, vocab_size, z_max),
                       f"{impl}_unconstrained": _ratio(free, expected, vocab_size, z_max)})
    return report


CHECKS = {"logits": check_from_logits, "hidden": check_from_hidden, "full_kl": check_full_kl}


def all_cases() -> dict:
    return {f"{name}_V{vocab_size}_T{temperature:g}_chunk{chunk}": check(vocab_size, temperature, chunk)
            for name, check in CHECKS.items() for vocab_size, temperature in VOCABS for chunk in CHUNKS}


def main():
    from kernels_worker import start_tensor_parallel_world  # beside this script (sys.path[0] under torchrun)

    out = start_tensor_parallel_world()
    report = all_cases()
    keys = [(case, metric) for case in report for metric in report[case]]
    values = torch.tensor([report[case][metric] for case, metric in keys], dtype=torch.float64)
    # The worst rank's error, and the least discriminating rank's unconstrained ratio.
    worst = values.clone()
    least = values.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    merged = {}
    for (case, metric), high, low in zip(keys, worst.tolist(), least.tolist()):
        merged.setdefault(case, {})[metric] = low if metric.endswith("_unconstrained") else high
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"tp": dist.get_world_size(), "fused": FUSED, "cases": merged}, f)
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
