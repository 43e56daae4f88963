"""Benchmark: megarl/kernels.py's naive vs chunked logprobs + entropy, forward + backward, at
Qwen2's vocabulary (151,936) on one CPU process (TP=1).

    python bench/kernels.py [--tokens 128 --hidden 896 --chunk-tokens N]

For each operation (1: from logits [tokens, V]; 2: from hidden states [tokens, H] and the output
layer [V, H]) it measures, side by side in one run:
  time  wall seconds of one forward + backward (after one small warm-up call);
  peak  the most bytes torch's CPU allocator held at once during a second forward + backward,
        above what was allocated before it (the inputs), read from the profiler's memory events
        (torch.profiler, profile_memory=True: every allocation and free, with a running total).
        Not tracemalloc, which sees Python's allocator only, not tensor storage. The inputs'
        gradients count, in both paths: for operation 1 a [tokens, V] fp32 tensor, for
        operation 2 the output layer's [V, H] (printed as "grads MiB").
and prints chunked / naive ratios, plus the largest difference of the two paths' outputs and
gradients as a sanity check. It prints; it asserts nothing.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 151_936  # Qwen2's; a multiple of 128, so Megatron adds no padding at TP=1
MIB = 2**20


def init_tp1():
    """A one-rank gloo world with Megatron's parallel state at TP=1 (the kernels read its TP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def make_inputs(tokens: int, hidden: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"logits": 3 * torch.randn(1, tokens, VOCAB, generator=g), "labels": torch.randint(0, VOCAB, (1, tokens)),
            "hidden": torch.randn(1, tokens, hidden, generator=g),
            "weight": 3 / hidden**0.5 * torch.randn(VOCAB, hidden, generator=g)}


def forward_backward(op: str, impl: str, inputs: dict, chunk, temperature: float = 0.7):
    """One forward + backward of logprob.sum() + entropy.sum(); (outputs, gradients)."""
    from megarl import kernels

    if op == "logits":
        leaves = [inputs["logits"].requires_grad_(True)]
        outputs = kernels.logprobs_and_entropy(leaves[0], inputs["labels"], VOCAB, temperature, impl,
                                               chunk_tokens=chunk)
    else:
        leaves = [inputs["hidden"].requires_grad_(True), inputs["weight"].requires_grad_(True)]
        outputs = kernels.logprobs_and_entropy_from_hidden(*leaves, inputs["labels"], VOCAB, temperature, impl,
                                                           chunk_tokens=chunk)
    (outputs[0].sum() + outputs[1].sum()).backward()
    grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    return [o.detach() for o in outputs], grads


def peak_bytes(fn) -> int:
    """Peak of torch's CPU allocations during fn() above the level before it, from the profiler's
    memory events ("Total Allocated" counts from the start of profiling)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])


def measure(op: str, impl: str, inputs: dict, chunk) -> dict:
    start = time.perf_counter()
    outputs, grads = forward_backward(op, impl, inputs, chunk)
    seconds = time.perf_counter() - start
    peak = peak_bytes(lambda: forward_backward(op, impl, inputs, chunk))
    return {"seconds": seconds, "peak": peak, "values": outputs + grads,
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads)}


def main():
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128,
                        help="tokens per call (128: measured 29-36 s for the whole run on 2 busy cores)")
    parser.add_argument("--hidden", type=int, default=896, help="hidden size of operation 2 (Qwen2.5-0.5B's)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: kernels.default_chunk_tokens")
    args = parser.parse_args()
    from megarl import kernels

    init_tp1()
    chunk = args.chunk_tokens or kernels.default_chunk_tokens(VOCAB)
    inputs = make_inputs(args.tokens, args.hidden)
    warm = make_inputs(4, args.hidden, seed=1)
    print(f"V={VOCAB} tokens={args.tokens} hidden={args.hidden} chunk_tokens={chunk} "
          f"threads={torch.get_num_threads()}; full fp32 logits = {args.tokens * VOCAB * 4 / MIB:.0f} MiB")
    # "grads MiB": the inputs' gradients, part of the peak in both paths (the floor of any implementation).
    print(f"{'op':8} {'impl':8} {'seconds':>8} {'peak MiB':>9} {'grads MiB':>10}")
    for op in ("logits", "hidden"):
        results = {}
        for impl in kernels.IMPLS:
            forward_backward(op, impl, warm, chunk)
            results[impl] = measure(op, impl, inputs, chunk)
            print(f"{op:8} {impl:8} {results[impl]['seconds']:8.2f} {results[impl]['peak'] / MIB:9.1f} "
                  f"{results[impl]['grad_bytes'] / MIB:10.1f}")
        naive, chunked = results["naive"], results["chunked"]
        diff = max((a - b).abs().max().item() for a, b in zip(naive["values"], chunked["values"]))
        print(f"{op:8} chunked/naive: time {chunked['seconds'] / naive['seconds']:.2f}x, "
              f"peak {chunked['peak'] / max(naive['peak'], 1):.3f}x; max |diff| of outputs and grads {diff:.1e}")


if __name__ == "__main__":
    main()
