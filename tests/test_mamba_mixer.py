"""Mamba-2 mixers on Megatron's MambaMixer (megarl/models/mamba_mixer.py): the chunked scan against the plain
recurrence, and the whole layer against transformers' Nemotron-H mixer (its torch path) with the same weights,
on padded rows and on a packed row; gradients reach every parameter."""

import pytest
import torch

SIZES = dict(hidden=48, heads=8, head_dim=8, groups=2, state=16, conv=4, chunk=8)


def _recurrence(x, a, B, C):
    """h_t = exp(a_t) h_{t-1} + x_t B_t^T; y_t = h_t C_t, one position at a time (the scan's definition)."""
    n, length, heads, dim = x.shape
    h = x.new_zeros(n, heads, dim, B.shape[-1])
    ys = []
    for t in range(length):
        h = torch.exp(a[:, t])[..., None, None] * h + x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize("length,chunk", [(5, 8), (8, 8), (21, 8), (33, 4)])
def test_the_chunked_scan_is_the_recurrence(length, chunk):
    from megarl.models.mamba_mixer import state_space_dual

    generator = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, 3, 4, generator=generator, dtype=torch.float64)
    a = -torch.rand(2, length, 3, generator=generator, dtype=torch.float64) * 2  # decays in (e^-2, 1]
    B, C = (torch.randn(2, length, 3, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = _recurrence(x, a, B, C)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(state_space_dual(x, a, B, C, chunk), expected, rtol=1e-10, atol=1e-10)


def _configs():
    from megatron.core.transformer import TransformerConfig
    from transformers import NemotronHConfig

    s = SIZES
    hf = NemotronHConfig(vocab_size=64, hidden_size=s["hidden"], num_attention_heads=4, num_key_value_heads=2,
                         head_dim=12, intermediate_size=32, mamba_num_heads=s["heads"], mamba_head_dim=s["head_dim"],
                         n_groups=s["groups"], ssm_state_size=s["state"], conv_kernel=s["conv"],
                         chunk_size=s["chunk"], hybrid_override_pattern="M", layer_norm_epsilon=1e-5,
                         use_conv_bias=True, use_bias=False)
    megatron = TransformerConfig(num_layers=1, hidden_size=s["hidden"], num_attention_heads=4, ffn_hidden_size=32,
                                 params_dtype=torch.float32, is_hybrid_model=True, mamba_state_dim=s["state"],
                                 mamba_head_dim=s["head_dim"], mamba_num_groups=s["groups"],
                                 mamba_num_heads=s["heads"], add_bias_linear=False, hidden_dropout=0.0,
                                 attention_dropout=0.0, gradient_accumulation_fusion=False)
    return hf, megatron


@pytest.fixture(scope="module")
def mixers(megatron_rank):
    """transformers' Nemotron-H mixer (random weights, dt not clamped: see the module) and megarl's, with its
    weights copied over (the in_proj's [z, x, B, C, dt] and the conv's [x, B, C] are in the same order at TP 1)."""
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from megarl.models.mamba_mixer import PackedMambaMixer

    hf_config, config = _configs()
    torch.manual_seed(0)
    reference = NemotronHMamba2Mixer(hf_config, layer_idx=0).eval()
    reference.time_step_limit = (0.0, float("inf"))
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
        reference.dt_bias.copy_(torch.rand_like(reference.dt_bias) * 2 - 3)  # dt from ~0.05 to ~0.3
        reference.A_log.copy_(torch.rand_like(reference.A_log))
        reference.norm.weight.add_(1.0)
    mixer = PackedMambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                             layer_number=1)
    mixer.chunk_size = SIZES["chunk"]
    with torch.no_grad():
        for name in ("in_proj.weight", "out_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                     "norm.weight"):
            target = mixer.get_parameter(name)
            source = reference.get_parameter(name)
            assert target.shape == source.shape, name
            target.copy_(source)
    return reference, mixer


def test_the_mixer_is_transformers_nemotron_h_mixer(mixers):
    reference, mixer = mixers
    x = torch.randn(2, 19, SIZES["hidden"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x)
        out, bias = mixer(x.transpose(0, 1).contiguous(), None)
    assert bias is None and expected.abs().max() > 0.05
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-4, atol=2e-5)


def test_a_packed_row_is_each_sequence_alone_and_gradients_reach_every_parameter(mixers):
    from megatron.core.packed_seq_params import PackedSeqParams

    reference, mixer = mixers
    lengths = [7, 12, 3]
    pieces = [torch.randn(1, length, SIZES["hidden"], generator=torch.Generator().manual_seed(length))
              for length in lengths]
    cu = torch.tensor([0, 7, 19, 22], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    row = torch.cat([piece[0] for piece in pieces] + [torch.zeros(2, SIZES["hidden"])]).unsqueeze(1)  # 2 pads
    out, _ = mixer(row, None, packed_seq_params=packed)
    with torch.no_grad():
        alone = torch.cat([reference(piece)[0] for piece in pieces])
    torch.testing.assert_close(out[:22, 0], alone, rtol=1e-4, atol=2e-5)
    assert torch.equal(out[22:], torch.zeros_like(out[22:]))
    mixer.zero_grad()
    out.square().sum().backward()
    for name, parameter in mixer.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().max() > 0, name
