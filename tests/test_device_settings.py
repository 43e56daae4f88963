"""What megarl decides by the device it runs on, checked on CPU by passing the device kind: the
dtype/attention check at start, Megatron's fusion switches, the kernels' chunk sizes and their
weight gradient's matmul precision. (The GPU itself runs none of this here.)"""

from __future__ import annotations

import pytest
import torch

from megarl import accelerator, kernels
from megarl.arguments import parse_args
from megarl.models import megatron_gpt


# ------------------------------------------------------------- the check at start ----
@pytest.mark.parametrize("flags,world,named", [
    (["--padding-free"], 1, ["--padding-free"]),
    (["--context-parallel-size", "2", "--padding-free"], 2, ["--padding-free", "--context-parallel-size 2"]),
])
def test_fp32_packed_or_context_parallel_attention_is_refused_with_transformer_engine(flags, world, named):
    args = parse_args(flags, world_size=world)  # this CPU host accepts it (megarl's own packed attention)
    message = accelerator.check_supported(args, on_cuda=True, transformer_engine=True)
    assert message is not None and "\n" not in message
    for word in named + ["--bf16", "float32"]:
        assert word in message, (word, message)
    # What passes: 16-bit parameters; the local spec on a CUDA host without TE (megarl's attention takes
    # packed rows and CP in fp32); a CPU host.
    assert accelerator.check_supported(parse_args(flags + ["--bf16"], world_size=world), on_cuda=True,
                                       transformer_engine=True) is None
    assert accelerator.check_supported(args, on_cuda=True, transformer_engine=False) is None
    assert accelerator.check_supported(args, on_cuda=False) is None


def test_fp32_on_a_gpu_is_warned_about_and_16_bits_or_cpu_are_not():
    fp32, bf16 = parse_args([], world_size=1), parse_args(["--bf16"], world_size=1)
    assert accelerator.check_supported(fp32, on_cuda=True, transformer_engine=True) is None  # runs, slowly
    with_te = accelerator.precision_warning(fp32, on_cuda=True, transformer_engine=True)
    assert "--bf16" in with_te and "unfused attention" in with_te and "\n" not in with_te
    assert "--bf16" in accelerator.precision_warning(fp32, on_cuda=True, transformer_engine=False)
    assert accelerator.precision_warning(bf16, on_cuda=True, transformer_engine=True) is None
    assert accelerator.precision_warning(fp32, on_cuda=False) is None


# ------------------------------------------------------------------ fusions ----
def _tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def test_fusions_by_device_kind():
    names = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
             "apply_rope_fusion", "gradient_accumulation_fusion")
    assert megatron_gpt.fusions(False, False) == dict.fromkeys(names, False)
    # CUDA with Transformer Engine and without Apex's extensions (the project's image)
    bare = megatron_gpt.fusions(True, True, importable=lambda *modules: False)
    assert {name for name, on in bare.items() if on} == {"bias_activation_fusion", "bias_dropout_fusion",
                                                         "apply_rope_fusion"}
    apex = megatron_gpt.fusions(True, False, importable=lambda *modules: True)
    assert {name for name, on in apex.items() if on} == {"bias_activation_fusion", "bias_dropout_fusion",
                                                         "masked_softmax_fusion", "gradient_accumulation_fusion"}


def test_megatron_accepts_the_cuda_fusions_and_refuses_rope_fusion_without_transformer_engine():
    """Megatron's own checks of the switches (TransformerConfig.__post_init__), on the real config of a
    model: the CUDA set without TE validates (SwiGLU fusion with a bias-free GLU MLP); RoPE fusion is
    refused where TE is absent, as on this host, which is why it follows TE."""
    from megatron.core.transformer import TransformerConfig  # noqa: F401  (Megatron importable here)

    hf_config = _tiny_config()
    family = megatron_gpt.family_of(hf_config)
    config = megatron_gpt.transformer_config(hf_config, family, 1, 1, 1, torch.float32,
                                             **megatron_gpt.fusions(True, False, importable=lambda *m: False))
    assert config.bias_activation_fusion and config.bias_dropout_fusion and not config.apply_rope_fusion
    # This host's own config: everything off.
    assert not megatron_gpt.transformer_config(hf_config, family, 1, 1, 1, torch.float32).bias_activation_fusion
    with pytest.raises(ValueError, match="apply_rope_fusion"):
        megatron_gpt.transformer_config(hf_config, family, 1, 1, 1, torch.float32,
                                        **megatron_gpt.fusions(True, True, importable=lambda *m: False))


# -------------------------------------------------------------- chunk sizes ----
def test_chunk_tokens_by_device_kind():
    qwen = 151_936
    # CPU: the tuned values (16 MiB of fp32 rows from logits, 64 MiB from hidden states), whatever H.
    assert kernels.default_chunk_tokens("cpu", qwen) == 27
    assert kernels.default_chunk_tokens("cpu", qwen, hidden_size=3584) == 110
    assert kernels.default_chunk_tokens("cpu", 100, budget=4000) == 10
    # CUDA: whole tensor-core tiles, at least CUDA_MIN_ROWS, more while they fit the budget.
    from_logits = kernels.default_chunk_tokens("cuda", qwen)
    from_hidden = kernels.default_chunk_tokens("cuda", qwen, hidden_size=3584)
    for rows in (from_logits, from_hidden):
        assert rows >= kernels.CUDA_MIN_ROWS and rows % kernels.CUDA_ROW_MULTIPLE == 0
    assert from_logits * 4 * qwen <= kernels.CUDA_CHUNK_BYTES < (from_logits + 128) * 4 * qwen
    assert from_hidden * (12 * qwen + 4 * 3584) <= kernels.CUDA_CHUNK_BYTES
    # a narrow shard (TP=8): the budget gives many more rows; a tiny budget never goes below the floor
    assert kernels.default_chunk_tokens("cuda", qwen // 8) > 8 * kernels.CUDA_MIN_ROWS
    assert kernels.default_chunk_tokens("cuda", qwen, budget=1) == kernels.CUDA_MIN_ROWS


def test_default_chunk_follows_the_tensors_device():
    """The operations pick the chunk from their input's device: on these CPU tensors, CPU's."""
    x, w = torch.zeros(2, 5000), torch.zeros(5000, 8)
    assert kernels._chunk(None, x) == kernels.default_chunk_tokens("cpu", 5000)
    assert kernels._chunk(None, torch.zeros(3, 8), w) == kernels.default_chunk_tokens("cpu", 5000, 8)
    assert kernels._chunk(7, x) == 7


# -------------------------------------------------- weight-gradient precision ----
def test_tf32_matmuls_only_on_cuda_and_restored():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with accelerator.tf32_matmuls("cpu"):
        assert matmul.fp32_precision == before
    with accelerator.tf32_matmuls("cuda"):
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == before
    with pytest.raises(KeyError):
        with accelerator.tf32_matmuls("cuda"):
            raise KeyError("inside")
    assert matmul.fp32_precision == before


# ------------------------------------------------------------ Triton tile sizes ----
def test_topk_kernel_tiles_bound_the_values_per_thread(monkeypatch):
    """The compiled top-k kernels' [BLOCK_V, K_BLOCK] tile: at most TOPK_TILE values, 32 per thread of
    their TOPK_NUM_WARPS warps (4096 x 16 = 512 before), whatever the row width and K; powers of two."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's block widths, not the interpreter's
    from megarl.kernels import triton_ops

    assert triton_ops.TOPK_TILE // (32 * triton_ops.TOPK_NUM_WARPS) <= 32
    for r in (151_936, 18_992, 4096, 130, 5):
        for k in (1, 3, 16, 64, 500):
            blocks, k_block = triton_ops.topk_blocks(r, k)
            assert blocks * k_block <= triton_ops.TOPK_TILE, (r, k)
            assert blocks & (blocks - 1) == 0 and k_block & (k_block - 1) == 0
            assert 16 <= blocks <= triton_ops.block_v(r) and k_block <= triton_ops.MAX_K_BLOCK
    assert triton_ops.topk_blocks(151_936, 64) == (256, 16)
    assert triton_ops.topk_blocks(151_936, 1) == (2048, 2)
    assert triton_ops.block_v(151_936) == triton_ops.MAX_BLOCK_V  # the other kernels keep their width
