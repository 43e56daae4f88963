"""--cpu-gemm (megarl/cpu_gemm.py): the trainer's fp32 GEMMs through oneDNN compute what torch's matmul computes,
within fp32 rounding, and every GEMM of Megatron's linear layers (forward, input and weight gradients) and
of the fused loss kernels goes through it when chosen: in-process on one Megatron rank, and two training
runs under torchrun (2 gloo ranks) that agree step by step."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (assert_fp32_paths_agree, assert_runs_agree, assert_signal_alive, length_reward_plugin, micro_batches,
                     nll, scalars, torchrun)
from test_fast_paths import actor_of

from megarl import cpu_gemm

onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture
def backend():
    """Sets the backend for a test; torch's again after it (the state is per process)."""
    yield cpu_gemm.use
    cpu_gemm.use("torch")


@pytest.fixture
def counted(monkeypatch):
    """The number of GEMMs oneDNN computed."""
    calls = {"onednn": 0}
    original = cpu_gemm._onednn_gemm

    def counting(a, b):
        calls["onednn"] += 1
        return original(a, b)

    monkeypatch.setattr(cpu_gemm, "_onednn_gemm", counting)
    return calls


@onednn
def test_onednn_products_equal_float64_within_fp32_rounding(backend, counted):
    backend("onednn")
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    weight = randn(96, 64)  # [out, in], Megatron's layout
    cases = {
        "forward x @ W^T, 3-D input": (randn(37, 2, 64), weight.t()),
        "input gradient g @ W": (randn(37, 96), weight),
        "weight gradient g^T @ x, transposed left operand": (randn(300, 96).t(), randn(300, 64)),
        "non-contiguous left operand": (randn(64, 37).t(), randn(64, 80)),
    }
    for what, (a, b) in cases.items():
        assert_fp32_paths_agree(cpu_gemm.matmul(a, b), (a.double() @ b.double()).float(), what)
    # the weight gradient added into main_grad: a widening layer's (b^T copied, the product transposed
    # back) and a narrowing layer's (a copied)
    for rows, columns in ((96, 64), (32, 200)):
        out, a, b = randn(rows, columns), randn(300, rows).t(), randn(300, columns)
        expected = (out.double() + a.double() @ b.double()).float()
        assert_fp32_paths_agree(cpu_gemm.accumulate(out, a, b), expected, f"accumulate into [{rows}, {columns}]")
    assert counted["onednn"] == len(cases) + 2
    # an MoE expert that got no tokens: its products over 0 rows are torch's (oneDNN has no such primitive)
    out = randn(96, 64)
    assert torch.equal(cpu_gemm.accumulate(out.clone(), randn(0, 96).t(), randn(0, 64)), out)
    assert cpu_gemm.matmul(randn(0, 64), weight.t()).shape == (0, 96)
    assert counted["onednn"] == len(cases) + 2


@onednn
def test_onednn_is_used_only_where_autograd_does_not_record(backend, counted):
    """oneDNN's linear op has no derivative: a product autograd must differentiate stays torch's."""
    backend("onednn")
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 16, generator=generator, requires_grad=True), torch.randn(16, 4, generator=generator)
    cpu_gemm.matmul(a, b).sum().backward()  # d/da of sum(a @ b): every row is b's row sums
    assert counted["onednn"] == 0
    assert_fp32_paths_agree(a.grad, b.sum(1).expand(8, 16), "torch's gradient")
    with torch.no_grad():
        cpu_gemm.matmul(a, b)
    cpu_gemm.matmul(a.double(), b.double())  # fp32 only
    assert counted["onednn"] == 1


@onednn
def test_a_weight_with_strided_rows_keeps_torchs_matmul(backend, counted):
    """oneDNN takes a dense or transposed-dense right operand; a column block of a wider matrix (rows strided
    apart) would run its reference kernel, so it stays torch's."""
    backend("onednn")
    generator = torch.Generator().manual_seed(2)
    a, wide = torch.randn(40, 64, generator=generator), torch.randn(80, 2, 64, generator=generator)
    block = wide[:, 1].t()  # [64, 80]: b^T is a column block of the [80, 128] matrix, rows 128 apart
    assert_fp32_paths_agree(cpu_gemm.matmul(a, block), (a.double() @ block.double()).float(), "strided")
    assert counted["onednn"] == 0
    cpu_gemm.matmul(a, block.contiguous())
    cpu_gemm.matmul(a, wide[:, 1].contiguous().t())
    assert counted["onednn"] == 2


@onednn
def test_linear_layers_through_onednn_compute_its_product_row_by_row_and_come_back():
    """linear_layers_through_onednn (the HF rollout's linear layers): inside, an fp32 nn.Linear computes oneDNN's
    product on its plain weight bit for bit (the reordered copy changes the layout, not the sums), within fp32
    rounding of torch's; a row's values do not depend on the rows beside it (rows leave the rollout's batch); a
    bf16 layer keeps torch's; on exit every layer is torch's again."""
    generator = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 48, bias=False),
                                torch.nn.Linear(48, 8).to(torch.bfloat16)).requires_grad_(False)
    x = torch.randn(2, 16, 64, generator=generator)
    before = model[1](model[0](x))
    with torch.no_grad(), cpu_gemm.linear_layers_through_onednn(model):
        hidden = model[0](x)
        plain = torch.ops.mkldnn._linear_pointwise(x, model[0].weight, model[0].bias, "none", [], "")
        assert torch.equal(hidden, plain)
        inside = model[1](hidden)
        assert_fp32_paths_agree(inside, before, "oneDNN's linear layers against torch's")
        assert torch.equal(model[1](hidden[:, :5]), inside[:, :5])
        assert "forward" not in vars(model[2])
    assert all("forward" not in vars(layer) for layer in model)
    assert torch.equal(model[1](model[0](x)), before)


def test_auto_leaves_the_library_the_cpu_leans_to_only_for_a_clearly_faster_one():
    assert cpu_gemm.faster(1.0, 0.5) == "onednn"
    assert cpu_gemm.faster(1.0, 0.95) == "torch"
    assert cpu_gemm.faster(1.0, 1.5) == "torch"
    assert cpu_gemm.faster(1.0, 0.95, lean="onednn") == "onednn"
    assert cpu_gemm.faster(0.95, 1.0, lean="onednn") == "onednn"  # a close call stays on the leaning's side
    assert cpu_gemm.faster(0.5, 1.0, lean="onednn") == "torch"
    assert cpu_gemm.choose("torch") == "torch" and not cpu_gemm.using_onednn()
    assert cpu_gemm.choose("auto") in ("onednn", "torch")
    cpu_gemm.use("torch")


def test_only_amd_cpus_with_avx512_lean_to_onednn():
    """MKL picks its kernels by the CPU's vendor: AVX2 on any AMD CPU, so oneDNN's AVX-512 code is the
    expected winner only there (the fields as /proc/cpuinfo gives them; flags abbreviated)."""
    zen4 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse2 avx2 avx512f avx512_bf16"}
    zen3 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse2 avx2 fma"}
    xeon = {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "fpu sse2 avx2 avx512f amx_tile"}
    assert cpu_gemm.leaning(zen4) == "onednn"
    assert [cpu_gemm.leaning(fields) for fields in (zen3, xeon, {})] == ["torch"] * 3
    assert cpu_gemm.leaning() in ("onednn", "torch")  # this machine's own /proc/cpuinfo, whatever it is


@onednn
def test_auto_keeps_its_choice_per_machine(monkeypatch, tmp_path):
    """The first auto measures and keeps the result; the next takes it without measuring (a forged choice
    proves the file is read); an unreadable file is measured over; an explicit backend touches no file."""
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    try:
        measured = cpu_gemm.choose("auto")
        assert cpu_gemm.decided_by() == "measured at start-up"
        assert json.loads(cpu_gemm.cache_path().read_text()) == {cpu_gemm.machine_key(): measured}
        other = {"onednn": "torch", "torch": "onednn"}[measured]
        cpu_gemm.keep_choice(other)
        monkeypatch.setattr(cpu_gemm, "measure", lambda group=None: pytest.fail("measured a kept choice"))
        assert cpu_gemm.choose("auto") == other and cpu_gemm.using_onednn() == (other == "onednn")
        assert cpu_gemm.decided_by().startswith("measured on this machine before")
        monkeypatch.undo()
        monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
        cpu_gemm.cache_path().write_text("{half a fi")
        again = cpu_gemm.choose("auto")  # measured again: on a host where the two are close, either one
        assert cpu_gemm.decided_by() == "measured at start-up"
        assert json.loads(cpu_gemm.cache_path().read_text()) == {cpu_gemm.machine_key(): again}
        cpu_gemm.cache_path().unlink()
        assert cpu_gemm.choose(other) == other and not cpu_gemm.cache_path().exists()
    finally:
        cpu_gemm.use("torch")


@onednn
def test_ranks_take_a_kept_choice_only_when_all_hold_it(tmp_path):
    """2 gloo ranks, each with its own cache directory: the same kept choice on both is taken without
    measuring; a choice only one rank holds is measured over, on both, which agree and both keep it; with
    times alike, the ranks follow the CPU's leaning only when every rank's CPU has it."""
    torchrun("cpu_gemm_choice_worker.py", tmp_path, "onednn,onednn", "torch,torch", "onednn,none", "torch,onednn",
             "lean:onednn,onednn", "lean:onednn,torch")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for agreed in ("onednn", "torch"):
        case = f"{agreed},{agreed}"
        assert [r[case]["backend"] for r in ranks] == [agreed, agreed]
        assert all(r[case]["decided_by"].startswith("measured on this machine before") for r in ranks)
    for case in ("onednn,none", "torch,onednn"):
        backends = {r[case]["backend"] for r in ranks}
        assert len(backends) == 1, (case, ranks)
        assert all(r[case]["decided_by"] == "measured at start-up" for r in ranks)
        assert all(set(r[case]["file"].values()) == backends for r in ranks)
    # times alike on both ranks: oneDNN where both CPUs lean to it, torch's where one does not (one rule on
    # every rank, so the ranks agree even on a cluster of mixed CPUs)
    assert [r["lean:onednn,onednn"]["backend"] for r in ranks] == ["onednn", "onednn"]
    assert [r["lean:onednn,torch"]["backend"] for r in ranks] == ["torch", "torch"]


def test_onednn_asked_of_a_torch_without_it_is_a_one_line_error(monkeypatch, tiny_model):
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError

    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="--cpu-gemm onednn: this torch has no oneDNN"):
        parse_args(["--model", tiny_model, "--cpu-gemm", "onednn"], world_size=1)
    assert parse_args(["--model", tiny_model, "--cpu-gemm", "auto"], world_size=1).cpu_gemm == "auto"


@onednn
def test_megatron_linear_layers_and_loss_kernels_through_onednn_match_torchs(megatron_rank, tiny_model, backend,
                                                                             counted):
    """One actor, two forward + backward passes over the same micro-batches: torch's GEMMs, then oneDNN's. The
    losses and every main gradient agree within fp32 rounding, and oneDNN computed each linear layer's three
    GEMMs (forward, input gradient, weight gradient added into main_grad) and the loss kernel's."""
    from megarl import kernels
    from megarl.model_runner import forward_backward

    actor = actor_of(tiny_model)
    linear_layers = [name for name, param in actor.model.named_parameters()
                     if name.endswith(".weight") and param.dim() == 2 and "embedding" not in name]
    if not any("output_layer" in name for name in linear_layers):  # tied: the output layer multiplies by the
        linear_layers.append("output layer (the embedding's weight)")  # embedding's weight
    results = {}
    for name in ("torch", "onednn"):
        backend(name)
        counted["onednn"] = 0
        actor.model.train()
        actor.model.zero_grad_buffer()
        losses = forward_backward(actor.model, micro_batches(count=2, seed=3), nll, False, 2)
        results[name] = ([loss for loss in losses],
                         {key: param.main_grad.clone() for key, param in actor.model.named_parameters()})
        calls = counted["onednn"]
        assert calls == (0 if name == "torch" else 3 * len(linear_layers) * 2), (name, calls, linear_layers)
    assert any(grad.abs().max() > 0 for grad in results["onednn"][1].values())
    for key, grad in results["onednn"][1].items():
        assert_fp32_paths_agree(grad, results["torch"][1][key], key)

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 9, 32, generator=generator, requires_grad=True)
    weight = torch.randn(259, 32, generator=generator, requires_grad=True)
    labels = torch.randint(0, 259, (2, 9), generator=generator)
    outputs = {}
    for name in ("torch", "onednn"):
        backend(name)
        counted["onednn"] = 0
        logprobs, entropy = kernels.logprobs_and_entropy_from_hidden(hidden, weight, labels, 259, 1.0, "chunked")
        grads = torch.autograd.grad((logprobs.sum() + entropy.sum()), (hidden, weight))
        outputs[name] = (logprobs, entropy, *grads)
        # the logits forward and again in the backward (recomputed chunk by chunk), the two gradients
        assert counted["onednn"] == (0 if name == "torch" else 4)
    for what, a, b in zip(("logprobs", "entropy", "d hidden", "d weight"), outputs["onednn"], outputs["torch"]):
        assert_fp32_paths_agree(a.detach(), b.detach(), what)




@onednn
@pytest.mark.slow
def test_a_training_run_through_onednn_matches_torchs_gemms(tiny_model, tmp_path, monkeypatch):
    """Two steps with --cpu-gemm torch vs onednn: the same per-step loss, gradient norm and entropy within
    tests/helpers.py's rule for two training runs, and rank 0 says which library the GEMMs went through.
    Two, not three: with responses of 100-300 tokens Adam's amplification of the first step's rounding
    (helpers.py) moved a third step's gradient norm by 2.4e-3 of it with either attention path for long
    sequences (1e-3 the rule), the second step's by 4e-5.
    Packed rows of responses of 100-600 tokens (at least 100 forced; the tiny model's sequences came to
    134-635 tokens in both steps with the arithmetic reward, before the length reward below): with oneDNN they
    take the short and the blocked attention paths
    (megarl/models/attention.py: oneDNN's default pieces, kept for this machine in a cache of the test's own,
    so that they are taken whatever this machine would measure), with torch the flash kernel (kept likewise).
    The reward is the response's length in characters (a plugin): with the arithmetic reward an Intel host's
    samples of the first step all scored 0, so that step had no gradient to compare (assert_signal_alive)."""
    from megarl.models import attention_paths

    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    plugin = length_reward_plugin(tmp_path)
    for library in ("onednn", "torch"):
        cpu_gemm.keep(f"{cpu_gemm.machine_key()} | attention with {library} GEMMs: 4 heads in 2 groups of 32",
                      [list(piece) for piece in attention_paths.DEFAULT_PATHS[library]])
    series, tags = {}, ["loss", "grad_norm", "entropy"]
    for backend in ("torch", "onednn"):
        result = torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", tiny_model,
                          "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "600",
                          "--min-new-tokens", "100", "--padding-free",
                          "--micro-batch-size", "8", "--lr", "1e-3", "--train-steps", "2", "--cpu-gemm", backend,
                          "--external-plugins", plugin, "--reward", "response_length",
                          "--log-dir", tmp_path / backend,
                          # the trainer's GEMMs are compared, not the engine: the HF backend spares vLLM's start
                          "--rollout-backend", "hf", timeout=900)
        said = [line for line in result.stdout.splitlines() if "CPU fp32 GEMMs through" in line]
        assert said == [f"megarl: CPU fp32 GEMMs through {'oneDNN' if backend == 'onednn' else 'torch'} "
                        f"(--cpu-gemm)"], result.stdout[-2000:]
        said = [line for line in result.stdout.splitlines() if "packed attention on CPU" in line]
        pieces = "flash up to 99, short 100-511, blocked above 511 tokens" if backend == "onednn" else \
            "flash at every length"
        assert said == [f"megarl: packed attention on CPU: {pieces} "
                        f"(measured on this machine before, kept in {cpu_gemm.cache_path()})"], result.stdout[-2000:]
        series[backend] = scalars(tmp_path / backend, tags)
    assert_signal_alive(tmp_path / "onednn", steps=(0, 1), what="oneDNN")
    for tag in tags:
        assert sorted(series["torch"][tag]) == sorted(series["onednn"][tag]) == [0, 1], (tag, series)
        assert_runs_agree(series["onednn"][tag], series["torch"][tag], tag)
