import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import ROOT, make_random_model

TINY_MODEL = ROOT / "artifacts" / "tiny-qwen2"


OPT_IN_LANES = ("soak", "learning", "variants", "migrating", "mutations")  # pytest.ini: outside CI, run by hand


def pytest_collection_modifyitems(config, items):
    """Soak, learning, variants and migrating tests (pytest.ini) run only when -m names their lane. Not
    `addopts = -m "not soak"`: the last -m wins, so the unit lane's `-m "not slow"` would then replace it and pull the soak in."""
    expression = config.getoption("markexpr") or ""
    lanes = [lane for lane in OPT_IN_LANES if lane not in expression]  # named lanes: the expression decides
    opted_out = [item for item in items if any(item.get_closest_marker(lane) for lane in lanes)]
    if opted_out:
        config.hook.pytest_deselected(items=opted_out)
        dropped = set(map(id, opted_out))
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_sessionstart(session):
    """--cpu-gemm auto (every run's default) measured once for the session and kept where every run of it
    reads it (megarl/cpu_gemm.py): two runs a test compares then compute with the same GEMM library, also on
    a host where the two are close enough for each run's own measurement to go either way (a Zen 4 EPYC:
    a killed run and its reference differed at fp32 rounding in CI). Not the user's ~/.cache: a fresh
    measurement, and nothing of the suite left behind."""
    from megarl import cpu_gemm

    os.environ["MEGARL_CACHE_DIR"] = tempfile.mkdtemp(prefix="megarl-test-cache-")
    if cpu_gemm.onednn_available():
        cpu_gemm.keep_choice(cpu_gemm.measure())


def pytest_sessionfinish(session):
    shutil.rmtree(os.environ.get("MEGARL_CACHE_DIR", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The built-in tiny model; built once if this checkout has none yet."""
    if not (TINY_MODEL / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(TINY_MODEL)], cwd=ROOT,
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(TINY_MODEL)


# Random tiny checkpoints, one session fixture each: name -> (family, tied, seed, Llama-3 RoPE).
RANDOM_MODELS = {
    "random_qwen2_untied": ("qwen2", False, 1, None),
    "random_qwen2_tied": ("qwen2", True, 2, None),
    "random_qwen3_untied": ("qwen3", False, 3, None),
    "random_qwen3_tied": ("qwen3", True, 4, None),
    "random_llama_untied": ("llama", False, 5, "custom"),
    "random_llama_tied": ("llama", True, 6, "megatron"),
    "random_qwen3_moe_untied": ("qwen3_moe", False, 7, None),
    "random_qwen3_moe_tied": ("qwen3_moe", True, 8, None),
    "random_qwen2_moe_untied": ("qwen2_moe", False, 9, None),
    "random_qwen3_5_untied": ("qwen3_5", False, 14, None),
    "random_qwen3_5_tied": ("qwen3_5", True, 15, None),
    "random_qwen3_5_moe_untied": ("qwen3_5_moe", False, 16, None),
    "random_deepseek_v3_untied": ("deepseek_v3", False, 23, None),  # q through q_a_proj / q_b_proj
    "random_glm4_moe_untied": ("glm4_moe", False, 26, None),  # q/k/v biases and q/k norms
    "random_gpt_oss_untied": ("gpt_oss", False, 33, None),  # sinks, biases, sliding and full layers, YaRN
    "random_nemotron_h_untied": ("nemotron_h", False, 34, None),  # Mamba-2, attention, MLP and MoE mixers
}


def _random_model_fixture(name: str):
    family, tied, seed, llama3_rope = RANDOM_MODELS[name]

    @pytest.fixture(scope="session", name=name)
    def fixture(tmp_path_factory) -> str:
        return make_random_model(tmp_path_factory.mktemp(name), family, tied, seed, llama3_rope=llama3_rope)

    return fixture


for _name in RANDOM_MODELS:
    globals()[_name] = _random_model_fixture(_name)


@pytest.fixture(scope="session")
def random_deepseek_v3_q_proj_tied(tmp_path_factory) -> str:
    """A random DeepSeek-V3 whose queries come from one q_proj (q_lora_rank None, as DeepSeek-V2-Lite), tied."""
    return make_random_model(tmp_path_factory.mktemp("random_deepseek_v3_q_proj_tied"), "deepseek_v3", True, 24,
                             q_lora_rank=None)


# DeepSeek-V3's YaRN at a tiny scale: an original context of 64, factor 4, and mscale != mscale_all_dim so that
# both of its attention terms (cos / sin scaled by their ratio, the softmax by mscale_all_dim's term squared) move
# the logits (the released config's 1 / 1 leaves the first at 1).
DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                     mscale_all_dim=0.5, beta_fast=32, beta_slow=1)


# YaRN on grouped-query attention as Qwen2/3 and Llama configs set it for long contexts (factor, original
# context), at a tiny scale, and with gpt-oss's truncate false (the correction range not rounded).
GQA_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, truncate=False)


@pytest.fixture(scope="session")
def random_qwen3_yarn(tmp_path_factory) -> str:
    """A random Qwen3 with YaRN RoPE (GQA_YARN), untied."""
    return make_random_model(tmp_path_factory.mktemp("random_qwen3_yarn"), "qwen3", False, 32, rope_extra=GQA_YARN)


@pytest.fixture(scope="session")
def random_qwen3_sliding(tmp_path_factory) -> str:
    """A random Qwen3 with sliding-window attention in its second layer of two (use_sliding_window,
    max_window_layers 1: transformers' layer_types [full, sliding]) over 5 tokens, untied; weights at std 0.2, so
    that attention depends on position enough for the window to move the logits."""
    return make_random_model(tmp_path_factory.mktemp("random_qwen3_sliding"), "qwen3", False, 33, std=0.2,
                             use_sliding_window=True, sliding_window=5, max_window_layers=1)


@pytest.fixture(scope="session")
def random_deepseek_v3_yarn(tmp_path_factory) -> str:
    """A random DeepSeek-V3 with YaRN RoPE (DEEPSEEK_YARN), untied."""
    return make_random_model(tmp_path_factory.mktemp("random_deepseek_v3_yarn"), "deepseek_v3", False, 31,
                             rope_extra=DEEPSEEK_YARN)


@pytest.fixture(scope="session")
def random_glm4_moe_plain_tied(tmp_path_factory) -> str:
    """A random GLM-4.5 without q/k/v biases and q/k norms (attention_bias and use_qk_norm false), tied."""
    return make_random_model(tmp_path_factory.mktemp("random_glm4_moe_plain_tied"), "glm4_moe", True, 27,
                             attention_bias=False, use_qk_norm=False)


@pytest.fixture(scope="session")
def random_nemotron_h_dense(tmp_path_factory) -> str:
    """A random Nemotron-H without MoE layers (M*-M: Mamba-2, attention, MLP, Mamba-2), as Nemotron-H 8B's kind."""
    return make_random_model(tmp_path_factory.mktemp("random_nemotron_h_dense"), "nemotron_h", False, 35,
                             num_hidden_layers=4, hybrid_override_pattern="M*-M")


@pytest.fixture(scope="session")
def random_qwen3_moe_mixed(tmp_path_factory) -> str:
    """A random Qwen3-MoE with a dense layer among its MoE layers (mlp_only_layers [2] of 4: at PP 2 each stage
    has an MoE layer, the second stage a dense one too)."""
    return make_random_model(tmp_path_factory.mktemp("random_qwen3_moe_mixed"), "qwen3_moe", False, 28,
                             num_hidden_layers=4, mlp_only_layers=[2])


@pytest.fixture(scope="session")
def random_qwen2_moe_mixed(tmp_path_factory) -> str:
    """A random Qwen2-MoE whose every other layer is dense (decoder_sparse_step 2: layers 1 and 3 MoE), tied."""
    return make_random_model(tmp_path_factory.mktemp("random_qwen2_moe_mixed"), "qwen2_moe", True, 29,
                             num_hidden_layers=4, decoder_sparse_step=2)


@pytest.fixture(scope="session")
def multimodal_qwen3_5(tmp_path_factory) -> str:
    """A random Qwen3.5 in the released checkpoints' layout (...ForConditionalGeneration: vision tower, MTP
    head, the language model under model.language_model.), tied."""
    from helpers import make_random_multimodal_qwen3_5

    return make_random_multimodal_qwen3_5(tmp_path_factory.mktemp("multimodal_qwen3_5"), True, 17)


@pytest.fixture(scope="session")
def random_moe_policy(tiny_model, tmp_path_factory) -> str:
    """A random Qwen3-MoE (8 experts of width 64, top 2) with the tiny model's tokenizer and stop tokens:
    a whole RL run's machinery on an MoE policy in seconds (its rewards are those of a random policy; the
    trained tiny MoE, tools/make_tiny_model.py --moe, takes minutes to build)."""
    def make(path, tokens):
        return make_random_model(path, "qwen3_moe", False, 13, moe_intermediate_size=64,
                                 max_position_embeddings=512, **tokens)

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_moe_policy"), make)


@pytest.fixture(scope="session")
def random_deepseek_v3_policy(tiny_model, tmp_path_factory) -> str:
    """A random DeepSeek-V3 (tests/helpers.py's shape at vLLM's CPU MLA widths: a latent of 512 plus a rope key
    of 64; 8 experts of width 64 under the sigmoid router, top 4 of the best 2 of 4 groups) with the tiny
    tokenizer; its expert bias small beside the router's scores, so that the routes depend on the token (the
    default bias, and the tiny build's, choose the same experts for nearly every token)."""
    def make(path, tokens):
        return make_random_model(path, "deepseek_v3", False, 25, kv_lora_rank=512, qk_rope_head_dim=64,
                                 moe_intermediate_size=64, expert_bias_std=0.01, **tokens)

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_deepseek_v3_policy"), make)


@pytest.fixture(scope="session")
def random_qwen3_sliding_policy(tiny_model, tmp_path_factory) -> str:
    """random_qwen3_sliding's model (its second layer of two windowed to 5 tokens) with the tiny tokenizer."""
    def make(path, tokens):
        return make_random_model(path, "qwen3", False, 33, std=0.2, use_sliding_window=True, sliding_window=5,
                                 max_window_layers=1, **tokens)

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_qwen3_sliding_policy"), make)


@pytest.fixture(scope="session")
def random_glm4_moe_policy(tiny_model, tmp_path_factory) -> str:
    """A random GLM-4.5 (tests/helpers.py's shape with experts of width 64, vLLM's CPU packing width; its expert
    bias small beside the router's scores, as random_deepseek_v3_policy's) with the tiny tokenizer."""
    def make(path, tokens):
        return make_random_model(path, "glm4_moe", False, 30, moe_intermediate_size=64, expert_bias_std=0.01,
                                 **tokens)

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_glm4_moe_policy"), make)


@pytest.fixture(scope="session")
def random_gpt_oss_policy(tiny_model, tmp_path_factory) -> str:
    """A random gpt-oss (tests/helpers.py's shape: 8 experts of width 64, top 2, sliding and full layers) with the
    tiny tokenizer."""
    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_gpt_oss_policy"),
                                lambda path, tokens: make_random_model(path, "gpt_oss", False, 34, **tokens))


@pytest.fixture(scope="session")
def random_nemotron_h_policy(tiny_model, tmp_path_factory) -> str:
    """A random Nemotron-H (tests/helpers.py's shape, ME*M-E, with experts of width 64; its expert bias small beside
    the router's scores, as random_deepseek_v3_policy's) with the tiny tokenizer."""
    def make(path, tokens):
        return make_random_model(path, "nemotron_h", False, 36, moe_intermediate_size=64, expert_bias_std=0.01,
                                 **tokens)

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_nemotron_h_policy"), make)


@pytest.fixture(scope="session")
def tiny_nemotron_h(tmp_path_factory) -> str:
    """A random Nemotron-H policy with the tiny tokenizer (tools/make_tiny_model.py --family nemotron_h: no warm-up)."""
    return _tiny_build(tmp_path_factory.mktemp("tiny_nemotron_h") / "tiny-nemotron_h", "--family", "nemotron_h")


@pytest.fixture(scope="session")
def random_qwen3_5_policy(tiny_model, tmp_path_factory) -> str:
    """A random Qwen3.5 (tests/helpers.py's shape, untied) with the tiny model's tokenizer and stop tokens: RL and
    distillation runs on Qwen3.5's hybrid layers in seconds (tools/make_tiny_model.py --family qwen3_5 trains one
    in minutes, for the quickstart and the learning lane)."""
    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_qwen3_5_policy"),
                                lambda path, tokens: make_random_model(path, "qwen3_5", False, 18, **tokens))


@pytest.fixture(scope="session")
def random_qwen3_5_moe_policy(tiny_model, tmp_path_factory) -> str:
    """A random Qwen3.5-MoE (8 experts of width 64, top 2, a gated shared expert) with the tiny tokenizer."""
    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_qwen3_5_moe_policy"),
                                lambda path, tokens: make_random_model(path, "qwen3_5_moe", False, 20,
                                                                       moe_intermediate_size=64, **tokens))


@pytest.fixture(scope="session")
def random_qwen3_5_teacher(tiny_model, tmp_path_factory) -> str:
    """Another random Qwen3.5 with the tiny model's tokenizer, in the released checkpoints' multimodal layout
    (a teacher as Qwen/Qwen3.5-4B ships: ...ForConditionalGeneration with a vision tower and an MTP head)."""
    from helpers import make_random_multimodal_qwen3_5

    def make(path, tokens):
        return make_random_multimodal_qwen3_5(path, True, 19, tokens["vocab_size"])

    return _with_tiny_tokenizer(tiny_model, tmp_path_factory.mktemp("random_qwen3_5_teacher"), make)


def _with_tiny_tokenizer(tiny_model: str, path, make) -> str:
    """`make(path, tokens)` (tokens: vocab_size, eos and pad ids of the tiny tokenizer), then the tiny model's
    tokenizer and generation config beside it."""
    import shutil

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    make(path, dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id))
    tokenizer.save_pretrained(path)
    shutil.copy(os.path.join(tiny_model, "generation_config.json"), path)
    return str(path)


@pytest.fixture(scope="session")
def perturbed_tiny(tiny_model, tmp_path_factory) -> str:
    """The tiny model with every weight moved by seeded noise (5% of its tensor's spread): a reference and a
    teacher that differ from the policy from the first step, without training one."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "tiny"
    shutil.copytree(tiny_model, out)
    generator = torch.Generator().manual_seed(5)
    weights = load_file(out / "model.safetensors")
    save_file({name: w + 0.05 * w.float().std().nan_to_num() * torch.randn(w.shape, generator=generator).to(w.dtype)
               for name, w in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


TINY_MOE = ROOT / "artifacts" / "tiny-qwen3-moe"


@pytest.fixture(scope="session")
def tiny_moe() -> str:
    """The MoE quickstart's policy (tools/make_tiny_model.py --moe, ~6 minutes on 2 cores); built once if absent."""
    if not (TINY_MOE / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--moe", "--out", str(TINY_MOE), "--quiet"],
                       cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(TINY_MOE)


@pytest.fixture(scope="session")
def warm_moe_policy(request) -> str:
    """The learning lane's policy of the family `request.param` (tools/make_tiny_model.py --family F --warm: the
    family's warm-up, 2-8 minutes on 2 cores), built once into artifacts/ if absent."""
    out = ROOT / "artifacts" / f"tiny-{request.param}-warm"
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--for-model", str(out.relative_to(ROOT))], cwd=ROOT,
                   check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(out)


TINY_TEACHER = ROOT / "artifacts" / "tiny-qwen2-teacher"


@pytest.fixture(scope="session")
def tiny_teacher() -> str:
    """The distillation quickstart's teacher (the tiny model trained longer); built once if absent."""
    if not (TINY_TEACHER / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--teacher", "--out", str(TINY_TEACHER),
                        "--quiet"], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(TINY_TEACHER)


def _tiny_build(out: Path, *flags: str) -> str:
    """tools/make_tiny_model.py's build into `out` with `flags`, once (kept across sessions in artifacts/)."""
    if not (out / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", *flags, "--out", str(out), "--quiet"], cwd=ROOT,
                       check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(out)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> str:
    """A random gpt-oss policy with the tiny tokenizer (tools/make_tiny_model.py --family gpt_oss: no warm-up)."""
    return _tiny_build(tmp_path_factory.mktemp("tiny_gpt_oss") / "tiny-gpt_oss", "--family", "gpt_oss")


@pytest.fixture(scope="session")
def tiny_glm4_moe(tmp_path_factory) -> str:
    """A random GLM-4.5 policy with the tiny tokenizer (tools/make_tiny_model.py --family glm4_moe: no warm-up)."""
    return _tiny_build(tmp_path_factory.mktemp("tiny_glm4_moe") / "tiny-glm4_moe", "--family", "glm4_moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> str:
    """A random DeepSeek-V3 policy with the tiny tokenizer (tools/make_tiny_model.py --family deepseek_v3: no
    warm-up, seconds; vLLM's CPU MLA widths), built per session rather than into artifacts/."""
    out = tmp_path_factory.mktemp("tiny_deepseek_v3") / "tiny-deepseek-v3"
    return _tiny_build(out, "--family", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_qwen3_5() -> str:
    """The tiny Qwen3.5 policy (tools/make_tiny_model.py --family qwen3_5, ~2 minutes on 2 cores)."""
    return _tiny_build(ROOT / "artifacts" / "tiny-qwen3_5", "--family", "qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_teacher() -> str:
    """The tiny Qwen3.5 teacher (--family qwen3_5 --teacher, ~4 minutes on 2 cores)."""
    return _tiny_build(ROOT / "artifacts" / "tiny-qwen3_5-teacher", "--family", "qwen3_5", "--teacher")


TINY_TOOL_MODEL = ROOT / "artifacts" / "tiny-qwen2-tools"


@pytest.fixture(scope="session")
def tiny_tool_model(tiny_model) -> str:
    """The multi-turn quickstart's policy (tools/make_tiny_model.py --tools: the tiny model fine-tuned on
    calculator episodes mixed with direct answers, ~8 minutes of CPU); built once if absent."""
    if not (TINY_TOOL_MODEL / "megarl_tiny.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--tools", "--base", tiny_model, "--out",
                        str(TINY_TOOL_MODEL), "--quiet"], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return str(TINY_TOOL_MODEL)


@pytest.fixture(scope="session")
def tiny_hint_model(tiny_model) -> str:
    """The self-distillation quickstart's policy (tools/make_tiny_model.py --hints: the tiny model fine-tuned to
    read an answer hint, ~1 minute); built once if absent."""
    return _tiny_build(ROOT / "artifacts" / "tiny-qwen2-hints", "--hints", "--base", tiny_model)


@pytest.fixture(scope="module")
def megatron_rank():
    """Megatron's parallel state over a world of one gloo rank in this process (TP = PP = DP = 1)."""
    import torch.distributed as dist

    from megarl import accelerator

    accelerator.apply_megatron_shims()
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
