"""Worker of tests/test_triton_kernels.py: megarl/kernels/triton_ops.py against torch_ops.py function
by function, and impl="triton" against impl="naive" through the public API in a one-rank gloo world
at TP=1, on CPU tensors under the Triton interpreter.

Runs as its own process with TRITON_INTERPRET=1 set before Python starts: Triton reads it when its
jit functions (its own standard library included) are defined at import, and Megatron's parallel
state imports Triton, so a test process that has imported Megatron cannot switch it on late.

Writes {"ops": {case: error}, "api": {case: error}} as JSON, cases named "function or op/.../what".
An error is in fp32 ulps of the compared tensor's scale (tests/helpers.py); both sides are fp32
computations (torch_ops and the naive path compute in fp32 whatever their input), so each must be
<= helpers.FP32_PATHS_ULPS. Against a bf16 `out` it is what exceeds one bf16 ulp of the fp32
reference: the interpreter converts fp32 to bf16 by truncation (its create_fp_trunc), where a GPU
rounds to nearest (half an ulp). Checks that must hold exactly (inputs untouched, margins and masked
gradients zero) report inf or a nonzero error in ulps when they fail.
"""

from __future__ import annotations

from megarl import startup_gc

startup_gc.defer_full_collections()  # as train.py's ranks do: no full collection rescans the imports below

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import BF16_EPS, EPS32, ulps  # noqa: E402


def error(a: torch.Tensor, b: torch.Tensor, bf16: bool = False) -> float:
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    if bf16:
        finite = b[torch.isfinite(b)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        excess = ((a - b).abs() - BF16_EPS * b.abs()).clamp(min=0).max().item()
        return 0.0 if excess == 0 else excess / (EPS32 * scale) if scale > 0 else float("inf")
    return ulps(a, b)


def untouched(same: bool) -> float:
    return 0.0 if same else float("inf")


# ------------------------------------------------------------------ per function ----
# (rows, real columns, K, temperature, x dtype, out dtype): rows of 0, 1 and 7; a padding-only
# shard (r = 0); r = 5, 37, 130 in blocks of 16 columns (one, three and nine blocks).
SHAPES = [
    (7, 37, 3, 0.7, torch.float32, torch.float32),
    (7, 130, 3, 1.3, torch.float32, torch.float32),
    (1, 5, 1, 1.0, torch.float32, torch.float32),
    (7, 37, 3, 1.3, torch.bfloat16, torch.bfloat16),
    (7, 5, 1, 0.7, torch.float16, torch.float32),
    (0, 37, 3, 0.7, torch.float32, torch.float32),
    (7, 0, 3, 1.3, torch.float32, torch.float32),
]
BLOCK_V = 16
TOPK_TILE = 32


def shape_name(shape) -> str:
    n, r, k, temp, x_dtype, out_dtype = shape
    return f"n{n}_r{r}_k{k}_T{temp:g}_{str(x_dtype)[6:]}_out_{str(out_dtype)[6:]}"


def _strided(n: int, r: int, dtype, g, scale: float = 3.0, device="cpu") -> torch.Tensor:
    """[n, r] columns 4.. of a wider [n, r + 9] tensor on `device`: the row stride is not r."""
    return (scale * torch.randn(n, r + 9, generator=g)).to(dtype).to(device)[:, 4:4 + r]


def _out(n: int, r: int, dtype, device="cpu") -> torch.Tensor:
    """A strided gradient buffer whose margin columns must stay 0."""
    return torch.zeros(n, r + 7, dtype=dtype, device=device)[:, 2:2 + r]


def _problem(n, r, k, dtype, seed, device="cpu"):
    """(the CPU generator the rest of the case draws from, x, labels, ids), the tensors on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = _strided(n, r, dtype, g, device=device)
    labels = torch.randint(-3, r + 3, (n,), generator=g)  # some outside the shard: not owned
    ids = torch.rand(n, r + 6, generator=g).argsort(dim=-1)[:, :k] - 3  # distinct per row
    return g, x, labels.to(device), ids.to(device)


def check_ops(shapes=SHAPES, device="cpu") -> dict:
    """{case: error} of every function on every shape, the tensors on `device` (tests/gpu/lane.py runs
    them compiled on a GPU at the real vocabulary size)."""
    from megarl.kernels import torch_ops as ref
    from megarl.kernels import triton_ops as tri

    def randn(*size, generator):  # drawn on the CPU (the same values on any device), used on `device`
        return torch.randn(*size, generator=generator).to(device)

    report = {}
    for seed, shape in enumerate(shapes):
        n, r, k, temp, x_dtype, out_dtype = shape
        name = shape_name(shape)
        bf16 = out_dtype == torch.bfloat16
        g, x, labels, ids = _problem(n, r, k, x_dtype, seed, device)
        x_before = x.clone()

        def compare_grad(fn_name, variant, run):
            """Both backends' gradients; the Triton one into a strided `out` of out_dtype."""
            expected, got = _out(n, r, torch.float32, device), _out(n, r, out_dtype, device)
            run(ref, expected)
            run(tri, got)
            report[f"{fn_name}/{variant}/{name}"] = error(got, expected, bf16)
            margins = torch.cat([got._base[:, :2], got._base[:, 2 + r:]], dim=1)  # _out's margin columns
            report[f"{fn_name}/{variant}/{name}/margins"] = untouched(not margins.any())

        # token_stats / token_grad
        stats = ref.token_stats(x, labels, temp)
        report[f"token_stats/{name}"] = error(tri.token_stats(x, labels, temp), stats)
        m, log_sum, expected = stats[:, 0], stats[:, 1].log(), stats[:, 2] / stats[:, 1]
        g_lp, g_h = randn(n, generator=g), randn(n, generator=g)
        for variant, (a, c) in {"both": (g_lp, g_h), "lp_only": (g_lp, None), "h_only": (None, g_h)}.items():
            compare_grad("token_grad", variant,
                         lambda ops, out: ops.token_grad(x, labels, temp, m, log_sum, expected, a, c, out))

        # topk_stats / topk_grad: log_rest = +inf on row 2 (a floored tail: no tail gradient)
        stats = ref.topk_stats(x, ids, temp)
        report[f"topk_stats/{name}"] = error(tri.topk_stats(x, ids, temp), stats)
        m, log_sum, log_rest = stats[:, 0], stats[:, 1].log(), stats[:, 2].log()
        if n > 2:
            log_rest[2] = torch.inf
        g_ids, g_tail = randn(n, k, generator=g), randn(n, generator=g)
        for variant, tail in {"tail": g_tail, "no_tail": None}.items():
            compare_grad("topk_grad", variant,
                         lambda ops, out: ops.topk_grad(x, ids, temp, m, log_sum, log_rest, g_ids, tail, out))

        # lse_stats and the full divergence; here the student has a -inf and a floored (< -1e4)
        # log-prob, the teacher too (straight-through floor, large finite terms)
        xs, xt = _strided(n, r, x_dtype, g, device=device), _strided(n, r, x_dtype, g, device=device)
        if n > 2 and r > 6:
            xs[0, 3], xs[1, 4], xt[0, 5], xt[2, 6] = -torch.inf, -1e6, -torch.inf, -1e6
        report[f"lse_stats/{name}"] = error(tri.lse_stats(xs, temp), ref.lse_stats(xs, temp))
        log_zs, log_zt = (torch.logsumexp(t.float() / temp, dim=-1) for t in (xs, xt))
        g_full = randn(n, generator=g)
        for beta in (0.0, 0.3, 1.0):
            args = (xs, xt, temp, log_zs, log_zt, beta)
            variant = f"beta{beta:g}/{name}"
            report[f"full_terms/{variant}"] = error(tri.full_terms(*args), ref.full_terms(*args))
            direct_sum = ref.full_direct_sum(*args, g_full)
            report[f"full_direct_sum/{variant}"] = error(tri.full_direct_sum(*args, g_full), direct_sum)
            compare_grad("full_grad", f"beta{beta:g}",
                         lambda ops, out: ops.full_grad(*args, g_full, direct_sum, out))
        report[f"inputs_untouched/{name}"] = untouched(torch.equal(x, x_before))
    return report


# ------------------------------------------------------------ the public API, TP=1 ----
VOCAB, WIDTH, SHAPE, K, HIDDEN = 120, 128, (1, 7), 4, 16  # 8 padding columns; 7 tokens


def _api_inputs(seed: int, vocab: int = VOCAB, width: int = WIDTH, shape=SHAPE, k: int = K, hidden: int = HIDDEN,
                dtype=torch.float32, device="cpu") -> dict:
    """The inputs of every API_OPS case: `shape` tokens ([1, tokens]) of a `width`-column shard of which
    `vocab` are real; logits, teacher, hidden and weight in `dtype`, everything on `device` (drawn on the
    CPU, so the values do not depend on the device)."""
    g = torch.Generator().manual_seed(seed)
    tokens = shape[0] * shape[1]
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[0, 0] = -100  # no shard owns it
    mask = torch.ones(shape)
    mask[0, 2] = mask[0, 5] = 0.0
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(tokens)]).view(*shape, k)
    logits = 3 * torch.randn(*shape, width, generator=g)
    # Token 1's top-k hold all but exp(-300) of the mass: its tail is floored (no tail gradient).
    logits[0, 1].scatter_(0, ids[0, 1], 300.0)
    floats = {"logits": logits, "teacher": 3 * torch.randn(*shape, width, generator=g),
              "hidden": torch.randn(*shape, hidden, generator=g),
              "weight": 3 / hidden**0.5 * torch.randn(width, hidden, generator=g)}
    return {"vocab": vocab, "labels": labels.to(device), "ids": ids.to(device), "mask": mask.to(device),
            **{name: value.to(dtype).to(device) for name, value in floats.items()}}


def _run_api(op, case, impl, leaves):
    """(outputs, gradients of the leaves) of sum(mask * w * output) over the outputs, w random (the
    same for both implementations): every output carries gradient, masked positions none."""
    from megarl import kernels

    tensors = [case[name].clone().requires_grad_(True) for name in leaves]
    outputs = op(kernels, impl, *tensors)
    g = torch.Generator().manual_seed(1234)
    loss = 0.0
    for out in outputs:
        mask = case["mask"].view(*case["mask"].shape, *(1,) * (out.dim() - case["mask"].dim()))
        loss = loss + (mask * torch.randn(out.shape, generator=g).to(out.device) * out).sum()
    loss.backward()
    return [o.detach() for o in outputs], [t.grad for t in tensors]


API_OPS = {
    "logprobs_and_entropy": (("logits",), lambda k, impl, x, temp, chunk, c: k.logprobs_and_entropy(
        x, c["labels"], c["vocab"], temp, impl, chunk_tokens=chunk)),
    "logprobs_and_entropy_from_hidden": (("hidden", "weight"), lambda k, impl, h, w, temp, chunk, c:
                                         k.logprobs_and_entropy_from_hidden(h, w, c["labels"], c["vocab"], temp,
                                                                            impl, chunk_tokens=chunk)),
    "topk_logprobs": (("logits",), lambda k, impl, x, temp, chunk, c: k.topk_logprobs(
        x, c["ids"], c["vocab"], temp, impl, chunk_tokens=chunk)),
    "topk_logprobs_weight_shard": (("hidden", "weight"), lambda k, impl, h, w, temp, chunk, c: k.topk_logprobs(
        h, c["ids"], c["vocab"], temp, impl, weight_shard=w, chunk_tokens=chunk)),
    **{f"full_divergence_beta{beta:g}": (("logits",), lambda k, impl, x, temp, chunk, c, beta=beta:
                                         (k.full_divergence(x, c["teacher"], c["vocab"], beta, temp, impl,
                                                            chunk_tokens=chunk),))
       for beta in (0.0, 0.5, 1.0)},
    "full_kl": (("logits",), lambda k, impl, x, temp, chunk, c: (k.full_kl(x, c["teacher"], c["vocab"], temp, impl,
                                                                          chunk_tokens=chunk),)),
}
API_SETTINGS = [(0.7, 3), (1.0, None), (1.3, 7)]  # (temperature, chunk_tokens): 3 does not divide 7 tokens


def api_comparisons(settings=API_SETTINGS, impls=("naive", "triton"), **inputs):
    """Every API_OPS case at every (temperature, chunk_tokens) setting, impls[1] against impls[0] (the
    reference), as ("value", case, got, expected) for outputs ("/outputI") and gradients ("/grad_LEAF"),
    ("masked", case, the gradient at masked tokens, the reference gradient's scale) and ("untouched", case,
    whether the inputs are unchanged). `inputs`: _api_inputs' sizes, dtype and device."""
    reference, tested = impls
    for seed, (temp, chunk) in enumerate(settings):
        case = _api_inputs(seed, **inputs)
        masked = case["mask"] == 0
        for op_name, (leaves, op) in API_OPS.items():
            name = f"{op_name}/T{temp:g}_chunk{chunk}"
            before = {leaf: case[leaf].clone() for leaf in leaves}
            results = {impl: _run_api(lambda k, i, *t: op(k, i, *t, temp, chunk, case), case, impl, leaves)
                       for impl in impls}
            (out_n, grads_n), (out_t, grads_t) = results[reference], results[tested]
            for i, (a, b) in enumerate(zip(out_t, out_n)):
                yield "value", f"{name}/output{i}", a, b
            for leaf, a, b in zip(leaves, grads_t, grads_n):
                yield "value", f"{name}/grad_{leaf}", a, b
            if leaves[0] in ("logits", "hidden"):  # per-token leaves: masked tokens get no gradient
                yield "masked", f"{name}/masked_grad", grads_t[0][masked], grads_n[0].abs().max().item()
            yield "untouched", f"{name}/inputs_untouched", all(torch.equal(case[leaf], before[leaf])
                                                               for leaf in leaves)


def check_api() -> dict:
    report = {}
    for kind, name, *values in api_comparisons():
        if kind == "value":
            report[name] = error(*values)
        elif kind == "masked":
            got, scale = values
            report[name] = ulps(got, 0 * got, scale)
        else:
            report[name] = untouched(values[0])
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 in the environment"
    from megarl.kernels import triton_ops

    triton_ops.INTERPRETER_BLOCK_V = BLOCK_V  # several blocks per row on these small widths
    # The top-k kernels' tile bound (triton_ops.topk_blocks) at interpreter scale: with K = 3 their blocks
    # narrow to 8 columns, so the narrowed launches run here too.
    triton_ops.TOPK_TILE = TOPK_TILE
    report = {"ops": check_ops()}
    from megarl import distributed

    distributed.init_single_process_world()
    report["api"] = check_api()
    distributed.destroy_single_process_world()
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
