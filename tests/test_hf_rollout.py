"""The rollout backend without vLLM (--rollout-backend hf, megarl/hf_rollout.py).

In process (the unit lane): the logit processing against vLLM's own functions; per-request randomness
(a prompt's samples do not depend on the rest of the call) and the reported logprobs against a plain
transformers forward of prompt + response; the weight load (tied head, unknown and missing names) and
the offload verbs; the refusals of what needs vLLM; and the train path with vLLM unimportable.
On torchrun ranks (slow): parity with the vLLM backend and the trainer (tests/workers/hf_rollout_worker.py),
and megarl/train.py end to end with vLLM blocked; the learning run is outside CI (-m learning).
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import (FP32_PATHS_ULPS, ROOT, ROUNDING_LEVEL, WORKERS, assert_fp32_paths_agree, fp32_paths_ulps,
                     length_reward_plugin, read_json, reward_rise, scalars, torchrun)
from megarl.arguments import parse_args
from megarl.errors import ConfigError
from megarl.placement import Placement

HF = ["--rollout-backend", "hf"]


def _engine(model, *flags):
    from megarl.hf_rollout import HfRolloutEngine

    args = parse_args(["--model", str(model), *HF, "--max-new-tokens", "12", *flags], world_size=1)
    return HfRolloutEngine(args, Placement.from_args(args, 1).rollout, 0, colocated=True)


def _prompts(engine, texts=("What is 12 + 30?", "What is 7 + 88? Take care.", "Compute 3 + 9.")):
    from megarl.data.prompts import render_chat

    return [render_chat(engine.tokenizer, text) for text in texts]


# ------------------------------------------------------------------ logit processing ----


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 1.0),
                                                     (0.7, -1, 0.8), (1.0, 20, 0.6), (0.5, 300, 0.9999)])
def test_processed_logprobs_are_vllms(temperature, top_k, top_p):
    """vLLM's processed_logprobs (what megarl asks vLLM for): its temperature, then its top-k/top-p masks
    (apply_top_k_top_p_pytorch, ties at the k-th kept), then log-softmax; greedy: the log-softmax at T = 1."""
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from megarl.hf_rollout import processed_logprobs

    logits = 3 * torch.randn(6, 259, generator=torch.Generator().manual_seed(0))
    if top_p == 1.0:  # eight tied maxima: top-k keeps all of them (under top-p, which ties stay is the sort's)
        logits[0, :8] = logits[0].max() + 1.0
    mine = processed_logprobs(logits.clone(), temperature, top_k, top_p)
    if temperature == 0.0:
        expected = logits.log_softmax(-1)
    else:
        k = torch.full((6,), top_k) if 0 < top_k < 259 else None
        p = torch.full((6,), top_p) if top_p < 1.0 else None
        expected = vllm_ops.apply_top_k_top_p_pytorch(logits / temperature, k, p).log_softmax(-1)
    assert torch.equal(torch.isinf(mine), torch.isinf(expected))
    assert torch.isinf(mine).any() == (0 < top_k < 259 or top_p < 1.0)  # the masks did something, and only they
    assert_fp32_paths_agree(mine[torch.isfinite(mine)], expected[torch.isfinite(expected)], "processed logprobs")


# ------------------------------------------------------------------ sampling ----


@pytest.fixture(scope="module")
def engine(tiny_model):
    return _engine(tiny_model, "--num-generations", "3", "--temperature", "0.7")


def test_a_prompts_samples_depend_on_seed_step_and_prompt_not_on_the_batch(engine):
    """One generator per sample, seeded from (--seed, step, seed key, prompt index) + j: a prompt sampled
    alone, or after other prompts, gives the same tokens; another step gives others."""
    prompts = _prompts(engine)
    full = engine.generate(prompts, [4, 9, 11], step=3, seed_key=("train", 0))
    alone = engine.generate(prompts[2:], [11], step=3, seed_key=("train", 0))
    reordered = engine.generate([prompts[2], prompts[0]], [11, 4], step=3, seed_key=("train", 0))
    assert [s.response_ids for s in full[6:]] == [s.response_ids for s in alone] == \
        [s.response_ids for s in reordered[:3]]
    assert [s.response_ids for s in full[:3]] == [s.response_ids for s in reordered[3:]]
    assert_fp32_paths_agree([x for s in full[6:] for x in s.logprobs], [x for s in alone for x in s.logprobs],
                            "logprobs alone vs in a batch")
    assert len({tuple(s.response_ids) for s in full}) > 3  # the n samples of a prompt differ
    other = engine.generate(prompts, [4, 9, 11], step=4, seed_key=("train", 0))
    assert [s.response_ids for s in other] != [s.response_ids for s in full]
    assert [(s.prompt_index, s.prompt_ids) for s in full] == [(i, p) for i, p in zip([4, 9, 11], prompts)
                                                              for _ in range(3)]


def test_reported_logprobs_are_a_plain_forwards_at_the_temperature(engine):
    """The cached, left-padded decoding reports, for every sampled token, the log-softmax at T = 0.7 that one
    unpadded forward of prompt + response gives (positions, masks and the cache line up), and the
    callback gets each prompt's samples once."""
    _check_reported_logprobs(engine)


def test_qwen3_5_decoding_carries_its_recurrent_state(random_qwen3_5_teacher):
    """The same on Qwen3.5 in the released multimodal layout (read as its language model): the Gated DeltaNet
    layers' conv and recurrent states in transformers' cache, the prompts' left padding kept out of them; and the
    weight load takes the checkpoint's model.language_model.* names."""
    engine = _engine(random_qwen3_5_teacher, "--num-generations", "3", "--temperature", "0.7")
    assert type(engine.model).__name__ == "Qwen3_5ForCausalLM"
    _check_reported_logprobs(engine)
    weights = {name: param.detach() + 0.01 for name, param in engine.model.named_parameters()}
    engine.load_weights(("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else
                         name, tensor) for name, tensor in weights.items())
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())


def _check_reported_logprobs(engine):
    prompts, done = _prompts(engine), []
    samples = engine.generate(prompts, [0, 1, 2], step=0, on_prompt_done=lambda i, s: done.append((i, len(s))))
    assert sorted(done) == [(0, 3), (1, 3), (2, 3)]
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1].double()
        expected = (logits / 0.7).log_softmax(-1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        assert fp32_paths_ulps(sample.logprobs, expected) <= FP32_PATHS_ULPS, sample
        ended = sample.response_ids[-1] in engine.stop_ids
        assert sample.truncated == (not ended) and (ended or len(sample.response_ids) == 12)
        assert sample.response_text == engine.tokenizer.decode(sample.response_ids[:-1] if ended else
                                                               sample.response_ids, skip_special_tokens=True)


def test_min_tokens_holds_the_stop_ids_back_and_greedy_is_one_sample(engine):
    prompts = _prompts(engine)
    free = engine.generate(prompts, [0, 1, 2], step=0, greedy=True)
    held = engine.generate(prompts, [0, 1, 2], step=0, greedy=True, min_tokens=12)
    assert len(free) == 3 and any(len(s.response_ids) < 12 for s in free)
    assert all(len(s.response_ids) == 12 and s.truncated and s.min_tokens == 12 for s in held)
    assert held[0].held_back_ids == engine.held_back_ids() == tuple(sorted(engine.stop_ids)) == (0, 2)
    assert all(s.min_tokens == 0 and s.held_back_ids == () for s in free)


# ------------------------------------------------------------------ the decoding loop against the old one ----


@pytest.mark.parametrize("flags,min_tokens,greedy", [
    (["--temperature", "0.7"], 0, False), (["--temperature", "1.3", "--top-k", "5"], 0, False),
    (["--temperature", "1.0", "--top-k", "20", "--top-p", "0.6"], 0, False),
    (["--temperature", "1.0", "--top-p", "0.9"], 4, False), ([], 0, True), ([], 3, True)])
@pytest.mark.parametrize("batch_tokens,noise_bytes,gemm", [(None, None, "torch"), (250, 4 * 259 * 4 * 3, "torch"),
                                                       (None, None, "onednn")])
def test_the_decoding_gives_the_old_loops_tokens_and_logprobs(tiny_model, monkeypatch, flags, min_tokens, greedy,
                                                               batch_tokens, noise_bytes, gemm):
    """The preallocated cache, grouped-head attention, prompts prefilled once, the batched draw from noise blocks
    and the micro-batches give the tokens of the loop before issue 54 (tests/hf_rollout_reference.py: one padded
    batch, a cache grown by concatenation, one exponential_ per row and step) for the same seeds, and its logprobs
    (bit for bit on the Zen 4 development host; asserted within two fp32 paths' rule). Second case: micro-batches of
    a few rows that cut a prompt's samples apart, and noise blocks of 3 steps (refilled, and cut when rows
    finish). Third: --cpu-gemm onednn, the new loop's linear layers through oneDNN (the old loop keeps torch's):
    the same tokens, the logprobs within fp32 rounding."""
    from hf_rollout_reference import old_engine

    from megarl import cpu_gemm, hf_rollout

    if gemm == "onednn" and not cpu_gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    if noise_bytes is not None:
        monkeypatch.setattr(hf_rollout, "NOISE_BYTES", noise_bytes)
    products = []  # the linear layers' oneDNN products (none on torch's GEMMs)
    onednn_linear = cpu_gemm._onednn_linear
    monkeypatch.setattr(cpu_gemm, "_onednn_linear", lambda *a: products.append(1) or onednn_linear(*a))
    engine = _engine(tiny_model, "--num-generations", "3", *flags, "--cpu-gemm", gemm,
                     *(["--hf-rollout-batch-tokens", str(batch_tokens)] if batch_tokens else []))
    prompts = _prompts(engine)
    for step in (0, 5):
        done = {True: [], False: []}
        runs = {}
        for old in (False, True):
            with old_engine(engine) if old else contextlib.nullcontext():
                runs[old] = engine.generate(prompts, [2, 0, 7], step=step, greedy=greedy, min_tokens=min_tokens,
                                            on_prompt_done=lambda i, s, old=old: done[old].append((i, len(s))))
        new, reference = runs[False], runs[True]
        assert sorted(done[False]) == sorted(done[True]) and len(done[False]) == 3 and len(new) == (3 if greedy else 9)
        assert [s.response_ids for s in new] == [s.response_ids for s in reference], (flags, step)
        assert [(s.truncated, s.response_text) for s in new] == [(s.truncated, s.response_text) for s in reference]
        assert_fp32_paths_agree([x for s in new for x in s.logprobs], [x for s in reference for x in s.logprobs],
                                "logprobs against the old loop")
    if not greedy:  # the samples of a prompt differ (the draws are not all alike)
        assert len({tuple(s.response_ids) for s in new}) > 3
    assert bool(products) == (gemm == "onednn")


def test_a_generators_block_of_draws_is_its_draws_step_by_step():
    """What hf_rollout._Noise rests on: exponential_ of a seeded generator into [steps, vocab] gives the values of
    one [vocab] draw per step, in order (torch's CPU kernel fills from one stream in element order)."""
    block = torch.empty(7, 259).exponential_(generator=torch.Generator().manual_seed(11))
    generator = torch.Generator().manual_seed(11)
    assert torch.equal(block, torch.stack([torch.empty(259).exponential_(generator=generator) for _ in range(7)]))


# ------------------------------------------------------------------ weights and memory ----


def test_load_weights_writes_every_parameter_in_place_and_names_a_bad_stream(tiny_model):
    """A stream of new values for every parameter (the tied model's names): each parameter takes its values,
    in the same tensors; lm_head.weight of a tied model is the embedding and is skipped (vLLM's loader does
    too). Asleep, the load wakes the weights first, not the KV cache."""
    engine = _engine(tiny_model)
    generator = torch.Generator().manual_seed(3)
    stream = [(name, torch.randn(p.shape, generator=generator)) for name, p in engine.model.named_parameters()]
    tensors = {name: p for name, p in engine.model.named_parameters()}
    engine.offload()
    engine.load_weights(iter(stream + [("lm_head.weight", torch.zeros_like(tensors["model.embed_tokens.weight"]))]))
    assert engine.asleep == {"kv_cache"}
    for name, value in stream:
        assert torch.equal(tensors[name], value), name
    assert engine.model.lm_head.weight is tensors["model.embed_tokens.weight"]  # still tied
    assert dict(engine.model.named_parameters()).keys() == tensors.keys()
    with pytest.raises(RuntimeError, match="unloaded: \\['model.norm.weight'\\]"):
        engine.load_weights(iter([s for s in stream if s[0] != "model.norm.weight"]))
    with pytest.raises(RuntimeError, match="model.layers.9.mlp.up_proj.weight .* is not a parameter"):
        engine.load_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))]))


def test_offload_empties_the_weights_and_onload_brings_them_back_bit_identical(tiny_model):
    engine = _engine(tiny_model)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    greedy = engine.generate(_prompts(engine), [0, 1, 2], step=0, greedy=True)
    for _ in range(2):  # the host buffers are reused the second time
        engine.offload()
        assert engine.asleep == {"weights", "kv_cache"}
        assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
        engine.onload()
    assert engine.asleep == set()
    assert all(torch.equal(before[name], p) for name, p in engine.model.named_parameters())
    again = engine.generate(_prompts(engine), [0, 1, 2], step=0, greedy=True)
    assert [s.response_ids for s in again] == [s.response_ids for s in greedy]


# ------------------------------------------------------------------ what needs vLLM ----


@pytest.mark.parametrize("flags,named", [
    (["--rollout-tensor-parallel-size", "2"], "--rollout-tensor-parallel-size 2"),
    (["--rollout-engine-kwargs", '{"max_num_seqs": 8}'], "--rollout-engine-kwargs"),
    (["--colocate-groups", "train,rollout;teacher", "--teacher-gpus", "1", "--standalone-teacher-model", "x",
      "--gkd-logits-topk", "4"], "teacher.gpus"),
    (["--hf-rollout-batch-tokens", "0"], "--hf-rollout-batch-tokens 0")])
def test_what_needs_vllm_is_refused_in_one_line(tiny_model, flags, named):
    with pytest.raises(ConfigError) as error:
        parse_args(["--model", tiny_model, *HF, *flags], world_size=2)
    message = str(error.value)
    assert message.startswith("--rollout-backend hf: ") and named in message and "\n" not in message


NO_VLLM_SCRIPT = """
import sys
from megarl import train, run, phases, generation, evaluation, checkpoint, weight_sync, actor, teacher  # the path
from megarl.arguments import parse_args
from megarl.placement import Placement
from megarl.run import build_run  # noqa: F401
from megarl.hf_rollout import HfRolloutEngine
from megarl.data.prompts import render_chat

args = parse_args(["--config", "examples/quickstart_grpo.yaml", "--model", sys.argv[1], "--rollout-backend", "hf",
                   "--max-new-tokens", "8"], world_size=2)
engine = HfRolloutEngine(args, Placement.from_args(args, 2).rollout, 1, colocated=True)
samples = engine.generate([render_chat(engine.tokenizer, "What is 1 + 2?")], [0], step=0)
assert len(samples) == 8 and engine.engine_index == 1 and engine.num_engines == 2, samples
try:
    parse_args(["--model", sys.argv[1], "--rollout-engine-kwargs", '{"max_num_seqs": 8}'], world_size=1)
except Exception as error:
    print("REFUSED", error)
assert not [name for name in sys.modules if name.split(".")[0] == "vllm"]
print("NO-VLLM OK")
"""


@pytest.mark.slow  # a fresh interpreter importing torch, transformers and megatron: 30 s of the unit lane
def test_the_train_path_runs_without_vllm(tiny_model, tmp_path):
    """vLLM unimportable (a meta-path finder raises on it, tests/workers/no_vllm.py): megarl's train path
    imports, the arguments parse, the HF engine builds and samples; a vLLM-only option says vLLM is
    missing in one line."""
    script = tmp_path / "no_vllm_path.py"
    script.write_text(NO_VLLM_SCRIPT)
    result = subprocess.run([sys.executable, str(WORKERS / "no_vllm.py"), str(script), tiny_model], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NO-VLLM OK" in result.stdout
    assert "REFUSED rollout.engine_kwargs (--rollout-engine-kwargs) 'max_num_seqs': vLLM's engine arguments, " \
           "but vLLM does not import here" in result.stdout


# ------------------------------------------------------------------ on torchrun ranks ----

SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "16", "--micro-batch-size", "16",
         "--lr", "1e-3", "--rollout-kv-cache-gb", "0.25"]


@pytest.mark.slow
def test_parity_with_the_vllm_backend_and_the_trainer(tiny_model, tmp_path):
    """One rank, both engines from the same checkpoint (tests/workers/hf_rollout_worker.py)."""
    out = tmp_path / "report.json"
    torchrun("hf_rollout_worker.py", out, "--model", tiny_model, *SMALL, "--temperature", "0.7", "--log-dir", "",
             nproc=1, timeout=600)
    report = read_json(out)
    for name in ("greedy", "greedy_min_stop", "greedy_after"):
        vllm_samples, hf_samples = report[name]
        for v, h in zip(vllm_samples, hf_samples, strict=True):
            assert v["ids"] == h["ids"] and v["text"] == h["text"] and v["truncated"] == h["truncated"], (name, v, h)
            assert v["min_tokens"] == h["min_tokens"] and v["held_back_ids"] == h["held_back_ids"], (name, v, h)
            assert_fp32_paths_agree(h["logprobs"], v["logprobs"], f"{name}: HF vs vLLM logprobs")
    # the stop string "}" cut the text before it; min_tokens 6 held EOS and the generation config's eos back
    assert all(not s["text"].endswith("}") and s["held_back_ids"] == [0, 2] for s in report["greedy_min_stop"][1])
    assert any(s["text"].endswith("}") for s in report["greedy"][1])
    # sampled at 0.7: the reported logprobs are the trainer's, at rounding level, also under min_tokens,
    # and after a GRPO step and the sync; before the sync they are not (the comparison can fail)
    for name in ("mismatch_before", "mismatch_before_min_tokens", "mismatch_after"):
        assert report[name]["mismatch"] <= ROUNDING_LEVEL and report[name]["ratio_dev_max"] <= 1e-3, (name, report)
    assert set(report["mismatch_before_min_tokens"]["lengths"]) == {16}
    assert report["mismatch_stale"]["mismatch"] > 100 * ROUNDING_LEVEL, report
    assert report["sync_bytes"] > 0
    assert report["offload_roundtrip"] == {"emptied": True, "asleep_after": [], "equal": True}


@pytest.mark.slow
def test_quickstart_runs_without_vllm(tiny_model, tmp_path):
    """megarl/train.py with --rollout-backend hf on 2 colocated ranks where vLLM cannot be imported: three
    GRPO steps with an evaluation, each synced, the trainer and the rollout agreeing at rounding level."""
    result = torchrun("no_vllm.py", ROOT / "megarl" / "train.py", "--config", "examples/quickstart_grpo.yaml",
                      "--model", tiny_model, *HF, *SMALL, "--micro-batch-size", "8", "--train-steps", "3",
                      "--eval-dataset", "held=builtin:8",
                      "--log-dir", tmp_path / "tb", timeout=600)
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "reward:" in result.stdout, result.stdout[-3000:]
    series = {tag: list(values.values()) for tag, values in
              scalars(tmp_path / "tb", ("mismatch", "ratio_dev_max", "sync_bytes", "eval/held/pass@1")).items()}
    assert len(series["mismatch"]) == 3 and max(series["mismatch"]) <= ROUNDING_LEVEL, series
    assert max(series["ratio_dev_max"]) <= 1e-3, series
    assert len(series["sync_bytes"]) == 3 and min(series["sync_bytes"]) > 0, series
    assert len(series["eval/held/pass@1"]) == 2, series  # before the first step and after the last


@pytest.mark.slow
@pytest.mark.learning
def test_quickstart_learns_with_the_hf_backend(tiny_model, tmp_path):
    """The quickstart (200 steps, about 4 minutes on 2 CPU ranks) on the HF backend with vLLM blocked: the reward
    rises. Its own bar (docs/testing.md, "Learning bars"): the fitted rise (helpers.reward_rise) over seeds 1234,
    1 and 2 read +0.274, +0.276, +0.289 (spread 0.015; at 80 steps +0.108, +0.099, +0.174: too noisy to judge),
    so +0.20 keeps a margin of five times the spread."""
    result = torchrun("no_vllm.py", ROOT / "megarl" / "train.py", "--config", "examples/quickstart_grpo.yaml",
                      "--model", tiny_model, *HF, "--log-dir", tmp_path / "tb", timeout=3600)
    line = [text for text in result.stdout.splitlines() if text.startswith("reward: ")][-1]
    assert reward_rise(tmp_path / "tb") >= 0.20, (reward_rise(tmp_path / "tb"), line)


MOE_POLICIES = ["random_qwen3_moe_mixed", "random_deepseek_v3_policy", "random_glm4_moe_policy",
                "random_gpt_oss_policy", "random_nemotron_h_policy"]
# the fused tensor a stream without one expert's up_proj leaves incomplete (Nemotron-H's experts are not gated)
UNLOADED = {"random_nemotron_h_policy": r"model\.layers\.\d+\.mixer\.experts\.up_proj"}


@pytest.mark.parametrize("policy", MOE_POLICIES)
def test_a_checkpoints_stream_loads_as_transformers_loads_it(policy, request):
    """The sync into the HF engine of the MoE families (models/in_memory_layout.py): a checkpoint's tensors as the
    stream, in reverse order, into an engine whose every weight was zeroed, give exactly the model
    transformers' own loading builds from the checkpoint (its conversion table: per-expert tensors into fused
    experts; gpt-oss's fused ones as they are), the expert bias buffer included. A stream without one expert's
    tensor names the fused tensor left incomplete."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(policy)
    engine = _engine(path)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    layers = engine.model.config.num_hidden_layers  # DeepSeek-V3's MTP layers after them: not in megarl's stream
    stream = sorted(((name, tensor) for name, tensor in load_file(f"{path}/model.safetensors").items()
                     if not name.startswith(tuple(f"model.layers.{i}." for i in range(layers, layers + 4)))),
                    reverse=True)
    with torch.no_grad():
        for tensor in engine.model.state_dict().values():
            tensor.zero_()
    engine.load_weights(iter(stream))
    loaded = engine.model.state_dict()
    assert loaded.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(loaded[name], expected[name])] == []
    if policy != "random_gpt_oss_policy":  # per-expert names: one expert's slice missing
        dropped = next(name for name, _ in stream if ".experts.3.up_proj" in name)
        fused = UNLOADED.get(policy, r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj")
        with pytest.raises(RuntimeError, match=rf"unloaded: \['{fused}'\]"):
            engine.load_weights(iter([item for item in stream if item[0] != dropped]))
    else:
        assert not [name for name, _ in stream if re.search(r"\.experts\.\d+\.", name)]  # fused as in memory
    if policy in ("random_deepseek_v3_policy", "random_glm4_moe_policy", "random_nemotron_h_policy"):
        assert any(name.endswith("e_score_correction_bias") and loaded[name].abs().max() > 0 for name in loaded)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["random_deepseek_v3_policy", "random_gpt_oss_policy",
                                    "random_qwen3_sliding_policy", "random_nemotron_h_policy"])
def test_the_new_families_sample_what_the_trainer_computes(policy, request, tmp_path):
    """DeepSeek-V3 (MLA, the sigmoid router and its expert bias buffer, fused experts in memory), gpt-oss
    (attention sinks through transformers' own attention, sliding windows of 8 tokens, fused experts) and a Qwen3
    windowed in its second layer only (5 tokens: vLLM 0.32 cannot serve it) and a Nemotron-H (Mamba-2 mixers, dt
    unfloored as the trainer's) on the HF backend, one rank without vLLM (tests/workers/hf_rollout_worker.py): its sampled logprobs are the trainer's at
    rounding level before and after a GRPO step and the sync, not before the sync (the comparison can fail: the
    length reward differs within a random model's groups, so the step moves the policy), and the offload round
    trip is bit-exact."""
    out = tmp_path / "report.json"
    # Nemotron-H's random policy moves less per step at 1e-3: a larger step keeps the stale check's margin
    faster = ["--lr", "1e-2"] if policy == "random_nemotron_h_policy" else []
    torchrun("hf_rollout_worker.py", out, "--model", request.getfixturevalue(policy), *HF, *SMALL, *faster,
             "--temperature", "0.7", "--reward", "response_length", "--external-plugins", length_reward_plugin(tmp_path),
             "--log-dir", "", nproc=1, timeout=600)
    report = read_json(out)
    for name in ("mismatch_before", "mismatch_before_min_tokens", "mismatch_after"):
        assert report[name]["mismatch"] <= ROUNDING_LEVEL and report[name]["ratio_dev_max"] <= 1e-3, (name, report)
    assert report["mismatch_stale"]["mismatch"] > 100 * ROUNDING_LEVEL, report
    assert report["sync_bytes"] > 0
    assert report["offload_roundtrip"] == {"emptied": True, "asleep_after": [], "equal": True}
