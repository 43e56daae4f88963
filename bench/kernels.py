"""Benchmark: megarl/kernels' implementations side by side, forward + backward, at Qwen2's
vocabulary (151,936) in one process (TP=1).

    python bench/kernels.py [--tokens 256 --hidden 896 --topk 20 --chunk-tokens N --device auto]

Operations (each the loss's sum of outputs, then backward):
  token/logits   logprob of the label + entropy, from fp32 logits [tokens, V]
  token/hidden   the same from hidden states [tokens, H] and the output layer [V, H]
  topk/hidden    the top-k GKD loss (tail mode, beta 0.5) from hidden states, K teacher ids
  fullkl/logits  the exact KL(pi || ref) over the vocabulary, from both models' logits
Implementations: naive (the reference), chunked, and triton where it can run at full speed (a CUDA
device; the interpreter that runs it on CPU in the tests is far too slow for this size).

Printed per operation and implementation, measured in one run:
  seconds    wall time of one forward + backward (after a small warm-up call);
  peak MiB   the most bytes torch's allocator held at once during a second forward + backward, above
             what was allocated before it (the inputs); on CPU from the profiler's memory events
             (torch.profiler, profile_memory=True), on CUDA from max_memory_allocated;
  grads MiB  the inputs' gradients, which any implementation must return (a [tokens, V] fp32 tensor
             from logits, the [V, H] output-layer gradient from hidden states): the floor of the peak;
  work MiB   peak - grads: the implementation's own working memory;
then the ratios to naive (time, peak, work) and max|err|, the largest absolute error of outputs and
gradients against a float64 computation on the full vocabulary (megarl.algorithms' pure functions).
It prints; it asserts nothing. The goals (issue 12): peak at most 1/8 of naive, max |diff| at most
1e-5 in fp32, not slower.
"""

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# torch.profiler's Kineto logs "USDT: ... profiler_start" and "profiler_stop" around every CPU memory
# profile (peak_bytes), between the table's rows. Kineto reads its level once, at the first profile;
# 6 is above its highest (USDT, 5): no Kineto lines. A KINETO_LOG_LEVEL given by the caller wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

VOCAB = 151_936  # Qwen2's; a multiple of 128, so Megatron adds no padding at TP=1
MIB = 2**20
OPERATIONS = ("token/logits", "token/hidden", "topk/hidden", "fullkl/logits")
TEMPERATURE = 0.7
REFERENCE_ROWS = 1024  # tokens per part of the float64 reference: 1.2 GB per [rows, V] float64 temporary


def make_inputs(tokens: int, hidden: int, topk: int, device, seed: int = 0) -> dict:
    """Random inputs drawn on `device` itself (a GPU draws [8k, V] in milliseconds, a CPU in seconds; the
    values then differ between devices, which a comparison within one run does not mind)."""
    import torch

    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    teacher = 3 * randn(1, tokens, VOCAB)
    teacher_logprobs, teacher_ids = torch.log_softmax(teacher / TEMPERATURE, dim=-1).topk(topk, dim=-1)
    return {"logits": 3 * randn(1, tokens, VOCAB), "ref_logits": teacher,
            "labels": torch.randint(0, VOCAB, (1, tokens), generator=g, device=device),
            "hidden": randn(1, tokens, hidden), "weight": 3 / hidden**0.5 * randn(VOCAB, hidden),
            "teacher_ids": teacher_ids, "teacher_logprobs": teacher_logprobs}


def forward_backward(op: str, impl: str, inputs: dict, chunk):
    """One forward + backward of the operation's outputs summed; (outputs, gradients)."""
    from megarl import kernels

    leaves = [inputs[name].requires_grad_(True) for name in (("logits",) if op.endswith("logits")
                                                             else ("hidden", "weight"))]
    if op == "token/logits":
        outputs = kernels.logprobs_and_entropy(leaves[0], inputs["labels"], VOCAB, TEMPERATURE, impl,
                                               chunk_tokens=chunk)
    elif op == "token/hidden":
        outputs = kernels.logprobs_and_entropy_from_hidden(*leaves, inputs["labels"], VOCAB, TEMPERATURE, impl,
                                                           chunk_tokens=chunk)
    elif op == "topk/hidden":
        outputs = kernels.distill_topk(leaves[0], inputs["teacher_ids"], inputs["teacher_logprobs"], VOCAB, 0.5,
                                       TEMPERATURE, "tail", impl, weight_shard=leaves[1], chunk_tokens=chunk)[:1]
    else:
        outputs = (kernels.full_kl(leaves[0], inputs["ref_logits"], VOCAB, TEMPERATURE, impl, chunk_tokens=chunk),)
    sum(o.sum() for o in outputs).backward()
    grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
        leaf.requires_grad_(False)
    return [o.detach() for o in outputs], grads


def reference(op: str, inputs: dict, rows: int = REFERENCE_ROWS):
    """(outputs, gradients) of the operation in float64 with plain torch on the full vocabulary (the
    pure functions of megarl.algorithms): what every implementation's error is measured against.
    Computed `rows` tokens at a time (every output is per token; the weight's gradient is their sum), so
    that its float64 [tokens, V] temporaries stay within a GPU's memory at thousands of tokens."""
    import torch

    from megarl.algorithms import GKD_TOPK_MODES, distill_full

    names = ("logits",) if op.endswith("logits") else ("hidden", "weight")
    tokens = inputs["labels"].shape[1]
    outputs, grads = [], []
    weight = None if op.endswith("logits") else inputs["weight"].double().requires_grad_(True)
    for start in range(0, tokens, rows):
        part = slice(start, min(start + rows, tokens))
        first = inputs[names[0]][:, part].double().requires_grad_(True)
        logits = first if weight is None else first @ weight.t()
        if op.startswith("token"):
            log_p = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            out = (log_p.gather(-1, inputs["labels"][:, part, None])[..., 0], -(log_p.exp() * log_p).sum(-1))
        elif op == "topk/hidden":
            out = (GKD_TOPK_MODES["tail"](logits, inputs["teacher_ids"][:, part],
                                          inputs["teacher_logprobs"][:, part].double(), 0.5, TEMPERATURE),)
        else:
            out = (distill_full(logits, inputs["ref_logits"][:, part].double(), 1.0, TEMPERATURE),)
        sum(o.sum() for o in out).backward()  # the weight's gradient accumulates over the parts
        outputs.append([o.detach() for o in out])
        grads.append(first.grad)
        del logits, out
    outputs = [torch.cat(parts, dim=1) for parts in zip(*outputs)]
    return outputs, [torch.cat(grads, dim=1)] + ([] if weight is None else [weight.grad])


def peak_bytes(fn, device) -> int:
    """Peak of torch's allocations during fn() above the level before it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    # "Total Allocated" counts from the start of profiling.
    return max([0, *(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")])


def measure(op: str, impl: str, inputs: dict, chunk, device) -> dict:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs, grads = forward_backward(op, impl, inputs, chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_bytes(lambda: forward_backward(op, impl, inputs, chunk), device)
    return {"seconds": seconds, "peak": peak, "values": outputs + grads,
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256,
                        help="tokens per call (256: measured 64 s for the whole run on 2 CPU cores; 512: 185 s)")
    parser.add_argument("--hidden", type=int, default=896, help="hidden size (Qwen2.5-0.5B's)")
    parser.add_argument("--topk", type=int, default=20, help="teacher ids per token of the top-k operation")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="default: kernels.default_chunk_tokens (its budget from logits, or from hidden states)")
    parser.add_argument("--ops", default=",".join(OPERATIONS), help=f"comma-separated subset of {OPERATIONS}")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: the GPU where there is one (triton runs only there), else the CPU")
    return parser


def main():
    import torch

    args = build_parser().parse_args()
    unknown = set(args.ops.split(",")) - set(OPERATIONS)
    if unknown:
        sys.exit(f"--ops: unknown {', '.join(sorted(unknown))} (known: {', '.join(OPERATIONS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    from megarl import accelerator, distributed, kernels

    accelerator.apply_megatron_shims()  # as a run does: on CPU, before Megatron is imported (its warnings)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda") if cuda else torch.device("cpu")
    distributed.init_single_process_world()
    impls = ["naive", "chunked"] + (["triton"] if device.type == "cuda" and accelerator.triton_available() else [])
    chunk = args.chunk_tokens
    inputs = make_inputs(args.tokens, args.hidden, args.topk, device)
    # The warm-up call (Triton's compilation, CUDA's lazy initialisation) on the measured inputs themselves on
    # a GPU (a kernel specialised for other strides would compile again inside the timed call); on the CPU a
    # 4-token call, since each full-size call there takes seconds.
    warm = inputs if device.type == "cuda" else make_inputs(4, args.hidden, args.topk, device, seed=1)
    chunks = chunk or (f"{kernels.default_chunk_tokens(device.type, VOCAB)} from logits, "
                       f"{kernels.default_chunk_tokens(device.type, VOCAB, args.hidden)} from hidden states")
    print(f"V={VOCAB} tokens={args.tokens} hidden={args.hidden} topk={args.topk} chunk_tokens={chunks} "
          f"device={device} threads={torch.get_num_threads()} impls={','.join(impls)}"
          f"{'' if 'triton' in impls else ' (triton: no CUDA device here)'}; "
          f"full fp32 logits = {args.tokens * VOCAB * 4 / MIB:.0f} MiB")
    print(f"{'operation':14} {'impl':8} {'seconds':>8} {'peak MiB':>9} {'grads MiB':>10} {'work MiB':>9} "
          f"{'time/naive':>10} {'peak/naive':>10} {'work/naive':>10} {'max|err|':>9}")
    started = time.perf_counter()
    for op in args.ops.split(","):
        outputs, grads = reference(op, inputs)
        exact = outputs + grads
        del outputs, grads
        results = {}
        for impl in impls:
            forward_backward(op, impl, warm, chunk)
            result = results[impl] = measure(op, impl, inputs, chunk, device)
            result["work"] = max(result["peak"] - result["grad_bytes"], 0)
            naive = results["naive"]
            error = max((a.double() - b).abs().max().item() for a, b in zip(result.pop("values"), exact))
            print(f"{op:14} {impl:8} {result['seconds']:8.2f} {result['peak'] / MIB:9.1f} "
                  f"{result['grad_bytes'] / MIB:10.1f} {result['work'] / MIB:9.1f} "
                  f"{result['seconds'] / naive['seconds']:10.2f} {result['peak'] / max(naive['peak'], 1):10.3f} "
                  f"{result['work'] / max(naive['work'], 1):10.3f} {error:9.1e}", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
